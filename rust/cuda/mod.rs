//! Everything that touches the CUDA driver, loaded at run time: no toolkit at build time and
//! no failure on machines without a GPU until CUDA is actually asked for.
//!
//! Layered like cudarc: [`driver`] and [`cufile`] hold the `unsafe` calls and the RAII types
//! whose `Drop` releases what they own; the loader above them is safe code.
//!
//! ```no_run
//! use fastsafetensors::cuda::driver::{Context, PinnedBuffer, Stream};
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

pub mod cufile;
pub mod driver;
