//! cuFile (GPUDirect Storage), opened through our own function table.
//!
//! cudarc looks for `libcufile.so`/`.so.1x`, but the only name the CUDA wheels ship is
//! `libcufile.so.0`, so the library is opened here: `$FASTSAFETENSORS_CUFILE` first (the
//! Python package points it at the wheel's copy), then the usual names.
//!
//! [`CuFileApi`] is what the GDS reader needs; [`CuFileLibrary`] implements it over the real
//! library, and tests implement it with a fake that records the call sequence.

use std::ffi::{c_int, c_void};
use std::os::fd::RawFd;

use libloading::Library;

/// Environment variable naming the cuFile library to load.
pub const CUFILE_ENV: &str = "FASTSAFETENSORS_CUFILE";
const LIBRARY_NAMES: [&str; 3] = ["libcufile.so.0", "libcufile.so", "libcufile.so.1"];

/// A registered file: the opaque `CUfileHandle_t`, as an integer so it is `Send`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileHandle(pub usize);

/// The cuFile calls the GDS reader makes. Errors are the library's own words.
pub trait CuFileApi: Sync {
    fn register_handle(&self, fd: RawFd) -> Result<FileHandle, String>;
    fn deregister_handle(&self, handle: FileHandle);
    fn register_buffer(&self, address: u64, len: usize) -> Result<(), String>;
    fn deregister_buffer(&self, address: u64);
    /// Reads `len` bytes at `file_offset` to `base + base_offset`; returns bytes read.
    fn read(
        &self,
        handle: FileHandle,
        base: u64,
        len: usize,
        file_offset: u64,
        base_offset: u64,
    ) -> Result<usize, String>;
    /// Whether cuFile runs in compatibility mode (reads through host memory, not DMA).
    fn compat_mode(&self) -> bool;
}

#[repr(C)]
#[derive(Clone, Copy)]
struct CUfileError {
    err: c_int,
    cu_err: c_int,
}

#[repr(C)]
union CUfileDescrHandle {
    fd: c_int,
    handle: *mut c_void,
}

#[repr(C)]
struct CUfileDescr {
    kind: c_int,
    handle: CUfileDescrHandle,
    fs_ops: *const c_void,
}

const CU_FILE_HANDLE_TYPE_OPAQUE_FD: c_int = 1;

type DriverOpen = unsafe extern "C" fn() -> CUfileError;
type HandleRegister = unsafe extern "C" fn(*mut *mut c_void, *mut CUfileDescr) -> CUfileError;
type HandleDeregister = unsafe extern "C" fn(*mut c_void);
type BufRegister = unsafe extern "C" fn(*const c_void, usize, c_int) -> CUfileError;
type BufDeregister = unsafe extern "C" fn(*const c_void) -> CUfileError;
type Read = unsafe extern "C" fn(*mut c_void, *mut c_void, usize, i64, i64) -> isize;
type DriverGetProperties = unsafe extern "C" fn(*mut CUfileDrvProps) -> CUfileError;
type GetParameterBool = unsafe extern "C" fn(c_int, *mut bool) -> CUfileError;

/// `CUfileDrvProps_t` (cufile.h).
#[repr(C)]
#[derive(Default)]
struct CUfileDrvProps {
    nvfs_major_version: u32,
    nvfs_minor_version: u32,
    nvfs_poll_thresh_size: usize,
    nvfs_max_direct_io_size: usize,
    nvfs_dstatusflags: u32,
    nvfs_dcontrolflags: u32,
    fflags: u32,
    max_device_cache_size: u32,
    per_buffer_cache_size: u32,
    max_device_pinned_mem_size: u32,
    max_batch_io_size: u32,
    max_batch_io_timeout_msecs: u32,
}

/// `CUFILE_PARAM_FORCE_COMPAT_MODE` of `CUFileBoolConfigParameter_t` (cuFile 1.7 and later).
const CUFILE_PARAM_FORCE_COMPAT_MODE: c_int = 2;

fn check(what: &str, e: CUfileError) -> Result<(), String> {
    match (e.err, e.cu_err) {
        (0, _) => Ok(()),
        (err, 0) => Err(format!("{what} failed with cuFile error {err}")),
        (err, cu) => Err(format!("{what} failed with cuFile error {err} (CUDA error {cu})")),
    }
}

/// The loaded library with its driver open.
pub struct CuFileLibrary {
    handle_register: HandleRegister,
    handle_deregister: HandleDeregister,
    buf_register: BufRegister,
    buf_deregister: BufDeregister,
    read: Read,
    compat_mode: bool,
    _library: Library,
}

