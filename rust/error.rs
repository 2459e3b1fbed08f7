//! The crate's error type. Every variant names the file (and tensor) it is about, because a
//! user loading a 30-file checkpoint needs to know which file to look at.

use std::fmt;
use std::path::PathBuf;

use crate::format::FormatError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file breaks the safetensors format.
    #[error("{}: {source}", .path.display())]
    Format { path: PathBuf, source: FormatError },
    /// An operating-system call on the file failed.
    #[error("{}: {op} failed: {source}", .path.display())]
    Io { path: PathBuf, op: &'static str, source: std::io::Error },
    /// There is nothing at the path (in safetensors' words, which code written for it matches).
    #[error("No such file or directory: {}", .path.display())]
    NotFound { path: PathBuf },
    /// The path is a directory, device or pipe rather than a regular file.
    #[error("{}: not a regular file", .path.display())]
    NotAFile { path: PathBuf },
    /// The file ended before the bytes its header promises (it changed while being read).
    #[error("{}: file ended at byte {at}, but its header says it holds {expected} bytes (was it truncated while loading?)", .path.display())]
    Truncated { path: PathBuf, at: u64, expected: u64 },
    /// The file's size or modification time changed while it was being loaded.
    #[error("{}: file changed while it was being loaded ({len} bytes when opened, {now} now); load it again once it is complete", .path.display())]
    Changed { path: PathBuf, len: u64, now: u64 },
    /// A single-file operation (`safe_open`, `keys`, `metadata`) was given a directory.
    #[error("{}: is a directory, but safe_open, keys() and metadata() read one .safetensors file: pass one of its files, or load the whole checkpoint with load()/load_file()", .path.display())]
    IsDirectory { path: PathBuf },
    /// A directory given to a load holds no `*.safetensors` file and no index.
    #[error("{}: no *.safetensors files and no *.safetensors.index.json in this directory (subdirectories are not searched)", .dir.display())]
    NoCheckpointFiles { dir: PathBuf },
    /// A directory given to a load holds several indexes, so which checkpoint is meant is unclear.
    #[error("{}: holds several checkpoint indexes ({}): pass the one to load instead of the directory", .dir.display(), .names.join(", "))]
    SeveralIndexes { dir: PathBuf, names: Vec<String> },
    /// A checkpoint index cannot be read as one.
    #[error("{}: not a safetensors checkpoint index: {reason}", .path.display())]
    InvalidIndex { path: PathBuf, reason: String },
    /// A checkpoint's files disagree with its index or with each other.
    #[error("{}: {problem}{}", .path.display(), more_problems(*.more, .path))]
    Checkpoint { path: PathBuf, problem: Problem, more: usize },
    /// An environment setting of the loader is malformed.
    #[error("{var}='{value}' is not valid: expected {expected} (or unset it for the default)")]
    InvalidSetting { var: &'static str, value: String, expected: &'static str },
    /// The load would allocate more host memory than allowed or available.
    #[error("loading needs {needed} bytes of host memory but {limit} bytes are {why}; set FASTSAFETENSORS_MAX_HOST_MEMORY (e.g. 64G) or load fewer files at once")]
    OutOfMemory { needed: u64, limit: u64, why: &'static str },
    /// Two files hold a tensor of the same name.
    #[error("tensor '{name}' is in both {} and {}", .first.display(), .second.display())]
    DuplicateTensor { name: String, first: PathBuf, second: PathBuf },
    /// A checkpoint file's name is not UTF-8, so it cannot be reported to the caller.
    #[error("{}: the path is not UTF-8, and fastsafetensors_rs takes UTF-8 paths only: rename the file, or link to it under a UTF-8 name", escaped(.path))]
    NotUtf8 { path: PathBuf },
    /// A file was given twice to one load.
    #[error("{}: given twice: pass each file once", .path.display())]
    FileGivenTwice { path: PathBuf },
    /// A tensor asked for by name (rows of it, say) is in none of the files.
    #[error("{}: no tensor named '{name}'", files_list(.files))]
    NoSuchTensor { name: String, files: Vec<PathBuf> },
    /// Names an exact `tensor_filter` asked for that are in none of the files.
    #[error("{}", missing_message(.names, .files))]
    MissingTensors { names: Vec<String>, files: Vec<PathBuf> },
    /// The CUDA driver is missing, has no such device, or failed a call.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// GPUDirect Storage was required (`nogds=False`) but could not read the file.
    #[error("{}: GPUDirect Storage was required but failed: {reason}", .path.display())]
    GdsRequired { path: PathBuf, reason: String },
    /// An option the loader does not know.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// `device=` names no device, or one this loader does not load to.
    #[error("fastsafetensors: cannot load to device '{device}'{why}")]
    InvalidDevice { device: String, why: &'static str },
    /// The target device cannot be used (no driver, no device).
    #[error("fastsafetensors: cannot load to {device}: {reason}")]
    DeviceUnavailable { device: String, reason: String },
    /// `dtype=` names a type the loader does not cast to.
    #[error("fastsafetensors: dtype={dtype} is not supported: dtype= casts floating-point tensors (F16, BF16, F32, F64) to torch.float16, torch.bfloat16, torch.float32 or torch.float64 and leaves the others as stored; convert to {dtype} yourself (tensor.to({dtype})) if that is what you want")]
    UnsupportedCast { dtype: String },
    /// A tensor torch has no way to hold.
    #[error("{}: tensor '{name}': {why}", .path.display())]
    Unrepresentable { path: PathBuf, name: String, why: String },
    /// A URL that names no object this loader can read.
    #[error("{url}: not a URL this loader reads: {reason}")]
    InvalidUrl { url: String, reason: String },
    /// The store's configuration cannot be used (an AWS profile that is missing, malformed, or
    /// gets its credentials through a process this loader does not run).
    #[error("{url}: {reason}")]
    RemoteConfig { url: String, reason: String },
    /// The object, or its bucket, is not there (HTTP 404).
    #[error("{url}: no such {what} (HTTP 404): check the URL, and that the object was uploaded")]
    RemoteNotFound { url: String, what: &'static str },
    /// The store refused the credentials, or they do not allow reading the object (HTTP 401/403).
    #[error("{url}: access denied ({code}): check the credentials the environment gives (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY, ...) and that they may read this object")]
    RemoteDenied { url: String, code: String },
    /// No credentials were found for the store.
    #[error("{url}: no credentials found: set them in the environment (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_ACCOUNT_KEY, ...), or AWS_SKIP_SIGNATURE=true for a public bucket")]
    RemoteNoCredentials { url: String },
    /// The object was replaced after its header was read: its bytes would mix two versions.
    #[error("{url}: the object changed while it was being loaded (it is no longer the version whose header was read); load it again once it is complete")]
    RemoteChanged { url: String },
    /// The load was given up (its stream closed, its handle cancelled) while this read waited.
    #[error("{}: the read was cancelled (the load was closed or interrupted)", .path.display())]
    Cancelled { path: PathBuf },
    /// The server answered in a way the loader cannot use (and retrying would not change).
    #[error("{url}: {reason}")]
    RemoteAnswer { url: String, reason: String },
    /// A request for an object failed after its retries (unreachable host, timeout, server error).
    #[error("{url}: {detail} (FASTSAFETENSORS_REMOTE_RETRIES and FASTSAFETENSORS_REMOTE_TIMEOUT set how long a request is retried)")]
    Remote { url: String, detail: String },
    /// The keeper of kept weights cannot be used (its directory is unsafe, none is running for
    /// a command to it, or it refused a request).
    #[error("keep: {0}")]
    Keep(String),
    /// A panic inside the loader, caught before it could cross the FFI boundary. Always a bug.
    #[error("internal error (please report): {0}")]
    Panic(String),
    /// Another error's message, with the credentials of the URLs in it removed.
    #[error("{0}")]
    Redacted(String),
    /// A signature's envelope does not verify with the key, certificate or identity given.
    #[error("{signature}: signature does not verify: {why}")]
    SignatureInvalid { signature: String, why: String },
    /// A signature or manifest of a kind, version or algorithm this loader does not check.
    #[error("{signature}: {why}")]
    ManifestUnsupported { signature: String, why: String },
    /// Verification was asked for, but there is nothing to verify against.
    #[error("{}: {why}", .path.display())]
    NothingToVerify { path: PathBuf, why: String },
    /// A file of the load is not among the files the manifest lists.
    #[error("{}: not listed in {manifest}: its bytes cannot be verified", .path.display())]
    NotInManifest { path: PathBuf, manifest: String },
    /// A weights file the manifest lists is not in the directory loaded.
    #[error("{}: listed in {manifest}, but not in the directory loaded", .path.display())]
    NotLoaded { path: PathBuf, manifest: String },
    /// A file's bytes do not hash to what the manifest says.
    #[error("{}: digest mismatch (bytes {start}..{end}): expected {expected}, got {actual} ({manifest})", .path.display())]
    DigestMismatch { path: PathBuf, start: u64, end: u64, expected: String, actual: String, manifest: String },
    /// A load that reads part of a file cannot check a digest of the whole file.
    #[error("{}: {manifest} has a digest of the whole file, but this load reads only part of it: pass full=True to the Signature or Digests (or verify=\"full\" for verify=True) to read the rest and check it, or load the whole file", .path.display())]
    PartialVerify { path: PathBuf, manifest: String },
    /// Bytes under a digest were read only in part (or the header's were not read), so the
    /// digest could not be checked.
    #[error("{}: bytes {start}..{end} have one digest in {manifest}, and this load read them only in part: it checks every digest covering the bytes it hands out and the header", .path.display())]
    UncheckedBytes { path: PathBuf, start: u64, end: u64, manifest: String },
    /// Bytes that landed twice (two reads sharing a page) are not the same in both copies.
    #[error("{}: bytes {start}..{end} were read twice and the copies {why}", .path.display())]
    CopiesDiffer { path: PathBuf, start: u64, end: u64, why: String },
    /// A tensor handed to a save that safetensors cannot store as it is.
    #[error("tensor '{name}' cannot be saved: {why}")]
    SaveRefused { name: String, why: String },
}

/// "tensor_filter names 2 tensors that are in none of the files (a, b): 'x', 'y'", with at
/// most a few of the files and names spelled out.
fn missing_message(names: &[String], files: &[PathBuf]) -> String {
    const SHOWN: usize = 20;
    let mut listed: Vec<String> = names.iter().take(SHOWN).map(|n| format!("'{n}'")).collect();
    if names.len() > SHOWN {
        listed.push(format!("and {} more", names.len() - SHOWN));
    }
    let where_ = files_list(files);
    let (count, noun) = (names.len(), if names.len() == 1 { "tensor" } else { "tensors" });
    format!("tensor_filter names {count} {noun} that are in none of the files ({where_}): {}", listed.join(", "))
}

/// `path` with each byte that is not UTF-8 written `\xNN`, as Python's "backslashreplace" does.
fn escaped(path: &std::path::Path) -> String {
    let mut out = String::new();
    for chunk in path.as_os_str().as_encoded_bytes().utf8_chunks() {
        out.push_str(chunk.valid());
        chunk.invalid().iter().for_each(|b| out.push_str(&format!("\\x{b:02x}")));
    }
    out
}

/// "a, b, c and 2 more": the files an error is about.
fn files_list(files: &[PathBuf]) -> String {
    let mut out = files.iter().take(3).map(|f| f.display().to_string()).collect::<Vec<_>>().join(", ");
    if files.len() > 3 {
        out.push_str(&format!(" and {} more", files.len() - 3));
    }
    out
}

fn more_problems(more: usize, path: &std::path::Path) -> String {
    match more {
        0 => String::new(),
        n => format!(" (and {n} more; `python -m fastsafetensors_rs verify {}` lists them all)", path.display()),
    }
}

impl Error {
    /// The error for a caught panic, with its message.
    pub(crate) fn from_panic(payload: Box<dyn std::any::Any + Send>) -> Error {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        Error::Panic(msg)
    }

    pub(crate) fn io(path: impl Into<PathBuf>, op: &'static str, source: std::io::Error) -> Error {
        match (op, source.kind()) {
            ("open", std::io::ErrorKind::NotFound) => Error::NotFound { path: path.into() },
            _ => Error::Io { path: path.into(), op, source },
        }
    }

    /// This error, or where its message names a URL with a user name, a password or a query
    /// string (a presigned URL's signature), its message without them ([`redact`]).
    pub fn redacted(self) -> Error {
        let message = self.to_string();
        let clean = redact(&message);
        if clean == message {
            self
        } else {
            Error::Redacted(clean)
        }
    }
}

/// `url` as errors and logs show it: without its query string or fragment, which may hold a
/// signature, nor the user name and password before its host.
pub fn shown(url: &str) -> String {
    let url = url.split(['?', '#']).next().unwrap_or(url);
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let host_end = rest.find('/').unwrap_or(rest.len());
            match rest[..host_end].rfind('@') {
                Some(at) => format!("{scheme}://{}", &rest[at + 1..]),
                None => url.to_owned(),
            }
        }
        None => url.to_owned(),
    }
}

/// `text` with every URL in it (`scheme://...`, up to a space or a quote) stripped of its
/// `user:password@` and its query string and fragment (punctuation that ends the URL's word,
/// such as the `:` before an error's reason, is kept).
pub fn redact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let word_end = rest[at..]
            .find(|c: char| c.is_whitespace() || matches!(c, '\'' | '"' | '<' | '>' | '`'))
            .map_or(rest.len(), |i| at + i);
        let word = &rest[at + 3..word_end];
        out.push_str(&rest[..at + 3]);
        let authority_end = word.find(['/', '?', '#']).unwrap_or(word.len());
        let host_start = word[..authority_end].rfind('@').map_or(0, |i| i + 1);
        let kept = &word[host_start..];
        match kept.find(['?', '#']) {
            Some(q) => {
                out.push_str(&kept[..q]);
                let tail = kept[q..].len() - kept[q..].trim_end_matches([':', ',', ';', '.', ')']).len();
                out.push_str(&kept[kept.len() - tail..]);
            }
            None => out.push_str(kept),
        }
        rest = &rest[word_end..];
    }
    out.push_str(rest);
    out
}

