//! Loads shared by the ranks of a group: read once, fan out.
//!
//! Every rank of a group wants every selected tensor. The extents that hold them are cut into
//! chunks, and each chunk into one equal piece per rank: rank `r` reads piece `r` of every
//! chunk from storage, and an all-gather per chunk (on the group's own backend) gives every
//! rank the whole chunk. So each byte is read by exactly one rank, the reads are balanced to
//! within a few pages per extent whatever the number and sizes of the files, and the read of the
//! next chunk can overlap the exchange of this one.
//!
//! A buffer mirrors its extent byte for byte (byte `k` is file byte `start + k`), so that each
//! rank reads straight into its piece of the buffer, and tensors are views of it. Pieces are
//! whole pages (the direct reader's alignment); the last chunk of an extent is padded up to
//! `world` whole pieces, and what lies past the extent is not read.

use super::{align_up, Extent, IO_ALIGN};

/// One buffer every rank ends up holding: an extent, and the chunks it is exchanged in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedExtent {
    pub extent: Extent,
    /// Bytes of the buffer: `extent.len` padded so that every chunk is `world` whole pieces.
    pub size: u64,
    pub chunks: Vec<Chunk>,
}

/// `world` pieces of `piece` bytes from `offset` in the buffer: rank `r`'s is
/// `[offset + r * piece, offset + (r + 1) * piece)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub offset: u64,
    pub piece: u64,
}

impl Chunk {
    /// What rank `rank` reads of this chunk: the part of its piece within the first `len`
    /// bytes of the buffer (the extent; past it is padding), as a buffer offset and length.
    pub fn read_by(&self, rank: usize, len: u64) -> (u64, u64) {
        let start = (self.offset + rank as u64 * self.piece).min(len);
        (start, (start + self.piece).min(len) - start)
    }
}

/// The chunks of `extents` for a group of `world` ranks, at most about `chunk` bytes each
/// (rounded up to `world` whole pages).
pub fn share(extents: Vec<Extent>, world: usize, chunk: u64) -> Vec<SharedExtent> {
    assert!(world > 0, "a group has at least one rank");
    let ranks = world as u64;
    let full = align_up(chunk.max(1), ranks * IO_ALIGN);
    extents
        .into_iter()
        .map(|extent| {
            let mut chunks = Vec::with_capacity(extent.len.div_ceil(full) as usize);
            let mut offset = 0;
            while offset < extent.len {
                let piece = align_up((extent.len - offset).min(full).div_ceil(ranks), IO_ALIGN);
                chunks.push(Chunk { offset, piece });
                offset += piece * ranks;
            }
            SharedExtent { extent, size: offset, chunks }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(start: u64, len: u64) -> Extent {
        Extent { file: 0, start, len, expected: len, tensors: 0..1 }
    }

    /// Every byte of every extent is read by exactly one rank, at the same offset in the
    /// buffer as in the extent.
    fn assert_read_once(shared: &[SharedExtent], world: usize) {
        for s in shared {
            let mut owner = vec![None; s.extent.len as usize];
            for c in &s.chunks {
                assert_eq!(c.piece % IO_ALIGN, 0);
                for r in 0..world {
                    let (at, len) = c.read_by(r, s.extent.len);
                    for b in at..at + len {
                        assert_eq!(owner[b as usize].replace(r), None, "byte {b} read twice");
                    }
                }
            }
            assert!(owner.iter().all(Option::is_some), "every byte is read");
            let last = s.chunks.last().unwrap();
            assert_eq!(s.size, last.offset + last.piece * world as u64);
            assert!(s.size >= s.extent.len);
        }
    }

    #[test]
    fn one_rank_reads_everything_in_chunks() {
        let shared = share(vec![extent(0, 10 * IO_ALIGN)], 1, 4 * IO_ALIGN);
        let pieces: Vec<u64> = shared[0].chunks.iter().map(|c| c.piece / IO_ALIGN).collect();
        assert_eq!(pieces, [4, 4, 2]);
        assert_eq!(shared[0].size, 10 * IO_ALIGN);
        assert_read_once(&shared, 1);
    }

    #[test]
    fn pieces_are_equal_within_a_chunk_and_balanced_across_ranks() {
        for world in 1..=8 {
            for pages in [1, 2, 3, 7, 64, 1000, 1001] {
                let shared = share(vec![extent(8 * IO_ALIGN, pages * IO_ALIGN)], world, 16 * IO_ALIGN);
                assert_read_once(&shared, world);
                let mut per_rank = vec![0u64; world];
                for c in &shared[0].chunks {
                    for (r, bytes) in per_rank.iter_mut().enumerate() {
                        *bytes += c.read_by(r, shared[0].extent.len).1;
                    }
                }
                // Only the last chunk is short of whole pieces: the ranks' shares differ by
                // fewer pages than there are ranks.
                let spread = per_rank.iter().max().unwrap() - per_rank.iter().min().unwrap();
                assert!(spread < IO_ALIGN * world as u64, "{world} ranks, {pages} pages: {per_rank:?}");
            }
        }
    }

    #[test]
    fn an_extent_smaller_than_the_group_leaves_ranks_idle_not_wrong() {
        let shared = share(vec![extent(0, IO_ALIGN)], 4, 64 << 20);
        assert_eq!(shared[0].chunks, [Chunk { offset: 0, piece: IO_ALIGN }]);
        assert_eq!(shared[0].size, 4 * IO_ALIGN);
        assert_eq!(shared[0].chunks[0].read_by(0, IO_ALIGN), (0, IO_ALIGN));
        for r in 1..4 {
            assert_eq!(shared[0].chunks[0].read_by(r, IO_ALIGN).1, 0);
        }
    }

    #[test]
    fn chunk_size_rounds_up_to_whole_pages_per_rank() {
        let shared = share(vec![extent(0, 100 * IO_ALIGN)], 3, 10 * IO_ALIGN);
        assert_eq!(shared[0].chunks[0].piece, 4 * IO_ALIGN);
        assert_read_once(&shared, 3);
    }

    #[test]
    fn extents_keep_their_order_and_files() {
        let mut second = extent(0, 2 * IO_ALIGN);
        second.file = 1;
        let shared = share(vec![extent(0, 3 * IO_ALIGN), second.clone()], 2, 1 << 20);
        assert_eq!(shared.len(), 2);
        assert_eq!(shared[1].extent, second);
        assert_read_once(&shared, 2);
    }
}
