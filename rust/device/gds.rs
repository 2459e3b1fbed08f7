//! The GPUDirect Storage path: cuFile DMAs file blocks straight into device memory.
//!
//! All files are read at once: the blocks of every file, in file then offset order, are handed
//! out one at a time to the I/O threads, so files overlap and nothing waits at a chunk
//! boundary. Each thread makes the destination's device current before its first cuFile call
//! (cuFile works in the calling thread's CUDA context) and restores the previous one after.
//!
//! The destination is registered with cuFile in chunks of at most `register_chunk` bytes
//! (registration pins BAR space, which is limited): the first block read into a chunk
//! registers it, the last one deregisters it, so only the chunks being read — a few, as the
//! blocks go out in order — are registered at once. Destinations start 4 KiB aligned (the
//! loader places them so), and chunks start at whole blocks, so every registered range is 4 KiB
//! aligned: otherwise cuFile would bounce through buffers of its own.
//!
//! cuFile reads are not ordered with any CUDA stream, so the work the destination's previous
//! owner queued is waited for on the host first. The first failure stops the reads; every
//! registration is undone on success and on failure; each file says whether it was read whole,
//! for the caller to read the others on the staged path (or fail, when GDS was required).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::device::cufile::{self, CuFileApi, CuFileLibrary, FileHandle};
use crate::device::Device;
use crate::plan::{self, ReadBlock, IO_ALIGN};
use crate::source::{io_pool, LocalFile, Source};

/// Whether to use GPUDirect Storage (the `nogds` argument of fastsafetensors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GdsMode {
    /// Where the nvidia-fs driver is loaded and cuFile is not in compatibility mode; the
    /// staged path otherwise or on failure.
    #[default]
    Auto,
    /// Never (`nogds=True`).
    Never,
    /// Always, failing clearly if it cannot (`nogds=False`).
    Require,
}

impl GdsMode {
    pub fn from_nogds(nogds: Option<bool>) -> GdsMode {
        match nogds {
            None => GdsMode::Auto,
            Some(true) => GdsMode::Never,
            Some(false) => GdsMode::Require,
        }
    }
}

/// cuFile for a load in `mode`, or why it is not used: in `Auto` mode only where the nvidia-fs
/// driver is loaded (without it cuFile only emulates GDS, slower than the staged path). Call
/// only once a context exists on a real device.
pub fn cufile_for(mode: GdsMode) -> std::result::Result<&'static CuFileLibrary, &'static str> {
    match mode {
        GdsMode::Never => Err("disabled (nogds=True)"),
        GdsMode::Auto if !cufile::nvidia_fs_loaded() => Err("the nvidia-fs driver is not loaded"),
        _ => cufile::shared(),
    }
}

#[derive(Debug, Clone, Copy)]
pub struct GdsOptions {
    pub block: u64,
    /// Most bytes of destination one registration covers.
    pub register_chunk: u64,
}

impl Default for GdsOptions {
    fn default() -> Self {
        GdsOptions { block: plan::DEFAULT_BLOCK, register_chunk: 256 << 20 }
    }
}

/// One file and where its byte 0 goes in device memory (`align_up(len, 4096)` bytes there,
/// starting 4 KiB aligned). cuFile reads through a file descriptor: only a local file can be
/// read this way.
pub struct GdsFile<'a> {
    pub file: &'a LocalFile,
    pub dst: u64,
}

/// What became of one file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GdsOutcome {
    /// Read whole.
    Read,
    /// This file's read failed, for this reason.
    Failed(String),
    /// Not read whole: the reads stopped at another file's failure.
    Stopped,
}

/// Reads every file whole into device memory.
pub fn read_files<D: Device, A: CuFileApi>(
    device: &D,
    api: &A,
    files: &[GdsFile],
    options: &GdsOptions,
) -> Vec<GdsOutcome> {
    let read = device.wait_ready().and_then(|()| device.with_current(|| read_all(device, api, files, options)));
    read.unwrap_or_else(|e| files.iter().map(|_| GdsOutcome::Failed(e.to_string())).collect())
}

