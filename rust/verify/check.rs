//! The per-file check the readers feed: blocks land in any order, in buffers the load owns,
//! and are hashed in file order by whichever reader completes the next bytes, while the other
//! readers go on reading. Files (and a sharded manifest's shards) are checked independently,
//! so they hash in parallel.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use super::{Digest, Expected, Hasher, Manifest};
use crate::error::{Error, Result};
use crate::format::{Header, LEN_PREFIX};
use crate::source::HostBuffer;

/// A manifest and how a load is to be checked against it.
#[derive(Debug, Clone)]
pub struct Verifier {
    pub manifest: Arc<Manifest>,
    /// Read the whole of every file a load touches, so that a load of some of its tensors can
    /// still be checked against a digest of the whole file.
    pub full: bool,
    /// The load is of a whole directory: every weights file the manifest lists at its top
    /// must be among the load's files (a file missing would leave the model short, silently).
    pub complete: bool,
}

impl Verifier {
    pub fn new(manifest: Manifest, full: bool) -> Verifier {
        Verifier { manifest: Arc::new(manifest), full, complete: false }
    }

    /// For a load of the files `paths`, a directory's: the first listed `.safetensors` file
    /// at the manifest's top that is not among them, as an error.
    pub fn check_complete(&self, paths: &[&Path]) -> Result<()> {
        if !self.complete {
            return Ok(());
        }
        let loaded: Vec<&str> =
            paths.iter().filter_map(|p| self.manifest.entry_for(&p.to_string_lossy()).map(|(name, _)| name)).collect();
        let dir = paths.first().and_then(|p| p.parent()).unwrap_or(Path::new("."));
        match self
            .manifest
            .files
            .keys()
            .find(|n| n.ends_with(".safetensors") && !n.contains('/') && !loaded.contains(&n.as_str()))
        {
            Some(name) => Err(Error::NotLoaded { path: dir.join(name), manifest: self.manifest.origin.clone() }),
            None => Ok(()),
        }
    }

    /// The check of the file at `path` (what the manifest's names are matched against),
    /// whose header is `header`: its header bytes are hashed at once (those parsed, not a
    /// second read of them), its data as the load's reads land.
    pub fn check_for(&self, path: &Path, header: &Header) -> Result<Arc<FileCheck>> {
        let shown = path.to_string_lossy();
        let Some((_, expected)) = self.manifest.entry_for(&shown) else {
            return Err(Error::NotInManifest { path: path.to_owned(), manifest: self.manifest.origin.clone() });
        };
        let check = FileCheck::new(path, header.file_len(), expected, &self.manifest.origin)?;
        let mut head = (header.data_start - LEN_PREFIX).to_le_bytes().to_vec();
        head.extend_from_slice(&header.json);
        check.landed_transient(0, &head);
        // Only the data's reads say whether a load touched the file.
        check.segments.iter().for_each(|s| s.lock().touched = false);
        Ok(Arc::new(check))
    }
}

/// The digests of one file being computed as its bytes land.
pub struct FileCheck {
    path: PathBuf,
    origin: String,
    /// The whole file (a file-level manifest) or its shards, in order.
    segments: Vec<Segment>,
    whole: bool,
    failed: AtomicBool,
}

struct Segment {
    start: u64,
    end: u64,
    expected: Digest,
    state: Mutex<State>,
    progress: Condvar,
}

struct State {
    /// Bytes below this are hashed or being hashed.
    claimed: u64,
    /// Bytes below this are hashed.
    hashed: u64,
    /// Blocks landed past `claimed`, by (start, end).
    pending: BTreeMap<(u64, u64), Block>,
    hasher: Option<Hasher>,
    /// A reader is hashing (others only queue their blocks).
    hashing: bool,
    /// Whether any of the data was read.
    touched: bool,
    /// Set once every byte is hashed: the digest, if it is not the one expected.
    outcome: Option<std::result::Result<(), Digest>>,
}

/// How a reader's bytes outlive its call, where they must wait for earlier ones.
#[derive(Clone, Copy)]
enum Keep<'a> {
    /// A reference on the buffer holding them.
    Buffer(&'a Arc<HostBuffer>),
    /// A copy.
    Copy,
}

/// Bytes waiting for the bytes before them: in the load's buffer, or a copy of bytes whose
/// buffer is reused as soon as the reader returns (a staging slot).
enum Block {
    Borrowed(*const u8, usize),
    /// Bytes in a buffer shared with the consumer (a stream's group): the reference keeps the
    /// buffer from being freed or reused before they are hashed.
    Kept(#[allow(dead_code)] Arc<HostBuffer>, *const u8, usize),
    Owned(Vec<u8>),
}

// SAFETY: a borrowed block points into a buffer that the load keeps alive and unchanged until
// the block is hashed or the check finished (the contract of `FileCheck::landed`); the bytes
// are only read.
unsafe impl Send for Block {}

impl Block {
    fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: see `unsafe impl Send for Block`.
            Block::Borrowed(ptr, len) | Block::Kept(_, ptr, len) => unsafe { std::slice::from_raw_parts(*ptr, *len) },
            Block::Owned(v) => v,
        }
    }
}

