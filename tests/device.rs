//! The device paths without a GPU: the staged pipeline against the host-memory stand-in,
//! and the GPUDirect Storage reader against a fake cuFile that records its calls, checks
//! what a real one needs, and writes into the stand-in's memory.

mod common;

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use common::{safetensors, TempDir};
use fastsafetensors::device::cufile::{CuFileApi, FileHandle};
use fastsafetensors::device::gds::{GdsMode, GdsOptions};
use fastsafetensors::device::StagingOptions;
use fastsafetensors::device::{Device, HostMemoryDevice};
use fastsafetensors::load::{plan_files, DeviceCopy, DeviceOptions, DeviceTarget, Planned};
use fastsafetensors::source::{ReadPath, ReaderKind};
use fastsafetensors::Error;

const NO_CUFILE: Result<&FakeCuFile, &str> = Err("not on this machine");

/// Two files whose sizes are not multiples of the block size.
fn checkpoint(dir: &TempDir) -> (Vec<PathBuf>, Vec<Vec<u8>>) {
    let files = vec![
        safetensors(&[("a", "BF16", &[1000, 37]), ("b", "F32", &[333])], 8),
        safetensors(&[("c", "I8", &[12345]), ("d", "F64", &[7, 3])], 8),
    ];
    write_all(dir, files)
}

/// One file of many blocks (1 MiB of data).
fn big_checkpoint(dir: &TempDir) -> (Vec<PathBuf>, Vec<Vec<u8>>) {
    write_all(dir, vec![safetensors(&[("w", "U8", &[1 << 20])], 8)])
}

fn write_all(dir: &TempDir, files: Vec<Vec<u8>>) -> (Vec<PathBuf>, Vec<Vec<u8>>) {
    let paths = files.iter().enumerate().map(|(i, f)| dir.write(&format!("{i}.safetensors"), f)).collect();
    (paths, files)
}

/// One allocation per file, laid end to end, each starting `misalign` bytes past a page
/// boundary (torch's caching allocator guarantees only 512 bytes); and the total size.
fn layout(planned: &Planned, misalign: u64) -> (Vec<DeviceTarget>, usize) {
    let mut targets = Vec::new();
    let mut end = 0;
    for file in 0..planned.sources.len() {
        let base = end + misalign;
        targets.push(DeviceTarget { file, base });
        end = (base + planned.device_alloc_len(file)).next_multiple_of(4096);
    }
    (targets, end as usize)
}

fn assert_files_at(memory: &[u8], targets: &[DeviceTarget], copies: &[DeviceCopy], files: &[Vec<u8>]) {
    assert_eq!(targets.len(), copies.len());
    for (t, c) in targets.iter().zip(copies) {
        let start = (t.base + c.offset) as usize;
        assert!(
            memory[start..start + files[t.file].len()] == files[t.file][..],
            "device copy of file {} differs",
            t.file
        );
    }
}

/// Nothing left running and nothing freed under a copy: the caller may free the destination.
fn assert_quiet(device: &HostMemoryDevice) {
    assert_eq!(device.in_flight(), 0, "copies still queued when the load returned");
    assert_eq!(device.freed_in_flight(), 0, "staging buffers freed under a queued copy");
}

fn staged(block: u64, slots: usize, reader: ReaderKind) -> DeviceOptions {
    DeviceOptions { reader, gds: GdsMode::Never, staging: StagingOptions { block, slots }, ..Default::default() }
}

fn read_paths(copies: &[DeviceCopy]) -> Vec<ReadPath> {
    copies.iter().map(|c| c.path).collect()
}

#[test]
fn staged_copies_are_bit_exact_for_every_block_and_ring_size() {
    let dir = TempDir::new("staged");
    let (paths, files) = checkpoint(&dir);
    for (block, slots) in [(4096, 1), (4096, 2), (8192, 3), (1 << 20, 4), (64 << 20, 16)] {
        for reader in [ReaderKind::Direct, ReaderKind::Mmap, ReaderKind::Auto] {
            let planned = plan_files(&paths).unwrap();
            let (targets, len) = layout(&planned, 512);
            let device = HostMemoryDevice::new(len);
            let copies = planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(block, slots, reader)).unwrap();
            assert_quiet(&device);
            assert_files_at(&device.memory(), &targets, &copies, &files);
            let blocks: u64 = planned.sources.iter().map(|s| s.len().div_ceil(block)).sum();
            assert_eq!(device.copies() as u64, blocks, "one copy per block");
            assert!(
                device.staging_allocated() <= slots,
                "{} staging buffers for {slots} slots",
                device.staging_allocated()
            );
        }
    }
}