/// `read_files` once the destination's device is current on the calling thread.
fn read_all<D: Device, A: CuFileApi>(device: &D, api: &A, files: &[GdsFile], options: &GdsOptions) -> Vec<GdsOutcome> {
    let block = plan::io_block(options.block);
    let chunk_len = plan::align_up(options.register_chunk.max(block), block);
    let reads = Reads::new(files, block, chunk_len);

    let opened: Vec<_> = files.iter().map(|f| Opened::open(api, f.file)).collect();
    for (i, o) in opened.iter().enumerate() {
        if let Err(reason) = o {
            reads.fail(i, reason.clone());
        }
    }
    let handles: Vec<_> = opened.iter().map(|o| o.as_ref().map(|o| o.handle).ok()).collect();
    let threads = io_pool().current_num_threads().min(reads.jobs.len()).max(1);
    let run = io_pool().install(|| {
        (0..threads).into_par_iter().try_for_each(|_| device.with_current(|| reads.work(api, files, &handles)))
    });
    if let Err(e) = run {
        reads.stop_all(e.to_string());
    }
    reads.deregister_all(api, files);
    drop(opened);
    reads.outcomes()
}

/// A file opened with `O_DIRECT` and registered with cuFile; deregistered when dropped.
struct Opened<'a, A: CuFileApi> {
    api: &'a A,
    handle: FileHandle,
    _file: File,
}

impl<'a, A: CuFileApi> Opened<'a, A> {
    fn open(api: &'a A, src: &LocalFile) -> Result<Opened<'a, A>, String> {
        // The file opened, whatever its path names now.
        let file = src.reopen(libc::O_DIRECT).map_err(|e| format!("open with O_DIRECT failed: {e}"))?;
        let handle = api.register_handle(file.as_raw_fd())?;
        Ok(Opened { api, handle, _file: file })
    }
}

impl<A: CuFileApi> Drop for Opened<'_, A> {
    fn drop(&mut self) {
        self.api.deregister_handle(self.handle);
    }
}

/// One block to read, and the registration chunk it lies in.
struct Job {
    file: usize,
    block: ReadBlock,
    chunk: usize,
}

/// A range of one file's destination registered as one: `len` bytes at `start`.
struct Chunk {
    file: usize,
    start: u64,
    len: u64,
    state: Mutex<ChunkState>,
}

#[derive(Default)]
struct ChunkState {
    registered: bool,
    /// Why registering failed, for every block of the chunk.
    failed: Option<String>,
    /// Blocks not yet read (or failed).
    remaining: usize,
}

/// The shared state of one `read_files`: jobs handed out in order, chunks, and per file the
/// blocks left and the first failure.
struct Reads {
    jobs: Vec<Job>,
    chunks: Vec<Chunk>,
    next: AtomicUsize,
    stop: AtomicBool,
    remaining: Vec<AtomicUsize>,
    failures: Vec<Mutex<Option<String>>>,
}

impl Reads {
    fn new(files: &[GdsFile], block: u64, chunk_len: u64) -> Reads {
        let mut jobs = Vec::new();
        let mut chunks: Vec<Chunk> = Vec::new();
        let mut remaining = Vec::new();
        for (file, f) in files.iter().enumerate() {
            let blocks = plan::read_blocks(f.file.len(), IO_ALIGN, block);
            remaining.push(AtomicUsize::new(blocks.len()));
            for b in blocks {
                let start = b.offset / chunk_len * chunk_len;
                if chunks.last().is_none_or(|c| c.file != file || c.start != start) {
                    let state = Mutex::new(ChunkState::default());
                    chunks.push(Chunk { file, start, len: 0, state });
                }
                let chunk = chunks.last_mut().unwrap();
                chunk.len += b.len;
                chunk.state.get_mut().unwrap().remaining += 1;
                jobs.push(Job { file, block: b, chunk: chunks.len() - 1 });
            }
        }
        let failures = files.iter().map(|_| Mutex::new(None)).collect();
        Reads { jobs, chunks, next: AtomicUsize::new(0), stop: AtomicBool::new(false), remaining, failures }
    }

