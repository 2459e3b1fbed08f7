//! Where bytes come from, and reading them into host memory.
//!
//! A [`Source`] is one checkpoint file wherever it lives: a [`LocalFile`], or an object in a
//! store or behind an HTTP URL ([`remote::RemoteObject`]); [`open`] picks by the path.
//! The unit of reading is an [`Extent`]: an aligned byte range of one file (the whole file for
//! a plain load) that becomes one [`HostBuffer`], so a tensor's address is
//! `buffer + (file offset - extent start)`. Two ways to fill it:
//!
//! - [`direct`]: parallel `pread`s with `O_DIRECT` into page-aligned anonymous memory (the
//!   cold-file path: no page-cache copy), falling back to buffered reads where the
//!   filesystem refuses `O_DIRECT`;
//! - [`mmap`]: a private copy-on-write mapping of the range (the warm-file path: zero-copy,
//!   tensors point straight at the page cache until written to).
//!
//! [`ReaderKind::Auto`] picks per file: mmap when the file's pages are already resident,
//! direct otherwise. A remote object is always read (with parallel ranged GETs, [`remote`]),
//! unless the opt-in [`cache`] holds a whole copy of the version the store has now.

pub mod aws_files;
pub mod budget;
pub mod cache;
pub mod direct;
pub mod in_flight;
pub mod mmap;
pub mod remote;

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use memmap2::MmapMut;
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::format::{self, Header};
use crate::plan::Extent;
use crate::settings::setting;

/// Environment variable that picks the reader when the caller does not.
pub const READER_ENV: &str = "FASTSAFETENSORS_READER";
/// Environment variable that sets the number of I/O threads (the pool is made at the first
/// load that reads files; the variable is checked at every load).
pub const THREADS_ENV: &str = "FASTSAFETENSORS_THREADS";
/// I/O threads when not configured: enough requests in flight to keep an NVMe queue busy.
const DEFAULT_THREADS: usize = 8;
/// Most I/O threads allowed: beyond this, threads only cost memory.
const MAX_THREADS: usize = 1024;
/// Fraction of a file's pages that must be resident for `Auto` to map it rather than read it.
const RESIDENT_THRESHOLD: f64 = 0.9;

/// The reader a caller asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReaderKind {
    /// mmap if the file is resident in the page cache, direct reads otherwise.
    #[default]
    Auto,
    Direct,
    Mmap,
}

impl FromStr for ReaderKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(ReaderKind::Auto),
            "direct" => Ok(ReaderKind::Direct),
            "mmap" => Ok(ReaderKind::Mmap),
            other => {
                Err(Error::InvalidArgument(format!("unknown reader '{other}' (expected 'auto', 'direct' or 'mmap')")))
            }
        }
    }
}

impl ReaderKind {
    /// `requested` if given, else `$FASTSAFETENSORS_READER`, else `Auto`.
    pub fn resolve(requested: Option<&str>) -> Result<ReaderKind> {
        match requested {
            Some(name) => name.parse(),
            None => Ok(setting(READER_ENV, "auto, direct or mmap", |v| v.parse().ok())?.unwrap_or_default()),
        }
    }
}

/// The number of I/O threads: `$FASTSAFETENSORS_THREADS`, else 8.
pub fn io_threads() -> Result<usize> {
    Ok(setting(THREADS_ENV, "a whole number of threads from 1 to 1024", parse_threads)?.unwrap_or(DEFAULT_THREADS))
}

fn parse_threads(value: &str) -> Option<usize> {
    value.parse::<usize>().ok().filter(|n| (1..=MAX_THREADS).contains(n))
}

/// How a file's bytes actually arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadPath {
    /// `O_DIRECT` reads (into host memory, or into staging buffers for a device).
    Direct,
    /// Reads through the page cache: the file was resident, or `O_DIRECT` is unsupported.
    Buffered,
    /// A zero-copy mapping of the file.
    Mmap,
    /// A zero-copy mapping chosen because direct reads of every file would not have fitted
    /// the host-memory limit (see [`budget`]).
    MmapFallback,
    /// GPUDirect Storage, straight into device memory.
    Gds,
    /// cuFile in compatibility mode: it emulates GPUDirect Storage with reads through host
    /// memory (the nvidia-fs driver is not loaded, or cuFile is told so).
    GdsCompat,
    /// Ranged GETs of an object in a store, or of an HTTP URL.
    Remote,
    /// Nothing: no tensor of the file was selected.
    NotRead,
    /// Nothing: the bytes are a kept entry's, mapped (see `keep`).
    Kept,
}

