//! Loading: headers → plan → reads, for a set of files at once.
//!
//! ```no_run
//! use fastsafetensors::loader::{load, LoadOptions};
//! let loaded = load(&["model-00001.safetensors".into()], &LoadOptions::default())?;
//! for t in &loaded.tensors {
//!     let bytes = loaded.bytes(t);
//!     println!("{} {} {:?}: {} bytes", t.name, t.dtype, t.shape, bytes.len());
//! }
//! # Ok::<(), fastsafetensors::Error>(())
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use rayon::prelude::*;

use crate::error::Result;
use crate::format::Header;
use crate::io::{self, HostBuffer, ReadPath, ReaderKind, SourceFile};
use crate::plan::{self, Placement};

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub reader: ReaderKind,
    /// Bytes per read request.
    pub block: u64,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { reader: ReaderKind::Auto, block: plan::DEFAULT_BLOCK }
    }
}

/// Every tensor of a set of files, in host memory. Buffers are reference-counted so that
/// each tensor handed out can keep its own file's buffer alive.
pub struct Loaded {
    pub buffers: Vec<Arc<HostBuffer>>,
    pub tensors: Vec<Placement>,
}

impl Loaded {
    pub fn bytes(&self, t: &Placement) -> &[u8] {
        &self.buffers[t.file].as_slice()[t.offset as usize..(t.offset + t.nbytes) as usize]
    }

    pub fn read_paths(&self) -> Vec<ReadPath> {
        self.buffers.iter().map(|b| b.read_path()).collect()
    }
}

/// Opens `paths`, validates every header and the names across files, then reads all files
/// in parallel. Nothing is read until every header is known to be good.
pub fn load(paths: &[PathBuf], options: &LoadOptions) -> Result<Loaded> {
    let sources = paths.iter().map(|p| SourceFile::open(p)).collect::<Result<Vec<_>>>()?;
    let headers = sources.iter().map(SourceFile::header).collect::<Result<Vec<Header>>>()?;
    let tensors = plan::place(paths, &headers)?;
    let buffers = io::io_pool().install(|| {
        sources
            .par_iter()
            .map(|src| src.read(options.reader, options.block).map(Arc::new))
            .collect::<Result<Vec<_>>>()
    })?;
    Ok(Loaded { buffers, tensors })
}

/// Reads and validates one file's header without touching its data.
pub fn read_header(path: &std::path::Path) -> Result<Header> {
    SourceFile::open(path)?.header()
}
