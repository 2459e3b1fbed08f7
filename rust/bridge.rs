//! The FFI surface for the C++ torch extension: the only `#[cxx::bridge]` in the crate.
//!
//! Every exported function runs inside `guard`, which turns a panic into an error: a
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
use crate::format::Dtype;
use crate::load::checkpoint::{self, Checkpoint};
use crate::load::device_stream::{Copier, DeviceStream};
use crate::load::fanout;
use crate::load::handle::{Handles, OpenFiles};
use crate::load::stream::{self, Group, StreamOptions};
use crate::load::{self, DeviceCopy, DeviceOptions, DeviceTarget, LoadOptions, Loaded, Planned};
use crate::plan::select::{MatchMode, RowRange, Selection, TensorFilter};
use crate::plan::target::{self, Output, Target};
use crate::plan::{self, Placement};
use crate::source::{budget, HostBuffer, LocalFile, ReadPath, ReaderKind, Source};

#[cxx::bridge(namespace = "fastsafetensors::rs")]
mod ffi {
    /// One tensor: `nbytes` at `offset` in buffer `buffer` (a file's, or for loaded tensors
    /// one extent's), with its safetensors dtype name and torch shape, and what the extension
    /// does with it once wrapped.
    struct TensorSpec {
        name: String,
        dtype: String,
        shape: Vec<i64>,
        buffer: usize,
        offset: usize,
        nbytes: usize,
        /// Copy the bytes out of the buffer (else: a view of it).
        copy: bool,
        /// Safetensors dtype name to cast to; empty: keep.
        cast: String,
    }

    /// A device a load targets, parsed.
    struct DeviceSpec {
        cuda: bool,
        /// CUDA device index; -1: torch's current device.
        index: i64,
        /// torch's name for it: "cpu", "cuda", "cuda:1".
        name: String,
    }

    /// How a load reaches its device.
    enum Route {
        /// Read into host memory (a CPU load).
        Host,
        /// Whole files copied to the device, in the groups `device_group_files` gives.
        Device,
        /// Read into host memory, then each tensor moved to the device (a selection on CUDA:
        /// only the selected bytes are read).
        HostThenDevice,
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

    /// One tensor of a header, as stored.
    struct HeaderTensor {
        name: String,
        dtype: String,
        shape: Vec<i64>,
    }

    /// A file's header: tensors in offset order, and the metadata's keys beside its values.
    struct HeaderSpec {
        has_metadata: bool,
        metadata_keys: Vec<String>,
        metadata_values: Vec<String>,
        tensors: Vec<HeaderTensor>,
    }

    /// A tensor handed to a save, as torch describes it (torch's dtype name, its shape and
    /// strides). Its bytes are at `address`, contiguous (a copy where the caller's tensor is
    /// not), in host memory (`device` -1) or on CUDA device `device`; `origin` is the
    /// caller's tensor's first element, which with the strides says what memory it covers.
    struct SaveTensorSpec {
        name: String,
        dtype: String,
        shape: Vec<i64>,
        strides: Vec<i64>,
        address: u64,
        origin: u64,
        device: i64,
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
        /// An event recorded on torch's current stream: the copies given its handle are
        /// ordered after the work queued there before it (the caching allocator may hand out
        /// memory that work still uses). Destroyed when dropped.
        type ReadyEvent;

        /// Opens `paths` (each one `.safetensors` file) and validates their headers: a handle,
        /// which the loads below take instead of reopening their `paths` (then some of those
        /// opened), until `close_handle`. `handle` -1 there: open `paths` afresh. URLs' objects
        /// are cached in `cache_dir` ("": where `$FASTSAFETENSORS_CACHE_DIR` says, if set).
        /// `verify`: "" for none, else what every load from the handle is verified against
        /// (JSON: see `verify::verifier_from_spec`).
        fn open_handle(paths: &Vec<String>, cache_dir: &str, verify: &str) -> Result<i64>;
        /// Lets go of the files of `handle` (loads running from them keep them); false if it
        /// was not open.
        fn close_handle(handle: i64) -> bool;
        /// Stops the reads of `handle`'s files in flight, in every load and stream from them
        /// (a load interrupted); false if it was not open.
        fn cancel_handle(handle: i64) -> bool;
        /// Every file of directory `dir` (or the file of a signature of a single file) checked
        /// against what `verify` names (JSON, as for `open_handle`, with `ignore_paths`,
        /// `ignore_git_paths` and `allow_symlinks`: `verify::verify_tree_spec`): one line per
        /// file, "status\tname\tdetail", status one of ok, missing, extra, changed, unreadable,
        /// symlink.
        fn verify_tree(dir: &str, verify: &str) -> Result<Vec<String>>;

        /// Records an event on `stream`, torch's current stream (a `cudaStream_t`) on CUDA
        /// device `ordinal`, for `ready` below. The extension keeps it until the copies given
        /// its handle have been waited for.
        fn record_ready(ordinal: usize, stream: u64) -> Result<Box<ReadyEvent>>;
        /// The `CUevent`, for the `ready` arguments below.
        fn handle(self: &ReadyEvent) -> u64;

