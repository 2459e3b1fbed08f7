//! The save ops: one call for a single process (`save`), and the steps of a group's save
//! (`save_begin`, `save_write`, `save_commit`, `save_end`), which the Python layer runs
//! between the group's collectives.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Mutex;

use serde::Deserialize;

use super::ffi::SaveTensorSpec;
use super::{guard, ready_event};
use crate::device::driver::Context;
use crate::device::CudaDevice;
use crate::error::{Error, Result};
use crate::plan::save::{
    assign_ranges, check_shared, group_tensors, plan_group_save, plan_save, FileSpec, RankTensor, SavePlan, SaveTarget,
    SaveTensor, Span, WriteRange, ASSIGN_UNIT,
};
use crate::save::{DeviceGather, HostGather, SaveOptions, SaveSession, TensorBytes};
use crate::source::budget;

#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn save(
    tensors: &Vec<SaveTensorSpec>,
    target: &str,
    max_shard_size: i64,
    has_metadata: bool,
    metadata_keys: &Vec<String>,
    metadata_values: &Vec<String>,
    max_memory: &str,
    ready: u64,
) -> Result<Vec<String>> {
    guard(|| {
        let target = target_of(target, max_shard_size);
        let specs = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| SaveTensor::from_torch(&t.name, &t.dtype, &t.shape, i))
            .collect::<Result<Vec<_>>>()?;
        let metadata =
            has_metadata.then(|| metadata_keys.iter().cloned().zip(metadata_values.iter().cloned()).collect());
        let plan = plan_save(specs.clone(), &target, metadata.as_ref())?;
        let whole = plan.files.iter().enumerate().map(|(file, f)| WriteRange { file, start: 0, end: f.len }).collect();
        // SAFETY: the caller's contract.
        let written = unsafe {
            with_sources(
                tensors,
                &specs,
                (0..tensors.len()).collect(),
                max_memory,
                ready,
                |sources, gather, options| {
                    let mut session = SaveSession::begin(plan.clone(), &target, whole, options.direct)?;
                    match gather {
                        Gathers::Host(g) => session.write(&[], sources, g, options)?,
                        Gathers::Device(g) => session.write(&[], sources, g, options)?,
                    };
                    session.commit()
                },
            )?
        };
        Ok(written.into_iter().map(|p| p.to_string_lossy().into_owned()).collect())
    })
}

fn target_of(target: &str, max_shard_size: i64) -> SaveTarget {
    match u64::try_from(max_shard_size) {
        Ok(max_shard_size) => SaveTarget::Directory { dir: target.into(), max_shard_size },
        Err(_) => SaveTarget::File(target.into()),
    }
}

