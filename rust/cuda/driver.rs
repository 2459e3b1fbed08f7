//! The CUDA driver API (through cudarc's `result` layer): contexts, streams, pinned host
//! memory, events. Every type releases what it owns on drop.

use std::ffi::c_void;
use std::sync::OnceLock;

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

/// The primary context of a device: the one the CUDA runtime, and so torch, uses.
pub struct Context {
    device: sys::CUdevice,
    raw: sys::CUcontext,
    ordinal: usize,
}

// SAFETY: CUDA contexts may be used from any thread (each binds it with `bind`).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    /// Retains device `ordinal`'s primary context and makes it current on this thread.
    pub fn primary(ordinal: usize) -> Result<Context> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(Error::Cuda(format!("no device cuda:{ordinal} ({count} device(s) visible)")));
        }
        let device = result::device::get(ordinal as i32).map_err(|e| cuda_error("cuDeviceGet", e))?;
        // SAFETY: `device` came from cuDeviceGet; released in Drop.
        let raw =
            unsafe { result::primary_ctx::retain(device) }.map_err(|e| cuda_error("cuDevicePrimaryCtxRetain", e))?;
        let ctx = Context { device, raw, ordinal };
        ctx.bind()?;
        Ok(ctx)
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes the context current on the calling thread (each I/O thread needs it).
    pub fn bind(&self) -> Result<()> {
        // SAFETY: `raw` is a live context retained by `self`.
        unsafe { result::ctx::set_current(self.raw) }.map_err(|e| cuda_error("cuCtxSetCurrent", e))
    }

    /// Waits for all work on the device: torch may still be using memory its caching
    /// allocator has just handed us, on streams we do not know.
    pub fn synchronize(&self) -> Result<()> {
        self.bind()?;
        result::ctx::synchronize().map_err(|e| cuda_error("cuCtxSynchronize", e))
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `primary`.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

/// A non-blocking stream for our copies, so they neither wait for nor block torch's work.
pub struct Stream {
    raw: sys::CUstream,
}

// SAFETY: streams may be used from any thread of their context.
unsafe impl Send for Stream {}
unsafe impl Sync for Stream {}

impl Stream {
    pub fn new(ctx: &Context) -> Result<Stream> {
        ctx.bind()?;
        let raw = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| cuda_error("cuStreamCreate", e))?;
        Ok(Stream { raw })
    }

    /// Enqueues a copy of `src[..len]` to device address `dst`. `src` must not be written
    /// until an event recorded after this copy has completed.
    pub fn copy_to_device(&self, src: &PinnedBuffer, len: usize, dst: u64) -> Result<()> {
        let bytes = &src.as_slice()[..len];
        // SAFETY: `dst` is device memory of at least `len` bytes (the caller allocated it
        // through torch for this file); `bytes` is pinned and outlives the copy because the
        // pipeline waits on the slot's event before reusing or freeing it.
        unsafe { result::memcpy_htod_async(dst, bytes, self.raw) }.map_err(|e| cuda_error("cuMemcpyHtoDAsync", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: `raw` is a live stream.
        unsafe { result::stream::synchronize(self.raw) }.map_err(|e| cuda_error("cuStreamSynchronize", e))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream is ours; pending work completes before it is destroyed.
        let _ = unsafe { result::stream::destroy(self.raw) };
    }
}

/// Page-locked host memory: the disk DMAs into it and the GPU copies out of it.
pub struct PinnedBuffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain memory owned by this value.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    pub fn new(ctx: &Context, len: usize) -> Result<PinnedBuffer> {
        ctx.bind()?;
        // SAFETY: allocates `len` bytes; uninitialised bytes are fine for u8.
        let ptr = unsafe { result::malloc_host(len, 0) }.map_err(|e| cuda_error("cuMemHostAlloc", e))?;
        Ok(PinnedBuffer { ptr: ptr as *mut u8, len })
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
        // SAFETY: `ptr` came from cuMemHostAlloc.
        let _ = unsafe { result::free_host(self.ptr as *mut c_void) };
    }
}

/// Marks a point in a stream, to wait for the copies enqueued before it.
pub struct Event {
    raw: sys::CUevent,
}

// SAFETY: events may be recorded and waited on from any thread of their context.
unsafe impl Send for Event {}

impl Event {
    pub fn new(ctx: &Context) -> Result<Event> {
        ctx.bind()?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_error("cuEventCreate", e))?;
        Ok(Event { raw })
    }

    pub fn record(&self, stream: &Stream) -> Result<()> {
        // SAFETY: both handles are live.
        unsafe { result::event::record(self.raw, stream.raw) }.map_err(|e| cuda_error("cuEventRecord", e))
    }

    pub fn synchronize(&self) -> Result<()> {
        // SAFETY: `raw` is a live event.
        unsafe { result::event::synchronize(self.raw) }.map_err(|e| cuda_error("cuEventSynchronize", e))
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: the event is ours.
        let _ = unsafe { result::event::destroy(self.raw) };
    }
}
