//! The FFI surface for the C++ torch extension: the only `#[cxx::bridge]` in the crate.
//!
//! Every exported function runs inside [`guard`], which turns a panic into an error: a
//! panic that unwound into C++ would abort the Python process.

// cxx hands vectors across as `&Vec`, not slices.
#![allow(clippy::ptr_arg)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use crate::cuda::cufile::{self, CuFileLibrary};
use crate::cuda::driver::{self, Context};
use crate::device::CudaDevice;
use crate::error::{Error, Result};
use crate::gds::GdsMode;
use crate::io::{budget, HostBuffer, ReaderKind, SourceFile};
use crate::loader::{self, DeviceOptions, LoadOptions, Loaded, Planned};
use crate::plan::{self, Placement};
use crate::select::{MatchMode, RowRange, Selection, TensorFilter};
use crate::stream::{self, Group, StreamOptions};

#[cxx::bridge(namespace = "fastsafetensors::rs")]
mod ffi {
    /// One tensor: `nbytes` at `offset` in the buffer of file `buffer`, with its safetensors
    /// dtype name.
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
        /// A reference on one file's host buffer; the buffer is freed when the last drops.
        type BufferRef;

        /// Opens `paths` and validates their headers (no data is read).
        fn plan_files(paths: &Vec<String>) -> Result<Box<PlannedFiles>>;
        fn tensors(self: &PlannedFiles) -> &Vec<TensorSpec>;
        fn file_count(self: &PlannedFiles) -> usize;
        /// Bytes of device memory file `index` needs.
        fn device_len(self: &PlannedFiles, index: usize) -> usize;
        /// Fills device memory `dsts[i]` with file i on CUDA device `ordinal`; returns how
        /// each file was read. `nogds`: -1 unset (auto), 0 false (require GDS), 1 true.
        fn copy_to_cuda(
            self: &PlannedFiles,
            ordinal: usize,
            dsts: &Vec<u64>,
            reader: &str,
            nogds: i32,
        ) -> Result<Vec<String>>;

        /// Loads the selected tensors of `paths` into host memory with `reader` ("auto",
        /// "direct", "mmap", or "" for the default).
        fn load_files(paths: &Vec<String>, reader: &str, selection: &TensorSelection) -> Result<Box<LoadedFiles>>;
        /// Loads rows `[start, stop)` of tensor `name` of `path` into host memory, reading
        /// only their bytes.
        fn load_rows(path: &str, name: &str, start: u64, stop: u64, reader: &str) -> Result<Box<LoadedFiles>>;
        fn tensors(self: &LoadedFiles) -> &Vec<TensorSpec>;
        /// How each file was read: "direct", "buffered" or "mmap".
        fn read_paths(self: &LoadedFiles) -> Vec<String>;
        fn buffer_count(self: &LoadedFiles) -> usize;
        fn buffer(self: &LoadedFiles, index: usize) -> Box<BufferRef>;
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
        /// Index in `paths` of the file of the current group (-1 before the first).
        fn group_file(self: &TensorStream) -> i64;
        /// Tensors and bytes of tensor data the stream hands out in all.
        fn tensor_count(self: &TensorStream) -> usize;
        fn byte_count(self: &TensorStream) -> u64;

        /// Number of CUDA devices; an error naming the reason when there is no driver.
        fn cuda_device_count() -> Result<usize>;
        /// Reads and validates one file's header without reading its data.
        fn read_header(path: &str) -> Result<HeaderSpec>;
        /// Fraction of the file's pages in the page cache (what `auto` decides by).
        fn resident_fraction(path: &str) -> Result<f64>;
    }
}

use ffi::{HeaderSpec, MetadataEntry, TensorSelection, TensorSpec};

pub struct PlannedFiles {
    planned: Planned,
    specs: Vec<TensorSpec>,
}

pub struct LoadedFiles {
    loaded: Loaded,
    specs: Vec<TensorSpec>,
}

pub struct BufferRef(Arc<HostBuffer>);

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
                .map_err(|_| Error::InvalidArgument(format!("tensor '{}': dimension {d} does not fit in i64", t.name)))
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

