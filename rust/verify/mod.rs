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

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
    /// Paths the signer left out (model_signing's `ignore_paths`), relative to the model's
    /// directory: a check of the directory does not call a file under them extra.
    pub ignored: Vec<String>,
    /// Whether the signer's serialization followed symbolic links (model_signing's
    /// `allow_symlinks`); `None` where the manifest does not say (a v0.1 statement, digests).
    pub allow_symlinks: Option<bool>,
}

impl Manifest {
    /// The entry for a file at `path` (a local path or a URL): the listed name that is the
    /// longest suffix of the path, on `/` boundaries. A manifest names files relative to the
    /// model's directory, wherever that directory is. A URL's query and fragment are not part
    /// of its name (`…/model.safetensors?X-Amz-Signature=…` is `model.safetensors`), and its
    /// percent-escapes are decoded. A signature of a single file (its one name is `.`) names
    /// whichever file is checked against it.
    pub fn entry_for(&self, path: &str) -> Option<(&str, &Expected)> {
        if let Some((name, expected)) = self.files.get_key_value(SINGLE_FILE) {
            return Some((name.as_str(), expected));
        }
        let decoded;
        let path = if crate::source::remote::is_url(Path::new(path)) {
            let end = path.find(['?', '#']).unwrap_or(path.len());
            decoded = percent_encoding::percent_decode_str(&path[..end]).decode_utf8_lossy();
            &*decoded
        } else {
            path
        };
        self.files
            .iter()
            .filter(|(name, _)| {
                path == name.as_str() || path.strip_suffix(name.as_str()).is_some_and(|head| head.ends_with('/'))
            })
            .max_by_key(|(name, _)| name.len())
            .map(|(name, e)| (name.as_str(), e))
    }

    /// Whether the manifest is a signature of one file (model_signing's name for it is `.`).
    pub fn single_file(&self) -> bool {
        self.files.contains_key(SINGLE_FILE)
    }
}

/// The name a model_signing manifest gives the file of a signature of a single file.
pub const SINGLE_FILE: &str = ".";

/// What a load is verified against, as the Python package describes it (JSON):
/// `{"signature": PATH, "public_key": PATH}` (or `"certificate_chain": [PATH…]`, or
/// `"trusted_root": PATH, "identity": …, "issuer": …`), `{"digests": {NAME: DIGEST}}`, or
/// `{"location": true}` (what the files' location carries: a Hugging Face cache's blob
/// names); each with `"full": bool`, `"checkpoints": [PATH…]` (what the load was given,
/// checked as a whole: see [`Verifier::checkpoints`]), and `"allow_symlinks": bool` to
/// follow symbolic links, or not, whatever the signature records (model_signing's
/// `--allow_symlinks`). `paths` are the load's files: where the signature records
/// `allow_symlinks=false`, none may be a link (nor a folder of it the manifest names), and a
/// signature of a single file checks a load of one.
pub fn verifier_from_spec(spec: &str, paths: &[PathBuf]) -> Result<Verifier> {
    let (verifier, options) = parse_spec(spec, paths)?;
    let manifest = &verifier.manifest;
    if manifest.single_file() && paths.len() > 1 {
        return Err(Error::ManifestUnsupported {
            signature: manifest.origin.clone(),
            why: format!(
                "a signature of a single file checks a load of that one file, and this load has {} files",
                paths.len()
            ),
        });
    }
    if !options.allow_symlinks.or(manifest.allow_symlinks).unwrap_or(true) {
        for path in paths {
            if let Some(link) = linked(path, manifest) {
                return Err(Error::NothingToVerify {
                    path: link,
                    why: format!(
                        "a symbolic link, and {} records allow_symlinks=false: model_signing refuses a model with links \
                         in it; pass Signature(..., allow_symlinks=True) to follow them",
                        manifest.origin
                    ),
                });
            }
        }
    }
    Ok(verifier)
}

