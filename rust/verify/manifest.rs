//! Manifests without a signature: digests the caller gives, and those a Hugging Face cache's
//! blob names carry.

use std::collections::BTreeMap;
use std::path::{Component, Path};

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
    Ok(Manifest { files, origin: "the digests given".into() })
}

/// The digests a Hugging Face cache snapshot carries for `paths`: in
/// `…/snapshots/<revision>/`, each file is a link to `…/blobs/<sha256 of its bytes>` (for
/// files stored with Git LFS, as weights are). A path that is not such a link is an error
/// naming it: `verify=True` has nothing to check it against.
pub fn from_hf_cache(paths: &[&Path]) -> Result<Manifest> {
    let mut files = BTreeMap::new();
    for &path in paths {
        let digest = hf_blob_digest(path).map_err(|why| Error::NothingToVerify { path: path.to_owned(), why })?;
        files.insert(path.to_string_lossy().into_owned(), Expected::Whole(digest));
    }
    Ok(Manifest { files, origin: "the Hugging Face cache's blob name".into() })
}

fn hf_blob_digest(path: &Path) -> std::result::Result<Digest, String> {
    const NOTHING: &str = "verify=True checks a file against what its location carries, and this path carries no \
                           digest (it is not a link from a Hugging Face cache snapshot to a blob named by its sha256): \
                           pass verify=Signature(...) or verify=Digests({...})";
    let in_snapshot =
        path.parent().and_then(Path::parent).is_some_and(|p| p.file_name().is_some_and(|n| n == "snapshots"));
    let target = std::fs::read_link(path).map_err(|_| NOTHING.to_owned())?;
    let blob_dir_ok = target.components().rev().nth(1).is_some_and(|c| c == Component::Normal("blobs".as_ref()));
    let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if !in_snapshot || !blob_dir_ok {
        return Err(NOTHING.to_owned());
    }
    if name.len() == 40 && name.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!(
            "its blob {name} is named by a git object id (a file stored without Git LFS), not by the sha256 of its \
             bytes: pass verify=Digests({{...}}) or a signature"
        ));
    }
    Digest::from_hex("sha256", &name).map_err(|_| NOTHING.to_owned())
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
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
