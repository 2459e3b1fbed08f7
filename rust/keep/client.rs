//! What a load (or `keep --list`, `--drop`, `--stop`) asks the keeper, starting it when none
//! runs.
//!
//! Nothing here fails a load: a keeper that cannot be reached, refuses, or goes away becomes
//! [`Attach::NotKept`] (or an error from [`Filling::put`]) with the reason, and the load goes
//! on reading as it would without `keep`.

use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::sys;
use super::wire::Socket;
use super::{Describe, Reply, Request, Span, PROGRAM, SOCKET};
use crate::error::{Error, Result};

/// How long a load waits for a keeper it started to listen.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a load waits for any answer of the keeper's (one waiting for another process's
/// fill is told every second that it goes on): a keeper that stopped answering is given up.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// The keeper program set by [`set_program`], if any.
static PROGRAM_OVERRIDE: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Makes loads start `program` as the keeper (tests; embedders that install it elsewhere).
pub fn set_program(program: impl Into<PathBuf>) {
    *PROGRAM_OVERRIDE.lock().unwrap_or_else(|p| p.into_inner()) = Some(program.into());
}

/// The keeper program: the one [`set_program`] set, else the one installed beside the library
/// this code runs in (the Python package's `_C` library), else `fastsafetensors-keeper` on `PATH`.
pub fn program() -> Option<PathBuf> {
    if let Some(p) = PROGRAM_OVERRIDE.lock().unwrap_or_else(|p| p.into_inner()).clone() {
        return Some(p);
    }
    if let Some(beside) = sys::library_dir().map(|d| d.join(PROGRAM)).filter(|p| p.is_file()) {
        return Some(beside);
    }
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| Path::new(d).join(PROGRAM)).find(|p| p.is_file())
}

/// The answer to a load's `attach`.
pub enum Attach {
    /// The entry is kept: map its buffers.
    Kept(Kept),
    /// Fill it (the keeper reserved its memory; other loads of it wait), then `put` it.
    Fill(Filling),
    /// It will not be kept; why.
    NotKept(String),
}

/// A kept entry: its memory (a sealed memory file for the host, exported device memory for a
/// GPU), where each buffer is in it, and the hold on it.
pub struct Kept {
    pub memory: OwnedFd,
    pub buffers: Vec<Span>,
    pub hold: Hold,
}

/// An entry this process fills, and the connection to put it on.
pub struct Filling {
    conn: Socket,
}

/// A connection holding an entry: the keeper counts this process among its holders until it
/// is dropped (or the process ends).
pub struct Hold {
    _conn: Socket,
}

impl Filling {
    /// Gives the filled memory (a sealed memory file, or exported device memory) to the
    /// keeper; the hold on the entry, or why it is not kept (the memory stays this process's).
    pub fn put(self, memory: BorrowedFd<'_>) -> std::result::Result<Hold, String> {
        self.conn.send(&Request::Put, Some(memory)).map_err(|e| went_away(&e))?;
        match answer(&self.conn) {
            Ok(Some((Reply::Taken { .. }, _))) => Ok(Hold { _conn: self.conn }),
            Ok(Some((Reply::Refused { why } | Reply::NotKept { why }, _))) => Err(why),
            Ok(Some((other, _))) => Err(format!("unexpected answer from the keeper: {other:?}")),
            Ok(None) => Err("the keeper went away while this process filled the entry".into()),
            Err(e) => Err(went_away(&e)),
        }
    }
}

/// The keeper's next answer that is not `Waiting`.
fn answer(conn: &Socket) -> std::io::Result<Option<(Reply, Option<OwnedFd>)>> {
    loop {
        match conn.recv::<Reply>()? {
            Some((Reply::Waiting, _)) => continue,
            other => return Ok(other),
        }
    }
}

fn went_away(e: &std::io::Error) -> String {
    if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
        return format!("the keeper did not answer within {} s", ANSWER_TIMEOUT.as_secs());
    }
    format!("the keeper went away ({e})")
}

/// Asks the keeper for `entry`, starting one if none runs. Waits while another process fills
/// the entry.
pub fn attach(entry: &Describe) -> Attach {
    match try_attach(entry) {
        Ok(answer) => answer,
        Err(why) => Attach::NotKept(why),
    }
}

