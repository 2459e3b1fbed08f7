//! The properties every input must satisfy, shared by the fuzz targets (`fuzz/fuzz_targets/`)
//! and by the corpus replay that runs under `cargo test` (`tests/fuzz_corpus.rs` includes
//! this file as a module).
//!
//! Each `check_*` function takes raw fuzzer bytes, runs one entry point of the crate on them,
//! and panics when a property is broken. An error returned by the crate is not a failure: a
//! hostile input must be rejected cleanly. A panic, an out-of-bounds access, an accepted file
//! that breaks the format's rules, or two entry points disagreeing about the same bytes is.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use fastsafetensors::format::{self, FormatError, Header, LEN_PREFIX, MAX_HEADER_LEN};
use fastsafetensors::load::{plan_files, LoadOptions};
use fastsafetensors::plan::{self, Placement, IO_ALIGN};
use fastsafetensors::source::ReaderKind;
use fastsafetensors::Error;

/// Separates the files of a multi-file input (see [`check_place`]). Bytes 0xfe and 0xff
/// never occur in UTF-8, so a separator cannot be mistaken for part of a header.
pub const FILE_SEPARATOR: &[u8] = b"\xff\xfe<next file>\xfe\xff";

/// At most this many files are taken from a multi-file input.
pub const MAX_FILES: usize = 8;

