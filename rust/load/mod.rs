//! Loading: headers → plan → reads, for a set of files at once.
//!
//! ```no_run
//! use fastsafetensors::load::{plan_files, LoadOptions};
//! let loaded = plan_files(&["model-00001.safetensors".into()])?.read_to_host(&LoadOptions::default())?;
//! for t in &loaded.tensors {
//!     let bytes = loaded.bytes(t);
//!     println!("{} {} {:?}: {} bytes", t.name, t.dtype, t.shape, bytes.len());
//! }
//! # Ok::<(), fastsafetensors::Error>(())
//! ```

pub mod checkpoint;
pub mod device_stream;
pub mod fanout;
pub mod handle;
pub mod kept;
pub mod stream;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;

use crate::device::cufile::{self, CuFileApi};
use crate::device::driver::{Context, RawEvent};
use crate::device::gds::{self, GdsFile, GdsMode, GdsOptions, GdsOutcome};
use crate::device::staged::{self, StagedFile};
use crate::device::StagingOptions;
use crate::device::{CudaDevice, Device};
use crate::error::{Error, Result};
use crate::format::Header;
use crate::plan::select::Selection;
use crate::plan::{self, Extent, ExtentPolicy, Placement, IO_ALIGN};
use crate::settings;
use crate::source::direct::{self, BlockReader};
use crate::source::{self, budget, HostBuffer, HostRead, ReadPath, ReaderKind, Source};
use crate::verify::{FileCheck, Verifier};

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub reader: ReaderKind,
    /// Bytes per read request.
    pub block: u64,
    /// Largest gap between selected tensors that is read rather than skipped.
    pub max_gap: u64,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { reader: ReaderKind::Auto, block: plan::DEFAULT_BLOCK, max_gap: plan::DEFAULT_MAX_GAP }
    }
}

/// Files whose headers are validated and whose tensors are placed; nothing read yet.
pub struct Planned {
    pub sources: Vec<Arc<dyn Source>>,
    /// The tensors to load, in file then offset order.
    pub tensors: Vec<Placement>,
    /// A verified load: each file's check, fed by the reads (empty: not verified).
    pub checks: Checks,
}

/// The checks of a verified load, one per file.
#[derive(Clone, Default)]
pub struct Checks {
    pub files: Vec<Arc<FileCheck>>,
    /// Read the rest of a file a load reads in part, to check its digest.
    pub full: bool,
}

impl Checks {
    /// The checks of `sources` (whose headers are `headers`) against `verifier`.
    pub fn new(verifier: &Verifier, sources: &[Arc<dyn Source>], headers: &[&Header]) -> Result<Checks> {
        let files = sources.iter().zip(headers).map(|(s, h)| verifier.check_for(s.path(), h)).collect::<Result<_>>()?;
        Ok(Checks { files, full: verifier.full })
    }

    pub fn file(&self, i: usize) -> Option<&FileCheck> {
        self.files.get(i).map(|c| &**c)
    }

    /// Every file checked: the first that does not match is the error.
    pub fn finish(&self) -> Result<()> {
        self.files.iter().try_for_each(|c| c.finish())
    }

