//! The CUDA driver API (through cudarc's `sys` and `result` layers): contexts, streams,
//! pinned host memory, events. Every type releases what it owns on drop.
//!
//! Nothing here leaves a context current on any thread: each call that needs one pushes its
//! object's context and pops it again ([`Context::enter`]), so the caller's current device —
//! torch's, or a CuPy or PyCUDA context — is what it was. Every object holds its context, so
//! the context is released only after the last stream, event and pinned buffer made in it.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys};

use crate::error::{Error, Result};

fn cuda_error(what: &str, e: result::DriverError) -> Error {
    let name = e.error_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    Error::Cuda(format!("{what} failed: {name} ({:?})", e.0))
}

/// Whether libcuda can be loaded. cudarc panics on any call when it cannot.
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the library.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// Number of CUDA devices, after initialising the driver.
pub fn device_count() -> Result<usize> {
    if !driver_present() {
        return Err(Error::Cuda("no CUDA driver: libcuda.so could not be loaded".into()));
    }
    result::init().map_err(|e| cuda_error("cuInit", e))?;
    let count = result::device::get_count().map_err(|e| cuda_error("cuDeviceGetCount", e))?;
    Ok(count.max(0) as usize)
}

/// The primary context of a device: the one the CUDA runtime, and so torch, uses. Cloning
/// shares one retain; the last clone releases it.
#[derive(Clone)]
pub struct Context(Arc<Primary>);

struct Primary {
    device: sys::CUdevice,
    raw: sys::CUcontext,
    ordinal: usize,
}

// SAFETY: a CUDA context may be used from any thread; each use binds it with `enter`.
unsafe impl Send for Primary {}
unsafe impl Sync for Primary {}

impl Drop for Primary {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `Context::primary`. Every object made in the context
        // holds a `Context`, so none is left.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

impl Context {
    /// Retains device `ordinal`'s primary context. Does not make it current anywhere.
    pub fn primary(ordinal: usize) -> Result<Context> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::Cuda(format!("no device cuda:{ordinal} ({count} device(s) visible)")));
        }
        let device = result::device::get(ordinal as i32).map_err(|e| cuda_error("cuDeviceGet", e))?;
        // SAFETY: `device` came from cuDeviceGet; released when the last clone drops.
        let raw =
            unsafe { result::primary_ctx::retain(device) }.map_err(|e| cuda_error("cuDevicePrimaryCtxRetain", e))?;
        Ok(Context(Arc::new(Primary { device, raw, ordinal })))
    }

    pub fn ordinal(&self) -> usize {
        self.0.ordinal
    }

    /// Makes the context current on the calling thread until the returned guard drops, which
    /// restores the thread's previous context.
    pub fn enter(&self) -> Result<Current<'_>> {
        // SAFETY: `raw` is a live context retained by `self`.
        unsafe { sys::cuCtxPushCurrent_v2(self.0.raw) }.result().map_err(|e| cuda_error("cuCtxPushCurrent", e))?;
        Ok(Current { _ctx: PhantomData, _same_thread: PhantomData })
    }
}

/// A context made current by [`Context::enter`]; dropping it pops it. Not `Send`: it must be
/// dropped on the thread that entered.
pub struct Current<'a> {
    _ctx: PhantomData<&'a Context>,
    _same_thread: PhantomData<*const ()>,
}

impl Drop for Current<'_> {
    fn drop(&mut self) {
        let mut popped = std::ptr::null_mut();
        // SAFETY: pops the context `enter` pushed on this thread; guards drop in reverse
        // order of creation, so it is on top.
        let _ = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) };
    }
}

/// A non-blocking stream for our copies, so they neither wait for nor block torch's work.
pub struct Stream {
    raw: sys::CUstream,
    ctx: Context,
}

