//! The device paths without a GPU: the staged pipeline against the host-memory stand-in,
//! and the GPUDirect Storage reader against a fake cuFile that records its calls.

mod common;

use std::os::fd::RawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Mutex;

use common::{safetensors, TempDir};
use fastsafetensors::cuda::cufile::{CuFileApi, FileHandle};
use fastsafetensors::device::HostMemoryDevice;
use fastsafetensors::gds::{GdsMode, GdsOptions};
use fastsafetensors::io::{ReadPath, ReaderKind};
use fastsafetensors::loader::{plan_files, DeviceOptions, Planned};
use fastsafetensors::staged::StagingOptions;
use fastsafetensors::Error;

const NO_CUFILE: Result<&FakeCuFile, &str> = Err("not on this machine");

/// Two files whose sizes are not multiples of the block size.
fn checkpoint(dir: &TempDir) -> (Vec<PathBuf>, Vec<Vec<u8>>) {
    let files = vec![
        safetensors(&[("a", "BF16", &[1000, 37]), ("b", "F32", &[333])], 8),
        safetensors(&[("c", "I8", &[12345]), ("d", "F64", &[7, 3])], 8),
    ];
    let paths = files.iter().enumerate().map(|(i, f)| dir.write(&format!("{i}.safetensors"), f)).collect();
    (paths, files)
}

/// Destinations laid end to end in device memory, and the total size.
fn layout(planned: &Planned) -> (Vec<u64>, usize) {
    let mut dsts = Vec::new();
    let mut end = 0;
    for i in 0..planned.sources.len() {
        dsts.push(end);
        end += planned.device_len(i);
    }
    (dsts, end as usize)
}

fn assert_files_at(memory: &[u8], dsts: &[u64], files: &[Vec<u8>]) {
    for (dst, file) in dsts.iter().zip(files) {
        let dst = *dst as usize;
        assert!(memory[dst..dst + file.len()] == file[..], "device copy differs from the file");
    }
}

fn staged(block: u64, slots: usize, reader: ReaderKind) -> DeviceOptions {
    DeviceOptions { reader, gds: GdsMode::Never, staging: StagingOptions { block, slots }, ..Default::default() }
}

