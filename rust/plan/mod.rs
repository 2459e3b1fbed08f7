//! Planning: from validated headers to the reads to issue and where each tensor lands.
//!
//! Pure computation, no I/O. Tensors are placed at their file offsets ([`place`]); the bytes
//! to read are grouped into [`Extent`]s, aligned byte ranges of one file that each fill one
//! page-aligned buffer ([`plan_extents`]). An extent starts at a multiple of [`IO_ALIGN`], so
//! a tensor's alignment in memory is its alignment in the file, whatever extent holds it. A
//! whole-file load is one extent per file; a selective load reads only the selected tensors'
//! ranges, merged where the gaps between them are small; a streaming load also caps each
//! extent's size, so that it can be handed out while the next ones are read.

pub mod fanout;
pub mod save;
pub mod select;
pub mod target;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::{Dtype, Header};

/// Alignment of O_DIRECT offsets, lengths and buffer addresses. 512 suffices on most devices;
/// 4096 is accepted everywhere and equals the page size, which buffers are aligned to anyway.
pub const IO_ALIGN: u64 = 4096;

/// Default size of one read request.
pub const DEFAULT_BLOCK: u64 = 8 << 20;

/// Default largest gap between two selected byte ranges that is read rather than skipped:
/// reading 256 KiB costs about what one more request costs on an NVMe drive.
pub const DEFAULT_MAX_GAP: u64 = 256 << 10;

/// The read request size for a requested one: at least, and a multiple of, [`IO_ALIGN`].
pub fn io_block(requested: u64) -> u64 {
    align_up(requested.max(IO_ALIGN), IO_ALIGN)
}

/// `n` rounded up to a multiple of `align`. For file sizes, which are below 2^63.
pub fn align_up(n: u64, align: u64) -> u64 {
    debug_assert!(n <= i64::MAX as u64, "{n} is not a file size");
    n.div_ceil(align) * align
}

/// `n` rounded down to a multiple of `align`.
pub fn align_down(n: u64, align: u64) -> u64 {
    n - n % align
}

/// One read request: `len` bytes (a multiple of the alignment) at `offset` in both the file
/// and the buffer, of which the first `expected` exist in the file (the rest is past its end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadBlock {
    pub offset: u64,
    pub len: u64,
    pub expected: u64,
}

/// Splits a file of `file_len` bytes into aligned blocks of at most `block` bytes.
pub fn read_blocks(file_len: u64, align: u64, block: u64) -> Vec<ReadBlock> {
    extent_blocks(0, align_up(file_len, align), file_len, align, block)
}

/// Splits the aligned range `[start, start + len)` of a file of `file_len` bytes into blocks
/// of at most `block` bytes. Block offsets are file offsets; a block lands at
/// `offset - start` in the extent's buffer.
pub fn extent_blocks(start: u64, len: u64, file_len: u64, align: u64, block: u64) -> Vec<ReadBlock> {
    assert!(align > 0 && block >= align && block % align == 0, "block must be a multiple of align");
    assert!(start % align == 0 && len % align == 0, "extent must be aligned");
    (start..start + len)
        .step_by(block as usize)
        .map(|offset| {
            let len = block.min(start + len - offset);
            ReadBlock { offset, len, expected: len.min(file_len.saturating_sub(offset)) }
        })
        .collect()
}

/// Where one tensor lands: `nbytes` at `offset` in the buffer of file `file`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub file: usize,
    pub offset: u64,
    pub nbytes: u64,
    /// False when the data is not aligned to its element size in memory: it must be copied
    /// to aligned memory before it is handed out as a typed tensor.
    pub aligned: bool,
}

/// Every tensor of `headers` (one per file, same order as `paths`), in file then offset
/// order. Tensor names must be unique across files.
pub fn place(paths: &[PathBuf], headers: &[Header]) -> Result<Vec<Placement>> {
    let total = headers.iter().map(|h| h.tensors.len()).sum();
    let mut first_seen: HashMap<&str, usize> = HashMap::with_capacity(total);
    let mut out = Vec::with_capacity(total);
    for (file, header) in headers.iter().enumerate() {
        for t in &header.tensors {
            if let Some(&other) = first_seen.get(t.name.as_str()) {
                return Err(duplicate(&t.name, &paths[other], &paths[file]));
            }
            first_seen.insert(&t.name, file);
            let offset = header.data_start + t.begin;
            out.push(Placement {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                file,
                offset,
                nbytes: t.nbytes(),
                aligned: offset % t.dtype.alignment() == 0,
            });
        }
    }
    Ok(out)
}

