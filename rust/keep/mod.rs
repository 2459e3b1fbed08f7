//! Kept weights: memory that outlives the process that loaded it.
//!
//! A keeper process (one per user and node, [`keeper`]) holds buffers that loads filled and
//! checked, and hands them to later loads of the same checkpoint, which map them instead of
//! reading: one more place bytes come from, beside the files and objects of `source`. A load
//! with `keep` goes through [`client`]:
//!
//! ```no_run
//! use fastsafetensors::keep::{client, memfd::Memfd, Describe};
//! # fn describe() -> Describe { unimplemented!() }
//! let entry: Describe = describe(); // what the load asks for ([`key::describe`])
//! match client::attach(&entry) {
//!     client::Attach::Kept(kept) => { /* map kept.memory's buffers: nothing is read */ }
//!     client::Attach::Fill(filling) => {
//!         let memory = Memfd::create("model", entry.len)?;
//!         // read into shared mappings of it, make them private, seal it, then:
//!         let _held = filling.put(memory.fd());
//!     }
//!     client::Attach::NotKept(why) => eprintln!("read as usual: {why}"),
//! }
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! - [`memfd`]: the host memory of an entry, a memory file sealed once filled (the `unsafe` of
//!   mappings and seals);
//! - [`wire`]: the Unix socket between loads and the keeper (the `unsafe` of `SCM_RIGHTS` and
//!   `SO_PEERCRED`), and here the messages that cross it;
//! - [`sys`]: the process-level calls (the `unsafe` of the uid, the keeper's lock, where the
//!   library is installed, and the keeper's own session);
//! - [`key`]: what identifies an entry: the files (device, inode, size, times and a sampled
//!   fingerprint of a local file; ETag or version of an object), the byte ranges, the device
//!   and the digests the bytes were verified against;
//! - [`client`]: what a load calls: attach, fill, put, and the commands of `keep --list`,
//!   `--drop`, `--stop`; it starts the keeper when none runs;
//! - [`keeper`]: the process: entries within a memory budget, the least recently attached
//!   entry nobody holds evicted first, and an exit once it has held nothing for a while.
//!
//! A load holds an entry through a connection of its own, open for as long as any of its
//! tensors is alive: the keeper sees a process that ends (however it ends) let go of it.

pub mod client;
pub mod keeper;
pub mod key;
pub mod memfd;
pub mod sys;
pub mod wire;

use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::settings::setting;
use crate::source::budget;

/// The directory of the keeper's socket (default: `/dev/shm/fastsafetensors-keep-UID`, or under
/// `/tmp` where there is no `/dev/shm`). Loads and the keeper must agree on it: a keeper in a
/// sidecar container shares it with the server's.
pub const KEEP_DIR_ENV: &str = "FASTSAFETENSORS_KEEP_DIR";
/// The memory the keeper may hold: a size or `unlimited` (default: half the machine's memory).
pub const KEEP_MEMORY_ENV: &str = "FASTSAFETENSORS_KEEP_MEMORY";
/// The memory the keeper may hold on each GPU: a size or `unlimited` (the default: what the
/// GPU's memory takes; a fill that finds too little is not kept).
pub const KEEP_DEVICE_MEMORY_ENV: &str = "FASTSAFETENSORS_KEEP_DEVICE_MEMORY";
/// Seconds a keeper that holds nothing waits before it exits (default 300; 0: never).
pub const KEEP_IDLE_ENV: &str = "FASTSAFETENSORS_KEEP_IDLE";

/// The device of host entries (device entries are "cuda:UUID").
pub const HOST: &str = "cpu";
/// The keeper's program, installed beside the library.
pub const PROGRAM: &str = "fastsafetensors-keeper";
/// The socket's name in the directory.
pub const SOCKET: &str = "keeper.sock";
/// The lock the running keeper holds in the directory (one keeper per directory).
pub const LOCK: &str = "keeper.lock";
/// Where a keeper started by a load writes its messages.
pub const LOG: &str = "keeper.log";

const DEFAULT_IDLE: Duration = Duration::from_secs(300);

/// The socket directory: `$FASTSAFETENSORS_KEEP_DIR`, else the default for this user.
pub fn dir() -> Result<PathBuf> {
    let given =
        setting(KEEP_DIR_ENV, "an absolute directory path", |v| Path::new(v).is_absolute().then(|| PathBuf::from(v)))?;
    Ok(given.unwrap_or_else(|| {
        let uid = sys::euid();
        let root = if Path::new("/dev/shm").is_dir() { Path::new("/dev/shm") } else { Path::new("/tmp") };
        root.join(format!("fastsafetensors-keep-{uid}"))
    }))
}

/// Makes `dir` if it is missing (mode 0700), and refuses one that another user owns or could
/// enter: whoever can reach the socket can ask for the weights.
pub fn prepare_dir(dir: &Path) -> Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(dir, "create the keep directory", e)),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| Error::io(dir, "stat the keep directory", e))?;
    let uid = sys::euid();
    let mode = meta.permissions().mode() & 0o777;
    if !meta.is_dir() {
        return Err(Error::Keep(format!("{}: not a directory ({KEEP_DIR_ENV} names the keeper's)", dir.display())));
    }
    if meta.uid() != uid || mode & 0o077 != 0 {
        return Err(Error::Keep(format!(
            "{}: the keeper's directory must be yours alone (mode 0700, owner uid {uid}); it has mode {mode:04o} and owner uid {}",
            dir.display(),
            meta.uid()
        )));
    }
    Ok(())
}

