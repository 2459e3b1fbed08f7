//! The FFI surface for the C++ torch extension: the only `#[cxx::bridge]` in the crate.
//!
//! Every exported function runs inside [`guard`], which turns a panic into an error: a
//! panic that unwound into C++ would abort the Python process.

// cxx hands vectors across as `&Vec`, not slices.
#![allow(clippy::ptr_arg)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::device::driver::{self, Context, RawEvent};
use crate::device::gds::GdsMode;
use crate::device::CudaDevice;
use crate::error::{Error, Result};
use crate::load::checkpoint::{self, Checkpoint};
use crate::load::device_stream::{Copier, DeviceStream};
use crate::load::stream::{self, Group, StreamOptions};
use crate::load::{self, DeviceCopy, DeviceOptions, DeviceTarget, LoadOptions, Loaded, Planned};
use crate::plan::select::{MatchMode, RowRange, Selection, TensorFilter};
use crate::plan::{self, Placement};
use crate::source::{budget, HostBuffer, LocalFile, ReaderKind};

#[cxx::bridge(namespace = "fastsafetensors::rs")]
mod ffi {
    /// One tensor: `nbytes` at `offset` in buffer `buffer` (a file's, or for loaded tensors
    /// one extent's), with its safetensors dtype name.
    struct TensorSpec {
        name: String,
        dtype: String,
        shape: Vec<i64>,
        buffer: usize,
        offset: usize,
        nbytes: usize,
        /// False when the data is not aligned to its element size and must be copied.
        aligned: bool,
    }

    /// How a file reached the device, and where in its allocation its byte 0 landed.
    struct FileCopy {
        path: String,
        offset: usize,
    }

    /// The files a path given to a load stands for, and what is wrong with them.
    struct CheckpointSpec {
        files: Vec<String>,
        /// The index the files come from; empty if none.
        index: String,
        problems: Vec<String>,
    }

    /// Which tensors a load reads.
    struct TensorSelection {
        /// False: every tensor (`patterns` and `mode` are not looked at).
        filtered: bool,
        patterns: Vec<String>,
        /// "exact", "glob" or "regex".
        mode: String,
    }

    struct MetadataEntry {
        key: String,
        value: String,
    }

    /// A file's header: tensors in offset order (offsets relative to the file start).
    struct HeaderSpec {
        has_metadata: bool,
        metadata: Vec<MetadataEntry>,
        tensors: Vec<TensorSpec>,
    }

