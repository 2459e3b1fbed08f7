//! Verified loads: what each file's bytes must hash to (a [`Manifest`]), and the per-file
//! check the readers feed as bytes land ([`FileCheck`]).
//!
//! A manifest comes from an OpenSSF model-signing signature ([`oms`]), a Hugging Face cache's
//! blob names or digests the caller gives ([`manifest`]). The loaders own every buffer a byte
//! lands in, so the digest is computed there, as the bytes arrive, never by a second read: a
//! reader reports each block it filled ([`FileCheck::landed`]), and whichever thread completes
//! the next bytes in file order hashes them while the other readers go on.

pub mod check;
pub mod manifest;
pub mod oms;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub use check::{FileCheck, Verifier};

/// A hash algorithm a manifest names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    Sha256,
    /// BLAKE2b with a 64-byte digest (model signing's `blake2`, Python's `hashlib.blake2b`).
    Blake2b,
    Blake3,
}

impl Algorithm {
    /// The name manifests use: `sha256`, `blake2`, `blake3`.
    pub fn name(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "sha256",
            Algorithm::Blake2b => "blake2",
            Algorithm::Blake3 => "blake3",
        }
    }

    /// The algorithm a manifest names, `None` for one this crate does not compute.
    pub fn from_name(name: &str) -> Option<Algorithm> {
        match name {
            "sha256" => Some(Algorithm::Sha256),
            "blake2" | "blake2b" => Some(Algorithm::Blake2b),
            "blake3" => Some(Algorithm::Blake3),
            _ => None,
        }
    }

    pub fn digest_len(self) -> usize {
        match self {
            Algorithm::Sha256 | Algorithm::Blake3 => 32,
            Algorithm::Blake2b => 64,
        }
    }

    pub fn hasher(self) -> Hasher {
        match self {
            Algorithm::Sha256 => Hasher::Sha256(Default::default()),
            Algorithm::Blake2b => Hasher::Blake2b(Default::default()),
            Algorithm::Blake3 => Hasher::Blake3(Box::default()),
        }
    }
}

/// A running hash of one of the [`Algorithm`]s.
#[derive(Clone)]
pub enum Hasher {
    Sha256(sha2::Sha256),
    Blake2b(blake2::Blake2b512),
    Blake3(Box<blake3::Hasher>),
}

impl Hasher {
    pub fn update(&mut self, bytes: &[u8]) {
        use sha2::Digest as _;
        match self {
            Hasher::Sha256(h) => h.update(bytes),
            Hasher::Blake2b(h) => h.update(bytes),
            Hasher::Blake3(h) => {
                h.update(bytes);
            }
        }
    }

    pub fn finish(self) -> Digest {
        use sha2::Digest as _;
        match self {
            Hasher::Sha256(h) => Digest { algorithm: Algorithm::Sha256, bytes: h.finalize().to_vec() },
            Hasher::Blake2b(h) => Digest { algorithm: Algorithm::Blake2b, bytes: h.finalize().to_vec() },
            Hasher::Blake3(h) => Digest { algorithm: Algorithm::Blake3, bytes: h.finalize().as_bytes().to_vec() },
        }
    }
}

/// A digest and the algorithm that made it. Shown as `sha256:<hex>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Digest {
    pub algorithm: Algorithm,
    pub bytes: Vec<u8>,
}

impl Digest {
    /// A digest from its algorithm's name and its hex digits; `why` says what is wrong.
    pub fn from_hex(algorithm: &str, hex: &str) -> Result<Digest, String> {
        let algorithm = Algorithm::from_name(algorithm)
            .ok_or_else(|| format!("hash algorithm '{algorithm}' is not supported (sha256, blake2 and blake3 are)"))?;
        let bytes = parse_hex(hex).ok_or_else(|| format!("'{hex}' is not a hex digest"))?;
        if bytes.len() != algorithm.digest_len() {
            return Err(format!(
                "a {} digest is {} hex digits, not {}",
                algorithm.name(),
                algorithm.digest_len() * 2,
                hex.len()
            ));
        }
        Ok(Digest { algorithm, bytes })
    }

    /// `algorithm:hex` (`sha256:…`); a bare 64-digit hex string is a sha256.
    pub fn parse(text: &str) -> Result<Digest, String> {
        match text.split_once(':') {
            Some((algorithm, hex)) => Digest::from_hex(algorithm, hex),
            None => Digest::from_hex("sha256", text),
        }
    }

    pub fn hex(&self) -> String {
        crate::source::hex(&self.bytes)
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.algorithm.name(), self.hex())
    }
}

fn parse_hex(hex: &str) -> Option<Vec<u8>> {
    if hex.len() % 2 != 0 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok()).collect()
}

/// What one file must hash to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    /// A digest of the whole file.
    Whole(Digest),
    /// Digests of byte ranges that tile the file (model signing's `shard` manifests), in order.
    Shards(Vec<Shard>),
}

