//! The keeper: the process that holds kept entries between the processes that use them.
//!
//! One per user and directory: it takes an exclusive lock on `keeper.lock` before it binds
//! `keeper.sock` (a socket left by a keeper that was killed is removed then: the lock says
//! nobody serves it), and a keeper that finds the lock taken leaves at once. It listens on
//! that Unix socket only, and answers only processes of its own user (`SO_PEERCRED`).
//!
//! Each connection is one load (or one command) and runs on a thread of its own. A load's
//! connection attaches to an entry, or fills it: the keeper reserves the entry's bytes in its
//! budget, other loads of the same entry wait, and the filler puts the sealed memory back on
//! the same connection. Either way the connection then holds the entry until it closes; a
//! process that ends closes it, however it ends. A filler that goes away before putting gives
//! its turn to the next load waiting.
//!
//! Memory: entries (kept or being filled) count against the budget of their device (host
//! memory, or each GPU's); a new one that does not fit evicts entries of its device nobody
//! holds, least recently attached first, and is not kept when that is not enough. An entry evicted or dropped while processes hold it stays mapped in them
//! (their tensors are valid) and is freed when the last lets go. With nothing kept and no
//! connection, the keeper exits after its idle time.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use super::memfd::Memfd;
use super::sys;
use super::wire::{Listener, Peer, Socket};
use super::{Describe, Listing, Reply, Request, Status, HOST, LOCK, SOCKET};
use crate::device::vmm;
use crate::error::{Error, Result};

/// How the keeper runs.
#[derive(Debug, Clone)]
pub struct Options {
    pub dir: PathBuf,
    /// Bytes of host entries it may hold (`None`: no limit).
    pub budget: Option<u64>,
    /// Bytes of entries it may hold on each GPU (`None`: as much as the GPU takes).
    pub device_budget: Option<u64>,
    /// How long it waits, holding nothing, before it exits (`None`: never).
    pub idle: Option<Duration>,
}

impl Options {
    /// The settings of the environment ([`super::dir`], [`super::memory_budget`],
    /// [`super::idle_timeout`]).
    pub fn from_env() -> Result<Options> {
        Ok(Options {
            dir: super::dir()?,
            budget: super::memory_budget()?,
            device_budget: super::device_memory_budget()?,
            idle: super::idle_timeout()?,
        })
    }
}

/// What `serve` found.
#[derive(Debug, PartialEq, Eq)]
pub enum Served {
    /// It served until it was stopped or idle.
    Done,
    /// Another keeper (this pid, if it said) serves the directory already.
    AlreadyRunning(Option<u32>),
}

/// The lock that makes this process the directory's keeper, taken or not.
pub struct Lock {
    file: std::fs::File,
}

impl Lock {
    /// Takes the directory's lock, or says which keeper holds it.
    pub fn take(dir: &Path) -> Result<std::result::Result<Lock, Option<u32>>> {
        super::prepare_dir(dir)?;
        let path = dir.join(LOCK);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io(&path, "open", e))?;
        if !sys::try_lock(&file) {
            let pid = std::fs::read_to_string(&path).ok().and_then(|s| s.trim().parse().ok());
            return Ok(Err(pid));
        }
        let mut lock = Lock { file };
        lock.file.set_len(0).map_err(|e| Error::io(&path, "write", e))?;
        write!(lock.file, "{}", std::process::id()).map_err(|e| Error::io(&path, "write", e))?;
        Ok(Ok(lock))
    }
}

/// Serves `options.dir` until stopped, or idle for `options.idle` holding nothing.
pub fn serve(options: &Options) -> Result<Served> {
    let lock = match Lock::take(&options.dir)? {
        Ok(lock) => lock,
        Err(pid) => return Ok(Served::AlreadyRunning(pid)),
    };
    serve_locked(options, lock)
}