    extern "Rust" {
        /// Validated files, not yet read.
        type PlannedFiles;
        /// The files' tensors in host memory.
        type LoadedFiles;
        /// Tensors handed out in groups as their bytes arrive.
        type TensorStream;
        /// Groups of tensors copied to a CUDA device one after the other.
        type DeviceTensorStream;
        /// A reference on one file's host buffer; the buffer is freed when the last drops.
        type BufferRef;

        /// Opens `paths`, validates their headers and keeps the tensors `selection` picks (no
        /// data is read). Tensor buffers are files; offsets are file offsets.
        fn plan_files(paths: &Vec<String>, selection: &TensorSelection) -> Result<Box<PlannedFiles>>;
        fn tensors(self: &PlannedFiles) -> &Vec<TensorSpec>;
        fn file_count(self: &PlannedFiles) -> usize;
        /// Bytes of device memory to allocate for file `index`.
        fn device_alloc_len(self: &PlannedFiles, index: usize) -> usize;
        /// Reads file `files[i]` into the allocation at device address `bases[i]` on CUDA
        /// device `ordinal`; returns how each was read and where its byte 0 landed. `nogds`:
        /// -1 unset (auto), 0 false (require GDS), 1 true. `ready`: a CUevent recorded on
        /// torch's current stream after the allocations (0: none); the copies come after it.
        fn copy_to_cuda(
            self: &PlannedFiles,
            ordinal: usize,
            files: &Vec<usize>,
            bases: &Vec<u64>,
            reader: &str,
            nogds: i32,
            ready: u64,
        ) -> Result<Vec<FileCopy>>;
        /// Frees the pinned staging buffers kept for later CUDA loads; returns how many.
        fn release_staging_buffers() -> usize;

        /// Reads the planned tensors into host memory with `reader` ("auto", "direct", "mmap",
        /// or "" for the default): each file's selected byte ranges, as few buffers (extents).
        fn read_to_host(planned: Box<PlannedFiles>, reader: &str) -> Result<Box<LoadedFiles>>;
        /// Loads rows `[start, stop)` of tensor `name` of `path` into host memory, reading
        /// only their bytes.
        fn load_rows(path: &str, name: &str, start: u64, stop: u64, reader: &str) -> Result<Box<LoadedFiles>>;
        /// The tensors: buffers are those of `buffer()`, offsets are within them.
        fn tensors(self: &LoadedFiles) -> &Vec<TensorSpec>;
        /// How each file was read: "direct", "buffered", "mmap", "mmap-fallback" (mapped: direct
        /// reads would not fit in host memory) or "none" (nothing selected in it).
        fn read_paths(self: &LoadedFiles) -> Vec<String>;
        fn buffer_count(self: &LoadedFiles) -> usize;
        fn buffer(self: &LoadedFiles, index: usize) -> Box<BufferRef>;
        /// Index of the file buffer `index` holds bytes of.
        fn buffer_file(self: &LoadedFiles, index: usize) -> usize;
        /// Address of the first byte of the buffer.
        fn address(self: &BufferRef) -> usize;

        /// Names of the tensors `selection` picks from `paths`, in read order (headers only).
        fn selected_names(paths: &Vec<String>, selection: &TensorSelection) -> Result<Vec<String>>;
        /// A streaming load of the selected tensors of `paths` into host memory, holding at
        /// most `max_memory` ("" for `$FASTSAFETENSORS_MAX_MEMORY` or the default) of buffers.
        fn open_stream(
            paths: &Vec<String>,
            reader: &str,
            selection: &TensorSelection,
            max_memory: &str,
        ) -> Result<Box<TensorStream>>;
        /// Waits for the next group of tensors; false after the last.
        fn next_group(self: &mut TensorStream) -> Result<bool>;
        /// The current group's tensors, all in buffer 0: `group_buffer()`.
        fn group_tensors(self: &TensorStream) -> &Vec<TensorSpec>;
        fn group_buffer(self: &TensorStream) -> Result<Box<BufferRef>>;
        /// How the current group was read: "direct", "buffered", "mmap" or "mmap-fallback" (""
        /// before the first).
        fn group_read_path(self: &TensorStream) -> &str;
        /// Index of the file of the current group among the files `paths` stand for (-1
        /// before the first), and its path.
        fn group_file(self: &TensorStream) -> i64;
        fn group_path(self: &TensorStream) -> String;
        /// Tensors and bytes of tensor data the stream hands out in all.
        fn tensor_count(self: &TensorStream) -> usize;
        fn byte_count(self: &TensorStream) -> u64;

        /// A streaming load of the selected tensors of `paths` to CUDA device `ordinal`: the
        /// caller allocates each group's memory (`alloc_len`), `submit`s its copy (which runs in
        /// the background, through the pinned staging ring, ordered after the CUevent `ready`
        /// recorded on torch's stream, 0 for none) and `wait`s for it.
        fn open_device_stream(
            paths: &Vec<String>,
            reader: &str,
            selection: &TensorSelection,
            max_memory: &str,
            ordinal: usize,
        ) -> Result<Box<DeviceTensorStream>>;
        fn group_count(self: &DeviceTensorStream) -> usize;
        /// Device memory the groups submitted ahead may take together (`u64::MAX`: no limit).
        fn budget(self: &DeviceTensorStream) -> u64;
        /// Bytes to allocate for group `k`.
        fn alloc_len(self: &DeviceTensorStream, k: usize) -> Result<usize>;
        /// Group `k`'s tensors: offsets from where the group's first byte lands.
        fn group_specs(self: &DeviceTensorStream, k: usize) -> Result<Vec<TensorSpec>>;
        /// Index and path of the file group `k` is read from.
        fn group_file(self: &DeviceTensorStream, k: usize) -> Result<i64>;
        fn group_path(self: &DeviceTensorStream, k: usize) -> Result<String>;
        fn submit(self: &DeviceTensorStream, k: usize, base: u64, ready: u64) -> Result<()>;
        /// Waits for group `k`'s copy: how it was read and where in its allocation it landed.
        fn wait(self: &DeviceTensorStream, k: usize) -> Result<FileCopy>;
        fn tensor_count(self: &DeviceTensorStream) -> usize;
        fn byte_count(self: &DeviceTensorStream) -> u64;

        /// Number of CUDA devices; an error naming the reason when there is no driver.
        fn cuda_device_count() -> Result<usize>;
        /// Reads and validates one file's header without reading its data.
        fn read_header(path: &str) -> Result<HeaderSpec>;
        /// Fraction of the file's pages in the page cache (what `auto` decides by).
        fn resident_fraction(path: &str) -> Result<f64>;
        /// The files `path` (a file, checkpoint directory or index) stands for, with every
        /// problem found in their headers against each other and the index.
        fn checkpoint(path: &str) -> Result<CheckpointSpec>;
    }
}

