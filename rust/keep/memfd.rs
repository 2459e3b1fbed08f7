//! Sealed memory files: the host memory a kept entry lives in, and the only `unsafe` of the
//! host side of keeping.
//!
//! ```no_run
//! use fastsafetensors::keep::memfd::Memfd;
//! let memfd = Memfd::create("model", 1 << 20)?;
//! let mut fill = memfd.map_shared(0, 1 << 20)?;     // the loader reads into this
//! fill[..4].copy_from_slice(b"safe");
//! memfd.make_private(&fill, 0)?;                    // now copy-on-write, same address
//! memfd.seal()?;                                    // nobody can change the bytes again
//! let view = memfd.map_private(0, 1 << 20)?;        // what an attaching load maps
//! assert_eq!(&view[..4], b"safe");
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! A load fills an entry through shared writable mappings of the file, then replaces each
//! with a private (copy-on-write) mapping of the same bytes at the same address, so that the
//! tensors already pointing there stay valid and their writes stay in the process. Once no
//! shared writable mapping is left the file is sealed (`F_SEAL_WRITE`, `F_SEAL_SHRINK`,
//! `F_SEAL_GROW`, `F_SEAL_SEAL`): `write()` and shared writable mappings fail from then on,
//! for every process holding it, and private mappings still work. The seals are what makes a
//! verified entry stay verified.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

use memmap2::{MmapMut, MmapOptions};

/// The seals a kept entry carries.
pub const SEALS: libc::c_int = libc::F_SEAL_WRITE | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// An anonymous memory file (`memfd_create`), sealable.
#[derive(Debug)]
pub struct Memfd {
    file: File,
    len: u64,
}

impl Memfd {
    /// A new file of `len` bytes (zeros; memory is allocated as it is written), named `name` in
    /// `/proc/PID/fd` and `/proc/PID/maps` (as `memfd:NAME`).
    pub fn create(name: &str, len: u64) -> io::Result<Memfd> {
        let name = CString::new(name.replace('\0', "")).expect("NULs removed");
        // SAFETY: `name` is a NUL-terminated string that outlives the call.
        let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create returned a new descriptor that nothing else owns.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        file.set_len(len)?;
        Ok(Memfd { file, len })
    }

    /// The memory file behind `fd` (received from another process): refused unless it is one.
    pub fn from_fd(fd: OwnedFd) -> io::Result<Memfd> {
        let file = File::from(fd);
        // F_GET_SEALS answers only for memory files (shmem, hugetlbfs): EINVAL for others.
        get_seals(file.as_fd())?;
        let len = file.metadata()?.len();
        Ok(Memfd { file, len })
    }

    #[allow(clippy::len_without_is_empty)] // a size, not a collection
    pub fn len(&self) -> u64 {
        self.len
    }

    /// A shared, writable mapping of `len` bytes from `offset` (page-aligned): what fills it.
    pub fn map_shared(&self, offset: u64, len: usize) -> io::Result<MmapMut> {
        self.check_range(offset, len)?;
        // SAFETY: a memory file cannot be truncated while this process holds it unsealed but by
        // this process, which does not; once sealed it cannot shrink at all.
        unsafe { MmapOptions::new().offset(offset).len(len.max(1)).map_mut(&self.file) }
    }

    /// A private, copy-on-write mapping of `len` bytes from `offset` (page-aligned): what a
    /// load's tensors point into. Writes to it stay in this process.
    pub fn map_private(&self, offset: u64, len: usize) -> io::Result<MmapMut> {
        self.check_range(offset, len)?;
        // SAFETY: as for `map_shared`; the mapping is private, so nothing written reaches the file.
        unsafe { MmapOptions::new().offset(offset).len(len.max(1)).map_copy(&self.file) }
    }

