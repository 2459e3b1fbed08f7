//! Manifests without a signature: digests the caller gives, and those a Hugging Face cache's
//! blob names carry.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use super::{Digest, Expected, Manifest};
use crate::error::{Error, Result};

/// A manifest of the caller's digests: file name (relative to the checkpoint's directory, or
/// a bare file name) → `sha256:<hex>` (or `blake2:`/`blake3:`; a bare hex string is sha256).
pub fn from_digests(digests: &BTreeMap<String, String>) -> Result<Manifest> {
    let mut files = BTreeMap::new();
    for (name, text) in digests {
        let digest =
            Digest::parse(text.trim()).map_err(|why| Error::InvalidArgument(format!("Digests: {name}: {why}")))?;
        files.insert(name.trim_start_matches("./").to_owned(), Expected::Whole(digest));
    }
    Ok(Manifest { files, origin: "the digests given".into(), ..Manifest::default() })
}

/// The digests a Hugging Face cache snapshot carries for `paths`: in
/// `…/snapshots/<revision>/` (and its subfolders), each file is a link to
/// `…/blobs/<sha256 of its bytes>` (for files stored with Git LFS, as weights are). A path
/// that is not such a link is an error naming it: `verify=True` has nothing to check it
/// against.
pub fn from_hf_cache(paths: &[&Path]) -> Result<Manifest> {
    let mut files = BTreeMap::new();
    for &path in paths {
        let digest = hf_blob_digest(path).map_err(|why| Error::NothingToVerify { path: path.to_owned(), why })?;
        files.insert(path.to_string_lossy().into_owned(), Expected::Whole(digest));
    }
    Ok(Manifest { files, origin: "the Hugging Face cache's blob name".into(), ..Manifest::default() })
}

fn hf_blob_digest(path: &Path) -> std::result::Result<Digest, String> {
    const NOTHING: &str = "verify=True checks a file against what its location carries, and this path carries no \
                           digest (it is not a link from a Hugging Face cache snapshot to a blob named by its sha256): \
                           pass verify=Signature(...) or verify=Digests({...})";
    let target = std::fs::read_link(path).map_err(|_| NOTHING.to_owned())?;
    // The link's folder, resolved (a path relative to the working directory, a cache reached
    // through a link), then where the link leads from it, by name.
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let dir = std::fs::canonicalize(dir).map_err(|_| NOTHING.to_owned())?;
    let blob = lexical(&dir.join(&target));
    // The repository folder: the one holding `snapshots/<revision>/`, above the link.
    let repo = dir
        .ancestors()
        .find(|d| d.parent().and_then(Path::file_name).is_some_and(|n| n == "snapshots"))
        .and_then(|revision| revision.parent()?.parent());
    let name = blob.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    match repo {
        Some(repo) if blob.parent() == Some(repo.join("blobs").as_path()) => {}
        _ => return Err(NOTHING.to_owned()),
    }
    if name.len() == 40 && name.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!(
            "its blob {name} is named by a git object id (a file stored without Git LFS), not by the sha256 of its \
             bytes: pass verify=Digests({{...}}) or a signature"
        ));
    }
    Digest::from_hex("sha256", &name).map_err(|_| NOTHING.to_owned())
}