        /// `device` parsed: "cpu", "cuda" or "cuda:N"; anything else is an error in one line.
        fn parse_device(device: &str) -> Result<DeviceSpec>;
        /// `device` parsed, `dtype` (torch's name, "" for none) checked as a cast target, and
        /// for CUDA, the driver and a device there: what every load checks first.
        fn check_target(device: &str, dtype: &str) -> Result<DeviceSpec>;
        /// A load of the tensors `selection` picks from `paths` to `device`, cast as `dtype`
        /// (torch's name, "" for none) says: paths resolved, headers validated, every setting
        /// and argument checked, and the device there; no data read yet.
        fn plan_load(
            paths: &Vec<String>,
            selection: &TensorSelection,
            device: &str,
            dtype: &str,
            handle: i64,
        ) -> Result<Box<PlannedFiles>>;
        fn target(self: &PlannedFiles) -> DeviceSpec;
        fn route(self: &PlannedFiles) -> Route;
        /// For `Route::Device`: groups of files copied together (each group's memory is
        /// allocated, filled and wrapped before the next's).
        fn file_count(self: &PlannedFiles) -> usize;
        fn device_group_count(self: &PlannedFiles) -> usize;
        fn device_group_files(self: &PlannedFiles, group: usize) -> Vec<usize>;
        /// The group's tensors; `buffer` is the file's position in the group.
        fn device_group_specs(self: &PlannedFiles, group: usize) -> Vec<TensorSpec>;
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

        /// A kept load's memory on a CUDA device (see `load::kept`), mapped read-only and shared
        /// by the tensors made in it: unmapped, and the keeper's hold let go, when dropped.
        type KeptDevice;
        /// `copy_to_cuda` of every file into kept memory on CUDA device `ordinal`: a kept
        /// entry's, attached to, or new memory filled and handed to the keeper. Not `kept()`
        /// where it is not kept (the reason is on stderr): the load then goes as without `keep`.
        fn copy_to_cuda_kept(self: &PlannedFiles, ordinal: usize, reader: &str) -> Result<Box<KeptDevice>>;
        fn kept(self: &KeptDevice) -> bool;
        /// The device address of the memory's first byte.
        fn address(self: &KeptDevice) -> u64;
        /// How each file came there, and where its byte 0 is from `address()`.
        fn file_copies(self: &KeptDevice) -> Vec<FileCopy>;

        /// Reads the planned tensors into host memory with `reader` ("auto", "direct", "mmap",
        /// or "" for the default): each file's selected byte ranges, as few buffers (extents).
        /// For `Route::HostThenDevice` the casts are left for after the move.
        fn read_to_host(planned: Box<PlannedFiles>, reader: &str) -> Result<Box<LoadedFiles>>;
        /// `read_to_host`, the bytes kept between processes (see `load::kept`): a kept entry's
        /// when the keeper holds this load's, else read into a new one and handed to it.
        fn read_to_host_kept(planned: Box<PlannedFiles>, reader: &str) -> Result<Box<LoadedFiles>>;
        /// A command to the running keeper, its answer as JSON: "list" (its entries), "drop"
        /// (ends the entries of the files at or under `path`), "stop"; "" when none runs.
        fn keep_command(command: &str, path: &str) -> Result<String>;
        /// Loads rows `[start, stop)` of tensor `name` of `path` into host memory, reading
        /// only their bytes (with a handle, found by name: the cost does not grow with the
        /// number of tensors).
        fn load_rows(
            path: &str,
            name: &str,
            start: i64,
            stop: i64,
            reader: &str,
            handle: i64,
        ) -> Result<Box<LoadedFiles>>;
        /// The tensors: buffers are those of `buffer()`, offsets are within them.
        fn tensors(self: &LoadedFiles) -> &Vec<TensorSpec>;
        /// How each file was read: "direct", "buffered", "mmap", "mmap-fallback" (mapped: direct
        /// reads would not fit in host memory) or "none" (nothing selected in it).
        fn read_paths(self: &LoadedFiles) -> Vec<String>;
        fn buffer_count(self: &LoadedFiles) -> usize;
        /// The loader's reference on buffer `index`, handed over (once).
        fn take_buffer(self: &mut LoadedFiles, index: usize) -> Result<Box<BufferRef>>;
        /// Address of the first byte of the buffer.
        fn address(self: &BufferRef) -> usize;

        /// Names of the tensors `selection` picks from `paths`, in read order (headers only).
        fn selected_names(paths: &Vec<String>, selection: &TensorSelection, handle: i64) -> Result<Vec<String>>;
        /// A streaming load of the selected tensors of `paths` into host memory, holding at
        /// most `max_memory` ("" for `$FASTSAFETENSORS_MAX_MEMORY` or the default) of buffers,
        /// cast as `dtype` (torch's name, "" for none) says.
        fn open_stream(
            paths: &Vec<String>,
            reader: &str,
            selection: &TensorSelection,
            max_memory: &str,
            dtype: &str,
            handle: i64,
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
            dtype: &str,
            ordinal: usize,
            handle: i64,
        ) -> Result<Box<DeviceTensorStream>>;
        fn group_count(self: &DeviceTensorStream) -> usize;
        /// The groups to submit now that group `k` is asked for, in order: `k` itself if it
        /// has not been, and those after it that fit the budget beside the groups submitted
        /// and not handed out (at least the next, so that one copy runs while the caller
        /// works).
        fn submissions(self: &mut DeviceTensorStream, k: usize) -> Vec<usize>;
        /// Bytes to allocate for group `k`.
        fn alloc_len(self: &DeviceTensorStream, k: usize) -> Result<usize>;
        /// Group `k`'s tensors: offsets from where the group's first byte lands.
        fn group_specs(self: &DeviceTensorStream, k: usize) -> Result<Vec<TensorSpec>>;
        /// How the group handed out last was read ("" before the first), and the index (-1
        /// before the first) and path of its file.
        fn group_read_path(self: &DeviceTensorStream) -> &str;
        fn group_file(self: &DeviceTensorStream) -> i64;
        fn group_path(self: &DeviceTensorStream) -> String;
        fn submit(self: &DeviceTensorStream, k: usize, base: u64, ready: u64) -> Result<()>;
        /// Waits for group `k`'s copy: how it was read and where in its allocation it landed.
        /// The group is handed out: its memory no longer counts against the budget.
        fn wait(self: &mut DeviceTensorStream, k: usize) -> Result<FileCopy>;
        fn tensor_count(self: &DeviceTensorStream) -> usize;
        fn byte_count(self: &DeviceTensorStream) -> u64;