impl ReadPath {
    pub fn name(self) -> &'static str {
        match self {
            ReadPath::Direct => "direct",
            ReadPath::Buffered => "buffered",
            ReadPath::Mmap => "mmap",
            ReadPath::MmapFallback => "mmap-fallback",
            ReadPath::Gds => "gds",
            ReadPath::GdsCompat => "gds-compat",
            ReadPath::Remote => "remote",
            ReadPath::NotRead => "none",
            ReadPath::Kept => "kept",
        }
    }
}

/// What becomes of a buffer's memory when the buffer is dropped (a stream keeps it for its
/// next group, or gives back its share of the memory budget).
pub(crate) type OnDrop = Box<dyn FnOnce(MmapMut) + Send + Sync>;

/// An extent of a file in host memory: page-aligned and writable. Its memory is unmapped on
/// drop, or handed to its `on_drop`.
pub struct HostBuffer {
    map: Option<MmapMut>,
    path: ReadPath,
    on_drop: Option<OnDrop>,
}

impl HostBuffer {
    pub(crate) fn new(map: MmapMut, path: ReadPath) -> HostBuffer {
        HostBuffer { map: Some(map), path, on_drop: None }
    }

    /// The same buffer, whose memory goes to `on_drop` when it is dropped.
    pub(crate) fn on_drop(mut self, on_drop: OnDrop) -> HostBuffer {
        self.on_drop = Some(on_drop);
        self
    }

    fn map(&self) -> &MmapMut {
        self.map.as_ref().expect("a live buffer has its memory")
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.map().as_ptr()
    }

    /// The mapping the buffer is (a kept entry's memory is remapped in place once filled).
    pub(crate) fn mapping(&self) -> &MmapMut {
        self.map()
    }

    /// Bytes in the buffer.
    pub fn byte_len(&self) -> usize {
        self.map().len()
    }

    pub fn as_slice(&self) -> &[u8] {
        self.map()
    }

    pub fn read_path(&self) -> ReadPath {
        self.path
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let (Some(on_drop), Some(map)) = (self.on_drop.take(), self.map.take()) {
            on_drop(map);
        }
    }
}

/// `len` bytes of page-aligned anonymous memory (at least one page, so that an extent with no
/// bytes still has an address).
pub(crate) fn alloc(len: u64, path: &Path) -> Result<MmapMut> {
    let len =
        usize::try_from(len.max(1)).map_err(|_| Error::io(path, "allocate", std::io::ErrorKind::OutOfMemory.into()))?;
    MmapMut::map_anon(len).map_err(|e| Error::io(path, "allocate", e))
}

/// Makes the pages under `buf` present and writable in one call (`MADV_POPULATE_WRITE`,
/// Linux 5.14), rather than one fault per page as bytes are copied in: the kernel allocates
/// them in a loop without a trap each. Only whole pages inside `buf` are touched; where the
/// kernel lacks the call, or the memory is short, nothing is done and the pages fault in as
/// they are written, as before.
pub(crate) fn prefault(buf: &mut [u8]) {
    let page = mmap::page_size();
    let start = (buf.as_mut_ptr() as usize).next_multiple_of(page);
    let end = (buf.as_mut_ptr() as usize + buf.len()) / page * page;
    if end > start {
        // SAFETY: the range is whole pages inside `buf`, which the caller may write; populating
        // changes no byte of it (a present page keeps its contents, a new one reads as zero, as
        // it would have at its first write).
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_POPULATE_WRITE) };
    }
}

