//! The CUDA layer itself — rust/device/driver.rs, the CUDA device and `copy_to_cuda` — against
//! a fake driver, on machines without a GPU.
//!
//! tests/fake_cuda/fake_cuda.c is compiled into a library whose soname is `libcuda.so` and
//! loaded before anything looks for the driver: the loader's dlopen("libcuda.so") then finds
//! it, and cuFile's calls reach it through `FASTSAFETENSORS_CUFILE`. Device memory is host
//! memory declared to the fake; it counts every breach of the driver's rules (see the C file)
//! as a violation. This binary has the process to itself, so no real driver is ever loaded
//! here, and its tests run one at a time.

mod common;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use common::{safetensors, wait_until, TempDir};
use fastsafetensors::device::driver::{Context, Event, RawEvent};
use fastsafetensors::device::gds::GdsMode;
use fastsafetensors::device::StagingOptions;
use fastsafetensors::load::{self, plan_files, DeviceCopy, DeviceOptions, DeviceTarget, Planned};
use fastsafetensors::source::ReaderKind;
use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
use memmap2::MmapMut;

struct Fake {
    lib: Library,
    _dir: TempDir,
}

/// The fake driver, built and loaded once; and the lock that runs the tests one at a time.
fn fake() -> (&'static Fake, MutexGuard<'static, ()>) {
    static FAKE: OnceLock<Fake> = OnceLock::new();
    static SERIAL: Mutex<()> = Mutex::new(());
    let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fake = FAKE.get_or_init(|| {
        let dir = TempDir::new("fake-cuda");
        let so = dir.0.join("libcuda.so");
        let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/fake_cuda.c");
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let status = std::process::Command::new(cc)
            .args(["-shared", "-fPIC", "-O1", "-Wl,-soname,libcuda.so", "-o"])
            .arg(&so)
            .arg(&source)
            .arg("-lpthread")
            .status()
            .expect("running the C compiler");
        assert!(status.success(), "compiling {}", source.display());
        // SAFETY: the fake has no initialisers; RTLD_GLOBAL is not needed for the soname
        // match, but keeps the fake the one every later dlopen of libcuda.so finds.
        let lib = unsafe { Library::open(Some(&so), RTLD_NOW | RTLD_GLOBAL) }.expect("loading the fake driver");
        // No other thread reads the environment here: the tests are serialised.
        std::env::set_var("FASTSAFETENSORS_CUFILE", &so);
        Fake { lib, _dir: dir }
    });
    fake.call::<()>("fake_reset");
    (fake, serial)
}

impl Fake {
    fn call<T>(&self, name: &str) -> T {
        // SAFETY: every fake_* function without arguments returns an int, a pointer or nothing.
        unsafe { (self.lib.get::<unsafe extern "C" fn() -> T>(name.as_bytes()).unwrap())() }
    }

    fn call1<A, T>(&self, name: &str, a: A) -> T {
        // SAFETY: the named function takes one argument of type A.
        unsafe { (self.lib.get::<unsafe extern "C" fn(A) -> T>(name.as_bytes()).unwrap())(a) }
    }

    fn count(&self, name: &str) -> i64 {
        self.call::<c_int>(name) as i64
    }

    fn violations(&self) -> String {
        let n = self.call::<c_int>("fake_violations");
        let text = unsafe { CStr::from_ptr(self.call::<*const c_char>("fake_violation_text")) };
        format!("{n} violation(s): {}", text.to_string_lossy())
    }

    fn assert_no_violations(&self) {
        assert_eq!(self.call::<c_int>("fake_violations"), 0, "{}", self.violations());
    }

    /// No violation whose description contains `kind` (others are checked elsewhere).
    fn assert_none_of(&self, kind: &str) {
        let text = self.violations();
        assert!(!text.contains(kind), "{text}");
    }

    fn current_context(&self) -> *mut c_void {
        let mut ctx = std::ptr::null_mut();
        self.call1::<*mut *mut c_void, c_int>("cuCtxGetCurrent", &mut ctx);
        ctx
    }