impl FileCheck {
    pub(crate) fn new(path: &Path, file_len: u64, expected: &Expected, origin: &str) -> Result<FileCheck> {
        let segment = |start, end, expected: &Digest| Segment {
            start,
            end,
            expected: expected.clone(),
            state: Mutex::new(State {
                claimed: start,
                hashed: start,
                pending: BTreeMap::new(),
                hasher: Some(expected.algorithm.hasher()),
                hashing: false,
                touched: false,
                outcome: None,
            }),
            progress: Condvar::new(),
        };
        let (segments, whole) = match expected {
            Expected::Whole(d) => (vec![segment(0, file_len, d)], true),
            Expected::Shards(shards) => {
                let signed_len = shards.last().map_or(0, |s| s.end);
                if signed_len != file_len {
                    return Err(Error::DigestMismatch {
                        path: path.to_owned(),
                        start: 0,
                        end: file_len,
                        expected: format!("a file of {signed_len} bytes"),
                        actual: format!("one of {file_len} bytes"),
                        manifest: origin.to_owned(),
                    });
                }
                (shards.iter().map(|s| segment(s.start, s.end, &s.digest)).collect(), false)
            }
        };
        Ok(FileCheck {
            path: path.to_owned(),
            origin: origin.to_owned(),
            segments,
            whole,
            failed: AtomicBool::new(false),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the digests come from, for messages.
    pub fn manifest(&self) -> &str {
        &self.origin
    }

    /// Whether the manifest has one digest for the whole file (rather than shards).
    pub fn is_whole_file(&self) -> bool {
        self.whole
    }

    /// `bytes`, read from file offset `offset`, have landed in a buffer of the load.
    ///
    /// # Safety
    /// `bytes` must stay alive and unchanged until [`FileCheck::wait_hashed`] up to their end
    /// has returned, or [`FileCheck::finish`] has, or the check is dropped: the bytes may be
    /// hashed later, by another reader, once the bytes before them have landed.
    pub unsafe fn landed(&self, offset: u64, bytes: &[u8]) {
        self.feed(offset, bytes, None)
    }

    /// As [`FileCheck::landed`], for the `len` bytes at `at` in `buffer` (written, and no
    /// longer written to): the check holds a reference on the buffer until they are hashed.
    pub fn landed_in(&self, offset: u64, buffer: &Arc<HostBuffer>, at: usize, len: usize) {
        assert!(at + len <= buffer.byte_len(), "bytes inside the buffer");
        // SAFETY: the range lies in the buffer (asserted), whose reference the pending block
        // keeps; its reads are done, and no other read writes those bytes.
        let bytes = unsafe { std::slice::from_raw_parts(buffer.as_ptr().add(at), len) };
        self.feed(offset, bytes, Some(Keep::Buffer(buffer)))
    }

    /// As [`FileCheck::landed`], for bytes whose buffer is reused once this returns: they are
    /// hashed before it returns where the bytes before them are in, copied otherwise.
    pub fn landed_transient(&self, offset: u64, bytes: &[u8]) {
        self.feed(offset, bytes, Some(Keep::Copy))
    }

    fn feed(&self, offset: u64, bytes: &[u8], keep: Option<Keep>) {
        let end = offset + bytes.len() as u64;
        for seg in self.segments.iter().filter(|s| s.start < end && offset < s.end) {
            let (from, to) = (offset.max(seg.start), end.min(seg.end));
            let part = &bytes[(from - offset) as usize..(to - offset) as usize];
            if self.feed_segment(seg, from, part, keep) {
                self.failed.store(true, Ordering::Relaxed);
            }
        }
    }

    /// Queues a block and hashes what is contiguous, unless another reader is: returns
    /// whether the segment's digest turned out wrong.
    fn feed_segment(&self, seg: &Segment, start: u64, part: &[u8], keep: Option<Keep>) -> bool {
        let end = start + part.len() as u64;
        let transient = matches!(keep, Some(Keep::Copy));
        let mut st = seg.lock();
        st.touched = true;
        if end <= st.claimed || part.is_empty() {
            return false;
        }
        let block = match keep {
            Some(Keep::Buffer(buffer)) => Block::Kept(Arc::clone(buffer), part.as_ptr(), part.len()),
            _ => Block::Borrowed(part.as_ptr(), part.len()),
        };
        st.pending.insert((start, end), block);
        if st.hashing {
            if !transient {
                return false;
            }
            if start <= st.claimed {
                // The reader hashing will reach it next: the bytes must stay until it has.
                while st.hashed < end && st.hashing {
                    st = seg.progress.wait(st).unwrap_or_else(|e| e.into_inner());
                }
                if st.hashed >= end {
                    return false;
                }
            }
        } else {
            st.hashing = true;
            st = self.hash_contiguous(seg, st);
        }
        if transient {
            if let Some(b) = st.pending.get_mut(&(start, end)) {
                *b = Block::Owned(part.to_vec());
            }
        }
        matches!(st.outcome, Some(Err(_)))
    }

    /// Hashes the landed blocks that continue the hashed bytes, the lock released while it
    /// does, until a gap or the end; then lets others hash again.
    fn hash_contiguous<'a>(&self, seg: &'a Segment, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        loop {
            let mut run = Vec::new();
            let st_ref = &mut *st;
            while let Some(entry) = st_ref.pending.first_entry() {
                let (start, end) = *entry.key();
                if start > st_ref.claimed {
                    break;
                }
                let block = entry.remove();
                let st = &mut *st_ref;
                if end > st.claimed {
                    run.push(((st.claimed - start) as usize, block));
                    st.claimed = end;
                }
            }
            if run.is_empty() {
                st.hashing = false;
                seg.progress.notify_all();
                return st;
            }
            let (upto, mut hasher) = (st.claimed, st.hasher.take().expect("one reader hashes at a time"));
            drop(st);
            for (skip, block) in &run {
                hasher.update(&block.bytes()[*skip..]);
            }
            drop(run);
            st = seg.lock();
            st.hashed = upto;
            if upto == seg.end {
                let actual = hasher.finish();
                st.outcome = Some(if actual == seg.expected { Ok(()) } else { Err(actual) });
            } else {
                st.hasher = Some(hasher);
            }
            seg.progress.notify_all();
        }
    }

    /// Waits until every byte before `offset` that has landed is hashed (a reader may still be
    /// hashing blocks another reader queued): after it, buffers holding those bytes may go.
    pub fn wait_hashed(&self, offset: u64) {
        for seg in self.segments.iter().filter(|s| s.start < offset) {
            let mut st = seg.lock();
            while st.hashing && st.hashed < offset.min(seg.end) {
                st = seg.progress.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    /// Whether a digest already turned out wrong (the load may stop early).
    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }

    /// Waits for the hashing in progress, then says whether the file is what the manifest
    /// says: every digest whose bytes were all read matches. A file-level digest whose file was
    /// read in part is an error; a shard read in part is not checked (nothing of it that was
    /// not read is handed out... but what was is unverified: loads read whole shards).
    pub fn finish(&self) -> Result<()> {
        for seg in &self.segments {
            let mut st = seg.lock();
            while st.hashing {
                st = seg.progress.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            match &st.outcome {
                Some(Ok(())) => {}
                Some(Err(actual)) => {
                    return Err(Error::DigestMismatch {
                        path: self.path.clone(),
                        start: seg.start,
                        end: seg.end,
                        expected: seg.expected.to_string(),
                        actual: actual.to_string(),
                        manifest: self.origin.clone(),
                    })
                }
                None if self.whole && st.touched => {
                    return Err(Error::PartialVerify { path: self.path.clone(), manifest: self.origin.clone() })
                }
                None => {}
            }
        }
        Ok(())
    }

    /// The bytes a load must still read for every digest that covers any of `wanted` (byte
    /// ranges the load hands out) to be checked: from the first byte not yet hashed (the
    /// header is, from the start) to the end of the last such digest; `None` if none.
    pub fn bytes_to_read(&self, wanted: &[(u64, u64)]) -> Option<(u64, u64)> {
        let touched = |seg: &Segment| wanted.iter().any(|&(a, b)| a < seg.end && seg.start < b);
        let mut span: Option<(u64, u64)> = None;
        for seg in self.segments.iter().filter(|s| touched(s)) {
            let from = seg.lock().claimed;
            if from < seg.end {
                span = Some(span.map_or((from, seg.end), |(a, b)| (a.min(from), b.max(seg.end))));
            }
        }
        span
    }
}

impl Segment {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verify::{Algorithm, Shard};
    use sha2::Digest as _;

    fn sha(bytes: &[u8]) -> Digest {
        Digest { algorithm: Algorithm::Sha256, bytes: sha2::Sha256::digest(bytes).to_vec() }
    }

    fn whole(bytes: &[u8]) -> FileCheck {
        FileCheck::new(Path::new("f.safetensors"), bytes.len() as u64, &Expected::Whole(sha(bytes)), "m").unwrap()
    }

    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 % 251) as u8).collect()
    }

    /// Every order of four blocks (and the first one fed again, as extents sharing a page
    /// are) gives the digest of the bytes in file order.
    #[test]
    fn blocks_in_any_order_hash_in_file_order() {
        let bytes = data(4000);
        let blocks = [(0usize, 1000usize), (1000, 1500), (2500, 1), (2501, 1499)];
        let mut order = [0, 1, 2, 3];
        let mut permutations = 0;
        loop {
            for transient in [false, true] {
                let check = whole(&bytes);
                for &k in &order {
                    let (at, len) = blocks[k];
                    if transient {
                        check.landed_transient(at as u64, &bytes[at..at + len]);
                    } else {
                        unsafe { check.landed(at as u64, &bytes[at..at + len]) };
                    }
                }
                check.landed_transient(0, &bytes[..10]);
                assert!(check.finish().is_ok(), "order {order:?}");
            }
            permutations += 1;
            // Next permutation (lexicographic).
            let Some(i) = (0..3).rev().find(|&i| order[i] < order[i + 1]) else { break };
            let j = (i + 1..4).rev().find(|&j| order[j] > order[i]).unwrap();
            order.swap(i, j);
            order[i + 1..].reverse();
        }
        assert_eq!(permutations, 24);
    }

    #[test]
    fn a_changed_byte_is_a_mismatch_naming_the_file_and_both_digests() {
        let bytes = data(3000);
        let check = whole(&bytes);
        let mut changed = bytes.clone();
        changed[2999] ^= 1;
        unsafe { check.landed(0, &changed) };
        assert!(check.has_failed());
        let err = check.finish().unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "f.safetensors: digest mismatch (bytes 0..3000): expected {}, got {} (m)",
                sha(&bytes),
                sha(&changed)
            )
        );
    }