/// A byte range of a file and its digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub start: u64,
    pub end: u64,
    pub digest: Digest,
}

/// The files of a checkpoint and what each must hash to, by name relative to the checkpoint's
/// directory (`/`-separated).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Manifest {
    pub files: BTreeMap<String, Expected>,
    /// Where the manifest came from, for messages: `model.sig (signed by key.pub)`.
    pub origin: String,
}

impl Manifest {
    /// The entry for a file at `path` (a local path or a URL): the listed name that is the
    /// longest suffix of the path, on `/` boundaries. A manifest names files relative to the
    /// model's directory, wherever that directory is.
    pub fn entry_for(&self, path: &str) -> Option<(&str, &Expected)> {
        self.files
            .iter()
            .filter(|(name, _)| {
                path == name.as_str() || path.strip_suffix(name.as_str()).is_some_and(|head| head.ends_with('/'))
            })
            .max_by_key(|(name, _)| name.len())
            .map(|(name, e)| (name.as_str(), e))
    }
}

/// What a load is verified against, as the Python package describes it (JSON):
/// `{"signature": PATH, "public_key": PATH}` (or `"certificate_chain": [PATH…]`, or
/// `"trusted_root": PATH, "identity": …, "issuer": …`), `{"digests": {NAME: DIGEST}}`, or
/// `{"location": true}` (what the files' location carries: a Hugging Face cache's blob
/// names); each with `"full": bool` and `"complete": bool` (the load is of a directory:
/// every weights file listed at its top must be loaded). `paths` are the load's files.
pub fn verifier_from_spec(spec: &str, paths: &[PathBuf]) -> Result<Verifier> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Spec {
        signature: Option<String>,
        public_key: Option<String>,
        certificate_chain: Option<Vec<String>>,
        trusted_root: Option<String>,
        identity: Option<String>,
        issuer: Option<String>,
        digests: Option<BTreeMap<String, String>>,
        #[serde(default)]
        location: bool,
        #[serde(default)]
        full: bool,
        #[serde(default)]
        complete: bool,
    }
    let bad = |why: String| Error::InvalidArgument(format!("verify=: {why}"));
    let spec: Spec = serde_json::from_str(spec).map_err(|e| bad(e.to_string()))?;
    let manifest = match (spec.signature, spec.digests, spec.location) {
        (Some(signature), None, false) => {
            let trust = match (spec.public_key, spec.certificate_chain, spec.trusted_root) {
                (Some(key), None, None) => oms::Trust::PublicKey(key.into()),
                (None, Some(chain), None) => oms::Trust::CertificateChain(chain.into_iter().map(PathBuf::from).collect()),
                (None, None, Some(root)) => oms::Trust::Sigstore {
                    trusted_root: root.into(),
                    identity: spec.identity.ok_or_else(|| bad("a sigstore signature needs identity=".into()))?,
                    issuer: spec.issuer.ok_or_else(|| bad("a sigstore signature needs issuer=".into()))?,
                },
                _ => {
                    return Err(bad(
                        "a Signature takes one of public_key=, certificate_chain= or trusted_root= (with identity= and issuer=)".into(),
                    ))
                }
            };
            let bundle = read_whole(Path::new(&signature))?;
            oms::read_signature(&bundle, &signature, &trust)?
        }
        (None, Some(digests), false) => manifest::from_digests(&digests)?,
        (None, None, true) => manifest::from_hf_cache(&paths.iter().map(PathBuf::as_path).collect::<Vec<_>>())?,
        _ => return Err(bad("give one of a signature, digests or the location".into())),
    };
    Ok(Verifier { complete: spec.complete, ..Verifier::new(manifest, spec.full) })
}

/// A signature file's bytes, local or at a URL (it is small).
fn read_whole(path: &Path) -> Result<Vec<u8>> {
    const MAX: u64 = 64 << 20;
    if !crate::source::remote::is_url(path) {
        return read_small_file(path, MAX, "a signature");
    }
    let src = crate::source::open(path)?;
    if src.len() > MAX {
        return Err(too_large(path, src.len(), MAX, "a signature"));
    }
    let mut bytes = vec![0u8; src.len() as usize];
    let got = src.read_at(&mut bytes, 0)?;
    bytes.truncate(got);
    Ok(bytes)
}

