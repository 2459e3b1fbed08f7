//! A checkpoint directory replaced as a whole: every reader of `dir` sees the old checkpoint
//! or the new one, never shards of both, whenever a save is killed or fails.
//!
//! The new files are written into a staging directory beside `dir` (`.DIR.PID.N.tmp`, in the
//! same parent, so on the same filesystem), each synced. At the commit, every other entry of
//! `dir` (config, tokenizer, the user's files and directories) is carried into the staging
//! directory as a hard link (directories are made again, their files linked), the staging
//! directory is synced, and `renameat2(RENAME_EXCHANGE)` swaps the two directories in one
//! step. The parent is synced; what `dir` held before is then removed, carried files aside.
//! What changed in `dir` between the carrying and the swap (entries made, files replaced) is
//! moved into the new one.
//!
//! Where that cannot be done, the commit falls back (see [`Commit`]):
//! - no `RENAME_EXCHANGE` (NFS, old kernels): `dir` renamed away, then the staging directory
//!   renamed into its place: never a mix, but for an instant no `dir`;
//! - `dir` is a mount point, holds this process's working directory, its parent is not
//!   writable, or an entry cannot be linked: the files are renamed into `dir` one by one,
//!   the index last (each file whole, the checkpoint not atomic as a whole).

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::plan::save::{INDEX_FILE, SINGLE_FILE};
use crate::settings::setting;
use crate::sink::{abandoned, abandoned_entries, lock, parent, parse_temp_name, publish, refuse_directory};
use crate::sink::{remove_abandoned, rename_into_place, sync_dir, sync_in_place};
use crate::sink::{remove_stale_temps, temp_name, FileSink, Sink};

/// The variable that picks how a checkpoint directory is committed.
pub const ENV_COMMIT: &str = "FASTSAFETENSORS_SAVE_COMMIT";

/// How a checkpoint directory is committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Commit {
    /// The staging directory exchanged with `dir` (falling back as the module says).
    Exchange,
    /// `dir` renamed away, then the staging directory renamed to `dir`.
    Rename,
    /// The files renamed into `dir` one by one, the index last.
    InPlace,
}

impl Commit {
    /// From `FASTSAFETENSORS_SAVE_COMMIT` (`exchange`, the default; `rename`; `in-place`).
    pub fn from_env() -> Result<Commit> {
        let parsed = setting(ENV_COMMIT, "exchange, rename or in-place", |v| match v.to_ascii_lowercase().as_str() {
            "exchange" => Some(Commit::Exchange),
            "rename" => Some(Commit::Rename),
            "in-place" | "inplace" => Some(Commit::InPlace),
            _ => None,
        })?;
        Ok(parsed.unwrap_or(Commit::Exchange))
    }
}

/// Whether an entry of a checkpoint directory is the checkpoint's own: its single file, its
/// index or a shard of transformers' names (a file or a link; a directory of such a name is
/// the user's). A new save replaces or drops these, and carries every other entry over.
pub fn is_checkpoint_file(name: &str) -> bool {
    if name == SINGLE_FILE || name == INDEX_FILE {
        return true;
    }
    // model-00001-of-00002.safetensors
    let Some(rest) = name.strip_prefix("model-").and_then(|r| r.strip_suffix(".safetensors")) else { return false };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    rest.split_once("-of-").is_some_and(|(i, n)| digits(i) && digits(n))
}

/// A checkpoint directory being saved: where its files go, and how they are committed.
pub struct CheckpointDir {
    /// `dir` as the caller gave it: the paths returned and named in errors.
    shown: PathBuf,
    /// `dir` with symbolic links resolved (a link to a directory keeps pointing at it).
    real: PathBuf,
    stage: Option<Stage>,
    how: Commit,
}

struct Stage {
    path: PathBuf,
    /// Held (flock) while this save lives, so that no other save takes it for abandoned.
    _lock: File,
    /// Whether the staging directory has been exchanged or renamed (it then holds the old
    /// directory, or nothing).
    committed: bool,
}