/// How a file will be brought into host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostRead {
    /// Zero-copy: a mapping of each extent.
    Map,
    /// A mapping, because direct reads would not fit the host-memory limit.
    MapOverLimit,
    /// Direct reads into memory allocated for each extent.
    Direct,
    /// Reads through the page cache into memory allocated for each extent: a verified load of
    /// a file in the page cache, whose tensors must be the bytes it hashed, in memory nobody
    /// else can write (a mapping of the file changes when the file is written).
    Buffered,
}

impl HostRead {
    /// Whether the load reads into memory of its own (rather than mapping the file).
    pub fn owns_memory(self) -> bool {
        matches!(self, HostRead::Direct | HostRead::Buffered)
    }
}

/// Pages of the data a [`Source::fingerprint`] samples: one per MiB of data, from 4 to 64
/// (at most 256 KiB read per file, whatever its size), each of 4 KiB.
pub const FINGERPRINT_SAMPLES: std::ops::RangeInclusive<u64> = 4..=64;
pub const FINGERPRINT_PAGE: u64 = 4096;

/// Which version of a source a load reads: when it changes, the bytes may mix two versions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Identity {
    /// A local file: its size and modification time.
    File { len: u64, modified: Option<SystemTime> },
    /// An object in a store: its size, and its ETag, version id (or generation) and
    /// Last-Modified date where the store gives them.
    Object { len: u64, e_tag: Option<String>, version: Option<String>, modified: Option<SystemTime> },
}

impl Identity {
    #[allow(clippy::len_without_is_empty)] // a size, not a collection
    pub fn len(&self) -> u64 {
        match self {
            Identity::File { len, .. } | Identity::Object { len, .. } => *len,
        }
    }

    /// A fingerprint of an object's version where the store names it (an ETag or version id
    /// is the store's own fingerprint of the bytes; else its size and Last-Modified date, for
    /// ranks reading one URL); None for a file or a version the store does not name.
    pub fn version_fingerprint(&self) -> Option<String> {
        let Identity::Object { len, e_tag, version, modified } = self else { return None };
        if e_tag.is_none() && version.is_none() && modified.is_none() {
            return None;
        }
        let modified = modified.and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok()).map(|d| d.as_secs());
        Some(format!(
            "object of {len} bytes, ETag {}, version {}, modified {}",
            e_tag.as_deref().unwrap_or("-"),
            version.as_deref().unwrap_or("-"),
            modified.map_or("-".to_owned(), |s| s.to_string())
        ))
    }
}

/// What a source allows beyond positioned reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Reads past the page cache (`O_DIRECT`).
    pub direct: bool,
    /// Zero-copy mappings, and asking the page cache what is resident.
    pub mmap: bool,
    /// GPUDirect Storage, which needs a file descriptor.
    pub gds: bool,
}

/// Where one checkpoint file's bytes come from. The planner, the host readers and the staged
/// device path see only this: its size, the version it was opened as, its header, and
/// positioned reads into a buffer they give. What needs more (a mapping, `O_DIRECT`, cuFile)
/// asks [`Source::local`] for the file behind it and falls back to `read_at` without one.
#[allow(clippy::len_without_is_empty)] // a size, not a collection
pub trait Source: Send + Sync {
    /// The path errors name.
    fn path(&self) -> &Path;
    /// The version the source was opened as.
    fn identity(&self) -> &Identity;
    /// The version it is now.
    fn current_identity(&self) -> Result<Identity>;
    /// Fills `buf` from byte `offset` on; fewer bytes only where the source ends.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize>;
    fn capabilities(&self) -> Capabilities;
    /// The local file behind the source, if there is one.
    fn local(&self) -> Option<&LocalFile>;

    /// Stops the reads of this source that are in flight, and fails those that follow (a
    /// remote object's requests; local reads are short and finish). For a load given up.
    fn cancel(&self) {}

    /// Whether the source splits a read into parallel requests itself (a remote object): it is
    /// then given whole extents rather than blocks spread over the I/O pool.
    fn splits_reads(&self) -> bool {
        false
    }

    /// Bytes in the source (as opened).
    fn len(&self) -> u64 {
        self.identity().len()
    }

    /// Fails if the source is no longer the version it was opened as: its bytes may then mix
    /// two versions.
    fn check_unchanged(&self) -> Result<()> {
        let now = self.current_identity()?;
        if now != *self.identity() {
            return Err(Error::Changed { path: self.path().to_owned(), len: self.len(), now: now.len() });
        }
        Ok(())
    }

