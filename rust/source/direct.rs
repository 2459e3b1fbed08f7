//! The cold-file reader: parallel `O_DIRECT` preads into page-aligned anonymous memory.
//!
//! [`BlockReader`] reads one block of a file into page-aligned memory; the host reader here,
//! the stream and the staged device pipeline all use it.

use std::fs::{File, OpenOptions};
use std::io;
use std::ops::Deref;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::atomic::{AtomicBool, Ordering};

use memmap2::MmapMut;
use rayon::prelude::*;

use super::{alloc, io_pool, HostBuffer, ReadPath, SourceFile};
use crate::error::{Error, Result};
use crate::plan::{self, Extent, ReadBlock, IO_ALIGN};

/// Reads the whole file into fresh page-aligned memory, `block` bytes per request.
pub fn read(src: &SourceFile, block: u64) -> Result<HostBuffer> {
    let len = plan::align_up(src.len, IO_ALIGN);
    let whole = Extent { file: 0, start: 0, len, expected: src.len, tensors: 0..0 };
    read_extent(&BlockReader::open(src, true)?, &whole, block)
}

/// Reads `extent` of the reader's file into fresh page-aligned memory, `block` bytes per
/// request, in parallel on the I/O pool.
pub fn read_extent<S: Deref<Target = SourceFile> + Sync>(
    reader: &BlockReader<S>,
    extent: &Extent,
    block: u64,
) -> Result<HostBuffer> {
    let block = plan::io_block(block);
    let blocks = extent.blocks(reader.src.len, IO_ALIGN, block);
    let mut map = alloc_for_reads(extent.len, &reader.src.path)?;
    io_pool().install(|| {
        blocks.par_iter().zip(map.par_chunks_mut(block as usize)).try_for_each(|(b, dst)| reader.read(b, dst))
    })?;
    Ok(HostBuffer::new(map, reader.path()))
}

/// Memory for `len` bytes of reads. Small pages: transparent huge pages make faulting in
/// cheaper only while the kernel has free 2 MiB blocks at hand; otherwise each one waits for
/// compaction. Measured on the development VM (15 GB free, 2 GB read with O_DIRECT, a fresh
/// process each time): 2.9-3.7 s for the first load of a process with MADV_HUGEPAGE, against
/// 0.9-1.5 s without; a process loads its model once.
pub(crate) fn alloc_for_reads(len: u64, path: &std::path::Path) -> Result<MmapMut> {
    alloc(len, path)
}

/// Reads blocks of one file, with `O_DIRECT` when asked and the filesystem allows it, else
/// through the page cache. Falls back for good at the first request `O_DIRECT` refuses
/// (tmpfs refuses the open; some network and FUSE filesystems refuse the read). `S` is how
/// the file is held: borrowed (`&SourceFile`) or shared with background reads (`Arc`).
pub struct BlockReader<S: Deref<Target = SourceFile>> {
    src: S,
    direct: Option<File>,
    fell_back: AtomicBool,
}

impl<S: Deref<Target = SourceFile>> BlockReader<S> {
    pub fn open(src: S, direct: bool) -> Result<BlockReader<S>> {
        let direct = if direct { open_direct(&src)? } else { None };
        Ok(BlockReader { src, direct, fell_back: AtomicBool::new(false) })
    }

    pub fn source(&self) -> &SourceFile {
        &self.src
    }

    /// Fills `dst` with the file's bytes at `b.offset`. `dst` is `b.len` bytes (or more),
    /// page-aligned; bytes past the end of the file are left as they are.
    pub fn read(&self, b: &ReadBlock, dst: &mut [u8]) -> Result<()> {
        let dst = &mut dst[..b.len as usize];
        if let Some(file) = self.direct.as_ref().filter(|_| !self.fell_back.load(Ordering::Relaxed)) {
            match read_exact(&self.src, file, b, dst) {
                Err(Failure::Unsupported) => self.fell_back.store(true, Ordering::Relaxed),
                other => return other.map_err(|f| f.into_error(&self.src)),
            }
        }
        read_exact(&self.src, &self.src.file, b, dst).map_err(|f| f.into_error(&self.src))
    }

    /// How the blocks were read (after the reads).
    pub fn path(&self) -> ReadPath {
        if self.direct.is_some() && !self.fell_back.load(Ordering::Relaxed) {
            ReadPath::Direct
        } else {
            ReadPath::Buffered
        }
    }
}

/// The file opened with `O_DIRECT`, or `None` where the filesystem does not support it.
fn open_direct(src: &SourceFile) -> Result<Option<File>> {
    match OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&src.path) {
        Ok(file) => Ok(Some(file)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(e) => Err(Error::io(&src.path, "open (O_DIRECT)", e)),
    }
}

enum Failure {
    /// The filesystem refused an O_DIRECT request: retry buffered.
    Unsupported,
    Failed(Error),
}

impl Failure {
    fn into_error(self, src: &SourceFile) -> Error {
        match self {
            Failure::Failed(e) => e,
            Failure::Unsupported => Error::io(&src.path, "read", io::Error::from_raw_os_error(libc::EINVAL)),
        }
    }
}

fn read_exact(src: &SourceFile, file: &File, b: &ReadBlock, dst: &mut [u8]) -> Result<(), Failure> {
    let mut done = 0usize;
    let expected = b.expected as usize;
    while done < expected {
        match file.read_at(&mut dst[done..], b.offset + done as u64) {
            Ok(0) => {
                return Err(Failure::Failed(Error::Truncated {
                    path: src.path.clone(),
                    at: b.offset + done as u64,
                    expected: src.len,
                }))
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Err(Failure::Unsupported),
            Err(e) => return Err(Failure::Failed(Error::io(&src.path, "read", e))),
        }
    }
    Ok(())
}