    fn ready_event(&self, device: c_int) -> u64 {
        self.call1::<c_int, *mut c_void>("fake_ready_event", device) as u64
    }

    fn torch_stream(&self, device: c_int) -> u64 {
        self.call1::<c_int, *mut c_void>("fake_torch_stream", device) as u64
    }
}

/// Device memory on `device`, declared to the fake, with one allocation per file laid out in
/// it 512 bytes past a page (as torch's caching allocator may hand out).
struct DeviceMemory<'f> {
    fake: &'f Fake,
    map: MmapMut,
    targets: Vec<DeviceTarget>,
}

impl<'f> DeviceMemory<'f> {
    fn new(fake: &'f Fake, planned: &Planned, device: c_int) -> DeviceMemory<'f> {
        let len: u64 = (0..planned.sources.len()).map(|i| planned.device_alloc_len(i) + 4096).sum();
        let map = MmapMut::map_anon(len as usize).unwrap();
        let start = map.as_ptr() as u64;
        let declare: unsafe extern "C" fn(usize, usize, c_int) =
            *unsafe { fake.lib.get(b"fake_device_memory").unwrap() };
        unsafe { declare(start as usize, len as usize, device) };
        let mut next = start;
        let mut targets = Vec::new();
        for file in 0..planned.sources.len() {
            targets.push(DeviceTarget { file, base: next + 512 });
            next += planned.device_alloc_len(file) + 4096;
        }
        DeviceMemory { fake, map, targets }
    }

    fn assert_holds(&self, copies: &[DeviceCopy], files: &[Vec<u8>]) {
        let start = self.map.as_ptr() as u64;
        for (t, c) in self.targets.iter().zip(copies) {
            let at = (t.base + c.offset - start) as usize;
            assert!(self.map[at..at + files[t.file].len()] == files[t.file][..], "file {} differs", t.file);
        }
    }
}

impl Drop for DeviceMemory<'_> {
    fn drop(&mut self) {
        self.fake.call1::<usize, ()>("fake_forget_memory", self.map.as_ptr() as usize);
    }
}

fn checkpoint(dir: &TempDir) -> (Vec<PathBuf>, Vec<Vec<u8>>) {
    let files = vec![
        safetensors(&[("a", "BF16", &[1000, 37]), ("b", "F32", &[333])], 8),
        safetensors(&[("c", "I8", &[123456]), ("d", "F64", &[7, 3])], 8),
    ];
    let paths = files.iter().enumerate().map(|(i, f)| dir.write(&format!("{i}.safetensors"), f)).collect();
    (paths, files)
}

fn options(gds: GdsMode) -> DeviceOptions {
    DeviceOptions {
        reader: ReaderKind::Mmap,
        gds,
        staging: StagingOptions { block: 8192, slots: 4 },
        ..Default::default()
    }
}

/// Loads the checkpoint to `device` with a fresh ready event, checking the bytes.
fn load(fake: &Fake, dir: &TempDir, device: usize, gds: GdsMode) -> fastsafetensors::Result<Vec<DeviceCopy>> {
    let ready = fake.ready_event(device as c_int);
    // SAFETY: the fake's events are never freed.
    load_after(fake, dir, device, gds, unsafe { RawEvent::from_raw(ready) })
}

/// Loads the checkpoint to `device`, ordered after `ready`, checking the bytes.
fn load_after(
    fake: &Fake,
    dir: &TempDir,
    device: usize,
    gds: GdsMode,
    ready: RawEvent,
) -> fastsafetensors::Result<Vec<DeviceCopy>> {
    let (paths, files) = checkpoint(dir);
    let planned = plan_files(&paths).unwrap();
    let memory = DeviceMemory::new(fake, &planned, device as c_int);
    let copies = planned.copy_to_cuda(device, &memory.targets, &options(gds), Some(ready))?;
    memory.assert_holds(&copies, &files);
    Ok(copies)
}