/// [`serve`], the lock taken already.
pub fn serve_locked(options: &Options, _lock: Lock) -> Result<Served> {
    let socket = options.dir.join(SOCKET);
    // Holding the lock, any socket there is a dead keeper's.
    match std::fs::remove_file(&socket) {
        Ok(()) => log(&format!("removed the socket a stopped keeper left ({})", socket.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io(&socket, "remove", e)),
    }
    let listener = Listener::bind(&socket).map_err(|e| Error::io(&socket, "listen on", e))?;
    let keeper = Arc::new(Keeper::new(options));
    log(&format!(
        "serving {} (pid {}, budget {}, idle exit {})",
        socket.display(),
        std::process::id(),
        options.budget.map_or("unlimited".into(), bytes),
        options.idle.map_or("never".into(), |d| format!("after {} s", d.as_secs())),
    ));
    let conn_ids = AtomicU64::new(1);
    loop {
        if let Some(why) = keeper.should_exit() {
            log(&format!("exiting: {why}"));
            break;
        }
        let conn = match listener.accept(Duration::from_millis(200)) {
            Ok(Some(conn)) => conn,
            Ok(None) => continue,
            Err(e) => {
                log(&format!("accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let peer = match conn.peer() {
            Ok(peer) => peer,
            Err(e) => {
                log(&format!("a connection without credentials ({e}): closed"));
                continue;
            }
        };
        let uid = sys::euid();
        if peer.uid != uid {
            let why = format!(
                "refused: this keeper serves uid {uid} only, and process {} runs as uid {}",
                peer.pid, peer.uid
            );
            log(&why);
            refuse(conn, why);
            continue;
        }
        let id = conn_ids.fetch_add(1, Ordering::Relaxed);
        let keeper = Arc::clone(&keeper);
        keeper.lock().connections += 1;
        let spawned = std::thread::Builder::new().name(format!("keeper-{id}")).spawn({
            let keeper = Arc::clone(&keeper);
            move || {
                Connection { keeper: &keeper, conn, peer, id, filling: None, holding: None }.run();
            }
        });
        if let Err(e) = spawned {
            log(&format!("could not start a thread for process {}: {e}", peer.pid));
            keeper.lock().connections -= 1;
        }
    }
    let _ = std::fs::remove_file(&socket);
    Ok(Served::Done)
}

/// How often a load waiting for another's fill is told that the keeper is still there.
const WAITING_EVERY: Duration = Duration::from_secs(1);

/// Answers `conn` with a refusal, on a thread of its own: its request is read first (for a
/// second at most), so that the process learns why rather than finding the connection closed.
fn refuse(conn: Socket, why: String) {
    let answer = move || {
        let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
        let _ = conn.recv::<serde_json::Value>();
        let _ = conn.send(&Reply::Refused { why }, None);
    };
    if let Err(e) = std::thread::Builder::new().name("keeper-refuse".into()).spawn(answer) {
        log(&format!("could not answer a refused process: {e}"));
    }
}

/// Writes a line of the keeper's log (its stderr).
fn log(message: &str) {
    let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    eprintln!("fastsafetensors-keeper[{}] {now}: {message}", std::process::id());
}

fn bytes(n: u64) -> String {
    match n {
        n if n >= 1 << 30 => format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64),
        n if n >= 1 << 20 => format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64),
        n => format!("{n} bytes"),
    }
}

struct Keeper {
    state: Mutex<State>,
    /// Signalled when an entry is put, given up, dropped, or the keeper stops.
    changed: Condvar,
    budget: Option<u64>,
    device_budget: Option<u64>,
    idle: Option<Duration>,
    dir: PathBuf,
}

struct State {
    entries: HashMap<String, Entry>,
    next_id: u64,
    connections: usize,
    last_activity: Instant,
    stop: bool,
}

struct Entry {
    id: u64,
    describe: Describe,
    /// None while it is filled.
    memory: Option<Memory>,
    /// Connections holding it, and their processes.
    holders: HashMap<u64, i32>,
    attaches: u64,
    created: SystemTime,
    last_attached: SystemTime,
}

/// An entry's memory, as the keeper holds it.
enum Memory {
    /// A sealed memory file.
    Host(Memfd),
    /// Device memory: its exported descriptor (what loads import), and the keeper's own handle
    /// on it, so that it stays allocated whatever becomes of descriptors alone.
    Device { fd: OwnedFd, _held: vmm::Physical },
}

impl Memory {
    /// What `describe` promised, in the descriptor a process put: a sealed memory file of the
    /// entry's size for the host, device memory the driver imports for a GPU.
    fn take(fd: OwnedFd, describe: &Describe) -> std::result::Result<Memory, String> {
        if describe.device != HOST {
            let copy = fd.try_clone().map_err(|e| format!("its descriptor could not be kept: {e}"))?;
            let held = vmm::Physical::import(copy, describe.len as usize)
                .map_err(|e| format!("the keeper cannot hold device memory ({e}): it needs the GPU's driver"))?;
            return Ok(Memory::Device { fd, _held: held });
        }
        let memory = Memfd::from_fd(fd).map_err(|e| format!("not a memory file: {e}"))?;
        match memory.is_sealed() {
            Ok(true) if memory.len() >= describe.len => Ok(Memory::Host(memory)),
            Ok(true) => Err(format!("{} bytes, not the {} promised", memory.len(), describe.len)),
            Ok(false) => Err("its memory is not sealed".to_owned()),
            Err(e) => Err(format!("its seals cannot be read: {e}")),
        }
    }

    fn try_clone_fd(&self) -> std::io::Result<OwnedFd> {
        match self {
            Memory::Host(memfd) => memfd.try_clone_fd(),
            Memory::Device { fd, .. } => fd.try_clone(),
        }
    }
}

impl Entry {
    fn listing(&self) -> Listing {
        let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let mut holders: Vec<i32> = self.holders.values().copied().collect();
        holders.sort_unstable();
        holders.dedup();
        Listing {
            id: self.id,
            files: self.describe.files.clone(),
            device: self.describe.device.clone(),
            len: self.describe.len,
            verified: self.describe.verified.clone(),
            holders,
            filling: self.memory.is_none(),
            attaches: self.attaches,
            created: secs(self.created),
            last_attached: secs(self.last_attached),
        }
    }

    /// Whether `path` names one of its files, or a directory holding one.
    fn matches(&self, path: &str) -> bool {
        let dir = format!("{}/", path.trim_end_matches('/'));
        self.describe.files.iter().any(|f| f == path || f.starts_with(&dir))
    }
}

impl Keeper {
    fn new(options: &Options) -> Keeper {
        Keeper {
            state: Mutex::new(State {
                entries: HashMap::new(),
                next_id: 1,
                connections: 0,
                last_activity: Instant::now(),
                stop: false,
            }),
            changed: Condvar::new(),
            budget: options.budget,
            device_budget: options.device_budget,
            idle: options.idle,
            dir: options.dir.clone(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn should_exit(&self) -> Option<String> {
        let state = self.lock();
        if state.stop {
            return Some("asked to stop".into());
        }
        let idle = self.idle?;
        let quiet = state.entries.is_empty() && state.connections == 0;
        (quiet && state.last_activity.elapsed() >= idle)
            .then(|| format!("nothing held for {} s", state.last_activity.elapsed().as_secs()))
    }

    /// Bytes of the entries (kept or being filled) on `device`.
    fn used(state: &State, device: &str) -> u64 {
        state.entries.values().filter(|e| e.describe.device == device).map(|e| e.describe.len).sum()
    }

    /// The budget of `device`'s entries, and the setting it comes from.
    fn budget(&self, device: &str) -> (Option<u64>, &'static str) {
        match device {
            HOST => (self.budget, super::KEEP_MEMORY_ENV),
            _ => (self.device_budget, super::KEEP_DEVICE_MEMORY_ENV),
        }
    }

    /// Makes room for `len` more bytes on `device` by evicting entries of that device nobody
    /// holds, least recently attached first; why it cannot, if it cannot.
    fn make_room(&self, state: &mut State, device: &str, len: u64) -> std::result::Result<(), String> {
        let (Some(budget), var) = self.budget(device) else { return Ok(()) };
        let pid = std::process::id();
        if len > budget {
            return Err(format!("{} do not fit {var} ({}) of the keeper (pid {pid})", bytes(len), bytes(budget)));
        }
        while Self::used(state, device) + len > budget {
            let victim = state
                .entries
                .iter()
                .filter(|(_, e)| e.describe.device == device && e.memory.is_some() && e.holders.is_empty())
                .min_by_key(|(_, e)| e.last_attached)
                .map(|(what, _)| what.clone());
            let Some(what) = victim else {
                return Err(format!(
                    "{} do not fit {var} ({}) beside the {} the keeper (pid {pid}) holds for running processes",
                    bytes(len),
                    bytes(budget),
                    bytes(Self::used(state, device)),
                ));
            };
            let gone = state.entries.remove(&what).expect("found above");
            log(&format!(
                "evicted entry {} ({}, {}): least recently attached",
                gone.id,
                gone.describe.files.join(", "),
                bytes(gone.describe.len)
            ));
        }
        Ok(())
    }
}

/// One connection: a load (attach, perhaps fill and put, then hold) or a command.
struct Connection<'a> {
    keeper: &'a Keeper,
    conn: Socket,
    peer: Peer,
    id: u64,
    /// The entry this connection fills (its `what`), until put.
    filling: Option<String>,
    /// The entry this connection holds.
    holding: Option<String>,
}

impl Connection<'_> {
    fn run(mut self) {
        loop {
            let request = match self.conn.recv::<Request>() {
                Ok(Some((request, fd))) => (request, fd),
                Ok(None) => break,
                Err(e) => {
                    let _ = self.conn.send(&Reply::Refused { why: format!("malformed request: {e}") }, None);
                    break;
                }
            };
            let keep_going = match request {
                (Request::Attach { entry }, _) => self.attach(entry),
                (Request::Put, fd) => self.put(fd),
                (Request::List, _) => self.reply(&self.list(), None),
                (Request::Drop { path }, _) => {
                    let count = self.drop_entries(&path);
                    self.reply(&Reply::Dropped { count }, None)
                }
                (Request::Stop, _) => {
                    self.keeper.lock().stop = true;
                    self.keeper.changed.notify_all();
                    self.reply(&Reply::Stopping, None)
                }
            };
            if !keep_going {
                break;
            }
        }
    }

    fn reply(&self, reply: &Reply, fd: Option<std::os::fd::BorrowedFd<'_>>) -> bool {
        self.conn.send(reply, fd).is_ok()
    }

    fn attach(&mut self, entry: Describe) -> bool {
        if self.filling.is_some() || self.holding.is_some() {
            return self.reply(&Reply::Refused { why: "one entry per connection".into() }, None);
        }
        let mut state = self.keeper.lock();
        let mut told = Instant::now();
        loop {
            if state.stop {
                drop(state);
                return self.reply(&Reply::NotKept { why: "the keeper is stopping".into() }, None);
            }
            match state.entries.get_mut(&entry.what) {
                Some(kept) if kept.memory.is_some() && kept.describe.version == entry.version => {
                    kept.holders.insert(self.id, self.peer.pid);
                    kept.attaches += 1;
                    kept.last_attached = SystemTime::now();
                    let (id, buffers) = (kept.id, kept.describe.buffers.clone());
                    let fd = kept.memory.as_ref().expect("kept").try_clone_fd();
                    state.last_activity = Instant::now();
                    drop(state);
                    self.holding = Some(entry.what);
                    return match fd {
                        Ok(fd) => self.reply(&Reply::Kept { id, buffers }, Some(fd.as_fd())),
                        Err(e) => {
                            self.reply(&Reply::NotKept { why: format!("the keeper could not share it: {e}") }, None)
                        }
                    };
                }
                Some(kept) if kept.memory.is_some() => {
                    // The files changed since it was made: never attached to again.
                    let stale = state.entries.remove(&entry.what).expect("found above");
                    log(&format!(
                        "dropped entry {} ({}): its files changed",
                        stale.id,
                        stale.describe.files.join(", ")
                    ));
                }
                Some(_) => {
                    // Another process fills it: wait for its put (or for it to give up).
                    let (next, _) = self
                        .keeper
                        .changed
                        .wait_timeout(state, Duration::from_millis(250))
                        .unwrap_or_else(|p| p.into_inner());
                    state = next;
                    if self.conn.hung_up() {
                        return false;
                    }
                    // Said now and then, so that the waiting load knows the keeper is alive.
                    if told.elapsed() >= WAITING_EVERY {
                        told = Instant::now();
                        if !self.reply(&Reply::Waiting, None) {
                            return false;
                        }
                    }
                }
                None => {
                    if let Err(why) = self.keeper.make_room(&mut state, &entry.device, entry.len) {
                        drop(state);
                        return self.reply(&Reply::NotKept { why }, None);
                    }
                    let id = state.next_id;
                    state.next_id += 1;
                    let now = SystemTime::now();
                    let what = entry.what.clone();
                    state.entries.insert(
                        what.clone(),
                        Entry {
                            id,
                            describe: entry,
                            memory: None,
                            holders: HashMap::new(),
                            attaches: 0,
                            created: now,
                            last_attached: now,
                        },
                    );
                    state.last_activity = Instant::now();
                    drop(state);
                    self.filling = Some(what);
                    return self.reply(&Reply::Fill { id }, None);
                }
            }
        }
    }

    fn put(&mut self, fd: Option<std::os::fd::OwnedFd>) -> bool {
        let Some(what) = self.filling.take() else {
            return self.reply(&Reply::Refused { why: "nothing is being filled on this connection".into() }, None);
        };
        let describe = self.keeper.lock().entries.get(&what).map(|e| e.describe.clone());
        // Taken outside the lock: importing device memory is a driver call.
        let memory = match (fd, &describe) {
            (_, None) => Err("it was dropped while it was filled".to_owned()),
            (None, _) => Err("no memory came with it".to_owned()),
            (Some(fd), Some(describe)) => Memory::take(fd, describe),
        };
        let mut state = self.keeper.lock();
        let outcome = match (memory, state.entries.get_mut(&what)) {
            (_, None) => Err("it was dropped while it was filled".to_owned()),
            (Err(why), Some(_)) => Err(why),
            (Ok(memory), Some(entry)) => {
                entry.memory = Some(memory);
                entry.holders.insert(self.id, self.peer.pid);
                Ok(entry.id)
            }
        };
        if outcome.is_err() {
            if let Some(entry) = state.entries.get(&what) {
                if entry.memory.is_none() {
                    state.entries.remove(&what);
                }
            }
        }
        state.last_activity = Instant::now();
        drop(state);
        self.keeper.changed.notify_all();
        match outcome {
            Ok(id) => {
                self.holding = Some(what);
                self.reply(&Reply::Taken { id }, None)
            }
            Err(why) => self.reply(&Reply::Refused { why: format!("the entry is not kept: {why}") }, None),
        }
    }

    fn list(&self) -> Reply {
        let state = self.keeper.lock();
        let mut entries: Vec<Listing> = state.entries.values().map(Entry::listing).collect();
        entries.sort_by_key(|e| e.id);
        Reply::Entries {
            keeper: Status {
                pid: std::process::id(),
                budget: self.keeper.budget,
                used: Keeper::used(&state, HOST),
                device_budget: self.keeper.device_budget,
                dir: self.keeper.dir.display().to_string(),
            },
            entries,
        }
    }

    fn drop_entries(&self, path: &str) -> usize {
        let mut state = self.keeper.lock();
        let gone: Vec<String> = state.entries.iter().filter(|(_, e)| e.matches(path)).map(|(w, _)| w.clone()).collect();
        for what in &gone {
            let entry = state.entries.remove(what).expect("listed above");
            log(&format!(
                "dropped entry {} ({}): asked by process {}",
                entry.id,
                entry.describe.files.join(", "),
                self.peer.pid
            ));
        }
        state.last_activity = Instant::now();
        drop(state);
        self.keeper.changed.notify_all();
        gone.len()
    }
}

impl Drop for Connection<'_> {
    /// The process let go (or ended): a fill it did not put is given up; what it held is
    /// held by one process fewer.
    fn drop(&mut self) {
        let mut state = self.keeper.lock();
        if let Some(what) = self.filling.take() {
            if state.entries.get(&what).is_some_and(|e| e.memory.is_none()) {
                state.entries.remove(&what);
                log(&format!("process {} went away before it filled its entry: the next load fills it", self.peer.pid));
            }
        }
        if let Some(what) = self.holding.take() {
            if let Some(entry) = state.entries.get_mut(&what) {
                entry.holders.remove(&self.id);
            }
        }
        state.connections -= 1;
        state.last_activity = Instant::now();
        drop(state);
        self.keeper.changed.notify_all();
    }
}
