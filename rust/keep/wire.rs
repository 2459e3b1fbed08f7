//! The keeper's socket: a Unix `SOCK_SEQPACKET` socket carrying JSON messages, a file
//! descriptor beside one where an entry's memory goes along (`SCM_RIGHTS`), and the peer's
//! credentials (`SO_PEERCRED`). No network: the address is a path in a directory only its
//! user can enter. The `unsafe` of the socket calls is all here.
//!
//! A message longer than one packet goes as several: each packet starts with one byte, 1 when
//! more packets of the message follow, 0 on the last; a descriptor rides on the first.

use std::io;
use std::mem::{size_of, zeroed};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Bytes of a message per packet: well under the socket buffer's default size.
const PACKET: usize = 60 << 10;
/// The largest message taken: far more than any request needs.
const MAX_MESSAGE: usize = 64 << 20;

/// One end of a connection.
#[derive(Debug)]
pub struct Socket {
    fd: OwnedFd,
}

/// Who is at the other end, as the kernel says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub pid: i32,
    pub uid: u32,
}

fn check(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn new_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) with constant arguments; the result is a new descriptor we own.
    let fd = check(unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) })?;
    // SAFETY: as above.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn address(path: &Path) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is plain data; all zeros is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: too long for a socket address (at most {} bytes)", path.display(), addr.sun_path.len() - 1),
        ));
    }
    for (dst, &b) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = b as libc::c_char;
    }
    let len = size_of::<libc::sa_family_t>() + bytes.len() + 1;
    Ok((addr, len as libc::socklen_t))
}

/// A socket listening at `path` (which must not exist).
pub struct Listener {
    fd: OwnedFd,
}

impl Listener {
    pub fn bind(path: &Path) -> io::Result<Listener> {
        let fd = new_socket()?;
        let (addr, len) = address(path)?;
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
        check(unsafe { libc::bind(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) })?;
        // SAFETY: listen(2) on our socket.
        check(unsafe { libc::listen(fd.as_raw_fd(), 64) })?;
        Ok(Listener { fd })
    }