impl Drop for Stage {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

impl CheckpointDir {
    /// Prepares a save of files `names` into `dir`: removes what saves that are gone left
    /// there, refuses a directory in the way of a file, and makes the staging directory
    /// (unless `commit` or the directory asks for an in-place commit).
    pub fn prepare(dir: &Path, names: &[String], commit: Commit) -> Result<CheckpointDir> {
        let shown = dir.to_owned();
        finish_interrupted_commits(dir);
        let exists = match std::fs::metadata(dir) {
            Ok(m) if m.is_dir() => true,
            Ok(_) => return Err(Error::io(dir, "create_dir_all", std::io::Error::from_raw_os_error(libc::EEXIST))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(Error::io(dir, "stat", e)),
        };
        let real = match exists {
            true => std::fs::canonicalize(dir).map_err(|e| Error::io(dir, "canonicalize", e))?,
            false => {
                let name = dir.file_name().filter(|_| !dir.ends_with(".."));
                let up = parent(dir);
                match std::fs::metadata(&up) {
                    Ok(m) if !m.is_dir() => {
                        return Err(Error::io(dir, "create_dir_all", std::io::Error::from_raw_os_error(libc::ENOTDIR)))
                    }
                    Ok(_) => {}
                    Err(_) => std::fs::create_dir_all(&up).map_err(|e| Error::io(dir, "create_dir_all", e))?,
                }
                let up = std::fs::canonicalize(&up).map_err(|e| Error::io(dir, "canonicalize", e))?;
                match name {
                    Some(name) => up.join(name),
                    None => up,
                }
            }
        };
        for name in names {
            refuse_directory(&real.join(name))
                .map_err(|_| Error::io(shown.join(name), "create", std::io::Error::from_raw_os_error(libc::EISDIR)))?;
        }
        if exists {
            remove_stale_temps(&real);
        }
        let mut checkpoint = CheckpointDir { shown, real, stage: None, how: commit };
        if commit != Commit::InPlace && checkpoint.can_stage(exists) {
            checkpoint.stage = checkpoint.make_stage()?;
        }
        if checkpoint.stage.is_none() && !exists {
            std::fs::create_dir_all(&checkpoint.real).map_err(|e| Error::io(dir, "create_dir_all", e))?;
        }
        Ok(checkpoint)
    }

    /// Whether `dir` can be replaced by a directory beside it: it has a parent on its own
    /// filesystem (not a mount point), and this process does not work inside it (its working
    /// directory would be the old one, removed).
    fn can_stage(&self, exists: bool) -> bool {
        let (Some(up), Some(_)) = (self.real.parent(), self.real.file_name()) else { return false };
        if !exists {
            return true;
        }
        let same_device = match (std::fs::metadata(up), std::fs::metadata(&self.real)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev(),
            _ => false,
        };
        let cwd_inside =
            std::env::current_dir().and_then(std::fs::canonicalize).is_ok_and(|cwd| cwd.starts_with(&self.real));
        same_device && !cwd_inside
    }

    /// The staging directory beside `dir`, or None where the parent refuses one (not
    /// writable, read-only): the commit is then in place.
    fn make_stage(&self) -> Result<Option<Stage>> {
        let up = parent(&self.real);
        let name = self.real.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        remove_abandoned(&up, |n, kind| kind.is_dir() && n == name);
        let path = up.join(temp_name(&name));
        if let Err(e) = std::fs::create_dir(&path) {
            return match e.raw_os_error() {
                Some(libc::EACCES | libc::EPERM | libc::EROFS) => Ok(None),
                _ => Err(Error::io(&self.shown, "create", e)),
            };
        }
        let opened = OpenOptions::new().read(true).custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC).open(&path);
        let lock_file = match opened {
            Ok(file) => file,
            Err(e) => {
                let _ = std::fs::remove_dir(&path);
                return Err(Error::io(&self.shown, "create", e));
            }
        };
        lock(&lock_file, false);
        Ok(Some(Stage { path, _lock: lock_file, committed: false }))
    }

    /// Whether the files are written into a staging directory (committed as a whole).
    pub fn staged(&self) -> bool {
        self.stage.is_some()
    }

    /// The path a file of the checkpoint has once saved, as the caller named the directory.
    pub fn path_of(&self, name: &str) -> PathBuf {
        self.shown.join(name)
    }

    /// A sink for the checkpoint's file `name`: in the staging directory, or beside its final
    /// name under a temporary one.
    pub fn sink(&self, name: &str, len: u64, direct: bool) -> Result<FileSink> {
        match &self.stage {
            Some(stage) => FileSink::create_staged(&self.path_of(name), &stage.path.join(name), len, direct),
            None => FileSink::create(&self.path_of(name), len, direct),
        }
    }

