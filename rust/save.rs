//! Saving: the files of a [`SavePlan`] written through [`Sink`]s, the mirror of a load.
//!
//! Each file is cut into blocks of [`SaveOptions::block`] bytes; a few writers (one buffer
//! each, so host memory stays within the budget whatever the model's size) take the blocks
//! in file order, gather each one's bytes into a page-aligned buffer (the header, then the
//! tensors' bytes: copied from host memory, or copied off the device into a pinned staging
//! buffer through [`Device`]), and write it at its offset. While one writer waits for the
//! disk the others gather, so device-to-host copies overlap the writes. Then every file is
//! synced and published: one file renamed into place, a checkpoint directory committed as a
//! whole ([`commit`](crate::sink::commit) says how, and why no crash leaves a mix). A
//! [`SaveSession`] runs those steps, on one process or on each rank of a group: the ranks
//! write the byte ranges [`assign_ranges`](crate::plan::save::assign_ranges) gives them, and
//! the first commits once all are durable.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use memmap2::MmapMut;
use rayon::prelude::*;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::plan::save::{FileLayout, SavePlan, SaveTarget, WriteRange};
use crate::plan::{align_up, DEFAULT_BLOCK, IO_ALIGN};
use crate::sink::commit::{CheckpointDir, Commit};
use crate::sink::{publish, remove_stale_temps, FileSink, Sink};
use crate::source::io_pool;

/// Where a tensor's bytes are: host memory the caller keeps alive for the save, or a device
/// address (read through the save's [`Device`]).
#[derive(Debug, Clone, Copy)]
pub enum TensorBytes<'a> {
    Host(&'a [u8]),
    Device(u64),
    /// Held by another rank of a group save (this rank writes none of its bytes).
    Elsewhere,
}

/// How a save writes.
#[derive(Debug, Clone, Copy)]
pub struct SaveOptions {
    /// Bytes per write (a multiple of [`IO_ALIGN`]).
    pub block: u64,
    /// Writers, each holding one buffer of `block` bytes.
    pub writers: usize,
    /// `O_DIRECT` where the filesystem takes it.
    pub direct: bool,
}

impl SaveOptions {
    /// As many writers as I/O threads, with buffers that fit in `budget` bytes together.
    pub fn within(budget: u64, threads: usize) -> SaveOptions {
        let block = DEFAULT_BLOCK.min(align_up((budget / threads.max(1) as u64).max(IO_ALIGN), IO_ALIGN));
        let writers = ((budget / block) as usize).clamp(1, threads.max(1));
        SaveOptions { block, writers, direct: true }
    }
}

/// Where a writer's buffer comes from and how device bytes get into it.
pub trait Gather: Sync {
    type Buffer: Send;
    fn alloc(&self, len: usize) -> Result<Self::Buffer>;
    /// The buffer's bytes; only between copies (after `wait`).
    fn bytes<'b>(&self, buffer: &'b mut Self::Buffer) -> &'b mut [u8];
    /// Starts copying `len` bytes at device address `src` into `buffer[at..]`.
    fn fetch(&self, buffer: &mut Self::Buffer, at: usize, src: u64, len: usize) -> Result<()>;
    /// Waits for the copies started into `buffer`.
    fn wait(&self, buffer: &mut Self::Buffer) -> Result<()>;
    /// Hands a buffer back once its writer is done.
    fn release(&self, _buffer: Self::Buffer) {}
}

/// Buffers of page-aligned anonymous memory, for saves of host tensors.
pub struct HostGather;

impl Gather for HostGather {
    type Buffer = MmapMut;

    fn alloc(&self, len: usize) -> Result<MmapMut> {
        MmapMut::map_anon(len).map_err(|e| Error::io(Path::new("save buffer"), "allocate", e))
    }

    fn bytes<'b>(&self, buffer: &'b mut MmapMut) -> &'b mut [u8] {
        buffer
    }

    fn fetch(&self, _: &mut MmapMut, _: usize, src: u64, _: usize) -> Result<()> {
        Err(Error::InvalidArgument(format!("a host save was given device memory (address {src:#x})")))
    }

    fn wait(&self, _: &mut MmapMut) -> Result<()> {
        Ok(())
    }
}