/// The options of a `verify=` spec beside the manifest: what a directory check leaves out.
#[derive(Debug, Default)]
struct Options {
    allow_symlinks: Option<bool>,
    ignore_paths: Vec<String>,
    ignore_git_paths: bool,
    signature: Option<PathBuf>,
}

fn parse_spec(spec: &str, paths: &[PathBuf]) -> Result<(Verifier, Options)> {
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
        checkpoints: Vec<String>,
        allow_symlinks: Option<bool>,
        /// A directory check's: paths relative to the directory not to report.
        #[serde(default)]
        ignore_paths: Vec<String>,
        /// A directory check's: whether git's files at its top are left out (model_signing's
        /// default).
        ignore_git_paths: Option<bool>,
    }
    let bad = |why: String| Error::InvalidArgument(format!("verify=: {why}"));
    let spec: Spec = serde_json::from_str(spec).map_err(|e| bad(e.to_string()))?;
    let options = Options {
        allow_symlinks: spec.allow_symlinks,
        ignore_paths: spec.ignore_paths,
        ignore_git_paths: spec.ignore_git_paths.unwrap_or(true),
        signature: spec.signature.as_ref().map(PathBuf::from),
    };
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
    let checkpoints = spec.checkpoints.into_iter().map(PathBuf::from).collect();
    Ok((Verifier { checkpoints, ..Verifier::new(manifest, spec.full) }, options))
}

/// The first symbolic link among `path` and the folders above it that the manifest's name for
/// it covers (`sub/model.safetensors`: the file and `sub`), if any. URLs have none.
fn linked(path: &Path, manifest: &Manifest) -> Option<PathBuf> {
    if crate::source::remote::is_url(path) {
        return None;
    }
    let (name, _) = manifest.entry_for(&path.to_string_lossy())?;
    let depth = if name == SINGLE_FILE { 1 } else { name.split('/').count() };
    path.ancestors()
        .take(depth)
        .find(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink()))
        .map(Path::to_owned)
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
    use crate::source::Source as _;
    use std::io::Read as _;
    let file = crate::source::LocalFile::open(path)?;
    if file.len() > max {
        return Err(too_large(path, file.len(), max, what));
    }
    let mut bytes = Vec::with_capacity(file.len() as usize);
    file.file().take(max + 1).read_to_end(&mut bytes).map_err(|e| Error::io(path, "read", e))?;
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
    /// A symbolic link, where links are not followed.
    Symlink,
}

/// Each file's name and verdict.
pub type Verdicts = Vec<(String, Verdict)>;

/// Git's files at the top of a model, which model_signing leaves out by default.
const GIT_PATHS: [&str; 4] = [".git", ".gitattributes", ".github", ".gitignore"];

/// How [`verify_tree`] walks a model, beside the manifest: model_signing's verify options.
#[derive(Debug, Clone, Default)]
pub struct TreeRules {
    /// Paths relative to the model's directory that are not reported when the manifest does
    /// not list them (a directory: everything under it).
    pub ignored: Vec<String>,
    /// Files left out, wherever they are: the signature itself.
    pub skip: Vec<PathBuf>,
    /// Whether symbolic links are followed (else each is reported, not read).
    pub allow_symlinks: bool,
}

/// The manifest `spec` names (as [`verifier_from_spec`] reads it), the rules of a check of the
/// model at `root` against it (the spec's `ignore_paths`, those the signature records, the
/// signature itself, git's files unless `ignore_git_paths` is false, links as `allow_symlinks`
/// or the signature says), and the verdicts of that check.
pub fn verify_tree_spec(root: &Path, spec: &str) -> Result<(Arc<Manifest>, Verdicts)> {
    let (verifier, options) = parse_spec(spec, &[])?;
    let manifest = verifier.manifest;
    let mut ignored: Vec<String> =
        options.ignore_paths.iter().chain(&manifest.ignored).filter_map(|p| relative_name(p)).collect();
    if options.ignore_git_paths {
        ignored.extend(GIT_PATHS.iter().map(|p| p.to_string()));
    }
    let rules = TreeRules {
        ignored,
        skip: options.signature.into_iter().collect(),
        allow_symlinks: options.allow_symlinks.or(manifest.allow_symlinks).unwrap_or(true),
    };
    let verdicts = verify_tree(root, &manifest, &rules)?;
    Ok((manifest, verdicts))
}

