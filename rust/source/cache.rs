//! The opt-in local cache of remote objects (`$FASTSAFETENSORS_CACHE_DIR`).
//!
//! An object read whole is written to a local file as its bytes arrive, by a thread of its
//! own (the load does not wait for the disk), under a name made of its URL and version:
//! `<dir>/<hash of the URL>-<hash of its ETag, version id and size>.safetensors`. The file is
//! written as `….partial.<pid>` and renamed to its final name only once every byte of the
//! object is in it, so a name found in the cache is always a whole object of that version.
//! The next load of the URL asks the store for the object's version (the one GET of its
//! header every open makes) and, where the entry of that version is there, reads the local
//! file instead ([`CachedObject`]: mapped, `O_DIRECT` or GPUDirect Storage like any local
//! file). An entry of another version is stale: it is never read, and removed when the new
//! one is complete. A load that reads only part of an object (a filter, a `get_slice`)
//! leaves no entry.
//!
//! An entry carries what proves it whole: when it is complete, the writer hashes it back in
//! blocks of [`DIGEST_BLOCK`] bytes (sha256) into `<entry>.sha256`, written before the entry
//! takes its final name. A lookup checks the entry against those digests (the blocks in
//! parallel; the read leaves it in the page cache, where the load then maps it) and its
//! first bytes, the header, against those the store just sent. An entry that fails either
//! check (a flipped byte, a header that is not the object's, a zeroed or cut file, a missing
//! digest file) is removed, said once, and the object is fetched again (and cached anew).
//! Partial files left by a process that is gone (killed mid-load) are removed when the cache
//! is next used.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use super::{hex, io_pool, Capabilities, Identity, LocalFile, Source};
use crate::error::{shown, Error, Result};
use crate::format::Header;
use crate::settings::setting;

/// Environment variable: the directory remote objects are cached in (unset: no cache).
pub const CACHE_DIR_ENV: &str = "FASTSAFETENSORS_CACHE_DIR";
/// Bytes per digest of an entry: blocks are checked in parallel.
pub const DIGEST_BLOCK: u64 = 16 << 20;

/// The cache directory the environment names, if any (created if missing).
pub fn dir_from_env() -> Result<Option<PathBuf>> {
    setting(CACHE_DIR_ENV, "a directory that exists or can be created", |v| {
        let dir = PathBuf::from(v);
        std::fs::create_dir_all(&dir).ok()?;
        dir.is_dir().then_some(dir)
    })
}

/// `dir`, created if missing, as a cache directory; an error naming it where it cannot be.
pub fn usable_dir(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)
        .and_then(|()| if dir.is_dir() { Ok(()) } else { Err(std::io::Error::from_raw_os_error(libc::ENOTDIR)) })
        .map_err(|e| Error::InvalidArgument(format!("cache_dir={}: not a usable directory ({e})", dir.display())))?;
    Ok(dir.to_owned())
}

/// 64-bit FNV-1a: a stable name for a string (the same in every process and release).
fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Where the object at `url` of version `identity` is cached under `dir`, and the start of
/// the name every version of it shares. The URL is taken without its query string and user
/// name (`error::shown`): a presigned URL's signature changes, its object does not,
/// and the version in the name tells objects apart.
fn entry(dir: &Path, url: &str, identity: &Identity) -> (PathBuf, String) {
    let stem = format!("{:016x}", fnv(&shown(url)));
    let version = match identity {
        Identity::Object { len, e_tag, version, .. } => {
            format!("{len}:{}:{}", e_tag.as_deref().unwrap_or(""), version.as_deref().unwrap_or(""))
        }
        Identity::File { len, .. } => format!("{len}"),
    };
    (dir.join(format!("{stem}-{:016x}.safetensors", fnv(&version))), stem)
}

/// Whether a version can be cached: without an ETag or version id, a replaced object of the
/// same size could not be told from the cached one.
fn cacheable(identity: &Identity) -> bool {
    matches!(identity, Identity::Object { e_tag: Some(_), .. } | Identity::Object { version: Some(_), .. })
}

/// The file holding the digests of the entry `path`.
fn digests_path(path: &Path) -> PathBuf {
    path.with_extension("sha256")
}

/// The cached copy of `url` at `identity`, if it is there and whole: its digests match, and
/// its first bytes are `prefix` (what the store just sent of the object). A damaged entry is
/// removed (and said so): the caller fetches the object again.
pub fn lookup(dir: &Path, url: &str, identity: &Identity, prefix: &[u8]) -> Option<CachedObject> {
    if !cacheable(identity) {
        return None;
    }
    let (path, _) = entry(dir, url, identity);
    let file = LocalFile::open(&path).ok()?;
    match check_entry(&file, identity.len(), prefix) {
        Ok(()) => Some(CachedObject { url: PathBuf::from(url), file, object: identity.clone() }),
        Err(why) => {
            let _ = std::fs::remove_file(&path);
            let _ = std::fs::remove_file(digests_path(&path));
            eprintln!(
                "fastsafetensors: {}: the cache entry {} was discarded ({why}); fetching the object again",
                shown(url),
                path.display()
            );
            None
        }
    }
}