/// Pinned staging buffers of a device, filled by its copies.
pub struct DeviceGather<'d, D: Device>(&'d D);

impl<'d, D: Device> DeviceGather<'d, D> {
    /// Orders the copies after the work already queued on the tensors (torch's stream).
    pub fn new(device: &'d D) -> Result<DeviceGather<'d, D>> {
        device.order_after_ready()?;
        Ok(DeviceGather(device))
    }
}

impl<D: Device> Gather for DeviceGather<'_, D> {
    type Buffer = D::Staging;

    fn alloc(&self, len: usize) -> Result<D::Staging> {
        match self.0.pool().take() {
            Some(staging) if self.0.staging_len(&staging) >= len => Ok(staging),
            _ => self.0.alloc_staging(len),
        }
    }

    fn bytes<'b>(&self, buffer: &'b mut D::Staging) -> &'b mut [u8] {
        self.0.bytes(buffer)
    }

    fn fetch(&self, buffer: &mut D::Staging, at: usize, src: u64, len: usize) -> Result<()> {
        self.0.copy_to_host_async(buffer, at, len, src)
    }

    fn wait(&self, buffer: &mut D::Staging) -> Result<()> {
        self.0.wait(buffer)
    }

    fn release(&self, mut buffer: D::Staging) {
        if self.0.wait(&mut buffer).is_ok() {
            self.0.pool().put(buffer);
        }
    }
}

/// One write: `len` bytes of file `file` at `offset`.
#[derive(Debug, Clone, Copy)]
struct Block {
    file: usize,
    offset: u64,
    len: u64,
}

/// Writes every file's bytes through its sink (not finished: see [`save`]).
pub fn write_files<S: Sink, G: Gather>(
    files: &[FileLayout],
    sinks: &[S],
    sources: &[TensorBytes],
    gather: &G,
    options: &SaveOptions,
) -> Result<()> {
    let whole: Vec<WriteRange> =
        files.iter().enumerate().map(|(file, f)| WriteRange { file, start: 0, end: f.len }).collect();
    write_ranges(files, sinks, &whole, sources, gather, options)
}

/// Writes `ranges` of the files through their sinks: each range's start is aligned for direct
/// writes (a multiple of [`ASSIGN_UNIT`](crate::plan::save::ASSIGN_UNIT), or 0), its end a multiple of it or the file's end.
pub fn write_ranges<S: Sink, G: Gather>(
    files: &[FileLayout],
    sinks: &[S],
    ranges: &[WriteRange],
    sources: &[TensorBytes],
    gather: &G,
    options: &SaveOptions,
) -> Result<()> {
    let block = options.block;
    let blocks: Vec<Block> = ranges
        .iter()
        .flat_map(|r| {
            (0..(r.end - r.start).div_ceil(block)).map(move |k| Block {
                file: r.file,
                offset: r.start + k * block,
                len: block.min(r.end - r.start - k * block),
            })
        })
        .collect();
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    let writer = || -> Result<()> {
        let mut buffer = gather.alloc(block as usize)?;
        let result = loop {
            let k = next.fetch_add(1, Ordering::Relaxed);
            if k >= blocks.len() || failed.load(Ordering::Relaxed) {
                break Ok(());
            }
            let b = blocks[k];
            if let Err(e) = write_block(&files[b.file], &sinks[b.file], b, sources, gather, &mut buffer) {
                let _ = gather.wait(&mut buffer); // no copy may still land in it
                break Err(e);
            }
        };
        gather.release(buffer);
        result
    };
    io_pool().scope(|scope| {
        for _ in 0..options.writers.clamp(1, blocks.len().max(1)) {
            scope.spawn(|_| {
                if let Err(e) = writer() {
                    failed.store(true, Ordering::Relaxed);
                    first_error.lock().unwrap().get_or_insert(e);
                }
            });
        }
    });
    first_error.into_inner().unwrap().map_or(Ok(()), Err)
}

