//! The zero-copy reader: private mappings of a local file.

use memmap2::{MmapMut, MmapOptions};

use super::{LocalFile, Source};
use crate::error::{Error, Result};

/// Maps `len` bytes of the file from `offset`, copy-on-write. A range with no bytes gets a page
/// of anonymous memory instead: an empty mapping does not exist.
pub fn map_range(src: &LocalFile, offset: u64, len: u64) -> Result<MmapMut> {
    if len == 0 {
        return super::alloc(0, src.path());
    }
    let len =
        usize::try_from(len).map_err(|_| Error::io(src.path(), "mmap", std::io::ErrorKind::OutOfMemory.into()))?;
    // SAFETY: the mapping is private, so our writes never reach the file. Another process
    // truncating the file while it is mapped would make accesses fault (SIGBUS); like every
    // mmap-based loader we rely on checkpoints not being truncated while they are loaded.
    let map = unsafe { MmapOptions::new().offset(offset).len(len).map_copy(src.file()) }
        .map_err(|e| Error::io(src.path(), "mmap", e))?;
    Ok(map)
}

/// Fraction of the file's pages that are in the page cache.
///
/// Asks `cachestat(2)` (Linux 6.5+), which counts a large folio at once, and falls back to
/// `mincore(2)` over a mapping, which answers page by page. Both report page-cache residency
/// only for files the caller may write to; for others they may answer cold, which leads to
/// direct reads: safe.
pub fn resident_fraction(src: &LocalFile) -> Result<f64> {
    let pages = src.len().div_ceil(page_size() as u64).max(1);
    if let Some(cached) = cachestat(src.file()) {
        return Ok((cached as f64 / pages as f64).min(1.0));
    }
    Ok(mincore_fraction(&map_range(src, 0, src.len())?))
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn cachestat(file: &std::fs::File) -> Option<u64> {
    use std::os::fd::AsRawFd;
    const SYS_CACHESTAT: libc::c_long = 451;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    let range = Range { off: 0, len: 0 }; // len 0: to the end of the file
    let mut stat = Stat::default();
    // SAFETY: cachestat(fd, &range, &stat, 0) reads `range` and writes `stat`, both live.
    let rc =
        unsafe { libc::syscall(SYS_CACHESTAT, file.as_raw_fd(), &range as *const Range, &mut stat as *mut Stat, 0) };
    (rc == 0).then_some(stat.nr_cache)
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn cachestat(_: &std::fs::File) -> Option<u64> {
    None
}

fn mincore_fraction(map: &[u8]) -> f64 {
    if map.is_empty() {
        return 1.0;
    }
    let page = page_size();
    let pages = map.len().div_ceil(page);
    let mut residency = vec![0u8; pages];
    // SAFETY: `map` is a live mapping of `map.len()` bytes starting on a page boundary, and
    // `residency` has one byte per page of it, as mincore(2) requires.
    let rc = unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, map.len(), residency.as_mut_ptr()) };
    if rc != 0 {
        return 0.0;
    }
    residency.iter().filter(|&&b| b & 1 == 1).count() as f64 / pages as f64
}

pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as usize
    } else {
        4096
    }
}
