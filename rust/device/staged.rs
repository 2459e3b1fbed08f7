//! The staged path to device memory, for when GPUDirect Storage is not there.
//!
//! Reader threads fill a ring of staging buffers (pinned memory on CUDA) with blocks of the
//! files and hand each to the device for an asynchronous copy as soon as it is full, so disk
//! reads overlap with host-to-device copies. The ring is first in, first out: a reader takes
//! the buffer whose copy was queued longest ago, so it rarely waits, and every slot is used.
//! Staging memory is bounded (at most `slots` buffers of `block` bytes per load) and comes
//! from the device's pool, to which it returns after the load: pinned allocation is slow and
//! synchronizes.
//!
//! Whatever happens — a failed read, copy, event record or wait, or a panic in a worker —
//! every buffer is waited for before it is reused, returned or freed, and the device memory
//! is not written once the load has returned: the ring drains every slot when dropped, and
//! synchronizes the stream after any error.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};

use rayon::prelude::*;

use crate::device::{Device, StagingOptions};
use crate::error::Result;
use crate::plan::{self, IO_ALIGN};
use crate::source::direct::BlockReader;
use crate::source::{io_pool, ReadPath};
use crate::verify::FileCheck;

/// An aligned range of a source (all of it, or one extent) read by `reader`, and where its
/// first byte goes in device memory (`len` bytes there).
pub struct StagedFile<'a> {
    pub reader: &'a BlockReader,
    pub dst: u64,
    /// Source offset of the range: a multiple of 4096.
    pub start: u64,
    /// Bytes of the range: a multiple of 4096.
    pub len: u64,
    /// A verified load's check of the source, fed from the staging buffers.
    pub check: Option<&'a FileCheck>,
}

impl<'a> StagedFile<'a> {
    /// All of the reader's source, its byte 0 at `dst` (`align_up(len, 4096)` bytes there).
    pub fn whole(reader: &'a BlockReader, dst: u64) -> StagedFile<'a> {
        StagedFile { reader, dst, start: 0, len: plan::align_up(reader.source().len(), IO_ALIGN), check: None }
    }
}

/// Copies every file to its device destination, ordered after the destination's previous
/// work. Returns how each file was read. When this returns (or unwinds), every copy it
/// started has completed, whether it succeeded or not.
pub fn copy_files<D: Device>(device: &D, files: &[StagedFile], options: &StagingOptions) -> Result<Vec<ReadPath>> {
    let block = plan::io_block(options.block);
    let jobs: Vec<_> = files
        .iter()
        .enumerate()
        .flat_map(|(i, f)| {
            plan::extent_blocks(f.start, f.len, f.reader.source().len(), IO_ALIGN, block)
                .into_iter()
                .map(move |b| (i, b))
        })
        .collect();
    if jobs.is_empty() {
        return Ok(files.iter().map(|f| f.reader.path()).collect());
    }
    device.order_after_ready()?;
    let ring = Ring::new(device, options.slots.clamp(1, jobs.len()), block as usize);
    let copied = io_pool().install(|| {
        jobs.par_iter().try_for_each(|&(i, b)| {
            let mut slot = ring.take()?;
            device.wait(slot.staging())?;
            let staging = device.bytes(slot.staging());
            files[i].reader.read(&b, staging)?;
            if let Some(check) = files[i].check {
                // Hashed from the slot before its copy is queued (it is reused after).
                check.landed_transient(b.offset, &staging[..b.expected as usize]);
            }
            device.copy_async(slot.staging(), b.expected as usize, files[i].dst + (b.offset - files[i].start))
        })
    });
    let drained = ring.drain(copied.is_err());
    copied?;
    drained?;
    Ok(files.iter().map(|f| f.reader.path()).collect())
}

/// The staging buffers of one load: those not in use, first in first out, and how many more
/// may be brought in (from the pool, or allocated).
struct Ring<'d, D: Device> {
    device: &'d D,
    len: usize,
    state: Mutex<RingState<D::Staging>>,
    returned: Condvar,
}

struct RingState<S> {
    free: VecDeque<S>,
    /// Buffers this load may still bring in.
    more: usize,
    drained: bool,
}

impl<'d, D: Device> Ring<'d, D> {
    fn new(device: &'d D, slots: usize, len: usize) -> Ring<'d, D> {
        let state = RingState { free: VecDeque::with_capacity(slots), more: slots, drained: false };
        Ring { device, len, state: Mutex::new(state), returned: Condvar::new() }
    }

    /// A buffer for the next block: a new one while fewer than `slots` are in the ring (so
    /// that every slot is in use before any is reused), else the one returned longest ago.
    fn take(&self) -> Result<Slot<'_, 'd, D>> {
        let mut state = self.state.lock().unwrap();
        loop {
            if state.more > 0 {
                state.more -= 1;
                drop(state);
                return match self.bring_in() {
                    Ok(staging) => Ok(Slot { ring: self, staging: Some(staging) }),
                    Err(e) => {
                        let mut state = self.state.lock().unwrap();
                        state.more += 1;
                        self.returned.notify_one();
                        Err(e)
                    }
                };
            }
            if let Some(staging) = state.free.pop_front() {
                return Ok(Slot { ring: self, staging: Some(staging) });
            }
            state = self.returned.wait(state).unwrap();
        }
    }

    /// A buffer from the device's pool (large enough), or a new one.
    fn bring_in(&self) -> Result<D::Staging> {
        while let Some(staging) = self.device.pool().take() {
            if self.device.staging_len(&staging) >= self.len {
                return Ok(staging);
            }
        }
        self.device.alloc_staging(self.len)
    }

    fn give(&self, staging: D::Staging) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.free.push_back(staging);
        self.returned.notify_one();
    }

    /// Waits for every buffer's last copy, synchronizing the stream if anything failed, then
    /// returns the buffers to the pool. Once drained, the ring is empty.
    fn drain(&self, failed: bool) -> Result<()> {
        // Never panics, even on a poisoned lock: it also runs while unwinding.
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.drained {
            return Ok(());
        }
        state.drained = true;
        // Every worker has finished, normally or by unwinding (rayon joins every job before
        // it propagates a panic, and a slot gives its buffer back when dropped): all buffers
        // are in `free`.
        let mut buffers: Vec<_> = state.free.drain(..).collect();
        drop(state);
        let mut first_error = None;
        for staging in &mut buffers {
            if let Err(e) = self.device.wait(staging) {
                first_error.get_or_insert(e);
            }
        }
        if failed || first_error.is_some() {
            if let Err(e) = self.device.synchronize() {
                // Whether the copies out of these buffers are done cannot be known: keep the
                // memory rather than free it under a running copy.
                std::mem::forget(buffers);
                return Err(first_error.unwrap_or(e));
            }
        }
        for staging in buffers {
            self.device.pool().put(staging);
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl<D: Device> Drop for Ring<'_, D> {
    fn drop(&mut self) {
        // Reached without `drain` only when unwinding from a panic in a worker.
        let _ = self.drain(true);
    }
}

/// A buffer taken from the ring; given back when dropped, also when a worker panics.
struct Slot<'r, 'd, D: Device> {
    ring: &'r Ring<'d, D>,
    staging: Option<D::Staging>,
}

impl<D: Device> Slot<'_, '_, D> {
    fn staging(&mut self) -> &mut D::Staging {
        self.staging.as_mut().expect("a slot holds its buffer until dropped")
    }
}

impl<D: Device> Drop for Slot<'_, '_, D> {
    fn drop(&mut self) {
        if let Some(staging) = self.staging.take() {
            self.ring.give(staging);
        }
    }
}
