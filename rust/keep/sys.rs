//! The process-level calls of keeping, and their `unsafe`: who this process runs as, the
//! keeper's lock, where this library is installed, and how a keeper gets a process of its own.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The effective uid of this process.
pub fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// Takes an exclusive lock on `file` without waiting: false when another process holds it.
/// The lock goes with the last descriptor of the file's open description.
pub fn try_lock(file: &File) -> bool {
    // SAFETY: flock on a live descriptor.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
}

/// The directory of the shared library (or program) this code is part of.
pub fn library_dir() -> Option<PathBuf> {
    // SAFETY: dladdr reads the loader's tables for an address in this library and fills `info`;
    // `dli_fname` is a NUL-terminated string the loader owns while the library is loaded.
    let name = unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(library_dir as *const libc::c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        std::ffi::CStr::from_ptr(info.dli_fname).to_bytes().to_vec()
    };
    let path = PathBuf::from(std::ffi::OsStr::from_bytes(&name));
    std::fs::canonicalize(path).ok()?.parent().map(Path::to_owned)
}

/// Makes `command`'s process close every descriptor above stderr before it runs: those this
/// process left inheritable (other libraries' sockets and pipes) would otherwise stay open in
/// a keeper for as long as it runs.
pub fn close_inherited(command: &mut Command) {
    // SAFETY: runs in the child between fork and exec, and makes one system call, which is
    // async-signal-safe (where the kernel lacks it, nothing is closed).
    unsafe {
        command.pre_exec(|| {
            libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
            Ok(())
        });
    }
}

/// Goes on in a child in a session of its own (a Ctrl-C in the terminal of the process that
/// started this one does not reach it), its stdout and stderr to `log`: false in the parent,
/// true in the child. For a single-threaded process only.
pub fn background(log: &File) -> io::Result<bool> {
    // SAFETY: the caller is single-threaded, so the child may run anything after fork.
    match unsafe { libc::fork() } {
        -1 => Err(io::Error::last_os_error()),
        0 => {
            // SAFETY: setsid, and dup2 of a descriptor this process owns onto stdout and stderr.
            unsafe {
                libc::setsid();
                libc::dup2(log.as_raw_fd(), 1);
                libc::dup2(log.as_raw_fd(), 2);
            }
            Ok(true)
        }
        _ => Ok(false),
    }
}