#[test]
fn staged_paths_follow_the_reader() {
    let dir = TempDir::new("staged-paths");
    let (paths, _) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let run = |reader| {
        let device = HostMemoryDevice::new(len);
        read_paths(&planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 2, reader)).unwrap())
    };
    assert_eq!(run(ReaderKind::Mmap), [ReadPath::Buffered, ReadPath::Buffered]);
    // Files just written are resident: auto reads them through the page cache.
    assert_eq!(run(ReaderKind::Auto), [ReadPath::Buffered, ReadPath::Buffered]);
    // O_DIRECT, unless the temp dir's filesystem refuses it.
    assert!(run(ReaderKind::Direct).iter().all(|p| matches!(p, ReadPath::Direct | ReadPath::Buffered)));
}

#[test]
fn the_ring_uses_its_slots_first_in_first_out() {
    // 256 blocks through 32 slots, more than there are I/O threads: a reader should always
    // find a slot whose copy is older than the newest, and every slot should be used.
    let dir = TempDir::new("staged-fifo");
    let (paths, files) = big_checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    let copies = planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 32, ReaderKind::Mmap)).unwrap();
    assert_quiet(&device);
    assert_files_at(&device.memory(), &targets, &copies, &files);
    assert_eq!(device.newest_waits(), 0, "a reader blocked on the newest copy while older ones were queued");
    assert_eq!(device.staging_used(), 32, "slots used");
}

#[test]
fn staging_buffers_are_reused_across_loads() {
    let dir = TempDir::new("staged-pool");
    let (paths, files) = big_checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    let mut allocated = Vec::new();
    for _ in 0..3 {
        let copies = planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 4, ReaderKind::Mmap)).unwrap();
        assert_quiet(&device);
        assert_files_at(&device.memory(), &targets, &copies, &files);
        allocated.push(device.staging_allocated());
    }
    assert_eq!(allocated, [4, 4, 4], "staging buffers allocated so far, after each of three loads of four slots");
    assert_eq!(device.pool().idle(), 4, "kept for the next load");
    assert_eq!(device.pool().clear(), 4);
    assert_eq!(device.pool().idle(), 0);
}

#[test]
fn a_failed_copy_mid_stream_is_an_error_not_a_hang() {
    let dir = TempDir::new("staged-fail");
    let (paths, _) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len).failing_at_copy(5);
    let err = planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 3, ReaderKind::Direct)).unwrap_err();
    assert!(err.to_string().contains("copy 5 failed"), "{err}");
    assert_quiet(&device);
}

#[test]
fn a_failed_event_record_leaves_no_copy_in_flight() {
    let dir = TempDir::new("staged-record");
    let (paths, _) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len).failing_record_at_copy(4);
    let err = planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 3, ReaderKind::Mmap)).unwrap_err();
    assert!(err.to_string().contains("recording the event of copy 4"), "{err}");
    assert_quiet(&device);
}

#[test]
fn a_failed_wait_still_drains_every_slot() {
    // The first wait after the last copy started is one of the final drain's.
    let dir = TempDir::new("staged-drain");
    let (paths, _) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let blocks = planned.sources.iter().map(|s| s.len().div_ceil(4096) as usize).sum();
    let device = HostMemoryDevice::new(len).failing_wait_after(blocks);
    let err = planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 4, ReaderKind::Mmap)).unwrap_err();
    assert!(err.to_string().contains("(injected)"), "{err}");
    assert_quiet(&device);
}

#[test]
fn a_panicking_worker_leaves_no_copy_in_flight() {
    let dir = TempDir::new("staged-panic");
    let (paths, _) = big_checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len).panicking_at_copy(20);
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 8, ReaderKind::Mmap))
    }));
    assert!(outcome.is_err(), "the injected panic reached the caller");
    assert_quiet(&device);
}

#[test]
fn a_file_truncated_after_planning_is_an_error() {
    let dir = TempDir::new("staged-truncated");
    let (paths, _) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    std::fs::OpenOptions::new().write(true).open(&paths[1]).unwrap().set_len(100).unwrap();
    let device = HostMemoryDevice::new(len);
    let err = planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 2, ReaderKind::Mmap)).unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");
    assert!(err.to_string().contains("1.safetensors"), "{err}");
    assert_quiet(&device);
}