    /// For a load that reads `groups` (extents and the tensors each hands out) and nothing
    /// more (a stream, within its budget): tells each check which bytes the load hands out, and
    /// refuses, before anything is read, a selection that leaves out part of what a digest
    /// covers (a verified stream reads whole files, or whole shards and the header's).
    pub(crate) fn require_covered<'a>(
        &self,
        groups: impl Iterator<Item = (&'a Extent, &'a [Placement])> + Clone,
    ) -> Result<()> {
        for (file, check) in self.files.iter().enumerate() {
            let mine = groups.clone().filter(|(e, _)| e.file == file);
            let handed_out: Vec<(u64, u64)> =
                mine.clone().flat_map(|(_, tensors)| tensors.iter().map(|t| (t.offset, t.offset + t.nbytes))).collect();
            let Some(span) = check.hand_out(&handed_out) else { continue };
            if !covers(mine.map(|(e, _)| e), span) {
                return Err(Error::InvalidArgument(format!(
                    "{}: a verified stream hands out only what it checks, and this selection reads part of what {} \
                     has one digest for: stream the whole file, or load the selection with load(), whose full=True reads the rest to check it",
                    check.path().display(),
                    check.manifest()
                )));
            }
        }
        Ok(())
    }

    /// Makes `extents` read what the checks need, and tells each check which bytes the load
    /// hands out: a file read in part is read whole where its manifest has one digest for it
    /// (with `full`; without, an error before anything is read), or the whole of each shard
    /// holding bytes handed out, and of those holding the header.
    pub fn widen(&self, extents: Vec<Extent>, tensors: &[Placement], file_lens: &[u64]) -> Result<Vec<Extent>> {
        if self.files.is_empty() {
            return Ok(extents);
        }
        let mut out = Vec::with_capacity(extents.len());
        let mut rest = &extents[..];
        while let Some(first) = rest.first() {
            let file = first.file;
            let run = rest.iter().take_while(|e| e.file == file).count();
            let (mine, later) = rest.split_at(run);
            rest = later;
            let tensors_of = mine[0].tensors.start..mine[run - 1].tensors.end;
            let handed_out: Vec<(u64, u64)> =
                tensors[tensors_of.clone()].iter().map(|t| (t.offset, t.offset + t.nbytes)).collect();
            let check = &self.files[file];
            match check.hand_out(&handed_out) {
                Some(span) if !covers(mine, span) => {
                    if check.is_whole_file() && !self.full {
                        return Err(Error::PartialVerify {
                            path: check.path().to_owned(),
                            manifest: check.manifest().to_owned(),
                        });
                    }
                    let start = plan::align_down(span.0.min(first.start), IO_ALIGN);
                    let end =
                        plan::align_up(span.1.max(mine.iter().map(|e| e.start + e.len).max().unwrap_or(0)), IO_ALIGN);
                    debug_assert!(tensors[tensors_of.clone()].iter().all(|t| t.file == file));
                    out.push(Extent {
                        file,
                        start,
                        len: end - start,
                        expected: end.min(file_lens[file]) - start,
                        tensors: tensors_of,
                    });
                }
                _ => out.extend_from_slice(mine),
            }
        }
        Ok(out)
    }
}

/// Opens `paths`, validates every header and the names across files. Nothing is read until
/// every header is known to be good.
pub fn plan_files(paths: &[PathBuf]) -> Result<Planned> {
    let mut seen = HashSet::with_capacity(paths.len());
    if let Some(twice) = paths.iter().find(|p| !seen.insert(*p)) {
        return Err(Error::FileGivenTwice { path: twice.clone() });
    }
    plan_sources(source::open_all(paths)?)
}

/// Validates every source's header and the names across them.
pub fn plan_sources(sources: Vec<Arc<dyn Source>>) -> Result<Planned> {
    plan_verified(sources, None)
}

/// [`plan_sources`], every read of the load checked against `verifier` (if any): the
/// headers hashed are those the tensors are placed by.
pub fn plan_verified(sources: Vec<Arc<dyn Source>>, verifier: Option<&Verifier>) -> Result<Planned> {
    let headers = sources.iter().map(|s| s.header()).collect::<Result<Vec<Header>>>()?;
    let paths: Vec<PathBuf> = sources.iter().map(|s| s.path().to_owned()).collect();
    let tensors = plan::place(&paths, &headers)?;
    let checks = match verifier {
        Some(v) => Checks::new(v, &sources, &headers.iter().collect::<Vec<_>>())?,
        None => Checks::default(),
    };
    Ok(Planned { sources, tensors, checks })
}

/// Reads and validates one file's header without touching its data.
pub fn read_header(path: &Path) -> Result<Header> {
    source::open(path)?.header()
}

/// The selected tensors of a set of files, in host memory: one reference-counted buffer per
/// extent read, so that each tensor handed out can keep its own extent's buffer alive.
pub struct Loaded {
    /// One per extent.
    pub buffers: Vec<Arc<HostBuffer>>,
    pub extents: Vec<Extent>,
    pub tensors: Vec<Placement>,
    paths: Vec<ReadPath>,
}