/// A disagreement between a checkpoint's files and its index, or between its files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Problem {
    /// The index lists a shard that is not there.
    MissingShard { shard: String, reason: String },
    /// Two files hold a tensor of the same name.
    Duplicate { name: String, first: PathBuf, second: PathBuf },
    /// The index maps a tensor to one shard, but another shard holds it.
    WrongShard { name: String, listed: String, found: PathBuf },
    /// The index maps a tensor that no shard holds.
    NotInShards { name: String, listed: String },
    /// A shard holds a tensor the index does not list.
    Unlisted { name: String, file: PathBuf },
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Problem::MissingShard { shard, reason } => write!(f, "lists shard {shard}, which {reason}"),
            Problem::Duplicate { name, first, second } => {
                write!(f, "tensor '{name}' is in both {} and {}", first.display(), second.display())
            }
            Problem::WrongShard { name, listed, found } => {
                write!(f, "maps '{name}' to {listed}, but it is in {}", found.display())
            }
            Problem::NotInShards { name, listed } => {
                write!(f, "maps '{name}' to {listed}, but none of the shards it lists has it")
            }
            Problem::Unlisted { name, file } => write!(f, "does not list tensor '{name}' of {}", file.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_in_messages_lose_their_credentials_and_queries() {
        let cases = [
            (
                "https://u:pw@h:8/m.safetensors?X-Amz-Signature=ab12: no such object",
                "https://h:8/m.safetensors: no such object",
            ),
            ("s3://b/k?versionId=1, and 'http://a@h/x#f' too", "s3://b/k, and 'http://h/x' too"),
            ("GET http://h/x?sig=1 failed (403)", "GET http://h/x failed (403)"),
            ("no url here: a@b?c", "no url here: a@b?c"),
            ("gs://b/dir@2/k.safetensors: fine", "gs://b/dir@2/k.safetensors: fine"),
            ("end http://u@h/?q", "end http://h/"),
        ];
        for (text, want) in cases {
            assert_eq!(redact(text), want, "{text}");
        }
        let e = Error::RemoteNotFound { url: "https://h/x?sig=s3cr3t".into(), what: "object" }.redacted();
        assert!(matches!(e, Error::Redacted(_)) && !e.to_string().contains("s3cr3t"), "{e}");
        assert!(matches!(Error::InvalidArgument("x".into()).redacted(), Error::InvalidArgument(_)));
    }
}