    /// Turns `map`, a shared mapping of this file from `offset` made by [`Memfd::map_shared`],
    /// into a private one of the same bytes at the same address (`MAP_FIXED`): pointers into
    /// it stay valid, and from now on writes through them stay in this process. Call it once
    /// nothing writes through the shared mapping any more.
    pub fn make_private(&self, map: &MmapMut, offset: u64) -> io::Result<()> {
        self.check_range(offset, map.len())?;
        let addr = map.as_ptr() as *mut libc::c_void;
        // SAFETY: the range is exactly `map`'s mapping (page-aligned start; the kernel rounds the
        // length up to whole pages as it did for `map`), which `map` keeps reserved and unmaps
        // on drop. The new mapping shows the same bytes of the same file, so whatever reads
        // them, before or after, sees no change; `MAP_FIXED` replaces the old mapping at once.
        let got = unsafe {
            libc::mmap(
                addr,
                map.len().max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED,
                self.file.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        if got == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        debug_assert_eq!(got, addr);
        Ok(())
    }

    /// Writes all of `bytes` at `offset` (`pwrite`): how a load fills the file.
    pub fn write_at(&self, bytes: &[u8], offset: u64) -> io::Result<()> {
        self.file.write_all_at(bytes, offset)
    }

    /// Seals the file: from now on nobody can change, grow or shrink it, nor remove the seals.
    /// Fails with `EBUSY` while a shared writable mapping of it exists (in any process).
    pub fn seal(&self) -> io::Result<()> {
        // SAFETY: fcntl on a descriptor we own, with an integer argument.
        let rc = unsafe { libc::fcntl(self.file.as_raw_fd(), libc::F_ADD_SEALS, SEALS) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Whether the file carries every one of [`SEALS`].
    pub fn is_sealed(&self) -> io::Result<bool> {
        Ok(get_seals(self.file.as_fd())? & SEALS == SEALS)
    }

    /// Pages of the file that hold memory (what an entry costs), from `st_blocks`.
    pub fn resident_bytes(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.file.metadata().map(|m| m.blocks() * 512).unwrap_or(0)
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The descriptor, for handing to another process (a new descriptor of the same file).
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        self.file.as_fd().try_clone_to_owned()
    }

    fn check_range(&self, offset: u64, len: usize) -> io::Result<()> {
        let page = crate::source::mmap::page_size() as u64;
        if offset % page != 0 || offset.checked_add(len as u64).is_none_or(|end| end > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bytes {offset}..+{len} are not a page-aligned range of a memory file of {} bytes", self.len),
            ));
        }
        Ok(())
    }
}

fn get_seals(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: fcntl(F_GET_SEALS) on a live descriptor only reads the seals.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(seals)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    const PAGE: usize = 4096;

    #[test]
    fn a_sealed_file_refuses_writes_and_shared_writable_mappings_but_maps_privately() {
        let memfd = Memfd::create("test", 2 * PAGE as u64).unwrap();
        let mut fill = memfd.map_shared(0, 2 * PAGE).unwrap();
        fill[..5].copy_from_slice(b"bytes");
        // Unsealable while a shared writable mapping exists.
        assert_eq!(memfd.seal().unwrap_err().raw_os_error(), Some(libc::EBUSY));
        memfd.make_private(&fill, 0).unwrap();
        memfd.seal().unwrap();
        assert!(memfd.is_sealed().unwrap());
        // The same address still shows the bytes, and writing there is private now.
        assert_eq!(&fill[..5], b"bytes");
        fill[0] = b'B';
        assert_eq!(&memfd.map_private(0, PAGE).unwrap()[..5], b"bytes");
        let mut file = memfd.file.try_clone().unwrap();
        assert_eq!(file.write(b"x").unwrap_err().raw_os_error(), Some(libc::EPERM));
        assert_eq!(file.write_at(b"x", 0).unwrap_err().raw_os_error(), Some(libc::EPERM));
        assert!(memfd.map_shared(0, PAGE).is_err(), "a shared writable mapping of a sealed file");
        assert_eq!(file.set_len(PAGE as u64).unwrap_err().raw_os_error(), Some(libc::EPERM));
        assert_eq!(file.set_len(4 * PAGE as u64).unwrap_err().raw_os_error(), Some(libc::EPERM));
    }

    #[test]
    fn only_memory_files_are_taken_from_elsewhere() {
        let dir = std::env::temp_dir().join(format!("fst-memfd-{}", std::process::id()));
        std::fs::write(&dir, b"plain").unwrap();
        let plain = OwnedFd::from(File::open(&dir).unwrap());
        assert!(Memfd::from_fd(plain).is_err());
        std::fs::remove_file(&dir).unwrap();
        let memfd = Memfd::create("x", PAGE as u64).unwrap();
        let again = Memfd::from_fd(memfd.try_clone_fd().unwrap()).unwrap();
        assert_eq!(again.len(), PAGE as u64);
        assert!(!again.is_sealed().unwrap());
    }

    #[test]
    fn ranges_must_be_page_aligned_and_inside() {
        let memfd = Memfd::create("x", 2 * PAGE as u64).unwrap();
        assert!(memfd.map_private(1, 10).is_err());
        assert!(memfd.map_private(PAGE as u64, 2 * PAGE).is_err());
        assert!(memfd.map_private(PAGE as u64, PAGE).is_ok());
    }
}
