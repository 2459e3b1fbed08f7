//! Device memory: everything that touches the CUDA driver, the two ways bytes reach a device,
//! and the host-memory stand-in that tests them without a GPU.
//!
//! Layered like cudarc: [`driver`], [`vmm`] (device memory another process can map, for kept
//! weights) and [`cufile`] hold the `unsafe` calls and the RAII types whose `Drop` releases
//! what they own (loaded at run time: no toolkit at build time, no
//! failure on machines without a GPU until CUDA is asked for). Above them, safe code:
//! [`staged`] copies through a ring of pinned staging buffers, [`gds`] reads with GPUDirect
//! Storage, and both go through the [`Device`] trait defined here.
//!
//! ```no_run
//! use fastsafetensors::device::driver::{Context, PinnedBuffer, Stream};
//! let ctx = Context::primary(0)?;            // torch's context on device 0
//! let stream = Stream::new(&ctx)?;
//! let mut staging = PinnedBuffer::new(&ctx, 1 << 20)?;
//! staging.as_mut_slice()[0] = 42;
//! # let device_address = 0;
//! stream.copy_to_device(&staging, 1, device_address)?;
//! stream.synchronize()?;
//! # Ok::<(), fastsafetensors::Error>(())
//! ```
//!
//! Facts that shape this module: without libcuda, cudarc's calls panic, so presence is
//! checked first; `cuFileDriverOpen` hangs forever on a machine with no GPU, so cuFile is
//! opened only after a context exists on a real device.
//!
//! [`Device`] is small on purpose: a way to make the device current on a thread (for cuFile),
//! staging memory the disk can DMA into, an asynchronous copy out of it, ways to wait for
//! that copy, and the ordering against the work the destination's previous owner queued.
//! [`CudaDevice`] implements it with pinned memory, one stream and one event per staging
//! buffer. [`HostMemoryDevice`] is a host-memory stand-in that lets the paths be tested bit
//! for bit on machines without a GPU: its copies run only when waited for, in queue order, so
//! a pipeline that reused a staging buffer too early, freed one under a queued copy, or did
//! not order its copies after the destination's previous work copies the wrong bytes and
//! fails its tests.

pub mod cufile;
pub mod driver;
pub mod gds;
pub mod staged;
pub mod vmm;

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use memmap2::MmapMut;

use crate::device::driver::{Context, Event, PinnedBuffer, RawEvent, Stream};
use crate::error::{Error, Result};
use crate::plan;
use crate::source::io_pool;

pub trait Device: Sync {
    /// A staging buffer and whatever tracks the copy out of it.
    type Staging: Send;

    /// Runs `f` with the device current on the calling thread, and restores what was current
    /// before, however `f` ends. cuFile calls need it; the methods below bind themselves.
    fn with_current<T>(&self, f: impl FnOnce() -> T) -> Result<T>;
    /// Idle staging buffers kept between loads.
    fn pool(&self) -> &StagingPool<Self::Staging>;
    fn alloc_staging(&self, len: usize) -> Result<Self::Staging>;
    fn staging_len(&self, staging: &Self::Staging) -> usize;
    /// The staging bytes, to read the file into. Only called after `wait`.
    fn bytes<'a>(&self, staging: &'a mut Self::Staging) -> &'a mut [u8];
    /// Starts copying `staging[..len]` to device address `dst`. On error the copy may still
    /// have been queued: `wait` then still waits for it.
    fn copy_async(&self, staging: &mut Self::Staging, len: usize, dst: u64) -> Result<()>;
    /// Starts copying `len` bytes at device address `src` into `staging[at..at + len]` (the
    /// way a save takes tensors off the device). `wait` waits for it as for a copy out.
    fn copy_to_host_async(&self, staging: &mut Self::Staging, at: usize, len: usize, src: u64) -> Result<()>;
    /// Blocks until the last copy out of `staging` has completed.
    fn wait(&self, staging: &mut Self::Staging) -> Result<()>;
    /// Orders the copies queued from now on after the work the destination's previous owner
    /// queued (torch's current stream, when the memory was allocated).
    fn order_after_ready(&self) -> Result<()>;
    /// Blocks until that work is done: for writers outside our stream (cuFile).
    fn wait_ready(&self) -> Result<()>;
    /// Blocks until every copy queued has completed.
    fn synchronize(&self) -> Result<()>;
}

/// How the staged path reads and copies.
#[derive(Debug, Clone, Copy)]
pub struct StagingOptions {
    /// Bytes per read and per copy.
    pub block: u64,
    /// Most staging buffers in use at once by one load.
    pub slots: usize,
}

