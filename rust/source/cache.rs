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

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};

use super::{Capabilities, Identity, LocalFile, Source};
use crate::error::{Error, Result};
use crate::format::Header;
use crate::settings::setting;

/// Environment variable: the directory remote objects are cached in (unset: no cache).
pub const CACHE_DIR_ENV: &str = "FASTSAFETENSORS_CACHE_DIR";

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
        .and_then(|()| if dir.is_dir() { Ok(()) } else { Err(std::io::ErrorKind::NotADirectory.into()) })
        .map_err(|e| Error::InvalidArgument(format!("cache_dir={}: not a usable directory ({e})", dir.display())))?;
    Ok(dir.to_owned())
}

/// 64-bit FNV-1a: a stable name for a string (the same in every process and release).
fn fnv(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// Where the object at `url` of version `identity` is cached under `dir`, and the start of
/// the name every version of it shares.
fn entry(dir: &Path, url: &str, identity: &Identity) -> (PathBuf, String) {
    let stem = format!("{:016x}", fnv(url));
    let version = match identity {
        Identity::Object { len, e_tag, version } => {
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

/// The cached copy of `url` at `identity`, if it is there and whole.
pub fn lookup(dir: &Path, url: &str, identity: &Identity) -> Option<CachedObject> {
    if !cacheable(identity) {
        return None;
    }
    let (path, _) = entry(dir, url, identity);
    let file = LocalFile::open(&path).ok()?;
    (file.len() == identity.len()).then(|| CachedObject { url: PathBuf::from(url), file })
}

/// A remote object read from its cache entry: the URL's name, the local file's bytes.
pub struct CachedObject {
    url: PathBuf,
    file: LocalFile,
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
            if ok && covered.is_whole(len) && file.sync_all().is_ok() && std::fs::rename(&partial, &path).is_ok() {
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

/// Removes the complete entries of the same URL other than `keep` (stale versions).
fn remove_other_versions(dir: &Path, stem: &str, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(stem) && name.ends_with(".safetensors") && e.path() != keep {
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
    fn entries_are_keyed_by_url_and_version() {
        let dir = Path::new("/c");
        let v = |tag: &str| Identity::Object { len: 10, e_tag: Some(tag.into()), version: None };
        let (a, stem_a) = entry(dir, "s3://b/k", &v("\"1\""));
        let (b, stem_b) = entry(dir, "s3://b/k", &v("\"2\""));
        let (c, _) = entry(dir, "s3://b/other", &v("\"1\""));
        assert_eq!(stem_a, stem_b);
        assert!(a != b && a != c && b != c);
        assert_eq!(fnv("a"), 0xaf63dc4c8601ec8c); // FNV-1a's published value: stable names
        assert!(!cacheable(&Identity::Object { len: 1, e_tag: None, version: None }));
    }
}
