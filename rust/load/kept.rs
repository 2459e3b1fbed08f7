//! Loads with `keep`: the bytes come from a kept entry when the keeper holds the one this load
//! would make (nothing is read or hashed: the tensors map the entry's sealed memory,
//! copy-on-write), else the load reads into the memory of a new entry, as a load that owns
//! its memory reads, and hands it to the keeper once every file is read and checked. Anything
//! that stops the keeping (no keeper, a full budget, a keeper that goes away) leaves the load
//! as it would be without `keep`, with one line on stderr saying why.
//!
//! ```no_run
//! use fastsafetensors::load::{plan_files, LoadOptions};
//! let loaded = plan_files(&["model.safetensors".into()])?.read_to_host_kept(&LoadOptions::default())?;
//! // the first load read and kept; a later one, in any process of this user, maps:
//! assert!(loaded.read_paths().iter().all(|p| p.name() == "kept" || p.name() == "direct"));
//! # Ok::<(), fastsafetensors::Error>(())
//! ```

use std::sync::{Arc, OnceLock};

use rayon::prelude::*;

use super::{choose_reads, LoadOptions, Loaded, Planned};
use crate::error::{Error, Result};
use crate::keep::client::{self, Attach, Filling, Hold, Kept};
use crate::keep::{self, key, Describe};
use crate::plan::Extent;
use crate::source::direct::{self, BlockReader};
use crate::source::{io_pool, HostBuffer, HostRead, ReadPath};

/// The device name of host entries.
pub const HOST: &str = "cpu";

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
            Attach::Kept(kept) => match self.attached(kept, &extents) {
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
    fn attached(&self, kept: Kept, extents: &[Extent]) -> Result<Vec<Arc<HostBuffer>>> {
        let Kept { memory, buffers, hold } = kept;
        let holding = Arc::new(Holding::default());
        holding.set(hold);
        let map = |(e, span): (&Extent, &keep::Span)| {
            let map = memory
                .map_private(span.offset, span.len as usize)
                .map_err(|err| Error::io(self.sources[e.file].path(), "map the kept entry of", err))?;
            Ok(Arc::new(held(HostBuffer::new(map, ReadPath::Kept), &holding)))
        };
        extents.iter().zip(&buffers).map(map).collect()
    }

    /// Reads `extents` into the entry's memory (`O_DIRECT` where the file allows it, else
    /// through the page cache: never a mapping of the file, whose bytes are not the entry's),
    /// each buffer made private as soon as it is read, and puts the entry once every file is
    /// read and checked.
    fn fill(self, filling: Filling, entry: &Describe, extents: Vec<Extent>, options: &LoadOptions) -> Result<Loaded> {
        let how = match choose_reads(&self.sources, &extents, options.reader, true, true) {
            // More than the host memory left: a load without `keep` maps what does not fit.
            Err(e @ Error::OutOfMemory { .. }) => return self.read_unkept(options, &e.to_string()),
            how => how?,
        };
        let readers = self
            .sources
            .iter()
            .zip(&how)
            .map(|(src, &h)| {
                h.owns_memory().then(|| BlockReader::open(Arc::clone(src), h == HostRead::Direct)).transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let memory = filling.memory();
        let holding = Arc::new(Holding::default());
        let read = |(e, span): (&Extent, &keep::Span)| -> Result<Arc<HostBuffer>> {
            let path = self.sources[e.file].path();
            let reader = readers[e.file].as_ref().expect("a reader for every file read");
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
        match filling.put() {
            Ok(hold) => holding.set(hold),
            Err(why) => notice(&why),
        }
        Ok(self.loaded(buffers, extents, &readers))
    }
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