/// A device whose destination memory still has a write of 0xEE pending on the previous
/// owner's stream, over the whole of the first allocation.
fn device_with_prior_work(targets: &[DeviceTarget], planned: &Planned, len: usize) -> HostMemoryDevice {
    let stale = vec![0xEE; planned.device_alloc_len(0) as usize];
    HostMemoryDevice::new(len).with_prior_write(targets[0].base, stale)
}

#[test]
fn staged_copies_are_ordered_after_the_destinations_previous_work() {
    let dir = TempDir::new("staged-ready");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = device_with_prior_work(&targets, &planned, len);
    let copies = planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 4, ReaderKind::Mmap)).unwrap();
    assert_quiet(&device);
    // Whatever the previous owner had queued runs now at the latest: it must not land on top.
    device.finish_prior_work();
    assert_files_at(&device.memory(), &targets, &copies, &files);
}

// ------------------------------------------------------------------ GPUDirect Storage

#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    RegisterHandle,
    DeregisterHandle,
    RegisterBuffer(u64, usize),
    DeregisterBuffer(u64),
    /// A read of `len` bytes at `file_offset` of the file registered as `file`.
    Read {
        file: usize,
        len: usize,
        file_offset: u64,
    },
}

/// What a fake cuFile has in flight.
#[derive(Default)]
struct Live {
    /// Registered ranges: (address, len).
    registered: Vec<(u64, usize)>,
    /// Reads in flight per file handle.
    reading: HashMap<usize, usize>,
}

/// A cuFile that reads with pread into the stand-in's memory. It checks what the real one
/// needs: the destination's device current on the calling thread (a CUDA context), reads
/// inside a registered range, registrations 4 KiB aligned; breaches are `violations`.
struct FakeCuFile<'d> {
    device: &'d HostMemoryDevice,
    calls: Mutex<Vec<Call>>,
    violations: Mutex<Vec<String>>,
    fail_buffer_registration: bool,
    /// Fail the read at this file offset.
    fail_read_at: Option<u64>,
    compat: bool,
    read_delay: Duration,
    live: Mutex<Live>,
    most_registered: Mutex<usize>,
    most_files_reading: Mutex<usize>,
}