/// Why the entry `file` is not the object of `len` bytes that begins with `prefix`, if it is not.
fn check_entry(file: &LocalFile, len: u64, prefix: &[u8]) -> std::result::Result<(), String> {
    if file.len() != len {
        return Err(format!("{} bytes where the object has {len}", file.len()));
    }
    let mut first = vec![0u8; prefix.len().min(len as usize)];
    match file.read_at(&mut first, 0) {
        Ok(n) if n == first.len() && first == prefix[..n] => {}
        Ok(_) => return Err("its first bytes (the header) are not those the store sent".to_owned()),
        Err(e) => return Err(e.to_string()),
    }
    let text = std::fs::read_to_string(digests_path(file.path())).map_err(|_| "its digests are missing".to_owned())?;
    let expected: Vec<&str> = text.lines().collect();
    if expected.len() as u64 != len.div_ceil(DIGEST_BLOCK) {
        return Err("its digests are not those of a whole entry".to_owned());
    }
    let actual = block_digests(file, len).map_err(|e| e.to_string())?;
    match expected.iter().zip(&actual).position(|(e, a)| e != a) {
        None => Ok(()),
        Some(k) => {
            let start = k as u64 * DIGEST_BLOCK;
            Err(format!("bytes {start}..{} do not match their sha256", (start + DIGEST_BLOCK).min(len)))
        }
    }
}

/// The sha256 (hex) of each [`DIGEST_BLOCK`] of the first `len` bytes of `file`, hashed in
/// parallel on the I/O pool.
fn block_digests(file: &LocalFile, len: u64) -> Result<Vec<String>> {
    let blocks: Vec<u64> = (0..len).step_by(DIGEST_BLOCK as usize).collect();
    io_pool().install(|| {
        blocks
            .par_iter()
            .map(|&start| {
                let mut buf = vec![0u8; DIGEST_BLOCK.min(len - start) as usize];
                let n = file.read_at(&mut buf, start)?;
                if n < buf.len() {
                    return Err(Error::Truncated { path: file.path().to_owned(), at: start + n as u64, expected: len });
                }
                Ok(hex(&Sha256::digest(&buf)))
            })
            .collect()
    })
}

/// Removes the partial entries under `dir` whose writing process is gone (a load killed before
/// it completed them): `….partial.<pid>` where no process `pid` runs.
pub fn remove_stale_partials(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.rsplit_once(".partial.")).map(|(_, pid)| pid) else { continue };
        if pid.parse::<u32>().is_ok_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// A remote object read from its cache entry: the URL's name, the local file's bytes.
pub struct CachedObject {
    url: PathBuf,
    file: LocalFile,
    /// The object's version in the store, which the entry holds.
    object: Identity,
}

impl Source for CachedObject {
    fn path(&self) -> &Path {
        &self.url
    }

    fn identity(&self) -> &Identity {
        self.file.identity()
    }

    fn current_identity(&self) -> Result<Identity> {
        self.file.current_identity()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.file.read_at(buf, offset)
    }

    fn capabilities(&self) -> Capabilities {
        self.file.capabilities()
    }

    fn local(&self) -> Option<&LocalFile> {
        Some(&self.file)
    }

    fn header(&self) -> Result<Header> {
        self.file.header()
    }

    /// The object's, as a load reading it from the store gives it (a rank of a shared load
    /// may hit the cache where another does not).
    fn fingerprint(&self) -> Result<String> {
        match self.object.version_fingerprint() {
            Some(fingerprint) => Ok(fingerprint),
            None => self.file.fingerprint(),
        }
    }
}

/// Writes the bytes of one object to its cache entry as they arrive, on a thread of its own.
/// Dropping it lets the thread finish the writes queued; the entry is kept only if they
/// covered the whole object.
pub struct CacheWriter {
    tx: Sender<(u64, bytes::Bytes)>,
}

impl CacheWriter {
    /// A writer for the object at `url` of version `identity`, or None where it cannot be
    /// cached (no version to key it by, or the file cannot be made: the load goes on uncached).
    pub fn start(dir: &Path, url: &str, identity: &Identity) -> Option<CacheWriter> {
        if !cacheable(identity) {
            return None;
        }
        let (path, stem) = entry(dir, url, identity);
        let partial = path.with_extension(format!("safetensors.partial.{}", std::process::id()));
        let file = OpenOptions::new().write(true).create(true).truncate(true).open(&partial).ok()?;
        let len = identity.len();
        if file.set_len(len).is_err() {
            let _ = std::fs::remove_file(&partial);
            return None;
        }
        let (tx, rx) = channel::<(u64, bytes::Bytes)>();
        let dir = dir.to_owned();
        let spawned = std::thread::Builder::new().name("fastsafetensors-cache".into()).spawn(move || {
            let mut covered = Coverage::default();
            let mut ok = true;
            for (offset, bytes) in rx {
                ok = ok && file.write_all_at(&bytes, offset).is_ok();
                covered.add(offset, offset + bytes.len() as u64);
            }
            // The digests go in place first: an entry under its final name always has them.
            let complete = ok
                && covered.is_whole(len)
                && file.sync_all().is_ok()
                && write_digests(&partial, &path, len)
                && std::fs::rename(&partial, &path).is_ok();
            if complete {
                remove_other_versions(&dir, &stem, &path);
            } else {
                let _ = std::fs::remove_file(&partial);
            }
        });
        spawned.ok().map(|_| CacheWriter { tx })
    }

