//! Fast, validated loading of `.safetensors` checkpoints.
//!
//! The data flows one way through the modules: [`format`] parses and validates headers,
//! [`plan`] decides what to read and where each tensor lands, [`io`] moves the bytes, and
//! [`loader`] runs the three for a set of files. [`bridge`] is the only FFI surface: the
//! C++ torch extension calls it and wraps the buffers as tensors.

pub mod bridge;
pub mod error;
pub mod format;
pub mod io;
pub mod loader;
pub mod plan;

pub use error::{Error, Result};
