//! Fast, validated loading of `.safetensors` checkpoints into host or CUDA memory.
//!
//! The data flows one way through the modules: [`checkpoint`] turns the paths given
//! (files, checkpoint directories, indexes) into files, [`format`] parses and validates headers,
//! [`select`] decides which tensors a load wants, [`plan`] what to read and where each tensor
//! lands, [`io`] moves the bytes into host memory (all at once, or through [`stream`] in
//! groups handed out as they arrive, within a memory budget), and [`staged`] (through a
//! [`device::StagingDevice`]) or [`gds`] (through cuFile) into device memory; [`loader`] runs
//! them for a set of files. [`cuda`] holds every
//! driver call. [`bridge`] is the only FFI surface: the C++ torch extension calls it and
//! wraps the buffers as tensors.

pub mod bridge;
pub mod checkpoint;
pub mod cuda;
pub mod device;
pub mod device_stream;
pub mod error;
pub mod format;
pub mod gds;
pub mod io;
pub mod loader;
pub mod plan;
pub mod select;
pub mod staged;
pub mod stream;

pub use error::{Error, Result};