impl Loaded {
    /// A buffer holding tensor `t`'s bytes, and their offset there. (Two extents can share
    /// the page where one ends and the next begins; either holds the file's bytes.)
    pub fn location(&self, t: &Placement) -> (usize, u64) {
        // Extents are in file then offset order and every tensor lies inside one.
        let after = self.extents.partition_point(|e| (e.file, e.start) <= (t.file, t.offset));
        let k = (0..after)
            .rev()
            .find(|&k| {
                self.extents[k].file == t.file && t.offset + t.nbytes <= self.extents[k].start + self.extents[k].len
            })
            .expect("every tensor lies in an extent");
        (k, self.extents[k].offset_of(t))
    }

    pub fn bytes(&self, t: &Placement) -> &[u8] {
        let (k, offset) = self.location(t);
        &self.buffers[k].as_slice()[offset as usize..(offset + t.nbytes) as usize]
    }

    /// How each file was read.
    pub fn read_paths(&self) -> Vec<ReadPath> {
        self.paths.clone()
    }
}

/// Options for loads into device memory.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceOptions {
    pub reader: ReaderKind,
    pub gds: GdsMode,
    pub staging: StagingOptions,
    pub gds_io: GdsOptions,
}

impl Planned {
    /// Keeps only the tensors `selection` asks for, cut to their row ranges. An exact filter
    /// naming tensors that are in none of the files is an error listing them.
    pub fn select(mut self, selection: &Selection) -> Result<Planned> {
        // Rows first, found by name among all the tensors: a row range of a tensor in no file
        // names that tensor, and cut tensors keep their names for the filter below.
        if !selection.rows.is_empty() {
            let index: HashMap<&str, usize> =
                self.tensors.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
            let mut cut = Vec::with_capacity(selection.rows.len());
            for r in &selection.rows {
                let Some(&i) = index.get(r.name.as_str()) else {
                    return Err(Error::NoSuchTensor { name: r.name.clone(), files: self.paths() });
                };
                let t = &self.tensors[i];
                let rows = t.rows(r.start, r.stop).map_err(|why| {
                    Error::InvalidArgument(format!("{}: {why}", self.sources[t.file].path().display()))
                })?;
                cut.push((i, rows));
            }
            for (i, rows) in cut {
                self.tensors[i] = rows;
            }
        }
        if let Some(filter) = &selection.filter {
            let missing = filter.missing(self.tensors.iter().map(|t| t.name.as_str()));
            if !missing.is_empty() {
                return Err(Error::MissingTensors { names: missing, files: self.paths() });
            }
            self.tensors.retain(|t| filter.matches(&t.name));
        }
        Ok(self)
    }

    /// The sources' paths, in file order.
    pub fn paths(&self) -> Vec<PathBuf> {
        self.sources.iter().map(|s| s.path().to_owned()).collect()
    }

    /// File lengths, in file order.
    pub fn file_lens(&self) -> Vec<u64> {
        self.sources.iter().map(|s| s.len()).collect()
    }

    /// Reads the selected tensors into host memory once it is known that the memory they
    /// need is there: mappings at once, direct reads in parallel on the I/O pool (which is
    /// not woken at all for a warm load, so its threads take no CPU from the caller's first
    /// touches). Each file's selected tensors are read as few extents: the whole file when
    /// everything is selected, else the selected ranges merged across small gaps.
    pub fn read_to_host(self, options: &LoadOptions) -> Result<Loaded> {
        let extents = self.host_extents(options)?;
        let verified = !self.checks.files.is_empty();
        let how = choose_reads(&self.sources, &extents, options.reader, true, verified)?;
        let readers = host_readers(&self.sources, &how)?;
        let read = |e: &Extent| -> Result<Arc<HostBuffer>> {
            match (&readers[e.file], how[e.file]) {
                (Some(reader), _) => direct::read_extent(reader, e, options.block, self.checks.file(e.file)),
                (None, h) => {
                    debug_assert!(!verified, "a verified load reads into its own memory");
                    let path = if h == HostRead::MapOverLimit { ReadPath::MmapFallback } else { ReadPath::Mmap };
                    Ok(Arc::new(source::map_extent(&*self.sources[e.file], e, path)?))
                }
            }
        };
        // A warm load maps its files without touching them, on the caller's thread; a verified
        // one hashes every page, so it runs on the pool, files in parallel.
        let buffers = if readers.iter().all(Option::is_none) && self.checks.files.is_empty() {
            extents.iter().map(read).collect::<Result<Vec<_>>>()
        } else {
            source::io_pool().install(|| extents.par_iter().map(read).collect::<Result<Vec<_>>>())
        }?;
        // How each file was read: a reader says so once its reads are done (a direct read
        // refused by the filesystem falls back to the page cache).
        let mut paths = vec![ReadPath::NotRead; self.sources.len()];
        for (e, b) in extents.iter().zip(&buffers) {
            paths[e.file] = readers[e.file].as_ref().map_or(b.read_path(), BlockReader::path);
        }
        for (src, &path) in self.sources.iter().zip(&paths) {
            if path != ReadPath::NotRead {
                src.check_unchanged()?;
            }
        }
        self.checks.finish()?;
        Ok(Loaded { buffers, extents, tensors: self.tensors, paths })
    }