/// `path` with its `.` and `..` components applied, by name (no link is followed).
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            part => out.push(part),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_take_algorithm_prefixes_and_bare_sha256() {
        let hex = "ab".repeat(32);
        let m = from_digests(&BTreeMap::from([
            ("a.safetensors".to_owned(), format!("sha256:{hex}")),
            ("./b.safetensors".to_owned(), hex.clone()),
            ("c.safetensors".to_owned(), format!("blake2:{}", "cd".repeat(64))),
        ]))
        .unwrap();
        assert_eq!(m.files.len(), 3);
        assert!(matches!(&m.files["b.safetensors"], Expected::Whole(d) if d.hex() == hex));
        let bad =
            |text: &str| from_digests(&BTreeMap::from([("a".to_owned(), text.to_owned())])).unwrap_err().to_string();
        assert!(bad("md5:00").contains("'md5' is not supported"), "{}", bad("md5:00"));
        assert!(bad("sha256:xyz").contains("not a hex digest"));
        assert!(bad("sha256:abcd").contains("64 hex digits"));
    }

    #[test]
    fn manifest_entries_match_the_longest_suffix_on_path_boundaries() {
        let hex = "00".repeat(32);
        let m = from_digests(&BTreeMap::from([
            ("model.safetensors".to_owned(), hex.clone()),
            ("sub/model.safetensors".to_owned(), hex),
        ]))
        .unwrap();
        assert_eq!(m.entry_for("/x/sub/model.safetensors").unwrap().0, "sub/model.safetensors");
        assert_eq!(m.entry_for("/x/model.safetensors").unwrap().0, "model.safetensors");
        assert_eq!(m.entry_for("s3://b/m/model.safetensors").unwrap().0, "model.safetensors");
        assert!(m.entry_for("/x/othermodel.safetensors").is_none());
        // A URL's query and fragment are not its name: the same bytes at `?v=2`, or at a
        // presigned URL, are the same listed file; percent-escapes are decoded.
        for url in [
            "https://h/m/model.safetensors?v=2",
            "https://h/m/model.safetensors#part",
            "s3://b/m/model.safetensors?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Signature=ab%2Fcd",
        ] {
            assert_eq!(m.entry_for(url).map(|(n, _)| n), Some("model.safetensors"), "{url}");
        }
        assert_eq!(
            m.entry_for("https://h/m/sub%2Fmodel.safetensors?x=1").map(|(n, _)| n),
            Some("sub/model.safetensors")
        );
        assert!(m.entry_for("https://h/m/model.safetensors.bak?v=.safetensors").is_none());
        // A local name may hold '?' and '#': they are its name.
        assert!(m.entry_for("/x/model.safetensors?v=2").is_none());
        let spaced = from_digests(&BTreeMap::from([("my model.safetensors".to_owned(), "00".repeat(32))])).unwrap();
        assert!(spaced.entry_for("https://h/my%20model.safetensors").is_some());
    }

    #[test]
    fn a_cache_snapshot_link_carries_its_blobs_digest() {
        let dir = std::env::temp_dir().join(format!("fst-hf-{}", std::process::id()));
        let hex = "12".repeat(32);
        std::fs::create_dir_all(dir.join("blobs")).unwrap();
        std::fs::create_dir_all(dir.join("snapshots/main")).unwrap();
        std::fs::write(dir.join("blobs").join(&hex), b"x").unwrap();
        std::fs::write(dir.join("snapshots/main/plain.safetensors"), b"x").unwrap();
        let link = dir.join("snapshots/main/model.safetensors");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(format!("../../blobs/{hex}"), &link).unwrap();
        let m = from_hf_cache(&[link.as_path()]).unwrap();
        assert!(matches!(m.files.values().next(), Some(Expected::Whole(d)) if d.hex() == hex));
        let err = from_hf_cache(&[dir.join("snapshots/main/plain.safetensors").as_path()]).unwrap_err();
        assert!(err.to_string().contains("carries no digest"), "{err}");
        // A subfolder of the snapshot (diffusers' transformer/, unet/, ...): its links lead
        // three folders up; one that leads elsewhere carries nothing.
        std::fs::create_dir_all(dir.join("snapshots/main/unet")).unwrap();
        let deep = dir.join("snapshots/main/unet/model.safetensors");
        std::os::unix::fs::symlink(format!("../../../blobs/{hex}"), &deep).unwrap();
        let m = from_hf_cache(&[deep.as_path()]).unwrap();
        assert!(matches!(m.files.values().next(), Some(Expected::Whole(d)) if d.hex() == hex));
        std::fs::create_dir_all(dir.join("snapshots/blobs")).unwrap();
        std::fs::write(dir.join("snapshots/blobs").join(&hex), b"x").unwrap();
        let astray = dir.join("snapshots/main/unet/astray.safetensors");
        std::os::unix::fs::symlink(format!("../../blobs/{hex}"), &astray).unwrap();
        let err = from_hf_cache(&[astray.as_path()]).unwrap_err();
        assert!(err.to_string().contains("carries no digest"), "{err}");
        // A path relative to the working directory is resolved from it.
        let cwd = std::env::current_dir().unwrap();
        let relative = deep.strip_prefix(&cwd).map(Path::to_owned).unwrap_or_else(|_| {
            let up = cwd.components().count() - 1;
            PathBuf::from("../".repeat(up)).join(deep.strip_prefix("/").unwrap())
        });
        assert!(from_hf_cache(&[relative.as_path()]).is_ok(), "{}", relative.display());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