impl<'d> FakeCuFile<'d> {
    fn new(device: &'d HostMemoryDevice) -> FakeCuFile<'d> {
        FakeCuFile {
            device,
            calls: Mutex::new(Vec::new()),
            violations: Mutex::new(Vec::new()),
            fail_buffer_registration: false,
            fail_read_at: None,
            compat: false,
            read_delay: Duration::ZERO,
            live: Mutex::new(Live::default()),
            most_registered: Mutex::new(0),
            most_files_reading: Mutex::new(0),
        }
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn violations(&self) -> Vec<String> {
        self.violations.lock().unwrap().clone()
    }

    fn record(&self, call: Call) {
        self.calls.lock().unwrap().push(call);
    }

    fn check_current(&self, what: &str) {
        if HostMemoryDevice::current() != Some(self.device.id()) {
            self.violations.lock().unwrap().push(format!("{what} without the destination's device current"));
        }
    }
}

impl CuFileApi for FakeCuFile<'_> {
    fn register_handle(&self, fd: RawFd) -> Result<FileHandle, String> {
        self.record(Call::RegisterHandle);
        Ok(FileHandle(fd as usize))
    }

    fn deregister_handle(&self, _: FileHandle) {
        self.record(Call::DeregisterHandle);
    }

    fn register_buffer(&self, address: u64, len: usize) -> Result<(), String> {
        self.check_current("cuFileBufRegister");
        if self.fail_buffer_registration {
            return Err("cuFileBufRegister failed with cuFile error 5011".into());
        }
        if address % 4096 != 0 {
            self.violations.lock().unwrap().push(format!("registered range at {address} is not 4 KiB aligned"));
        }
        self.record(Call::RegisterBuffer(address, len));
        let mut live = self.live.lock().unwrap();
        live.registered.push((address, len));
        let mut most = self.most_registered.lock().unwrap();
        *most = (*most).max(live.registered.len());
        Ok(())
    }

    fn deregister_buffer(&self, address: u64) {
        self.record(Call::DeregisterBuffer(address));
        self.live.lock().unwrap().registered.retain(|&(a, _)| a != address);
    }

    fn read(
        &self,
        handle: FileHandle,
        base: u64,
        len: usize,
        file_offset: u64,
        base_offset: u64,
    ) -> Result<usize, String> {
        self.check_current("cuFileRead");
        self.record(Call::Read { file: handle.0, len, file_offset });
        let at = base + base_offset;
        {
            let mut live = self.live.lock().unwrap();
            if !live.registered.iter().any(|&(a, l)| a <= at && at + len as u64 <= a + l as u64) {
                self.violations.lock().unwrap().push(format!("read to {at} outside every registered range"));
            }
            *live.reading.entry(handle.0).or_default() += 1;
            let reading = live.reading.values().filter(|&&n| n > 0).count();
            let mut most = self.most_files_reading.lock().unwrap();
            *most = (*most).max(reading);
        }
        std::thread::sleep(self.read_delay);
        let outcome = (|| {
            if self.fail_read_at == Some(file_offset) {
                return Err(format!("cuFileRead at offset {file_offset} failed (-5)"));
            }
            let path = std::fs::read_link(format!("/proc/self/fd/{}", handle.0)).map_err(|e| e.to_string())?;
            let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
            let mut bytes = vec![0; len];
            let n = file.read_at(&mut bytes, file_offset).map_err(|e| e.to_string())?;
            self.device.write(at, &bytes[..n]).map_err(|e| e.to_string())?;
            Ok(n)
        })();
        *self.live.lock().unwrap().reading.get_mut(&handle.0).unwrap() -= 1;
        outcome
    }

    fn compat_mode(&self) -> bool {
        self.compat
    }
}

fn with_gds(gds: GdsMode, block: u64, register_chunk: u64) -> DeviceOptions {
    DeviceOptions { gds, gds_io: GdsOptions { block, register_chunk }, ..staged(4096, 2, ReaderKind::Auto) }
}

#[test]
fn gds_reads_are_bit_exact_and_registrations_balanced() {
    let dir = TempDir::new("gds");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    let cufile = FakeCuFile::new(&device);
    let copies = planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Auto, 8192, 16384)).unwrap();
    assert_eq!(read_paths(&copies), [ReadPath::Gds, ReadPath::Gds]);
    assert_eq!(device.copies(), 0, "nothing went through staging");
    assert_files_at(&device.memory(), &targets, &copies, &files);
    assert_eq!(cufile.violations(), Vec::<String>::new());

    let calls = cufile.calls();
    let count = |f: fn(&Call) -> bool| calls.iter().filter(|c| f(c)).count();
    assert_eq!(count(|c| *c == Call::RegisterHandle), 2);
    assert_eq!(count(|c| *c == Call::DeregisterHandle), 2);
    assert_eq!(count(|c| matches!(c, Call::RegisterBuffer(..))), count(|c| matches!(c, Call::DeregisterBuffer(_))));
    // Registrations are bounded by the chunk size and cover each file once.
    for (t, c) in targets.iter().zip(&copies) {
        let start = t.base + c.offset;
        let file_len = planned.device_len(t.file);
        let registered: Vec<_> = calls
            .iter()
            .filter_map(|call| match call {
                Call::RegisterBuffer(a, l) if *a >= start && *a < start + file_len => Some(*l),
                _ => None,
            })
            .collect();
        assert!(registered.iter().all(|&l| l <= 16384), "{registered:?}");
        assert_eq!(registered.iter().sum::<usize>() as u64, file_len);
    }
    // Every block read once, at its own offset.
    let mut reads: Vec<_> = calls.iter().filter(|c| matches!(c, Call::Read { .. })).collect();
    reads.dedup();
    let blocks: u64 = planned.sources.iter().map(|s| s.len().div_ceil(8192)).sum();
    assert_eq!(reads.len() as u64, blocks);
}

#[test]
fn cufile_runs_with_the_device_current_on_every_thread_and_restores_it() {
    let dir = TempDir::new("gds-current");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    let cufile = FakeCuFile::new(&device);
    // The caller has another device current (torch's, or a context of its own).
    let other = HostMemoryDevice::new(1);
    let copies = other
        .with_current(|| {
            let copies =
                planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Require, 4096, 8192));
            assert_eq!(HostMemoryDevice::current(), Some(other.id()), "the caller's current device changed");
            copies
        })
        .unwrap()
        .unwrap();
    assert_eq!(HostMemoryDevice::current(), None);
    assert_eq!(cufile.violations(), Vec::<String>::new());
    assert_files_at(&device.memory(), &targets, &copies, &files);
}