    /// The next connection, or None when none came within `timeout`.
    pub fn accept(&self, timeout: Duration) -> io::Result<Option<Socket>> {
        if !poll_readable(self.fd.as_raw_fd(), timeout)? {
            return Ok(None);
        }
        // SAFETY: accept4(2) on our listening socket, not asking for the address.
        let rc = unsafe {
            libc::accept4(self.fd.as_raw_fd(), std::ptr::null_mut(), std::ptr::null_mut(), libc::SOCK_CLOEXEC)
        };
        match check(rc) {
            // SAFETY: a new descriptor we own.
            Ok(fd) => Ok(Some(Socket { fd: unsafe { OwnedFd::from_raw_fd(fd) } })),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN | libc::EINTR | libc::ECONNABORTED)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// Whether `fd` becomes readable (or hung up) within `timeout`.
fn poll_readable(fd: RawFd, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    let ms = timeout.as_millis().min(i32::MAX as u128) as libc::c_int;
    // SAFETY: one pollfd, live for the call.
    match check(unsafe { libc::poll(&mut pfd, 1, ms) }) {
        Ok(n) => Ok(n > 0),
        Err(e) if e.raw_os_error() == Some(libc::EINTR) => Ok(false),
        Err(e) => Err(e),
    }
}

impl Socket {
    /// Connects to the socket at `path`.
    pub fn connect(path: &Path) -> io::Result<Socket> {
        let fd = new_socket()?;
        let (addr, len) = address(path)?;
        loop {
            // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
            let rc = unsafe { libc::connect(fd.as_raw_fd(), &addr as *const _ as *const libc::sockaddr, len) };
            match check(rc) {
                Ok(_) => return Ok(Socket { fd }),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// The process at the other end (as it was when it connected).
    pub fn peer(&self) -> io::Result<Peer> {
        // SAFETY: ucred is plain data.
        let mut cred: libc::ucred = unsafe { zeroed() };
        let mut len = size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt(SO_PEERCRED) writes at most `len` bytes into `cred`.
        check(unsafe {
            libc::getsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                &mut cred as *mut _ as *mut libc::c_void,
                &mut len,
            )
        })?;
        Ok(Peer { pid: cred.pid, uid: cred.uid })
    }

    /// Sends `message`, with `fd` beside it if given.
    pub fn send<T: Serialize>(&self, message: &T, fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        let bytes = serde_json::to_vec(message).map_err(io::Error::other)?;
        let mut chunks = bytes.chunks(PACKET).peekable();
        let mut first = true;
        loop {
            let chunk = chunks.next().unwrap_or(&[]);
            let more = chunks.peek().is_some();
            self.send_packet(more, chunk, if first { fd } else { None })?;
            first = false;
            if !more {
                return Ok(());
            }
        }
    }

    fn send_packet(&self, more: bool, chunk: &[u8], fd: Option<BorrowedFd<'_>>) -> io::Result<()> {
        let flag = [u8::from(more)];
        let mut iov = [
            libc::iovec { iov_base: flag.as_ptr() as *mut libc::c_void, iov_len: 1 },
            libc::iovec { iov_base: chunk.as_ptr() as *mut libc::c_void, iov_len: chunk.len() },
        ];
        let mut control = Control::new();
        // SAFETY: msghdr is plain data; all zeros is a valid empty header.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = iov.len();
        if let Some(fd) = fd {
            control.put_fd(&mut msg, fd.as_raw_fd());
        }
        loop {
            // SAFETY: `msg` points at live buffers (iov, control) for the duration of the call.
            let rc = unsafe { libc::sendmsg(self.fd.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
            match rc {
                n if n >= 0 => return Ok(()),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.raw_os_error() != Some(libc::EINTR) {
                        return Err(e);
                    }
                }
            }
        }
    }

    /// The next message and the descriptor that came with it; `None` when the other end has
    /// closed the connection.
    pub fn recv<T: DeserializeOwned>(&self) -> io::Result<Option<(T, Option<OwnedFd>)>> {
        let mut message = Vec::new();
        let mut fd = None;
        let mut buf = vec![0u8; PACKET + 1];
        loop {
            let (n, got) = self.recv_packet(&mut buf)?;
            if got.is_some() {
                fd = fd.or(got);
            }
            if n == 0 {
                // An empty packet is never sent (each has its flag byte): the connection ended.
                return Ok(None);
            }
            message.extend_from_slice(&buf[1..n]);
            if message.len() > MAX_MESSAGE {
                return Err(io::Error::new(io::ErrorKind::InvalidData, "message too long"));
            }
            if buf[0] == 0 {
                break;
            }
        }
        let value = serde_json::from_slice(&message).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        Ok(Some((value, fd)))
    }

    fn recv_packet(&self, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
        let mut iov = [libc::iovec { iov_base: buf.as_mut_ptr() as *mut libc::c_void, iov_len: buf.len() }];
        let mut control = Control::new();
        // SAFETY: msghdr is plain data; all zeros is a valid empty header.
        let mut msg: libc::msghdr = unsafe { zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = 1;
        msg.msg_control = control.buf.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = size_of::<[u64; 8]>();
        let n = loop {
            // SAFETY: `msg` points at live buffers for the duration of the call; MSG_CMSG_CLOEXEC
            // makes any descriptor received close-on-exec.
            let rc = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if rc >= 0 {
                break rc as usize;
            }
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINTR) {
                return Err(e);
            }
        };
        let fds = control.take_fds(&msg);
        if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a packet was cut short"));
        }
        let mut fds = fds.into_iter();
        let fd = fds.next();
        // More than one descriptor is never sent: any others are closed as they drop here.
        Ok((n, fd))
    }

    /// Whether the other end has closed the connection (without waiting).
    pub fn hung_up(&self) -> bool {
        let mut pfd = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLRDHUP, revents: 0 };
        // SAFETY: one pollfd, live for the call; no waiting.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
    }

    /// Gives up waiting in `recv` after `timeout` (None: wait for ever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        let tv = match timeout {
            Some(t) => {
                libc::timeval { tv_sec: t.as_secs() as libc::time_t, tv_usec: t.subsec_micros() as libc::suseconds_t }
            }
            None => libc::timeval { tv_sec: 0, tv_usec: 0 },
        };
        // SAFETY: setsockopt with a timeval that lives for the call.
        check(unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                &tv as *const _ as *const libc::c_void,
                size_of::<libc::timeval>() as libc::socklen_t,
            )
        })?;
        Ok(())
    }
}

