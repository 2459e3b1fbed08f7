//! Files held open across loads: what a `safe_open` handle reads from.
//!
//! ```no_run
//! use fastsafetensors::load::handle::OpenFiles;
//! use fastsafetensors::load::LoadOptions;
//! let files = OpenFiles::open(&["model.safetensors".into()])?;
//! // Later, whatever became of the path meanwhile: rows 0..2 of one tensor, from the file opened.
//! let planned = files.plan_rows("model.safetensors".as_ref(), "lm_head.weight", 0, 2)?;
//! let loaded = planned.read_to_host(&LoadOptions::default())?;
//! # Ok::<(), fastsafetensors::Error>(())
//! ```
//!
//! [`OpenFiles`] opens its files once and parses their headers once; every later load of it
//! reads those open files with those headers. So a file replaced on disk after opening
//! (`os.replace`, as the Hugging Face Hub client does) or deleted is still read as it was
//! opened, as safetensors (which maps the file when opening it) does, and a tensor is found by
//! a hash lookup: the cost of a row range does not grow with the files' tensor count. A file
//! changed in place (the same inode written to) still fails the next read with
//! [`Error::Changed`] or [`Error::Truncated`]: its bytes would mix two versions.
//!
//! [`Handles`] numbers open sets of files for the FFI, which passes integers, not objects.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{Error, Result};
use crate::format::Header;
use crate::load::{checkpoint, Checks, Planned};
use crate::plan::{self, Placement};
use crate::source::{self, Source};
use crate::verify::{FileCheck, Verifier};

/// Files opened together, with their headers and where each tensor is.
pub struct OpenFiles {
    sources: Vec<Arc<dyn Source>>,
    headers: Vec<Header>,
    /// Every tensor of every file, in file then offset order.
    tensors: Vec<Placement>,
    /// Each file's tensors, as a range of `tensors`.
    file_tensors: Vec<Range<usize>>,
    by_name: HashMap<String, usize>,
    /// What every load of these files is verified against (`None`: not verified).
    verifier: Option<Verifier>,
    /// The checks of the shared load planned last from these files ([`OpenFiles::share_checks`]):
    /// what this rank hashes of the files it checks for the group, fed in file order.
    shared_checks: Mutex<Checks>,
}

impl OpenFiles {
    /// Opens `paths`, each one `.safetensors` file, and validates their headers and the names
    /// across them (a name in two files is an error).
    pub fn open(paths: &[PathBuf]) -> Result<OpenFiles> {
        Self::open_cached(paths, None)
    }

    /// [`OpenFiles::open`], with `cache_dir` as the cache of the URLs' objects (`None`: the
    /// one `$FASTSAFETENSORS_CACHE_DIR` names, if any).
    pub fn open_cached(paths: &[PathBuf], cache_dir: Option<&Path>) -> Result<OpenFiles> {
        for path in paths {
            checkpoint::check_single_file(path)?;
        }
        let open = |path: &PathBuf| source::open_cached(path, cache_dir);
        // Opening an object costs a round trip (its first GET): the objects of a checkpoint
        // are opened at once, not one after another. The first error in file order is the one
        // returned.
        let sources = if paths.iter().any(|p| source::remote::is_url(p)) {
            use rayon::prelude::*;
            let opened: Vec<Result<_>> = source::io_pool().install(|| paths.par_iter().map(open).collect());
            opened.into_iter().collect::<Result<Vec<_>>>()?
        } else {
            paths.iter().map(open).collect::<Result<Vec<_>>>()?
        };
        Self::from_sources(sources)
    }

    /// The same over sources already open.
    pub fn from_sources(sources: Vec<Arc<dyn Source>>) -> Result<OpenFiles> {
        let headers = sources.iter().map(|s| s.header()).collect::<Result<Vec<Header>>>()?;
        let paths: Vec<PathBuf> = sources.iter().map(|s| s.path().to_owned()).collect();
        let tensors = plan::place(&paths, &headers)?;
        let mut file_tensors = vec![0..0; sources.len()];
        let mut start = 0;
        for (file, header) in headers.iter().enumerate() {
            file_tensors[file] = start..start + header.tensors.len();
            start += header.tensors.len();
        }
        let by_name = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(OpenFiles {
            sources,
            headers,
            tensors,
            file_tensors,
            by_name,
            verifier: None,
            shared_checks: Mutex::new(Checks::default()),
        })
    }

    /// Every later load of these files verified against `verifier`: a file the manifest does
    /// not list (or whose size differs from what it lists) is an error now.
    pub fn verified(mut self, verifier: Verifier) -> Result<OpenFiles> {
        Checks::new(&verifier, &self.sources, &self.headers.iter().collect::<Vec<_>>())?;
        checkpoint::check_verified(
            &verifier.checkpoints,
            &self.sources.iter().map(|s| s.path()).collect::<Vec<_>>(),
            &verifier,
        )?;
        self.verifier = Some(verifier);
        Ok(self)
    }

    /// Keeps `checks`, those of a shared load just planned from these files (which know the
    /// bytes the load hands out), for [`OpenFiles::check_shared`] to feed: the files this rank
    /// checks for the group.
    pub fn share_checks(&self, checks: Checks) {
        *self.shared_checks.lock().unwrap_or_else(PoisonError::into_inner) = checks;
    }

