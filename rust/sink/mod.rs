//! Where saved bytes go, the mirror of [`source`](crate::source): a [`Sink`] is one file being
//! written. [`FileSink`] writes a local file under a temporary name in its directory, with
//! `O_DIRECT` from page-aligned buffers where the filesystem takes it (buffered writes
//! otherwise: tmpfs refuses `O_DIRECT`), in parallel at any offsets, with its space reserved
//! up front so that a full disk fails the save before a byte is written.
//!
//! Durability is the last step, in this order: each file synced (`fsync`), renamed to its
//! final name, the directory synced. So a save killed at any moment leaves every file under a
//! final name whole (the one it replaced, or the new one), and at worst a hidden temporary
//! file (`.NAME.PID.N.tmp`) behind, which the next save into that directory removes
//! ([`remove_stale_temps`]): its writer held a lock on it while it lived. A sink dropped
//! before it is published removes its file.
//!
//! A checkpoint directory is committed as a whole by [`commit`]: its files are written into a
//! staging directory beside it, which then takes its place in one rename.

pub mod commit;

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
    /// The file's name as the caller knows it: errors name it.
    path: PathBuf,
    /// Where its bytes are being written.
    temp: PathBuf,
    /// Where [`publish`] renames it; None when it is written in place (in a staging directory).
    target: Option<PathBuf>,
    file: File,
    len: u64,
    direct: bool,
    published: bool,
}

/// Distinguishes the temporary files of one process's saves.
static NEXT_TEMP: AtomicU64 = AtomicU64::new(0);

/// A new temporary name for `name` in this process: `.NAME.PID.N.tmp`.
pub fn temp_name(name: &str) -> String {
    let n = NEXT_TEMP.fetch_add(1, Ordering::Relaxed);
    format!(".{name}.{}.{n}.tmp", std::process::id())
}

/// The final name and the writer's process id of a temporary name (`.NAME.PID.N.tmp`).
pub fn parse_temp_name(temp: &str) -> Option<(&str, u32)> {
    let rest = temp.strip_prefix('.')?.strip_suffix(".tmp")?;
    let (rest, n) = rest.rsplit_once('.')?;
    let (name, pid) = rest.rsplit_once('.')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    (digits(n) && digits(pid) && !name.is_empty()).then_some(())?;
    Some((name, pid.parse().ok()?))
}

impl FileSink {
    /// Creates the temporary file for `path` (in the same directory, so that the rename that
    /// publishes it is atomic) and reserves `len` bytes for it.
    pub fn create(path: &Path, len: u64, direct: bool) -> Result<FileSink> {
        let name =
            path.file_name().ok_or_else(|| Error::InvalidArgument(format!("{}: not a file name", path.display())))?;
        refuse_directory(path)?;
        let temp = path.with_file_name(temp_name(&name.to_string_lossy()));
        FileSink::open(path, temp, Some(path.to_owned()), len, direct)
    }

    /// Creates the file `at` (in a staging directory: it is written under its own name, and
    /// published by the directory's commit), whose errors name `path`.
    pub fn create_staged(path: &Path, at: &Path, len: u64, direct: bool) -> Result<FileSink> {
        FileSink::open(path, at.to_owned(), None, len, direct)
    }

    /// Opens a file another process created and writes parts of (a group save): never
    /// created, cut, published or removed through this sink. `direct` as for [`FileSink::create`].
    pub fn open_existing(path: &Path, at: &Path, direct: bool) -> Result<FileSink> {
        let (file, direct) = open_for_writing(path, at, false, direct)?;
        let len = file.metadata().map_err(|e| Error::io(path, "stat", e))?.len();
        Ok(FileSink { path: path.to_owned(), temp: at.to_owned(), target: None, file, len, direct, published: true })
    }

    /// Makes what was written through this sink durable (the file's length aside).
    pub fn sync(&self) -> Result<()> {
        self.file.sync_all().map_err(|e| Error::io(&self.path, "fsync", e))
    }

    fn open(path: &Path, temp: PathBuf, target: Option<PathBuf>, len: u64, direct: bool) -> Result<FileSink> {
        let (file, direct) = open_for_writing(path, &temp, true, direct)?;
        // Held while this process writes the file: a later save removes it only once free.
        lock(&file, false);
        let sink = FileSink { path: path.to_owned(), temp, target, file, len, direct, published: false };
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

/// Opens `at` (a new file with `create`) for writing, with `O_DIRECT` where asked and the
/// filesystem takes it (tmpfs and some FUSE filesystems refuse it at open: then buffered);
/// errors name `path`. Returns the file and whether it is direct.
fn open_for_writing(path: &Path, at: &Path, create: bool, direct: bool) -> Result<(File, bool)> {
    let op = if create { "create" } else { "open" };
    let open = |flags: i32| OpenOptions::new().write(true).create_new(create).custom_flags(flags).open(at);
    match direct {
        true => match open(libc::O_DIRECT) {
            Ok(file) => Ok((file, true)),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                Ok((open(0).map_err(|e| Error::io(path, op, e))?, false))
            }
            Err(e) => Err(Error::io(path, op, e)),
        },
        false => Ok((open(0).map_err(|e| Error::io(path, op, e))?, false)),
    }
}

/// Refuses a directory in the way of a file: it would only fail the rename, after every byte
/// was written, and a save of several files would then have published some.
pub fn refuse_directory(path: &Path) -> Result<()> {
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir()) {
        return Err(Error::io(path, "create", std::io::Error::from_raw_os_error(libc::EISDIR)));
    }
    Ok(())
}