/// What the extension does for each load to CUDA (the bridge's `record_ready`): an event made
/// in the device's primary context and recorded on torch's current stream (also the null
/// stream, torch's default), which the copies are then ordered after, staged or through cuFile.
#[test]
fn an_event_recorded_on_torchs_stream_orders_the_copies() {
    let (fake, _serial) = fake();
    let dir = TempDir::new("fake-torch-stream");
    for device in [0, 1] {
        for stream in [fake.torch_stream(device as c_int), 0] {
            for gds in [GdsMode::Never, GdsMode::Require] {
                let event = Event::new(&Context::primary(device).unwrap()).unwrap();
                // SAFETY: the fake's torch stream of `device`, or the null stream.
                unsafe { event.record_on(stream) }.unwrap();
                load_after(fake, &dir, device, gds, event.as_raw()).unwrap();
                assert_eq!(fake.current_context(), std::ptr::null_mut(), "a context was left current");
            }
        }
    }
    fake.assert_no_violations();
}

#[test]
fn a_load_leaves_every_threads_current_context_as_it_was() {
    let (fake, _serial) = fake();
    let dir = TempDir::new("fake-current");
    // The caller works in a context of its own on device 0 (CuPy, PyCUDA), then loads to 1.
    let user = fake.call1::<c_int, *mut c_void>("fake_user_context", 0);
    assert_eq!(fake.call1::<*mut c_void, c_int>("cuCtxPushCurrent_v2", user), 0);
    load(fake, &dir, 1, GdsMode::Never).unwrap();
    let after = fake.current_context();
    let mut popped = std::ptr::null_mut();
    fake.call1::<*mut *mut c_void, c_int>("cuCtxPopCurrent_v2", &mut popped);
    assert_eq!(after, user, "the caller's current context was replaced");
    assert_eq!(fake.count("fake_bound_threads"), 0, "I/O threads left with a context current");
    fake.assert_no_violations();
}

#[test]
fn cufile_reads_run_in_the_destinations_context() {
    let (fake, _serial) = fake();
    let dir = TempDir::new("fake-cufile");
    // A staged load to device 0 first: its I/O threads must not keep device 0's context.
    load(fake, &dir, 0, GdsMode::Never).unwrap();
    let copies = load(fake, &dir, 1, GdsMode::Require).unwrap();
    assert!(fake.count("fake_cufile_reads") > 0);
    assert!(copies.iter().all(|c| c.path.name() == "gds-compat"), "no nvidia-fs here: {copies:?}");
    fake.assert_no_violations();
}

#[test]
fn copies_are_ordered_after_torchs_stream_without_a_device_wide_wait() {
    let (fake, _serial) = fake();
    let dir = TempDir::new("fake-order");
    load(fake, &dir, 0, GdsMode::Never).unwrap();
    assert_eq!(fake.count("fake_context_synchronizations"), 0, "cuCtxSynchronize waits for unrelated work");
    fake.assert_none_of("not ordered after the destination's previous work");
    load(fake, &dir, 1, GdsMode::Require).unwrap();
    fake.assert_none_of("before the destination's previous work was waited for");
    assert_eq!(fake.count("fake_context_synchronizations"), 0, "cuCtxSynchronize waits for unrelated work");
    fake.assert_no_violations();
}

#[test]
fn pinned_staging_is_allocated_once_and_released_on_request() {
    let (fake, _serial) = fake();
    let dir = TempDir::new("fake-pool");
    load::release_staging_buffers();
    fake.call::<()>("fake_reset");
    load(fake, &dir, 0, GdsMode::Never).unwrap();
    let first = fake.count("fake_pinned_allocations");
    for _ in 0..19 {
        load(fake, &dir, 0, GdsMode::Never).unwrap();
    }
    assert!((1..=4).contains(&first), "{first} pinned buffers for 4 slots");
    assert_eq!(fake.count("fake_pinned_allocations"), first, "pinned allocations over 20 loads");
    assert_eq!(fake.count("fake_pinned_frees"), 0, "pinned buffers freed between loads");
    assert_eq!(load::release_staging_buffers(), first as usize);
    assert_eq!(fake.count("fake_pinned_frees"), first);
    fake.assert_no_violations();
}