    /// What tells these bytes from those of another file under the same path (another
    /// fine-tune of the same layout, a copy on another machine): a sha256 of the size, the
    /// header and [`FINGERPRINT_SAMPLES`] pages spread evenly over the data. Ranks sharing a
    /// load compare it before each reads its part for the others. It is a sample, not a
    /// digest: files differing in a few bytes between the pages sampled are not told apart
    /// (only digests of every byte would). The modification time is not part of it: copies of
    /// one checkpoint made at different times are the same bytes.
    fn fingerprint(&self) -> Result<String> {
        sampled_fingerprint(self, |page, offset| self.read_at(page, offset))
    }

    /// Reads and validates the header (two small reads; the data is not touched).
    fn header(&self) -> Result<Header> {
        let path = self.path();
        let format_err = |source| Error::Format { path: path.to_owned(), source };
        // More than the 8-byte length, so that a file of another format can be named.
        let mut prefix = [0u8; format::SNIFF_LEN];
        let got = self.read_at(&mut prefix, 0)?;
        if (got as u64) < format::LEN_PREFIX && self.len() >= format::LEN_PREFIX {
            return Err(Error::Truncated { path: path.to_owned(), at: got as u64, expected: self.len() });
        }
        let len = format::header_len(&prefix[..got], self.len()).map_err(format_err)?;
        let mut json = vec![0u8; len as usize];
        let got = self.read_at(&mut json, format::LEN_PREFIX)?;
        if got < json.len() {
            return Err(Error::Truncated {
                path: path.to_owned(),
                at: format::LEN_PREFIX + got as u64,
                expected: self.len(),
            });
        }
        format::parse_header(&json, self.len()).map_err(format_err)
    }
}

/// [`Source::fingerprint`] from the bytes: the size, the header (read with `src.read_at`) and
/// the sampled pages of the data, read with `read_page` (page-aligned offsets, into a
/// page-aligned buffer of one page, so that it may read past the page cache).
pub fn sampled_fingerprint<S: Source + ?Sized>(
    src: &S,
    read_page: impl Fn(&mut [u8], u64) -> Result<usize>,
) -> Result<String> {
    let len = src.len();
    let mut hash = Sha256::new();
    hash.update(len.to_le_bytes());
    let mut prefix = [0u8; format::LEN_PREFIX as usize];
    let got = src.read_at(&mut prefix, 0)?;
    let data_start = match got == prefix.len() {
        true => u64::from_le_bytes(prefix).saturating_add(format::LEN_PREFIX).min(len),
        false => 0,
    };
    // The header whole (read already to plan the load: in memory or in the page cache).
    let mut buf = vec![0u8; data_start.clamp(2 * FINGERPRINT_PAGE, 1 << 20) as usize];
    let mut at = 0;
    while at < data_start {
        let n = src.read_at(&mut buf[..(data_start - at).min(1 << 20) as usize], at)?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        at += n as u64;
    }
    // Then the pages sampled, from the first page of the data to the last page of the file.
    let skip = buf.as_ptr().align_offset(FINGERPRINT_PAGE as usize);
    let page = &mut buf[skip..skip + FINGERPRINT_PAGE as usize];
    let first = data_start / FINGERPRINT_PAGE;
    let last = len.saturating_sub(1) / FINGERPRINT_PAGE;
    let samples = ((len - data_start) >> 20).clamp(*FINGERPRINT_SAMPLES.start(), *FINGERPRINT_SAMPLES.end());
    for k in 0..samples {
        let offset = (first + (last - first.min(last)) * k / (samples - 1)) * FINGERPRINT_PAGE;
        let n = read_page(page, offset)?;
        hash.update(&page[..n]);
    }
    Ok(hex(&hash.finalize()))
}

/// `bytes` in lowercase hexadecimal (how digests are written and compared).
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether the read running on this thread is still wanted (a stream not yet dropped).
pub type Wanted = Arc<dyn Fn() -> bool + Send + Sync>;