    /// Publishes the finished (synced) `files`, then `index`: the staging directory takes
    /// `dir`'s place, or the files are renamed in one by one. Returns their paths, the index last.
    pub fn commit(mut self, files: Vec<FileSink>, index: Option<FileSink>) -> Result<Vec<PathBuf>> {
        let names: Vec<String> = files
            .iter()
            .chain(&index)
            .map(|s| s.path().file_name().unwrap_or_default().to_string_lossy().into_owned())
            .collect();
        let Some(mut stage) = self.stage.take() else {
            // In place: the shards, then the index, then the stale files of the old checkpoint
            // removed, all made durable by one sync (which, failing, still leaves no stale file).
            let mut written = publish(files)?;
            let (index, _) = rename_into_place(index.into_iter().collect())?;
            written.extend(index);
            let removed = remove_stale(&self.real, &self.shown, &names);
            sync_in_place(&self.real)?;
            return removed.map(|()| written);
        };
        let mut written = publish(files)?;
        written.extend(publish(index.into_iter().collect())?);
        match self.swap(&mut stage, self.how) {
            Ok(true) => Ok(written),
            Ok(false) => {
                // In place after all: each file from the staging directory to its name.
                for name in &names {
                    std::fs::rename(stage.path.join(name), self.real.join(name))
                        .map_err(|e| Error::io(self.path_of(name), "rename", e))?;
                }
                let removed = remove_stale(&self.real, &self.shown, &names);
                sync_in_place(&self.real)?;
                removed.map(|()| written)
            }
            Err(e) => Err(e),
        }
    }

    /// Puts the staging directory in `dir`'s place; false where it cannot (the caller then
    /// commits in place), an error where the save must fail with `dir` as it was.
    fn swap(&self, stage: &mut Stage, how: Commit) -> Result<bool> {
        let io = |op: &'static str| move |e: std::io::Error| Error::io(&self.shown, op, e);
        let up = parent(&self.real);
        let before = match std::fs::symlink_metadata(&self.real) {
            Ok(m) if m.is_dir() => Some(m),
            Ok(_) => return Err(io("create_dir_all")(std::io::Error::from_raw_os_error(libc::EEXIST))),
            Err(_) => None,
        };
        let Some(before) = before else {
            // A new directory: renamed into place (another one made there meanwhile is taken
            // as the existing directory).
            sync_dir(&stage.path)?;
            match std::fs::rename(&stage.path, &self.real) {
                Ok(()) => {
                    stage.committed = true;
                    sync_in_place(&up)?;
                    return Ok(true);
                }
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) => {
                    return self.swap(stage, how);
                }
                Err(e) => return Err(io("rename")(e)),
            }
        };
        match carry(&self.real, &stage.path, &before) {
            Ok(()) => {}
            Err(e) if cannot_link(&e) => return Ok(false),
            Err(e) => return Err(io("carry its files over")(e)),
        }
        let exchanged = match how {
            Commit::Exchange => exchange(&stage.path, &self.real),
            _ => Err(std::io::Error::from_raw_os_error(libc::EINVAL)),
        };
        match exchanged {
            Ok(()) => stage.committed = true,
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) => {
                // No exchange here (NFS): the old directory aside, then the new one in place
                // (a kill between the two is mended by the next save into `dir`:
                // [`finish_interrupted_commits`]).
                let aside = up.join(temp_name(&aside_name(&stage_name(&self.real))));
                match std::fs::rename(&self.real, &aside) {
                    Ok(()) => {}
                    Err(e)
                        if matches!(e.raw_os_error(), Some(libc::EXDEV | libc::EBUSY | libc::EACCES | libc::EPERM)) =>
                    {
                        return Ok(false)
                    }
                    Err(e) => return Err(io("rename")(e)),
                }
                if let Err(e) = std::fs::rename(&stage.path, &self.real) {
                    let _ = std::fs::rename(&aside, &self.real);
                    return Err(io("rename")(e));
                }
                stage.committed = true;
                stage.path = aside;
            }
            // overlayfs renames no directory of a lower layer; a directory in use elsewhere.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EXDEV | libc::EBUSY | libc::EACCES | libc::EPERM)) => {
                return Ok(false)
            }
            Err(e) => return Err(io("rename (exchange)")(e)),
        }
        let synced = sync_in_place(&up);
        // The old directory is now at stage.path: what appeared in it after the carrying goes
        // to the new one, then the rest (the old checkpoint, links of the carried files) goes,
        // the sync failing or not (the new checkpoint is in place either way).
        move_newcomers(&stage.path, &self.real, true);
        let _ = std::fs::remove_dir_all(&stage.path);
        synced.map(|()| true)
    }
}

/// The name (before [`temp_name`] makes it hidden) of directory `name` set aside by a commit
/// by renames: not `name`, so that no save takes it for an abandoned staging directory.
fn aside_name(name: &str) -> String {
    format!("{name}~old")
}