use ffi::{CheckpointSpec, FileCopy, HeaderSpec, MetadataEntry, TensorSelection, TensorSpec};

pub struct PlannedFiles {
    planned: Planned,
    specs: Vec<TensorSpec>,
}

pub struct LoadedFiles {
    loaded: Loaded,
    specs: Vec<TensorSpec>,
}

pub struct BufferRef(Arc<HostBuffer>);

pub struct DeviceTensorStream(Copier);

pub struct TensorStream {
    stream: stream::TensorStream,
    group: Option<Group>,
    specs: Vec<TensorSpec>,
}

/// Runs `f`, turning a panic into [`Error::Panic`].
fn guard<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(Error::from_panic(payload)))
}

/// The spec of tensor `t`, which starts at `offset` in buffer `buffer`. Takes the name from
/// `name` (moved, not copied, where the placement is not needed any more).
fn spec_at(t: &Placement, name: String, buffer: usize, offset: u64) -> Result<TensorSpec> {
    let shape = t
        .shape
        .iter()
        .map(|&d| {
            i64::try_from(d)
                .map_err(|_| Error::InvalidArgument(format!("tensor '{name}': dimension {d} does not fit in i64")))
        })
        .collect::<Result<_>>()?;
    Ok(TensorSpec {
        name,
        dtype: t.dtype.name().to_owned(),
        shape,
        buffer,
        offset: offset as usize,
        nbytes: t.nbytes as usize,
        aligned: t.aligned,
    })
}

/// Specs of tensors read as whole files: buffer `i` is file `i`, offsets are file offsets.
fn specs(tensors: &[Placement]) -> Result<Vec<TensorSpec>> {
    tensors.iter().map(|t| spec_at(t, t.name.clone(), t.file, t.offset)).collect()
}

/// Specs of loaded tensors: buffer `k` is extent `k`. The names move into the specs: only
/// the buffers of `loaded` are used afterwards.
fn loaded_specs(loaded: &mut Loaded) -> Result<Vec<TensorSpec>> {
    let mut out = Vec::with_capacity(loaded.tensors.len());
    for (k, e) in loaded.extents.iter().enumerate() {
        for t in &mut loaded.tensors[e.tensors.clone()] {
            let name = std::mem::take(&mut t.name);
            out.push(spec_at(t, name, k, e.offset_of(t))?);
        }
    }
    Ok(out)
}