#[test]
fn gds_reads_wait_for_the_destinations_previous_work() {
    let dir = TempDir::new("gds-ready");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = device_with_prior_work(&targets, &planned, len);
    let cufile = FakeCuFile::new(&device);
    let copies =
        planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Require, 8192, 16384)).unwrap();
    device.finish_prior_work();
    assert_files_at(&device.memory(), &targets, &copies, &files);
}

#[test]
fn gds_registrations_are_page_aligned_in_any_allocation() {
    let dir = TempDir::new("gds-align");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    for misalign in [0, 512, 1024, 3584] {
        let (targets, len) = layout(&planned, misalign);
        let device = HostMemoryDevice::new(len);
        let cufile = FakeCuFile::new(&device);
        let copies =
            planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Require, 8192, 16384)).unwrap();
        assert_eq!(cufile.violations(), Vec::<String>::new(), "allocations {misalign} bytes past a page");
        assert_files_at(&device.memory(), &targets, &copies, &files);
        for (t, c) in targets.iter().zip(&copies) {
            assert!(c.offset + planned.device_len(t.file) <= planned.device_alloc_len(t.file), "inside the allocation");
        }
    }
}

#[test]
fn gds_reads_files_concurrently_without_a_barrier_per_chunk() {
    let dir = TempDir::new("gds-overlap");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    let cufile = FakeCuFile { read_delay: Duration::from_millis(5), ..FakeCuFile::new(&device) };
    let copies =
        planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Require, 4096, 8192)).unwrap();
    assert_files_at(&device.memory(), &targets, &copies, &files);
    assert_eq!(cufile.violations(), Vec::<String>::new());
    // (With at least two I/O threads, as by default.)
    assert!(*cufile.most_files_reading.lock().unwrap() >= 2, "files were read one after another");
    assert!(*cufile.most_registered.lock().unwrap() >= 2, "each chunk waited for the previous one");
}

#[test]
fn cufile_compatibility_mode_is_reported_as_such() {
    let dir = TempDir::new("gds-compat");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    let cufile = FakeCuFile { compat: true, ..FakeCuFile::new(&device) };
    let copies =
        planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Require, 8192, 16384)).unwrap();
    assert_eq!(read_paths(&copies), [ReadPath::GdsCompat, ReadPath::GdsCompat]);
    assert_eq!(ReadPath::GdsCompat.name(), "gds-compat");
    assert_files_at(&device.memory(), &targets, &copies, &files);

    // Left to choose, the loader prefers its staged path to cuFile's emulation.
    let device = HostMemoryDevice::new(len);
    let cufile = FakeCuFile { compat: true, ..FakeCuFile::new(&device) };
    let copies = planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Auto, 8192, 16384)).unwrap();
    assert!(read_paths(&copies).iter().all(|p| matches!(p, ReadPath::Direct | ReadPath::Buffered)), "{copies:?}");
    assert!(cufile.calls().is_empty());
    assert_files_at(&device.memory(), &targets, &copies, &files);
}

#[test]
fn gds_failure_falls_back_to_staged_in_auto_mode() {
    let dir = TempDir::new("gds-fallback");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    let cufile = FakeCuFile { fail_buffer_registration: true, ..FakeCuFile::new(&device) };
    let copies = planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Auto, 8192, 16384)).unwrap();
    assert!(copies.iter().all(|c| c.path != ReadPath::Gds), "{copies:?}");
    assert_quiet(&device);
    assert_files_at(&device.memory(), &targets, &copies, &files);
    // Every handle registered before the failure was released, and no buffer registered.
    let calls = cufile.calls();
    assert!(calls.iter().all(|c| matches!(c, Call::RegisterHandle | Call::DeregisterHandle)), "{calls:?}");
    let handles = calls.iter().filter(|c| **c == Call::RegisterHandle).count();
    assert_eq!(handles, calls.len() - handles);
}