        /// The plan of a load of what `selection` picks from `paths` shared by `world` ranks
        /// (each byte read by one rank, the rest exchanged), as JSON: `files`; `buffers`, each
        /// an extent of a file (`file`, `start`, `len`) in a buffer of `size` bytes that the
        /// ranks exchange in `chunks` (`[offset, piece]`: rank r reads piece r); `tensors`,
        /// each a `TensorSpec` in one of the buffers. Chunks are about `chunk` bytes (0: the
        /// default). For a bulk load, a buffer per file (or per selected range); `streamed`:
        /// buffers of at most a quarter of `max_memory` ("" for the default), so that two in
        /// flight and those handed out fit in it.
        #[allow(clippy::too_many_arguments)]
        fn share_load(
            paths: &Vec<String>,
            selection: &TensorSelection,
            dtype: &str,
            world: i64,
            streamed: bool,
            max_memory: &str,
            chunk: i64,
            handle: i64,
        ) -> Result<String>;
        /// Reads `len` bytes of file `path` from `offset` to `address`: host memory, or memory
        /// of CUDA device `ordinal` (>= 0; the copies ordered after event `ready`). Returns how
        /// the bytes were read. With a handle, the file as it opened it.
        #[allow(clippy::too_many_arguments)]
        unsafe fn read_range(
            path: &str,
            offset: i64,
            address: u64,
            len: u64,
            ordinal: i64,
            reader: &str,
            handle: i64,
            ready: u64,
        ) -> Result<String>;

        /// Feeds `len` bytes at host `address`, file `path`'s bytes from `offset` on, to the
        /// file's check in the verified shared load planned last from `handle` (`share_load`):
        /// what the rank checking a file for the group does with each buffer of it, in order.
        ///
        /// # Safety
        /// `len` bytes at `address` are readable until this returns.
        unsafe fn check_range(path: &str, offset: i64, address: u64, len: u64, handle: i64) -> Result<()>;

        /// Whether file `path` matched its manifest, once `check_range` was given every buffer
        /// of it: an error naming what did not.
        fn check_finish(path: &str, handle: i64) -> Result<()>;

        /// torch's name for the dtype of `c10::ScalarType` number `code` ("bfloat16").
        fn torch_dtype_name(code: i32) -> String;
        /// The `c10::ScalarType` number of safetensors dtype `dtype` ("BF16").
        fn torch_scalar_type(dtype: &str) -> Result<i32>;

        /// Saves `tensors` (names in the caller's order) to `target`: one file, as safetensors'
        /// `save_file` writes it (`max_shard_size` < 0), or a checkpoint directory in shards
        /// of at most `max_shard_size` bytes, named and indexed as transformers names them.
        /// `metadata`: keys beside values, or `has_metadata` false for none. Host memory held
        /// stays within `max_memory` ("" for the stream default). CUDA tensors are copied off
        /// their device after event `ready` (0: none). Returns the paths written, index last.
        ///
        /// # Safety
        /// Every tensor's bytes at `address` (contiguous, its shape's size) stay readable and
        /// unchanged until this returns.
        #[allow(clippy::too_many_arguments)]
        unsafe fn save(
            tensors: &Vec<SaveTensorSpec>,
            target: &str,
            max_shard_size: i64,
            has_metadata: bool,
            metadata_keys: &Vec<String>,
            metadata_values: &Vec<String>,
            max_memory: &str,
            ready: u64,
        ) -> Result<Vec<String>>;

        /// Begins one rank's part of a save (a group's, or a single process's as rank 0 of
        /// 1): `spec` is JSON, `{"rank", "world", "target", "max_shard_size" (-1: one file),
        /// "metadata" (or null), "ranks": [[{"name", "dtype", "shape"}, ...] per rank],
        /// "files" (optional: [{"path", "tensors": [names], "metadata"}], the caller's files)}`.
        /// Rank 0 prepares the target and creates the files. Returns the session's handle,
        /// the bytes this rank writes, then (rank 0) where each file is being written.
        fn save_begin(spec: &str) -> Result<Vec<String>>;
        /// Writes this rank's part of save `handle` from `tensors` (its own, any order) and
        /// makes it durable; `locations`: what rank 0's `save_begin` returned (rank 0: none).
        /// Returns the bytes written.
        ///
        /// # Safety
        /// As for `save`.
        unsafe fn save_write(
            handle: i64,
            locations: &Vec<String>,
            tensors: &Vec<SaveTensorSpec>,
            max_memory: &str,
            ready: u64,
        ) -> Result<u64>;
        /// Commits save `handle` (rank 0, once every rank's part is durable); returns the
        /// paths written, the index last.
        fn save_commit(handle: i64) -> Result<Vec<String>>;
        /// Ends save `handle` without committing: what it made is removed. False if unknown.
        fn save_end(handle: i64) -> bool;