/// Finishes the commits by renames into `dir` that were killed (or failed) between their two
/// renames, and removes what the last step of such a commit had yet to. Without this, the next
/// save into `dir` would find no `dir` and remove both hidden directories as abandoned: the new
/// checkpoint and the old one, with the directory's other files.
/// - No `dir`: the complete new directory, staged by the same process as the old one set aside
///   (and synced before it was), is renamed into place; where there is not exactly one, the old
///   one goes back.
/// - With `dir` in place, the old directory left aside goes, as the commit would have removed
///   it (what appeared in it meanwhile moved into `dir` first).
fn finish_interrupted_commits(dir: &Path) {
    let Some(name) = dir.file_name().and_then(|n| n.to_str()) else { return };
    let up = parent(dir);
    let aside = aside_name(name);
    for (old, pid, _) in abandoned_entries(&up, |n, kind| kind.is_dir() && n == aside) {
        if std::fs::symlink_metadata(dir).is_err() {
            let staged = abandoned_entries(&up, |n, kind| kind.is_dir() && n == name);
            let mut of_that_save = staged.iter().filter(|(_, p, _)| *p == pid).map(|(path, _, _)| path);
            let back = match (of_that_save.next(), of_that_save.next()) {
                (Some(new), None) => new,
                _ => &old,
            };
            if std::fs::rename(back, dir).is_err() {
                continue;
            }
            let _ = sync_dir(&up);
            if back == &old {
                continue;
            }
        }
        move_newcomers(&old, dir, true);
        let _ = std::fs::remove_dir_all(&old);
    }
}

fn stage_name(real: &Path) -> String {
    real.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
}

/// Whether a carrying error means the entries cannot be linked here (the commit is then in
/// place) rather than a failure of the filesystem.
fn cannot_link(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES | libc::EMLINK | libc::EOPNOTSUPP | libc::EXDEV))
}

/// Whether entry `name` of the old directory stays behind (not carried): the checkpoint's own
/// files, and temporaries of saves that are gone.
fn left_behind(dir: &Path, name: &str, kind: std::fs::FileType) -> bool {
    if is_checkpoint_file(name) && !kind.is_dir() {
        return true;
    }
    parse_temp_name(name)
        .is_some_and(|(n, pid)| kind.is_file() && n.ends_with(".safetensors") && abandoned(&dir.join(name), pid))
}

/// Carries every entry of `from` but the checkpoint's own files into `to`: files, links and
/// other non-directories as hard links (the same files), directories made again with their
/// mode, owner and times, and `to` given `from`'s mode and owner. Every directory made is
/// synced.
fn carry(from: &Path, to: &Path, meta: &std::fs::Metadata) -> std::io::Result<()> {
    carry_entries(from, to, true)?;
    same_attributes(to, meta, false)?;
    File::open(to)?.sync_all()
}

fn carry_entries(from: &Path, to: &Path, top: bool) -> std::io::Result<()> {
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        let kind = entry.file_type()?;
        if top && name.to_str().is_some_and(|n| left_behind(from, n, kind)) {
            continue;
        }
        let (source, target) = (from.join(&name), to.join(&name));
        if kind.is_dir() {
            std::fs::create_dir(&target)?;
            carry_entries(&source, &target, false)?;
            same_attributes(&target, &std::fs::symlink_metadata(&source)?, true)?;
            File::open(&target)?.sync_all()?;
        } else {
            // linkat without AT_SYMLINK_FOLLOW: a symbolic link is linked, not its target.
            std::fs::hard_link(&source, &target)?;
        }
    }
    Ok(())
}

/// Gives directory `path` the mode and owner (where this process may) of `meta`, and its
/// times with `times` (a carried directory is unchanged; the checkpoint directory is not).
fn same_attributes(path: &Path, meta: &std::fs::Metadata, times: bool) -> std::io::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: plain system calls on a NUL-terminated path. The owner is best effort: only
    // root may give a directory to another user.
    unsafe {
        let _ = libc::lchown(c.as_ptr(), meta.uid(), meta.gid());
        if times {
            let stamps = [
                libc::timespec { tv_sec: meta.atime(), tv_nsec: meta.atime_nsec() },
                libc::timespec { tv_sec: meta.mtime(), tv_nsec: meta.mtime_nsec() },
            ];
            let _ = libc::utimensat(libc::AT_FDCWD, c.as_ptr(), stamps.as_ptr(), libc::AT_SYMLINK_NOFOLLOW);
        }
    }
    Ok(())
}