    /// File `path`'s check in the shared load planned last (an error if it is not verified).
    fn shared_check(&self, path: &Path) -> Result<Arc<FileCheck>> {
        let checks = self.shared_checks.lock().unwrap_or_else(PoisonError::into_inner);
        checks.files.iter().find(|c| c.path() == path).cloned().ok_or_else(|| {
            Error::InvalidArgument(format!("{}: no verified shared load of it was planned from this handle", path.display()))
        })
    }

    /// Feeds `bytes`, file `path`'s from `offset` on, to its check in the shared load planned
    /// last (what the rank checking a file does with each buffer of it, in order, once the
    /// exchange has filled it). A digest those bytes complete that does not match is the error.
    pub fn check_shared(&self, path: &Path, offset: u64, bytes: &[u8]) -> Result<()> {
        let check = self.shared_check(path)?;
        check.landed_transient(offset, bytes);
        if check.has_failed() {
            return check.finish();
        }
        Ok(())
    }

    /// Whether file `path` is what the manifest says, once every buffer of it was fed
    /// ([`FileCheck::finish`]).
    pub fn finish_shared(&self, path: &Path) -> Result<()> {
        self.shared_check(path)?.finish()
    }

    /// The checks of a load of files `files` (indexes), fresh for each load.
    fn checks(&self, files: &[usize]) -> Result<Checks> {
        let Some(verifier) = &self.verifier else { return Ok(Checks::default()) };
        let sources: Vec<_> = files.iter().map(|&f| Arc::clone(&self.sources[f])).collect();
        Checks::new(verifier, &sources, &files.iter().map(|&f| &self.headers[f]).collect::<Vec<_>>())
    }

    /// Stops the reads of these files in flight (a load given up: interrupted, or its handle
    /// cancelled), and fails the later ones.
    pub fn cancel(&self) {
        self.sources.iter().for_each(|s| s.cancel());
    }

    /// The index of file `path` among those opened; an error for a file not opened here.
    fn file(&self, path: &Path) -> Result<usize> {
        self.sources.iter().position(|s| s.path() == path).ok_or_else(|| {
            Error::InvalidArgument(format!("{}: not one of the files this handle opened", path.display()))
        })
    }

    /// File `path` as it was opened.
    pub fn source(&self, path: &Path) -> Result<&Arc<dyn Source>> {
        Ok(&self.sources[self.file(path)?])
    }

    /// The header of file `path` as it was when opened.
    pub fn header(&self, path: &Path) -> Result<&Header> {
        Ok(&self.headers[self.file(path)?])
    }

    /// Every tensor of the files `paths` (some of those opened, in any order): a plan that
    /// reads the open files, numbered in the order of `paths`.
    pub fn plan(&self, paths: &[PathBuf]) -> Result<Planned> {
        let files = paths.iter().map(|p| self.file(p)).collect::<Result<Vec<usize>>>()?;
        let mut tensors = Vec::with_capacity(files.iter().map(|&f| self.file_tensors[f].len()).sum());
        for (k, &f) in files.iter().enumerate() {
            tensors
                .extend(self.tensors[self.file_tensors[f].clone()].iter().map(|t| Placement { file: k, ..t.clone() }));
        }
        let sources = files.iter().map(|&f| Arc::clone(&self.sources[f])).collect();
        Ok(Planned { sources, tensors, checks: self.checks(&files)? })
    }

    /// Rows `[start, stop)` of tensor `name` of file `path`: a plan that reads only their
    /// bytes, found by name (a lookup, whatever the number of tensors).
    pub fn plan_rows(&self, path: &Path, name: &str, start: u64, stop: u64) -> Result<Planned> {
        let file = self.file(path)?;
        let missing = || Error::NoSuchTensor { name: name.to_owned(), files: vec![path.to_owned()] };
        let t = self.by_name.get(name).map(|&i| &self.tensors[i]).filter(|t| t.file == file).ok_or_else(missing)?;
        let rows = t.rows(start, stop).map_err(|why| Error::InvalidArgument(format!("{}: {why}", path.display())))?;
        Ok(Planned {
            sources: vec![Arc::clone(&self.sources[file])],
            tensors: vec![Placement { file: 0, ..rows }],
            checks: self.checks(&[file])?,
        })
    }
}

/// Open sets of files by number: what the FFI hands out for an [`OpenFiles`], and takes back.
pub struct Handles {
    next: AtomicI64,
    open: Mutex<BTreeMap<i64, Arc<OpenFiles>>>,
}

impl Default for Handles {
    fn default() -> Self {
        Self::new()
    }
}

impl Handles {
    pub const fn new() -> Handles {
        Handles { next: AtomicI64::new(1), open: Mutex::new(BTreeMap::new()) }
    }

    /// Keeps `files` open under a new number (never 0 or negative, never reused).
    pub fn insert(&self, files: OpenFiles) -> i64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.table().insert(id, Arc::new(files));
        id
    }

    /// The files open under `id`. Loads running from them keep them open after `remove`.
    pub fn get(&self, id: i64) -> Result<Arc<OpenFiles>> {
        let closed = || Error::InvalidArgument(format!("handle {id} is closed (or was never opened)"));
        self.table().get(&id).cloned().ok_or_else(closed)
    }

    /// Lets go of the files open under `id`; false if none were.
    pub fn remove(&self, id: i64) -> bool {
        self.table().remove(&id).is_some()
    }

    /// The table. A panic while it was held cannot leave it half-changed (each change is one
    /// call on the map), so a poisoned lock is taken as it is.
    fn table(&self) -> std::sync::MutexGuard<'_, BTreeMap<i64, Arc<OpenFiles>>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