        /// Reads and validates one file's header without reading its data (with a handle: the
        /// header as it was opened).
        fn read_header(path: &str, handle: i64) -> Result<HeaderSpec>;
        /// Fraction of the file's pages in the page cache (what `auto` decides by).
        fn resident_fraction(path: &str) -> Result<f64>;
        /// The files `path` (a file, checkpoint directory or index) stands for, with every
        /// problem found in their headers against each other and the index.
        fn checkpoint(path: &str) -> Result<CheckpointSpec>;
    }
}

mod save;
use save::{save, save_begin, save_commit, save_end, save_write};

use ffi::{CheckpointSpec, DeviceSpec, FileCopy, HeaderSpec, HeaderTensor, Route, TensorSelection, TensorSpec};

pub struct PlannedFiles {
    planned: Planned,
    target: Target,
    route: Route,
    cast: Option<Dtype>,
    /// For `Route::Device`: what becomes of each tensor, in `planned.tensors` order.
    outputs: Vec<Output>,
}

pub struct LoadedFiles {
    loaded: Loaded,
    specs: Vec<TensorSpec>,
    /// The loader's references on the buffers, until handed over.
    buffers: Vec<Option<Arc<HostBuffer>>>,
}

pub struct BufferRef(Arc<HostBuffer>);

pub struct KeptDevice(Option<crate::load::kept::KeptOnDevice>);

pub struct ReadyEvent(driver::Event);

pub struct DeviceTensorStream {
    copier: Copier,
    cast: Option<Dtype>,
    /// Groups below `ahead` have been submitted, in order; `in_flight` bytes are allocated
    /// for those not handed out yet.
    ahead: usize,
    in_flight: u64,
    /// The group handed out last, and how it was read.
    last: Option<(usize, ReadPath)>,
}

pub struct TensorStream {
    stream: stream::TensorStream,
    cast: Option<Dtype>,
    group: Option<Group>,
    specs: Vec<TensorSpec>,
}

/// The files `open_handle` opened, by handle.
static HANDLES: Handles = Handles::new();

/// Runs `f`, turning a panic into [`Error::Panic`], and its error's URLs into their shown form
/// (no user name, password or query string).
fn guard<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let result = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(Error::from_panic(payload)));
    // The one place every message leaves by: URLs in it lose their credentials here.
    result.map_err(Error::redacted)
}

/// The spec of tensor `t`, which starts at `offset` in buffer `buffer` and becomes `output`.
/// Takes the name from `name` (moved, not copied, where the placement is not needed any more).
/// `t` has passed [`target::check_torch_can_hold`].
fn spec_at(t: &Placement, name: String, buffer: usize, offset: u64, output: Output) -> TensorSpec {
    TensorSpec {
        name,
        dtype: t.dtype.name().to_owned(),
        shape: target::torch_shape(t),
        buffer,
        offset: offset as usize,
        nbytes: t.nbytes as usize,
        copy: output.copy,
        cast: output.cast.map_or_else(String::new, |d| d.name().to_owned()),
    }
}

/// Fails, before anything is read, on a selected tensor torch cannot hold.
fn check_torch(planned: &Planned) -> Result<()> {
    planned.tensors.iter().try_for_each(|t| target::check_torch_can_hold(planned.sources[t.file].path(), t))
}

/// Whether a buffer read this way is memory of its own, freed with its last tensor (a mapping
/// is page cache: its views stay views).
fn owns_memory(path: ReadPath) -> bool {
    !matches!(path, ReadPath::Mmap | ReadPath::MmapFallback | ReadPath::Kept)
}

/// Specs of loaded tensors: buffer `k` is extent `k`. The names move into the specs: only
/// the buffers of `loaded` are used afterwards. `copy_out`: whether a cast in a buffer of its
/// own copies the buffer's other tensors out of it.
fn loaded_specs(loaded: &mut Loaded, cast: Option<Dtype>, copy_out: bool) -> Vec<TensorSpec> {
    let mut buffers = vec![0; loaded.tensors.len()];
    for (k, e) in loaded.extents.iter().enumerate() {
        buffers[e.tensors.clone()].fill(k);
    }
    let owned: Vec<bool> = loaded.buffers.iter().map(|b| copy_out && owns_memory(b.read_path())).collect();
    let outputs = target::outputs(&loaded.tensors, &buffers, cast, |k| owned[k]);
    let mut out = Vec::with_capacity(loaded.tensors.len());
    for (k, e) in loaded.extents.iter().enumerate() {
        for i in e.tensors.clone() {
            let t = &mut loaded.tensors[i];
            let name = std::mem::take(&mut t.name);
            out.push(spec_at(t, name, k, e.offset_of(t), outputs[i]));
        }
    }
    out
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

/// Every load starts here: settings checked, then, with a handle, the files it holds open
/// (its headers validated when it was opened); without one, paths resolved to files
/// (directories and indexes expanded), headers validated, and the tensors checked against
/// any index.
fn plan(paths: &[String], handle: i64) -> Result<Planned> {
    load::check_env()?;
    if let Some(files) = opened(handle)? {
        return files.plan(&paths.iter().map(PathBuf::from).collect::<Vec<_>>());
    }
    let checkpoints = checkpoint::resolve_all(&paths.iter().map(PathBuf::from).collect::<Vec<_>>())?;
    let planned = load::plan_files(&checkpoint::files(&checkpoints))?;
    checkpoint::check_placed(&checkpoints, &planned.tensors)?;
    Ok(planned)
}

/// The plan of `paths` narrowed to what `selection` picks, every tensor one torch can hold.
fn plan_selected(paths: &[String], selection: &TensorSelection, handle: i64) -> Result<Planned> {
    let planned = plan(paths, handle)?.select(&selection.to_selection()?)?;
    check_torch(&planned)?;
    Ok(planned)
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

impl From<&Target> for DeviceSpec {
    fn from(target: &Target) -> DeviceSpec {
        let index = match target {
            Target::Cpu | Target::Cuda(None) => -1,
            Target::Cuda(Some(i)) => i64::from(*i),
        };
        DeviceSpec { cuda: *target != Target::Cpu, index, name: target.name() }
    }
}

/// The device `device` names and the cast `dtype` asks for, checked; for CUDA, a clear error
/// at once on machines without a driver or a device.
fn target_and_cast(device: &str, dtype: &str) -> Result<(Target, Option<Dtype>)> {
    let target = Target::parse(device)?;
    let cast = target::cast_target(dtype)?;
    if target != Target::Cpu {
        let unavailable = |reason| Error::DeviceUnavailable { device: target.name(), reason };
        match driver::device_count() {
            Ok(0) => return Err(unavailable("CUDA: no CUDA device is visible".to_owned())),
            Ok(_) => {}
            Err(e) => return Err(unavailable(e.to_string())),
        }
    }
    Ok((target, cast))
}

fn open_handle(paths: &Vec<String>, cache_dir: &str, verify: &str) -> Result<i64> {
    guard(|| {
        let paths: Vec<PathBuf> = paths.iter().map(PathBuf::from).collect();
        let cache_dir = (!cache_dir.is_empty()).then(|| Path::new(cache_dir));
        let mut files = OpenFiles::open_cached(&paths, cache_dir)?;
        if !verify.is_empty() {
            files = files.verified(crate::verify::verifier_from_spec(verify, &paths)?)?;
        }
        Ok(HANDLES.insert(files))
    })
}

unsafe fn check_range(path: &str, offset: i64, address: u64, len: u64, handle: i64) -> Result<()> {
    guard(|| {
        let offset =
            u64::try_from(offset).map_err(|_| Error::InvalidArgument(format!("check_range: offset {offset}")))?;
        let files = opened(handle)?.ok_or_else(|| Error::InvalidArgument("check_range: no handle".into()))?;
        // SAFETY: the caller's contract.
        let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, len as usize) };
        files.check_shared(Path::new(path), offset, bytes)
    })
}