/// How a rank's bytes are gathered: from host memory, or off its device.
enum Gathers<'a, 'd> {
    Host(&'a HostGather),
    Device(&'a DeviceGather<'d, CudaDevice>),
}

/// Checks the caller's tensors (`tensors[k]` is the plan's tensor `global[k]`, described by
/// `specs[global[k]]`) and runs `f` with every tensor's bytes (the others' `Elsewhere`), the
/// gather their device takes, and the write options.
///
/// # Safety
/// As for `save`.
unsafe fn with_sources<T>(
    tensors: &[SaveTensorSpec],
    specs: &[SaveTensor],
    global: Vec<usize>,
    max_memory: &str,
    ready: u64,
    f: impl FnOnce(&[TensorBytes], Gathers, &SaveOptions) -> Result<T>,
) -> Result<T> {
    let sizes = global.iter().map(|&g| specs[g].nbytes()).collect::<Result<Vec<u64>>>()?;
    let names: Vec<String> = tensors.iter().map(|t| t.name.clone()).collect();
    let spans: Vec<Span> = tensors.iter().zip(&sizes).map(|(t, &nbytes)| covered(t, nbytes)).collect();
    check_shared(&names, &spans)?;
    let mut sources = vec![TensorBytes::Elsewhere; specs.len()];
    for ((t, &g), &nbytes) in tensors.iter().zip(&global).zip(&sizes) {
        sources[g] = match t.device {
            // SAFETY: the caller keeps the bytes readable and unchanged until we return.
            -1 => TensorBytes::Host(unsafe { host_bytes(t.address, nbytes) }),
            _ => TensorBytes::Device(t.address),
        };
    }
    let budget = budget::stream_budget(Some(max_memory).filter(|m| !m.is_empty()))?;
    let options = SaveOptions::within(budget, crate::source::io_threads()?);
    let devices: BTreeSet<i64> = tensors.iter().map(|t| t.device).filter(|&d| d >= 0).collect();
    match devices.iter().collect::<Vec<_>>()[..] {
        [] => f(&sources, Gathers::Host(&HostGather), &options),
        [&ordinal] => {
            // SAFETY: the extension keeps the event alive until this call returns.
            let ready = unsafe { ready_event(ready) };
            let device = CudaDevice::new(Context::primary(ordinal as usize)?, ready)?;
            let gather = DeviceGather::new(&device)?;
            f(&sources, Gathers::Device(&gather), &options)
        }
        _ => {
            let list: Vec<String> = devices.iter().map(|d| format!("cuda:{d}")).collect();
            Err(Error::InvalidArgument(format!(
                "the tensors are on {}: save from one device at a time (or move them to one)",
                list.join(", ")
            )))
        }
    }
}

/// The memory the caller's tensor covers: from its first element to the end of its last
/// (torch's strides are never negative), `nbytes` being its size once contiguous.
fn covered(t: &SaveTensorSpec, nbytes: u64) -> Span {
    let numel: i64 = t.shape.iter().product();
    let end = match numel {
        0 => t.origin,
        _ => {
            let last: i64 = t.shape.iter().zip(&t.strides).map(|(&n, &stride)| (n - 1) * stride).sum();
            t.origin + (last as u64 + 1) * (nbytes / numel as u64)
        }
    };
    Span { device: t.device, begin: t.origin, end }
}

/// # Safety
/// `len` bytes at `address` are readable and unchanged for the lifetime the caller picks.
unsafe fn host_bytes<'a>(address: u64, len: u64) -> &'a [u8] {
    if len == 0 {
        return &[];
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(address as *const u8, len as usize) }
}

/// What `save_begin` is given.
#[derive(Deserialize)]
struct GroupSpec {
    rank: usize,
    world: usize,
    target: String,
    max_shard_size: i64,
    metadata: Option<BTreeMap<String, String>>,
    ranks: Vec<Vec<RankTensor>>,
    files: Option<Vec<GroupFile>>,
}

#[derive(Deserialize)]
struct GroupFile {
    path: PathBuf,
    tensors: Vec<String>,
    metadata: Option<BTreeMap<String, String>>,
}

/// A save begun on this process: the session, the plan's tensors and this rank's own.
struct Begun {
    session: SaveSession,
    specs: Vec<SaveTensor>,
    /// This rank's tensors: name -> index in `specs`.
    mine: HashMap<String, usize>,
}

static SAVES: Mutex<BTreeMap<i64, Begun>> = Mutex::new(BTreeMap::new());
static NEXT_SAVE: AtomicI64 = AtomicI64::new(1);

pub(super) fn save_begin(spec: &str) -> Result<Vec<String>> {
    guard(|| {
        let spec: GroupSpec =
            serde_json::from_str(spec).map_err(|e| Error::InvalidArgument(format!("save_begin: {e}")))?;
        if spec.world == 0 || spec.rank >= spec.world || spec.ranks.len() != spec.world {
            return Err(Error::InvalidArgument(format!(
                "save_begin: rank {} of {} with {} ranks' tensors",
                spec.rank,
                spec.world,
                spec.ranks.len()
            )));
        }
        let group = group_tensors(&spec.ranks)?;
        let at: HashMap<&str, usize> = group.tensors.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let target = match &spec.files {
            Some(files) => {
                let files = files
                    .iter()
                    .map(|f| {
                        let tensors = f
                            .tensors
                            .iter()
                            .map(|n| {
                                at.get(n.as_str()).copied().ok_or_else(|| {
                                    Error::InvalidArgument(format!("{}: no rank holds tensor '{n}'", f.path.display()))
                                })
                            })
                            .collect::<Result<Vec<usize>>>()?;
                        Ok(FileSpec { path: f.path.clone(), tensors, metadata: f.metadata.clone() })
                    })
                    .collect::<Result<Vec<FileSpec>>>()?;
                SaveTarget::Files(files)
            }
            None => target_of(&spec.target, spec.max_shard_size),
        };
        let plan: SavePlan = plan_group_save(&group, &target, spec.metadata.as_ref())?;
        let mut ranges = assign_ranges(&plan.files, &group.holders, spec.world, ASSIGN_UNIT)?;
        let ranges = std::mem::take(&mut ranges[spec.rank]);
        let bytes: u64 = ranges.iter().map(|r| r.end - r.start).sum();
        let session = match spec.rank {
            0 => SaveSession::begin(plan, &target, ranges, true)?,
            _ => SaveSession::join(plan, ranges),
        };
        let locations: Vec<String> =
            session.locations().into_iter().map(|p| p.to_string_lossy().into_owned()).collect();
        // Every rank's tensor is one of the group's (group_tensors lists them all).
        let mine =
            spec.ranks[spec.rank].iter().filter_map(|t| Some((t.name.clone(), *at.get(t.name.as_str())?))).collect();
        let handle = NEXT_SAVE.fetch_add(1, Ordering::Relaxed);
        SAVES.lock().unwrap_or_else(|e| e.into_inner()).insert(handle, Begun { session, specs: group.tensors, mine });
        Ok([handle.to_string(), bytes.to_string()].into_iter().chain(locations).collect())
    })
}

fn take(handle: i64) -> Result<Begun> {
    SAVES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&handle)
        .ok_or_else(|| Error::InvalidArgument(format!("no save in progress with handle {handle}")))
}