/// Room for the control message of one descriptor, aligned as `cmsghdr` needs.
struct Control {
    buf: [u64; 8],
}

impl Control {
    fn new() -> Control {
        Control { buf: [0; 8] }
    }

    /// Attaches `fd` to `msg` as an `SCM_RIGHTS` control message in this buffer.
    fn put_fd(&mut self, msg: &mut libc::msghdr, fd: RawFd) {
        msg.msg_control = self.buf.as_mut_ptr() as *mut libc::c_void;
        // SAFETY: CMSG_SPACE is a pure computation.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) } as usize;
        debug_assert!(msg.msg_controllen <= size_of::<[u64; 8]>());
        // SAFETY: the control buffer is large enough for one header and one descriptor
        // (asserted above) and aligned for cmsghdr; CMSG_FIRSTHDR and CMSG_DATA point into it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut RawFd, fd);
        }
    }

    /// The descriptors `recvmsg` put in this buffer (they are ours to close).
    fn take_fds(&self, msg: &libc::msghdr) -> Vec<OwnedFd> {
        let mut fds = Vec::new();
        if msg.msg_controllen == 0 {
            return fds;
        }
        // SAFETY: recvmsg filled `msg_controllen` bytes of this buffer with well-formed control
        // messages; the CMSG macros walk them without leaving it. Each SCM_RIGHTS descriptor is a
        // new one that this process now owns.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg) as *const RawFd;
                    let count = ((*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                    for i in 0..count {
                        fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(msg, cmsg);
            }
        }
        fds
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};

    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Note {
        text: String,
    }

    fn pair(dir: &Path) -> (Socket, Socket) {
        let path = dir.join("s.sock");
        let listener = Listener::bind(&path).unwrap();
        let client = Socket::connect(&path).unwrap();
        let server = listener.accept(Duration::from_secs(5)).unwrap().unwrap();
        (client, server)
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("fst-wire-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn messages_large_and_small_arrive_whole_with_their_descriptor() {
        let dir = scratch("msg");
        let (client, server) = pair(&dir);
        assert_eq!(server.peer().unwrap(), Peer { pid: std::process::id() as i32, uid: unsafe { libc::geteuid() } });
        let mut file = tempfile_in(&dir);
        file.write_all(b"descriptor").unwrap();
        let big = Note { text: "x".repeat(3 * PACKET + 17) };
        client.send(&big, Some(std::os::fd::AsFd::as_fd(&file))).unwrap();
        client.send(&Note { text: "small".into() }, None).unwrap();
        let (got, fd) = server.recv::<Note>().unwrap().unwrap();
        assert_eq!(got, big);
        let mut received = std::fs::File::from(fd.expect("the descriptor"));
        received.rewind().unwrap();
        let mut text = String::new();
        received.read_to_string(&mut text).unwrap();
        assert_eq!(text, "descriptor");
        let (small, none) = server.recv::<Note>().unwrap().unwrap();
        assert_eq!((small.text.as_str(), none.is_none()), ("small", true));
        drop(client);
        assert!(server.recv::<Note>().unwrap().is_none(), "a closed connection reads as None");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_read_timeout_ends_a_wait() {
        let dir = scratch("timeout");
        let (client, _server) = pair(&dir);
        client.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let err = client.recv::<Note>().unwrap_err();
        assert!(matches!(err.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_in(dir: &Path) -> std::fs::File {
        let path = dir.join("f");
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }
}