fn check_finish(path: &str, handle: i64) -> Result<()> {
    guard(|| {
        let files = opened(handle)?.ok_or_else(|| Error::InvalidArgument("check_finish: no handle".into()))?;
        files.finish_shared(Path::new(path))
    })
}

fn verify_tree(dir: &str, verify: &str) -> Result<Vec<String>> {
    use crate::verify::Verdict;
    guard(|| {
        let (manifest, verdicts) = crate::verify::verify_tree_spec(Path::new(dir), verify)?;
        Ok(verdicts
            .into_iter()
            .map(|(name, v)| match v {
                Verdict::Ok => format!("ok\t{name}\t"),
                Verdict::Missing => format!("missing\t{name}\tlisted in {}, not in the directory", manifest.origin),
                Verdict::Extra => format!("extra\t{name}\tnot listed in {}", manifest.origin),
                Verdict::Changed { start, end, expected, actual } => {
                    format!("changed\t{name}\tbytes {start}..{end}: expected {expected}, got {actual}")
                }
                Verdict::Unreadable(why) => format!("unreadable\t{name}\t{why}"),
                Verdict::Symlink => format!(
                    "symlink\t{name}\ta symbolic link, and {} records allow_symlinks=false (model_signing refuses it too): \
                     pass --allow_symlinks to follow links",
                    manifest.origin
                ),
            })
            .collect())
    })
}

fn close_handle(handle: i64) -> bool {
    guard(|| Ok(HANDLES.remove(handle))).unwrap_or(false)
}

fn cancel_handle(handle: i64) -> bool {
    guard(|| Ok(HANDLES.get(handle).map(|files| files.cancel()).is_ok())).unwrap_or(false)
}

/// The files open under `handle`; `None` for -1 (a load that opens its paths itself).
fn opened(handle: i64) -> Result<Option<Arc<OpenFiles>>> {
    if handle == -1 {
        return Ok(None);
    }
    HANDLES.get(handle).map(Some)
}

#[allow(clippy::too_many_arguments)]
fn share_load(
    paths: &Vec<String>,
    selection: &TensorSelection,
    dtype: &str,
    world: i64,
    streamed: bool,
    max_memory: &str,
    chunk: i64,
    handle: i64,
) -> Result<String> {
    guard(|| {
        let (Ok(world @ 1..), Ok(chunk)) = (usize::try_from(world), u64::try_from(chunk)) else {
            return Err(Error::InvalidArgument(format!("share_load: world {world}, chunk {chunk}")));
        };
        let cast = target::cast_target(dtype)?;
        let max_len = match streamed {
            true => (budget::stream_budget(Some(max_memory).filter(|m| !m.is_empty()))? / 4).max(plan::IO_ALIGN),
            false => u64::MAX,
        };
        let chunk = if chunk == 0 { fanout::DEFAULT_CHUNK } else { chunk }.min(max_len);
        let planned = plan_selected(paths, selection, handle)?;
        let shared = planned.share(world, max_len, chunk)?;
        // A verified load: each file is checked by one rank, from the buffers the exchange
        // filled (the plan's checks know what the load hands out); files go to the ranks
        // with the fewest bytes to hash so far, largest first.
        let mut checkers = vec![-1i64; planned.sources.len()];
        if !planned.checks.files.is_empty() {
            let mut bytes = vec![0u64; planned.sources.len()];
            shared.iter().for_each(|s| bytes[s.extent.file] += s.extent.expected);
            let mut load = vec![0u64; world];
            let mut order: Vec<usize> = (0..bytes.len()).filter(|&f| bytes[f] > 0).collect();
            order.sort_by_key(|&f| std::cmp::Reverse(bytes[f]));
            for f in order {
                let r = (0..world).min_by_key(|&r| load[r]).expect("a group has a rank");
                load[r] += bytes[f];
                checkers[f] = r as i64;
            }
            if let Some(files) = opened(handle)? {
                files.share_checks(planned.checks.clone());
            }
        }
        let mut buffers = vec![0; planned.tensors.len()];
        for (k, s) in shared.iter().enumerate() {
            buffers[s.extent.tensors.clone()].fill(k);
        }
        let outputs = target::outputs(&planned.tensors, &buffers, cast, |_| true);
        let tensors: Vec<_> = planned
            .tensors
            .iter()
            .zip(&outputs)
            .zip(&buffers)
            .map(|((t, &output), &k)| {
                let spec = spec_at(t, t.name.clone(), k, shared[k].extent.offset_of(t), output);
                serde_json::json!({
                    "name": spec.name, "dtype": spec.dtype, "shape": spec.shape, "buffer": spec.buffer,
                    "offset": spec.offset, "nbytes": spec.nbytes, "copy": spec.copy, "cast": spec.cast,
                })
            })
            .collect();
        let buffers: Vec<_> = shared
            .iter()
            .map(|s| {
                let chunks: Vec<[u64; 2]> = s.chunks.iter().map(|c| [c.offset, c.piece]).collect();
                let e = &s.extent;
                serde_json::json!({"file": e.file, "start": e.start, "len": e.len, "size": s.size, "chunks": chunks})
            })
            .collect();
        let files: Vec<String> = planned.paths().iter().map(|p| p.to_string_lossy().into_owned()).collect();
        // What the ranks compare before reading for each other: the same path may hold other
        // bytes on another rank (another working directory, another mount, another copy).
        // A rank alone reads for no other.
        let fingerprints = if world > 1 { planned.fingerprints()? } else { Vec::new() };
        let plan = serde_json::json!({
            "files": files, "buffers": buffers, "tensors": tensors, "fingerprints": fingerprints, "checkers": checkers,
        });
        Ok(plan.to_string())
    })
}

