//! Loading: headers → plan → reads, for a set of files at once.
//!
//! ```no_run
//! use fastsafetensors::loader::{plan_files, LoadOptions};
//! let loaded = plan_files(&["model-00001.safetensors".into()])?.read_to_host(&LoadOptions::default())?;
//! for t in &loaded.tensors {
//!     let bytes = loaded.bytes(t);
//!     println!("{} {} {:?}: {} bytes", t.name, t.dtype, t.shape, bytes.len());
//! }
//! # Ok::<(), fastsafetensors::Error>(())
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;

use crate::cuda::cufile::CuFileApi;
use crate::device::StagingDevice;
use crate::error::{Error, Result};
use crate::format::Header;
use crate::gds::{self, GdsMode, GdsOptions};
use crate::io::{self, budget, HostBuffer, HostRead, ReadPath, ReaderKind, SourceFile};
use crate::plan::{self, Placement, IO_ALIGN};
use crate::staged::{self, StagedFile, StagingOptions};

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub reader: ReaderKind,
    /// Bytes per read request.
    pub block: u64,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { reader: ReaderKind::Auto, block: plan::DEFAULT_BLOCK }
    }
}

/// Files whose headers are validated and whose tensors are placed; nothing read yet.
pub struct Planned {
    pub sources: Vec<SourceFile>,
    pub tensors: Vec<Placement>,
}

/// Opens `paths`, validates every header and the names across files. Nothing is read until
/// every header is known to be good.
pub fn plan_files(paths: &[PathBuf]) -> Result<Planned> {
    let sources = paths.iter().map(|p| SourceFile::open(p)).collect::<Result<Vec<_>>>()?;
    let headers = sources.iter().map(SourceFile::header).collect::<Result<Vec<Header>>>()?;
    let tensors = plan::place(paths, &headers)?;
    Ok(Planned { sources, tensors })
}

/// Reads and validates one file's header without touching its data.
pub fn read_header(path: &Path) -> Result<Header> {
    SourceFile::open(path)?.header()
}

/// Every tensor of a set of files, in host memory. Buffers are reference-counted so that
/// each tensor handed out can keep its own file's buffer alive.
pub struct Loaded {
    pub buffers: Vec<Arc<HostBuffer>>,
    pub tensors: Vec<Placement>,
}

impl Loaded {
    pub fn bytes(&self, t: &Placement) -> &[u8] {
        &self.buffers[t.file].as_slice()[t.offset as usize..(t.offset + t.nbytes) as usize]
    }

    pub fn read_paths(&self) -> Vec<ReadPath> {
        self.buffers.iter().map(|b| b.read_path()).collect()
    }
}

/// Options for loads into device memory.
#[derive(Debug, Clone, Copy, Default)]
pub struct DeviceOptions {
    pub reader: ReaderKind,
    pub gds: GdsMode,
    pub staging: StagingOptions,
    pub gds_io: GdsOptions,
}

impl Planned {
    /// Reads all files into host memory once it is known that the memory they need is
    /// there: mappings at once, direct reads in parallel on the I/O pool (which is not woken
    /// at all for a warm load, so its threads take no CPU from the caller's first touches).
    pub fn read_to_host(self, options: &LoadOptions) -> Result<Loaded> {
        let choices = self.sources.iter().map(|s| s.choose(options.reader)).collect::<Result<Vec<_>>>()?;
        let owned = (0..self.sources.len())
            .filter(|&i| matches!(choices[i], HostRead::Direct))
            .map(|i| self.device_len(i))
            .sum();
        budget::check(owned)?;
        let read = |(src, how): (&SourceFile, HostRead)| src.read(how, options.block).map(Arc::new);
        let buffers = if owned == 0 {
            self.sources.iter().zip(choices).map(read).collect::<Result<Vec<_>>>()
        } else {
            io::io_pool().install(|| self.sources.par_iter().zip(choices).map(read).collect::<Result<Vec<_>>>())
        }?;
        Ok(Loaded { buffers, tensors: self.tensors })
    }

    /// Bytes of memory file `i` needs: the file rounded up to whole aligned reads.
    pub fn device_len(&self, i: usize) -> u64 {
        plan::align_up(self.sources[i].len, IO_ALIGN)
    }

    /// Copies file `i` to device address `dsts[i]` (`device_len(i)` bytes there), through
    /// GPUDirect Storage where `options.gds` and `cufile` allow, else staged through `device`.
    /// `cufile` is the opened library, or why it is not available.
    pub fn copy_to_device<D: StagingDevice, A: CuFileApi>(
        &self,
        device: &D,
        cufile: std::result::Result<&A, &str>,
        dsts: &[u64],
        options: &DeviceOptions,
    ) -> Result<Vec<ReadPath>> {
        if dsts.len() != self.sources.len() {
            return Err(Error::InvalidArgument(format!(
                "{} destinations for {} files",
                dsts.len(),
                self.sources.len()
            )));
        }
        let mut paths: Vec<Option<ReadPath>> = vec![None; self.sources.len()];
        if options.gds != GdsMode::Never {
            for (i, src) in self.sources.iter().enumerate() {
                let outcome =
                    cufile.map_err(str::to_owned).and_then(|api| gds::read_file(api, src, dsts[i], &options.gds_io));
                match outcome {
                    Ok(()) => paths[i] = Some(ReadPath::Gds),
                    Err(reason) if options.gds == GdsMode::Require => {
                        return Err(Error::GdsRequired { path: src.path.clone(), reason })
                    }
                    Err(reason) => {
                        gds_fallback_notice(&reason);
                        break;
                    }
                }
            }
        }
        let staged_files = self
            .sources
            .iter()
            .zip(dsts)
            .zip(&paths)
            .filter(|(_, done)| done.is_none())
            .map(|((src, &dst), _)| {
                let direct = match options.reader {
                    ReaderKind::Direct => true,
                    ReaderKind::Mmap => false,
                    ReaderKind::Auto => !src.is_resident()?,
                };
                Ok(StagedFile { src, dst, direct })
            })
            .collect::<Result<Vec<_>>>()?;
        let mut staged_paths = staged::copy_files(device, &staged_files, &options.staging)?.into_iter();
        self.sources.iter().try_for_each(SourceFile::check_unchanged)?;
        Ok(paths
            .into_iter()
            .map(|p| p.unwrap_or_else(|| staged_paths.next().expect("one path per staged file")))
            .collect())
    }
}

/// Says once per process why GPUDirect Storage is not used.
fn gds_fallback_notice(reason: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| eprintln!("fastsafetensors: GPUDirect Storage not used ({reason}); using the staged path"));
}
