//! Fast, validated loading of `.safetensors` checkpoints into host or CUDA memory.
//!
//! The modules follow the data, and every import points down this list:
//!
//! - [`format`](mod@format): headers parsed and validated, the dtype table: the leaf, which imports nothing
//!   of the crate (its `FormatError` says what is wrong with a header, and the caller adds the
//!   file);
//! - [`error`]: the one error type, every variant naming its file (it wraps `FormatError`), and
//!   [`settings`]: the environment variables the loader reads;
//! - [`plan`]: which tensors a load wants ([`plan::select`]), where each lands and which byte
//!   ranges to read (pure computation);
//! - [`source`]: where the bytes come from, behind the [`source::Source`] seam: a local file
//!   read with `O_DIRECT` ([`source::direct`]) or mapped ([`source::mmap`]), within the
//!   host-memory budget ([`source::budget`]);
//! - [`device`]: device memory: the CUDA driver and cuFile layers, the pinned staging pipeline,
//!   GPUDirect Storage, and a host-memory stand-in for tests;
//! - [`keep`]: kept weights: sealed memory a keeper process holds between the processes that
//!   load a checkpoint, matched by the files' identity and the load's result; a load with
//!   `keep` maps it instead of reading ([`load::kept`]);
//! - [`load`]: the loads that run those for a set of files: paths resolved to checkpoint files
//!   ([`load::checkpoint`]), bulk loads to host or device, streams ([`load::stream`],
//!   [`load::device_stream`]), files held open across loads ([`load::handle`]);
//! - [`sink`] and [`save`]: saving, the mirror of loading: the layout planned in
//!   [`plan::save`], bytes gathered from host or device memory and written through a
//!   [`sink::Sink`] (a local file under a temporary name, published when durable; a
//!   checkpoint directory committed as a whole by [`sink::commit`]), by one process or by
//!   the ranks of a group ([`save::SaveSession`]);
//! - [`bridge`]: the only FFI surface. The C++ torch extension calls it, wraps the buffers as
//!   tensors and carries out what it says for each tensor.

pub mod bridge;
pub mod device;
pub mod error;
pub mod format;
pub mod keep;
pub mod load;
pub mod plan;
pub mod save;
pub mod settings;
pub mod sink;
pub mod source;
pub mod verify;

pub use error::{Error, Result};
