//! Where saved bytes go, the mirror of [`source`](crate::source): a [`Sink`] is one file being
//! written. [`FileSink`] writes a local file under a temporary name in its directory, with
//! `O_DIRECT` from page-aligned buffers where the filesystem takes it (buffered writes
//! otherwise: tmpfs refuses `O_DIRECT`), in parallel at any offsets, with its space reserved
//! up front so that a full disk fails the save before a byte is written.
//!
//! Durability is the last step, in this order: each file synced (`fsync`), renamed to its
//! final name, the directory synced. So a save killed at any moment leaves every file under a
//! final name whole (the one it replaced, or the new one), and at worst a hidden temporary
//! file (`.NAME.PID.N.tmp`) behind. A sink dropped before it is published removes its file.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::plan::{align_up, IO_ALIGN};

/// One file being written.
pub trait Sink: Sync {
    /// The name the file will have.
    fn path(&self) -> &Path;
    /// Whether writes go around the page cache: then every write's offset and length are
    /// multiples of [`IO_ALIGN`], from page-aligned memory (the tail past the file's end is
    /// cut when the file is finished).
    fn direct(&self) -> bool;
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<()>;
    /// Cuts the file to its length and makes its bytes durable.
    fn finish(&mut self) -> Result<()>;
}

/// A local file written under a temporary name, published by [`publish`].
pub struct FileSink {
    path: PathBuf,
    temp: PathBuf,
    file: File,
    len: u64,
    direct: bool,
    published: bool,
}

/// Distinguishes the temporary files of one process's saves.
static NEXT_TEMP: AtomicU64 = AtomicU64::new(0);

impl FileSink {
    /// Creates the temporary file for `path` (in the same directory, so that the rename that
    /// publishes it is atomic) and reserves `len` bytes for it.
    pub fn create(path: &Path, len: u64, direct: bool) -> Result<FileSink> {
        let name =
            path.file_name().ok_or_else(|| Error::InvalidArgument(format!("{}: not a file name", path.display())))?;
        // A directory in the way would only fail the rename, after every byte was written,
        // and a save of several files would then have published some: refused first.
        if std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
            return Err(Error::io(path, "create", std::io::Error::from_raw_os_error(libc::EISDIR)));
        }
        let n = NEXT_TEMP.fetch_add(1, Ordering::Relaxed);
        let temp = path.with_file_name(format!(".{}.{}.{n}.tmp", name.to_string_lossy(), std::process::id()));
        let open = |flags: i32| OpenOptions::new().write(true).create_new(true).custom_flags(flags).open(&temp);
        let (file, direct) = match direct {
            true => match open(libc::O_DIRECT) {
                Ok(file) => (file, true),
                // tmpfs (and some FUSE filesystems) refuse O_DIRECT at open.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    (open(0).map_err(|e| Error::io(path, "create", e))?, false)
                }
                Err(e) => return Err(Error::io(path, "create", e)),
            },
            false => (open(0).map_err(|e| Error::io(path, "create", e))?, false),
        };
        let sink = FileSink { path: path.to_owned(), temp, file, len, direct, published: false };
        sink.reserve()?;
        Ok(sink)
    }

    /// Allocates the file's blocks now: a disk too full fails here, with nothing written, and
    /// the writes that follow overwrite allocated blocks inside the file's size, which a
    /// filesystem can run in parallel (appending writes serialize on the inode).
    fn reserve(&self) -> Result<()> {
        let len = if self.direct { align_up(self.len, IO_ALIGN) } else { self.len };
        if len == 0 {
            return Ok(());
        }
        // SAFETY: a plain system call on a file descriptor this sink owns.
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, 0, len as libc::off_t) };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if !matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS)) {
                return Err(Error::io(&self.path, "reserving space (fallocate)", e));
            }
            // Filesystems without fallocate: the size at least, so writes do not append.
            self.file.set_len(len).map_err(|e| Error::io(&self.path, "set_len", e))?;
        }
        Ok(())
    }

    /// The temporary file, while it is one.
    pub fn temp_path(&self) -> &Path {
        &self.temp
    }
}

impl Sink for FileSink {
    fn path(&self) -> &Path {
        &self.path
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        self.file.write_all_at(bytes, offset).map_err(|e| Error::io(&self.path, "write", e))
    }

    fn finish(&mut self) -> Result<()> {
        self.file.set_len(self.len).map_err(|e| Error::io(&self.path, "set_len", e))?;
        self.file.sync_all().map_err(|e| Error::io(&self.path, "fsync", e))
    }
}

