//! Verified loads under faults of the source: a read that fails while the check waits for
//! earlier bytes, and a source that answers a second read of the same bytes differently.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::safetensors;
use sha2::Digest as _;

use fastsafetensors::load::stream::{StreamOptions, TensorStream};
use fastsafetensors::load::{plan_verified, Planned};
use fastsafetensors::plan::{Extent, IO_ALIGN};
use fastsafetensors::source::direct::{read_extent, BlockReader};
use fastsafetensors::source::{Capabilities, Identity, LocalFile, Source};
use fastsafetensors::verify::{manifest, Verifier};
use fastsafetensors::{Error, Result};

/// How a [`FaultySource`] misbehaves.
enum Fault {
    /// Reads at this offset fail, after a pause (so that the reads beside them land first).
    FailAt(u64),
    /// Bytes of the data served a second time come back with every bit flipped, as a server
    /// that answers a second ranged request for them differently would send them.
    LieOnRereads,
}

struct FaultySource {
    path: PathBuf,
    bytes: Vec<u8>,
    identity: Identity,
    fault: Fault,
    /// Every byte offset served so far, every read's offset, and how many bytes were served
    /// again.
    served: Mutex<(BTreeSet<u64>, Vec<u64>, usize)>,
}

impl FaultySource {
    fn new(bytes: Vec<u8>, fault: Fault) -> Arc<FaultySource> {
        let identity = Identity::File { len: bytes.len() as u64, modified: Some(SystemTime::UNIX_EPOCH) };
        let path = PathBuf::from("memory://model.safetensors");
        Arc::new(FaultySource { path, bytes, identity, fault, served: Mutex::new((BTreeSet::new(), Vec::new(), 0)) })
    }

    fn reads(&self) -> Vec<u64> {
        self.served.lock().unwrap().1.clone()
    }
}

impl Source for FaultySource {
    fn path(&self) -> &Path {
        &self.path
    }

    fn identity(&self) -> &Identity {
        &self.identity
    }

    fn current_identity(&self) -> Result<Identity> {
        Ok(self.identity.clone())
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        if let Fault::FailAt(at) = self.fault {
            if offset == at {
                std::thread::sleep(Duration::from_millis(200));
                return Err(Error::Io {
                    path: self.path.clone(),
                    op: "read",
                    source: std::io::Error::other("injected read error"),
                });
            }
        }
        let start = (offset as usize).min(self.bytes.len());
        let n = buf.len().min(self.bytes.len() - start);
        buf[..n].copy_from_slice(&self.bytes[start..start + n]);
        let mut served = self.served.lock().unwrap();
        served.1.push(offset);
        for (k, b) in buf[..n].iter_mut().enumerate() {
            let at = offset + k as u64;
            if !served.0.insert(at) {
                served.2 += 1;
                if matches!(self.fault, Fault::LieOnRereads) && at >= data_start(&self.bytes) {
                    *b ^= 0xff;
                }
            }
        }
        Ok(n)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { direct: false, mmap: false, gds: false }
    }

    fn local(&self) -> Option<&LocalFile> {
        None
    }
}

fn data_start(file: &[u8]) -> u64 {
    8 + u64::from_le_bytes(file[..8].try_into().unwrap())
}

/// A file of tensors whose sizes are not whole pages (so that consecutive reads share pages),
/// and a verifier holding its sha256.
fn file_and_verifier() -> (Vec<u8>, Verifier) {
    let specs: Vec<(String, [u64; 1])> = (0..24).map(|i| (format!("t{i}"), [1000 + 37 * i])).collect();
    let tensors: Vec<(&str, &str, &[u64])> = specs.iter().map(|(n, s)| (n.as_str(), "F32", &s[..])).collect();
    let bytes = safetensors(&tensors, 8);
    let digest = format!("{:x}", sha2::Sha256::digest(&bytes));
    let digests = BTreeMap::from([("model.safetensors".to_owned(), digest)]);
    (bytes, Verifier::new(manifest::from_digests(&digests).unwrap(), false))
}

