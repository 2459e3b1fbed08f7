//! The GPUDirect Storage path: cuFile DMAs file blocks straight into device memory.
//!
//! Per file: the file is opened with `O_DIRECT` and registered; the destination is
//! registered in chunks of at most `register_chunk` bytes (registration pins BAR space,
//! which is limited), and each chunk's blocks are read in parallel. Every registration is
//! undone, on success and on failure. Any failure is returned as the library's words, for
//! the caller to fall back to the staged path (or fail, when GDS was required).

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;

use rayon::prelude::*;

use crate::cuda::cufile::{CuFileApi, FileHandle};
use crate::io::{io_pool, SourceFile};
use crate::plan::{self, ReadBlock, IO_ALIGN};

/// Whether to use GPUDirect Storage (the `nogds` argument of fastsafetensors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GdsMode {
    /// Where the nvidia-fs driver is loaded; the staged path otherwise or on failure.
    #[default]
    Auto,
    /// Never (`nogds=True`).
    Never,
    /// Always, failing clearly if it cannot (`nogds=False`).
    Require,
}

impl GdsMode {
    pub fn from_nogds(nogds: Option<bool>) -> GdsMode {
        match nogds {
            None => GdsMode::Auto,
            Some(true) => GdsMode::Never,
            Some(false) => GdsMode::Require,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct GdsOptions {
    pub block: u64,
    /// Most bytes of destination registered at once.
    pub register_chunk: u64,
}

impl Default for GdsOptions {
    fn default() -> Self {
        GdsOptions { block: plan::DEFAULT_BLOCK, register_chunk: 256 << 20 }
    }
}

/// Reads `src` whole into device memory at `dst` (`align_up(len, 4096)` bytes there).
pub fn read_file<A: CuFileApi>(api: &A, src: &SourceFile, dst: u64, options: &GdsOptions) -> Result<(), String> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(&src.path)
        .map_err(|e| format!("open with O_DIRECT failed: {e}"))?;
    let handle = HandleGuard(api, api.register_handle(file.as_raw_fd())?);
    let block = plan::io_block(options.block);
    let chunk = plan::align_up(options.register_chunk.max(block), block);
    let blocks = plan::read_blocks(src.len, IO_ALIGN, block);
    for chunk_blocks in blocks.chunks((chunk / block) as usize) {
        let start = chunk_blocks[0].offset;
        let len = chunk_blocks.iter().map(|b| b.len).sum::<u64>();
        api.register_buffer(dst + start, len as usize)?;
        let _registered = BufferGuard(api, dst + start);
        io_pool()
            .install(|| chunk_blocks.par_iter().try_for_each(|b| read_block(api, handle.1, dst + start, start, b)))?;
    }
    Ok(())
}

fn read_block<A: CuFileApi>(
    api: &A,
    handle: FileHandle,
    base: u64,
    base_start: u64,
    b: &ReadBlock,
) -> Result<(), String> {
    let mut done = 0u64;
    while done < b.expected {
        let n = api.read(handle, base, (b.len - done) as usize, b.offset + done, b.offset - base_start + done)?;
        if n == 0 {
            return Err(format!("cuFileRead returned no data at offset {} (file truncated?)", b.offset + done));
        }
        done += n as u64;
    }
    Ok(())
}

/// Deregisters the file handle when dropped.
struct HandleGuard<'a, A: CuFileApi>(&'a A, FileHandle);

impl<A: CuFileApi> Drop for HandleGuard<'_, A> {
    fn drop(&mut self) {
        self.0.deregister_handle(self.1);
    }
}

/// Deregisters a destination chunk when dropped.
struct BufferGuard<'a, A: CuFileApi>(&'a A, u64);

impl<A: CuFileApi> Drop for BufferGuard<'_, A> {
    fn drop(&mut self) {
        self.0.deregister_buffer(self.1);
    }
}