/// The bytes of a small local file a verification reads whole (`what`: a signature, a key or
/// certificate file): a regular file of at most `max` bytes, refused in one line otherwise. It
/// is opened without waiting (a FIFO is refused, not waited on), checked before anything is
/// read (a device is refused unread) and read no further than `max` bytes (a file that grows
/// as it is read is refused, not followed).
pub(crate) fn read_small_file(path: &Path, max: u64, what: &str) -> Result<Vec<u8>> {
    use std::io::Read as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| Error::io(path, "open", e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, "stat", e))?;
    if !meta.is_file() {
        return Err(Error::NotAFile { path: path.to_owned() });
    }
    if meta.len() > max {
        return Err(too_large(path, meta.len(), max, what));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max + 1).read_to_end(&mut bytes).map_err(|e| Error::io(path, "read", e))?;
    if bytes.len() as u64 > max {
        return Err(too_large(path, bytes.len() as u64, max, what));
    }
    Ok(bytes)
}

fn too_large(path: &Path, len: u64, max: u64, what: &str) -> Error {
    Error::ManifestUnsupported {
        signature: path.display().to_string(),
        why: format!("{len} bytes or more: too large for {what} (at most {max} bytes are read)"),
    }
}

/// What [`verify_tree`] found for one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// Listed in the manifest, not in the directory.
    Missing,
    /// In the directory, not listed.
    Extra,
    /// Its bytes hash to something else (which shard, for a sharded manifest).
    Changed {
        start: u64,
        end: u64,
        expected: String,
        actual: String,
    },
    /// It could not be read.
    Unreadable(String),
}

/// Names a directory's check skips, as model signing does by default: git's own files.
const IGNORED: [&str; 4] = [".git", ".github", ".gitignore", ".gitattributes"];

/// Every file of `dir` against the manifest, weights or not (what `model_signing verify`
/// checks, in one pass over each file, files in parallel): each listed file hashed, each
/// unlisted one reported, `skip` (the signature itself) and git's files left out. Sorted by
/// name.
pub fn verify_tree(dir: &Path, manifest: &Manifest, skip: &[PathBuf]) -> Result<Vec<(String, Verdict)>> {
    use rayon::prelude::*;
    let mut found = Vec::new();
    walk(dir, dir, skip, &mut found)?;
    let listed: std::collections::BTreeSet<&str> = manifest.files.keys().map(String::as_str).collect();
    let mut out: Vec<(String, Verdict)> = found
        .iter()
        .filter(|name| !listed.contains(name.as_str()))
        .map(|name| (name.clone(), Verdict::Extra))
        .collect();
    let present: std::collections::BTreeSet<&str> = found.iter().map(String::as_str).collect();
    let checked: Vec<(String, Verdict)> = crate::source::io_pool().install(|| {
        manifest
            .files
            .par_iter()
            .map(|(name, expected)| {
                let verdict = if present.contains(name.as_str()) {
                    hash_file(&dir.join(name), expected).unwrap_or_else(|e| Verdict::Unreadable(e.to_string()))
                } else {
                    Verdict::Missing
                };
                (name.clone(), verdict)
            })
            .collect()
    });
    out.extend(checked);
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

fn walk(root: &Path, dir: &Path, skip: &[PathBuf], out: &mut Vec<String>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "list", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| Error::io(dir, "list", e))?;
        let path = entry.path();
        let name = entry.file_name();
        if IGNORED.iter().any(|i| name == *i) || skip.iter().any(|s| same_file(s, &path)) {
            continue;
        }
        let kind = entry.file_type().map_err(|e| Error::io(&path, "stat", e))?;
        if kind.is_dir() {
            walk(root, &path, skip, out)?;
        } else {
            let rel = path.strip_prefix(root).unwrap_or(&path);
            out.push(rel.components().map(|c| c.as_os_str().to_string_lossy()).collect::<Vec<_>>().join("/"));
        }
    }
    Ok(())
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (std::fs::canonicalize(a), std::fs::canonicalize(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// One file's digests, read once in order: a [`FileCheck`] fed each chunk as it is read
/// (in order, so hashed at once), whose verdict becomes the file's.
fn hash_file(path: &Path, expected: &Expected) -> Result<Verdict> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).map_err(|e| Error::io(path, "open", e))?;
    let len = file.metadata().map_err(|e| Error::io(path, "stat", e))?.len();
    let check = match FileCheck::new(path, len, expected, "") {
        Ok(check) => check,
        Err(e) => return changed(e),
    };
    let mut buf = vec![0u8; 8 << 20];
    let mut offset = 0;
    while offset < len {
        let want = (len - offset).min(buf.len() as u64) as usize;
        file.read_exact(&mut buf[..want]).map_err(|e| Error::io(path, "read", e))?;
        check.landed_transient(offset, &buf[..want]);
        offset += want as u64;
    }
    check.finish().map_or_else(changed, |()| Ok(Verdict::Ok))
}

/// A digest mismatch as a [`Verdict`]; other errors stay errors.
fn changed(e: Error) -> Result<Verdict> {
    match e {
        Error::DigestMismatch { start, end, expected, actual, .. } => {
            Ok(Verdict::Changed { start, end, expected, actual })
        }
        e => Err(e),
    }
}
