//! Streaming: the selected tensors handed out group by group as their bytes arrive, while
//! the reads of later groups go on in the background, within a memory budget.
//!
//! ```no_run
//! use fastsafetensors::load::plan_files;
//! use fastsafetensors::load::stream::{StreamOptions, TensorStream};
//! let planned = plan_files(&["model-00001.safetensors".into()])?;
//! let mut stream = TensorStream::open(planned, StreamOptions::with_budget(256 << 20))?;
//! while let Some(group) = stream.next_group()? {
//!     for t in &group.tensors {
//!         println!("{}: {} bytes", t.name, group.bytes(t).len());
//!     }
//! } // dropping the stream before its end stops its reads
//! # Ok::<(), fastsafetensors::Error>(())
//! ```
//!
//! The selected tensors are planned into extents of at most [`StreamOptions::group`] bytes
//! ([`plan::plan_extents`]); each extent is a group. A scheduler thread admits the groups in
//! order while they fit the budget and, while less than half of it is in use, alternately the
//! next group of one of the next few files (several files read at once, as a bulk load reads
//! them); it allocates (or, for a file in the page cache, maps) each one's buffer and queues
//! its block reads on the I/O pool. The consumer takes the groups in order, each once all its
//! reads have completed.
//!
//! Memory: a group's buffer holds its reservation on the budget until the buffer is freed,
//! that is until the last tensor into it is dropped, so the budget bounds the buffers being
//! read, those read and waiting, and those handed out and still referenced. A group is
//! admitted over the budget only when the consumer is waiting for it: a tensor larger than
//! the budget still loads (alone), and a consumer that keeps every tensor gets them all, one
//! group at a time, instead of waiting forever.
//!
//! Dropping the stream cancels it: queued reads are skipped, the scheduler is joined, and the
//! drop returns once no read of the stream is running. Each group's file is checked to be
//! unchanged before the group is handed out; a file that changed or shrank mid-stream ends
//! the stream with [`Error::Changed`] or [`Error::Truncated`].

use std::collections::{BTreeMap, HashMap};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

use super::Checks;
use crate::error::{Error, Result};
use crate::source::direct::{self, BlockReader, FillTarget};
use memmap2::MmapMut;

use crate::load::{self, Planned};
use crate::plan::{self, Extent, ExtentPolicy, Placement, IO_ALIGN};
use crate::source::{self, io_pool, HostBuffer, HostRead, ReadPath, ReaderKind, Source};

/// Largest group when the budget allows it: large enough that a group's reads keep several
/// I/O threads busy, small beside any budget worth setting.
pub const DEFAULT_GROUP: u64 = 32 << 20;

/// Files a stream reads at once: the consumer's, and up to this many minus one ahead.
const LANES: usize = 4;

#[derive(Debug, Clone)]
pub struct StreamOptions {
    pub reader: ReaderKind,
    /// Bytes per read request.
    pub block: u64,
    /// Largest gap between selected tensors that is read rather than skipped.
    pub max_gap: u64,
    /// Bytes of buffers the stream may hold at once (`u64::MAX`: no limit).
    pub budget: u64,
    /// Largest group, unless a single tensor is larger.
    pub group: u64,
}

impl StreamOptions {
    /// Defaults for `budget`, with groups of [`group_for`]`(budget)`.
    pub fn with_budget(budget: u64) -> StreamOptions {
        StreamOptions {
            reader: ReaderKind::Auto,
            block: plan::DEFAULT_BLOCK,
            max_gap: plan::DEFAULT_MAX_GAP,
            budget,
            group: group_for(budget),
        }
    }
}

/// A group as planned: its extent and its tensors.
pub(crate) type PlannedGroup = (Extent, Vec<Placement>);