    /// The extents a load into host memory reads: each file's selected tensors as few ranges
    /// as `options` allows, widened to what the checks of a verified load need.
    pub(crate) fn host_extents(&self, options: &LoadOptions) -> Result<Vec<Extent>> {
        let policy = ExtentPolicy { max_gap: options.max_gap, ..ExtentPolicy::default() };
        let extents = plan::plan_extents(&self.tensors, &self.file_lens(), &policy);
        self.checks.widen(extents, &self.tensors, &self.file_lens())
    }

    /// Bytes of memory file `i` needs: the file rounded up to whole aligned reads.
    pub fn device_len(&self, i: usize) -> u64 {
        plan::align_up(self.sources[i].len(), IO_ALIGN)
    }

    /// Bytes of device memory to allocate for file `i`: `device_len(i)` and room to start it
    /// at an aligned address whatever the allocation's alignment.
    pub fn device_alloc_len(&self, i: usize) -> u64 {
        self.device_len(i) + IO_ALIGN
    }

    /// Copies each target's file into its allocation (`device_alloc_len` bytes at `base`),
    /// through GPUDirect Storage where `options.gds` and `cufile` allow, else staged through
    /// `device`. `cufile` is the opened library, or why it is not available. Returns, per
    /// target, how the file was read and where in the allocation its byte 0 landed.
    pub fn copy_to_device<D: Device, A: CuFileApi>(
        &self,
        device: &D,
        cufile: std::result::Result<&A, &str>,
        targets: &[DeviceTarget],
        options: &DeviceOptions,
    ) -> Result<Vec<DeviceCopy>> {
        if let Some(t) = targets.iter().find(|t| t.file >= self.sources.len()) {
            return Err(Error::InvalidArgument(format!("no file {} (of {})", t.file, self.sources.len())));
        }
        // Each file starts at the first 4 KiB boundary in its allocation: cuFile registers
        // only aligned ranges without bouncing, and tensors keep the alignment the file gives.
        let dsts: Vec<u64> = targets.iter().map(|t| t.base.next_multiple_of(IO_ALIGN)).collect();
        let mut paths: Vec<Option<ReadPath>> = vec![None; targets.len()];
        // GPUDirect Storage moves the bytes past host memory, where nothing can hash them: a
        // verified load reads through the staging buffers.
        let verified = !self.checks.files.is_empty();
        if options.gds == GdsMode::Require && verified {
            return Err(Error::InvalidArgument(
                "a verified load hashes the bytes in host memory, which GPUDirect Storage bypasses: \
                 load without nogds=False"
                    .into(),
            ));
        }
        if options.gds != GdsMode::Never && !targets.is_empty() && !verified {
            let first = self.sources[targets[0].file].path();
            match cufile {
                Err(reason) if options.gds == GdsMode::Require => {
                    return Err(Error::GdsRequired { path: first.to_owned(), reason: reason.to_owned() })
                }
                Err(reason) => gds_fallback_notice(reason),
                // Compatibility mode reads through host memory like the staged path, but one
                // request at a time and without overlapping the copies: only when asked for.
                Ok(api) if api.compat_mode() && options.gds == GdsMode::Auto => {
                    gds_fallback_notice("cuFile runs in compatibility mode")
                }
                Ok(api) => {
                    let how = if api.compat_mode() { ReadPath::GdsCompat } else { ReadPath::Gds };
                    // cuFile reads through a file descriptor: other sources are staged.
                    let (gds_targets, files): (Vec<usize>, Vec<GdsFile>) = targets
                        .iter()
                        .zip(&dsts)
                        .enumerate()
                        .filter_map(|(k, (t, &dst))| {
                            let src = &self.sources[t.file];
                            let file = src.local().filter(|_| src.capabilities().gds)?;
                            Some((k, GdsFile { file, dst }))
                        })
                        .unzip();
                    let outcomes = gds::read_files(device, api, &files, &options.gds_io);
                    let failure = files.iter().zip(&outcomes).find_map(|(f, o)| match o {
                        GdsOutcome::Failed(reason) => Some((f.file.path().to_owned(), reason.clone())),
                        _ => None,
                    });
                    match failure {
                        Some((path, reason)) if options.gds == GdsMode::Require => {
                            return Err(Error::GdsRequired { path, reason })
                        }
                        Some((_, reason)) => gds_fallback_notice(&reason),
                        None => {}
                    }
                    for (&k, outcome) in gds_targets.iter().zip(&outcomes) {
                        if *outcome == GdsOutcome::Read {
                            paths[k] = Some(how);
                        }
                    }
                }
            }
        }
        let staged: Vec<(BlockReader, u64, Option<&FileCheck>)> = targets
            .iter()
            .zip(&dsts)
            .zip(&paths)
            .filter(|(_, done)| done.is_none())
            .map(|((t, &dst), _)| {
                let src = &self.sources[t.file];
                let direct = source::choose(&**src, options.reader)? == HostRead::Direct;
                Ok((BlockReader::open(Arc::clone(src), direct)?, dst, self.checks.file(t.file)))
            })
            .collect::<Result<Vec<_>>>()?;
        let staged_files: Vec<_> = staged
            .iter()
            .map(|(reader, dst, check)| StagedFile { check: *check, ..StagedFile::whole(reader, *dst) })
            .collect();
        let mut staged_paths = staged::copy_files(device, &staged_files, &options.staging)?.into_iter();
        targets.iter().try_for_each(|t| self.sources[t.file].check_unchanged())?;
        for t in targets {
            if let Some(check) = self.checks.file(t.file) {
                check.finish()?;
            }
        }
        Ok(paths
            .into_iter()
            .zip(targets.iter().zip(&dsts))
            .map(|(p, (t, &dst))| DeviceCopy {
                path: p.unwrap_or_else(|| staged_paths.next().expect("one path per staged file")),
                offset: dst - t.base,
            })
            .collect())
    }

