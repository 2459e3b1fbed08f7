//! Streaming to a device: the selected tensors in groups, each group copied into a device
//! allocation of its own through the pinned staging ring, the next group's copy running while
//! the consumer works on the current one.
//!
//! The caller allocates device memory (on CUDA, through torch's caching allocator, so that
//! torch's memory statistics count it) and hands it over group by group:
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use fastsafetensors::device::HostMemoryDevice;
//! # use fastsafetensors::load::plan_files;
//! # use fastsafetensors::load::device_stream::{Copier, DeviceStream};
//! # use fastsafetensors::load::stream::StreamOptions;
//! let stream = DeviceStream::open(plan_files(&["model.safetensors".into()])?, &StreamOptions::with_budget(64 << 20))?;
//! let device = Arc::new(HostMemoryDevice::new(1 << 30));
//! let copier = Copier::start(stream, move |_ready| Ok(Arc::clone(&device)))?;
//! let mut next_free = 0;
//! for k in 0..copier.stream().group_count() {
//!     copier.submit(k, next_free, 0)?;
//!     let landed = copier.wait(k)?;
//!     println!("group {k} at {}", next_free + landed.offset);
//!     next_free += copier.stream().alloc_len(k);
//! }
//! # Ok::<(), fastsafetensors::Error>(())
//! ```
//!
//! [`Copier::submit`] queues group `k`'s copy into the allocation at `base`
//! ([`DeviceStream::alloc_len`] bytes there); [`Copier::wait`] blocks until it is done and
//! says where the group landed. A consumer submits the groups after `k` (as many as its
//! budget allows, at least one) before waiting for group `k`, so that copies run while it
//! works: device memory in use is the groups it holds, those submitted, and the pinned ring
//! (GPUDirect Storage is for bulk loads).

use std::collections::{HashMap, HashSet};
use std::ops::Deref;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

use crate::device::staged::{self, StagedFile};
use crate::device::Device;
use crate::device::StagingOptions;
use crate::error::{Error, Result};
use crate::load::stream::{self, PlannedGroup, StreamOptions};
use crate::load::{self, DeviceCopy, Planned};
use crate::plan::{Placement, IO_ALIGN};
use crate::source::direct::BlockReader;
use crate::source::{HostRead, ReadPath};

/// The groups of a streaming load to a device. Nothing is read until a group is copied.
pub struct DeviceStream {
    /// Per file: its reader, with O_DIRECT where it is not resident.
    readers: Vec<BlockReader>,
    budget: u64,
    groups: Vec<PlannedGroup>,
    staging: StagingOptions,
    /// A verified stream's checks: a group is handed out after the files before its own
    /// have passed, and the last group after its file has.
    checks: load::Checks,
}

impl DeviceStream {
    /// Plans `planned` (its selection) into groups of at most `options.group` bytes.
    pub fn open(planned: Planned, options: &StreamOptions) -> Result<DeviceStream> {
        let checks = planned.checks.clone();
        let (sources, groups) = stream::plan_groups(planned, options);
        checks.require_covered(groups.iter().map(|(e, t)| (e, &t[..])))?;
        let how = load::choose_reads(&sources, groups.iter().map(|(e, _)| e), options.reader, false, false)?;
        let readers = sources
            .into_iter()
            .zip(how)
            .map(|(src, how)| BlockReader::open(src, how == HostRead::Direct))
            .collect::<Result<Vec<_>>>()?;
        let staging = StagingOptions { block: options.block, ..StagingOptions::default() };
        Ok(DeviceStream { readers, budget: options.budget, groups, staging, checks })
    }

    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    /// Device memory the groups submitted and not yet handed out may take together (beyond
    /// one group ahead, which is always allowed).
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Group `k`'s tensors; their offsets are file offsets (see [`DeviceStream::offset_of`]).
    pub fn tensors(&self, k: usize) -> &[Placement] {
        &self.groups[k].1
    }

    /// Where tensor `t` of group `k` starts, from where the group's first byte landed.
    pub fn offset_of(&self, k: usize, t: &Placement) -> u64 {
        self.groups[k].0.offset_of(t)
    }

    /// Bytes to allocate for group `k`: its extent, and room to start it at an aligned address
    /// whatever the allocation's alignment.
    pub fn alloc_len(&self, k: usize) -> u64 {
        self.groups[k].0.len + IO_ALIGN
    }

    /// Index of the file group `k` is read from, and its path.
    pub fn file(&self, k: usize) -> (usize, &std::path::Path) {
        let file = self.groups[k].0.file;
        (file, self.readers[file].source().path())
    }

    pub fn tensor_count(&self) -> usize {
        self.groups.iter().map(|g| g.1.len()).sum()
    }

    pub fn byte_count(&self) -> u64 {
        self.groups.iter().flat_map(|g| &g.1).map(|t| t.nbytes).sum()
    }

