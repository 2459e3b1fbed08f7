//! The zero-copy reader: a private mapping of the whole file.

use memmap2::{Advice, MmapMut, MmapOptions};

use super::SourceFile;
use crate::error::{Error, Result};

/// Maps the file copy-on-write: tensors may be written to without touching the file.
pub fn map(src: &SourceFile) -> Result<MmapMut> {
    // SAFETY: the mapping is private, so our writes never reach the file. Another process
    // truncating the file while it is mapped would make accesses fault (SIGBUS); like every
    // mmap-based loader we rely on checkpoints not being truncated while they are loaded.
    let map = unsafe { MmapOptions::new().len(src.len as usize).map_copy(&src.file) }
        .map_err(|e| Error::io(&src.path, "mmap", e))?;
    Ok(map)
}

/// Maps every page now (reading what is not resident), so that first touches of the
/// tensors do not fault one by one. MAP_POPULATE would instead copy every page: it
/// write-faults private mappings. Best effort: kernels before 5.14 lack MADV_POPULATE_READ.
pub fn populate(map: &MmapMut) {
    let _ = map.advise(Advice::PopulateRead);
}

/// Fraction of the mapping's pages that are in the page cache.
///
/// The kernel reports page-cache residency only for files the caller may write to; for
/// others it reports mapped pages only, which reads as cold and leads to direct reads: safe.
pub fn resident_fraction(map: &[u8]) -> f64 {
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

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as usize } else { 4096 }
}