/// Specs of loaded tensors: buffer `k` is extent `k`.
fn loaded_specs(loaded: &Loaded) -> Result<Vec<TensorSpec>> {
    let mut out = Vec::with_capacity(loaded.tensors.len());
    for (k, e) in loaded.extents.iter().enumerate() {
        for t in &loaded.tensors[e.tensors.clone()] {
            out.push(spec_at(t, t.name.clone(), k, e.offset_of(t))?);
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

fn plan(paths: &[String]) -> Result<Planned> {
    loader::plan_files(&paths.iter().map(PathBuf::from).collect::<Vec<_>>())
}

fn plan_files(paths: &Vec<String>) -> Result<Box<PlannedFiles>> {
    guard(|| {
        let planned = plan(paths)?;
        let specs = specs(&planned.tensors)?;
        Ok(Box::new(PlannedFiles { planned, specs }))
    })
}

/// cuFile, opened once per process, or why it cannot be used.
fn cufile_library(gds: GdsMode) -> std::result::Result<&'static CuFileLibrary, &'static str> {
    static LIBRARY: OnceLock<std::result::Result<CuFileLibrary, String>> = OnceLock::new();
    if gds == GdsMode::Auto && !cufile::nvidia_fs_loaded() {
        return Err("the nvidia-fs driver is not loaded");
    }
    LIBRARY.get_or_init(CuFileLibrary::open).as_ref().map_err(String::as_str)
}

impl PlannedFiles {
    fn tensors(&self) -> &Vec<TensorSpec> {
        &self.specs
    }

    fn file_count(&self) -> usize {
        self.planned.sources.len()
    }

    fn device_len(&self, index: usize) -> usize {
        self.planned.device_len(index) as usize
    }

    fn copy_to_cuda(&self, ordinal: usize, dsts: &Vec<u64>, reader: &str, nogds: i32) -> Result<Vec<String>> {
        guard(|| {
            let gds = GdsMode::from_nogds(match nogds {
                0 => Some(false),
                1 => Some(true),
                _ => None,
            });
            let options = DeviceOptions { reader: reader_kind(reader)?, gds, ..DeviceOptions::default() };
            let ctx = Context::primary(ordinal)?;
            // The destination came from torch's caching allocator: work torch queued on it
            // before it was freed and handed to us may still be running.
            ctx.synchronize()?;
            let device = CudaDevice::new(ctx)?;
            // cuFile is opened only now that a context exists on a real device.
            let cufile = if gds == GdsMode::Never { Err("disabled (nogds=True)") } else { cufile_library(gds) };
            let paths = self.planned.copy_to_device(&device, cufile, dsts, &options)?;
            device.synchronize()?;
            Ok(paths.into_iter().map(|p| p.name().to_owned()).collect())
        })
    }
}

fn load_files(paths: &Vec<String>, reader: &str, selection: &TensorSelection) -> Result<Box<LoadedFiles>> {
    guard(|| {
        let options = LoadOptions { reader: reader_kind(reader)?, ..LoadOptions::default() };
        let loaded = plan(paths)?.select(&selection.to_selection()?)?.read_to_host(&options)?;
        let specs = loaded_specs(&loaded)?;
        Ok(Box::new(LoadedFiles { loaded, specs }))
    })
}

fn load_rows(path: &str, name: &str, start: u64, stop: u64, reader: &str) -> Result<Box<LoadedFiles>> {
    guard(|| {
        let options = LoadOptions { reader: reader_kind(reader)?, ..LoadOptions::default() };
        let exact = TensorFilter::new(MatchMode::Exact, &[name])?;
        let selection = Selection { filter: Some(exact), rows: vec![RowRange { name: name.to_owned(), start, stop }] };
        let loaded = plan(&[path.to_owned()])?.select(&selection)?.read_to_host(&options)?;
        let specs = loaded_specs(&loaded)?;
        Ok(Box::new(LoadedFiles { loaded, specs }))
    })
}

fn selected_names(paths: &Vec<String>, selection: &TensorSelection) -> Result<Vec<String>> {
    guard(|| Ok(plan(paths)?.select(&selection.to_selection()?)?.tensors.into_iter().map(|t| t.name).collect()))
}

fn open_stream(
    paths: &Vec<String>,
    reader: &str,
    selection: &TensorSelection,
    max_memory: &str,
) -> Result<Box<TensorStream>> {
    guard(|| {
        let budget = budget::stream_budget(Some(max_memory).filter(|m| !m.is_empty()))?;
        let options = StreamOptions { reader: reader_kind(reader)?, ..StreamOptions::with_budget(budget) };
        let planned = plan(paths)?.select(&selection.to_selection()?)?;
        let stream = stream::TensorStream::open(planned, options)?;
        Ok(Box::new(TensorStream { stream, group: None, specs: Vec::new() }))
    })
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
    guard(|| SourceFile::open(std::path::Path::new(path))?.resident_fraction())
}

fn read_header(path: &str) -> Result<HeaderSpec> {
    guard(|| {
        let path = PathBuf::from(path);
        let header = loader::read_header(&path)?;
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