fn duplicate(name: &str, first: &Path, second: &Path) -> Error {
    Error::DuplicateTensor { name: name.to_owned(), first: first.to_owned(), second: second.to_owned() }
}

impl Placement {
    /// Rows `[start, stop)` of the tensor (along its first dimension): in a row-major tensor
    /// they are one contiguous byte range, so only those bytes need reading. Columns are not
    /// contiguous; a column shard reads the whole tensor and slices it in memory. The error
    /// says why the rows cannot be taken (the caller adds the file).
    pub fn rows(&self, start: u64, stop: u64) -> std::result::Result<Placement, String> {
        let Some((&len, rest)) = self.shape.split_first() else {
            return Err(format!("tensor '{}' is a scalar and has no rows", self.name));
        };
        if start > stop || stop > len {
            return Err(format!("tensor '{}' has {len} rows; rows [{start}, {stop}) are not within them", self.name));
        }
        // Cannot overflow: the whole tensor's bit count was checked when the header was read.
        let row_bits = rest.iter().product::<u64>() * self.dtype.bits();
        if row_bits % 8 != 0 {
            return Err(format!(
                "tensor '{}': a row of {} {:?} is not a whole number of bytes",
                self.name, self.dtype, rest
            ));
        }
        let row = row_bits / 8;
        let mut shape = self.shape.clone();
        shape[0] = stop - start;
        let offset = self.offset + start * row;
        Ok(Placement {
            name: self.name.clone(),
            dtype: self.dtype,
            shape,
            file: self.file,
            offset,
            nbytes: (stop - start) * row,
            aligned: offset % self.dtype.alignment() == 0,
        })
    }
}

/// An aligned byte range of one file, read into one buffer, and the tensors it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Extent {
    pub file: usize,
    /// File offset of the first byte: a multiple of the alignment.
    pub start: u64,
    /// Bytes to allocate and to request: a multiple of the alignment.
    pub len: u64,
    /// Bytes of `len` that exist in the file (the rest is past its end).
    pub expected: u64,
    /// The tensors it holds, as indexes into the placements it was planned from.
    pub tensors: Range<usize>,
}

impl Extent {
    /// Where tensor `t` (one of this extent's) starts in the extent's buffer.
    pub fn offset_of(&self, t: &Placement) -> u64 {
        debug_assert!(t.file == self.file && t.offset >= self.start && t.offset + t.nbytes <= self.start + self.len);
        t.offset - self.start
    }

    /// The read requests that fill this extent, `block` bytes at most each.
    pub fn blocks(&self, file_len: u64, align: u64, block: u64) -> Vec<ReadBlock> {
        extent_blocks(self.start, self.len, file_len, align, block)
    }
}

/// How [`plan_extents`] groups the byte ranges of tensors into extents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtentPolicy {
    pub align: u64,
    /// Largest gap between two tensors of one extent; the gap's bytes are read and unused.
    /// Larger gaps are skipped: the next tensor starts a new extent.
    pub max_gap: u64,
    /// Largest extent. A tensor larger than this still gets an extent: one of its own.
    pub max_len: u64,
}

impl Default for ExtentPolicy {
    /// No size cap: what a load that holds everything at once reads.
    fn default() -> Self {
        ExtentPolicy { align: IO_ALIGN, max_gap: DEFAULT_MAX_GAP, max_len: u64::MAX }
    }
}