impl Default for StagingOptions {
    fn default() -> Self {
        StagingOptions { block: plan::DEFAULT_BLOCK, slots: 2 * io_pool().current_num_threads() }
    }
}

/// Idle staging buffers, kept for the next load: pinned allocation is slow and synchronizes.
/// Holds at most `keep` buffers; a buffer put beyond that is freed.
pub struct StagingPool<S> {
    idle: Mutex<Vec<S>>,
    keep: usize,
}

impl<S> StagingPool<S> {
    pub fn new(keep: usize) -> StagingPool<S> {
        StagingPool { idle: Mutex::new(Vec::new()), keep }
    }

    pub fn take(&self) -> Option<S> {
        self.idle.lock().unwrap().pop()
    }

    /// Keeps `staging` (whose copies have all completed) for later, or frees it.
    pub fn put(&self, staging: S) {
        let mut idle = self.idle.lock().unwrap();
        if idle.len() < self.keep {
            idle.push(staging);
        }
    }

    /// Frees every idle buffer; returns how many there were.
    pub fn clear(&self) -> usize {
        let drained: Vec<S> = std::mem::take(&mut *self.idle.lock().unwrap());
        drained.len()
    }

    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap().len()
    }
}

/// A CUDA device for one load: our own stream, ordered after torch's (`ready`), and the
/// device's pinned staging pool, shared by every load to that device.
pub struct CudaDevice {
    ctx: Context,
    stream: Stream,
    ready: Option<RawEvent>,
    pool: Arc<StagingPool<CudaStaging>>,
}

pub struct CudaStaging {
    buffer: PinnedBuffer,
    copied: Event,
    pending: Pending,
}

/// What is known about the last copy out of a staging buffer.
enum Pending {
    None,
    /// Queued (or maybe queued: the call failed) without its event: wait for the stream.
    Queued,
    /// Queued, and its event recorded after it.
    Recorded,
}

impl CudaDevice {
    /// `ready`: an event recorded on torch's current stream once the destinations were
    /// allocated; the copies are ordered after it.
    pub fn new(ctx: Context, ready: Option<RawEvent>) -> Result<CudaDevice> {
        let stream = Stream::new(&ctx)?;
        let pool = cuda_pool(ctx.ordinal());
        Ok(CudaDevice { ctx, stream, ready, pool })
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }
}

/// The pinned staging pool of CUDA device `ordinal`.
fn cuda_pool(ordinal: usize) -> Arc<StagingPool<CudaStaging>> {
    let mut pools = cuda_pools().lock().unwrap();
    Arc::clone(pools.entry(ordinal).or_insert_with(|| Arc::new(StagingPool::new(StagingOptions::default().slots))))
}

fn cuda_pools() -> &'static Mutex<HashMap<usize, Arc<StagingPool<CudaStaging>>>> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<StagingPool<CudaStaging>>>>> = OnceLock::new();
    POOLS.get_or_init(Mutex::default)
}

/// Frees the idle pinned staging buffers of every CUDA device (those of loads running now
/// are freed when they finish); returns how many were freed.
pub fn release_cuda_staging() -> usize {
    let pools: Vec<_> = cuda_pools().lock().unwrap().values().cloned().collect();
    pools.iter().map(|p| p.clear()).sum()
}

impl Device for CudaDevice {
    type Staging = CudaStaging;