#[test]
fn a_failed_event_record_leaves_no_copy_running() {
    let (fake, _serial) = fake();
    let dir = TempDir::new("fake-record");
    fake.call1::<c_int, ()>("fake_fail_event_record_at", 3);
    let err = load(fake, &dir, 0, GdsMode::Never).unwrap_err();
    assert!(err.to_string().contains("cuEventRecord"), "{err}");
    assert_eq!(fake.call::<std::ffi::c_ulong>("fake_unfinished_copies"), 0, "copies left running after the error");
    load::release_staging_buffers();
    fake.assert_none_of("under a copy that may still be running");
    fake.assert_no_violations();
}

#[test]
fn streams_events_and_pinned_memory_go_before_their_context() {
    let (fake, _serial) = fake();
    let dir = TempDir::new("fake-order-of-release");
    load(fake, &dir, 1, GdsMode::Never).unwrap();
    load::release_staging_buffers();
    fake.assert_none_of("after its context was released");
    fake.assert_no_violations();
    assert_eq!(fake.call1::<c_int, c_int>("fake_primary_retained", 1), 0, "retains and releases balance");
}

#[test]
fn a_cufile_library_the_user_named_is_the_only_one_tried() {
    let (fake, _serial) = fake();
    let dir = TempDir::new("fake-cufile-env");
    let not_a_library = dir.write("libcufile.so.0", b"not a shared object");
    let chosen = std::env::var_os("FASTSAFETENSORS_CUFILE");
    std::env::set_var("FASTSAFETENSORS_CUFILE", &not_a_library);
    let opened = fastsafetensors::device::cufile::CuFileLibrary::open();
    std::env::set_var("FASTSAFETENSORS_CUFILE", chosen.expect("the fake sets it"));
    let err = opened.err().expect("a file that is not a library must not load");
    assert!(
        err.starts_with(&format!("FASTSAFETENSORS_CUFILE={} could not be loaded", not_a_library.display())),
        "{err}"
    );
    assert!(!err.contains("libcufile.so.1"), "other libraries were tried: {err}");
    fake.assert_no_violations();
}