/// Groups the byte ranges of `tensors` (in file then offset order, as [`place`] returns
/// them; file `i` is `file_lens[i]` bytes) into extents, in the same order. Consecutive
/// tensors of one file share an extent while the gap between them is at most `max_gap` and
/// the extent stays within `max_len`. Every extent holds at least one tensor.
pub fn plan_extents(tensors: &[Placement], file_lens: &[u64], policy: &ExtentPolicy) -> Vec<Extent> {
    let ExtentPolicy { align, max_gap, max_len } = *policy;
    assert!(align > 0, "alignment must be positive");
    let close = |file: usize, start: u64, end: u64, tensors: Range<usize>| Extent {
        file,
        start,
        len: end - start,
        expected: end.min(file_lens[file]).saturating_sub(start),
        tensors,
    };
    let mut out = Vec::new();
    // The extent being built: file, start, aligned end, first tensor.
    let mut open: Option<(usize, u64, u64, usize)> = None;
    for (i, t) in tensors.iter().enumerate() {
        let (start, end) = (align_down(t.offset, align), align_up(t.offset + t.nbytes, align));
        if let Some((file, first_start, last_end, first)) = open {
            assert!((t.file, t.offset) >= (file, tensors[i - 1].offset), "tensors must be in file then offset order");
            if file == t.file && start <= last_end.saturating_add(max_gap) && end.max(last_end) - first_start <= max_len
            {
                open = Some((file, first_start, end.max(last_end), first));
                continue;
            }
            out.push(close(file, first_start, last_end, first..i));
        }
        open = Some((t.file, start, end, i));
    }
    if let Some((file, start, end, first)) = open {
        out.push(close(file, start, end, first..tensors.len()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format;

    fn header(json: &str, data_len: usize) -> Header {
        let mut f = (json.len() as u64).to_le_bytes().to_vec();
        f.extend_from_slice(json.as_bytes());
        f.resize(f.len() + data_len, 0);
        format::parse(&f).unwrap()
    }

    #[test]
    fn blocks_cover_the_file_with_aligned_requests() {
        let blocks = read_blocks(10_000, 4096, 8192);
        assert_eq!(
            blocks,
            [ReadBlock { offset: 0, len: 8192, expected: 8192 }, ReadBlock { offset: 8192, len: 4096, expected: 1808 },]
        );
    }

    #[test]
    fn exact_multiple_has_no_partial_block() {
        let blocks = read_blocks(16384, 4096, 8192);
        assert_eq!(blocks.len(), 2);
        assert!(blocks.iter().all(|b| b.len == 8192 && b.expected == 8192));
    }

    #[test]
    fn tiny_file_is_one_aligned_block() {
        assert_eq!(read_blocks(10, 4096, 8 << 20), [ReadBlock { offset: 0, len: 4096, expected: 10 }]);
        assert!(read_blocks(0, 4096, 4096).is_empty());
    }

    #[test]
    fn blocks_are_contiguous_and_aligned() {
        for file_len in [1, 4095, 4096, 4097, 1 << 20, (3 << 20) + 17] {
            for block in [4096, 12288, 1 << 20] {
                let blocks = read_blocks(file_len, 4096, block);
                let mut next = 0;
                for b in &blocks {
                    assert_eq!(b.offset, next);
                    assert_eq!(b.offset % 4096, 0);
                    assert_eq!(b.len % 4096, 0);
                    assert!(b.len <= block && b.expected <= b.len);
                    next += b.len;
                }
                assert_eq!(next, align_up(file_len, 4096));
                assert_eq!(blocks.iter().map(|b| b.expected).sum::<u64>(), file_len);
            }
        }
    }

    #[test]
    fn placements_are_file_offsets_and_flag_misalignment() {
        // Header of 31 bytes: data starts at 39, so an F32 at data offset 0 is misaligned.
        let json = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[1],"data_offsets":[4,5]}}"#;
        let h = header(json, 5);
        let p = place(&[PathBuf::from("x")], std::slice::from_ref(&h)).unwrap();
        assert_eq!(p[0].offset, h.data_start);
        assert_eq!(p[0].aligned, h.data_start % 4 == 0);
        assert!(p[1].aligned, "bytes are always aligned");
        assert_eq!(p[1].offset, h.data_start + 4);
    }

    #[test]
    fn padded_header_gives_aligned_tensors() {
        let mut json = r#"{"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}}"#.to_string();
        while (8 + json.len()) % 8 != 0 {
            json.push(' ');
        }
        let p = place(&[PathBuf::from("x")], &[header(&json, 8)]).unwrap();
        assert!(p[0].aligned);
    }

    #[test]
    fn duplicate_names_across_files_are_rejected() {
        let json = r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
        let paths = [PathBuf::from("one.safetensors"), PathBuf::from("two.safetensors")];
        let err = place(&paths, &[header(json, 1), header(json, 1)]).unwrap_err().to_string();
        assert_eq!(err, "tensor 'w' is in both one.safetensors and two.safetensors");
    }

    /// A tensor of `nbytes` U8 at `offset` of file `file`.
    fn at(file: usize, offset: u64, nbytes: u64) -> Placement {
        Placement {
            name: format!("t{file}@{offset}"),
            dtype: Dtype::U8,
            shape: vec![nbytes],
            file,
            offset,
            nbytes,
            aligned: true,
        }
    }

    fn policy(max_gap: u64, max_len: u64) -> ExtentPolicy {
        ExtentPolicy { align: 4096, max_gap, max_len }
    }

    #[test]
    fn extent_blocks_cover_a_range_inside_a_file() {
        assert_eq!(
            extent_blocks(8192, 12288, 18000, 4096, 8192),
            [
                ReadBlock { offset: 8192, len: 8192, expected: 8192 },
                ReadBlock { offset: 16384, len: 4096, expected: 1616 }
            ]
        );
        assert!(extent_blocks(4096, 0, 10, 4096, 4096).is_empty());
    }

    #[test]
    fn a_whole_file_is_one_extent() {
        let tensors = [at(0, 100, 5000), at(0, 5100, 20), at(0, 5120, 0), at(0, 5120, 3000)];
        let e = plan_extents(&tensors, &[8120], &ExtentPolicy::default());
        assert_eq!(e, [Extent { file: 0, start: 0, len: 8192, expected: 8120, tensors: 0..4 }]);
        assert_eq!(e[0].offset_of(&tensors[3]), 5120);
    }

    #[test]
    fn large_gaps_are_skipped_and_small_ones_read() {
        // Tensors at [0, 4096) and [20480, 24576): a 16 KiB gap.
        let tensors = [at(0, 0, 4096), at(0, 20480, 4096)];
        let lens = [1 << 20];
        assert_eq!(plan_extents(&tensors, &lens, &policy(16384, u64::MAX)).len(), 1);
        let split = plan_extents(&tensors, &lens, &policy(12288, u64::MAX));
        assert_eq!(split.iter().map(|e| (e.start, e.len)).collect::<Vec<_>>(), [(0, 4096), (20480, 4096)]);
    }

    #[test]
    fn extents_are_capped_but_a_large_tensor_gets_one_alone() {
        let tensors = [at(0, 0, 3000), at(0, 3000, 3000), at(0, 6000, 50000), at(0, 56000, 100), at(0, 56100, 100)];
        let e = plan_extents(&tensors, &[56200], &policy(0, 8192));
        let summary: Vec<_> = e.iter().map(|e| (e.start, e.len, e.tensors.clone())).collect();
        assert_eq!(summary, [(0, 8192, 0..2), (4096, 53248, 2..3), (53248, 4096, 3..5)]);
    }

    #[test]
    fn files_never_share_an_extent() {
        let e = plan_extents(&[at(0, 0, 10), at(1, 0, 10)], &[10, 10], &ExtentPolicy::default());
        assert_eq!(e.iter().map(|e| (e.file, e.expected)).collect::<Vec<_>>(), [(0, 10), (1, 10)]);
    }

    #[test]
    #[should_panic(expected = "file then offset order")]
    fn unordered_tensors_are_a_bug() {
        plan_extents(&[at(0, 100, 10), at(0, 0, 10)], &[200], &ExtentPolicy::default());
    }

    /// A small deterministic generator, so the exhaustive tests need no extra crate.
    struct Lcg(u64);

    impl Lcg {
        fn below(&mut self, n: u64) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 33) % n.max(1)
        }
    }

    #[test]
    fn extents_hold_every_selected_tensor_and_nothing_needless() {
        let mut rng = Lcg(7);
        for case in 0..3000 {
            let files = 1 + rng.below(3) as usize;
            let mut tensors = Vec::new();
            let mut lens = Vec::new();
            for file in 0..files {
                let mut offset = 8 + rng.below(5000);
                for _ in 0..rng.below(9) {
                    let nbytes = [0, 1, 100, 4096, 5000, 20000][rng.below(6) as usize] + rng.below(3);
                    if rng.below(3) > 0 {
                        tensors.push(at(file, offset, nbytes));
                    }
                    offset += nbytes;
                }
                lens.push(offset);
            }
            let align = [512, 4096][rng.below(2) as usize];
            let max_gap = [0, 4096, 65536][rng.below(3) as usize];
            let max_len = [4096, 16384, u64::MAX][rng.below(3) as usize];
            let policy = ExtentPolicy { align, max_gap, max_len };
            let extents = plan_extents(&tensors, &lens, &policy);
            let ctx = format!("case {case}: {policy:?} {tensors:?}");
            let mut next = 0;
            for (k, e) in extents.iter().enumerate() {
                let held = &tensors[e.tensors.clone()];
                assert_eq!(e.tensors.start, next, "{ctx}");
                assert!(!held.is_empty(), "{ctx}");
                next = e.tensors.end;
                assert!(e.start % align == 0 && e.len % align == 0, "{ctx}");
                assert_eq!(e.start, align_down(held[0].offset, align), "{ctx}");
                let end = held.iter().map(|t| align_up(t.offset + t.nbytes, align)).max().unwrap();
                assert_eq!(e.start + e.len, end, "{ctx}");
                assert!(e.len <= max_len || held.len() == 1, "{ctx}: oversized extent {e:?}");
                assert_eq!(e.expected, end.min(lens[e.file]).saturating_sub(e.start), "{ctx}");
                let mut reach = 0;
                for t in held {
                    assert_eq!(t.file, e.file, "{ctx}");
                    assert!(t.offset >= e.start && t.offset + t.nbytes <= e.start + e.len, "{ctx}");
                    assert!(reach == 0 || align_down(t.offset, align) <= reach + max_gap, "{ctx}: gap too large");
                    reach = reach.max(align_up(t.offset + t.nbytes, align));
                }
                // Split only where it had to be: another file, a large gap, or the size cap.
                if let Some(f) = extents.get(k + 1) {
                    let first = &tensors[f.tensors.start];
                    let merged_end = (e.start + e.len).max(align_up(first.offset + first.nbytes, align));
                    assert!(
                        f.file != e.file
                            || align_down(first.offset, align) > e.start + e.len + max_gap
                            || merged_end - e.start > max_len,
                        "{ctx}: needless split between {e:?} and {f:?}"
                    );
                }
                let blocks = e.blocks(lens[e.file], align, 2 * align);
                assert_eq!(blocks.iter().map(|b| b.len).sum::<u64>(), e.len, "{ctx}");
                assert_eq!(blocks.iter().map(|b| b.expected).sum::<u64>(), e.expected, "{ctx}");
            }
            assert_eq!(next, tensors.len(), "{ctx}");
        }
    }

    #[test]
    fn rows_are_a_contiguous_part_of_the_tensor() {
        let json = r#"{"w":{"dtype":"BF16","shape":[6,5],"data_offsets":[0,60]},"s":{"dtype":"F32","shape":[],"data_offsets":[60,64]},"p":{"dtype":"F4","shape":[4,3],"data_offsets":[64,70]}}"#;
        let h = header(json, 70);
        let p = place(&[PathBuf::from("x")], std::slice::from_ref(&h)).unwrap();
        let w = p.iter().find(|t| t.name == "w").unwrap();
        let rows = w.rows(2, 5).unwrap();
        assert_eq!((rows.offset, rows.nbytes, rows.shape.clone()), (w.offset + 20, 30, vec![3, 5]));
        assert_eq!(w.rows(6, 6).unwrap().nbytes, 0);
        assert_eq!(w.rows(0, 6).unwrap(), *w);
        assert!(w.rows(4, 7).unwrap_err().contains("has 6 rows; rows [4, 7)"));
        assert!(w.rows(3, 2).is_err());
        let s = p.iter().find(|t| t.name == "s").unwrap();
        assert!(s.rows(0, 1).unwrap_err().contains("scalar"));
        let packed = p.iter().find(|t| t.name == "p").unwrap();
        assert!(packed.rows(0, 2).unwrap_err().contains("not a whole number of bytes"));
    }

    #[test]
    fn placements_follow_file_order() {
        let a = header(r#"{"x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#, 1);
        let b = header(r#"{"y":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#, 2);
        let p = place(&[PathBuf::from("a"), PathBuf::from("b")], &[a, b]).unwrap();
        assert_eq!(
            p.iter().map(|p| (p.name.as_str(), p.file, p.nbytes)).collect::<Vec<_>>(),
            [("x", 0, 1), ("y", 1, 2)]
        );
    }
}