pub(super) unsafe fn save_write(
    handle: i64,
    locations: &Vec<String>,
    tensors: &Vec<SaveTensorSpec>,
    max_memory: &str,
    ready: u64,
) -> Result<u64> {
    guard(|| {
        let mut begun = take(handle)?;
        let result =
            (|| {
                let mut global = Vec::with_capacity(tensors.len());
                for t in tensors {
                    let g = *begun.mine.get(&t.name).ok_or_else(|| Error::SaveRefused {
                        name: t.name.clone(),
                        why: "it was not among this rank's tensors when the save began".into(),
                    })?;
                    let planned = SaveTensor::from_torch(&t.name, &t.dtype, &t.shape, g)?;
                    if (planned.dtype, &planned.shape) != (begun.specs[g].dtype, &begun.specs[g].shape) {
                        return Err(Error::SaveRefused {
                            name: t.name.clone(),
                            why: "it changed since the save began".into(),
                        });
                    }
                    global.push(g);
                }
                if global.len() != begun.mine.len() {
                    return Err(Error::InvalidArgument(format!(
                        "save_write: {} tensors given, {} when the save began",
                        global.len(),
                        begun.mine.len()
                    )));
                }
                let locations: Vec<PathBuf> = locations.iter().map(PathBuf::from).collect();
                let session = &mut begun.session;
                // SAFETY: the caller's contract.
                unsafe {
                    with_sources(tensors, &begun.specs, global, max_memory, ready, |sources, gather, options| {
                        match gather {
                            Gathers::Host(g) => session.write(&locations, sources, g, options),
                            Gathers::Device(g) => session.write(&locations, sources, g, options),
                        }
                    })
                }
            })();
        // Kept for the commit (or the end) whichever way the write went.
        SAVES.lock().unwrap_or_else(|e| e.into_inner()).insert(handle, begun);
        result
    })
}

pub(super) fn save_commit(handle: i64) -> Result<Vec<String>> {
    guard(|| {
        let begun = take(handle)?;
        let written = begun.session.commit()?;
        Ok(written.into_iter().map(|p| p.to_string_lossy().into_owned()).collect())
    })
}

pub(super) fn save_end(handle: i64) -> bool {
    guard(|| Ok(SAVES.lock().unwrap_or_else(|e| e.into_inner()).remove(&handle).is_some())).unwrap_or(false)
}