/// Gathers one block's bytes (header, host tensors, then the device's copies) and writes it.
fn write_block<S: Sink, G: Gather>(
    file: &FileLayout,
    sink: &S,
    b: Block,
    sources: &[TensorBytes],
    gather: &G,
    buffer: &mut G::Buffer,
) -> Result<()> {
    let end = b.offset + b.len;
    let padded = if sink.direct() { align_up(b.len, IO_ALIGN) } else { b.len } as usize;
    let first = file.tensors.partition_point(|t| t.offset + t.nbytes <= b.offset);
    let pieces = file.tensors[first..].iter().take_while(|t| t.offset < end).filter(|t| t.nbytes > 0).map(|t| {
        let from = t.offset.max(b.offset);
        let to = (t.offset + t.nbytes).min(end);
        // (source, byte of the tensor, byte of the buffer, length)
        (&sources[t.source], from - t.offset, (from - b.offset) as usize, (to - from) as usize)
    });
    {
        let bytes = &mut gather.bytes(buffer)[..padded];
        let header_len = file.header.len() as u64;
        if b.offset < header_len {
            let n = (header_len.min(end) - b.offset) as usize;
            bytes[..n].copy_from_slice(&file.header[b.offset as usize..b.offset as usize + n]);
        }
        for (source, skip, at, len) in pieces.clone() {
            match source {
                TensorBytes::Host(data) => {
                    bytes[at..at + len].copy_from_slice(&data[skip as usize..skip as usize + len])
                }
                TensorBytes::Elsewhere => {
                    return Err(Error::InvalidArgument(format!(
                        "{}: internal error: bytes {}..{} hold a tensor this rank does not have",
                        file.path.display(),
                        b.offset,
                        b.offset + b.len
                    )))
                }
                TensorBytes::Device(_) => {}
            }
        }
        bytes[b.len as usize..].fill(0);
    }
    for (source, skip, at, len) in pieces {
        if let TensorBytes::Device(address) = source {
            gather.fetch(buffer, at, address + skip, len)?;
        }
    }
    gather.wait(buffer)?;
    sink.write_at(b.offset, &gather.bytes(buffer)[..padded])
}

/// Saves a plan in one call: [`SaveSession::begin`], [`SaveSession::write`] of every byte,
/// [`SaveSession::commit`]. Returns the paths written (the index last).
pub fn save<G: Gather>(
    plan: &SavePlan,
    target: &SaveTarget,
    sources: &[TensorBytes],
    gather: &G,
    options: &SaveOptions,
) -> Result<Vec<PathBuf>> {
    let ranges = plan.files.iter().enumerate().map(|(file, f)| WriteRange { file, start: 0, end: f.len }).collect();
    let mut session = SaveSession::begin(plan.clone(), target, ranges, options.direct)?;
    session.write(&[], sources, gather, options)?;
    session.commit()
}

/// A save in progress on one process, or on one rank of a group. The committing rank (the
/// only one of a single-process save) begins it: it prepares the directory, creates every
/// file (space reserved) and writes the index; every rank then writes its ranges of the files
/// and syncs them; once every rank's bytes are durable, the committing rank commits: one file
/// (or the caller's files) renamed into place, or a checkpoint directory committed as a whole
/// ([`CheckpointDir`]): the directory holds the old checkpoint or the new one whenever the
/// save is killed or fails. Dropped before its commit, it leaves nothing behind.
pub struct SaveSession {
    plan: SavePlan,
    /// This rank's bytes to write.
    ranges: Vec<WriteRange>,
    /// On the committing rank: what it created.
    owner: Option<Owner>,
}

struct Owner {
    checkpoint: Option<CheckpointDir>,
    sinks: Vec<FileSink>,
    index: Option<FileSink>,
}

