//! Device memory that another process can map: the driver's virtual memory management API
//! (`cuMemCreate` with POSIX file-descriptor handles, `cuMemExportToShareableHandle` /
//! `cuMemImportFromShareableHandle`, `cuMemAddressReserve`, `cuMemMap`, `cuMemSetAccess`).
//! Like [`super::driver`], the `unsafe` calls are here and every type releases what it owns
//! on drop.
//!
//! ```no_run
//! use fastsafetensors::device::vmm::{self, Access, Mapping, Physical};
//! let len = vmm::round_up(0, 100 << 20)?;
//! let memory = Physical::create(0, len)?;           // on device 0
//! let fd = memory.export()?;                        // a descriptor for another process
//! let here = Mapping::new(memory, 0, Access::ReadWrite)?;
//! // ... copy into here.address() ...; elsewhere:
//! let there = Mapping::new(Physical::import(fd.into(), len)?, 0, Access::Read)?;
//! # Ok::<(), fastsafetensors::Error>(())
//! ```
//!
//! A mapping holds its physical memory, and the memory is freed once every mapping and every
//! handle to it (in any process) is gone.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::driver::{self, Context};
use crate::error::{Error, Result};

fn check(what: &str, rc: sys::CUresult) -> Result<()> {
    rc.result().map_err(|e| {
        let name = e.error_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        Error::Cuda(format!("{what} failed: {name} ({:?})", e.0))
    })
}

fn location(ordinal: usize) -> sys::CUmemLocation {
    // SAFETY: a plain C struct; all zeros is valid, and the fields that matter are set below.
    let mut loc: sys::CUmemLocation = unsafe { std::mem::zeroed() };
    loc.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    loc.__bindgen_anon_1.id = ordinal as i32;
    loc
}

fn properties(ordinal: usize) -> sys::CUmemAllocationProp {
    // SAFETY: a plain C struct; all zeros is valid (no win32 metadata, default flags).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = location(ordinal);
    prop
}

/// `len` rounded up to the allocation granularity of device `ordinal` (what `cuMemCreate`
/// and mappings take).
pub fn round_up(ordinal: usize, len: usize) -> Result<usize> {
    let _ctx = Context::primary(ordinal)?; // the driver initialised and the device there
    let prop = properties(ordinal);
    let mut granularity = 0usize;
    // SAFETY: both pointers are to live values of the types the call takes.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut granularity,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
        )
    })?;
    Ok(len.max(1).next_multiple_of(granularity.max(1)))
}

/// The GPU behind ordinal `ordinal`, as its UUID: the same whatever `CUDA_VISIBLE_DEVICES`
/// makes its ordinal in a process.
pub fn device_uuid(ordinal: usize) -> Result<String> {
    driver::device_count()?;
    let mut device = 0;
    // SAFETY: writes the device handle of a valid ordinal (checked by the driver).
    check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut device, ordinal as i32) })?;
    // SAFETY: a plain C struct the call fills.
    let mut uuid: sys::CUuuid = unsafe { std::mem::zeroed() };
    // SAFETY: `uuid` is live; `device` came from cuDeviceGet.
    check("cuDeviceGetUuid", unsafe { sys::cuDeviceGetUuid_v2(&mut uuid, device) })?;
    Ok(uuid.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect())
}

/// Physical device memory, by its driver handle: released on drop (the memory itself goes once
/// no mapping or handle of any process refers to it).
pub struct Physical {
    handle: sys::CUmemGenericAllocationHandle,
    len: usize,
}

// SAFETY: a handle the driver accepts from any thread.
unsafe impl Send for Physical {}
unsafe impl Sync for Physical {}

impl Physical {
    /// `len` bytes (a multiple of the granularity: [`round_up`]) on device `ordinal`,
    /// exportable as a file descriptor.
    pub fn create(ordinal: usize, len: usize) -> Result<Physical> {
        let ctx = Context::primary(ordinal)?;
        let _current = ctx.enter()?;
        let prop = properties(ordinal);
        let mut handle = 0;
        // SAFETY: `handle` and `prop` are live; the driver writes the new handle.
        check("cuMemCreate", unsafe { sys::cuMemCreate(&mut handle, len, &prop, 0) })?;
        Ok(Physical { handle, len })
    }