impl Drop for FileSink {
    fn drop(&mut self) {
        if !self.published {
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// Renames finished sinks to their names, then syncs their directories: from here on the
/// files survive a crash. Returns the paths, in order.
pub fn publish(sinks: Vec<FileSink>) -> Result<Vec<PathBuf>> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    let mut paths = Vec::with_capacity(sinks.len());
    for mut sink in sinks {
        std::fs::rename(&sink.temp, &sink.path).map_err(|e| Error::io(&sink.path, "rename", e))?;
        sink.published = true;
        let dir = parent(&sink.path);
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
        paths.push(sink.path.clone());
    }
    for dir in dirs {
        sync_dir(&dir)?;
    }
    Ok(paths)
}

fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, "fsync", e))
}

/// A sink in memory, for tests of what is written where: every write is kept.
#[derive(Default)]
pub struct MemorySink {
    path: PathBuf,
    direct: bool,
    bytes: Mutex<Vec<u8>>,
    /// Fail the n-th write (0-based), as a full disk does.
    fail_at: Option<usize>,
    writes: Mutex<usize>,
    len: u64,
    finished: bool,
}

impl MemorySink {
    pub fn new(path: &Path, len: u64, direct: bool) -> MemorySink {
        MemorySink { path: path.to_owned(), direct, len, ..MemorySink::default() }
    }

    pub fn failing_at_write(mut self, n: usize) -> MemorySink {
        self.fail_at = Some(n);
        self
    }

    /// The file's bytes once finished.
    pub fn bytes(&self) -> Vec<u8> {
        assert!(self.finished, "{}: read before it was finished", self.path.display());
        self.bytes.lock().unwrap().clone()
    }
}

impl Sink for MemorySink {
    fn path(&self) -> &Path {
        &self.path
    }

    fn direct(&self) -> bool {
        self.direct
    }

    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<()> {
        let n = {
            let mut writes = self.writes.lock().unwrap();
            *writes += 1;
            *writes - 1
        };
        if self.fail_at == Some(n) {
            return Err(Error::io(&self.path, "write", std::io::Error::from_raw_os_error(libc::ENOSPC)));
        }
        if self.direct {
            assert!(offset % IO_ALIGN == 0 && bytes.len() as u64 % IO_ALIGN == 0, "unaligned direct write");
            assert!(bytes.as_ptr() as u64 % IO_ALIGN == 0, "direct write from unaligned memory");
        }
        let mut file = self.bytes.lock().unwrap();
        let end = offset as usize + bytes.len();
        if file.len() < end {
            file.resize(end, 0);
        }
        file[offset as usize..end].copy_from_slice(bytes);
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.bytes.lock().unwrap().resize(self.len as usize, 0);
        self.finished = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_appears_under_its_name_only_when_published() {
        let dir = tempdir();
        let path = dir.join("model.safetensors");
        let mut sink = FileSink::create(&path, 5, false).unwrap();
        sink.write_at(0, b"hello").unwrap();
        sink.finish().unwrap();
        assert!(!path.exists());
        let temp = sink.temp_path().to_owned();
        assert!(temp.file_name().unwrap().to_str().unwrap().starts_with(".model.safetensors."));
        assert_eq!(publish(vec![sink]).unwrap(), std::slice::from_ref(&path));
        assert_eq!(std::fs::read(&path).unwrap(), b"hello");
        assert!(!temp.exists());
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_sink_dropped_unpublished_leaves_nothing() {
        let dir = tempdir();
        let sink = FileSink::create(&dir.join("x.safetensors"), 1 << 20, true).unwrap();
        sink.write_at(0, &vec![1u8; 4096]).unwrap_or(()); // unaligned memory may refuse: no matter
        drop(sink);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn direct_writes_are_cut_to_the_file_length() {
        let dir = tempdir();
        let path = dir.join("x.safetensors");
        let mut sink = FileSink::create(&path, 5000, true).unwrap();
        let mut block = memmap2::MmapMut::map_anon(8192).unwrap();
        block[..5000].fill(7);
        sink.write_at(0, &block).unwrap();
        sink.finish().unwrap();
        publish(vec![sink]).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), vec![7u8; 5000]);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_directory_under_the_name_is_refused_before_anything_is_written() {
        let dir = tempdir();
        std::fs::create_dir(dir.join("model.safetensors")).unwrap();
        let err = FileSink::create(&dir.join("model.safetensors"), 10, true).err().unwrap().to_string();
        assert!(err.ends_with("model.safetensors: create failed: Is a directory (os error 21)"), "{err}");
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn errors_name_the_file() {
        let err = FileSink::create(Path::new("/nonexistent-dir/x.safetensors"), 1, true).err().unwrap().to_string();
        assert!(err.starts_with("/nonexistent-dir/x.safetensors: create failed"), "{err}");
    }

    fn tempdir() -> PathBuf {
        let n = NEXT_TEMP.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("fst-sink-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