/// Swaps two directories in one step.
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    renameat2(a, b, libc::RENAME_EXCHANGE)
}

/// `renameat2(2)`, relative to the working directory.
fn renameat2(from: &Path, to: &Path, flags: libc::c_uint) -> std::io::Result<()> {
    let c =
        |p: &Path| CString::new(p.as_os_str().as_bytes()).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL));
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: a plain system call on NUL-terminated paths.
    let rc = unsafe { libc::renameat2(libc::AT_FDCWD, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), flags) };
    match rc {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Brings into the new directory `new` what someone else changed in the old one `old` between
/// the carrying and the swap, at any depth: an entry `new` lacks is moved in (never over an
/// entry), a file replaced meanwhile (another inode under its name) replaces the carried link.
/// The checkpoint's own files at the top stay behind.
fn move_newcomers(old: &Path, new: &Path, top: bool) {
    let Ok(entries) = std::fs::read_dir(old) else { return };
    let mut moved = false;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Ok(kind) = entry.file_type() else { continue };
        if top && name.to_str().is_some_and(|n| left_behind(old, n, kind)) {
            continue;
        }
        let (source, target) = (entry.path(), new.join(&name));
        match (std::fs::symlink_metadata(&source), std::fs::symlink_metadata(&target)) {
            (_, Err(_)) => moved |= renameat2(&source, &target, libc::RENAME_NOREPLACE).is_ok(),
            (Ok(a), Ok(b)) if a.is_dir() && b.is_dir() => move_newcomers(&source, &target, false),
            (Ok(a), Ok(b)) if !a.is_dir() && !b.is_dir() && a.ino() != b.ino() => {
                moved |= std::fs::rename(&source, &target).is_ok()
            }
            _ => {}
        }
    }
    if moved {
        let _ = sync_dir(new);
    }
}