#[test]
fn a_gds_read_failure_sends_only_unfinished_files_to_the_staged_path() {
    let dir = TempDir::new("gds-partial");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    // The last block of the second file fails.
    let last = (planned.sources[1].len() - 1) / 8192 * 8192;
    let cufile = FakeCuFile { fail_read_at: Some(last), ..FakeCuFile::new(&device) };
    let copies = planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Auto, 8192, 16384)).unwrap();
    assert_ne!(copies[1].path, ReadPath::Gds);
    assert_files_at(&device.memory(), &targets, &copies, &files);
    let calls = cufile.calls();
    let count = |f: fn(&Call) -> bool| calls.iter().filter(|c| f(c)).count();
    assert_eq!(count(|c| matches!(c, Call::RegisterBuffer(..))), count(|c| matches!(c, Call::DeregisterBuffer(_))));
    assert_eq!(count(|c| *c == Call::RegisterHandle), count(|c| *c == Call::DeregisterHandle));
}

#[test]
fn required_gds_fails_clearly() {
    let dir = TempDir::new("gds-required");
    let (paths, _) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    let err =
        planned.copy_to_device(&device, NO_CUFILE, &targets, &with_gds(GdsMode::Require, 8192, 16384)).unwrap_err();
    assert!(matches!(err, Error::GdsRequired { .. }), "{err}");
    assert!(err.to_string().contains("0.safetensors") && err.to_string().contains("not on this machine"), "{err}");
    assert_eq!(device.copies(), 0, "no silent fallback when GDS is required");

    let cufile = FakeCuFile { fail_buffer_registration: true, ..FakeCuFile::new(&device) };
    let err =
        planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Require, 8192, 16384)).unwrap_err();
    assert!(err.to_string().contains("cuFileBufRegister failed"), "{err}");
}

#[test]
fn nogds_never_touches_cufile() {
    let dir = TempDir::new("gds-never");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (targets, len) = layout(&planned, 0);
    let device = HostMemoryDevice::new(len);
    let cufile = FakeCuFile::new(&device);
    let copies =
        planned.copy_to_device(&device, Ok(&cufile), &targets, &with_gds(GdsMode::Never, 8192, 16384)).unwrap();
    assert!(cufile.calls().is_empty());
    assert_files_at(&device.memory(), &targets, &copies, &files);
}

#[test]
fn without_a_driver_cuda_fails_cleanly() {
    // This machine may or may not have a GPU; without one the answer must be an error, fast.
    match fastsafetensors::device::driver::device_count() {
        Ok(n) => eprintln!("{n} CUDA device(s) present"),
        Err(e) => assert!(e.to_string().starts_with("CUDA: "), "{e}"),
    }
}

/// Each file's `sha256:` digest, by name (`{i}.safetensors`).
fn sha256_digests(files: &[Vec<u8>]) -> std::collections::BTreeMap<String, String> {
    use sha2::Digest as _;
    files
        .iter()
        .enumerate()
        .map(|(i, f)| (format!("{i}.safetensors"), format!("sha256:{:x}", sha2::Sha256::digest(f))))
        .collect()
}

