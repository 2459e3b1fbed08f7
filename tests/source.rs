//! The source seam: a load from a source that is not a local file (bytes in memory here, as
//! an object store's would be) plans, reads, streams and stages exactly as a file does, through
//! nothing but `Source::read_at`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::{safetensors, TempDir};

use fastsafetensors::device::staged::{copy_files, StagedFile};
use fastsafetensors::device::{HostMemoryDevice, StagingOptions};
use fastsafetensors::load::stream::{StreamOptions, TensorStream};
use fastsafetensors::load::{plan_files, plan_sources, LoadOptions};
use fastsafetensors::source::direct::BlockReader;
use fastsafetensors::source::{Capabilities, Identity, LocalFile, ReadPath, ReaderKind, Source};
use fastsafetensors::{Error, Result};

/// A source held in memory, whose version can be bumped to stand for a replaced object.
struct MemorySource {
    path: PathBuf,
    bytes: Vec<u8>,
    identity: Identity,
    replaced: AtomicBool,
    /// Where each read is written down (this source's number), if anywhere.
    log: Option<(usize, Arc<Mutex<Vec<usize>>>)>,
}

impl MemorySource {
    fn new(name: &str, bytes: Vec<u8>) -> Arc<MemorySource> {
        Arc::new(Self::unlogged(name, bytes))
    }

    fn unlogged(name: &str, bytes: Vec<u8>) -> MemorySource {
        let identity = Identity::File { len: bytes.len() as u64, modified: Some(SystemTime::UNIX_EPOCH) };
        MemorySource { path: PathBuf::from(name), bytes, identity, replaced: AtomicBool::new(false), log: None }
    }

    /// A source that writes `number` into `log` at each read.
    fn logged(name: &str, bytes: Vec<u8>, number: usize, log: &Arc<Mutex<Vec<usize>>>) -> Arc<MemorySource> {
        Arc::new(MemorySource { log: Some((number, Arc::clone(log))), ..Self::unlogged(name, bytes) })
    }
}

impl Source for MemorySource {
    fn path(&self) -> &Path {
        &self.path
    }

    fn identity(&self) -> &Identity {
        &self.identity
    }

    fn current_identity(&self) -> Result<Identity> {
        let secs = u64::from(self.replaced.load(Ordering::Relaxed));
        let modified = SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
        Ok(Identity::File { len: self.bytes.len() as u64, modified: Some(modified) })
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        if let Some((number, log)) = &self.log {
            log.lock().unwrap().push(*number);
        }
        let start = (offset as usize).min(self.bytes.len());
        let n = buf.len().min(self.bytes.len() - start);
        buf[..n].copy_from_slice(&self.bytes[start..start + n]);
        Ok(n)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { direct: false, mmap: false, gds: false }
    }

    fn local(&self) -> Option<&LocalFile> {
        None
    }
}

const TENSORS: &[(&str, &str, &[u64])] = &[("a", "F32", &[1000, 3]), ("b", "BF16", &[4097]), ("c", "U8", &[5])];

/// Each tensor's bytes as the file holds them, by name.
fn reference(dir: &TempDir, bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let path = dir.write("reference.safetensors", bytes);
    let loaded = plan_files(&[path]).unwrap().read_to_host(&LoadOptions::default()).unwrap();
    loaded.tensors.iter().map(|t| (t.name.clone(), loaded.bytes(t).to_vec())).collect()
}

#[test]
fn a_load_from_a_source_in_memory_reads_it_through_read_at() {
    let dir = TempDir::new("source-load");
    let bytes = safetensors(TENSORS, 8);
    let expected = reference(&dir, &bytes);
    for reader in [ReaderKind::Auto, ReaderKind::Direct, ReaderKind::Mmap] {
        let src: Arc<dyn Source> = MemorySource::new("memory://model.safetensors", bytes.clone());
        let planned = plan_sources(vec![src]).unwrap();
        let loaded = planned.read_to_host(&LoadOptions { reader, block: 4096, ..Default::default() }).unwrap();
        // Neither O_DIRECT nor a mapping applies: the source's own reads.
        assert_eq!(loaded.read_paths(), [ReadPath::Buffered], "{reader:?}");
        let got: Vec<_> = loaded.tensors.iter().map(|t| (t.name.clone(), loaded.bytes(t).to_vec())).collect();
        assert_eq!(got, expected, "{reader:?}");
    }
}

#[test]
fn a_stream_from_a_source_in_memory_hands_out_every_tensor() {
    let dir = TempDir::new("source-stream");
    let bytes = safetensors(TENSORS, 8);
    let expected = reference(&dir, &bytes);
    let src: Arc<dyn Source> = MemorySource::new("memory://model.safetensors", bytes);
    let mut stream =
        TensorStream::open(plan_sources(vec![src]).unwrap(), StreamOptions::with_budget(16 << 10)).unwrap();
    let mut got = Vec::new();
    while let Some(group) = stream.next_group().unwrap() {
        got.extend(group.tensors.iter().map(|t| (t.name.clone(), group.bytes(t).to_vec())));
    }
    assert_eq!(got, expected);
}