impl TensorSelection {
    fn to_selection(&self) -> Result<Selection> {
        if !self.filtered {
            return Ok(Selection::all());
        }
        let mode: MatchMode = self.mode.parse()?;
        Ok(Selection::filtered(TensorFilter::new(mode, &self.patterns)?))
    }
}

fn reader_kind(reader: &str) -> Result<ReaderKind> {
    ReaderKind::resolve(Some(reader).filter(|r| !r.is_empty()))
}

/// Every load starts here: settings checked, paths resolved to files (directories and
/// indexes expanded), headers validated, and the tensors checked against any index.
fn plan(paths: &[String]) -> Result<Planned> {
    load::check_env()?;
    let checkpoints = checkpoint::resolve_all(&paths.iter().map(PathBuf::from).collect::<Vec<_>>())?;
    let planned = load::plan_files(&checkpoint::files(&checkpoints))?;
    checkpoint::check_placed(&checkpoints, &planned.tensors)?;
    Ok(planned)
}

/// The plan of `paths` narrowed to what `selection` picks.
fn plan_selected(paths: &[String], selection: &TensorSelection) -> Result<Planned> {
    plan(paths)?.select(&selection.to_selection()?)
}

/// The options of a stream: the reader and the `max_memory` budget ("" for the default).
fn stream_options(reader: &str, max_memory: &str) -> Result<StreamOptions> {
    let budget = budget::stream_budget(Some(max_memory).filter(|m| !m.is_empty()))?;
    Ok(StreamOptions { reader: reader_kind(reader)?, ..StreamOptions::with_budget(budget) })
}

fn load_options(reader: &str) -> Result<LoadOptions> {
    Ok(LoadOptions { reader: reader_kind(reader)?, ..LoadOptions::default() })
}

/// The CUevent handed over by the extension (0: none).
///
/// # Safety
/// The extension must keep the event alive until the copies ordered after it have been waited for.
unsafe fn ready_event(ready: u64) -> Option<RawEvent> {
    // SAFETY: the caller's contract.
    (ready != 0).then(|| unsafe { RawEvent::from_raw(ready) })
}

impl From<DeviceCopy> for FileCopy {
    fn from(c: DeviceCopy) -> FileCopy {
        FileCopy { path: c.path.name().to_owned(), offset: c.offset as usize }
    }
}

impl LoadedFiles {
    fn new(mut loaded: Loaded) -> Result<Box<LoadedFiles>> {
        let specs = loaded_specs(&mut loaded)?;
        Ok(Box::new(LoadedFiles { loaded, specs }))
    }
}

fn plan_files(paths: &Vec<String>, selection: &TensorSelection) -> Result<Box<PlannedFiles>> {
    guard(|| {
        let planned = plan_selected(paths, selection)?;
        let specs = specs(&planned.tensors)?;
        Ok(Box::new(PlannedFiles { planned, specs }))
    })
}

impl PlannedFiles {
    fn tensors(&self) -> &Vec<TensorSpec> {
        &self.specs
    }

    fn file_count(&self) -> usize {
        self.planned.sources.len()
    }

    fn device_alloc_len(&self, index: usize) -> usize {
        self.planned.device_alloc_len(index) as usize
    }

    #[allow(clippy::too_many_arguments)]
    fn copy_to_cuda(
        &self,
        ordinal: usize,
        files: &Vec<usize>,
        bases: &Vec<u64>,
        reader: &str,
        nogds: i32,
        ready: u64,
    ) -> Result<Vec<FileCopy>> {
        guard(|| {
            if files.len() != bases.len() {
                return Err(Error::InvalidArgument(format!("{} allocations for {} files", bases.len(), files.len())));
            }
            let gds = GdsMode::from_nogds(match nogds {
                0 => Some(false),
                1 => Some(true),
                _ => None,
            });
            let options = DeviceOptions { reader: reader_kind(reader)?, gds, ..DeviceOptions::default() };
            let targets: Vec<_> = files.iter().zip(bases).map(|(&file, &base)| DeviceTarget { file, base }).collect();
            // SAFETY: the extension keeps the event alive until this call returns.
            let ready = unsafe { ready_event(ready) };
            let copies = self.planned.copy_to_cuda(ordinal, &targets, &options, ready)?;
            Ok(copies.into_iter().map(FileCopy::from).collect())
        })
    }
}

