//! The cold-file reader: parallel `O_DIRECT` preads into page-aligned anonymous memory.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};

use memmap2::{Advice, MmapMut};
use rayon::prelude::*;

use super::{io_pool, HostBuffer, ReadPath, SourceFile};
use crate::error::{Error, Result};
use crate::plan::{self, ReadBlock, IO_ALIGN};

/// Reads the whole file; falls back to buffered reads where `O_DIRECT` is refused (tmpfs,
/// some network and FUSE filesystems answer EINVAL at open or at the first read).
pub fn read(src: &SourceFile, block: u64) -> Result<HostBuffer> {
    let block = plan::align_up(block.max(IO_ALIGN), IO_ALIGN);
    let blocks = plan::read_blocks(src.len, IO_ALIGN, block);
    let len = plan::align_up(src.len, IO_ALIGN) as usize;
    let mut map = MmapMut::map_anon(len).map_err(|e| Error::io(&src.path, "allocate", e))?;
    // Huge pages make faulting in the destination ~10x cheaper; best effort.
    let _ = map.advise(Advice::HugePage);

    let direct = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(&src.path);
    let path = match direct {
        Ok(file) => match read_blocks(src, &file, &blocks, block, &mut map) {
            Err(Failure::Unsupported) => ReadPath::Buffered,
            other => other.map(|()| ReadPath::Direct).map_err(|f| f.into_error(src))?,
        },
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => ReadPath::Buffered,
        Err(e) => return Err(Error::io(&src.path, "open (O_DIRECT)", e)),
    };
    if path == ReadPath::Buffered {
        read_blocks(src, &src.file, &blocks, block, &mut map).map_err(|f| f.into_error(src))?;
    }
    Ok(HostBuffer { map, path })
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
            Failure::Unsupported => {
                Error::io(&src.path, "read", io::Error::from_raw_os_error(libc::EINVAL))
            }
        }
    }
}

fn read_blocks(
    src: &SourceFile,
    file: &File,
    blocks: &[ReadBlock],
    block: u64,
    buf: &mut [u8],
) -> Result<(), Failure> {
    debug_assert_eq!(blocks.len(), buf.len().div_ceil(block as usize));
    io_pool().install(|| {
        blocks
            .par_iter()
            .zip(buf.par_chunks_mut(block as usize))
            .try_for_each(|(b, dst)| read_block(src, file, b, dst))
    })
}

/// Fills `dst` (the block's slice of the buffer) with the file's bytes at `b.offset`.
fn read_block(src: &SourceFile, file: &File, b: &ReadBlock, dst: &mut [u8]) -> Result<(), Failure> {
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