/// Removes what an earlier save left in `dir` (named `shown` in errors) that the new
/// checkpoint (`written`, names) does not have: its shards, its index, or its single file, and
/// links of those names (a loader would take a stale `model.safetensors` before the new
/// index). Directories stay.
pub fn remove_stale(dir: &Path, shown: &Path, written: &[String]) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(shown, "read_dir", e))?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if is_checkpoint_file(name)
            && !written.iter().any(|w| w == name)
            && entry.file_type().is_ok_and(|t| !t.is_dir())
        {
            std::fs::remove_file(dir.join(name)).map_err(|e| Error::io(shown.join(name), "remove", e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_files_are_transformers_names() {
        for name in ["model.safetensors", "model.safetensors.index.json", "model-00001-of-00002.safetensors"] {
            assert!(is_checkpoint_file(name), "{name}");
        }
        for name in [
            "config.json",
            "model-1-of-2.safetensors",
            "model-00001-of-00002.safetensors.bak",
            "model-0001a-of-00002.safetensors",
            "adapter_model.safetensors",
            "pytorch_model.bin",
        ] {
            assert!(!is_checkpoint_file(name), "{name}");
        }
    }

    use crate::sink::Sink;
    use std::os::unix::fs::symlink;

    fn tempdir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(temp_name(&format!("fst-commit-{tag}")).trim_start_matches('.'));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Every entry under `dir` (recursively): path -> contents ("->target" for links, "/" for
    /// directories).
    fn tree(dir: &Path) -> std::collections::BTreeMap<String, String> {
        let mut out = std::collections::BTreeMap::new();
        fn walk(root: &Path, at: &Path, out: &mut std::collections::BTreeMap<String, String>) {
            for e in std::fs::read_dir(at).unwrap() {
                let e = e.unwrap();
                let rel = e.path().strip_prefix(root).unwrap().to_string_lossy().into_owned();
                let kind = e.file_type().unwrap();
                if kind.is_symlink() {
                    out.insert(rel, format!("->{}", std::fs::read_link(e.path()).unwrap().display()));
                } else if kind.is_dir() {
                    out.insert(rel, "/".into());
                    walk(root, &e.path(), out);
                } else {
                    out.insert(rel, String::from_utf8_lossy(&std::fs::read(e.path()).unwrap()).into_owned());
                }
            }
        }
        walk(dir, dir, &mut out);
        out
    }

    fn save(dir: &Path, files: &[(&str, &str)], how: Commit) -> Result<Vec<PathBuf>> {
        let names: Vec<String> = files.iter().map(|f| f.0.to_string()).collect();
        let checkpoint = CheckpointDir::prepare(dir, &names, how)?;
        let mut sinks = Vec::new();
        for (name, bytes) in files {
            let mut sink = checkpoint.sink(name, bytes.len() as u64, false)?;
            sink.write_at(0, bytes.as_bytes())?;
            sink.finish()?;
            sinks.push(sink);
        }
        let index = sinks.pop();
        checkpoint.commit(sinks, index)
    }

    /// A directory holding an old sharded checkpoint, a link named model.safetensors, the
    /// user's files, a link, a subdirectory and a file of a shard's name in it.
    fn old_checkpoint(dir: &Path) {
        for (name, bytes) in [
            ("model-00001-of-00003.safetensors", "old 1"),
            ("model-00002-of-00003.safetensors", "old 2"),
            ("model-00003-of-00003.safetensors", "old 3"),
            ("model.safetensors.index.json", "old index"),
            ("config.json", "config"),
            ("notes.safetensors", "the user's"),
        ] {
            std::fs::write(dir.join(name), bytes).unwrap();
        }
        std::fs::write(dir.parent().unwrap().join("elsewhere.safetensors"), "elsewhere").unwrap();
        symlink("../elsewhere.safetensors", dir.join("model.safetensors")).unwrap();
        symlink("config.json", dir.join("config-link.json")).unwrap();
        std::fs::create_dir_all(dir.join("original/deeper")).unwrap();
        std::fs::write(dir.join("original/model-00001-of-00002.safetensors"), "kept").unwrap();
        std::fs::write(dir.join("original/deeper/x"), "x").unwrap();
    }

    #[test]
    fn a_commit_replaces_the_checkpoint_and_carries_everything_else() {
        for how in [Commit::Exchange, Commit::Rename, Commit::InPlace] {
            let root = tempdir("carry");
            let dir = root.join("ckpt");
            std::fs::create_dir(&dir).unwrap();
            old_checkpoint(&dir);
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o750)).unwrap();
            let config_inode = std::fs::metadata(dir.join("config.json")).unwrap().ino();
            let dir_inode = std::fs::metadata(&dir).unwrap().ino();
            let mut expected = tree(&dir);
            for stale in [
                "model-00001-of-00003.safetensors",
                "model-00002-of-00003.safetensors",
                "model-00003-of-00003.safetensors",
                "model.safetensors",
            ] {
                expected.remove(stale);
            }
            let files = [
                ("model-00001-of-00002.safetensors", "new 1"),
                ("model-00002-of-00002.safetensors", "new 2"),
                ("model.safetensors.index.json", "new index"),
            ];
            let written = save(&dir, &files, how).unwrap();
            assert_eq!(written, files.map(|f| dir.join(f.0)), "{how:?}");
            for (name, bytes) in files {
                expected.insert(name.into(), bytes.into());
            }
            assert_eq!(tree(&dir), expected, "{how:?}");
            assert_eq!(std::fs::metadata(dir.join("config.json")).unwrap().ino(), config_inode, "{how:?}");
            assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o7777, 0o750, "{how:?}");
            // Replaced by the staging directory, unless committed in place.
            assert_eq!(std::fs::metadata(&dir).unwrap().ino() == dir_inode, how == Commit::InPlace, "{how:?}");
            assert_eq!(std::fs::read_to_string(root.join("elsewhere.safetensors")).unwrap(), "elsewhere");
            // Nothing left beside the directory.
            let mut beside: Vec<_> = std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().file_name()).collect();
            beside.sort();
            assert_eq!(beside, ["ckpt", "elsewhere.safetensors"], "{how:?}");
            std::fs::remove_dir_all(root).unwrap();
        }
    }

    #[test]
    fn a_new_directory_appears_whole() {
        for how in [Commit::Exchange, Commit::InPlace] {
            let root = tempdir("new");
            let dir = root.join("a/b/ckpt");
            save(&dir, &[("model.safetensors", "new")], how).unwrap();
            assert_eq!(tree(&dir), [("model.safetensors".to_string(), "new".to_string())].into());
            std::fs::remove_dir_all(root).unwrap();
        }
    }

    #[test]
    fn a_save_given_a_link_to_a_directory_saves_into_its_target() {
        let root = tempdir("link");
        std::fs::create_dir(root.join("v1")).unwrap();
        std::fs::write(root.join("v1/config.json"), "c").unwrap();
        symlink("v1", root.join("latest")).unwrap();
        save(&root.join("latest"), &[("model.safetensors", "new")], Commit::Exchange).unwrap();
        assert_eq!(std::fs::read_link(root.join("latest")).unwrap(), Path::new("v1"));
        assert_eq!(tree(&root.join("v1")).len(), 2);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_save_that_fails_before_the_commit_leaves_the_directory_as_it_was() {
        let root = tempdir("fail");
        let dir = root.join("ckpt");
        std::fs::create_dir(&dir).unwrap();
        old_checkpoint(&dir);
        let before = tree(&dir);
        let checkpoint = CheckpointDir::prepare(&dir, &["model.safetensors".into()], Commit::Exchange).unwrap();
        assert!(checkpoint.staged());
        let sink = checkpoint.sink("model.safetensors", 10, false).unwrap();
        sink.write_at(0, b"partial").unwrap();
        drop(sink);
        drop(checkpoint);
        assert_eq!(tree(&dir), before);
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 2); // ckpt, elsewhere.safetensors
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn what_saves_that_are_gone_left_is_removed_and_what_live_ones_hold_is_not() {
        let root = tempdir("stale");
        let dir = root.join("ckpt");
        std::fs::create_dir(&dir).unwrap();
        // A process id that is not running: beyond the kernel's limit.
        let dead = 4_194_305u32;
        std::fs::write(dir.join(format!(".model.safetensors.{dead}.0.tmp")), "stale").unwrap();
        std::fs::write(dir.join(format!(".notes.txt.{dead}.0.tmp")), "not ours").unwrap();
        std::fs::create_dir(root.join(format!(".ckpt.{dead}.3.tmp"))).unwrap();
        std::fs::create_dir(root.join(format!(".other.{dead}.3.tmp"))).unwrap();
        // A dead process id whose file is locked: a writer in another PID namespace.
        let held = dir.join(format!(".model-00001-of-00002.safetensors.{dead}.1.tmp"));
        std::fs::write(&held, "held").unwrap();
        let holder = File::open(&held).unwrap();
        assert!(lock(&holder, true));
        save(&dir, &[("model.safetensors", "new")], Commit::Exchange).unwrap();
        let names: Vec<String> = tree(&dir).into_keys().collect();
        assert_eq!(
            names,
            [
                format!(".model-00001-of-00002.safetensors.{dead}.1.tmp"),
                format!(".notes.txt.{dead}.0.tmp"),
                "model.safetensors".into()
            ]
        );
        let beside: Vec<String> = tree(&root).into_keys().filter(|n| !n.starts_with("ckpt")).collect();
        assert_eq!(beside, [format!(".other.{dead}.3.tmp")]);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn a_commit_by_renames_killed_between_them_is_finished_by_the_next_save() {
        // What a commit by renames killed between its renames leaves beside `dir`: the old
        // directory set aside and the complete new one, both of one (dead) process.
        let dead = 4_194_305u32;
        let killed = |root: &Path| {
            let new = root.join(format!(".ckpt.{dead}.3.tmp"));
            let old = root.join(format!(".{}.{dead}.4.tmp", aside_name("ckpt")));
            std::fs::create_dir(&new).unwrap();
            std::fs::create_dir(&old).unwrap();
            for (name, bytes) in [("model.safetensors", "new"), ("config.json", "config"), ("mine.txt", "mine")] {
                std::fs::write(new.join(name), bytes).unwrap();
            }
            for (name, bytes) in [("model.safetensors", "old"), ("config.json", "config"), ("mine.txt", "mine")] {
                std::fs::write(old.join(name), bytes).unwrap();
            }
            (new, old)
        };
        let listing = |entries: &[(&str, &str)]| {
            entries.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<std::collections::BTreeMap<_, _>>()
        };
        let new_checkpoint = listing(&[("config.json", "config"), ("mine.txt", "mine"), ("model.safetensors", "new")]);

        // The next save finds no `dir`: the killed commit is finished first (the new checkpoint
        // with the user's files in place, the old one gone), then the save replaces it.
        let root = tempdir("killed-rename");
        let dir = root.join("ckpt");
        killed(&root);
        finish_interrupted_commits(&dir);
        assert_eq!(tree(&root), tree_with_prefix("ckpt", &new_checkpoint));
        killed(&root);
        std::fs::remove_dir_all(&dir).unwrap();
        save(&dir, &[("model.safetensors", "newer")], Commit::Rename).unwrap();
        let newer = listing(&[("config.json", "config"), ("mine.txt", "mine"), ("model.safetensors", "newer")]);
        assert_eq!(tree(&root), tree_with_prefix("ckpt", &newer));

        // Killed after the second rename: `dir` is the new checkpoint, and the old one left
        // aside goes, what appeared in it meanwhile moved over first.
        std::fs::remove_dir_all(&dir).unwrap();
        let (new, old) = killed(&root);
        std::fs::rename(&new, &dir).unwrap();
        std::fs::write(old.join("late.txt"), "late").unwrap();
        finish_interrupted_commits(&dir);
        let mut with_late = new_checkpoint.clone();
        with_late.insert("late.txt".into(), "late".into());
        assert_eq!(tree(&root), tree_with_prefix("ckpt", &with_late));

        // No new directory to be found (two, or none): the old one goes back.
        std::fs::remove_dir_all(&dir).unwrap();
        let (new, _) = killed(&root);
        std::fs::remove_dir_all(&new).unwrap();
        finish_interrupted_commits(&dir);
        let old_checkpoint = listing(&[("config.json", "config"), ("mine.txt", "mine"), ("model.safetensors", "old")]);
        assert_eq!(tree(&root), tree_with_prefix("ckpt", &old_checkpoint));

        // A live process's aside is left alone.
        std::fs::remove_dir_all(&dir).unwrap();
        let live = root.join(format!(".{}.{}.9.tmp", aside_name("ckpt"), std::process::id()));
        std::fs::create_dir(&live).unwrap();
        finish_interrupted_commits(&dir);
        assert!(live.is_dir() && !dir.exists());
        std::fs::remove_dir_all(root).unwrap();
    }

    /// `entries` as [`tree`] lists them under directory `name`.
    fn tree_with_prefix(
        name: &str,
        entries: &std::collections::BTreeMap<String, String>,
    ) -> std::collections::BTreeMap<String, String> {
        let mut out: std::collections::BTreeMap<_, _> =
            entries.iter().map(|(k, v)| (format!("{name}/{k}"), v.clone())).collect();
        out.insert(name.to_owned(), "/".into());
        out
    }

    #[test]
    fn a_directory_in_the_way_of_a_file_is_refused_before_anything_is_written() {
        let root = tempdir("way");
        let dir = root.join("ckpt");
        std::fs::create_dir_all(dir.join("model.safetensors")).unwrap();
        let err = save(&dir, &[("model.safetensors", "new")], Commit::Exchange).unwrap_err().to_string();
        assert!(err.ends_with("ckpt/model.safetensors: create failed: Is a directory (os error 21)"), "{err}");
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 1);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn what_changed_in_the_old_directory_before_the_swap_is_brought_over() {
        let root = tempdir("late");
        let (old, new) = (root.join("old"), root.join("new"));
        for d in [&old, &new] {
            std::fs::create_dir_all(d.join("runs")).unwrap();
        }
        std::fs::write(old.join("runs/a"), "a").unwrap();
        std::fs::hard_link(old.join("runs/a"), new.join("runs/a")).unwrap(); // carried
        std::fs::write(old.join("trainer_state.json"), "v1").unwrap();
        std::fs::hard_link(old.join("trainer_state.json"), new.join("trainer_state.json")).unwrap();
        // Then, before the swap: a new file at the top and in a subdirectory, a file replaced.
        std::fs::write(old.join("late.txt"), "late").unwrap();
        std::fs::write(old.join("runs/b"), "b").unwrap();
        std::fs::write(old.join("state.tmp"), "v2").unwrap();
        std::fs::rename(old.join("state.tmp"), old.join("trainer_state.json")).unwrap();
        std::fs::write(old.join("model.safetensors"), "the old checkpoint").unwrap();
        std::fs::write(new.join("model.safetensors"), "the new checkpoint").unwrap();
        move_newcomers(&old, &new, true);
        let expected: Vec<(String, String)> = [
            ("late.txt", "late"),
            ("model.safetensors", "the new checkpoint"),
            ("runs", "/"),
            ("runs/a", "a"),
            ("runs/b", "b"),
            ("trainer_state.json", "v2"),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        assert_eq!(tree(&new).into_iter().collect::<Vec<_>>(), expected);
        std::fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn temporary_names_are_parsed_back() {
        assert_eq!(parse_temp_name(".model.safetensors.12.3.tmp"), Some(("model.safetensors", 12)));
        assert_eq!(parse_temp_name(".ckpt.1.0.tmp"), Some(("ckpt", 1)));
        for name in ["model.safetensors", ".x.1.tmp", ".x.a.1.tmp", "..1.2.tmp", ".x.1.2.tmpx"] {
            assert_eq!(parse_temp_name(name), None, "{name}");
        }
    }
}