    fn with_current<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let _current = self.ctx.enter()?;
        Ok(f())
    }

    fn pool(&self) -> &StagingPool<CudaStaging> {
        &self.pool
    }

    fn alloc_staging(&self, len: usize) -> Result<CudaStaging> {
        let buffer = PinnedBuffer::new(&self.ctx, len)?;
        Ok(CudaStaging { buffer, copied: Event::new(&self.ctx)?, pending: Pending::None })
    }

    fn staging_len(&self, staging: &CudaStaging) -> usize {
        staging.buffer.len()
    }

    fn bytes<'a>(&self, staging: &'a mut CudaStaging) -> &'a mut [u8] {
        staging.buffer.as_mut_slice()
    }

    fn copy_async(&self, staging: &mut CudaStaging, len: usize, dst: u64) -> Result<()> {
        // Pending before the copy is queued: if recording the event fails, the copy may be
        // running, and `wait` must then wait for the whole stream.
        staging.pending = Pending::Queued;
        self.stream.copy_to_device(&staging.buffer, len, dst)?;
        staging.copied.record(&self.stream)?;
        staging.pending = Pending::Recorded;
        Ok(())
    }

    fn copy_to_host_async(&self, staging: &mut CudaStaging, at: usize, len: usize, src: u64) -> Result<()> {
        staging.pending = Pending::Queued;
        self.stream.copy_to_host(&mut staging.buffer, at, len, src)?;
        staging.copied.record(&self.stream)?;
        staging.pending = Pending::Recorded;
        Ok(())
    }

    fn wait(&self, staging: &mut CudaStaging) -> Result<()> {
        match staging.pending {
            Pending::None => {}
            Pending::Recorded => staging.copied.synchronize()?,
            Pending::Queued => self.stream.synchronize()?,
        }
        staging.pending = Pending::None;
        Ok(())
    }

    fn order_after_ready(&self) -> Result<()> {
        self.ready.map_or(Ok(()), |event| self.stream.wait_for(event))
    }

    fn wait_ready(&self) -> Result<()> {
        self.ready.map_or(Ok(()), |event| event.synchronize(&self.ctx))
    }

    fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }
}