/// Renames finished sinks to their names, then syncs their directories: from here on the
/// files survive a crash. Returns the paths, in order.
pub fn publish(sinks: Vec<FileSink>) -> Result<Vec<PathBuf>> {
    // Sinks are all staged (already at their names in a staging directory) or all renamed.
    let renamed = sinks.iter().any(|s| s.target.is_some());
    let (paths, dirs) = rename_into_place(sinks)?;
    for dir in dirs {
        match renamed {
            true => sync_in_place(&dir)?,
            false => sync_dir(&dir)?,
        }
    }
    Ok(paths)
}

/// Renames finished sinks to their names (a staged sink is already at its name in the
/// staging directory). Returns the paths, in order, and the directories to sync.
pub(crate) fn rename_into_place(sinks: Vec<FileSink>) -> Result<(Vec<PathBuf>, Vec<PathBuf>)> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    let mut paths = Vec::with_capacity(sinks.len());
    for mut sink in sinks {
        let at = match &sink.target {
            Some(target) => {
                std::fs::rename(&sink.temp, target).map_err(|e| Error::io(&sink.path, "rename", e))?;
                target.clone()
            }
            None => sink.temp.clone(),
        };
        sink.published = true;
        let dir = parent(&at);
        if !dirs.contains(&dir) {
            dirs.push(dir);
        }
        paths.push(sink.path.clone());
    }
    Ok((paths, dirs))
}

/// Syncs `dir` after files (or a checkpoint directory) were renamed into it: a failure now
/// says that they are in place, only not known to be durable, so that nobody takes the
/// failed save for one that left the old files.
pub(crate) fn sync_in_place(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io(dir, "fsync (what was renamed into it is in place but not known to be durable)", e))
}

pub(crate) fn parent(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    }
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, "fsync", e))
}

/// Takes `flock(LOCK_EX)` on `file` (waiting for it unless `try_only`); whether it was taken.
/// Filesystems without locks (some NFS mounts) answer ENOLCK: the lock is then taken as free.
pub(crate) fn lock(file: &File, try_only: bool) -> bool {
    let op = if try_only { libc::LOCK_EX | libc::LOCK_NB } else { libc::LOCK_EX };
    // SAFETY: a plain system call on a file descriptor the caller owns.
    let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EWOULDBLOCK)
}

/// Whether the save that wrote temporary `path` (a file or a staging directory), whose name
/// says process `pid` wrote it, is gone: no such process here, and nobody holds its lock
/// (which also covers a writer in another PID namespace, or on another host of a shared
/// filesystem where locks work).
pub(crate) fn abandoned(path: &Path, pid: u32) -> bool {
    if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
        return false;
    }
    let flags = libc::O_NOFOLLOW | libc::O_CLOEXEC;
    match OpenOptions::new().read(true).custom_flags(flags).open(path) {
        Ok(file) => lock(&file, true),
        Err(e) => e.kind() != std::io::ErrorKind::NotFound && e.raw_os_error() != Some(libc::ELOOP),
    }
}

/// Removes the temporary files (`.NAME.PID.N.tmp`, NAME a `.safetensors` file or an index)
/// that saves which are gone left in `dir` (killed before they published them). Best effort:
/// what cannot be removed stays, and files of other names are never touched.
pub fn remove_stale_temps(dir: &Path) {
    remove_abandoned(dir, |name, kind| {
        kind.is_file() && (name.ends_with(".safetensors") || name.ends_with(".safetensors.index.json"))
    });
}

/// Removes the entries `.NAME.PID.N.tmp` of `dir` that `ours(NAME, kind)` claims and whose
/// writer is gone ([`abandoned`]).
pub(crate) fn remove_abandoned(dir: &Path, ours: impl Fn(&str, std::fs::FileType) -> bool) {
    for (path, _, kind) in abandoned_entries(dir, ours) {
        let _ = match kind.is_dir() {
            true => std::fs::remove_dir_all(&path),
            false => std::fs::remove_file(&path),
        };
    }
}

/// The entries `.NAME.PID.N.tmp` of `dir` that `ours(NAME, kind)` claims and whose writer is
/// gone ([`abandoned`]): each path, its writer's process id and its kind.
pub(crate) fn abandoned_entries(
    dir: &Path,
    ours: impl Fn(&str, std::fs::FileType) -> bool,
) -> Vec<(PathBuf, u32, std::fs::FileType)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((final_name, pid)) = name.to_str().and_then(parse_temp_name) else { continue };
        let Ok(kind) = entry.file_type() else { continue };
        let path = entry.path();
        if ours(final_name, kind) && abandoned(&path, pid) {
            found.push((path, pid, kind));
        }
    }
    found
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