const SIZE: &str = "bytes with an optional K/M/G/T suffix (e.g. 64G), or 'unlimited'";

/// The keeper's budget of host entries in bytes (`None`: unlimited).
pub fn memory_budget() -> Result<Option<u64>> {
    Ok(match setting(KEEP_MEMORY_ENV, SIZE, budget::parse_size)? {
        Some(limit) => limit,
        None => budget::mem_total().map(|total| total / 2),
    })
}

/// The keeper's budget of entries on each GPU in bytes (`None`: unlimited).
pub fn device_memory_budget() -> Result<Option<u64>> {
    Ok(setting(KEEP_DEVICE_MEMORY_ENV, SIZE, budget::parse_size)?.flatten())
}

/// How long a keeper holding nothing waits before it exits (`None`: it never does).
pub fn idle_timeout() -> Result<Option<Duration>> {
    let secs = setting(KEEP_IDLE_ENV, "a whole number of seconds (0: never exit)", |v| v.parse::<u64>().ok())?;
    Ok(match secs {
        Some(0) => None,
        Some(s) => Some(Duration::from_secs(s)),
        None => Some(DEFAULT_IDLE),
    })
}

/// Every keep setting checked: what a load with `keep` checks first.
pub fn check_env() -> Result<()> {
    dir()?;
    memory_budget()?;
    device_memory_budget()?;
    idle_timeout()?;
    Ok(())
}

/// A buffer's place in an entry's memory: `len` bytes from `offset` (page-aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub offset: u64,
    pub len: u64,
}

/// An entry as a load asks for it. The keeper matches `what` and `version`; the rest is what
/// `keep --list` shows and `keep --drop` matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Describe {
    /// A digest of what the load reads: the files by path, the byte ranges, the device, and
    /// the digests the bytes are verified against.
    pub what: String,
    /// A digest of the files' versions: when it differs from an entry's, the entry is stale.
    pub version: String,
    /// The files, as the load names them (URLs without credentials).
    pub files: Vec<String>,
    /// "cpu", or the GPU ("cuda:UUID").
    pub device: String,
    /// What the bytes were checked against (None: not verified).
    pub verified: Option<String>,
    /// Where each buffer of the load lies in the entry's memory, in the load's order.
    pub buffers: Vec<Span>,
    /// Bytes of memory the entry takes.
    pub len: u64,
}

/// What a process asks the keeper.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum Request {
    /// The entry, if kept; else the turn to fill it (or why it will not be kept). Waits while
    /// another process fills it.
    Attach { entry: Describe },
    /// The entry this connection filled: its memory rides beside the message, sealed.
    Put,
    /// The entries, for `keep --list`.
    List,
    /// Ends the entries of the files at or under `path`.
    Drop { path: String },
    /// Ends the keeper (and every entry it holds).
    Stop,
}

/// The keeper's answers.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// The entry: its memory beside the message. The connection holds it until it closes.
    Kept {
        id: u64,
        buffers: Vec<Span>,
    },
    /// Another process fills the entry: the answer comes once it has put it (or given up).
    Waiting,
    /// Nobody holds the entry: fill it and `Put` it (the budget is reserved).
    Fill {
        id: u64,
    },
    /// The entry will not be kept, and why: the load reads on its own.
    NotKept {
        why: String,
    },
    /// The entry put is kept; the connection holds it.
    Taken {
        id: u64,
    },
    Entries {
        keeper: Status,
        entries: Vec<Listing>,
    },
    Dropped {
        count: usize,
    },
    Stopping,
    /// The request was refused (another user's process, a malformed request).
    Refused {
        why: String,
    },
}

/// The keeper itself, for `keep --list`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Status {
    pub pid: u32,
    /// The budget of host entries, and the bytes they hold.
    pub budget: Option<u64>,
    pub used: u64,
    /// The budget of each GPU's entries.
    pub device_budget: Option<u64>,
    pub dir: String,
}

/// One entry, for `keep --list`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Listing {
    pub id: u64,
    pub files: Vec<String>,
    pub device: String,
    pub len: u64,
    pub verified: Option<String>,
    /// The processes holding it now.
    pub holders: Vec<i32>,
    /// Whether it is being filled (not yet kept).
    pub filling: bool,
    pub attaches: u64,
    /// Seconds since the Unix epoch.
    pub created: u64,
    pub last_attached: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_directory_must_be_private() {
        let base = std::env::temp_dir().join(format!("fst-keepdir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(&base).unwrap();
        let fresh = base.join("fresh");
        prepare_dir(&fresh).unwrap();
        assert_eq!(std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777, 0o700);
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o755)).unwrap();
        let err = prepare_dir(&open).unwrap_err().to_string();
        assert!(err.contains("must be yours alone") && err.contains("mode 0755"), "{err}");
        let file = base.join("file");
        std::fs::write(&file, b"").unwrap();
        assert!(prepare_dir(&file).unwrap_err().to_string().contains("not a directory"));
        let link = base.join("link");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        assert!(prepare_dir(&link).unwrap_err().to_string().contains("not a directory"), "a link is refused");
        std::fs::remove_dir_all(&base).unwrap();
    }
}