impl CuFileLibrary {
    /// Loads cuFile and opens its driver.
    ///
    /// Call only once a CUDA context exists on a real device: on machines without a GPU,
    /// `cuFileDriverOpen` never returns.
    pub fn open() -> Result<CuFileLibrary, String> {
        // A library the user named is the only one tried: quietly loading another would hide
        // that their choice does not load.
        let names: Vec<String> = match std::env::var(CUFILE_ENV) {
            Ok(chosen) if !chosen.is_empty() => vec![chosen],
            _ => LIBRARY_NAMES.iter().map(|s| s.to_string()).collect(),
        };
        let mut tried = Vec::new();
        let library = names
            .iter()
            .find_map(|name| {
                // SAFETY: loading cuFile runs only its own initialisers.
                unsafe { Library::new(name) }.map_err(|e| tried.push(format!("{name}: {e}"))).ok()
            })
            .ok_or_else(|| match std::env::var(CUFILE_ENV) {
                Ok(chosen) if !chosen.is_empty() => {
                    format!("{CUFILE_ENV}={chosen} could not be loaded ({})", tried.join("; "))
                }
                _ => format!("libcufile could not be loaded ({})", tried.join("; ")),
            })?;
        // SAFETY: the symbol types match cufile.h (CUfileError_t is {int, CUresult}).
        unsafe {
            let symbol = |name: &[u8]| -> Result<*const (), String> {
                library
                    .get::<*const ()>(name)
                    .map(|s| *s)
                    .map_err(|e| format!("libcufile lacks {}: {e}", String::from_utf8_lossy(name)))
            };
            let driver_open: DriverOpen = std::mem::transmute(symbol(b"cuFileDriverOpen\0")?);
            let handle_register = std::mem::transmute::<*const (), HandleRegister>(symbol(b"cuFileHandleRegister\0")?);
            let handle_deregister =
                std::mem::transmute::<*const (), HandleDeregister>(symbol(b"cuFileHandleDeregister\0")?);
            let buf_register = std::mem::transmute::<*const (), BufRegister>(symbol(b"cuFileBufRegister\0")?);
            let buf_deregister = std::mem::transmute::<*const (), BufDeregister>(symbol(b"cuFileBufDeregister\0")?);
            let read = std::mem::transmute::<*const (), Read>(symbol(b"cuFileRead\0")?);
            // Optional: older cuFile versions lack them.
            let get_properties = symbol(b"cuFileDriverGetProperties\0")
                .ok()
                .map(|f| std::mem::transmute::<*const (), DriverGetProperties>(f));
            let get_bool =
                symbol(b"cuFileGetParameterBool\0").ok().map(|f| std::mem::transmute::<*const (), GetParameterBool>(f));
            check("cuFileDriverOpen", driver_open())?;
            Ok(CuFileLibrary {
                handle_register,
                handle_deregister,
                buf_register,
                buf_deregister,
                read,
                compat_mode: compat_mode(get_properties, get_bool),
                _library: library,
            })
        }
    }
}

/// Whether the opened driver runs in compatibility mode: the nvidia-fs driver is not loaded,
/// cuFile reports no nvidia-fs version, or it is told to (`CUFILE_FORCE_COMPAT_MODE`,
/// `force_compat_mode` in cufile.json). In doubt, compatibility mode.
///
/// # Safety
/// The functions, if given, are cuFile's, and its driver is open.
unsafe fn compat_mode(get_properties: Option<DriverGetProperties>, get_bool: Option<GetParameterBool>) -> bool {
    if !nvidia_fs_loaded() {
        return true;
    }
    let mut props = CUfileDrvProps::default();
    let nvfs = get_properties.is_some_and(|f| check("", f(&mut props)).is_ok() && props.nvfs_major_version > 0);
    let mut forced = false;
    let forced = get_bool.is_some_and(|f| check("", f(CUFILE_PARAM_FORCE_COMPAT_MODE, &mut forced)).is_ok() && forced);
    !nvfs || forced
}

impl CuFileApi for CuFileLibrary {
    fn compat_mode(&self) -> bool {
        self.compat_mode
    }

    fn register_handle(&self, fd: RawFd) -> Result<FileHandle, String> {
        let mut descr = CUfileDescr {
            kind: CU_FILE_HANDLE_TYPE_OPAQUE_FD,
            handle: CUfileDescrHandle { fd },
            fs_ops: std::ptr::null(),
        };
        let mut handle: *mut c_void = std::ptr::null_mut();
        // SAFETY: both pointers are valid for the call; `fd` is open (O_DIRECT).
        check("cuFileHandleRegister", unsafe { (self.handle_register)(&mut handle, &mut descr) })?;
        Ok(FileHandle(handle as usize))
    }

    fn deregister_handle(&self, handle: FileHandle) {
        // SAFETY: `handle` came from cuFileHandleRegister and is deregistered once.
        unsafe { (self.handle_deregister)(handle.0 as *mut c_void) }
    }

    fn register_buffer(&self, address: u64, len: usize) -> Result<(), String> {
        // SAFETY: `address` is device memory of at least `len` bytes.
        check("cuFileBufRegister", unsafe { (self.buf_register)(address as *const c_void, len, 0) })
    }

    fn deregister_buffer(&self, address: u64) {
        // SAFETY: `address` was registered by `register_buffer`.
        let _ = unsafe { (self.buf_deregister)(address as *const c_void) };
    }

    fn read(
        &self,
        handle: FileHandle,
        base: u64,
        len: usize,
        file_offset: u64,
        base_offset: u64,
    ) -> Result<usize, String> {
        // SAFETY: `base + base_offset .. + len` lies in device memory allocated for the file.
        let n = unsafe {
            (self.read)(handle.0 as *mut c_void, base as *mut c_void, len, file_offset as i64, base_offset as i64)
        };
        if n < 0 {
            Err(format!("cuFileRead at offset {file_offset} failed ({n})"))
        } else {
            Ok(n as usize)
        }
    }
}

/// Whether the nvidia-fs kernel module is loaded: without it cuFile only emulates GDS
/// ("compatibility mode") through the page cache, slower than our staged path.
pub fn nvidia_fs_loaded() -> bool {
    std::path::Path::new("/proc/driver/nvidia-fs/stats").exists()
}

/// cuFile, opened once per process, or why it cannot be used. Call only once a context exists
/// on a real device.
pub fn shared() -> Result<&'static CuFileLibrary, &'static str> {
    static LIBRARY: std::sync::OnceLock<Result<CuFileLibrary, String>> = std::sync::OnceLock::new();
    LIBRARY.get_or_init(CuFileLibrary::open).as_ref().map_err(String::as_str)
}