/// `format::parse`, and the two-step `header_len` + `parse_header` path the file reader
/// takes, on a whole file. Returns what `parse` returned.
pub fn check_parse(file: &[u8]) -> Result<Header, FormatError> {
    let file_len = file.len() as u64;
    let parsed = format::parse(file);
    // The reader sees only the first SNIFF_LEN bytes (the length, and what a file of
    // another format starts with), then the header bytes.
    let prefix = &file[..file.len().min(format::SNIFF_LEN)];
    let stepwise = format::header_len(prefix, file_len).and_then(|n| {
        let json = &file[LEN_PREFIX as usize..(LEN_PREFIX + n) as usize];
        format::parse_header(json, file_len)
    });
    assert_eq!(parsed, stepwise, "parse and header_len + parse_header disagree");
    match &parsed {
        Ok(header) => {
            check_header(header, file_len);
            check_reencoded(header);
            let paths = [PathBuf::from("model.safetensors")];
            let placements = plan::place(&paths, std::slice::from_ref(header))
                .unwrap_or_else(|e| panic!("one valid file failed to place: {e}"));
            check_placements(&placements, std::slice::from_ref(header));
            for block in [IO_ALIGN, 3 * IO_ALIGN, plan::DEFAULT_BLOCK] {
                check_blocks(file_len, IO_ALIGN, block);
            }
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
    parsed
}

/// Every rule of the format holds for an accepted header of a `file_len`-byte file.
pub fn check_header(h: &Header, file_len: u64) {
    assert!(h.data_start >= LEN_PREFIX && h.data_start - LEN_PREFIX <= MAX_HEADER_LEN);
    assert_eq!(h.file_len(), file_len, "header and data do not add up to the file");
    let mut names = HashSet::new();
    let mut expected = 0u64;
    for t in &h.tensors {
        assert!(names.insert(t.name.as_str()), "tensor '{}' accepted twice", t.name);
        assert_ne!(t.name, "__metadata__");
        assert_eq!(format::Dtype::from_name(t.dtype.name()), Some(t.dtype));
        assert_eq!(t.begin, expected, "tensor '{}' leaves a gap or overlaps", t.name);
        assert!(t.begin <= t.end && t.end <= h.data_len, "tensor '{}' out of bounds", t.name);
        let needed = format::byte_len(&t.name, t.dtype, &t.shape)
            .unwrap_or_else(|e| panic!("accepted a tensor whose size is invalid: {e}"));
        assert_eq!(t.nbytes(), needed, "tensor '{}' has the wrong byte count", t.name);
        expected = t.end;
    }
    assert_eq!(expected, h.data_len, "accepted trailing bytes");
}

/// Writing an accepted header out again and parsing that gives back the same tensors and
/// metadata: nothing in a name, shape or offset is lost or altered by parsing.
fn check_reencoded(h: &Header) {
    let mut json = serde_json::Map::new();
    if let Some(metadata) = &h.metadata {
        json.insert("__metadata__".into(), serde_json::json!(metadata));
    }
    for t in &h.tensors {
        let entry = serde_json::json!({
            "dtype": t.dtype.name(),
            "shape": t.shape,
            "data_offsets": [t.begin, t.end],
        });
        json.insert(t.name.clone(), entry);
    }
    let json = serde_json::to_vec(&json).expect("a header serializes");
    let mut file = (json.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&json);
    file.resize(file.len() + h.data_len as usize, 0);
    let again = format::parse(&file).unwrap_or_else(|e| panic!("re-encoded header rejected: {e}"));
    assert_eq!(again.tensors, h.tensors);
    assert_eq!(again.metadata, h.metadata);
    assert_eq!(again.data_len, h.data_len);
}

/// Placements of `headers` (file `i` is `headers[i]`): one per tensor, in file then offset
/// order, each inside its file and flagged misaligned exactly when it is.
pub fn check_placements(placements: &[Placement], headers: &[Header]) {
    assert_eq!(placements.len(), headers.iter().map(|h| h.tensors.len()).sum::<usize>());
    let mut tensors = HashMap::new();
    for (file, h) in headers.iter().enumerate() {
        for t in &h.tensors {
            assert!(tensors.insert(t.name.as_str(), (file, t)).is_none(), "'{}' placed twice", t.name);
        }
    }
    let mut previous = (0usize, 0u64);
    for p in placements {
        let (file, t) = tensors[p.name.as_str()];
        let h = &headers[file];
        assert_eq!(p.file, file);
        assert_eq!((p.dtype, &p.shape), (t.dtype, &t.shape));
        assert_eq!(p.offset, h.data_start + t.begin);
        assert_eq!(p.nbytes, t.nbytes());
        assert!(p.offset >= h.data_start && p.offset + p.nbytes <= h.file_len(), "'{}' outside its file", p.name);
        assert_eq!(p.aligned, p.offset % p.dtype.alignment() == 0);
        assert!((p.file, p.offset) >= previous, "placements out of order at '{}'", p.name);
        previous = (p.file, p.offset);
    }
}

/// `plan::place` over several files: `input` is up to [`MAX_FILES`] files joined by
/// [`FILE_SEPARATOR`]. Only inputs whose files all parse reach the planner, as in a load.
pub fn check_place(input: &[u8]) {
    let files = split_files(input);
    let Ok(headers) = files.iter().map(|f| format::parse(f)).collect::<Result<Vec<_>, _>>() else {
        return;
    };
    let paths: Vec<PathBuf> = (0..headers.len()).map(|i| PathBuf::from(format!("model-{i}.safetensors"))).collect();
    // The first name seen in an earlier file, in placement order.
    let mut seen = HashMap::new();
    let mut duplicate = None;
    'files: for (file, h) in headers.iter().enumerate() {
        for t in &h.tensors {
            if let Some(&first) = seen.get(t.name.as_str()) {
                duplicate = Some((t.name.clone(), first, file));
                break 'files;
            }
            seen.insert(t.name.as_str(), file);
        }
    }
    match (plan::place(&paths, &headers), duplicate) {
        (Ok(placements), None) => check_placements(&placements, &headers),
        (Err(Error::DuplicateTensor { name, first, second }), Some((dup, a, b))) => {
            assert_eq!((name, first, second), (dup, paths[a].clone(), paths[b].clone()));
        }
        (Ok(_), Some((name, ..))) => panic!("tensor '{name}' is in two files but was placed"),
        (Err(e), _) => panic!("unexpected planning error: {e}"),
    }
}

/// The files of a multi-file input.
pub fn split_files(input: &[u8]) -> Vec<&[u8]> {
    let mut files = Vec::new();
    let mut rest = input;
    while files.len() + 1 < MAX_FILES {
        match rest.windows(FILE_SEPARATOR.len()).position(|w| w == FILE_SEPARATOR) {
            Some(at) => {
                files.push(&rest[..at]);
                rest = &rest[at + FILE_SEPARATOR.len()..];
            }
            None => break,
        }
    }
    files.push(rest);
    files
}

/// `plan::read_blocks` on parameters decoded from `input`: three little-endian u64 (missing
/// bytes read as zero) give the file length, the alignment and the block size. They are
/// brought within what callers pass: a length a file can have (below 2^63), an alignment
/// up to 64 KiB, a block that is a multiple of it, and at most 4096 blocks in all.
pub fn check_read_blocks(input: &[u8]) {
    let word = |i: usize| {
        let mut b = [0u8; 8];
        let chunk = input.get(i * 8..).unwrap_or(&[]);
        let n = chunk.len().min(8);
        b[..n].copy_from_slice(&chunk[..n]);
        u64::from_le_bytes(b)
    };
    let align = 1 + word(1) % (64 << 10);
    let block = align * (1 + word(2) % (64 << 10));
    let file_len = (word(0) & i64::MAX as u64) % (block * 4096 + 1);
    check_blocks(file_len, align, block);
}

/// The blocks cover the file from offset 0, contiguous and aligned, each at most `block`
/// bytes, and expect exactly the file's bytes.
pub fn check_blocks(file_len: u64, align: u64, block: u64) {
    let blocks = plan::read_blocks(file_len, align, block);
    let total = plan::align_up(file_len, align);
    assert!(total >= file_len && total - file_len < align && total % align == 0);
    assert_eq!(blocks.is_empty(), file_len == 0);
    let mut next = 0u64;
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(b.offset, next, "blocks not contiguous");
        assert!(b.offset % align == 0 && b.len % align == 0, "block not aligned: {b:?}");
        assert!(b.len > 0 && b.len <= block, "block of the wrong size: {b:?}");
        assert!(i + 1 == blocks.len() || b.len == block, "short block before the last: {b:?}");
        assert_eq!(b.expected, b.len.min(file_len - b.offset), "wrong expected bytes: {b:?}");
        next += b.len;
    }
    assert_eq!(next, total);
    assert_eq!(blocks.iter().map(|b| b.expected).sum::<u64>(), file_len);
}

