//! Loads with `keep`: the bytes come from a kept entry when the keeper holds the one this load
//! would make (nothing is read or hashed: the tensors map the entry's memory), else the load
//! reads into the memory of a new entry, as a load that owns its memory reads, and hands it to
//! the keeper once every file is read and checked. Anything that stops the keeping (no
//! keeper, a full budget, a keeper that goes away) leaves the load as it would be without
//! `keep`, with one line on stderr saying why.
//!
//! ```no_run
//! use fastsafetensors::load::{plan_files, LoadOptions};
//! let loaded = plan_files(&["model.safetensors".into()])?.read_to_host_kept(&LoadOptions::default())?;
//! // the first load read and kept; a later one, in any process of this user, maps:
//! assert!(loaded.read_paths().iter().all(|p| p.name() == "kept" || p.name() == "direct"));
//! # Ok::<(), fastsafetensors::Error>(())
//! ```
//!
//! Host entries are sealed memory files, mapped copy-on-write ([`crate::keep::memfd`]): a
//! write into a tensor stays in its process. Device entries are device memory from the
//! driver's virtual memory API ([`crate::device::vmm`]), one allocation holding every file,
//! filled through the staged path and then mapped read-only, in the process that filled it as
//! in those that attach: device memory has no copy-on-write, so a kernel writing into a kept
//! tensor fails rather than change the weights of every process (where the driver will not
//! map it read-only, nothing is kept).

use std::os::fd::AsFd;
use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use super::{choose_reads, host_readers, DeviceCopy, DeviceOptions, DeviceTarget, LoadOptions, Loaded, Planned};
use crate::device::gds::GdsMode;
use crate::device::vmm::{self, Access, Mapping, Physical};
use crate::error::{Error, Result};
use crate::keep::client::{self, Attach, Filling, Hold, Kept};
use crate::keep::memfd::Memfd;
use crate::keep::{self, key, Describe, Span, HOST};
use crate::plan::Extent;
use crate::source::direct::{self, BlockReader};
use crate::source::{io_pool, HostBuffer, ReadPath};

impl Planned {
    /// [`Planned::read_to_host`], with the bytes kept between processes (see the module).
    pub fn read_to_host_kept(self, options: &LoadOptions) -> Result<Loaded> {
        keep::check_env()?;
        let extents = self.host_extents(options)?;
        let entry = match key::describe(&self.sources, &extents, &self.checks.files, HOST) {
            Ok(entry) => entry,
            Err(Error::Keep(why)) => return self.read_unkept(options, &why),
            Err(e) => return Err(e),
        };
        match client::attach(&entry) {
            Attach::Kept(kept) => match self.attached(kept, &entry, &extents) {
                Ok(buffers) => Ok(self.loaded(buffers, extents, &[])),
                Err(e) => self.read_unkept(options, &e.to_string()),
            },
            Attach::Fill(filling) => self.fill(filling, &entry, extents, options),
            Attach::NotKept(why) => self.read_unkept(options, &why),
        }
    }

    /// The load without `keep`, after saying why.
    fn read_unkept(self, options: &LoadOptions, why: &str) -> Result<Loaded> {
        notice(why);
        self.read_to_host(options)
    }

    /// The load's result: how each file was read is its reader's say (`readers` empty: the
    /// bytes are the entry's).
    fn loaded(self, buffers: Vec<Arc<HostBuffer>>, extents: Vec<Extent>, readers: &[Option<BlockReader>]) -> Loaded {
        let mut paths = vec![ReadPath::NotRead; self.sources.len()];
        for e in &extents {
            paths[e.file] = readers.get(e.file).and_then(Option::as_ref).map_or(ReadPath::Kept, BlockReader::path);
        }
        Loaded { buffers, extents, tensors: self.tensors, paths }
    }

    /// The entry's buffers mapped copy-on-write, each holding the entry until it is dropped.
    fn attached(&self, kept: Kept, entry: &Describe, extents: &[Extent]) -> Result<Vec<Arc<HostBuffer>>> {
        let Kept { memory, buffers, hold } = kept;
        let refused = |why: String| Error::Keep(format!("the keeper's entry {why}"));
        let memory = Memfd::from_fd(memory).map_err(|e| refused(format!("is not a memory file ({e})")))?;
        if !memory.is_sealed().unwrap_or(false) || memory.len() < entry.len {
            return Err(refused("is not sealed, or shorter than its layout".into()));
        }
        let holding = Arc::new(Holding::default());
        holding.set(hold);
        let map = |(e, span): (&Extent, &Span)| {
            let map = memory
                .map_private(span.offset, span.len as usize)
                .map_err(|err| Error::io(self.sources[e.file].path(), "map the kept entry of", err))?;
            Ok(Arc::new(held(HostBuffer::new(map, ReadPath::Kept), &holding)))
        };
        extents.iter().zip(&buffers).map(map).collect()
    }