/// # Safety
/// `address` is the start of `len` bytes of memory (of the host, or of CUDA device `ordinal`)
/// that nothing else reads or writes until this returns; `ready` is 0 or an event the caller
/// keeps alive until then.
#[allow(clippy::too_many_arguments)]
unsafe fn read_range(
    path: &str,
    offset: i64,
    address: u64,
    len: u64,
    ordinal: i64,
    reader: &str,
    handle: i64,
    ready: u64,
) -> Result<String> {
    guard(|| {
        let reader = reader_kind(reader)?;
        let offset =
            u64::try_from(offset).map_err(|_| Error::InvalidArgument(format!("read_range: offset {offset}")))?;
        if len == 0 {
            return Ok(ReadPath::NotRead.name().to_owned());
        }
        let src = match opened(handle)? {
            Some(files) => Arc::clone(files.source(Path::new(path))?),
            None => Arc::new(LocalFile::open(Path::new(path))?) as Arc<dyn Source>,
        };
        let how = if ordinal >= 0 {
            // SAFETY: the caller's contract.
            let ready = unsafe { ready_event(ready) };
            fanout::read_to_cuda(&src, offset, len, address, ordinal as usize, ready, reader)?
        } else {
            // SAFETY: the caller's contract: `len` bytes at `address`, ours until we return.
            let dst = unsafe { std::slice::from_raw_parts_mut(address as *mut u8, len as usize) };
            fanout::read_to_host(&src, offset, dst, reader)?
        };
        Ok(how.name().to_owned())
    })
}

fn record_ready(ordinal: usize, stream: u64) -> Result<Box<ReadyEvent>> {
    guard(|| {
        let event = driver::Event::new(&Context::primary(ordinal)?)?;
        // SAFETY: the extension passes torch's current stream of device `ordinal`, made in
        // that device's primary context (the one torch uses).
        unsafe { event.record_on(stream) }?;
        Ok(Box::new(ReadyEvent(event)))
    })
}

impl ReadyEvent {
    fn handle(&self) -> u64 {
        self.0.as_raw().0 as u64
    }
}

fn parse_device(device: &str) -> Result<DeviceSpec> {
    guard(|| Ok(DeviceSpec::from(&Target::parse(device)?)))
}

fn check_target(device: &str, dtype: &str) -> Result<DeviceSpec> {
    guard(|| Ok(DeviceSpec::from(&target_and_cast(device, dtype)?.0)))
}

fn plan_load(
    paths: &Vec<String>,
    selection: &TensorSelection,
    device: &str,
    dtype: &str,
    handle: i64,
) -> Result<Box<PlannedFiles>> {
    guard(|| {
        let (target, cast) = target_and_cast(device, dtype)?;
        let route = match (&target, selection.filtered) {
            (Target::Cpu, _) => Route::Host,
            // A selection on CUDA: only the selected bytes are read, into host memory.
            (_, true) => Route::HostThenDevice,
            (_, false) => Route::Device,
        };
        let planned = plan_selected(paths, selection, handle)?;
        let outputs = if route == Route::Device {
            let files: Vec<usize> = planned.tensors.iter().map(|t| t.file).collect();
            target::outputs(&planned.tensors, &files, cast, |_| true)
        } else {
            Vec::new()
        };
        Ok(Box::new(PlannedFiles { planned, target, route, cast, outputs }))
    })
}

impl PlannedFiles {
    fn copy_to_cuda_kept(&self, ordinal: usize, reader: &str) -> Result<Box<KeptDevice>> {
        guard(|| {
            let options = DeviceOptions { reader: reader_kind(reader)?, ..DeviceOptions::default() };
            Ok(Box::new(KeptDevice(self.planned.copy_to_cuda_kept(ordinal, &options)?)))
        })
    }

    fn target(&self) -> DeviceSpec {
        DeviceSpec::from(&self.target)
    }

    fn route(&self) -> Route {
        self.route
    }

    fn file_count(&self) -> usize {
        self.planned.sources.len()
    }