impl SaveSession {
    /// Starts a save as its committing rank, which writes `ranges` of the files itself.
    pub fn begin(plan: SavePlan, target: &SaveTarget, ranges: Vec<WriteRange>, direct: bool) -> Result<SaveSession> {
        let name = |path: &Path| path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let commit = Commit::from_env()?; // checked by every save, whichever it takes
        let (checkpoint, sinks, index) = match target {
            SaveTarget::Directory { dir, .. } => {
                let names: Vec<String> = plan
                    .files
                    .iter()
                    .map(|f| &f.path)
                    .chain(plan.index.iter().map(|i| &i.0))
                    .map(|p| name(p))
                    .collect();
                let checkpoint = CheckpointDir::prepare(dir, &names, commit)?;
                let sinks = plan
                    .files
                    .iter()
                    .map(|f| checkpoint.sink(&name(&f.path), f.len, direct))
                    .collect::<Result<Vec<FileSink>>>()?;
                // The index is written with the files, so that a disk too full for it fails
                // the save before anything is published; it is published last.
                let index = match &plan.index {
                    Some((path, bytes)) => {
                        let sink = checkpoint.sink(&name(path), bytes.len() as u64, false)?;
                        sink.write_at(0, bytes)?;
                        Some(sink)
                    }
                    None => None,
                };
                (Some(checkpoint), sinks, index)
            }
            SaveTarget::File(_) | SaveTarget::Files(_) => {
                let mut dirs: Vec<PathBuf> = plan.files.iter().map(|f| crate::sink::parent(&f.path)).collect();
                dirs.dedup();
                for dir in &dirs {
                    remove_stale_temps(dir);
                }
                let sinks = plan
                    .files
                    .iter()
                    .map(|f| FileSink::create(&f.path, f.len, direct))
                    .collect::<Result<Vec<FileSink>>>()?;
                (None, sinks, None)
            }
        };
        Ok(SaveSession { plan, ranges, owner: Some(Owner { checkpoint, sinks, index }) })
    }

    /// Joins a save another rank began, to write `ranges` of its files.
    pub fn join(plan: SavePlan, ranges: Vec<WriteRange>) -> SaveSession {
        SaveSession { plan, ranges, owner: None }
    }

    pub fn plan(&self) -> &SavePlan {
        &self.plan
    }

    /// Where each file's bytes are being written until the commit (on the committing rank).
    pub fn locations(&self) -> Vec<PathBuf> {
        self.owner.as_ref().map_or_else(Vec::new, |o| o.sinks.iter().map(|s| s.temp_path().to_owned()).collect())
    }

    /// Writes this rank's ranges and makes them durable: through the sinks it created (the
    /// committing rank) or into the files at `locations` (the others). Returns the bytes written.
    pub fn write<G: Gather>(
        &mut self,
        locations: &[PathBuf],
        sources: &[TensorBytes],
        gather: &G,
        options: &SaveOptions,
    ) -> Result<u64> {
        let written = self.ranges.iter().map(|r| r.end - r.start).sum();
        match &mut self.owner {
            Some(owner) => {
                write_ranges(&self.plan.files, &owner.sinks, &self.ranges, sources, gather, options)?;
            }
            None => {
                if locations.len() != self.plan.files.len() {
                    return Err(Error::InvalidArgument(format!(
                        "a group save gave {} locations for {} files",
                        locations.len(),
                        self.plan.files.len()
                    )));
                }
                let sinks = self
                    .plan
                    .files
                    .iter()
                    .zip(locations)
                    .map(|(f, at)| FileSink::open_existing(&f.path, at, options.direct))
                    .collect::<Result<Vec<FileSink>>>()?;
                write_ranges(&self.plan.files, &sinks, &self.ranges, sources, gather, options)?;
                let mut touched: Vec<usize> = self.ranges.iter().map(|r| r.file).collect();
                touched.dedup();
                io_pool().install(|| touched.par_iter().try_for_each(|&f| sinks[f].sync()))?;
            }
        }
        Ok(written)
    }