thread_local! {
    static WANTED: std::cell::RefCell<Option<Wanted>> = const { std::cell::RefCell::new(None) };
}

/// Runs `read` with `wanted` as what a source that waits long (a remote object) asks, while it
/// waits, whether to go on: a stream dropped mid-read stops its requests at once instead of
/// waiting for a stalled server.
pub fn read_while<T>(wanted: Wanted, read: impl FnOnce() -> T) -> T {
    let before = WANTED.with(|w| w.borrow_mut().replace(wanted));
    let out = read();
    WANTED.with(|w| *w.borrow_mut() = before);
    out
}

/// What [`read_while`] set on this thread, if anything.
pub(crate) fn wanted() -> Option<Wanted> {
    WANTED.with(|w| w.borrow().clone())
}

/// Opens what `path` names: an object for a URL (`s3://`, `gs://`, `az://`, `http(s)://`),
/// else a local file.
pub fn open(path: &Path) -> Result<Arc<dyn Source>> {
    open_cached(path, None)
}

/// [`open`], with `cache_dir` as the cache of objects read (`None`: the one
/// `$FASTSAFETENSORS_CACHE_DIR` names, if any).
pub fn open_cached(path: &Path, cache_dir: Option<&Path>) -> Result<Arc<dyn Source>> {
    if remote::is_url(path) {
        let url = path.to_str().expect("a URL is UTF-8");
        let mut object = remote::RemoteObject::open(url)?;
        let dir = match cache_dir {
            Some(dir) => Some(cache::usable_dir(dir)?),
            None => cache::dir_from_env()?,
        };
        if let Some(dir) = dir {
            cache::remove_stale_partials(&dir);
            // The version just read decides: its entry if it is there and whole, else one is
            // written.
            if let Some(hit) = cache::lookup(&dir, url, object.identity(), object.prefix()) {
                return Ok(Arc::new(hit));
            }
            object.cache_into(&dir);
        }
        return Ok(Arc::new(object));
    }
    Ok(Arc::new(LocalFile::open(path)?))
}

/// Opens every path, the URLs among them in parallel (each open is a round trip to the
/// store: a checkpoint of 30 shards would wait for 30 in turn). The error is the first in
/// `paths` order, as opening them one by one would give.
pub fn open_all(paths: &[PathBuf]) -> Result<Vec<Arc<dyn Source>>> {
    if !paths.iter().any(|p| remote::is_url(p)) {
        return paths.iter().map(|p| open(p)).collect();
    }
    let opened: Vec<Result<Arc<dyn Source>>> = io_pool().install(|| paths.par_iter().map(|p| open(p)).collect());
    opened.into_iter().collect()
}

/// Decides how to bring `src` into host memory: the reader `kind` asks for, or for `Auto`, a
/// mapping if the file is resident and direct reads otherwise. A source that cannot be
/// mapped is read.
pub fn choose(src: &dyn Source, kind: ReaderKind) -> Result<HostRead> {
    let Some(file) = src.local().filter(|_| src.capabilities().mmap) else { return Ok(HostRead::Direct) };
    Ok(match kind {
        ReaderKind::Mmap => HostRead::Map,
        ReaderKind::Direct => HostRead::Direct,
        ReaderKind::Auto if file.is_resident()? => HostRead::Map,
        ReaderKind::Auto => HostRead::Direct,
    })
}

/// Maps `extent` of `src` (copy-on-write; nothing is read until touched).
pub fn map_extent(src: &dyn Source, extent: &Extent, path: ReadPath) -> Result<HostBuffer> {
    let file =
        src.local().ok_or_else(|| Error::InvalidArgument(format!("{}: cannot be mapped", src.path().display())))?;
    Ok(HostBuffer::new(mmap::map_range(file, extent.start, extent.expected)?, path))
}

/// An open regular file on a local filesystem: the source everything else builds on.
pub struct LocalFile {
    path: PathBuf,
    file: File,
    identity: Identity,
}

