//! The per-file check the readers feed: blocks land in any order, in buffers the load owns,
//! and are hashed in file order by whichever reader completes the next bytes, while the other
//! readers go on reading. Files (and a sharded manifest's shards) are checked independently,
//! so they hash in parallel.
//!
//! Bytes that land twice (two extents or two stream groups sharing a page) are hashed once and
//! the other copy is compared with the bytes hashed: whichever copy a tensor is handed out
//! from holds the bytes the digest covers. The header is part of every check: a load of any
//! of a file's data must check the digests that cover `[0, data start)`, since the header
//! places every tensor.

use std::collections::BTreeMap;
use std::ops::Range;
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
    /// What the load was given (files, directories, indexes, prefixes): each is checked as a
    /// whole (`load::checkpoint::check_verified`): a listed index hashed, a directory's listed
    /// weights files all loaded (a file missing would leave the model short, silently).
    pub checkpoints: Vec<PathBuf>,
}

impl Verifier {
    pub fn new(manifest: Manifest, full: bool) -> Verifier {
        Verifier { manifest: Arc::new(manifest), full, checkpoints: Vec::new() }
    }

    /// The check of the file at `path` (what the manifest's names are matched against),
    /// whose header is `header`: its header bytes are hashed at once (those parsed, not a
    /// second read of them), its data as the load's reads land.
    pub fn check_for(&self, path: &Path, header: &Header) -> Result<Arc<FileCheck>> {
        let shown = path.to_string_lossy();
        let Some((_, expected)) = self.manifest.entry_for(&shown) else {
            return Err(Error::NotInManifest { path: path.to_owned(), manifest: self.manifest.origin.clone() });
        };
        let mut check = FileCheck::new(path, header.file_len(), expected, &self.manifest.origin)?;
        check.header_end = header.data_start;
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
    /// Where the header ends: bytes below are the header parsed (and hashed as parsed), which
    /// no tensor is handed out from, so their later copies are not compared.
    header_end: u64,
    /// Whether the load said which bytes it hands out ([`FileCheck::hand_out`]): then only
    /// the digests covering them (and the header) must pass; else every digest any read
    /// touched must.
    told: AtomicBool,
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
    /// Blocks landed and not yet hashed or compared, by (start, end, arrival).
    pending: BTreeMap<(u64, u64, u64), Block>,
    /// The blocks of the run being hashed (taken out of `pending`, not yet hashed): a reader
    /// whose bytes are among them waits until they are.
    in_run: Vec<(u64, u64, u64)>,
    arrivals: u64,
    hasher: Option<Hasher>,
    /// The last bytes hashed (up to [`TAIL`], ending at `hashed`): what a later copy of them is
    /// compared with. Taken with the hasher by the reader hashing.
    tail: Option<Vec<u8>>,
    /// The first bytes that landed twice and differ (or could not be compared), and why.
    conflict: Option<(Range<u64>, &'static str)>,
    /// A reader is hashing (others only queue their blocks).
    hashing: bool,
    /// Whether any of the data was read.
    touched: bool,
    /// Whether the load hands out bytes it covers (or it covers the header of a file the load
    /// hands out bytes of).
    needed: bool,
    /// Set once every byte is hashed: the digest, if it is not the one expected.
    outcome: Option<std::result::Result<(), Digest>>,
}

/// Bytes kept of what was hashed last, to compare a second copy with. Copies overlap by less
/// than a page (extents and stream groups share at most the page where one ends and the next
/// begins); this leaves room for alignments up to 64 KiB.
const TAIL: usize = 64 << 10;

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
                in_run: Vec::new(),
                arrivals: 0,
                hasher: Some(expected.algorithm.hasher()),
                tail: Some(Vec::new()),
                conflict: None,
                hashing: false,
                touched: false,
                needed: false,
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
            header_end: 0,
            told: AtomicBool::new(false),
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

    /// What the file must hash to, in one line: `sha256:…` for a digest of the whole file, or
    /// each shard's `start-end=sha256:…`, comma-separated (what a kept entry is verified against).
    pub fn expected(&self) -> String {
        if self.whole {
            return self.segments.iter().map(|s| s.expected.to_string()).collect();
        }
        let shards: Vec<String> =
            self.segments.iter().map(|s| format!("{}-{}={}", s.start, s.end, s.expected)).collect();
        shards.join(",")
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

    /// Queues a block and hashes (or compares) what is contiguous, unless another reader is:
    /// returns whether the segment turned out wrong.
    fn feed_segment(&self, seg: &Segment, start: u64, part: &[u8], keep: Option<Keep>) -> bool {
        let end = start + part.len() as u64;
        let transient = matches!(keep, Some(Keep::Copy));
        let mut st = seg.lock();
        st.touched = true;
        if part.is_empty() {
            return false;
        }
        let block = match keep {
            Some(Keep::Buffer(buffer)) => Block::Kept(Arc::clone(buffer), part.as_ptr(), part.len()),
            _ => Block::Borrowed(part.as_ptr(), part.len()),
        };
        let key = (start, end, st.arrivals);
        st.arrivals += 1;
        st.pending.insert(key, block);
        if !st.hashing {
            st.hashing = true;
            st = self.hash_contiguous(seg, st);
        } else if transient && start <= st.claimed {
            // The reader hashing will reach it next: the bytes must stay until it has hashed
            // (or compared) them, not only taken them.
            while (st.pending.contains_key(&key) || st.in_run.contains(&key)) && st.hashing {
                st = seg.progress.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
        if transient {
            if let Some(b) = st.pending.get_mut(&key) {
                *b = Block::Owned(part.to_vec());
            }
        }
        matches!(st.outcome, Some(Err(_))) || st.conflict.is_some()
    }

    /// Hashes the landed blocks that continue the hashed bytes, the lock released while it
    /// does, until a gap or the end; then lets others hash again. The part of a block below
    /// the bytes already claimed is a second copy: it is compared with the copy hashed.
    fn hash_contiguous<'a>(&self, seg: &'a Segment, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        loop {
            let mut run = Vec::new();
            let from = st.claimed;
            let st_ref = &mut *st;
            while let Some(entry) = st_ref.pending.first_entry() {
                let key @ (start, end, _) = *entry.key();
                if start > st_ref.claimed {
                    break;
                }
                run.push((start, entry.remove()));
                st_ref.in_run.push(key);
                st_ref.claimed = st_ref.claimed.max(end);
            }
            if run.is_empty() {
                st.hashing = false;
                seg.progress.notify_all();
                return st;
            }
            let upto = st.claimed;
            // None once every byte is hashed: what lands after is only compared.
            let mut hasher = st.hasher.take();
            let mut tail = st.tail.take().expect("the tail goes with the hasher");
            drop(st);
            // This run's hashed bytes by file offset: what later copies in it are compared with
            // (those before it, with the tail, which ends at `from`).
            let mut hashed: Vec<(u64, &[u8])> = Vec::with_capacity(run.len());
            let mut at = from;
            let mut conflict = None;
            for (start, block) in &run {
                let bytes = block.bytes();
                let seen = ((at.saturating_sub(*start)) as usize).min(bytes.len());
                if conflict.is_none() {
                    conflict = compare(&tail, from, &hashed, *start, &bytes[..seen], self.header_end);
                }
                let new = &bytes[seen..];
                if let Some(hasher) = hasher.as_mut() {
                    hasher.update(new);
                }
                hashed.push((start + seen as u64, new));
                at = at.max(start + bytes.len() as u64);
            }
            hashed.iter().for_each(|(_, new)| keep_tail(&mut tail, new));
            drop(hashed);
            drop(run);
            st = seg.lock();
            st.in_run.clear();
            st.hashed = upto;
            st.tail = Some(tail);
            if st.conflict.is_none() {
                st.conflict = conflict;
            }
            match hasher {
                Some(hasher) if upto == seg.end => {
                    let actual = hasher.finish();
                    st.outcome = Some(if actual == seg.expected { Ok(()) } else { Err(actual) });
                }
                hasher => st.hasher = hasher,
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
    /// says: every digest whose bytes were read in whole or in part must have been checked and
    /// match, and so must those covering the header where any of the data was read (the
    /// header places every tensor). Digests of bytes not read at all are not checked: nothing
    /// of them is handed out.
    pub fn finish(&self) -> Result<()> {
        let told = self.told.load(Ordering::Relaxed);
        let data_read = self.segments.iter().any(|s| s.lock().touched);
        for seg in &self.segments {
            let mut st = seg.lock();
            while st.hashing {
                st = seg.progress.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            if let Some((range, why)) = &st.conflict {
                return Err(Error::CopiesDiffer {
                    path: self.path.clone(),
                    start: range.start,
                    end: range.end,
                    why: (*why).to_owned(),
                });
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
                // Bytes read only to fill an aligned read (past the last byte handed out) are
                // not handed out: their digest need not pass.
                None if told && !st.needed => {}
                None if self.whole && (data_read || st.needed) => {
                    return Err(Error::PartialVerify { path: self.path.clone(), manifest: self.origin.clone() })
                }
                None if st.needed || st.touched || (data_read && seg.start < self.header_end) => {
                    return Err(Error::UncheckedBytes {
                        path: self.path.clone(),
                        start: seg.start,
                        end: seg.end,
                        manifest: self.origin.clone(),
                    })
                }
                None => {}
            }
        }
        Ok(())
    }

    /// The load hands out the bytes `ranges` of this file (tensors' bytes; an empty range
    /// for a tensor of no bytes, whose shape the header gives all the same): the digests
    /// covering them and the header are the ones that must pass (those of bytes read only to
    /// fill an aligned read need not). Returns what must still be read for them to be checked
    /// ([`FileCheck::bytes_to_read`]).
    pub fn hand_out(&self, ranges: &[(u64, u64)]) -> Option<(u64, u64)> {
        if ranges.is_empty() {
            return None;
        }
        self.told.store(true, Ordering::Relaxed);
        for seg in self.segments.iter().filter(|s| self.covers_any(s, ranges)) {
            seg.lock().needed = true;
        }
        self.bytes_to_read(ranges)
    }

    fn covers_any(&self, seg: &Segment, ranges: &[(u64, u64)]) -> bool {
        seg.start < self.header_end || ranges.iter().any(|&(a, b)| a < b && a < seg.end && seg.start < b)
    }

    /// The bytes a load must still read for every digest that covers any of `wanted` (byte
    /// ranges the load hands out), or the header, to be checked: from the first byte not yet
    /// hashed (the header is, from the start) to the end of the last such digest; `None` if
    /// none (or nothing is wanted).
    pub fn bytes_to_read(&self, wanted: &[(u64, u64)]) -> Option<(u64, u64)> {
        if wanted.is_empty() {
            return None;
        }
        let mut span: Option<(u64, u64)> = None;
        for seg in self.segments.iter().filter(|s| self.covers_any(s, wanted)) {
            let from = seg.lock().claimed;
            if from < seg.end {
                span = Some(span.map_or((from, seg.end), |(a, b)| (a.min(from), b.max(seg.end))));
            }
        }
        span
    }

    /// The last boundary between digests (or the file's end) at or before `offset`: a read
    /// ending at `offset` reads every digest it covers whole up to there.
    pub fn digest_boundary_before(&self, offset: u64) -> u64 {
        self.segments.iter().map(|s| s.end).filter(|&e| e <= offset).max().unwrap_or(0)
    }
}

/// Compares `copy`, bytes read again from `start` on, with the copy hashed: those before
/// `from` with `tail` (the last bytes hashed before it), the others with `hashed` (the bytes
/// hashed since, by offset). Bytes below `header_end` (the header, hashed as parsed) are not
/// compared. `None` where they agree, else the range and why.
fn compare(
    tail: &[u8],
    from: u64,
    hashed: &[(u64, &[u8])],
    start: u64,
    copy: &[u8],
    header_end: u64,
) -> Option<(Range<u64>, &'static str)> {
    let skip = (header_end.saturating_sub(start) as usize).min(copy.len());
    let (start, copy) = (start + skip as u64, &copy[skip..]);
    let end = start + copy.len() as u64;
    let range = start..end;
    // The part before `from`, against the tail.
    if start < from {
        let n = (from.min(end) - start) as usize;
        let back = (from - start) as usize;
        if back > tail.len() {
            return Some((range, "too far apart to compare"));
        }
        if tail[tail.len() - back..tail.len() - back + n] != copy[..n] {
            return Some((range, DIFFER));
        }
    }
    // The rest, against each run of bytes hashed since that it overlaps.
    for &(at, bytes) in hashed {
        let (a, b) = (at.max(start).max(from), (at + bytes.len() as u64).min(end));
        if a < b && bytes[(a - at) as usize..(b - at) as usize] != copy[(a - start) as usize..(b - start) as usize] {
            return Some((range, DIFFER));
        }
    }
    None
}

const DIFFER: &str = "differ (the file changed while it was read)";

/// `tail` followed by `bytes`, cut to its last [`TAIL`] bytes.
fn keep_tail(tail: &mut Vec<u8>, bytes: &[u8]) {
    if bytes.len() >= TAIL {
        tail.clear();
        tail.extend_from_slice(&bytes[bytes.len() - TAIL..]);
    } else {
        let drop = (tail.len() + bytes.len()).saturating_sub(TAIL);
        tail.drain(..drop);
        tail.extend_from_slice(bytes);
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
        assert_eq!(check.bytes_to_read(&[(2500, 2600)]), Some((2100, 3000)));
        assert_eq!(check.bytes_to_read(&[(0, 100)]), None, "shard 0 is hashed");
        // A shard read in part never passes: what was read of it is unchecked.
        let err = check.finish().unwrap_err();
        assert!(matches!(err, Error::UncheckedBytes { start: 2000, end: 3000, .. }), "{err}");
        unsafe { check.landed(2100, &bytes[2100..]) };
        assert!(check.finish().is_ok(), "every shard read is read whole and matches");

        let mut changed = bytes.clone();
        changed[1500] ^= 0x80;
        let check = FileCheck::new(Path::new("f"), 3000, &Expected::Shards(shards.clone()), "m").unwrap();
        unsafe { check.landed(0, &changed) };
        let err = check.finish().unwrap_err().to_string();
        assert!(err.starts_with("f: digest mismatch (bytes 1000..2000)"), "{err}");

        let short = FileCheck::new(Path::new("f"), 2999, &Expected::Shards(shards), "m").err().unwrap();
        assert!(short.to_string().contains("expected a file of 3000 bytes, got one of 2999 bytes"), "{short}");
    }

    fn shards(bytes: &[u8], size: usize) -> Expected {
        let shards = (0..bytes.len())
            .step_by(size)
            .map(|a| {
                let b = (a + size).min(bytes.len());
                Shard { start: a as u64, end: b as u64, digest: sha(&bytes[a..b]) }
            })
            .collect();
        Expected::Shards(shards)
    }

    /// A check of a file whose header ends at `header_end`, its header already hashed (as
    /// `Verifier::check_for` does).
    fn with_header(bytes: &[u8], expected: &Expected, header_end: usize) -> FileCheck {
        let mut check = FileCheck::new(Path::new("f"), bytes.len() as u64, expected, "m").unwrap();
        check.header_end = header_end as u64;
        check.landed_transient(0, &bytes[..header_end]);
        check.segments.iter().for_each(|s| s.lock().touched = false);
        check
    }

    /// The header places every tensor: a load of data in shard 2 checks shard 0 too, where the
    /// header is, and fails if it was not read whole.
    #[test]
    fn a_load_of_any_data_checks_the_shards_holding_the_header() {
        let bytes = data(3000);
        let expected = shards(&bytes, 1000);
        let check = with_header(&bytes, &expected, 300);
        assert_eq!(check.bytes_to_read(&[(2100, 2200)]), Some((300, 3000)), "the header's shard is read");
        assert_eq!(check.bytes_to_read(&[]), None, "nothing wanted, nothing read");
        unsafe { check.landed(2000, &bytes[2000..]) };
        let err = check.finish().unwrap_err();
        assert!(matches!(err, Error::UncheckedBytes { start: 0, end: 1000, .. }), "{err}");
        // A header edited in place (same length: data offsets swapped) fails its shard.
        let mut edited = bytes.clone();
        edited[100] ^= 1;
        let check = with_header(&edited, &expected, 300);
        unsafe {
            check.landed(300, &edited[300..1000]);
            check.landed(2000, &edited[2000..]);
        }
        assert!(matches!(check.finish(), Err(Error::DigestMismatch { start: 0, end: 1000, .. })));
        // A header longer than a shard: every shard it covers is checked.
        let check = with_header(&bytes, &expected, 1500);
        assert_eq!(check.bytes_to_read(&[(2500, 2600)]), Some((1500, 3000)));
        // Nothing of the data read: nothing handed out, nothing to check.
        assert!(with_header(&bytes, &expected, 300).finish().is_ok());
    }

    /// A load says which bytes it hands out: the digests covering them and the header must
    /// pass; one read only to fill the last aligned read need not, and is not read whole.
    #[test]
    fn digests_of_bytes_handed_out_must_pass_and_those_of_padding_need_not() {
        let bytes = data(3000);
        let expected = shards(&bytes, 1000);
        let check = with_header(&bytes, &expected, 300);
        // Tensor bytes in shard 1; an aligned read of them spills into shard 2.
        assert_eq!(check.hand_out(&[(1100, 1900)]), Some((300, 2000)), "the header's shard and shard 1");
        unsafe { check.landed(300, &bytes[300..2100]) };
        assert!(check.finish().is_ok(), "shard 2 was read in part, and nothing of it is handed out");
        // Shard 1 read in part: it holds bytes handed out.
        let check = with_header(&bytes, &expected, 300);
        check.hand_out(&[(1100, 1900)]);
        unsafe { check.landed(300, &bytes[300..1950]) };
        assert!(matches!(check.finish(), Err(Error::UncheckedBytes { start: 1000, end: 2000, .. })));
        // A tensor of no bytes still needs the header's shard.
        let check = with_header(&bytes, &expected, 300);
        assert_eq!(check.hand_out(&[(2500, 2500)]), Some((300, 1000)));
        assert!(matches!(check.finish(), Err(Error::UncheckedBytes { start: 0, end: 1000, .. })));
        assert_eq!(check.digest_boundary_before(2100), 2000);
        assert_eq!(check.digest_boundary_before(999), 0);
    }

    /// Bytes that land twice: the copy not hashed is compared with the copy hashed, whichever
    /// lands first, however the blocks overlap; a copy that differs fails the file.
    #[test]
    fn a_second_copy_of_bytes_is_compared_with_the_first() {
        let bytes = data(20_000);
        let expected = Expected::Whole(sha(&bytes));
        // (first block, second block): overlapping by a page, one inside the other, equal.
        let cases = [((0, 8192), (4096, 20_000)), ((0, 20_000), (5000, 6000)), ((0, 20_000), (0, 20_000))];
        for ((a0, a1), (b0, b1)) in cases {
            for second_first in [false, true] {
                for flip in [None, Some(b0.max(a0)), Some(b1.min(a1) - 1)] {
                    let mut other = bytes.clone();
                    if let Some(at) = flip {
                        other[at] ^= 0x40;
                    }
                    let check = FileCheck::new(Path::new("f"), 20_000, &expected, "m").unwrap();
                    let first = || unsafe { check.landed(a0 as u64, &bytes[a0..a1]) };
                    let second = || unsafe { check.landed(b0 as u64, &other[b0..b1]) };
                    if second_first {
                        second();
                        first();
                    } else {
                        first();
                        second();
                    }
                    // The rest of the file, once.
                    unsafe { check.landed(a1 as u64, &bytes[a1..]) };
                    let outcome = check.finish();
                    let case = format!("{:?} then {:?}, flip {flip:?}", (a0, a1), (b0, b1));
                    match flip {
                        None => assert!(outcome.is_ok(), "{case}: {outcome:?}"),
                        // The copy hashed is `other` where it lands first and covers the byte.
                        Some(_) => assert!(
                            matches!(outcome, Err(Error::CopiesDiffer { .. } | Error::DigestMismatch { .. })),
                            "{case}: {outcome:?}"
                        ),
                    }
                }
            }
        }
    }

    #[test]
    fn copies_of_the_header_are_not_compared_and_copies_too_far_apart_fail() {
        let bytes = data(300_000);
        let expected = Expected::Whole(sha(&bytes));
        // The header is hashed as parsed; the copy a data read brings of it is never handed out.
        let check = with_header(&bytes, &expected, 500);
        let mut other = bytes.clone();
        other[10] ^= 1;
        unsafe { check.landed(0, &other) };
        assert!(check.finish().is_ok());
        // A copy of bytes hashed long before (past what is kept to compare) fails, never passes.
        let check = with_header(&bytes, &expected, 500);
        unsafe {
            check.landed(0, &bytes);
            check.landed(1000, &bytes[1000..2000]);
        }
        let err = check.finish().unwrap_err().to_string();
        assert_eq!(err, "f: bytes 1000..2000 were read twice and the copies too far apart to compare");
    }

    /// A block waiting for earlier bytes keeps its buffer: the reader's reference may go (a
    /// read of the same extent failed) and the bytes are still there to hash.
    #[test]
    fn a_waiting_block_keeps_its_buffer_alive() {
        let bytes = data(3 * 4096);
        let check = FileCheck::new(Path::new("f"), bytes.len() as u64, &Expected::Whole(sha(&bytes)), "m").unwrap();
        let mut map = memmap2::MmapMut::map_anon(4096).unwrap();
        map.copy_from_slice(&bytes[4096..8192]);
        let buffer = Arc::new(HostBuffer::new(map, crate::source::ReadPath::Direct));
        check.landed_in(4096, &buffer, 0, 4096);
        let weak = Arc::downgrade(&buffer);
        drop(buffer);
        assert!(weak.upgrade().is_some(), "the check holds the buffer");
        check.landed_transient(0, &bytes[..4096]);
        assert!(weak.upgrade().is_none(), "hashed, and let go");
        check.landed_transient(8192, &bytes[8192..]);
        assert!(check.finish().is_ok());
    }

    /// A staging slot is reused as soon as `landed_transient` returns: whatever order the
    /// blocks land in, and whichever reader hashes them, they are hashed (or copied) first.
    #[test]
    fn transient_bytes_are_hashed_before_their_buffer_is_reused() {
        use rayon::prelude::*;
        let bytes = data(2 << 20);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(8).build().unwrap();
        for round in 0..30 {
            let check = whole(&bytes);
            pool.install(|| {
                bytes.par_chunks(4096).enumerate().for_each(|(i, block)| {
                    let mut slot = block.to_vec();
                    check.landed_transient(i as u64 * 4096, &slot);
                    slot.fill(0xAA);
                    std::hint::black_box(&slot);
                })
            });
            assert!(check.finish().is_ok(), "round {round}: bytes of a reused slot were hashed");
        }
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