    /// Without a cast every tensor stays a view of its file's buffer, and all files are read in
    /// one go, overlapping. With one, file by file: each file's buffer is freed (its tensors
    /// cast or copied out) before the next one is allocated.
    fn device_group_count(&self) -> usize {
        match self.planned.sources.len() {
            n if n > 0 && self.cast.is_some() => n,
            _ => 1,
        }
    }

    fn device_group_files(&self, group: usize) -> Vec<usize> {
        match self.planned.sources.len() {
            n if n > 0 && self.cast.is_some() => vec![group],
            n => (0..n).collect(),
        }
    }

    fn device_group_specs(&self, group: usize) -> Vec<TensorSpec> {
        let files = self.device_group_files(group);
        let tensors = self.planned.tensors.iter().zip(&self.outputs);
        tensors
            .filter_map(|(t, &output)| {
                let at = files.iter().position(|&f| f == t.file)?;
                Some(spec_at(t, t.name.clone(), at, t.offset, output))
            })
            .collect()
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

impl KeptDevice {
    fn kept(&self) -> bool {
        self.0.is_some()
    }

    fn address(&self) -> u64 {
        self.0.as_ref().map_or(0, |k| k.mapping.address())
    }

    fn file_copies(&self) -> Vec<FileCopy> {
        self.0.as_ref().map_or_else(Vec::new, |k| k.files.iter().map(|&c| c.into()).collect())
    }
}

fn release_staging_buffers() -> usize {
    guard(|| Ok(load::release_staging_buffers())).unwrap_or(0)
}

fn read_to_host(planned: Box<PlannedFiles>, reader: &str) -> Result<Box<LoadedFiles>> {
    guard(|| {
        let PlannedFiles { planned, route, cast, .. } = *planned;
        let loaded = planned.read_to_host(&load_options(reader)?)?;
        // Moved to the device afterwards, tensors are copied there anyway: none is copied out.
        Ok(LoadedFiles::new(loaded, cast, route == Route::Host))
    })
}

fn read_to_host_kept(planned: Box<PlannedFiles>, reader: &str) -> Result<Box<LoadedFiles>> {
    guard(|| {
        let PlannedFiles { planned, route, cast, .. } = *planned;
        // Host entries: a CPU load, or a selection on CUDA (its tensors are moved from them).
        let loaded = planned.read_to_host_kept(&load_options(reader)?)?;
        Ok(LoadedFiles::new(loaded, cast, route == Route::Host))
    })
}

fn keep_command(command: &str, path: &str) -> Result<String> {
    use crate::keep::{client, Request};
    guard(|| {
        let request = match command {
            "list" => Request::List,
            "drop" => Request::Drop { path: path.to_owned() },
            "stop" => Request::Stop,
            other => return Err(Error::InvalidArgument(format!("keep command '{other}' (list, drop or stop)"))),
        };
        let reply = client::command(&request)?;
        Ok(reply.map_or_else(String::new, |r| serde_json::to_string(&r).unwrap_or_default()))
    })
}

fn load_rows(path: &str, name: &str, start: i64, stop: i64, reader: &str, handle: i64) -> Result<Box<LoadedFiles>> {
    guard(|| {
        let (Ok(start), Ok(stop)) = (u64::try_from(start), u64::try_from(stop)) else {
            return Err(Error::InvalidArgument(format!("rows [{start}, {stop}) of '{name}': negative row index")));
        };
        let planned = match opened(handle)? {
            Some(files) => {
                load::check_env()?;
                files.plan_rows(Path::new(path), name, start, stop)?
            }
            None => {
                let exact = TensorFilter::new(MatchMode::Exact, &[name])?;
                let rows = vec![RowRange { name: name.to_owned(), start, stop }];
                checkpoint::check_single_file(Path::new(path))?;
                plan(&[path.to_owned()], -1)?.select(&Selection { filter: Some(exact), rows })?
            }
        };
        check_torch(&planned)?;
        Ok(LoadedFiles::new(planned.read_to_host(&load_options(reader)?)?, None, false))
    })
}

fn selected_names(paths: &Vec<String>, selection: &TensorSelection, handle: i64) -> Result<Vec<String>> {
    guard(|| {
        let planned = plan(paths, handle)?.select(&selection.to_selection()?)?;
        Ok(planned.tensors.into_iter().map(|t| t.name).collect())
    })
}

fn open_stream(
    paths: &Vec<String>,
    reader: &str,
    selection: &TensorSelection,
    max_memory: &str,
    dtype: &str,
    handle: i64,
) -> Result<Box<TensorStream>> {
    guard(|| {
        let cast = target::cast_target(dtype)?;
        let planned = plan_selected(paths, selection, handle)?;
        let stream = stream::TensorStream::open(planned, stream_options(reader, max_memory)?)?;
        Ok(Box::new(TensorStream { stream, cast, group: None, specs: Vec::new() }))
    })
}

fn open_device_stream(
    paths: &Vec<String>,
    reader: &str,
    selection: &TensorSelection,
    max_memory: &str,
    dtype: &str,
    ordinal: usize,
    handle: i64,
) -> Result<Box<DeviceTensorStream>> {
    guard(|| {
        let cast = target::cast_target(dtype)?;
        let stream =
            DeviceStream::open(plan_selected(paths, selection, handle)?, &stream_options(reader, max_memory)?)?;
        let copier = Copier::start(stream, move |ready| {
            // SAFETY: the extension keeps the event alive until it has waited for this copy.
            let ready = unsafe { ready_event(ready) };
            Ok(Box::new(CudaDevice::new(Context::primary(ordinal)?, ready)?))
        })?;
        Ok(Box::new(DeviceTensorStream { copier, cast, ahead: 0, in_flight: 0, last: None }))
    })
}

impl DeviceTensorStream {
    fn stream(&self) -> &DeviceStream {
        self.copier.stream()
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

    fn submissions(&mut self, k: usize) -> Vec<usize> {
        let stream = self.copier.stream();
        let count = stream.group_count();
        let mut out = Vec::new();
        if k >= count {
            return out;
        }
        if k >= self.ahead {
            out.push(k);
            self.in_flight += stream.alloc_len(k);
            self.ahead = k + 1;
        }
        while self.ahead < count
            && (self.ahead == k + 1 || self.in_flight + stream.alloc_len(self.ahead) <= stream.budget())
        {
            out.push(self.ahead);
            self.in_flight += stream.alloc_len(self.ahead);
            self.ahead += 1;
        }
        out
    }

    fn alloc_len(&self, k: usize) -> Result<usize> {
        guard(|| self.check(k).map(|()| self.stream().alloc_len(k) as usize))
    }

    fn group_specs(&self, k: usize) -> Result<Vec<TensorSpec>> {
        guard(|| {
            self.check(k)?;
            let stream = self.stream();
            let tensors = stream.tensors(k);
            let outputs = target::outputs(tensors, &vec![0; tensors.len()], self.cast, |_| true);
            let specs = tensors.iter().zip(outputs);
            Ok(specs.map(|(t, output)| spec_at(t, t.name.clone(), 0, stream.offset_of(k, t), output)).collect())
        })
    }

    fn group_read_path(&self) -> &str {
        self.last.map_or("", |(_, path)| path.name())
    }

    fn group_file(&self) -> i64 {
        self.last.map_or(-1, |(k, _)| self.stream().file(k).0 as i64)
    }

    fn group_path(&self) -> String {
        self.last.map_or_else(String::new, |(k, _)| self.stream().file(k).1.display().to_string())
    }

    fn submit(&self, k: usize, base: u64, ready: u64) -> Result<()> {
        guard(|| self.copier.submit(k, base, ready))
    }

    fn wait(&mut self, k: usize) -> Result<FileCopy> {
        guard(|| {
            let copy = self.copier.wait(k)?;
            self.in_flight = self.in_flight.saturating_sub(self.copier.stream().alloc_len(k));
            self.last = Some((k, copy.path));
            Ok(copy.into())
        })
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
            let copy_out = owns_memory(group.read_path);
            let outputs = target::outputs(&group.tensors, &vec![0; group.tensors.len()], self.cast, |_| copy_out);
            let mut specs = Vec::with_capacity(group.tensors.len());
            for (t, output) in group.tensors.iter_mut().zip(outputs) {
                let name = std::mem::take(&mut t.name);
                specs.push(spec_at(t, name, 0, t.offset - group.start, output));
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
    fn new(mut loaded: Loaded, cast: Option<Dtype>, copy_out: bool) -> Box<LoadedFiles> {
        let specs = loaded_specs(&mut loaded, cast, copy_out);
        let buffers = std::mem::take(&mut loaded.buffers).into_iter().map(Some).collect();
        Box::new(LoadedFiles { loaded, specs, buffers })
    }

    fn tensors(&self) -> &Vec<TensorSpec> {
        &self.specs
    }

    fn read_paths(&self) -> Vec<String> {
        self.loaded.read_paths().into_iter().map(|p| p.name().to_owned()).collect()
    }

    fn buffer_count(&self) -> usize {
        self.buffers.len()
    }

    fn take_buffer(&mut self, index: usize) -> Result<Box<BufferRef>> {
        guard(|| match self.buffers.get_mut(index).and_then(Option::take) {
            Some(buffer) => Ok(Box::new(BufferRef(buffer))),
            None => Err(Error::InvalidArgument(format!("buffer {index} was handed over already, or is not there"))),
        })
    }
}

impl BufferRef {
    fn address(&self) -> usize {
        self.0.as_ptr() as usize
    }
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
            // Messages: their URLs shown without credentials, as errors' are.
            problems: c.survey().iter().map(|p| crate::error::redact(&format!("{report}: {p}"))).collect(),
        })
    })
}

fn read_header(path: &str, handle: i64) -> Result<HeaderSpec> {
    guard(|| {
        let path = PathBuf::from(path);
        let header = match opened(handle)? {
            Some(files) => files.header(&path)?.clone(),
            None => {
                checkpoint::check_single_file(&path)?;
                let header = load::read_header(&path)?;
                // The same checks across the file's tensors as a load makes.
                plan::place(std::slice::from_ref(&path), std::slice::from_ref(&header))?;
                header
            }
        };
        let tensors = header
            .tensors
            .iter()
            .map(|t| {
                let shape = t.shape.iter().map(|&d| {
                    i64::try_from(d).map_err(|_| Error::Unrepresentable {
                        path: path.clone(),
                        name: t.name.clone(),
                        why: format!("dimension {d} does not fit in i64"),
                    })
                });
                Ok(HeaderTensor {
                    name: t.name.clone(),
                    dtype: t.dtype.name().to_owned(),
                    shape: shape.collect::<Result<_>>()?,
                })
            })
            .collect::<Result<_>>()?;
        let has_metadata = header.metadata.is_some();
        let (metadata_keys, metadata_values) = header.metadata.unwrap_or_default().into_iter().unzip();
        Ok(HeaderSpec { has_metadata, metadata_keys, metadata_values, tensors })
    })
}

fn torch_dtype_name(code: i32) -> String {
    target::torch_name(code)
}

fn torch_scalar_type(dtype: &str) -> Result<i32> {
    guard(|| {
        Dtype::from_name(dtype)
            .and_then(target::torch_code)
            .ok_or_else(|| Error::InvalidArgument(format!("internal error: no torch dtype for {dtype}")))
    })
}