fn release_staging_buffers() -> usize {
    guard(|| Ok(load::release_staging_buffers())).unwrap_or(0)
}

fn read_to_host(planned: Box<PlannedFiles>, reader: &str) -> Result<Box<LoadedFiles>> {
    guard(|| LoadedFiles::new(planned.planned.read_to_host(&load_options(reader)?)?))
}

fn load_rows(path: &str, name: &str, start: u64, stop: u64, reader: &str) -> Result<Box<LoadedFiles>> {
    guard(|| {
        let exact = TensorFilter::new(MatchMode::Exact, &[name])?;
        let selection = Selection { filter: Some(exact), rows: vec![RowRange { name: name.to_owned(), start, stop }] };
        checkpoint::check_single_file(Path::new(path))?;
        LoadedFiles::new(plan(&[path.to_owned()])?.select(&selection)?.read_to_host(&load_options(reader)?)?)
    })
}

fn selected_names(paths: &Vec<String>, selection: &TensorSelection) -> Result<Vec<String>> {
    guard(|| Ok(plan_selected(paths, selection)?.tensors.into_iter().map(|t| t.name).collect()))
}

fn open_stream(
    paths: &Vec<String>,
    reader: &str,
    selection: &TensorSelection,
    max_memory: &str,
) -> Result<Box<TensorStream>> {
    guard(|| {
        let stream = stream::TensorStream::open(plan_selected(paths, selection)?, stream_options(reader, max_memory)?)?;
        Ok(Box::new(TensorStream { stream, group: None, specs: Vec::new() }))
    })
}

fn open_device_stream(
    paths: &Vec<String>,
    reader: &str,
    selection: &TensorSelection,
    max_memory: &str,
    ordinal: usize,
) -> Result<Box<DeviceTensorStream>> {
    guard(|| {
        let stream = DeviceStream::open(plan_selected(paths, selection)?, &stream_options(reader, max_memory)?)?;
        let copier = Copier::start(stream, move |ready| {
            // SAFETY: the extension keeps the event alive until it has waited for this copy.
            let ready = unsafe { ready_event(ready) };
            Ok(Box::new(CudaDevice::new(Context::primary(ordinal)?, ready)?))
        })?;
        Ok(Box::new(DeviceTensorStream(copier)))
    })
}

impl DeviceTensorStream {
    fn stream(&self) -> &DeviceStream {
        self.0.stream()
    }

    fn check(&self, k: usize) -> Result<()> {
        let count = self.stream().group_count();
        if k < count {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!("no group {k} (of {count})")))
        }
    }

    fn group_count(&self) -> usize {
        self.stream().group_count()
    }

    fn budget(&self) -> u64 {
        self.stream().budget()
    }

    fn alloc_len(&self, k: usize) -> Result<usize> {
        guard(|| self.check(k).map(|()| self.stream().alloc_len(k) as usize))
    }

    fn group_specs(&self, k: usize) -> Result<Vec<TensorSpec>> {
        guard(|| {
            self.check(k)?;
            let stream = self.stream();
            stream.tensors(k).iter().map(|t| spec_at(t, t.name.clone(), 0, stream.offset_of(k, t))).collect()
        })
    }

    fn group_file(&self, k: usize) -> Result<i64> {
        guard(|| self.check(k).map(|()| self.stream().file(k).0 as i64))
    }

    fn group_path(&self, k: usize) -> Result<String> {
        guard(|| self.check(k).map(|()| self.stream().file(k).1.display().to_string()))
    }

    fn submit(&self, k: usize, base: u64, ready: u64) -> Result<()> {
        guard(|| self.0.submit(k, base, ready))
    }

    fn wait(&self, k: usize) -> Result<FileCopy> {
        guard(|| Ok(self.0.wait(k)?.into()))
    }

    fn tensor_count(&self) -> usize {
        self.stream().tensor_count()
    }

    fn byte_count(&self) -> u64 {
        self.stream().byte_count()
    }
}