impl LocalFile {
    pub fn open(path: &Path) -> Result<LocalFile> {
        // O_NONBLOCK so that a FIFO given by mistake is refused below instead of blocking
        // the open until a writer appears; it changes nothing for regular files.
        let file = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| Error::io(path, "open", e))?;
        let meta = file.metadata().map_err(|e| Error::io(path, "stat", e))?;
        if !meta.is_file() {
            return Err(Error::NotAFile { path: path.to_owned() });
        }
        let identity = Identity::File { len: meta.len(), modified: meta.modified().ok() };
        Ok(LocalFile { path: path.to_owned(), file, identity })
    }

    /// The open file, for the readers that need its descriptor (mappings, cuFile).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The file opened again, with `flags` (`O_DIRECT`) added: through `/proc/self/fd`, so that
    /// it is the file this one opened even where its path now names another file, or none.
    /// Errors are the caller's to name the file by its path.
    pub fn reopen(&self, flags: libc::c_int) -> std::io::Result<File> {
        let fd = format!("/proc/self/fd/{}", self.file.as_raw_fd());
        OpenOptions::new().read(true).custom_flags(flags).open(fd)
    }

    /// Whether (nearly) all of the file is in the page cache, so reading it through the
    /// cache beats O_DIRECT.
    pub fn is_resident(&self) -> Result<bool> {
        Ok(self.resident_fraction()? >= RESIDENT_THRESHOLD)
    }

    /// Fraction of the file's pages in the page cache.
    pub fn resident_fraction(&self) -> Result<f64> {
        mmap::resident_fraction(self)
    }
}

impl Source for LocalFile {
    fn path(&self) -> &Path {
        &self.path
    }

    fn identity(&self) -> &Identity {
        &self.identity
    }

    fn current_identity(&self) -> Result<Identity> {
        let meta = self.file.metadata().map_err(|e| Error::io(&self.path, "stat", e))?;
        Ok(Identity::File { len: meta.len(), modified: meta.modified().ok() })
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(&self.path, "read", e)),
            }
        }
        Ok(done)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { direct: true, mmap: true, gds: true }
    }

    fn local(&self) -> Option<&LocalFile> {
        Some(self)
    }

    /// The sampled pages read past the page cache where the filesystem allows it: a buffered
    /// read of a cold file would read ahead megabytes around each page.
    fn fingerprint(&self) -> Result<String> {
        match self.reopen(libc::O_DIRECT) {
            // A filesystem that opens with O_DIRECT but refuses the read: through the cache.
            Ok(direct) => sampled_fingerprint(self, |page, offset| match direct.read_at(page, offset) {
                Ok(n) => Ok(n),
                Err(_) => self.read_at(page, offset),
            }),
            Err(_) => sampled_fingerprint(self, |page, offset| self.read_at(page, offset)),
        }
    }
}

/// The pool that runs reads. Separate from rayon's global pool: I/O threads mostly wait,
/// so there should be more of them than cores, and they must not starve compute work.
pub(crate) fn io_pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        // Every load checks the variable before reading (`check_env`): the default stands in
        // only if it turned malformed between that check and this first use.
        let threads = io_threads().unwrap_or(DEFAULT_THREADS);
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("fastsafetensors-io-{i}"))
            .build()
            .expect("creating the I/O thread pool")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_counts_are_whole_numbers_from_one_to_the_limit() {
        assert_eq!(parse_threads("1"), Some(1));
        assert_eq!(parse_threads("64"), Some(64));
        assert_eq!(parse_threads("1024"), Some(1024));
        for bad in ["0", "-1", "1025", "abc", "8 threads", "2.5", ""] {
            assert_eq!(parse_threads(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn reader_names() {
        assert_eq!("mmap".parse::<ReaderKind>().unwrap(), ReaderKind::Mmap);
        let err = "fast".parse::<ReaderKind>().unwrap_err().to_string();
        assert!(err.contains("'fast'") && err.contains("'direct'"), "{err}");
    }

    #[test]
    fn malformed_settings_name_the_variable_and_what_it_takes() {
        let err = Error::InvalidSetting { var: THREADS_ENV, value: "abc".into(), expected: "a whole number" };
        assert_eq!(
            err.to_string(),
            "FASTSAFETENSORS_THREADS='abc' is not valid: expected a whole number (or unset it for the default)"
        );
    }
}