    /// Reads `extents` into a new sealed memory file (`O_DIRECT` where the file allows it,
    /// else through the page cache: never a mapping of the file, whose bytes are not the
    /// entry's), written through staging buffers (see [`direct::read_extent_through`]) and
    /// mapped privately from the start (sources that split their own reads: read into a shared
    /// mapping, made private once read), and puts the entry once every file is read and
    /// checked.
    fn fill(self, filling: Filling, entry: &Describe, extents: Vec<Extent>, options: &LoadOptions) -> Result<Loaded> {
        let how = match choose_reads(&self.sources, &extents, options.reader, true, true) {
            // More than the host memory left: a load without `keep` maps what does not fit.
            Err(e @ Error::OutOfMemory { .. }) => return self.read_unkept(options, &e.to_string()),
            how => how?,
        };
        let name = entry.files.first().map_or("entry", |f| f.rsplit('/').next().unwrap_or(f));
        let memory = match Memfd::create(&format!("fastsafetensors-keep:{name}"), entry.len) {
            Ok(memory) => memory,
            Err(e) => return self.read_unkept(options, &format!("no memory file for the entry: {e}")),
        };
        let readers = host_readers(&self.sources, &how)?;
        let holding = Arc::new(Holding::default());
        let read = |(e, span): (&Extent, &Span)| -> Result<Arc<HostBuffer>> {
            let path = self.sources[e.file].path();
            let reader = readers[e.file].as_ref().expect("a reader for every file read");
            if !reader.source().splits_reads() {
                let map = memory
                    .map_private(span.offset, span.len as usize)
                    .map_err(|err| Error::io(path, "map the entry of", err))?;
                let view = Arc::new(held(HostBuffer::new(map, reader.path()), &holding));
                let write = |at: usize, bytes: &[u8]| memory.write_at(bytes, span.offset + at as u64);
                direct::read_extent_through(reader, e, options.block, self.checks.file(e.file), &view, &write)?;
                return Ok(view);
            }
            let map = memory
                .map_shared(span.offset, span.len as usize)
                .map_err(|err| Error::io(path, "map the entry of", err))?;
            let buffer = held(HostBuffer::new(map, reader.path()), &holding);
            let buffer = direct::read_extent_in(reader, e, options.block, self.checks.file(e.file), buffer)?;
            // Read: from now on the tensors' writes stay in this process.
            memory
                .make_private(buffer.mapping(), span.offset)
                .map_err(|err| Error::io(path, "remap the entry of", err))?;
            Ok(buffer)
        };
        let pairs: Vec<_> = extents.iter().zip(&entry.buffers).collect();
        let buffers = io_pool().install(|| pairs.into_par_iter().map(read).collect::<Result<Vec<_>>>())?;
        for (src, reader) in self.sources.iter().zip(&readers) {
            if reader.is_some() {
                src.check_unchanged()?;
            }
        }
        self.checks.finish()?;
        let put = match memory.seal() {
            Ok(()) => filling.put(memory.fd()),
            Err(e) => Err(format!("its memory could not be sealed: {e}")),
        };
        match put {
            Ok(hold) => holding.set(hold),
            Err(why) => notice(&why),
        }
        Ok(self.loaded(buffers, extents, &readers))
    }