    /// Reads blocks until none are left or a read failed.
    fn work<A: CuFileApi>(&self, api: &A, files: &[GdsFile], handles: &[Option<FileHandle>]) {
        while !self.stop.load(Ordering::Relaxed) {
            let Some(job) = self.jobs.get(self.next.fetch_add(1, Ordering::Relaxed)) else { return };
            let Some(handle) = handles[job.file] else { continue };
            let chunk = &self.chunks[job.chunk];
            let dst = files[job.file].dst;
            let read =
                self.register(api, chunk, dst).and_then(|()| read_block(api, handle, dst, chunk.start, &job.block));
            self.finish_block(api, chunk, dst);
            match read {
                Ok(()) => {
                    self.remaining[job.file].fetch_sub(1, Ordering::Relaxed);
                }
                Err(reason) => self.fail(job.file, reason),
            }
        }
    }

    /// Registers the chunk unless done already; other blocks of it wait meanwhile.
    fn register<A: CuFileApi>(&self, api: &A, chunk: &Chunk, dst: u64) -> Result<(), String> {
        let mut state = chunk.state.lock().unwrap();
        if let Some(reason) = &state.failed {
            return Err(reason.clone());
        }
        if !state.registered {
            api.register_buffer(dst + chunk.start, chunk.len as usize)
                .inspect_err(|e| state.failed = Some(e.clone()))?;
            state.registered = true;
        }
        Ok(())
    }

    /// Counts a block of the chunk done; the last one deregisters it.
    fn finish_block<A: CuFileApi>(&self, api: &A, chunk: &Chunk, dst: u64) {
        let mut state = chunk.state.lock().unwrap();
        state.remaining -= 1;
        if state.remaining == 0 && state.registered {
            api.deregister_buffer(dst + chunk.start);
            state.registered = false;
        }
    }

    fn fail(&self, file: usize, reason: String) {
        self.failures[file].lock().unwrap().get_or_insert(reason);
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Every file not read whole failed for `reason` (the reads could not run at all).
    fn stop_all(&self, reason: String) {
        for (file, left) in self.remaining.iter().enumerate() {
            if left.load(Ordering::Relaxed) > 0 {
                self.failures[file].lock().unwrap().get_or_insert(reason.clone());
            }
        }
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Deregisters the chunks left registered when the reads stopped early.
    fn deregister_all<A: CuFileApi>(&self, api: &A, files: &[GdsFile]) {
        for chunk in &self.chunks {
            let mut state = chunk.state.lock().unwrap();
            if state.registered {
                api.deregister_buffer(files[chunk.file].dst + chunk.start);
                state.registered = false;
            }
        }
    }

    fn outcomes(&self) -> Vec<GdsOutcome> {
        self.remaining
            .iter()
            .zip(&self.failures)
            .map(|(left, failure)| match failure.lock().unwrap().take() {
                Some(reason) => GdsOutcome::Failed(reason),
                None if left.load(Ordering::Relaxed) == 0 => GdsOutcome::Read,
                None => GdsOutcome::Stopped,
            })
            .collect()
    }
}

/// Reads one block into the registered range at `base`, which is the file's byte `base_start`.
fn read_block<A: CuFileApi>(
    api: &A,
    handle: FileHandle,
    dst: u64,
    base_start: u64,
    b: &ReadBlock,
) -> Result<(), String> {
    let base = dst + base_start;
    let mut done = 0u64;
    while done < b.expected {
        let n = api.read(handle, base, (b.len - done) as usize, b.offset + done, b.offset - base_start + done)?;
        if n == 0 {
            return Err(format!("cuFileRead returned no data at offset {} (file truncated?)", b.offset + done));
        }
        done += n as u64;
    }
    Ok(())
}
