//! The reads of a load shared by the ranks of a group ([`crate::plan::fanout`]): the plan
//! every rank computes alike, and one rank's reads of its pieces, into host memory or a CUDA
//! device. The exchange of the pieces is the caller's (torch.distributed, in Python).

use std::sync::Arc;

use rayon::prelude::*;

use super::Planned;
use crate::device::driver::{Context, RawEvent};
use crate::device::staged::{self, StagedFile};
use crate::device::{CudaDevice, Device, StagingOptions};
use crate::error::{Error, Result};
use crate::plan::fanout::{self, SharedExtent};
use crate::plan::{self, ExtentPolicy, ReadBlock, IO_ALIGN};
use crate::source::direct::BlockReader;
use crate::source::{self, io_pool, HostRead, ReadPath, ReaderKind, Source};

/// Bytes exchanged per collective, by default: large enough that a collective's fixed cost is
/// small, small enough that reading the next chunk overlaps exchanging this one.
pub const DEFAULT_CHUNK: u64 = 64 << 20;

impl Planned {
    /// The buffers of a load shared by `world` ranks: extents of at most `max_len` bytes (a
    /// tensor larger than that gets one of its own), each exchanged in chunks of about `chunk`.
    pub fn share(&self, world: usize, max_len: u64, chunk: u64) -> Result<Vec<SharedExtent>> {
        if world == 0 {
            return Err(Error::InvalidArgument("a group of 0 ranks".to_owned()));
        }
        let policy = ExtentPolicy { max_len, ..ExtentPolicy::default() };
        let extents = plan::plan_extents(&self.tensors, &self.file_lens(), &policy);
        // A verified load reads what its checks need: whole files, or whole shards and the
        // header's, as a load of one process does; a stream (a budget) refuses a selection
        // that would need more, as a stream of one process does.
        let extents = if max_len == u64::MAX {
            self.checks.widen(extents, &self.tensors, &self.file_lens())?
        } else {
            self.checks.require_covered(extents.iter().map(|e| (e, &self.tensors[e.tensors.clone()])))?;
            extents
        };
        Ok(fanout::share(extents, world, chunk))
    }

    /// Each file's [`Source::fingerprint`], in file order (the files in parallel).
    pub fn fingerprints(&self) -> Result<Vec<String>> {
        io_pool().install(|| self.sources.par_iter().map(|s| s.fingerprint()).collect())
    }
}

/// Reads `dst.len()` bytes of `src` from `offset` into `dst`: with `O_DIRECT` where `reader`
/// chooses direct reads and the offset, length and address allow it, else through the page
/// cache; in parallel requests of `block` bytes. Bytes past the end of the source are left as
/// they are. Fails if the source changed since it was opened.
pub fn read_to_host(src: &Arc<dyn Source>, offset: u64, dst: &mut [u8], reader: ReaderKind) -> Result<ReadPath> {
    let aligned = offset % IO_ALIGN == 0 && dst.len() as u64 % IO_ALIGN == 0 && dst.as_ptr() as u64 % IO_ALIGN == 0;
    let direct = aligned && source::choose(&**src, reader)? == HostRead::Direct;
    let reader = BlockReader::open(Arc::clone(src), direct)?;
    let blocks = blocks(offset, dst.len() as u64, src.len(), plan::DEFAULT_BLOCK);
    io_pool().install(|| {
        blocks.par_iter().zip(dst.par_chunks_mut(plan::DEFAULT_BLOCK as usize)).try_for_each(|(b, d)| reader.read(b, d))
    })?;
    src.check_unchanged()?;
    Ok(reader.path())
}

/// Reads `len` bytes of `src` from `offset` to device address `dst` on CUDA device `ordinal`,
/// through the pinned staging ring, ordered after `ready`. `offset` and `len` are multiples
/// of 4096 (what a shared extent's pieces are).
pub fn read_to_cuda(
    src: &Arc<dyn Source>,
    offset: u64,
    len: u64,
    dst: u64,
    ordinal: usize,
    ready: Option<RawEvent>,
    reader: ReaderKind,
) -> Result<ReadPath> {
    let device = CudaDevice::new(Context::primary(ordinal)?, ready)?;
    read_to_device(&device, src, offset, len, dst, reader)
}

/// [`read_to_cuda`] on any [`Device`] (the host-memory stand-in, in tests).
pub fn read_to_device<D: Device>(
    device: &D,
    src: &Arc<dyn Source>,
    offset: u64,
    len: u64,
    dst: u64,
    reader: ReaderKind,
) -> Result<ReadPath> {
    if offset % IO_ALIGN != 0 || len % IO_ALIGN != 0 {
        return Err(Error::InvalidArgument(format!(
            "{}: a read to a CUDA device takes whole pages ({len} bytes at {offset})",
            src.path().display()
        )));
    }
    let direct = source::choose(&**src, reader)? == HostRead::Direct;
    let reader = BlockReader::open(Arc::clone(src), direct)?;
    let file = StagedFile { reader: &reader, dst, start: offset, len, check: None };
    let paths = staged::copy_files(device, &[file], &StagingOptions::default())?;
    src.check_unchanged()?;
    Ok(paths[0])
}

/// The requests that read `len` bytes from `offset` of a source of `file_len` bytes: `block`
/// bytes each but the last, each expecting what the source holds of it.
fn blocks(offset: u64, len: u64, file_len: u64, block: u64) -> Vec<ReadBlock> {
    (0..len)
        .step_by(block as usize)
        .map(|at| {
            let len = block.min(len - at);
            ReadBlock { offset: offset + at, len, expected: len.min(file_len.saturating_sub(offset + at)) }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_the_range_and_stop_expecting_at_the_end_of_the_source() {
        let b = blocks(100, 25, 120, 10);
        assert_eq!(
            b,
            [
                ReadBlock { offset: 100, len: 10, expected: 10 },
                ReadBlock { offset: 110, len: 10, expected: 10 },
                ReadBlock { offset: 120, len: 5, expected: 0 },
            ]
        );
        assert!(blocks(0, 0, 10, 4).is_empty());
    }
}