/// The whole loader on a file holding `file`: it accepts exactly what `format::parse`
/// accepts, with the same error, and every reader hands back each tensor's bytes from
/// inside the file.
pub fn check_load(file: &[u8]) {
    let parsed = format::parse(file);
    let tmp = TempFile::new(file);
    let planned = plan_files(&[tmp.path().to_owned()]);
    let header = match (parsed, planned) {
        (Ok(header), Ok(_)) => header,
        (Err(expected), Err(Error::Format { path, source })) => {
            assert_eq!(path, tmp.path(), "the error names another file");
            assert_eq!(source, expected, "the loader and parse reject the file for different reasons");
            return;
        }
        (Err(e), Ok(_)) => panic!("the loader accepted a file parse rejects: {e}"),
        (Ok(_), Err(e)) => panic!("the loader rejected a file parse accepts: {e}"),
        (Err(expected), Err(e)) => panic!("parse rejects the file ({expected}) but the loader fails otherwise: {e}"),
    };
    for reader in [ReaderKind::Mmap, ReaderKind::Direct, ReaderKind::Auto] {
        let options = LoadOptions { reader, block: IO_ALIGN, ..LoadOptions::default() };
        let loaded = plan_files(&[tmp.path().to_owned()])
            .and_then(|p| p.read_to_host(&options))
            .unwrap_or_else(|e| panic!("{reader:?}: a valid file failed to load: {e}"));
        check_placements(&loaded.tensors, std::slice::from_ref(&header));
        for t in &loaded.tensors {
            let end = t.offset + t.nbytes;
            assert!(end <= file.len() as u64, "'{}' ends past the file", t.name);
            assert!(
                loaded.bytes(t) == &file[t.offset as usize..end as usize],
                "{reader:?}: wrong bytes for '{}'",
                t.name
            );
        }
    }
}

/// A file under the temp dir holding given bytes, removed on drop. Names are unique per
/// process and call, so checks may run on several threads at once.
pub struct TempFile(PathBuf);

impl TempFile {
    pub fn new(bytes: &[u8]) -> TempFile {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("fastsafetensors-fuzz-{}-{n}.safetensors", std::process::id()));
        std::fs::write(&path, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        TempFile(path)
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