#[test]
fn staged_copies_are_bit_exact_for_every_block_and_ring_size() {
    let dir = TempDir::new("staged");
    let (paths, files) = checkpoint(&dir);
    for (block, slots) in [(4096, 1), (4096, 2), (8192, 3), (1 << 20, 4), (64 << 20, 16)] {
        for reader in [ReaderKind::Direct, ReaderKind::Mmap, ReaderKind::Auto] {
            let planned = plan_files(&paths).unwrap();
            let (dsts, len) = layout(&planned);
            let device = HostMemoryDevice::new(len);
            planned.copy_to_device(&device, NO_CUFILE, &dsts, &staged(block, slots, reader)).unwrap();
            assert_files_at(&device.memory(), &dsts, &files);
            let blocks: u64 = planned.sources.iter().map(|s| s.len.div_ceil(block)).sum();
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
    let (dsts, len) = layout(&planned);
    let run = |reader| {
        planned.copy_to_device(&HostMemoryDevice::new(len), NO_CUFILE, &dsts, &staged(4096, 2, reader)).unwrap()
    };
    assert_eq!(run(ReaderKind::Mmap), [ReadPath::Buffered, ReadPath::Buffered]);
    // Files just written are resident: auto reads them through the page cache.
    assert_eq!(run(ReaderKind::Auto), [ReadPath::Buffered, ReadPath::Buffered]);
    // O_DIRECT, unless the temp dir's filesystem refuses it.
    assert!(run(ReaderKind::Direct).iter().all(|p| matches!(p, ReadPath::Direct | ReadPath::Buffered)));
}

#[test]
fn a_failed_copy_mid_stream_is_an_error_not_a_hang() {
    let dir = TempDir::new("staged-fail");
    let (paths, _) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (dsts, len) = layout(&planned);
    let device = HostMemoryDevice::new(len).failing_at_copy(5);
    let err = planned.copy_to_device(&device, NO_CUFILE, &dsts, &staged(4096, 3, ReaderKind::Direct)).unwrap_err();
    assert!(err.to_string().contains("copy 5 failed"), "{err}");
}

#[test]
fn a_file_truncated_after_planning_is_an_error() {
    let dir = TempDir::new("staged-truncated");
    let (paths, _) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (dsts, len) = layout(&planned);
    std::fs::OpenOptions::new().write(true).open(&paths[1]).unwrap().set_len(100).unwrap();
    let err = planned
        .copy_to_device(&HostMemoryDevice::new(len), NO_CUFILE, &dsts, &staged(4096, 2, ReaderKind::Mmap))
        .unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");
    assert!(err.to_string().contains("1.safetensors"), "{err}");
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Call {
    RegisterHandle,
    DeregisterHandle,
    RegisterBuffer(u64, usize),
    DeregisterBuffer(u64),
    Read { len: usize, file_offset: u64 },
}

/// A cuFile that reads with pread into host memory standing in for the device.
struct FakeCuFile {
    memory: Mutex<Vec<u8>>,
    calls: Mutex<Vec<Call>>,
    fail_buffer_registration: bool,
}

impl FakeCuFile {
    fn new(len: usize) -> FakeCuFile {
        FakeCuFile { memory: Mutex::new(vec![0; len]), calls: Mutex::new(Vec::new()), fail_buffer_registration: false }
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    fn record(&self, call: Call) {
        self.calls.lock().unwrap().push(call);
    }
}

impl CuFileApi for FakeCuFile {
    fn register_handle(&self, fd: RawFd) -> Result<FileHandle, String> {
        self.record(Call::RegisterHandle);
        Ok(FileHandle(fd as usize))
    }

    fn deregister_handle(&self, _: FileHandle) {
        self.record(Call::DeregisterHandle);
    }

    fn register_buffer(&self, address: u64, len: usize) -> Result<(), String> {
        if self.fail_buffer_registration {
            return Err("cuFileBufRegister failed with cuFile error 5011".into());
        }
        self.record(Call::RegisterBuffer(address, len));
        Ok(())
    }

    fn deregister_buffer(&self, address: u64) {
        self.record(Call::DeregisterBuffer(address));
    }

    fn read(
        &self,
        handle: FileHandle,
        base: u64,
        len: usize,
        file_offset: u64,
        base_offset: u64,
    ) -> Result<usize, String> {
        self.record(Call::Read { len, file_offset });
        let path = std::fs::read_link(format!("/proc/self/fd/{}", handle.0)).map_err(|e| e.to_string())?;
        let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
        let mut bytes = vec![0; len];
        let n = file.read_at(&mut bytes, file_offset).map_err(|e| e.to_string())?;
        let at = (base + base_offset) as usize;
        self.memory.lock().unwrap()[at..at + n].copy_from_slice(&bytes[..n]);
        Ok(n)
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
    let (dsts, len) = layout(&planned);
    let cufile = FakeCuFile::new(len);
    let unused = HostMemoryDevice::new(len);
    let paths_taken =
        planned.copy_to_device(&unused, Ok(&cufile), &dsts, &with_gds(GdsMode::Auto, 8192, 16384)).unwrap();
    assert_eq!(paths_taken, [ReadPath::Gds, ReadPath::Gds]);
    assert_eq!(unused.copies(), 0, "nothing went through staging");
    assert_files_at(&cufile.memory.lock().unwrap(), &dsts, &files);

    let calls = cufile.calls();
    let count = |f: fn(&Call) -> bool| calls.iter().filter(|c| f(c)).count();
    assert_eq!(count(|c| *c == Call::RegisterHandle), 2);
    assert_eq!(count(|c| *c == Call::DeregisterHandle), 2);
    assert_eq!(count(|c| matches!(c, Call::RegisterBuffer(..))), count(|c| matches!(c, Call::DeregisterBuffer(_))));
    // Registrations are bounded by the chunk size and cover each file once.
    for (i, planned_len) in (0..2).map(|i| (i, planned.device_len(i))) {
        let registered: Vec<_> = calls
            .iter()
            .filter_map(|c| match c {
                Call::RegisterBuffer(a, l) if *a >= dsts[i] && *a < dsts[i] + planned_len => Some(*l),
                _ => None,
            })
            .collect();
        assert!(registered.iter().all(|&l| l <= 16384), "{registered:?}");
        assert_eq!(registered.iter().sum::<usize>() as u64, planned_len);
    }
    // The first file's sequence: handle, then per chunk register → reads → deregister.
    assert_eq!(calls[0], Call::RegisterHandle);
    assert!(matches!(calls[1], Call::RegisterBuffer(0, 16384)));
    assert!(matches!(calls[2], Call::Read { file_offset: 0 | 8192, len: 8192 }));
}

#[test]
fn gds_failure_falls_back_to_staged_in_auto_mode() {
    let dir = TempDir::new("gds-fallback");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (dsts, len) = layout(&planned);
    let cufile = FakeCuFile { fail_buffer_registration: true, ..FakeCuFile::new(len) };
    let device = HostMemoryDevice::new(len);
    let taken = planned.copy_to_device(&device, Ok(&cufile), &dsts, &with_gds(GdsMode::Auto, 8192, 16384)).unwrap();
    assert!(taken.iter().all(|p| *p != ReadPath::Gds), "{taken:?}");
    assert_files_at(&device.memory(), &dsts, &files);
    // The handle registered before the failure was released.
    assert_eq!(cufile.calls(), [Call::RegisterHandle, Call::DeregisterHandle]);
}

#[test]
fn required_gds_fails_clearly() {
    let dir = TempDir::new("gds-required");
    let (paths, _) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (dsts, len) = layout(&planned);
    let device = HostMemoryDevice::new(len);
    let err = planned.copy_to_device(&device, NO_CUFILE, &dsts, &with_gds(GdsMode::Require, 8192, 16384)).unwrap_err();
    assert!(matches!(err, Error::GdsRequired { .. }), "{err}");
    assert!(err.to_string().contains("0.safetensors") && err.to_string().contains("not on this machine"), "{err}");
    assert_eq!(device.copies(), 0, "no silent fallback when GDS is required");

    let cufile = FakeCuFile { fail_buffer_registration: true, ..FakeCuFile::new(len) };
    let err =
        planned.copy_to_device(&device, Ok(&cufile), &dsts, &with_gds(GdsMode::Require, 8192, 16384)).unwrap_err();
    assert!(err.to_string().contains("cuFileBufRegister failed"), "{err}");
}

#[test]
fn nogds_never_touches_cufile() {
    let dir = TempDir::new("gds-never");
    let (paths, files) = checkpoint(&dir);
    let planned = plan_files(&paths).unwrap();
    let (dsts, len) = layout(&planned);
    let cufile = FakeCuFile::new(len);
    let device = HostMemoryDevice::new(len);
    planned.copy_to_device(&device, Ok(&cufile), &dsts, &with_gds(GdsMode::Never, 8192, 16384)).unwrap();
    assert!(cufile.calls().is_empty());
    assert_files_at(&device.memory(), &dsts, &files);
}

#[test]
fn without_a_driver_cuda_fails_cleanly() {
    // This machine may or may not have a GPU; without one the answer must be an error, fast.
    match fastsafetensors::cuda::driver::device_count() {
        Ok(n) => eprintln!("{n} CUDA device(s) present"),
        Err(e) => assert!(e.to_string().starts_with("CUDA: "), "{e}"),
    }
}