fn planned(src: &Arc<FaultySource>, verifier: &Verifier) -> Planned {
    let src: Arc<dyn Source> = Arc::clone(src) as Arc<dyn Source>;
    plan_verified(vec![src], Some(verifier)).unwrap()
}

/// A block read after a gap waits in the check, in the extent's buffer; when the read of
/// another block of the extent fails, the load gives up, but the check still holds the bytes
/// it will hash once the gap is filled (by another extent sharing the page): they must still
/// be there (before, the buffer was unmapped under them).
#[test]
fn a_failed_read_leaves_the_bytes_the_check_waits_on_alive() {
    let (bytes, verifier) = file_and_verifier();
    let len = bytes.len() as u64;
    let extent_start = 2 * IO_ALIGN;
    let fail_at = extent_start + 2 * IO_ALIGN;
    let src = FaultySource::new(bytes.clone(), Fault::FailAt(fail_at));
    let planned = planned(&src, &verifier);
    let check = &planned.checks.files[0];
    let reader = BlockReader::open(Arc::clone(&src) as Arc<dyn Source>, false).unwrap();
    let expected = len - extent_start;
    let extent =
        Extent { file: 0, start: extent_start, len: expected.next_multiple_of(IO_ALIGN), expected, tensors: 0..0 };
    let err = read_extent(&reader, &extent, 2 * IO_ALIGN, Some(check)).err().expect("the read fails");
    assert!(err.to_string().contains("injected read error"), "{err}");
    assert!(src.reads().contains(&extent_start), "the block after the gap was read and waits in the check");
    // Another extent brings the bytes before it (and those the failed read did not).
    check.landed_transient(0, &bytes[..extent_start as usize]);
    check.landed_transient(fail_at, &bytes[fail_at as usize..]);
    check.finish().expect("every byte hashed is the file's");
}

/// A verified stream over a source that answers a second read of the same bytes differently:
/// consecutive groups share a page, and whichever copy of it a tensor comes from, it must be
/// the copy hashed or one compared with it. The stream fails naming the bytes, or hands out
/// exactly the file's tensors.
#[test]
fn a_stream_hands_out_no_second_copy_unlike_the_first() {
    let (bytes, verifier) = file_and_verifier();
    let honest = FaultySource::new(bytes.clone(), Fault::FailAt(u64::MAX));
    let lying = FaultySource::new(bytes, Fault::LieOnRereads);
    // One group in memory at a time: each group is read whole before the next, so the copy of
    // a shared page that lands second is the later group's, the one its tensors come from.
    let options = StreamOptions { block: IO_ALIGN, group: 4 * IO_ALIGN, ..StreamOptions::with_budget(4 * IO_ALIGN) };
    let drain = |src: &Arc<FaultySource>| -> Result<BTreeMap<String, Vec<u8>>> {
        let mut stream = TensorStream::open(planned(src, &verifier), options.clone())?;
        let mut out = BTreeMap::new();
        while let Some(group) = stream.next_group()? {
            for t in &group.tensors {
                out.insert(t.name.clone(), group.bytes(t).to_vec());
            }
        }
        Ok(out)
    };
    let expected = drain(&honest).unwrap();
    assert_eq!(expected.len(), 24);
    assert!(honest.served.lock().unwrap().2 > 0, "groups share pages, read twice");
    match drain(&lying) {
        Ok(got) => {
            let wrong: Vec<&String> = expected.keys().filter(|n| got.get(*n) != expected.get(*n)).collect();
            assert!(wrong.is_empty(), "tensors {wrong:?} came from bytes never hashed");
        }
        Err(e) => assert!(matches!(e, Error::CopiesDiffer { .. } | Error::DigestMismatch { .. }), "{e}"),
    }
    assert!(lying.served.lock().unwrap().2 > 0, "the source lied");
}