/// The selected tensors cut into the groups a stream hands out: extents of at most
/// `options.group` bytes (a larger tensor alone), each with its tensors, in read order.
pub(crate) fn plan_groups(planned: Planned, options: &StreamOptions) -> (Vec<Arc<dyn Source>>, Vec<PlannedGroup>) {
    let policy = ExtentPolicy { align: IO_ALIGN, max_gap: options.max_gap, max_len: options.group };
    let extents = plan::plan_extents(&planned.tensors, &planned.file_lens(), &policy);
    let mut tensors = planned.tensors.into_iter();
    let groups = extents
        .into_iter()
        .map(|e| {
            let members = tensors.by_ref().take(e.tensors.len()).collect();
            (e, members)
        })
        .collect();
    (planned.sources, groups)
}

/// The group size for a budget: a quarter of it, so that several groups are read while the
/// consumer works on one, within [`IO_ALIGN`] and [`DEFAULT_GROUP`].
pub fn group_for(budget: u64) -> u64 {
    (budget / 4).clamp(IO_ALIGN, DEFAULT_GROUP)
}

/// Tensors whose bytes have arrived, and the buffer they are in.
pub struct Group {
    pub file: usize,
    /// File offset of the buffer's first byte.
    pub start: u64,
    pub buffer: Arc<HostBuffer>,
    pub tensors: Vec<Placement>,
    pub read_path: ReadPath,
}

impl Group {
    /// Where tensor `t` (one of this group's) starts in the buffer.
    pub fn offset_of(&self, t: &Placement) -> u64 {
        t.offset - self.start
    }

    pub fn bytes(&self, t: &Placement) -> &[u8] {
        let offset = self.offset_of(t) as usize;
        &self.buffer.as_slice()[offset..offset + t.nbytes as usize]
    }
}

/// A load that hands out its tensors group by group. See the module documentation.
pub struct TensorStream {
    shared: Arc<Shared>,
    sources: Vec<Arc<dyn Source>>,
    readers: Vec<Option<Arc<BlockReader>>>,
    pending: Option<Receiver<(usize, Result<Pending>)>>,
    /// Groups that arrived ahead of their turn (read ahead in a later file).
    arrived: HashMap<usize, Result<Pending>>,
    scheduler: Option<JoinHandle<()>>,
    next: usize,
    groups: usize,
    tensors: usize,
    bytes: u64,
    finished: bool,
    /// A verified stream's checks, and how many files (in order) have passed theirs.
    checks: Checks,
    checked: usize,
}

impl TensorStream {
    /// Starts reading the tensors of `planned` (its selection) in the background.
    pub fn open(planned: Planned, options: StreamOptions) -> Result<TensorStream> {
        let (tensors, bytes) = (planned.tensors.len(), planned.tensors.iter().map(|t| t.nbytes).sum());
        let checks = planned.checks.clone();
        let (sources, groups) = plan_groups(planned, &options);
        checks.require_covered(groups.iter().map(|(e, t)| (e, &t[..])))?;
        // Without a budget the caller keeps everything, as a load that returns it all does.
        let keeps_all = options.budget == u64::MAX;
        let verified = !checks.files.is_empty();
        let how = load::choose_reads(&sources, groups.iter().map(|(e, _)| e), options.reader, keeps_all, verified)?;
        // A reader for each file read into the stream's memory; files mapped (or with nothing
        // selected) have none.
        let mut readers = vec![None; sources.len()];
        for (i, src) in sources.iter().enumerate() {
            if how[i].owns_memory() {
                readers[i] = Some(Arc::new(BlockReader::open(Arc::clone(src), how[i] == HostRead::Direct)?));
            }
        }
        let shared = Arc::new(Shared::new(options.budget, plan::align_up(options.group, IO_ALIGN)));
        let (tx, rx) = channel();
        let mapped = how
            .iter()
            .map(|&h| if h == HostRead::MapOverLimit { ReadPath::MmapFallback } else { ReadPath::Mmap })
            .collect();
        let work = Schedule {
            shared: Arc::clone(&shared),
            sources: sources.clone(),
            readers: readers.clone(),
            mapped,
            groups,
            options,
            checks: checks.clone(),
        };
        let groups = work.groups.len();
        let scheduler =
            std::thread::Builder::new().name("fastsafetensors-stream".into()).spawn(move || work.run(tx)).map_err(
                |e| Error::io(sources.first().map(|s| s.path().to_owned()).unwrap_or_default(), "start a thread", e),
            )?;
        Ok(TensorStream {
            shared,
            sources,
            readers,
            pending: Some(rx),
            arrived: HashMap::new(),
            scheduler: Some(scheduler),
            next: 0,
            groups,
            tensors,
            bytes,
            finished: false,
            checks,
            checked: 0,
        })
    }