/// A stream of several files reads ahead in the next ones while the consumer is on the first
/// (a disk serves several sequential streams faster than one), and still hands out every
/// tensor in file order.
#[test]
fn a_stream_reads_later_files_while_the_first_is_read() {
    let dir = TempDir::new("source-lanes");
    let log = Arc::new(Mutex::new(Vec::new()));
    let mut sources: Vec<Arc<dyn Source>> = Vec::new();
    let mut expected = Vec::new();
    for f in 0..4 {
        let names: Vec<String> = (0..40).map(|i| format!("f{f}.t{i}")).collect();
        let tensors: Vec<(&str, &str, &[u64])> = names.iter().map(|n| (n.as_str(), "U8", &[10_000u64][..])).collect();
        let bytes = safetensors(&tensors, 8);
        expected.extend(reference(&dir, &bytes));
        sources.push(MemorySource::logged(&format!("memory://f{f}.safetensors"), bytes, f, &log));
    }
    // Files of 400 KB, a budget of 128 KiB (groups of 32 KiB): in file order alone, the next
    // files would be read only once file 0's last group is.
    let options = StreamOptions { block: 4096, ..StreamOptions::with_budget(128 << 10) };
    let planned = plan_sources(sources).unwrap();
    log.lock().unwrap().clear(); // the headers' reads
    let mut stream = TensorStream::open(planned, options).unwrap();
    let mut got = Vec::new();
    while let Some(group) = stream.next_group().unwrap() {
        got.extend(group.tensors.iter().map(|t| (t.name.clone(), group.bytes(t).to_vec())));
    }
    assert_eq!(got, expected, "every tensor, in file order");
    let log = log.lock().unwrap();
    let first_of_others = log.iter().position(|&f| f > 0).expect("the other files were read");
    let last_of_first = log.iter().rposition(|&f| f == 0).expect("file 0 was read");
    assert!(first_of_others < last_of_first, "the next files read only after file 0: {log:?}");
}

#[test]
fn the_staged_device_path_reads_a_source_in_memory() {
    let bytes = safetensors(TENSORS, 8);
    let src: Arc<dyn Source> = MemorySource::new("memory://model.safetensors", bytes.clone());
    let reader = BlockReader::open(Arc::clone(&src), true).unwrap();
    // Device memory starts at address 0 in the stand-in.
    let device = HostMemoryDevice::new(bytes.len().next_multiple_of(4096));
    let paths =
        copy_files(&device, &[StagedFile::whole(&reader, 0)], &StagingOptions { block: 8192, slots: 2 }).unwrap();
    assert_eq!(paths, [ReadPath::Buffered]);
    assert_eq!(&device.memory()[..bytes.len()], &bytes[..]);
}

#[test]
fn a_source_replaced_during_a_load_is_an_error_naming_it() {
    let bytes = safetensors(TENSORS, 8);
    let src = MemorySource::new("memory://model.safetensors", bytes);
    let planned = plan_sources(vec![Arc::clone(&src) as Arc<dyn Source>]).unwrap();
    src.replaced.store(true, Ordering::Relaxed);
    match planned.read_to_host(&LoadOptions::default()) {
        Err(Error::Changed { path, .. }) => assert_eq!(path, Path::new("memory://model.safetensors")),
        other => panic!("expected Changed, got {:?}", other.map(|l| l.read_paths())),
    }
}

#[test]
fn fingerprints_tell_apart_files_of_one_layout_and_agree_on_copies() {
    let dir = TempDir::new("source-fingerprint");
    let bytes = safetensors(TENSORS, 8);
    let file = LocalFile::open(&dir.write("model.safetensors", &bytes)).unwrap();
    let fingerprint = file.fingerprint().unwrap();
    // The same bytes elsewhere (a copy, another mtime, held in memory): the same fingerprint.
    assert_eq!(MemorySource::new("copy", bytes.clone()).fingerprint().unwrap(), fingerprint);
    // Another fine-tune of the same layout: a value changed in a sampled page of the data
    // (the first and the last are), or in the header.
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    for at in [header_end, bytes.len() - 1, 10] {
        let mut other = bytes.clone();
        other[at] ^= 1;
        assert_ne!(MemorySource::new("other", other).fingerprint().unwrap(), fingerprint, "byte {at} flipped");
    }
    // A size of its own.
    assert_ne!(MemorySource::new("short", bytes[..bytes.len() - 1].to_vec()).fingerprint().unwrap(), fingerprint);
    // Sources too small to hold a header still have one.
    assert_eq!(MemorySource::new("tiny", vec![1, 2]).fingerprint().unwrap().len(), 64);
}
