//! Planning: from validated headers to the reads to issue and where each tensor lands.
//!
//! Pure computation, no I/O. A file is read whole, from offset 0, into one buffer whose base
//! is page-aligned, so a tensor's buffer offset is its file offset and its alignment in memory
//! is decided by the file layout alone.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::{Dtype, Header};

/// Alignment of O_DIRECT offsets, lengths and buffer addresses. 512 suffices on most devices;
/// 4096 is accepted everywhere and equals the page size, which buffers are aligned to anyway.
pub const IO_ALIGN: u64 = 4096;

/// Default size of one read request.
pub const DEFAULT_BLOCK: u64 = 8 << 20;

/// The read request size for a requested one: at least, and a multiple of, [`IO_ALIGN`].
pub fn io_block(requested: u64) -> u64 {
    align_up(requested.max(IO_ALIGN), IO_ALIGN)
}

/// `n` rounded up to a multiple of `align`. For file sizes, which are below 2^63.
pub fn align_up(n: u64, align: u64) -> u64 {
    debug_assert!(n <= i64::MAX as u64, "{n} is not a file size");
    n.div_ceil(align) * align
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
    assert!(align > 0 && block >= align && block % align == 0, "block must be a multiple of align");
    let total = align_up(file_len, align);
    (0..total)
        .step_by(block as usize)
        .map(|offset| {
            let len = block.min(total - offset);
            ReadBlock { offset, len, expected: len.min(file_len - offset) }
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
    let mut first_seen: HashMap<&str, usize> = HashMap::new();
    let mut out = Vec::with_capacity(headers.iter().map(|h| h.tensors.len()).sum());
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