// SAFETY: streams may be used from any thread; each call binds their context.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(ctx: &Context) -> Result<Stream> {
        let _current = ctx.enter()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda_error("cuStreamCreate", e))?;
        Ok(Stream { raw, ctx: ctx.clone() })
    }

    /// Enqueues a copy of `src[..len]` to device address `dst`. `src` must not be written or
    /// freed until an event recorded after this copy, or the stream, has completed.
    pub fn copy_to_device(&self, src: &PinnedBuffer, len: usize, dst: u64) -> Result<()> {
        let bytes = &src.as_slice()[..len];
        let _current = self.ctx.enter()?;
        // SAFETY: `dst` is device memory of at least `len` bytes (the caller allocated it
        // through torch for this file); `bytes` is pinned and outlives the copy because the
        // pipeline waits for the copy before reusing or freeing it.
        unsafe { result::memcpy_htod_async(dst, bytes, self.raw) }.map_err(|e| cuda_error("cuMemcpyHtoDAsync", e))
    }

    /// Enqueues a copy of `len` bytes at device address `src` into `dst[at..at + len]`. `dst`
    /// must not be read, written or freed until an event recorded after this copy, or the
    /// stream, has completed.
    pub fn copy_to_host(&self, dst: &mut PinnedBuffer, at: usize, len: usize, src: u64) -> Result<()> {
        let bytes = &mut dst.as_mut_slice()[at..at + len];
        let _current = self.ctx.enter()?;
        // SAFETY: `src` is device memory of at least `len` bytes (a tensor the caller keeps
        // alive for the save); `bytes` is pinned and outlives the copy because the pipeline
        // waits for the copy before reading, reusing or freeing it.
        unsafe { result::memcpy_dtoh_async(bytes, src, self.raw) }.map_err(|e| cuda_error("cuMemcpyDtoHAsync", e))
    }

    /// Makes the work queued on this stream from now on wait until `event` has completed.
    /// `event` may belong to another library (torch's).
    pub fn wait_for(&self, event: RawEvent) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: both handles are live: `event` is kept by its owner until the load returns.
        unsafe { result::stream::wait_event(self.raw, event.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| cuda_error("cuStreamWaitEvent", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: `raw` is a live stream.
        unsafe { result::stream::synchronize(self.raw) }.map_err(|e| cuda_error("cuStreamSynchronize", e))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(_current) = self.ctx.enter() {
            // SAFETY: the stream is ours; its context is alive (`self.ctx`, released after).
            let _ = unsafe { result::stream::destroy(self.raw) };
        }
    }
}

/// An event lent by its owner (one recorded on torch's current stream), as a raw `CUevent`.
#[derive(Debug, Clone, Copy)]
pub struct RawEvent(pub sys::CUevent);

// SAFETY: a handle; its owner keeps it alive for as long as it lends it.
unsafe impl Send for RawEvent {}
unsafe impl Sync for RawEvent {}

impl RawEvent {
    /// # Safety
    /// `handle` is a live `CUevent` (a `cudaEvent_t`), and stays alive while the value is used.
    pub unsafe fn from_raw(handle: u64) -> RawEvent {
        RawEvent(handle as sys::CUevent)
    }

    /// Blocks until the work recorded in the event has completed.
    pub fn synchronize(&self, ctx: &Context) -> Result<()> {
        let _current = ctx.enter()?;
        // SAFETY: the event is live (see `Stream::wait_for`).
        unsafe { result::event::synchronize(self.0) }.map_err(|e| cuda_error("cuEventSynchronize", e))
    }
}

/// Page-locked host memory: the disk DMAs into it and the GPU copies out of it.
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
    ctx: Context,
}

// SAFETY: the buffer is plain memory owned by this value.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    pub fn new(ctx: &Context, len: usize) -> Result<PinnedBuffer> {
        let _current = ctx.enter()?;
        // SAFETY: allocates `len` bytes; uninitialised bytes are fine for u8.
        let ptr = unsafe { result::malloc_host(len, 0) }.map_err(|e| cuda_error("cuMemHostAlloc", e))?;
        Ok(PinnedBuffer { ptr: ptr as *mut u8, len, ctx: ctx.clone() })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if let Ok(_current) = self.ctx.enter() {
            // SAFETY: `ptr` came from cuMemHostAlloc; no copy out of it is running (the
            // owner waited for them).
            let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
        }
    }
}

/// Marks a point in a stream, to wait for the copies enqueued before it.
pub struct Event {
    raw: sys::CUevent,
    ctx: Context,
}

// SAFETY: events may be recorded and waited on from any thread; each call binds the context.
unsafe impl Send for Event {}

impl Event {
    pub fn new(ctx: &Context) -> Result<Event> {
        let _current = ctx.enter()?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_error("cuEventCreate", e))?;
        Ok(Event { raw, ctx: ctx.clone() })
    }

    pub fn record(&self, stream: &Stream) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: both handles are live.
        unsafe { result::event::record(self.raw, stream.raw) }.map_err(|e| cuda_error("cuEventRecord", e))
    }

    /// Records the event on a stream of someone else's (torch's current stream), made in this
    /// event's context: the work queued there so far is what the event stands for.
    ///
    /// # Safety
    /// `stream` is a live `CUstream` (a `cudaStream_t`; 0 is the legacy default stream) of
    /// this event's context.
    pub unsafe fn record_on(&self, stream: u64) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: the caller's contract for `stream`; the event is ours.
        unsafe { result::event::record(self.raw, stream as sys::CUstream) }.map_err(|e| cuda_error("cuEventRecord", e))
    }

    /// The event as lent to a load: valid while `self` lives.
    pub fn as_raw(&self) -> RawEvent {
        RawEvent(self.raw)
    }

    pub fn synchronize(&self) -> Result<()> {
        let _current = self.ctx.enter()?;
        // SAFETY: `raw` is a live event.
        unsafe { result::event::synchronize(self.raw) }.map_err(|e| cuda_error("cuEventSynchronize", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Ok(_current) = self.ctx.enter() {
            // SAFETY: the event is ours; its context is alive.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
    }
}
