//! What identifies a kept entry: a later load attaches only when it would read the same bytes
//! to the same device, checked against the same digests.
//!
//! Two digests, both sha256 of JSON: `what` (the files by path, the byte ranges read, the
//! device, and for a verified load the digests each file must hash to) and `version` (each
//! file as it is now: for a local file its device, inode, size, modification and change
//! times, and [`Source::fingerprint`], which hashes the header and pages sampled from the data;
//! for an object, the ETag, version or generation the store gives). An entry whose `what`
//! matches but whose `version` does not is stale: the keeper drops it and the load fills a
//! new one. A source without a version (an object whose store names none) is not kept.
//!
//! The dtype a load casts to is not part of either: an entry holds the files' bytes, and a
//! cast runs on the tensors made from them, attached or read.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;
use serde_json::json;
use sha2::{Digest, Sha256};

use super::{Describe, Span};
use crate::error::{Error, Result};
use crate::plan::Extent;
use crate::source::{self, hex, Identity, Source};
use crate::verify::FileCheck;

/// Changes when what an entry holds is laid out differently.
const LAYOUT: u32 = 1;

/// The entry a load of `extents` of `sources` to `device` ("cpu", "cuda:UUID") would make,
/// checked against `checks` (one per source; empty: not verified). `Error::Keep` says why
/// it cannot be kept; other errors are those of reading the sources.
pub fn describe(
    sources: &[Arc<dyn Source>],
    extents: &[Extent],
    checks: &[Arc<FileCheck>],
    device: &str,
) -> Result<Describe> {
    let mut used = vec![false; sources.len()];
    extents.iter().for_each(|e| used[e.file] = true);
    let files: Vec<String> = sources.iter().map(|s| shown_path(s.path())).collect();
    let versions: Vec<String> = source::io_pool().install(|| {
        sources
            .par_iter()
            .zip(&used)
            .map(|(s, &used)| if used { version(&**s) } else { Ok(String::new()) })
            .collect::<Result<_>>()
    })?;
    let verified: Vec<Option<String>> = match checks {
        [] => vec![None; sources.len()],
        _ => checks.iter().map(|c| Some(c.expected())).collect(),
    };
    let ranges: Vec<[u64; 4]> = extents.iter().map(|e| [e.file as u64, e.start, e.len, e.expected]).collect();
    let what = json!({
        "layout": LAYOUT, "files": files, "extents": ranges, "device": device, "verified": verified,
    });
    let (buffers, len) = layout(extents.iter().map(|e| e.len));
    Ok(Describe {
        what: sha256(&what.to_string()),
        version: sha256(&json!(versions).to_string()),
        files,
        device: device.to_owned(),
        verified: checks.first().map(|c| c.manifest().to_owned()),
        buffers,
        len,
    })
}

/// Where buffers of `lens` bytes lie in one memory file: one after the other, each at a page
/// boundary (at least a page each); and the file's length.
pub fn layout(lens: impl Iterator<Item = u64>) -> (Vec<Span>, u64) {
    let page = source::mmap::page_size() as u64;
    let mut at = 0u64;
    let spans = lens
        .map(|len| {
            let span = Span { offset: at, len: len.max(1) };
            at += span.len.next_multiple_of(page);
            span
        })
        .collect();
    (spans, at)
}

/// How a file is named in an entry: its canonical path, or a URL as errors show it.
fn shown_path(path: &Path) -> String {
    let text = path.to_string_lossy();
    if source::remote::is_url(path) {
        return crate::error::shown(&text);
    }
    std::fs::canonicalize(path).map_or_else(|_| text.into_owned(), |p| p.to_string_lossy().into_owned())
}

/// The version of one source, as text.
fn version(src: &dyn Source) -> Result<String> {
    if let Some(file) = src.local() {
        let path = src.path();
        let meta = file.file().metadata().map_err(|e| Error::io(path, "stat", e))?;
        return Ok(format!(
            "file dev {} ino {} size {} mtime {}.{:09} ctime {}.{:09} fingerprint {}",
            meta.dev(),
            meta.ino(),
            meta.size(),
            meta.mtime(),
            meta.mtime_nsec(),
            meta.ctime(),
            meta.ctime_nsec(),
            src.fingerprint()?
        ));
    }
    match src.identity() {
        // A date alone (what a plain HTTP server may give) tells versions apart only to the
        // second: an object replaced within one at the same size would attach stale bytes.
        Identity::Object { e_tag, version, .. } => {
            e_tag.as_ref().or(version.as_ref()).and_then(|_| src.identity().version_fingerprint()).ok_or_else(|| {
                Error::Keep(format!(
                    "{}: the store names no version of it (no ETag or version id; a date alone does not tell \
                     versions of one second apart): it is not kept",
                    crate::error::shown(&src.path().to_string_lossy())
                ))
            })
        }
        Identity::File { .. } => {
            Err(Error::Keep(format!("{}: not a file this process can name", src.path().display())))
        }
    }
}

fn sha256(text: &str) -> String {
    hex(&Sha256::digest(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_pages() {
        let page = source::mmap::page_size() as u64;
        let (spans, len) = layout([page, 1, 0, 3 * page + 5].into_iter());
        let offsets: Vec<u64> = spans.iter().map(|s| s.offset).collect();
        assert_eq!(offsets, [0, page, 2 * page, 3 * page]);
        assert_eq!(spans[2].len, 1, "an empty buffer still has an address");
        assert_eq!(len, 7 * page);
    }
}
