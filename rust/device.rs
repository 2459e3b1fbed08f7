//! What the staged pipeline needs from a device, and the two devices it runs on.
//!
//! [`StagingDevice`] is small on purpose: staging memory the disk can DMA into, an
//! asynchronous copy out of it, and a way to wait for that copy. [`CudaDevice`] implements it
//! with pinned memory, one stream and one event per staging buffer. [`HostMemoryDevice`] is a
//! host-memory stand-in that lets the pipeline be tested bit for bit on machines without a
//! GPU; its copies happen only when waited for, so a pipeline that reused a staging buffer
//! too early would copy the wrong bytes and fail its tests.

use std::sync::Mutex;

use memmap2::MmapMut;

use crate::cuda::driver::{Context, Event, PinnedBuffer, Stream};
use crate::error::{Error, Result};

pub trait StagingDevice: Sync {
    /// A staging buffer and whatever tracks the copy out of it.
    type Staging: Send;

    fn alloc_staging(&self, len: usize) -> Result<Self::Staging>;
    /// The staging bytes, to read the file into. Only called after `wait`.
    fn bytes<'a>(&self, staging: &'a mut Self::Staging) -> &'a mut [u8];
    /// Starts copying `staging[..len]` to device address `dst`.
    fn copy_async(&self, staging: &mut Self::Staging, len: usize, dst: u64) -> Result<()>;
    /// Blocks until the last copy out of `staging` has completed.
    fn wait(&self, staging: &mut Self::Staging) -> Result<()>;
}

/// A CUDA device: pinned staging, copies on our own stream.
pub struct CudaDevice {
    ctx: Context,
    stream: Stream,
}

pub struct CudaStaging {
    buffer: PinnedBuffer,
    copied: Event,
    pending: bool,
}

impl CudaDevice {
    pub fn new(ctx: Context) -> Result<CudaDevice> {
        let stream = Stream::new(&ctx)?;
        Ok(CudaDevice { ctx, stream })
    }

    pub fn context(&self) -> &Context {
        &self.ctx
    }

    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize()
    }
}

impl StagingDevice for CudaDevice {
    type Staging = CudaStaging;

    fn alloc_staging(&self, len: usize) -> Result<CudaStaging> {
        Ok(CudaStaging { buffer: PinnedBuffer::new(&self.ctx, len)?, copied: Event::new(&self.ctx)?, pending: false })
    }

    fn bytes<'a>(&self, staging: &'a mut CudaStaging) -> &'a mut [u8] {
        staging.buffer.as_mut_slice()
    }

    fn copy_async(&self, staging: &mut CudaStaging, len: usize, dst: u64) -> Result<()> {
        self.ctx.bind()?;
        self.stream.copy_to_device(&staging.buffer, len, dst)?;
        staging.copied.record(&self.stream)?;
        staging.pending = true;
        Ok(())
    }

    fn wait(&self, staging: &mut CudaStaging) -> Result<()> {
        if staging.pending {
            staging.copied.synchronize()?;
            staging.pending = false;
        }
        Ok(())
    }
}

/// Host memory standing in for a device: address `a` is byte `a` of `memory`.
pub struct HostMemoryDevice {
    memory: Mutex<Vec<u8>>,
    /// Fail the n-th copy (0-based), to test errors mid-stream.
    fail_copy: Option<usize>,
    copies: Mutex<usize>,
    staging_allocated: Mutex<usize>,
}

pub struct HostStaging {
    buffer: MmapMut,
    /// A copy started but not yet performed: (len, dst).
    pending: Option<(usize, u64)>,
}

impl HostMemoryDevice {
    pub fn new(len: usize) -> HostMemoryDevice {
        HostMemoryDevice {
            memory: Mutex::new(vec![0; len]),
            fail_copy: None,
            copies: Mutex::new(0),
            staging_allocated: Mutex::new(0),
        }
    }

    pub fn failing_at_copy(mut self, n: usize) -> HostMemoryDevice {
        self.fail_copy = Some(n);
        self
    }

    pub fn memory(&self) -> Vec<u8> {
        self.memory.lock().unwrap().clone()
    }

    /// Copies started so far.
    pub fn copies(&self) -> usize {
        *self.copies.lock().unwrap()
    }

    /// Staging buffers allocated so far.
    pub fn staging_allocated(&self) -> usize {
        *self.staging_allocated.lock().unwrap()
    }
}

impl StagingDevice for HostMemoryDevice {
    type Staging = HostStaging;

    fn alloc_staging(&self, len: usize) -> Result<HostStaging> {
        // Page-aligned, as pinned memory is, so O_DIRECT reads into it work.
        let buffer = MmapMut::map_anon(len).map_err(|e| Error::Cuda(format!("staging allocation failed: {e}")))?;
        *self.staging_allocated.lock().unwrap() += 1;
        Ok(HostStaging { buffer, pending: None })
    }

    fn bytes<'a>(&self, staging: &'a mut HostStaging) -> &'a mut [u8] {
        assert!(staging.pending.is_none(), "staging buffer written while its copy is in flight");
        &mut staging.buffer
    }

    fn copy_async(&self, staging: &mut HostStaging, len: usize, dst: u64) -> Result<()> {
        let mut copies = self.copies.lock().unwrap();
        if self.fail_copy == Some(*copies) {
            return Err(Error::Cuda(format!("copy {} failed (injected)", *copies)));
        }
        *copies += 1;
        let end = dst as usize + len;
        if end > self.memory.lock().unwrap().len() {
            return Err(Error::Cuda(format!("copy to {dst}..{end} is out of device memory")));
        }
        staging.pending = Some((len, dst));
        Ok(())
    }

    fn wait(&self, staging: &mut HostStaging) -> Result<()> {
        if let Some((len, dst)) = staging.pending.take() {
            let dst = dst as usize;
            self.memory.lock().unwrap()[dst..dst + len].copy_from_slice(&staging.buffer[..len]);
        }
        Ok(())
    }
}