fn try_attach(entry: &Describe) -> std::result::Result<Attach, String> {
    let dir = super::dir().map_err(|e| e.to_string())?;
    super::prepare_dir(&dir).map_err(|e| e.to_string())?;
    let conn = connect_or_start(&dir)?;
    conn.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(|e| went_away(&e))?;
    conn.send(&Request::Attach { entry: entry.clone() }, None).map_err(|e| went_away(&e))?;
    match answer(&conn) {
        Ok(Some((Reply::Kept { buffers, .. }, Some(memory)))) => {
            if buffers != entry.buffers {
                return Err("the keeper's entry is laid out differently".into());
            }
            Ok(Attach::Kept(Kept { memory, buffers, hold: Hold { _conn: conn } }))
        }
        Ok(Some((Reply::Fill { .. }, _))) => Ok(Attach::Fill(Filling { conn })),
        Ok(Some((Reply::NotKept { why } | Reply::Refused { why }, _))) => Ok(Attach::NotKept(why)),
        Ok(Some((other, _))) => Err(format!("unexpected answer from the keeper: {other:?}")),
        Ok(None) => Err("the keeper went away before it answered".into()),
        Err(e) => Err(went_away(&e)),
    }
}

/// A connection to the keeper of `dir`, started if none listens there.
fn connect_or_start(dir: &Path) -> std::result::Result<Socket, String> {
    let socket = dir.join(SOCKET);
    match Socket::connect(&socket) {
        Ok(conn) => return Ok(conn),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ECONNREFUSED)) => {}
        Err(e) => return Err(format!("{}: cannot connect to the keeper: {e}", socket.display())),
    }
    start(dir)?;
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        match Socket::connect(&socket) {
            Ok(conn) => return Ok(conn),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!(
                    "the keeper started for {} did not listen within {} s ({e}); see {}",
                    dir.display(),
                    START_TIMEOUT.as_secs(),
                    dir.join(super::LOG).display()
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

/// Starts a keeper for `dir` in the background: its program checks its settings, takes the
/// directory's lock and goes on in a process of its own (a new session: the loader's Ctrl-C
/// does not reach it), its messages in `keeper.log` there. Another keeper taking the lock
/// first is no error: loads then talk to that one.
fn start(dir: &Path) -> std::result::Result<(), String> {
    let program = program().ok_or_else(|| {
        format!("no keeper program ({PROGRAM}) beside the library or on PATH: the installation is incomplete")
    })?;
    let mut command = Command::new(&program);
    command.arg("--spawned").arg("--dir").arg(dir).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    sys::close_inherited(&mut command);
    let out = command.output().map_err(|e| format!("{}: could not start the keeper: {e}", program.display()))?;
    if !out.status.success() {
        let said = String::from_utf8_lossy(&out.stderr);
        let said = said.trim().lines().last().unwrap_or("").to_owned();
        return Err(format!("the keeper ({}) did not start ({}): {said}", program.display(), out.status));
    }
    Ok(())
}

/// Sends a command (`List`, `Drop`, `Stop`) to the running keeper; `Ok(None)` when none runs.
pub fn command(request: &Request) -> Result<Option<Reply>> {
    let dir = super::dir()?;
    let socket = dir.join(SOCKET);
    let conn = match Socket::connect(&socket) {
        Ok(conn) => conn,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::ECONNREFUSED)) => return Ok(None),
        Err(e) => return Err(Error::io(&socket, "connect to", e)),
    };
    conn.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(|e| Error::io(&socket, "set a timeout on", e))?;
    conn.send(request, None).map_err(|e| Error::io(&socket, "send to", e))?;
    match conn.recv::<Reply>() {
        Ok(Some((Reply::Refused { why }, _))) => Err(Error::Keep(why)),
        Ok(Some((reply, _))) => Ok(Some(reply)),
        Ok(None) => Err(Error::Keep(format!("the keeper at {} closed the connection", socket.display()))),
        Err(e) => Err(Error::io(&socket, "receive from", e)),
    }
}
