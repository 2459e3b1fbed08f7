//! The staged path to device memory, for when GPUDirect Storage is not there.
//!
//! Reader threads fill a ring of staging buffers (pinned memory on CUDA) with blocks of the
//! files and hand each to the device for an asynchronous copy as soon as it is full, so disk
//! reads overlap with host-to-device copies. A buffer is refilled only once its previous copy
//! has completed. Staging memory is bounded: at most `slots` buffers of `block` bytes,
//! allocated as the reads need them.

use std::sync::{Condvar, Mutex};

use rayon::prelude::*;

use crate::device::StagingDevice;
use crate::error::Result;
use crate::io::direct::BlockReader;
use crate::io::{io_pool, ReadPath, SourceFile};
use crate::plan::{self, IO_ALIGN};

/// One file and where its byte 0 goes in device memory (`align_up(len, 4096)` bytes there).
pub struct StagedFile<'a> {
    pub src: &'a SourceFile,
    pub dst: u64,
    /// Read with O_DIRECT (cold file) rather than through the page cache (warm file).
    pub direct: bool,
}

#[derive(Debug, Clone, Copy)]
pub struct StagingOptions {
    /// Bytes per read and per copy.
    pub block: u64,
    /// Most staging buffers alive at once.
    pub slots: usize,
}

impl Default for StagingOptions {
    fn default() -> Self {
        StagingOptions { block: plan::DEFAULT_BLOCK, slots: 2 * io_pool().current_num_threads() }
    }
}

/// Copies every file to its device destination. Returns how each file was read. When this
/// returns, every copy it started has completed, whether it succeeded or not.
pub fn copy_files<D: StagingDevice>(
    device: &D,
    files: &[StagedFile],
    options: &StagingOptions,
) -> Result<Vec<ReadPath>> {
    let block = plan::io_block(options.block);
    let readers = files.iter().map(|f| BlockReader::open(f.src, f.direct)).collect::<Result<Vec<_>>>()?;
    let jobs: Vec<_> = files
        .iter()
        .enumerate()
        .flat_map(|(i, f)| plan::read_blocks(f.src.len, IO_ALIGN, block).into_iter().map(move |b| (i, b)))
        .collect();
    let ring = Ring::new(options.slots.clamp(1, jobs.len().max(1)));

    let copied = io_pool().install(|| {
        jobs.par_iter().try_for_each(|&(i, b)| {
            let mut staging = ring.take(|| device.alloc_staging(block as usize))?;
            let result = device
                .wait(&mut staging)
                .and_then(|()| readers[i].read(&b, device.bytes(&mut staging)))
                .and_then(|()| device.copy_async(&mut staging, b.expected as usize, files[i].dst + b.offset));
            ring.give(staging);
            result
        })
    });
    // Every copy must be complete before the staging memory is freed or the tensors used.
    let drained = ring.into_inner().iter_mut().try_for_each(|s| device.wait(s));
    copied?;
    drained?;
    Ok(readers.iter().map(BlockReader::path).collect())
}

/// The staging buffers not in use, and how many more may be allocated.
struct Ring<S> {
    state: Mutex<(Vec<S>, usize)>,
    returned: Condvar,
}

impl<S> Ring<S> {
    fn new(capacity: usize) -> Ring<S> {
        Ring { state: Mutex::new((Vec::with_capacity(capacity), capacity)), returned: Condvar::new() }
    }

    /// A free buffer, a new one while under capacity, or the next one returned.
    fn take(&self, alloc: impl FnOnce() -> Result<S>) -> Result<S> {
        let mut state = self.state.lock().unwrap();
        loop {
            if let Some(s) = state.0.pop() {
                return Ok(s);
            }
            if state.1 > 0 {
                state.1 -= 1;
                drop(state);
                return alloc().inspect_err(|_| {
                    self.state.lock().unwrap().1 += 1;
                    self.returned.notify_one();
                });
            }
            state = self.returned.wait(state).unwrap();
        }
    }

    fn give(&self, s: S) {
        self.state.lock().unwrap().0.push(s);
        self.returned.notify_one();
    }

    fn into_inner(self) -> Vec<S> {
        self.state.into_inner().unwrap().0
    }
}