impl TensorStream {
    fn next_group(&mut self) -> Result<bool> {
        guard(|| {
            self.group = None;
            self.specs.clear();
            let Some(mut group) = self.stream.next_group()? else { return Ok(false) };
            let mut specs = Vec::with_capacity(group.tensors.len());
            for t in &mut group.tensors {
                let name = std::mem::take(&mut t.name);
                specs.push(spec_at(t, name, 0, t.offset - group.start)?);
            }
            self.specs = specs;
            self.group = Some(group);
            Ok(true)
        })
    }

    fn group_tensors(&self) -> &Vec<TensorSpec> {
        &self.specs
    }

    fn group_buffer(&self) -> Result<Box<BufferRef>> {
        guard(|| match &self.group {
            Some(group) => Ok(Box::new(BufferRef(Arc::clone(&group.buffer)))),
            None => Err(Error::InvalidArgument("the stream has no current group".into())),
        })
    }

    fn group_read_path(&self) -> &str {
        self.group.as_ref().map_or("", |g| g.read_path.name())
    }

    fn group_file(&self) -> i64 {
        self.group.as_ref().map_or(-1, |g| g.file as i64)
    }

    fn group_path(&self) -> String {
        self.group.as_ref().map_or_else(String::new, |g| self.stream.path(g.file).display().to_string())
    }

    fn tensor_count(&self) -> usize {
        self.stream.tensor_count()
    }

    fn byte_count(&self) -> u64 {
        self.stream.byte_count()
    }
}

impl LoadedFiles {
    fn tensors(&self) -> &Vec<TensorSpec> {
        &self.specs
    }

    fn read_paths(&self) -> Vec<String> {
        self.loaded.read_paths().into_iter().map(|p| p.name().to_owned()).collect()
    }

    fn buffer_count(&self) -> usize {
        self.loaded.buffers.len()
    }

    fn buffer(&self, index: usize) -> Box<BufferRef> {
        Box::new(BufferRef(Arc::clone(&self.loaded.buffers[index])))
    }

    fn buffer_file(&self, index: usize) -> usize {
        self.loaded.extents[index].file
    }
}

impl BufferRef {
    fn address(&self) -> usize {
        self.0.as_ptr() as usize
    }
}

fn cuda_device_count() -> Result<usize> {
    guard(driver::device_count)
}

fn resident_fraction(path: &str) -> Result<f64> {
    guard(|| LocalFile::open(Path::new(path))?.resident_fraction())
}

fn checkpoint(path: &str) -> Result<CheckpointSpec> {
    guard(|| {
        let c = Checkpoint::resolve(Path::new(path))?;
        let report = c.report_path().display().to_string();
        Ok(CheckpointSpec {
            files: c.files.iter().map(|f| f.display().to_string()).collect(),
            index: c.index.as_ref().map(|i| i.path.display().to_string()).unwrap_or_default(),
            problems: c.survey().iter().map(|p| format!("{report}: {p}")).collect(),
        })
    })
}

fn read_header(path: &str) -> Result<HeaderSpec> {
    guard(|| {
        let path = PathBuf::from(path);
        checkpoint::check_single_file(&path)?;
        let header = load::read_header(&path)?;
        let placements = plan::place(std::slice::from_ref(&path), std::slice::from_ref(&header))?;
        Ok(HeaderSpec {
            has_metadata: header.metadata.is_some(),
            metadata: header
                .metadata
                .unwrap_or_default()
                .into_iter()
                .map(|(key, value)| MetadataEntry { key, value })
                .collect(),
            tensors: specs(&placements)?,
        })
    })
}
