//! The cold-file reader: parallel `O_DIRECT` preads into page-aligned anonymous memory.
//!
//! [`BlockReader`] reads one block of a file into page-aligned memory; the host reader here,
//! the stream and the staged device pipeline all use it.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use memmap2::MmapMut;
use rayon::prelude::*;

use super::{alloc, io_pool, HostBuffer, Identity, LocalFile, ReadPath, Source};
use crate::error::{Error, Result};
use crate::plan::{self, Extent, ReadBlock, IO_ALIGN};
use crate::verify::FileCheck;

/// Reads `extent` of the reader's source into fresh page-aligned memory, `block` bytes per
/// request, in parallel on the I/O pool. With a `check` (a verified load), each block is
/// reported to it as it lands, and the check holds a reference on the buffer until it has
/// hashed them: a read that fails cannot free bytes the check has yet to hash.
pub fn read_extent(
    reader: &BlockReader,
    extent: &Extent,
    block: u64,
    check: Option<&FileCheck>,
) -> Result<Arc<HostBuffer>> {
    let map = alloc_for_reads(extent.len, reader.src.path())?;
    read_extent_in(reader, extent, block, check, HostBuffer::new(map, reader.path()))
}

/// [`read_extent`] into `buffer` (at least `extent.len` bytes, page-aligned, writable): the
/// memory of a kept entry being filled.
pub(crate) fn read_extent_in(
    reader: &BlockReader,
    extent: &Extent,
    block: u64,
    check: Option<&FileCheck>,
    buffer: HostBuffer,
) -> Result<Arc<HostBuffer>> {
    assert!(buffer.byte_len() as u64 >= extent.len, "a buffer holding the extent");
    let block = plan::io_block(block);
    // Written through the mapping's own pointer (the buffer lends no `&mut` while shared).
    let target = FillTarget(buffer.as_ptr() as *mut u8);
    let buffer = Arc::new(buffer);
    let blocks = if reader.src.splits_reads() {
        // One read of the whole extent: the source runs its own parallel requests.
        vec![ReadBlock { offset: extent.start, len: extent.len, expected: extent.expected }]
    } else {
        extent.blocks(reader.src.len(), IO_ALIGN, block)
    };
    let read = |b: &ReadBlock| -> Result<()> {
        let at = (b.offset - extent.start) as usize;
        // SAFETY: the extent's blocks are disjoint and lie inside the buffer, which outlives
        // this call; nothing reads these bytes before they are written.
        reader.read(b, unsafe { target.slice(at, b.len as usize) })?;
        if let Some(check) = check {
            check.landed_in(b.offset, &buffer, at, b.expected as usize);
        }
        Ok(())
    };
    match &blocks[..] {
        [b] => read(b)?,
        _ => io_pool().install(|| blocks.par_iter().try_for_each(read))?,
    }
    Ok(buffer)
}

/// [`read_extent`] into memory filled by calls rather than through a pointer: each block is
/// read into a staging buffer of the reading thread's and handed to `write` with its offset in
/// the extent, then reported to `check` from `view`, the same memory mapped. A kept entry's
/// memory file is filled so (`pwrite`): the kernel allocates its shared-memory pages in the
/// write, where reads into a mapping of it would take a fault, a zeroed page and a page-table
/// entry for each, and the staging buffers' pages, present after their first block, cost a
/// direct read nothing more. Sources that split reads of their own (one read of the whole
/// extent) are not for this: their staging would be the whole extent.
pub(crate) fn read_extent_through(
    reader: &BlockReader,
    extent: &Extent,
    block: u64,
    check: Option<&FileCheck>,
    view: &Arc<HostBuffer>,
    write: &(dyn Fn(usize, &[u8]) -> io::Result<()> + Sync),
) -> Result<()> {
    assert!(view.byte_len() as u64 >= extent.len, "a view of the extent");
    let block = plan::io_block(block);
    let path = reader.src.path();
    let staging = std::sync::Mutex::new(Vec::<MmapMut>::new());
    let read = |b: &ReadBlock| -> Result<()> {
        let taken = staging.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut buf = match taken {
            Some(buf) if buf.len() as u64 >= b.len => buf,
            _ => alloc_for_reads(block.max(b.len), path)?,
        };
        reader.read(b, &mut buf[..b.len as usize])?;
        let at = (b.offset - extent.start) as usize;
        // Only the bytes that exist: past them the staging buffer holds an earlier block's.
        write(at, &buf[..b.expected as usize]).map_err(|e| Error::io(path, "write the kept memory of", e))?;
        staging.lock().unwrap_or_else(|e| e.into_inner()).push(buf);
        if let Some(check) = check {
            check.landed_in(b.offset, view, at, b.expected as usize);
        }
        Ok(())
    };
    let blocks = extent.blocks(reader.src.len(), IO_ALIGN, block);
    io_pool().install(|| blocks.par_iter().try_for_each(read))
}