/// A verified load shared by a group, to the device stand-in, run as the Python exchange runs
/// it: each rank reads its piece of every chunk of every shared buffer through the staging
/// ring (`read_to_device`, what `read_range` does for CUDA) — one memory here for the buffers
/// the exchange leaves alike on every rank —, and the rank checking a file feeds its check
/// each chunk from a host copy of the device buffer, in order, then finishes it. For 1 to 4
/// ranks: the buffers hold the files' bytes, the right digests pass, and a byte flipped in
/// either file fails that file's check alone, naming it.
#[test]
fn shared_verified_reads_to_the_device_stand_in() {
    use fastsafetensors::load::{fanout, plan_verified};
    use fastsafetensors::source;
    use fastsafetensors::verify::{manifest, Verifier};
    let dir = TempDir::new("shared-verified-device");
    let (paths, files) = checkpoint(&dir);
    let load = |signed: &[Vec<u8>], world: usize| -> Vec<bool> {
        let verifier = Verifier::new(manifest::from_digests(&sha256_digests(signed)).unwrap(), false);
        let planned = plan_verified(source::open_all(&paths).unwrap(), Some(&verifier)).unwrap();
        let shared = planned.share(world, u64::MAX, 8192).unwrap();
        let mut bases = Vec::new();
        let mut end = 0u64;
        for s in &shared {
            bases.push(end);
            end = (end + s.size).next_multiple_of(4096);
        }
        let device = HostMemoryDevice::new(end as usize);
        for (s, &base) in shared.iter().zip(&bases) {
            let src = &planned.sources[s.extent.file];
            let check = planned.checks.files.iter().find(|c| c.path() == src.path()).expect("a check per file");
            for c in &s.chunks {
                for rank in 0..world {
                    let (at, n) = c.read_by(rank, s.extent.len);
                    if n > 0 {
                        fanout::read_to_device(&device, src, s.extent.start + at, n, base + at, ReaderKind::Direct)
                            .unwrap();
                    }
                }
                assert_quiet(&device);
                let stop = (c.offset + world as u64 * c.piece).min(s.extent.len);
                let memory = device.memory();
                check.landed_transient(
                    s.extent.start + c.offset,
                    &memory[(base + c.offset) as usize..(base + stop) as usize],
                );
            }
            let memory = device.memory();
            let file = &files[s.extent.file];
            let (start, n) = (s.extent.start as usize, s.extent.expected as usize);
            assert!(
                memory[base as usize..base as usize + n] == file[start..start + n],
                "buffer of {}",
                src.path().display()
            );
        }
        planned
            .sources
            .iter()
            .map(|src| {
                let check = planned.checks.files.iter().find(|c| c.path() == src.path()).unwrap();
                match check.finish() {
                    Ok(()) => true,
                    Err(e) => {
                        assert!(matches!(&e, Error::DigestMismatch { path, .. } if path == src.path()), "{e}");
                        false
                    }
                }
            })
            .collect()
    };
    for world in 1..=4 {
        assert_eq!(load(&files, world), [true, true], "{world} ranks");
        for flipped in 0..files.len() {
            let mut signed = files.clone();
            let middle = signed[flipped].len() / 2;
            signed[flipped][middle] ^= 1;
            let expected: Vec<bool> = (0..files.len()).map(|f| f != flipped).collect();
            assert_eq!(load(&signed, world), expected, "{world} ranks, file {flipped} signed otherwise");
        }
    }
}

/// A verified load to the device stand-in hashes the bytes in the staging slots: the right
/// digests pass, and a byte changed after signing fails naming the file, for every ring size
/// (so blocks complete out of order, and those ahead of a gap are kept as copies).
#[test]
fn verified_staged_copies_hash_the_staging_slots() {
    use fastsafetensors::load::plan_verified;
    use fastsafetensors::source;
    use fastsafetensors::verify::{manifest, Verifier};
    let dir = TempDir::new("verified-staged");
    let (paths, files) = checkpoint(&dir);
    let verifier = Verifier::new(manifest::from_digests(&sha256_digests(&files)).unwrap(), false);
    for (block, slots) in [(4096, 1), (4096, 3), (8192, 8)] {
        let planned = plan_verified(source::open_all(&paths).unwrap(), Some(&verifier)).unwrap();
        let (targets, len) = layout(&planned, 512);
        let device = HostMemoryDevice::new(len);
        let copies =
            planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(block, slots, ReaderKind::Direct)).unwrap();
        assert_quiet(&device);
        assert_files_at(&device.memory(), &targets, &copies, &files);
    }
    let mut changed = files.clone();
    let last = changed[1].len() - 1;
    changed[1][last] ^= 1;
    let verifier = Verifier::new(manifest::from_digests(&sha256_digests(&changed)).unwrap(), false);
    let planned = plan_verified(source::open_all(&paths).unwrap(), Some(&verifier)).unwrap();
    let (targets, len) = layout(&planned, 512);
    let device = HostMemoryDevice::new(len);
    let err = planned.copy_to_device(&device, NO_CUFILE, &targets, &staged(4096, 3, ReaderKind::Mmap)).unwrap_err();
    assert_quiet(&device);
    assert!(matches!(&err, Error::DigestMismatch { path, .. } if path.ends_with("1.safetensors")), "{err}");
    // GPUDirect Storage would bypass the host memory the hash is computed in: refused.
    let planned = plan_verified(source::open_all(&paths).unwrap(), Some(&verifier)).unwrap();
    let options = DeviceOptions { gds: GdsMode::Require, ..staged(4096, 3, ReaderKind::Mmap) };
    let err = planned.copy_to_device(&device, NO_CUFILE, &targets, &options).unwrap_err();
    assert!(err.to_string().contains("GPUDirect Storage"), "{err}");
}