    /// [`Planned::copy_to_device`] on CUDA device `ordinal`. `ready` is an event recorded on
    /// torch's current stream after the destinations were allocated: the copies are ordered
    /// after it (torch's caching allocator may hand out memory that work queued on that
    /// stream still uses). The calling thread's current context is left as it was.
    pub fn copy_to_cuda(
        &self,
        ordinal: usize,
        targets: &[DeviceTarget],
        options: &DeviceOptions,
        ready: Option<RawEvent>,
    ) -> Result<Vec<DeviceCopy>> {
        let ctx = Context::primary(ordinal)?;
        if targets.is_empty() {
            return Ok(Vec::new());
        }
        let device = CudaDevice::new(ctx, ready)?;
        // cuFile is opened only now that a context exists on a real device.
        let cufile = device.with_current(|| gds::cufile_for(options.gds))?;
        // Every copy has completed when this returns, on success and on error: the ring
        // drains its slots, and cuFile reads are synchronous.
        self.copy_to_device(&device, cufile, targets, options)
    }
}

/// Checks every setting the loader reads from the environment, so that a malformed one fails
/// the load with an error naming it instead of being ignored or read only by some loads.
pub fn check_env() -> Result<()> {
    ReaderKind::resolve(None)?;
    source::io_threads()?;
    budget::limit_from_env()?;
    budget::stream_limit_from_env()?;
    source::remote::RemoteSettings::from_env()?;
    source::cache::dir_from_env()?;
    // Read when GPUDirect Storage is tried; a path must name a file (a bare library name is
    // left to the dynamic loader's search).
    let library = |v: &str| (!v.contains('/') || Path::new(v).is_file()).then_some(());
    settings::setting(cufile::CUFILE_ENV, "the path of an existing cuFile library (libcufile.so.0)", library)?;
    Ok(())
}