    /// The path of file `index`.
    pub fn path(&self, index: usize) -> &std::path::Path {
        self.sources[index].path()
    }

    /// Tensors the stream hands out in all.
    pub fn tensor_count(&self) -> usize {
        self.tensors
    }

    /// Bytes of tensor data the stream hands out in all.
    pub fn byte_count(&self) -> u64 {
        self.bytes
    }

    /// Groups the stream hands out in all.
    pub fn group_count(&self) -> usize {
        self.groups
    }

    /// A view of the stream's memory and reads that outlives it.
    pub fn monitor(&self) -> StreamMonitor {
        StreamMonitor(Arc::clone(&self.shared))
    }

    /// The next group, once all its bytes have arrived; `None` after the last. After an
    /// error the stream is stopped and returns `None`.
    pub fn next_group(&mut self) -> Result<Option<Group>> {
        if self.finished {
            return Ok(None);
        }
        if self.next == self.groups {
            // The last files' digests, before the stream says it is complete.
            let checked = self.check_files_before(self.sources.len());
            self.stop();
            return checked.map(|()| None);
        }
        let index = self.next;
        self.shared.update(|s| s.waiting_for = Some(index));
        let received = self.receive(index);
        let result = match received {
            Ok(Ok(pending)) => pending.wait(&self.readers).and_then(|group| {
                self.sources[group.file].check_unchanged()?;
                // No tensor of a file is handed out before the files before it have passed.
                self.check_files_before(group.file)?;
                Ok(group)
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(Error::Panic(format!("the stream ended after {index} of {} groups", self.groups))),
        };
        self.shared.update(|s| s.waiting_for = None);
        match result {
            Ok(group) => {
                self.next += 1;
                Ok(Some(group))
            }
            Err(e) => {
                self.stop();
                Err(e)
            }
        }
    }

    /// Finishes the checks of the files before `file` not yet checked (their reads are all
    /// done: groups are handed out in file order).
    fn check_files_before(&mut self, file: usize) -> Result<()> {
        while self.checked < file.min(self.checks.files.len()) {
            self.checks.files[self.checked].finish()?;
            self.checked += 1;
        }
        Ok(())
    }

    /// Group `index` as the scheduler sent it, keeping those that come first for later.
    fn receive(&mut self, index: usize) -> std::result::Result<Result<Pending>, std::sync::mpsc::RecvError> {
        if let Some(found) = self.arrived.remove(&index) {
            return Ok(found);
        }
        let rx = self.pending.as_ref().expect("a running stream has its receiver");
        loop {
            let (k, pending) = rx.recv()?;
            if k == index {
                return Ok(pending);
            }
            self.arrived.insert(k, pending);
        }
    }

    /// Cancels what is still queued, joins the scheduler and waits for running reads.
    fn stop(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        self.shared.update(|s| s.cancelled = true);
        self.pending = None;
        self.arrived.clear();
        if let Some(scheduler) = self.scheduler.take() {
            // The scheduler catches its own panics; an error here could only be one in that.
            let _ = scheduler.join();
        }
        let mut state = self.shared.lock();
        while state.tasks > 0 {
            state = self.shared.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        let idle = std::mem::take(&mut state.idle);
        state.used -= idle.len() as u64 * self.shared.pooled_len;
        drop(state);
        drop(idle);
    }
}

impl Drop for TensorStream {
    fn drop(&mut self) {
        self.stop();
    }
}

/// How much memory a stream's buffers hold and how many of its reads are queued or running,
/// also after the stream is dropped (its buffers live as long as their tensors).
pub struct StreamMonitor(Arc<Shared>);

impl StreamMonitor {
    /// Bytes reserved by the stream's buffers alive (being read, waiting or handed out).
    pub fn memory_in_use(&self) -> u64 {
        self.0.lock().used
    }

    /// Block reads queued or running.
    pub fn reads_in_flight(&self) -> usize {
        self.0.lock().tasks
    }
}

/// What the scheduler, the reads and the consumer share.
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    budget: u64,
    /// Size of the buffers groups are read into and that are kept for reuse: groups up to
    /// this size. Larger groups (one large tensor) and mappings get buffers of their own.
    pooled_len: u64,
}

#[derive(Default)]
struct State {
    cancelled: bool,
    /// Bytes reserved by buffers alive, idle ones included.
    used: u64,
    /// Buffers of `pooled_len` bytes whose tensors are gone, kept for the next groups: reading
    /// into memory already faulted in saves allocating and zeroing it again.
    idle: Vec<MmapMut>,
    /// The group the consumer is blocked on.
    waiting_for: Option<usize>,
    /// Block reads queued or running.
    tasks: usize,
}

impl Shared {
    fn new(budget: u64, pooled_len: u64) -> Shared {
        Shared { state: Mutex::default(), changed: Condvar::new(), budget, pooled_len }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn update(&self, f: impl FnOnce(&mut State)) {
        f(&mut self.lock());
        self.changed.notify_all();
    }

    fn cancelled(&self) -> bool {
        self.lock().cancelled
    }

    /// Blocks until group `index` may have `bytes` of memory: an idle buffer (for a pooled
    /// size), or new memory while it fits the budget or the consumer is waiting for this
    /// group. `None` once the stream is cancelled.
    fn admit(self: &Arc<Self>, index: usize, bytes: u64, pooled: bool) -> Option<(Reservation, Option<MmapMut>)> {
        let mut state = self.lock();
        loop {
            if state.cancelled {
                return None;
            }
            if pooled {
                if let Some(map) = state.idle.pop() {
                    // The idle buffer's share of the budget passes to the new reservation.
                    return Some((Reservation { shared: Arc::clone(self), bytes, pooled }, Some(map)));
                }
            }
            // Idle buffers are memory no one uses: free them to make room.
            while state.used.saturating_add(bytes) > self.budget && !state.idle.is_empty() {
                state.idle.pop();
                state.used -= self.pooled_len;
            }
            if state.used.saturating_add(bytes) <= self.budget || state.waiting_for == Some(index) {
                state.used += bytes;
                return Some((Reservation { shared: Arc::clone(self), bytes, pooled }, None));
            }
            state = self.changed.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

impl Shared {
    /// Memory for group `index` now, if it fits within `limit` bytes in use (an idle buffer
    /// for a pooled size, or new memory); `None` otherwise, without waiting.
    fn try_admit(self: &Arc<Self>, bytes: u64, pooled: bool, limit: u64) -> Option<(Reservation, Option<MmapMut>)> {
        let mut state = self.lock();
        if state.cancelled {
            return None;
        }
        if pooled && !state.idle.is_empty() && state.used <= limit {
            let map = state.idle.pop();
            return Some((Reservation { shared: Arc::clone(self), bytes, pooled }, map));
        }
        if state.used.saturating_add(bytes) > limit {
            return None;
        }
        state.used += bytes;
        Some((Reservation { shared: Arc::clone(self), bytes, pooled }, None))
    }
}

/// Bytes of the budget held by one buffer: kept with the buffer when it goes back to the pool,
/// given back when its memory is freed.
struct Reservation {
    shared: Arc<Shared>,
    bytes: u64,
    pooled: bool,
}

impl Reservation {
    /// Takes the memory of a buffer whose last tensor is gone: into the pool while the stream
    /// runs and is within its budget, else freed (and the reservation with it).
    fn release(mut self, map: MmapMut) {
        let mut state = self.shared.lock();
        let keep = self.pooled && !state.cancelled && state.used <= self.shared.budget;
        if keep {
            state.idle.push(map);
            self.bytes = 0; // now held by the idle buffer
            drop(state);
            self.shared.changed.notify_all();
        } else {
            drop(state);
            drop(map);
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let bytes = self.bytes;
        if bytes > 0 {
            self.shared.update(|s| s.used -= bytes);
        }
    }
}

/// A group whose buffer exists and whose reads (if any) are queued.
struct Pending {
    group: Group,
    reads: Option<Arc<Completion>>,
}

impl Pending {
    fn wait(mut self, readers: &[Option<Arc<BlockReader>>]) -> Result<Group> {
        if let Some(reads) = self.reads {
            reads.wait()?;
            self.group.read_path = readers[self.group.file].as_ref().map_or(ReadPath::Mmap, |r| r.path());
        }
        Ok(self.group)
    }
}

/// The outstanding reads of one group and the first error among them.
struct Completion {
    state: Mutex<(usize, Option<Error>)>,
    done: Condvar,
}

impl Completion {
    fn new(reads: usize) -> Completion {
        Completion { state: Mutex::new((reads, None)), done: Condvar::new() }
    }

    fn finish(&self, result: Result<()>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.0 -= 1;
        if let Err(e) = result {
            state.1.get_or_insert(e);
        }
        if state.0 == 0 {
            self.done.notify_all();
        }
    }

    fn wait(&self) -> Result<()> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while state.0 > 0 {
            state = self.done.wait(state).unwrap_or_else(PoisonError::into_inner);
        }
        state.1.take().map_or(Ok(()), Err)
    }
}

/// The scheduler's work: the groups in order, and how to read each file.
struct Schedule {
    shared: Arc<Shared>,
    sources: Vec<Arc<dyn Source>>,
    readers: Vec<Option<Arc<BlockReader>>>,
    /// How each file without a reader is mapped: as it is in the page cache, or over the limit.
    mapped: Vec<ReadPath>,
    groups: Vec<PlannedGroup>,
    options: StreamOptions,
    checks: Checks,
}

impl Schedule {
    /// Admits and starts the groups: in order, and, while less than half the budget is in
    /// use, alternately the first group not yet started of one of the next files. A disk (or
    /// the host under a VM) serves several sequential streams faster than one: a bulk load
    /// reads all its files at once, and a stream without this reads one file at a time.
    fn run(mut self, tx: Sender<(usize, Result<Pending>)>) {
        let mut groups: Vec<Option<PlannedGroup>> = std::mem::take(&mut self.groups).into_iter().map(Some).collect();
        // Each file's groups are a run of indexes; `next[f]`: the first of file f not started.
        let mut next: BTreeMap<usize, usize> = BTreeMap::new();
        for (i, g) in groups.iter().enumerate().rev() {
            next.insert(g.as_ref().expect("not started yet").0.file, i);
        }
        let mut lowest = 0;
        let mut turn = 0;
        while lowest < groups.len() {
            let current = groups[lowest].as_ref().expect("the lowest not started").0.file;
            let ahead: Vec<usize> =
                next.range(current + 1..).take(LANES - 1).map(|(_, &i)| i).filter(|&i| groups[i].is_some()).collect();
            turn += 1;
            let index = if !ahead.is_empty() && turn % 2 == 0 { ahead[(turn / 2 - 1) % ahead.len()] } else { lowest };
            let (extent, tensors) = groups[index].take().expect("each group starts once");
            let pooled = self.readers[extent.file].is_some() && extent.len <= self.shared.pooled_len;
            let bytes = if pooled { self.shared.pooled_len } else { extent.len };
            let admitted = if index == lowest {
                self.shared.admit(index, bytes, pooled)
            } else {
                match self.shared.try_admit(bytes, pooled, self.shared.budget / 2) {
                    Some(admitted) => Some(admitted),
                    None if self.shared.cancelled() => None,
                    None => {
                        groups[index] = Some((extent, tensors)); // not now: the in-order one next
                        continue;
                    }
                }
            };
            let Some((reservation, reused)) = admitted else { return };
            let file = extent.file;
            let started = catch_unwind(AssertUnwindSafe(|| self.start(extent, tensors, reservation, reused)))
                .unwrap_or_else(|panic| Err(Error::from_panic(panic)));
            let failed = started.is_err();
            if tx.send((index, started)).is_err() || failed {
                return;
            }
            // The file's next group, and the lowest group not started.
            match groups.get(index + 1) {
                Some(Some(g)) if g.0.file == file => next.insert(file, index + 1),
                _ => next.remove(&file),
            };
            while lowest < groups.len() && groups[lowest].is_none() {
                lowest += 1;
            }
        }
    }

    /// Allocates or maps the group's buffer and queues its reads.
    fn start(
        &self,
        extent: Extent,
        tensors: Vec<Placement>,
        reservation: Reservation,
        reused: Option<MmapMut>,
    ) -> Result<Pending> {
        let src = &self.sources[extent.file];
        let buffer_len = reservation.bytes;
        let group = |buffer: HostBuffer, read_path| Group {
            file: extent.file,
            start: extent.start,
            buffer: Arc::new(buffer.on_drop(Box::new(move |map| reservation.release(map)))),
            tensors,
            read_path,
        };
        let check = self.checks.files.get(extent.file).cloned();
        let Some(reader) = &self.readers[extent.file] else {
            let path = self.mapped[extent.file];
            let group = group(source::map_extent(&**src, &extent, path)?, path);
            if let Some(check) = check {
                check.landed_in(extent.start, &group.buffer, 0, extent.expected as usize);
            }
            return Ok(Pending { group, reads: None });
        };
        let block = plan::io_block(self.options.block);
        let blocks = extent.blocks(src.len(), IO_ALIGN, block);
        let mut map = match reused {
            Some(map) => map,
            None => direct::alloc_for_reads(buffer_len, src.path())?,
        };
        let target = FillTarget(map.as_mut_ptr());
        let group = group(HostBuffer::new(map, reader.path()), reader.path());
        let reads = Arc::new(Completion::new(blocks.len()));
        self.shared.update(|s| s.tasks += blocks.len());
        for b in blocks {
            let (shared, reader, reads, buffer, check) = (
                Arc::clone(&self.shared),
                Arc::clone(reader),
                Arc::clone(&reads),
                Arc::clone(&group.buffer),
                check.clone(),
            );
            let at = (b.offset - extent.start) as usize;
            io_pool().spawn(move || {
                let result = if shared.cancelled() {
                    Ok(()) // nobody will look at this group
                } else {
                    // SAFETY: [at, at + b.len) lies inside the buffer (the extent's blocks
                    // cover it exactly), which `buffer` keeps alive; no other read writes it.
                    let dst = unsafe { target.slice(at, b.len as usize) };
                    // A remote read stops waiting once the stream is dropped.
                    let live = Arc::clone(&shared);
                    let wanted: source::Wanted = Arc::new(move || !live.cancelled());
                    catch_unwind(AssertUnwindSafe(|| {
                        source::read_while(wanted, || reader.read(&b, dst))?;
                        if let Some(check) = &check {
                            check.landed_in(b.offset, &buffer, at, b.expected as usize);
                        }
                        Ok(())
                    }))
                    .unwrap_or_else(|p| Err(Error::from_panic(p)))
                };
                drop(buffer);
                reads.finish(result);
                shared.update(|s| s.tasks -= 1);
            });
        }
        Ok(Pending { group, reads: Some(reads) })
    }
}