    /// Copies group `k` into the allocation at `base` (`alloc_len(k)` bytes) through `device`'s
    /// staging ring, ordered after the allocation's previous work. When this returns, every
    /// copy it queued has completed. Fails if the file changed meanwhile.
    pub fn copy_group<D: Device>(&self, device: &D, k: usize, base: u64) -> Result<DeviceCopy> {
        let Some((extent, _)) = self.groups.get(k) else {
            return Err(Error::InvalidArgument(format!("no group {k} (of {})", self.groups.len())));
        };
        let reader = &self.readers[extent.file];
        let dst = base.next_multiple_of(IO_ALIGN);
        let check = self.checks.file(extent.file);
        let range = StagedFile { reader, dst, start: extent.start, len: extent.len, check };
        let path =
            staged::copy_files(device, std::slice::from_ref(&range), &self.staging)?.pop().unwrap_or(ReadPath::NotRead);
        reader.source().check_unchanged()?;
        // Groups are copied in order: the files before this one are read whole by now.
        let last_of_file = self.groups.get(k + 1).is_none_or(|(next, _)| next.file != extent.file);
        let through = if last_of_file { extent.file + 1 } else { extent.file };
        self.checks.files.iter().take(through).try_for_each(|c| c.finish())?;
        Ok(DeviceCopy { path, offset: dst - base })
    }
}

/// Copies the groups of a [`DeviceStream`] in the background, in the order they are submitted.
/// Dropping it skips what is queued and waits for the copy running.
pub struct Copier {
    stream: Arc<DeviceStream>,
    jobs: Option<Sender<Job>>,
    done: Arc<(Mutex<Done>, Condvar)>,
    worker: Option<JoinHandle<()>>,
}

struct Job {
    group: usize,
    base: u64,
    /// What the device needs to order the copy after the allocation's previous work (on CUDA
    /// a `CUevent` recorded on torch's stream; the submitter keeps it alive until `wait`).
    ready: u64,
}

#[derive(Default)]
struct Done {
    /// Groups submitted and not yet waited for.
    submitted: HashSet<usize>,
    results: HashMap<usize, Result<DeviceCopy>>,
    cancelled: bool,
}

impl Copier {
    /// Starts the copying thread. `device(ready)` gives the device to copy a job with.
    pub fn start<D, R, F>(stream: DeviceStream, device: F) -> Result<Copier>
    where
        D: Device,
        R: Deref<Target = D>,
        F: Fn(u64) -> Result<R> + Send + 'static,
    {
        let stream = Arc::new(stream);
        let done: Arc<(Mutex<Done>, Condvar)> = Arc::default();
        let (tx, rx) = channel::<Job>();
        let worker = {
            let (stream, done) = (Arc::clone(&stream), Arc::clone(&done));
            std::thread::Builder::new()
                .name("fastsafetensors-device-stream".into())
                .spawn(move || {
                    for job in rx {
                        if done.0.lock().unwrap_or_else(PoisonError::into_inner).cancelled {
                            continue;
                        }
                        let copied = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            device(job.ready).and_then(|d| stream.copy_group(&*d, job.group, job.base))
                        }))
                        .unwrap_or_else(|panic| Err(Error::from_panic(panic)));
                        done.0.lock().unwrap_or_else(PoisonError::into_inner).results.insert(job.group, copied);
                        done.1.notify_all();
                    }
                })
                .map_err(|e| Error::io(std::path::PathBuf::new(), "start a thread", e))?
        };
        Ok(Copier { stream, jobs: Some(tx), done, worker: Some(worker) })
    }

    pub fn stream(&self) -> &DeviceStream {
        &self.stream
    }

    /// Queues group `k`'s copy into the allocation at `base`.
    pub fn submit(&self, group: usize, base: u64, ready: u64) -> Result<()> {
        if group >= self.stream.group_count() {
            return Err(Error::InvalidArgument(format!("no group {group} (of {})", self.stream.group_count())));
        }
        let jobs = self.jobs.as_ref().ok_or_else(|| Error::InvalidArgument("the stream is closed".into()))?;
        if !self.done.0.lock().unwrap_or_else(PoisonError::into_inner).submitted.insert(group) {
            return Err(Error::InvalidArgument(format!("group {group} was submitted already")));
        }
        jobs.send(Job { group, base, ready }).map_err(|_| Error::Panic("the copying thread has stopped".into()))
    }

    /// Blocks until group `k`'s copy (submitted before) is done; where the group landed.
    pub fn wait(&self, group: usize) -> Result<DeviceCopy> {
        let (lock, cv) = &*self.done;
        let mut done = lock.lock().unwrap_or_else(PoisonError::into_inner);
        if !done.submitted.remove(&group) {
            return Err(Error::InvalidArgument(format!("group {group} was not submitted")));
        }
        loop {
            if let Some(result) = done.results.remove(&group) {
                return result;
            }
            if self.worker.as_ref().is_none_or(|w| w.is_finished()) {
                return Err(Error::Panic(format!("group {group} was never copied")));
            }
            done = cv.wait(done).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        self.done.0.lock().unwrap_or_else(PoisonError::into_inner).cancelled = true;
        self.jobs = None; // ends the worker's loop once the queue is drained (skipped)
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