    #[test]
    fn a_file_read_in_part_fails_a_whole_file_digest_and_one_not_read_passes() {
        let bytes = data(3000);
        let check = whole(&bytes);
        unsafe { check.landed(1000, &bytes[1000..2000]) };
        assert!(matches!(check.finish(), Err(Error::PartialVerify { .. })));
        assert!(whole(&bytes).finish().is_ok(), "nothing read, nothing handed out");
    }

    #[test]
    fn shards_are_checked_each_and_a_mismatch_names_its_range() {
        let bytes = data(3000);
        let shards = vec![
            Shard { start: 0, end: 1000, digest: sha(&bytes[..1000]) },
            Shard { start: 1000, end: 2000, digest: sha(&bytes[1000..2000]) },
            Shard { start: 2000, end: 3000, digest: sha(&bytes[2000..]) },
        ];
        let check = FileCheck::new(Path::new("f"), 3000, &Expected::Shards(shards.clone()), "m").unwrap();
        // Blocks across shard boundaries, out of order; the last shard only in part.
        unsafe {
            check.landed(500, &bytes[500..1500]);
            check.landed(0, &bytes[..500]);
            check.landed(1500, &bytes[1500..2100]);
        }
        assert!(check.finish().is_ok(), "shards read whole match; the one read in part is not checked");
        assert_eq!(check.bytes_to_read(&[(2500, 2600)]), Some((2100, 3000)));
        assert_eq!(check.bytes_to_read(&[(0, 100)]), None, "shard 0 is hashed");

        let mut changed = bytes.clone();
        changed[1500] ^= 0x80;
        let check = FileCheck::new(Path::new("f"), 3000, &Expected::Shards(shards.clone()), "m").unwrap();
        unsafe { check.landed(0, &changed) };
        let err = check.finish().unwrap_err().to_string();
        assert!(err.starts_with("f: digest mismatch (bytes 1000..2000)"), "{err}");

        let short = FileCheck::new(Path::new("f"), 2999, &Expected::Shards(shards), "m").err().unwrap();
        assert!(short.to_string().contains("expected a file of 3000 bytes, got one of 2999 bytes"), "{short}");
    }

    #[test]
    fn readers_on_many_threads_hash_every_byte_once() {
        use rayon::prelude::*;
        let bytes = data(1 << 20);
        for algorithm in ["sha256", "blake2", "blake3"] {
            let mut hasher = Algorithm::from_name(algorithm).unwrap().hasher();
            hasher.update(&bytes);
            let check =
                FileCheck::new(Path::new("f"), bytes.len() as u64, &Expected::Whole(hasher.finish()), "m").unwrap();
            bytes.par_chunks(4096).enumerate().for_each(|(i, block)| {
                if i % 3 == 0 {
                    check.landed_transient(i as u64 * 4096, block);
                } else {
                    unsafe { check.landed(i as u64 * 4096, block) };
                }
            });
            assert!(check.finish().is_ok(), "{algorithm}");
        }
    }
}