/// Where a file goes: an allocation of `device_alloc_len(file)` bytes at device address `base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceTarget {
    pub file: usize,
    pub base: u64,
}

/// How a file reached the device, and where its byte 0 is: `base + offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCopy {
    pub path: ReadPath,
    pub offset: u64,
}

/// Frees the pinned staging buffers kept for later CUDA loads; returns how many there were.
pub fn release_staging_buffers() -> usize {
    crate::device::release_cuda_staging()
}

/// How each file is brought into host memory to read `extents` of it: a file with nothing to
/// read is not looked at. A verified load (`verified`) reads every file into memory of its
/// own, through the page cache where it would have mapped it. When the caller keeps
/// everything it reads (`keeps_all`), direct reads that would not fit in host memory are made
/// mappings ([`map_what_does_not_fit`]), but for a verified load, which fails instead.
pub(crate) fn choose_reads<'a>(
    sources: &[Arc<dyn Source>],
    extents: impl IntoIterator<Item = &'a Extent>,
    reader: ReaderKind,
    keeps_all: bool,
    verified: bool,
) -> Result<Vec<HostRead>> {
    let mut wanted = vec![0u64; sources.len()];
    for e in extents {
        wanted[e.file] += e.len;
    }
    let mut how = Vec::with_capacity(sources.len());
    for (src, &bytes) in sources.iter().zip(&wanted) {
        how.push(match (bytes, source::choose(&**src, reader)?) {
            (0, _) => HostRead::Map,
            (_, HostRead::Direct) => HostRead::Direct,
            (_, _) if verified => HostRead::Buffered,
            (_, h) => h,
        });
    }
    if keeps_all && verified {
        budget::check(wanted.iter().sum())?;
    } else if keeps_all {
        let mappable: Vec<bool> = sources.iter().map(|s| s.local().is_some() && s.capabilities().mmap).collect();
        map_what_does_not_fit(&mut how, &wanted, &mappable, reader)?;
    }
    Ok(how)
}

/// A reader for each file read into memory of the load's own (`how`); none for files mapped
/// or with nothing to read.
pub(crate) fn host_readers(sources: &[Arc<dyn Source>], how: &[HostRead]) -> Result<Vec<Option<BlockReader>>> {
    let open = |(src, &h): (&Arc<dyn Source>, &HostRead)| {
        h.owns_memory().then(|| BlockReader::open(Arc::clone(src), h == HostRead::Direct)).transpose()
    };
    sources.iter().zip(how).map(open).collect()
}

/// Makes the direct reads of a load fit the host-memory limit. With the `auto` reader, files
/// are mapped instead, from the last, until the rest fit: a mapping is page cache the kernel
/// can reclaim, so a load larger than memory still succeeds, as it does with safetensors.
/// An explicit `direct` reader is not overridden: it fails with a clear error instead.
/// Only local files can be mapped (`mappable`): a remote object is always read.
fn map_what_does_not_fit(how: &mut [HostRead], wanted: &[u64], mappable: &[bool], reader: ReaderKind) -> Result<()> {
    let mut owned: u64 = (0..how.len()).filter(|&i| how[i] == HostRead::Direct).map(|i| wanted[i]).sum();
    if reader != ReaderKind::Auto {
        return budget::check(owned);
    }
    let Some((limit, _)) = budget::host_limit()? else { return Ok(()) };
    for i in (0..how.len()).rev() {
        if owned <= limit {
            break;
        }
        if how[i] == HostRead::Direct && mappable[i] {
            how[i] = HostRead::MapOverLimit;
            owned -= wanted[i];
        }
    }
    Ok(())
}

/// Whether `extents` (of one file, in offset order) read every byte of `[span.0, span.1)`.
pub(crate) fn covers<'a>(extents: impl IntoIterator<Item = &'a Extent>, span: (u64, u64)) -> bool {
    let mut reached = span.0;
    for e in extents {
        if e.start <= reached {
            reached = reached.max(e.start + e.expected);
        }
    }
    reached >= span.1
}

/// Says once per process why GPUDirect Storage is not used.
fn gds_fallback_notice(reason: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| eprintln!("fastsafetensors: GPUDirect Storage not used ({reason}); using the staged path"));
}
