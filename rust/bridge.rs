//! The FFI surface for the C++ torch extension: the only `#[cxx::bridge]` in the crate.
//!
//! Every exported function runs inside [`guard`], which turns a panic into an error: a
//! panic that unwound into C++ would abort the Python process.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::io::{HostBuffer, ReaderKind};
use crate::loader::{self, LoadOptions, Loaded};
use crate::plan::{self, Placement};

#[cxx::bridge(namespace = "fastsafetensors::rs")]
mod ffi {
    /// One tensor: `nbytes` at `offset` in buffer `buffer`, with its safetensors dtype name.
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
        /// The files' tensors in host memory.
        type LoadedFiles;
        /// A reference on one file's buffer; the buffer is freed when the last one drops.
        type BufferRef;

        /// Loads `paths` with `reader` ("auto", "direct", "mmap", or "" for the default).
        fn load_files(paths: &Vec<String>, reader: &str) -> Result<Box<LoadedFiles>>;
        fn tensors(self: &LoadedFiles) -> &Vec<TensorSpec>;
        /// How each file was read: "direct", "buffered" or "mmap".
        fn read_paths(self: &LoadedFiles) -> Vec<String>;
        fn buffer_count(self: &LoadedFiles) -> usize;
        fn buffer(self: &LoadedFiles, index: usize) -> Box<BufferRef>;
        /// Address of the first byte of the buffer.
        fn address(self: &BufferRef) -> usize;

        /// Reads and validates one file's header without reading its data.
        fn read_header(path: &str) -> Result<HeaderSpec>;
    }
}

use ffi::{HeaderSpec, MetadataEntry, TensorSpec};

pub struct LoadedFiles {
    loaded: Loaded,
    specs: Vec<TensorSpec>,
}

pub struct BufferRef(Arc<HostBuffer>);

/// Runs `f`, turning a panic into [`Error::Panic`].
fn guard<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let msg = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        Err(Error::Panic(msg))
    })
}

fn spec(t: &Placement) -> Result<TensorSpec> {
    let shape = t
        .shape
        .iter()
        .map(|&d| {
            i64::try_from(d).map_err(|_| {
                Error::InvalidArgument(format!("tensor '{}': dimension {d} does not fit in i64", t.name))
            })
        })
        .collect::<Result<_>>()?;
    Ok(TensorSpec {
        name: t.name.clone(),
        dtype: t.dtype.name().to_owned(),
        shape,
        buffer: t.file,
        offset: t.offset as usize,
        nbytes: t.nbytes as usize,
        aligned: t.aligned,
    })
}

fn load_files(paths: &Vec<String>, reader: &str) -> Result<Box<LoadedFiles>> {
    guard(|| {
        let reader = ReaderKind::resolve(Some(reader).filter(|r| !r.is_empty()))?;
        let paths: Vec<PathBuf> = paths.iter().map(PathBuf::from).collect();
        let loaded = loader::load(&paths, &LoadOptions { reader, ..LoadOptions::default() })?;
        let specs = loaded.tensors.iter().map(spec).collect::<Result<_>>()?;
        Ok(Box::new(LoadedFiles { loaded, specs }))
    })
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

fn read_header(path: &str) -> Result<HeaderSpec> {
    guard(|| {
        let path = PathBuf::from(path);
        let header = loader::read_header(&path)?;
        let placements = plan::place(std::slice::from_ref(&path), std::slice::from_ref(&header))?;
        let tensors = placements.iter().map(spec).collect::<Result<_>>()?;
        Ok(HeaderSpec {
            has_metadata: header.metadata.is_some(),
            metadata: header
                .metadata
                .unwrap_or_default()
                .into_iter()
                .map(|(key, value)| MetadataEntry { key, value })
                .collect(),
            tensors,
        })
    })
}