    /// Commits the save (on the committing rank, once every rank's bytes are durable): every
    /// file cut to its length and synced, then published. Returns the paths, the index last.
    pub fn commit(mut self) -> Result<Vec<PathBuf>> {
        let Some(mut owner) = self.owner.take() else {
            return Err(Error::InvalidArgument("only the rank that began a save commits it".into()));
        };
        io_pool().install(|| owner.sinks.par_iter_mut().try_for_each(|s| s.finish()))?;
        if let Some(index) = &mut owner.index {
            index.finish()?;
        }
        match owner.checkpoint {
            Some(checkpoint) => checkpoint.commit(owner.sinks, owner.index),
            None => publish(owner.sinks),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::HostMemoryDevice;
    use crate::format::{self, Dtype};
    use crate::plan::save::{plan_save, SaveTensor, INDEX_FILE};
    use crate::sink::MemorySink;

    /// Tensors of every size around the block edges, with distinct bytes.
    fn tensors(sizes: &[usize]) -> (Vec<SaveTensor>, Vec<Vec<u8>>) {
        let data: Vec<Vec<u8>> =
            sizes.iter().enumerate().map(|(i, &n)| (0..n).map(|j| (j * 7 + i * 13) as u8).collect()).collect();
        let specs = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| SaveTensor { name: format!("t{i}"), dtype: Dtype::U8, shape: vec![n as u64], source: i })
            .collect();
        (specs, data)
    }

    /// What safetensors writes for the same tensors: header, then the bytes in file order.
    fn expected(file: &FileLayout, data: &[Vec<u8>]) -> Vec<u8> {
        let mut out = file.header.clone();
        for t in &file.tensors {
            out.extend_from_slice(&data[t.source]);
        }
        out
    }

    fn write_to_memory<G: Gather>(
        plan: &SavePlan,
        sources: &[TensorBytes],
        gather: &G,
        options: &SaveOptions,
    ) -> Result<Vec<Vec<u8>>> {
        let mut sinks: Vec<MemorySink> =
            plan.files.iter().map(|f| MemorySink::new(&f.path, f.len, options.direct)).collect();
        write_files(&plan.files, &sinks, sources, gather, options)?;
        Ok(sinks
            .iter_mut()
            .map(|s| {
                s.finish().unwrap();
                s.bytes()
            })
            .collect())
    }

    #[test]
    fn every_byte_lands_once_in_place_for_any_block_and_writer_count() {
        let sizes = [0, 1, 4095, 4096, 4097, 10_000, 3, 65_536, 1];
        let (specs, data) = tensors(&sizes);
        let target = SaveTarget::Directory { dir: "/ckpt".into(), max_shard_size: 40_000 };
        let plan = plan_save(specs, &target, None).unwrap();
        assert!(plan.files.len() > 1);
        let sources: Vec<TensorBytes> = data.iter().map(|d| TensorBytes::Host(d)).collect();
        for block in [4096, 8192, 12_288, 1 << 20] {
            for writers in [1, 3, 8] {
                for direct in [false, true] {
                    let options = SaveOptions { block, writers, direct };
                    let files = write_to_memory(&plan, &sources, &HostGather, &options).unwrap();
                    for (file, bytes) in plan.files.iter().zip(&files) {
                        assert_eq!(bytes, &expected(file, &data), "block {block}, {writers} writers, direct {direct}");
                        format::parse(bytes).unwrap();
                    }
                }
            }
        }
    }

    #[test]
    fn device_tensors_come_through_the_staging_copies() {
        let sizes = [5000, 1, 9000, 4096];
        let (specs, data) = tensors(&sizes);
        // Tensors 0 and 2 on the device (at scattered addresses), 1 and 3 in host memory.
        let device = HostMemoryDevice::new(64 << 10);
        device.write(100, &data[0]).unwrap();
        device.write(20_000, &data[2]).unwrap();
        let sources = [
            TensorBytes::Device(100),
            TensorBytes::Host(&data[1]),
            TensorBytes::Device(20_000),
            TensorBytes::Host(&data[3]),
        ];
        let plan = plan_save(specs, &SaveTarget::File("/x.safetensors".into()), None).unwrap();
        for writers in [1, 4] {
            let options = SaveOptions { block: 4096, writers, direct: true };
            let gather = DeviceGather::new(&device).unwrap();
            let files = write_to_memory(&plan, &sources, &gather, &options).unwrap();
            assert_eq!(files[0], expected(&plan.files[0], &data));
        }
        assert_eq!(device.freed_in_flight(), 0);
    }

    #[test]
    fn device_bytes_are_those_the_work_queued_before_the_save_leaves() {
        let (specs, data) = tensors(&[9000]);
        // The tensor's bytes are still being written by work queued before the save (a
        // kernel on torch's stream): the copies must come after it.
        let device = HostMemoryDevice::new(16 << 10).with_prior_write(0, data[0].clone());
        let plan = plan_save(specs, &SaveTarget::File("/x.safetensors".into()), None).unwrap();
        let options = SaveOptions { block: 4096, writers: 2, direct: true };
        let gather = DeviceGather::new(&device).unwrap();
        let files = write_to_memory(&plan, &[TensorBytes::Device(0)], &gather, &options).unwrap();
        assert_eq!(files[0], expected(&plan.files[0], &data));
    }

    #[test]
    fn a_failed_write_or_copy_fails_the_save() {
        let (specs, data) = tensors(&[100_000]);
        let plan = plan_save(specs, &SaveTarget::File("/x.safetensors".into()), None).unwrap();
        let options = SaveOptions { block: 4096, writers: 4, direct: false };
        let sources = [TensorBytes::Host(&data[0])];
        let sinks = [MemorySink::new(&plan.files[0].path, plan.files[0].len, false).failing_at_write(5)];
        let err = write_files(&plan.files, &sinks, &sources, &HostGather, &options).unwrap_err().to_string();
        assert!(err.starts_with("/x.safetensors: write failed: No space left on device"), "{err}");

        let device = HostMemoryDevice::new(200_000).failing_at_copy(3);
        let sources = [TensorBytes::Device(0)];
        let gather = DeviceGather::new(&device).unwrap();
        let sinks = [MemorySink::new(&plan.files[0].path, plan.files[0].len, true)];
        let err = write_files(&plan.files, &sinks, &sources, &gather, &options).unwrap_err().to_string();
        assert!(err.contains("copy 3 failed"), "{err}");
        assert_eq!(device.freed_in_flight(), 0);
    }

    #[test]
    fn options_keep_buffers_within_the_budget() {
        let o = SaveOptions::within(1 << 30, 8);
        assert_eq!((o.block, o.writers), (DEFAULT_BLOCK, 8));
        let o = SaveOptions::within(20 << 20, 8);
        assert!(o.block * o.writers as u64 <= 20 << 20 && o.block % IO_ALIGN == 0, "{o:?}");
        assert_eq!(SaveOptions::within(1, 8).writers, 1);
    }

    #[test]
    fn a_save_publishes_files_and_index_and_removes_stale_ones() {
        let dir = std::env::temp_dir().join(format!("fst-save-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for stale in ["model-00001-of-00009.safetensors", "model.safetensors", "notes.txt"] {
            std::fs::write(dir.join(stale), b"old").unwrap();
        }
        let (specs, data) = tensors(&[3000, 3000, 3000]);
        let target = SaveTarget::Directory { dir: dir.clone(), max_shard_size: 6000 };
        let plan = plan_save(specs, &target, None).unwrap();
        let sources: Vec<TensorBytes> = data.iter().map(|d| TensorBytes::Host(d)).collect();
        let written = save(&plan, &target, &sources, &HostGather, &SaveOptions::within(1 << 20, 2)).unwrap();
        assert_eq!(written.last().unwrap(), &dir.join(INDEX_FILE));
        let mut names: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(
            names,
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "model.safetensors.index.json",
                "notes.txt"
            ]
        );
        for file in &plan.files {
            assert_eq!(std::fs::read(&file.path).unwrap(), expected(file, &data));
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}