    /// Every file copied to CUDA device `ordinal` into kept device memory, or attached to it
    /// (see the module); `None` when it is not kept (the caller loads as without `keep`, into
    /// memory of torch's: the reason is on stderr).
    pub fn copy_to_cuda_kept(&self, ordinal: usize, options: &DeviceOptions) -> Result<Option<KeptOnDevice>> {
        keep::check_env()?;
        let extents: Vec<Extent> = (0..self.sources.len())
            .map(|i| Extent {
                file: i,
                start: 0,
                len: self.device_len(i),
                expected: self.sources[i].len(),
                tensors: 0..0,
            })
            .collect();
        let mut entry = match vmm::device_uuid(ordinal)
            .and_then(|uuid| key::describe(&self.sources, &extents, &self.checks.files, &format!("cuda:{uuid}")))
        {
            Ok(entry) => entry,
            Err(Error::Keep(why)) => return unkept(&why),
            Err(e) => return Err(e),
        };
        entry.len = vmm::round_up(ordinal, entry.len as usize)? as u64;
        match client::attach(&entry) {
            Attach::Kept(kept) => match attached_on_device(kept, ordinal, &entry) {
                Ok(on_device) => Ok(Some(on_device)),
                Err(e) => unkept(&e.to_string()),
            },
            Attach::Fill(filling) => self.fill_device(filling, &entry, ordinal, options),
            Attach::NotKept(why) => unkept(&why),
        }
    }

    /// Copies every file into new device memory through the staged path (GPUDirect Storage
    /// is not used: its registrations of memory of this kind vary by driver), makes it
    /// read-only, and puts it.
    fn fill_device(
        &self,
        filling: Filling,
        entry: &Describe,
        ordinal: usize,
        options: &DeviceOptions,
    ) -> Result<Option<KeptOnDevice>> {
        let allocated = Physical::create(ordinal, entry.len as usize)
            .and_then(|memory| Ok((memory.export()?, Mapping::new(memory, ordinal, Access::ReadWrite)?)));
        let (fd, mapping) = match allocated {
            Ok(allocated) => allocated,
            Err(e) => return unkept(&format!("no device memory for the entry: {e}")),
        };
        let targets: Vec<DeviceTarget> = entry
            .buffers
            .iter()
            .enumerate()
            .map(|(file, span)| DeviceTarget { file, base: mapping.address() + span.offset })
            .collect();
        let staged = DeviceOptions { gds: GdsMode::Never, ..*options };
        // Fresh memory: no work of anyone's came before the copies into it.
        let copies = self.copy_to_cuda(ordinal, &targets, &staged, None)?;
        let files = entry.buffers.iter().zip(copies).map(|(span, c)| DeviceCopy { offset: span.offset, ..c }).collect();
        // Shared, it must be read-only (see the module); where the driver will not, the memory
        // stays this load's own, as when the keeper does not take it.
        let put = match mapping.set_access(Access::Read) {
            Ok(()) => filling.put(fd.as_fd()),
            Err(e) => Err(format!("the entry's device memory could not be made read-only: {e}")),
        };
        let hold = put.map_err(|why| notice(&why)).ok();
        Ok(Some(KeptOnDevice { mapping, files, _hold: hold }))
    }
}

/// A kept load's memory on a CUDA device, mapped read-only, and where each file is in it: the
/// extension wraps its tensors, which hold it; unmapped (and the keeper's hold let go) when
/// dropped.
pub struct KeptOnDevice {
    pub mapping: Mapping,
    /// Per file: how it came there, and where its byte 0 is from `mapping.address()`.
    pub files: Vec<DeviceCopy>,
    _hold: Option<Hold>,
}

/// The entry's device memory imported and mapped read-only.
fn attached_on_device(kept: Kept, ordinal: usize, entry: &Describe) -> Result<KeptOnDevice> {
    let Kept { memory, buffers, hold } = kept;
    let mapping = Mapping::new(Physical::import(memory, entry.len as usize)?, ordinal, Access::Read)?;
    let files = buffers.iter().map(|span| DeviceCopy { path: ReadPath::Kept, offset: span.offset }).collect();
    Ok(KeptOnDevice { mapping, files, _hold: Some(hold) })
}

fn unkept<T>(why: &str) -> Result<Option<T>> {
    notice(why);
    Ok(None)
}

/// The hold on an entry that the buffers of a load share: set once the entry is the
/// keeper's, let go when the last buffer is dropped.
#[derive(Default)]
struct Holding(OnceLock<Hold>);

impl Holding {
    fn set(&self, hold: Hold) {
        let _ = self.0.set(hold);
    }
}

/// `buffer`, holding `hold` until it is dropped.
fn held(buffer: HostBuffer, hold: &Arc<Holding>) -> HostBuffer {
    let hold = Arc::clone(hold);
    buffer.on_drop(Box::new(move |map| {
        drop(map);
        drop(hold);
    }))
}

/// Says why a load is not kept: once per load, on stderr (the load goes on without it).
fn notice(why: &str) {
    eprintln!("fastsafetensors: keep: {why}; loading without keeping");
}