thread_local! {
    /// The stand-in's "current context" stack on this thread: device ids.
    static CURRENT: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Host memory standing in for a device: address `a` is byte `a` of its memory.
///
/// It models what the pipeline must get right on a real device:
/// - one stream: copies run in the order queued, only when waited for (`wait` runs the queue
///   up to that buffer's copy, `synchronize` all of it), reading the staging bytes then;
/// - a staging buffer freed while its copy is queued is counted (`freed_in_flight`);
/// - `with_prior_write` stands for work the destination's previous owner queued on its own
///   stream: it lands when `order_after_ready` queues it ahead of our copies, when
///   `wait_ready` waits for it, or — too late — when the test calls `finish_prior_work`;
/// - a per-thread current-device stack (`with_current`, `current`), for cuFile fakes to check;
/// - faults injected at a given copy or wait.
pub struct HostMemoryDevice {
    id: u64,
    state: Arc<Mutex<HostState>>,
    pool: StagingPool<HostStaging>,
    faults: Faults,
}

#[derive(Default, Clone, Copy)]
struct Faults {
    /// Fail the n-th copy (0-based) before queueing it.
    copy: Option<usize>,
    /// Queue the n-th copy, then fail (as a failed event record does).
    record: Option<usize>,
    /// Panic at the n-th copy.
    panic: Option<usize>,
    /// Fail the first wait on a queued copy once this many copies were started.
    wait_after: Option<usize>,
}

#[derive(Default)]
struct HostState {
    memory: Vec<u8>,
    /// Our stream's work, in order.
    queue: VecDeque<Queued>,
    /// Work of the destination's previous owner, not yet run: (address, bytes).
    prior: Option<(u64, Vec<u8>)>,
    copies: usize,
    staging_allocated: usize,
    staging_used: std::collections::BTreeSet<u64>,
    freed_in_flight: usize,
    newest_waits: usize,
    wait_failed: bool,
}

enum Queued {
    /// (copy number, staging id, source address, len, destination)
    Copy {
        seq: usize,
        staging: u64,
        src: usize,
        len: usize,
        dst: u64,
    },
    Prior(u64, Vec<u8>),
    /// (copy number, staging id, source address, len, destination in the staging buffer)
    ToHost {
        seq: usize,
        staging: u64,
        src: u64,
        len: usize,
        dst: usize,
    },
}

impl Queued {
    /// The copy number and staging buffer of a copy in either direction.
    fn copy(&self) -> Option<(usize, u64)> {
        match *self {
            Queued::Copy { seq, staging, .. } | Queued::ToHost { seq, staging, .. } => Some((seq, staging)),
            Queued::Prior(..) => None,
        }
    }
}

pub struct HostStaging {
    id: u64,
    buffer: MmapMut,
    /// Number of its latest queued copy.
    last_copy: Option<usize>,
    state: Arc<Mutex<HostState>>,
}

impl Drop for HostStaging {
    fn drop(&mut self) {
        let mut state = self.state.lock().unwrap();
        let before = state.queue.len();
        // The copy would read freed memory: count it and drop it from the queue.
        state.queue.retain(|q| q.copy().is_none_or(|(_, staging)| staging != self.id));
        if state.queue.len() != before {
            state.freed_in_flight += 1;
        }
    }
}

impl HostState {
    fn write(&mut self, dst: u64, bytes: &[u8]) {
        let dst = dst as usize;
        self.memory[dst..dst + bytes.len()].copy_from_slice(bytes);
    }

    /// Runs the queue up to and including copy `until` (everything when `None`).
    fn run(&mut self, until: Option<usize>) {
        while let Some(q) = self.queue.pop_front() {
            match q {
                Queued::Copy { seq, src, len, dst, .. } => {
                    // SAFETY: `src` points into a staging buffer's mapping, which is alive:
                    // a HostStaging removes its copies from the queue before it is unmapped.
                    let bytes = unsafe { std::slice::from_raw_parts(src as *const u8, len) }.to_vec();
                    self.write(dst, &bytes);
                    if Some(seq) == until {
                        return;
                    }
                }
                Queued::Prior(dst, bytes) => self.write(dst, &bytes),
                Queued::ToHost { seq, src, len, dst, .. } => {
                    let src = src as usize;
                    // SAFETY: as above, `dst` points into a live staging buffer's mapping.
                    let out = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
                    out.copy_from_slice(&self.memory[src..src + len]);
                    if Some(seq) == until {
                        return;
                    }
                }
            }
        }
    }
}

impl HostMemoryDevice {
    pub fn new(len: usize) -> HostMemoryDevice {
        let state = HostState { memory: vec![0; len], ..HostState::default() };
        HostMemoryDevice {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            state: Arc::new(Mutex::new(state)),
            pool: StagingPool::new(64),
            faults: Faults::default(),
        }
    }

    /// Fails the n-th copy (0-based) before queueing it.
    pub fn failing_at_copy(mut self, n: usize) -> HostMemoryDevice {
        self.faults.copy = Some(n);
        self
    }

    /// Queues the n-th copy and then fails, as when recording its event fails.
    pub fn failing_record_at_copy(mut self, n: usize) -> HostMemoryDevice {
        self.faults.record = Some(n);
        self
    }

    /// Panics at the n-th copy, as a bug in a worker would.
    pub fn panicking_at_copy(mut self, n: usize) -> HostMemoryDevice {
        self.faults.panic = Some(n);
        self
    }

    /// Fails the first wait on a queued copy once `copies` copies were started.
    pub fn failing_wait_after(mut self, copies: usize) -> HostMemoryDevice {
        self.faults.wait_after = Some(copies);
        self
    }

    /// Work the destination's previous owner queued and that has not run yet: `bytes` at `dst`.
    pub fn with_prior_write(self, dst: u64, bytes: Vec<u8>) -> HostMemoryDevice {
        self.state.lock().unwrap().prior = Some((dst, bytes));
        self
    }

    /// Lets that work finish, if nothing waited for it.
    pub fn finish_prior_work(&self) {
        let mut state = self.state.lock().unwrap();
        if let Some((dst, bytes)) = state.prior.take() {
            state.write(dst, &bytes);
        }
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// The stand-in device current on the calling thread, if any.
    pub fn current() -> Option<u64> {
        CURRENT.with(|c| c.borrow().last().copied())
    }

    /// Writes straight into device memory, as another DMA engine (cuFile) does.
    pub fn write(&self, dst: u64, bytes: &[u8]) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        if dst as usize + bytes.len() > state.memory.len() {
            return Err(Error::Cuda(format!("write to {dst}..+{} is out of device memory", bytes.len())));
        }
        state.write(dst, bytes);
        Ok(())
    }

    pub fn memory(&self) -> Vec<u8> {
        self.state.lock().unwrap().memory.clone()
    }

    /// Copies started so far.
    pub fn copies(&self) -> usize {
        self.state.lock().unwrap().copies
    }

    /// Copies queued and not yet run.
    pub fn in_flight(&self) -> usize {
        self.state.lock().unwrap().queue.iter().filter(|q| q.copy().is_some()).count()
    }

    /// Staging buffers allocated so far.
    pub fn staging_allocated(&self) -> usize {
        self.state.lock().unwrap().staging_allocated
    }

    /// Distinct staging buffers copies were made from.
    pub fn staging_used(&self) -> usize {
        self.state.lock().unwrap().staging_used.len()
    }

    /// Staging buffers freed while a copy out of them was still queued.
    pub fn freed_in_flight(&self) -> usize {
        self.state.lock().unwrap().freed_in_flight
    }

    /// Waits on the copy started last: the pipeline blocked on its newest copy although
    /// older ones were queued.
    pub fn newest_waits(&self) -> usize {
        self.state.lock().unwrap().newest_waits
    }
}

/// Pops the stand-in's current-device stack when dropped, even on a panic.
struct Entered;

impl Drop for Entered {
    fn drop(&mut self) {
        CURRENT.with(|c| c.borrow_mut().pop());
    }
}

impl Device for HostMemoryDevice {
    type Staging = HostStaging;

    fn with_current<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        CURRENT.with(|c| c.borrow_mut().push(self.id));
        let _entered = Entered;
        Ok(f())
    }

    fn pool(&self) -> &StagingPool<HostStaging> {
        &self.pool
    }

    fn alloc_staging(&self, len: usize) -> Result<HostStaging> {
        // Page-aligned, as pinned memory is, so O_DIRECT reads into it work.
        let buffer = MmapMut::map_anon(len).map_err(|e| Error::Cuda(format!("staging allocation failed: {e}")))?;
        self.state.lock().unwrap().staging_allocated += 1;
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(HostStaging { id, buffer, last_copy: None, state: Arc::clone(&self.state) })
    }

    fn staging_len(&self, staging: &HostStaging) -> usize {
        staging.buffer.len()
    }

    fn bytes<'a>(&self, staging: &'a mut HostStaging) -> &'a mut [u8] {
        let queued = self.state.lock().unwrap().queue.iter().any(|q| q.copy().is_some_and(|(_, s)| s == staging.id));
        assert!(!queued, "staging buffer touched while its copy is in flight");
        &mut staging.buffer
    }

    fn copy_async(&self, staging: &mut HostStaging, len: usize, dst: u64) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        let seq = state.copies;
        if self.faults.panic == Some(seq) {
            state.copies += 1;
            drop(state);
            panic!("copy {seq} panicked (injected)");
        }
        if self.faults.copy == Some(seq) {
            return Err(Error::Cuda(format!("copy {seq} failed (injected)")));
        }
        state.copies += 1;
        let end = dst as usize + len;
        if end > state.memory.len() {
            return Err(Error::Cuda(format!("copy to {dst}..{end} is out of device memory")));
        }
        state.staging_used.insert(staging.id);
        let src = staging.buffer.as_ptr() as usize;
        state.queue.push_back(Queued::Copy { seq, staging: staging.id, src, len, dst });
        staging.last_copy = Some(seq);
        if self.faults.record == Some(seq) {
            return Err(Error::Cuda(format!("recording the event of copy {seq} failed (injected)")));
        }
        Ok(())
    }

    fn copy_to_host_async(&self, staging: &mut HostStaging, at: usize, len: usize, src: u64) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        let seq = state.copies;
        if self.faults.copy == Some(seq) {
            return Err(Error::Cuda(format!("copy {seq} failed (injected)")));
        }
        state.copies += 1;
        let end = src as usize + len;
        if end > state.memory.len() || at + len > staging.buffer.len() {
            return Err(Error::Cuda(format!("copy from {src}..{end} is out of device or staging memory")));
        }
        state.staging_used.insert(staging.id);
        let dst = staging.buffer.as_mut_ptr() as usize + at;
        state.queue.push_back(Queued::ToHost { seq, staging: staging.id, src, len, dst });
        staging.last_copy = Some(seq);
        Ok(())
    }

    fn wait(&self, staging: &mut HostStaging) -> Result<()> {
        let Some(seq) = staging.last_copy else { return Ok(()) };
        let mut state = self.state.lock().unwrap();
        let queued = state.queue.iter().any(|q| q.copy().is_some_and(|(s, _)| s == seq));
        if queued {
            if let Some(after) = self.faults.wait_after {
                if state.copies >= after && !state.wait_failed {
                    state.wait_failed = true;
                    return Err(Error::Cuda(format!("waiting for copy {seq} failed (injected)")));
                }
            }
            let older_queued = state.queue.iter().any(|q| q.copy().is_some_and(|(s, _)| s < seq));
            if seq + 1 == state.copies && older_queued {
                state.newest_waits += 1;
            }
            state.run(Some(seq));
        }
        staging.last_copy = None;
        Ok(())
    }

    fn order_after_ready(&self) -> Result<()> {
        let mut state = self.state.lock().unwrap();
        if let Some((dst, bytes)) = state.prior.take() {
            state.queue.push_back(Queued::Prior(dst, bytes));
        }
        Ok(())
    }

    fn wait_ready(&self) -> Result<()> {
        self.finish_prior_work();
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.state.lock().unwrap().run(None);
        Ok(())
    }
}