/// A path relative to the model's directory as a manifest name (`./sub//x` is `sub/x`, `.` the
/// whole model); `None` for one outside it.
fn relative_name(path: &str) -> Option<String> {
    if path.starts_with('/') {
        return None;
    }
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty() && *p != ".").collect();
    if parts.contains(&"..") {
        return None;
    }
    Some(if parts.is_empty() { SINGLE_FILE.to_owned() } else { parts.join("/") })
}

/// Whether `name` is `path` or under it.
fn under(name: &str, path: &str) -> bool {
    path == SINGLE_FILE || name == path || name.strip_prefix(path).is_some_and(|rest| rest.starts_with('/'))
}

/// Every file of the model at `root` against the manifest, weights or not (what
/// `model_signing verify` checks, in one pass over each file, files in parallel): each listed
/// file hashed, each unlisted one reported unless `rules` leave it out, each link reported
/// where links are not followed. A file the manifest lists is checked whatever the rules say
/// (a signed `.git/HEAD` too). `root` is a directory, or the file of a signature of a single
/// file (named `.` in the manifest, by its own name in the verdicts). Sorted by name.
pub fn verify_tree(root: &Path, manifest: &Manifest, rules: &TreeRules) -> Result<Verdicts> {
    use rayon::prelude::*;
    let listed: BTreeSet<&str> = manifest.files.keys().map(String::as_str).collect();
    let mut walk = Walk { rules, listed: &listed, found: BTreeMap::new(), links: Vec::new(), dirs: Vec::new() };
    let is_dir = std::fs::metadata(root).map_err(|e| Error::io(root, "stat", e))?.is_dir();
    if is_dir {
        walk.dir(root, "")?;
    } else {
        walk.found.insert(SINGLE_FILE.to_owned(), root.to_owned());
    }
    let Walk { found, links, .. } = walk;
    let mut out: Vec<(String, Verdict)> = links.into_iter().map(|name| (name, Verdict::Symlink)).collect();
    out.extend(found.keys().filter(|name| !listed.contains(name.as_str())).map(|name| (name.clone(), Verdict::Extra)));
    let refused: BTreeSet<&str> = out.iter().map(|(name, _)| name.as_str()).collect();
    let checked: Vec<(String, Verdict)> = crate::source::io_pool().install(|| {
        manifest
            .files
            .par_iter()
            .filter(|(name, _)| !refused.contains(name.as_str()))
            .map(|(name, expected)| {
                let verdict = match found.get(name) {
                    Some(path) => hash_file(path, expected).unwrap_or_else(|e| Verdict::Unreadable(e.to_string())),
                    None => Verdict::Missing,
                };
                (name.clone(), verdict)
            })
            .collect()
    });
    out.extend(checked);
    // The file of a signature of a single file, by the name it has here.
    if let Some(shown) = root.file_name().filter(|_| !is_dir) {
        out.iter_mut()
            .filter(|(name, _)| name == SINGLE_FILE)
            .for_each(|(name, _)| *name = shown.to_string_lossy().into());
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// A walk of a model's directory.
struct Walk<'a> {
    rules: &'a TreeRules,
    listed: &'a BTreeSet<&'a str>,
    /// Files found (not links refused), by name.
    found: BTreeMap<String, PathBuf>,
    /// Links found where links are not followed.
    links: Vec<String>,
    /// The directories being walked (the current one and those above it), resolved: a link to
    /// one of them is not followed into a loop.
    dirs: Vec<PathBuf>,
}

impl Walk<'_> {
    fn dir(&mut self, dir: &Path, prefix: &str) -> Result<()> {
        let resolved = std::fs::canonicalize(dir).map_err(|e| Error::io(dir, "resolve", e))?;
        if self.dirs.contains(&resolved) {
            return Ok(()); // a link to a folder it is in
        }
        self.dirs.push(resolved);
        let walked = self.entries(dir, prefix);
        self.dirs.pop();
        walked
    }

    fn entries(&mut self, dir: &Path, prefix: &str) -> Result<()> {
        let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "list", e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(dir, "list", e))?;
            let path = entry.path();
            let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
            // Left out unless the manifest lists it, or something under it.
            let wanted = self.listed.contains(name.as_str())
                || self.listed.iter().any(|l| l.strip_prefix(name.as_str()).is_some_and(|r| r.starts_with('/')));
            let left_out = self.rules.ignored.iter().any(|i| under(&name, i))
                || self.rules.skip.iter().any(|s| same_file(s, &path));
            if left_out && !wanted {
                continue;
            }
            let mut kind = entry.file_type().map_err(|e| Error::io(&path, "stat", e))?;
            if kind.is_symlink() {
                if !self.rules.allow_symlinks {
                    self.links.push(name);
                    continue;
                }
                // A dangling link stays a link: unreadable when listed, extra if not.
                if let Ok(meta) = std::fs::metadata(&path) {
                    kind = meta.file_type();
                }
            }
            if kind.is_dir() {
                self.dir(&path, &format!("{name}/"))?;
            } else {
                self.found.insert(name, path);
            }
        }
        Ok(())
    }
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
    use crate::source::Source as _;
    use std::io::Read;
    // Opened without waiting, regular files only: a FIFO is refused, not waited on.
    let local = crate::source::LocalFile::open(path)?;
    let (mut file, len) = (local.file(), local.len());
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory of its own for one test.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fst-verify-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch directory");
        dir
    }

    fn fifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    }

    fn sha(bytes: &[u8]) -> String {
        let mut h = Algorithm::Sha256.hasher();
        h.update(bytes);
        h.finish().to_string()
    }

    #[test]
    fn trust_files_are_regular_files_of_bounded_size_read_without_waiting() {
        let dir = scratch("trust");
        std::fs::write(dir.join("key.pub"), b"0123456789").expect("write");
        assert_eq!(read_small_file(&dir.join("key.pub"), 10, "a key").expect("read"), b"0123456789");
        // One byte over the limit: refused, naming the file and the limit.
        let e = read_small_file(&dir.join("key.pub"), 9, "a key").expect_err("too large").to_string();
        assert_eq!(
            e,
            format!(
                "{}: 10 bytes or more: too large for a key (at most 9 bytes are read)",
                dir.join("key.pub").display()
            )
        );
        // A FIFO with no writer: refused at once (a blocking open would wait for a writer forever).
        fifo(&dir.join("fifo.pub"));
        let e = read_small_file(&dir.join("fifo.pub"), 1 << 20, "a key").expect_err("a FIFO");
        assert_eq!(e.to_string(), format!("{}: not a regular file", dir.join("fifo.pub").display()));
        // A device that never ends, and a directory: refused before a byte is read.
        for path in [Path::new("/dev/zero"), dir.as_path()] {
            let e = read_small_file(path, 1 << 20, "a key").expect_err("not a file");
            assert_eq!(e.to_string(), format!("{}: not a regular file", path.display()));
        }
        let e = read_small_file(&dir.join("missing.pub"), 1 << 20, "a key").expect_err("missing");
        assert!(matches!(e, Error::NotFound { .. }), "{e}");
        // A signature too: read_whole takes the same path for local files.
        let e = read_whole(&dir.join("fifo.pub")).expect_err("a FIFO signature");
        assert_eq!(e.to_string(), format!("{}: not a regular file", dir.join("fifo.pub").display()));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    /// `files` (name, bytes) written under `dir`, and digests of those named in `listed`.
    fn model(dir: &Path, files: &[(&str, &[u8])], listed: &[&str]) -> Manifest {
        for (name, bytes) in files {
            let path = dir.join(name);
            std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
            std::fs::write(path, bytes).expect("write");
        }
        let digests = files.iter().filter(|(n, _)| listed.contains(n)).map(|(n, b)| (n.to_string(), sha(b))).collect();
        manifest::from_digests(&digests).expect("digests")
    }

    fn verdicts(dir: &Path, manifest: &Manifest, rules: &TreeRules) -> Vec<(String, Verdict)> {
        verify_tree(dir, manifest, rules).expect("walk")
    }

    fn names(verdicts: &[(String, Verdict)], want: &Verdict) -> Vec<String> {
        verdicts.iter().filter(|(_, v)| v == want).map(|(n, _)| n.clone()).collect()
    }

    #[test]
    fn a_directory_check_leaves_out_ignored_and_git_paths_but_checks_every_listed_file() {
        let dir = scratch("tree");
        let files: [(&str, &[u8]); 8] = [
            ("a.safetensors", b"a"),
            (".git/HEAD", b"ref: main"),
            (".git/config", b"[core]"),
            ("sub/.git/x", b"x"),
            ("ignore-me", b"i"),
            ("logs/run1.txt", b"r"),
            ("sub/b.txt", b"b"),
            ("model.sig", b"{}"),
        ];
        let manifest = model(&dir, &files, &["a.safetensors", ".git/HEAD", "sub/b.txt"]);
        let git: Vec<String> = GIT_PATHS.iter().map(|p| p.to_string()).collect();
        let rules = TreeRules {
            ignored: [vec!["ignore-me".into(), "logs".into()], git].concat(),
            skip: vec![dir.join("model.sig")],
            allow_symlinks: false,
        };
        let got = verdicts(&dir, &manifest, &rules);
        // git's files at the top and the ignored paths are not extra; a listed .git/HEAD is
        // checked; git's names below the top are the model's own (model_signing reports them).
        assert_eq!(names(&got, &Verdict::Ok), [".git/HEAD", "a.safetensors", "sub/b.txt"]);
        assert_eq!(names(&got, &Verdict::Extra), ["sub/.git/x"]);
        // An edited ignored file changes nothing; an edited listed one under an ignored path does.
        std::fs::write(dir.join("ignore-me"), b"edited").expect("write");
        std::fs::write(dir.join(".git/HEAD"), b"ref: other").expect("write");
        let got = verdicts(&dir, &manifest, &rules);
        assert!(matches!(&got[0], (n, Verdict::Changed { .. }) if n == ".git/HEAD"), "{got:?}");
        assert_eq!(got.len(), 4);
        // Without the rules, every unlisted file is extra.
        let got = verdicts(&dir, &manifest, &TreeRules { allow_symlinks: true, ..TreeRules::default() });
        assert_eq!(
            names(&got, &Verdict::Extra),
            [".git/config", "ignore-me", "logs/run1.txt", "model.sig", "sub/.git/x"]
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn links_are_reported_where_the_signature_does_not_allow_them() {
        let dir = scratch("links");
        let manifest = model(&dir, &[("a.bin", b"a"), ("real/b.bin", b"b")], &["a.bin", "real/b.bin"]);
        let mut manifest = Manifest { files: manifest.files, ..Manifest::default() };
        manifest.files.insert("link.bin".into(), manifest.files["a.bin"].clone());
        manifest.files.insert("linked/b.bin".into(), manifest.files["real/b.bin"].clone());
        std::os::unix::fs::symlink("a.bin", dir.join("link.bin")).expect("link");
        std::os::unix::fs::symlink("real", dir.join("linked")).expect("link");
        let refused = TreeRules { allow_symlinks: false, ..TreeRules::default() };
        let got = verdicts(&dir, &manifest, &refused);
        assert_eq!(names(&got, &Verdict::Symlink), ["link.bin", "linked"]);
        assert_eq!(names(&got, &Verdict::Missing), ["linked/b.bin"]);
        let followed = TreeRules { allow_symlinks: true, ..TreeRules::default() };
        let got = verdicts(&dir, &manifest, &followed);
        assert!(got.iter().all(|(_, v)| *v == Verdict::Ok), "{got:?}");
        // A link back up the tree is walked once, not forever.
        std::os::unix::fs::symlink("..", dir.join("real/up")).expect("link");
        assert_eq!(verdicts(&dir, &manifest, &followed).len(), 4);
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn a_listed_fifo_is_refused_not_waited_on() {
        let dir = scratch("fifo-tree");
        let manifest = model(&dir, &[("a.bin", b"a")], &["a.bin"]);
        std::fs::remove_file(dir.join("a.bin")).expect("rm");
        fifo(&dir.join("a.bin"));
        let got = verdicts(&dir, &manifest, &TreeRules::default());
        assert_eq!(
            got,
            [("a.bin".into(), Verdict::Unreadable(format!("{}: not a regular file", dir.join("a.bin").display())))]
        );
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn a_signature_of_a_single_file_checks_that_file_by_its_own_name() {
        let dir = scratch("single");
        std::fs::write(dir.join("w.bin"), b"weights").expect("write");
        let manifest = Manifest {
            files: BTreeMap::from([(
                SINGLE_FILE.to_owned(),
                Expected::Whole(Digest::parse(&sha(b"weights")).expect("digest")),
            )]),
            ..Manifest::default()
        };
        assert_eq!(verdicts(&dir.join("w.bin"), &manifest, &TreeRules::default()), [("w.bin".into(), Verdict::Ok)]);
        // A directory is not the file: model_signing finds `.` missing and the files extra.
        let got = verdicts(&dir, &manifest, &TreeRules::default());
        assert_eq!(got, [(".".into(), Verdict::Missing), ("w.bin".into(), Verdict::Extra)]);
        // A load: any one file is checked against it, never two.
        assert_eq!(manifest.entry_for("/x/w.bin").map(|(n, _)| n), Some("."));
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    fn oms(name: &str) -> String {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/oms").join(name).display().to_string()
    }

    #[test]
    fn loads_through_links_are_refused_where_the_signature_records_allow_symlinks_false() {
        let dir = scratch("load-links");
        let model = Path::new(&oms("model")).to_owned();
        std::fs::create_dir_all(dir.join("m/real")).expect("mkdir");
        std::os::unix::fs::symlink(model.join("model.safetensors"), dir.join("m/model.safetensors")).expect("link");
        std::fs::copy(model.join("config.json"), dir.join("m/config.json")).expect("copy");
        std::fs::copy(model.join("sub/notes.txt"), dir.join("m/real/notes.txt")).expect("copy");
        std::os::unix::fs::symlink("real", dir.join("m/sub")).expect("link");
        let spec = |extra: &str| {
            format!(r#"{{"signature": "{}", "public_key": "{}"{extra}}}"#, oms("key.sig"), oms("key.pub"))
        };
        for (path, link) in [("m/model.safetensors", "m/model.safetensors"), ("m/sub/notes.txt", "m/sub")] {
            let e = verifier_from_spec(&spec(""), &[dir.join(path)]).expect_err("a link").to_string();
            assert!(e.starts_with(&format!("{}: a symbolic link, and ", dir.join(link).display())), "{e}");
            assert!(e.contains("records allow_symlinks=false"), "{e}");
            verifier_from_spec(&spec(r#", "allow_symlinks": true"#), &[dir.join(path)]).expect("links followed");
        }
        // Links above the model's directory are not the model's.
        verifier_from_spec(&spec(""), &[dir.join("m/config.json")]).expect("no link");
        std::fs::remove_dir_all(&dir).expect("clean up");
    }
}