/// Where reads write into a buffer being filled: each read its own disjoint range.
#[derive(Clone, Copy)]
pub(crate) struct FillTarget(pub(crate) *mut u8);

impl FillTarget {
    /// `len` bytes from `at`.
    ///
    /// # Safety
    /// `[at, at + len)` must lie inside the buffer, which must outlive the slice, and no other
    /// slice of those bytes may exist meanwhile.
    pub(crate) unsafe fn slice<'a>(self, at: usize, len: usize) -> &'a mut [u8] {
        std::slice::from_raw_parts_mut(self.0.add(at), len)
    }
}

// SAFETY: each read writes its own disjoint range of the buffer, which stays alive for as
// long as the reads (their callers hold a reference on it or wait for them).
unsafe impl Send for FillTarget {}
unsafe impl Sync for FillTarget {}

/// Memory for `len` bytes of reads. Small pages: transparent huge pages make faulting in
/// cheaper only while the kernel has free 2 MiB blocks at hand; otherwise each one waits for
/// compaction. Measured on the development VM (15 GB free, 2 GB read with O_DIRECT, a fresh
/// process each time): 2.9-3.7 s for the first load of a process with MADV_HUGEPAGE, against
/// 0.9-1.5 s without; a process loads its model once.
pub(crate) fn alloc_for_reads(len: u64, path: &std::path::Path) -> Result<MmapMut> {
    alloc(len, path)
}

/// Reads blocks of one source into page-aligned memory: with `O_DIRECT` when asked and the
/// source is a local file whose filesystem allows it, else with the source's own reads
/// (through the page cache for a file). Falls back for good at the first request `O_DIRECT`
/// refuses (tmpfs refuses the open; some network and FUSE filesystems refuse the read).
pub struct BlockReader {
    src: Arc<dyn Source>,
    direct: Option<File>,
    fell_back: AtomicBool,
}

impl BlockReader {
    pub fn open(src: Arc<dyn Source>, direct: bool) -> Result<BlockReader> {
        let direct = match src.local() {
            Some(file) if direct && src.capabilities().direct => open_direct(file)?,
            _ => None,
        };
        Ok(BlockReader { src, direct, fell_back: AtomicBool::new(false) })
    }

    pub fn source(&self) -> &dyn Source {
        &*self.src
    }

    /// Fills `dst` with the source's bytes at `b.offset`. `dst` is `b.len` bytes (or more),
    /// page-aligned; bytes past the end of the source are left as they are.
    pub fn read(&self, b: &ReadBlock, dst: &mut [u8]) -> Result<()> {
        let dst = &mut dst[..b.len as usize];
        if let Some(file) = self.direct.as_ref().filter(|_| !self.fell_back.load(Ordering::Relaxed)) {
            match read_direct(file, b, dst) {
                Ok(done) => return self.check_len(b, done),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => self.fell_back.store(true, Ordering::Relaxed),
                Err(e) => return Err(Error::io(self.src.path(), "read", e)),
            }
        }
        let done = self.src.read_at(&mut dst[..b.expected as usize], b.offset)?;
        self.check_len(b, done)
    }

    /// How the blocks were read (after the reads).
    pub fn path(&self) -> ReadPath {
        if matches!(self.src.identity(), Identity::Object { .. }) {
            return ReadPath::Remote;
        }
        if self.direct.is_some() && !self.fell_back.load(Ordering::Relaxed) {
            ReadPath::Direct
        } else {
            ReadPath::Buffered
        }
    }

    /// A read that stopped short of the block's bytes met the end of the source.
    fn check_len(&self, b: &ReadBlock, done: usize) -> Result<()> {
        if (done as u64) < b.expected {
            return Err(Error::Truncated {
                path: self.src.path().to_owned(),
                at: b.offset + done as u64,
                expected: self.src.len(),
            });
        }
        Ok(())
    }
}

/// The file opened again with `O_DIRECT` (the file opened, whatever its path names now), or
/// `None` where the filesystem does not support it or there is no `/proc` to reopen it by.
fn open_direct(file: &LocalFile) -> Result<Option<File>> {
    match file.reopen(libc::O_DIRECT) {
        Ok(file) => Ok(Some(file)),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOENT)) => Ok(None),
        Err(e) => Err(Error::io(file.path(), "open (O_DIRECT)", e)),
    }
}

/// `O_DIRECT` reads into `dst` until the block's bytes are in or the file ends: the bytes read.
fn read_direct(file: &File, b: &ReadBlock, dst: &mut [u8]) -> io::Result<usize> {
    let mut done = 0usize;
    while (done as u64) < b.expected {
        match file.read_at(&mut dst[done..], b.offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}