/// `keep` to CUDA through the stand-in: the first load fills device memory of the virtual
/// memory API through the staged path and puts it; the keeper (this crate's program, finding
/// the same fake driver) imports and holds it; the next load imports it from the keeper and
/// maps it read-only, reading nothing. Each load's handles go with it; the keeper's stay.
#[test]
fn kept_device_memory_is_filled_once_and_attached_read_only() {
    use fastsafetensors::keep::{client, Reply, Request};
    use fastsafetensors::source::ReadPath;

    let (fake, _serial) = fake();
    let dir = TempDir::new("fake-keep");
    let keep_dir = std::env::temp_dir().join(format!("fstk-fake-{}", std::process::id()));
    client::set_program(env!("CARGO_BIN_EXE_fastsafetensors-keeper"));
    std::env::set_var("FASTSAFETENSORS_KEEP_DIR", &keep_dir);
    std::env::set_var("LD_LIBRARY_PATH", &fake._dir.0);
    let (paths, files) = checkpoint(&dir);
    let kept_load = || plan_files(&paths).unwrap().copy_to_cuda_kept(1, &options(GdsMode::Require)).unwrap();
    let first = kept_load().expect("kept");
    assert!(first.files.iter().all(|c| c.path != ReadPath::Kept), "{:?}", first.files);
    let second = kept_load().expect("attached");
    assert!(second.files.iter().all(|c| c.path == ReadPath::Kept), "{:?}", second.files);
    assert_ne!(first.mapping.address(), second.mapping.address());
    let assert_bytes = |load: &fastsafetensors::load::kept::KeptOnDevice| {
        for (copy, bytes) in load.files.iter().zip(&files) {
            let at = (load.mapping.address() + copy.offset) as *const u8;
            // SAFETY: the fake's device memory is host memory, mapped readable for this load.
            let got = unsafe { std::slice::from_raw_parts(at, bytes.len()) };
            assert!(got == &bytes[..], "a kept file differs");
        }
    };
    for load in [&first, &second] {
        assert_bytes(load);
        assert_eq!(protection(load.mapping.address()), "r--s", "kept device memory is read-only");
    }
    assert_eq!(fake.count("fake_cufile_reads"), 0, "GPUDirect Storage is not used for kept memory");
    drop((first, second));
    assert_eq!(fake.count("fake_vmm_live"), 0, "a load's handles outlive it");
    let entries = || match client::command(&Request::List).unwrap() {
        Some(Reply::Entries { entries, .. }) => entries,
        other => panic!("{other:?}"),
    };
    // The keeper counts a holder out when its connection's thread sees the close: soon after
    // the drop, not at once.
    wait_until(10, || entries().iter().all(|e| e.holders.is_empty()));
    let listed = entries();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0].device, format!("cuda:fa{}01", "0".repeat(28)));
    assert_eq!((listed[0].attaches, listed[0].holders.len()), (1, 0), "{listed:?}");
    // Stopped, the keeper lets go of it; the next load fills again.
    client::command(&Request::Stop).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let again = kept_load().expect("kept");
    assert!(again.files.iter().all(|c| c.path != ReadPath::Kept));
    drop(again);
    client::command(&Request::Stop).unwrap();
    // A keeper whose budget on each GPU is less than the entry: not kept (the caller loads as
    // without keep); the host's budget does not count device entries.
    std::thread::sleep(std::time::Duration::from_millis(500));
    std::env::set_var("FASTSAFETENSORS_KEEP_DEVICE_MEMORY", "1M");
    assert!(kept_load().is_none(), "2 MiB kept on a GPU whose budget is 1 MiB");
    std::env::remove_var("FASTSAFETENSORS_KEEP_DEVICE_MEMORY");
    client::command(&Request::Stop).unwrap();
    // A driver that will not map device memory read-only: the load keeps its bytes as memory
    // of its own, writable, and the entry is not put (shared, it could be written).
    std::thread::sleep(std::time::Duration::from_millis(500));
    fake.call1::<c_int, ()>("fake_refuse_read_only", 1);
    let own = kept_load().expect("loaded, into memory of its own");
    assert!(own.files.iter().all(|c| c.path != ReadPath::Kept), "{:?}", own.files);
    assert_bytes(&own);
    assert_eq!(protection(own.mapping.address()), "rw-s");
    assert!(entries().is_empty(), "{:?}", entries());
    fake.call1::<c_int, ()>("fake_refuse_read_only", 0);
    drop(own);
    // Nor can such a driver attach to an entry: not kept (the caller loads as without keep),
    // and the imported memory is let go.
    let kept = kept_load().expect("kept");
    fake.call1::<c_int, ()>("fake_refuse_read_only", 1);
    assert!(kept_load().is_none(), "attached to device memory that could not be made read-only");
    fake.call1::<c_int, ()>("fake_refuse_read_only", 0);
    drop(kept);
    assert_eq!(fake.count("fake_vmm_live"), 0, "a load's handles outlive it");
    client::command(&Request::Stop).unwrap();
    let _ = std::fs::remove_dir_all(&keep_dir);
    fake.assert_no_violations();
}

/// The permissions `/proc/self/maps` shows for the mapping at `address` ("r--s").
fn protection(address: u64) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find_map(|line| {
            let (range, rest) = line.split_once(' ')?;
            let (start, end) = range.split_once('-')?;
            let (start, end) = (u64::from_str_radix(start, 16).ok()?, u64::from_str_radix(end, 16).ok()?);
            (start <= address && address < end).then(|| rest[..4].to_owned())
        })
        .expect("the address is mapped")
}