    /// Queues `bytes`, the object's from `offset` on, for writing.
    pub fn write(&self, offset: u64, bytes: bytes::Bytes) {
        let _ = self.tx.send((offset, bytes));
    }
}

/// Hashes the complete `partial` file of `len` bytes and writes its digests, synced, for
/// the entry `path`; whether that succeeded.
fn write_digests(partial: &Path, path: &Path, len: u64) -> bool {
    let Ok(file) = LocalFile::open(partial) else { return false };
    let Ok(digests) = block_digests(&file, len) else { return false };
    let target = digests_path(path);
    let tmp = target.with_extension(format!("sha256.partial.{}", std::process::id()));
    let written = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .and_then(|mut f| f.write_all(digests.join("\n").as_bytes()).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, &target));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.is_ok()
}

/// Removes the complete entries of the same URL other than `keep` (stale versions), and their
/// digests.
fn remove_other_versions(dir: &Path, stem: &str, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let keep_digests = digests_path(keep);
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let entry_file = name.ends_with(".safetensors") || name.ends_with(".sha256");
        if name.starts_with(stem) && entry_file && e.path() != keep && e.path() != keep_digests {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The byte ranges written so far, merged.
#[derive(Default)]
struct Coverage(Vec<(u64, u64)>);

impl Coverage {
    fn add(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        let i = self.0.partition_point(|&(s, _)| s < start);
        self.0.insert(i, (start, end));
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.0.len());
        for &(s, e) in &self.0 {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        self.0 = merged;
    }

    fn is_whole(&self, len: u64) -> bool {
        len == 0 || matches!(self.0.as_slice(), [(0, end)] if *end >= len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coverage_merges_ranges_in_any_order() {
        let mut c = Coverage::default();
        c.add(10, 20);
        c.add(0, 5);
        assert!(!c.is_whole(20));
        c.add(5, 10);
        assert!(c.is_whole(20));
        assert!(!c.is_whole(21));
        c.add(15, 30);
        assert_eq!(c.0, [(0, 30)]);
    }

    #[test]
    fn an_entry_is_checked_against_its_digests_and_the_objects_first_bytes() {
        let dir = std::env::temp_dir().join(format!("fst-cache-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("entry.safetensors");
        let len = DIGEST_BLOCK + 1000; // two blocks, the last short
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let partial = dir.join("entry.partial");
        std::fs::write(&partial, &bytes).unwrap();
        assert!(write_digests(&partial, &path, len));
        std::fs::rename(&partial, &path).unwrap();
        let check = |prefix: &[u8]| check_entry(&LocalFile::open(&path).unwrap(), len, prefix);
        assert_eq!(check(&bytes[..100]), Ok(()));
        assert!(check(&[9; 100]).unwrap_err().contains("header"));
        for (at, block) in [(5, "0..16777216"), (len - 1, "16777216..16778216")] {
            let mut flipped = bytes.clone();
            flipped[at as usize] ^= 1;
            std::fs::write(&path, &flipped).unwrap();
            let why = check(&bytes[..4]).unwrap_err();
            assert!(why.contains(&format!("bytes {block} do not match")), "{why}");
        }
        std::fs::write(&path, &bytes[..100]).unwrap();
        assert!(check(&bytes[..4]).unwrap_err().contains("100 bytes where the object has"));
        std::fs::write(&path, &bytes).unwrap();
        std::fs::remove_file(digests_path(&path)).unwrap();
        assert_eq!(check(&bytes[..4]).unwrap_err(), "its digests are missing");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn entries_are_keyed_by_url_and_version() {
        let dir = Path::new("/c");
        let v = |tag: &str| Identity::Object { len: 10, e_tag: Some(tag.into()), version: None, modified: None };
        let (a, stem_a) = entry(dir, "s3://b/k", &v("\"1\""));
        let (b, stem_b) = entry(dir, "s3://b/k", &v("\"2\""));
        let (c, _) = entry(dir, "s3://b/other", &v("\"1\""));
        assert_eq!(stem_a, stem_b);
        assert!(a != b && a != c && b != c);
        assert_eq!(fnv("a"), 0xaf63dc4c8601ec8c); // FNV-1a's published value: stable names
        assert!(!cacheable(&Identity::Object { len: 1, e_tag: None, version: None, modified: None }));
        // The query string and user name do not name another object (presigned URLs).
        assert_eq!(entry(dir, "https://u:p@h/k?sig=1", &v("1")), entry(dir, "https://h/k?sig=2", &v("1")));
    }
}