    /// The memory another process exported (`len` bytes), from its descriptor.
    pub fn import(fd: OwnedFd, len: usize) -> Result<Physical> {
        driver::device_count()?;
        let mut handle = 0;
        // SAFETY: for POSIX descriptors the "OS handle" is the descriptor's number, passed as
        // the pointer's value; the driver takes its own reference and `fd` is closed after.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(Physical { handle, len })
    }

    /// A descriptor of the memory for another process (sent with `SCM_RIGHTS`).
    pub fn export(&self) -> Result<OwnedFd> {
        let mut fd: libc::c_int = -1;
        // SAFETY: for POSIX descriptors the driver writes an int; `self.handle` is live.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                &mut fd as *mut libc::c_int as *mut std::ffi::c_void,
                self.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        // SAFETY: the driver made a new descriptor, which is ours to close.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    #[allow(clippy::len_without_is_empty)] // a size, not a collection
    pub fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Physical {
    fn drop(&mut self) {
        // SAFETY: the handle is ours; mappings of it hold their own `Physical`.
        let _ = unsafe { sys::cuMemRelease(self.handle) };
    }
}

/// How a mapping may be accessed from its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    Read,
    ReadWrite,
}

/// Physical memory mapped at a device address of this process, accessible from its device.
/// Unmapped (and the address range freed) on drop.
pub struct Mapping {
    address: sys::CUdeviceptr,
    physical: Physical,
    ctx: Context,
}

// SAFETY: an address range and handles the driver accepts from any thread.
unsafe impl Send for Mapping {}
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `physical` whole, accessible from device `ordinal` as `access` says.
    pub fn new(physical: Physical, ordinal: usize, access: Access) -> Result<Mapping> {
        let ctx = Context::primary(ordinal)?;
        let _current = ctx.enter()?;
        let len = physical.len;
        let mut address = 0;
        // SAFETY: reserves a fresh range of `len` bytes (the driver picks where).
        check("cuMemAddressReserve", unsafe { sys::cuMemAddressReserve(&mut address, len, 0, 0, 0) })?;
        // SAFETY: maps the whole of a live allocation onto the whole range reserved above.
        if let Err(e) = check("cuMemMap", unsafe { sys::cuMemMap(address, len, 0, physical.handle, 0) }) {
            // SAFETY: frees the range reserved above, which nothing maps.
            let _ = unsafe { sys::cuMemAddressFree(address, len) };
            return Err(e);
        }
        drop(_current);
        let mapping = Mapping { address, physical, ctx };
        mapping.set_access(access)?;
        Ok(mapping)
    }

    /// Makes the whole mapping accessible from its device as `access` says.
    pub fn set_access(&self, access: Access) -> Result<()> {
        let _current = self.ctx.enter()?;
        let flags = match access {
            Access::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
            Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let desc = sys::CUmemAccessDesc { location: location(self.ctx.ordinal()), flags };
        // SAFETY: the range is ours and mapped; `desc` is live for the call.
        check("cuMemSetAccess", unsafe { sys::cuMemSetAccess(self.address, self.physical.len, &desc, 1) })
    }

    /// The device address of its first byte.
    pub fn address(&self) -> u64 {
        self.address
    }

    #[allow(clippy::len_without_is_empty)] // a size, not a collection
    pub fn len(&self) -> usize {
        self.physical.len
    }

    pub fn physical(&self) -> &Physical {
        &self.physical
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let _current = self.ctx.enter();
        // SAFETY: the range is ours, mapped in `new`; nothing uses it once its owner drops it.
        unsafe {
            let _ = sys::cuMemUnmap(self.address, self.physical.len);
            let _ = sys::cuMemAddressFree(self.address, self.physical.len);
        }
    }
}
