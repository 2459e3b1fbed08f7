//! What a path given to a load stands for: one `.safetensors` file, a checkpoint directory
//! or a checkpoint index. The first step of the data flow, before any header is read.
//!
//! - A directory holding one `*.safetensors.index.json`: the shards that index lists (other
//!   `.safetensors` files beside them, such as a `consolidated.safetensors`, are not loaded).
//! - A directory without an index: every `*.safetensors` in it, in name order
//!   (subdirectories are not searched).
//!
//! In a directory, names starting with `.` are skipped, as the shell's and Python's
//! `glob("*.safetensors")` skip them (e.g. the `._*` files macOS leaves on shared drives).
//! - A directory holding several indexes: refused; pass the index to load.
//! - A file whose name ends in `.json`: a checkpoint index (`{"weight_map": {tensor: shard}}`,
//!   shard paths relative to the index's directory); the shards it lists, in name order.
//! - Anything else: itself, a `.safetensors` file.
//! - A URL (`s3://`, `gs://`, `az://`, `http(s)://`): an index if it ends in `.json`, a file if
//!   it ends in `.safetensors`, else a prefix, which stands for the objects directly under it
//!   as a directory does for its files (HTTP servers cannot be listed: give the index).
//!
//! The shards of an index are checked against it: every shard it lists exists
//! ([`Checkpoint::check_files`], before anything is opened), and once the headers are read,
//! every tensor of the map is in the shard the map names and every tensor of the shards is
//! in the map ([`check_placed`]). Symbolic links are followed (the Hugging Face cache is
//! made of them).
//!
//! ```no_run
//! use fastsafetensors::load::checkpoint::Checkpoint;
//! let ckpt = Checkpoint::resolve("models/llama".as_ref())?;
//! ckpt.check_files()?;
//! println!("{} files, index {:?}", ckpt.files.len(), ckpt.index.as_ref().map(|i| &i.path));
//! # Ok::<(), fastsafetensors::Error>(())
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::error::{Error, Problem, Result};
use crate::plan::Placement;
use crate::source::{self, remote};
use crate::verify::{FileCheck, Verifier};

/// How the name of a checkpoint index ends in a directory.
pub const INDEX_SUFFIX: &str = ".safetensors.index.json";
/// How the name of a file a directory contributes ends.
const FILE_SUFFIX: &str = ".safetensors";
/// Largest index read: bigger files are not indexes (a 100k-tensor index is ~10 MB).
const MAX_INDEX_LEN: u64 = 100_000_000;

/// The files a path stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The path as given.
    pub path: PathBuf,
    /// The files to load, in order.
    pub files: Vec<PathBuf>,
    /// The index the files come from, if any.
    pub index: Option<Index>,
}

/// A checkpoint index, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    pub path: PathBuf,
    /// Tensor name → shard, as written in the index.
    pub weight_map: BTreeMap<String, String>,
    /// The shards as written, in the order of [`Checkpoint::files`].
    pub shards: Vec<String>,
    /// The index's bytes as read: what a verified load checks (the index chooses the files).
    pub bytes: Vec<u8>,
}

#[derive(Deserialize)]
struct RawIndex {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// The files `path` stands for (see the module documentation). Reads directory listings
    /// and the index, no safetensors file. A path that does not exist stands for itself, so
    /// that opening it reports it.
    pub fn resolve(path: &Path) -> Result<Checkpoint> {
        if remote::is_url(path) {
            return Checkpoint::resolve_url(path);
        }
        if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
            return Checkpoint::from_directory(path);
        }
        if path.extension().is_some_and(|e| e == "json") {
            return Checkpoint::from_index(path, path);
        }
        Ok(Checkpoint { path: path.to_owned(), files: vec![path.to_owned()], index: None })
    }

    /// A URL: an index (`.json`), a file (`.safetensors`), or else a prefix, listed as a
    /// directory is (objects directly under it; names starting with `.` skipped).
    fn resolve_url(url: &Path) -> Result<Checkpoint> {
        let text = url.to_str().expect("a URL is UTF-8");
        let name = text.split(['?', '#']).next().unwrap_or(text).trim_end_matches('/');
        if name.ends_with(".json") {
            return Checkpoint::from_index(url, url);
        }
        if name.ends_with(FILE_SUFFIX) {
            return Ok(Checkpoint { path: url.to_owned(), files: vec![url.to_owned()], index: None });
        }
        let entries = remote::list(text)?
            .into_iter()
            .filter_map(|u| {
                let name = u.rsplit('/').next().unwrap_or(&u).to_owned();
                (!name.starts_with('.')).then(|| (name, PathBuf::from(u)))
            })
            .collect();
        Checkpoint::from_entries(url, entries)
    }

    fn from_directory(dir: &Path) -> Result<Checkpoint> {
        let mut listed = Vec::new();
        let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, "read directory", e))?;
        for entry in entries {
            let entry = entry.map_err(|e| Error::io(dir, "read directory", e))?;
            let raw = entry.file_name();
            let name = raw.to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let path = entry.path();
            // Paths cross to Python and C++ as UTF-8: a shard named otherwise could be loaded but
            // not reported, so it is refused, by name.
            if raw.to_str().is_none() && (name.ends_with(FILE_SUFFIX) || name.ends_with(INDEX_SUFFIX)) {
                return Err(Error::NotUtf8 { path });
            }
            // A dangling link stays in, so that the load reports it instead of skipping it.
            if std::fs::metadata(&path).is_ok_and(|m| m.is_dir()) {
                continue;
            }
            listed.push((name, path));
        }
        Checkpoint::from_entries(dir, listed)
    }

    /// The checkpoint of a directory (or prefix) holding `listed` (name, path) entries.
    fn from_entries(dir: &Path, listed: Vec<(String, PathBuf)>) -> Result<Checkpoint> {
        let mut indexes = Vec::new();
        let mut files = Vec::new();
        for (name, path) in listed {
            if name.ends_with(INDEX_SUFFIX) {
                indexes.push((name, path));
            } else if name.ends_with(FILE_SUFFIX) {
                files.push((name, path));
            }
        }
        indexes.sort();
        files.sort();
        match indexes.len() {
            0 if files.is_empty() => Err(Error::NoCheckpointFiles { dir: dir.to_owned() }),
            0 => {
                Ok(Checkpoint { path: dir.to_owned(), files: files.into_iter().map(|(_, p)| p).collect(), index: None })
            }
            1 => Checkpoint::from_index(dir, &indexes[0].1),
            _ => {
                Err(Error::SeveralIndexes { dir: dir.to_owned(), names: indexes.into_iter().map(|(n, _)| n).collect() })
            }
        }
    }

    fn from_index(given: &Path, index_path: &Path) -> Result<Checkpoint> {
        let invalid = |reason: String| Error::InvalidIndex { path: index_path.to_owned(), reason };
        let url = index_path.to_str().filter(|_| remote::is_url(index_path));
        let text = match url {
            Some(url) => remote::read_small(url)?,
            None => {
                let len = std::fs::metadata(index_path).map_err(|e| Error::io(index_path, "open", e))?.len();
                if len > MAX_INDEX_LEN {
                    return Err(invalid(format!("it is {len} bytes, more than an index can be")));
                }
                std::fs::read(index_path).map_err(|e| Error::io(index_path, "read", e))?
            }
        };
        let raw: RawIndex = serde_json::from_slice(&text).map_err(|e| {
            invalid(format!(
                "{e} (a load takes .safetensors files, their directory, or the *{INDEX_SUFFIX} that lists them)"
            ))
        })?;
        if raw.weight_map.is_empty() {
            return Err(invalid("its weight_map lists no tensors".to_owned()));
        }
        let shards: BTreeSet<&String> = raw.weight_map.values().collect();
        if let Some(bad) = shards.iter().find(|s| !Path::new(s).components().all(|c| matches!(c, Component::Normal(_))))
        {
            return Err(invalid(format!("shard path '{bad}' does not stay inside the index's directory")));
        }
        let files = match url {
            Some(url) => shards.iter().map(|s| PathBuf::from(remote::sibling(url, s))).collect(),
            None => {
                let folder = index_path.parent().unwrap_or(Path::new(""));
                shards.iter().map(|s| folder.join(s)).collect()
            }
        };
        let shards = shards.into_iter().cloned().collect();
        Ok(Checkpoint {
            path: given.to_owned(),
            files,
            index: Some(Index { path: index_path.to_owned(), weight_map: raw.weight_map, shards, bytes: text }),
        })
    }

    /// Where problems are reported: the index, else the path given.
    pub fn report_path(&self) -> &Path {
        self.index.as_ref().map_or(&self.path, |i| &i.path)
    }

    /// The shards the index lists that are not regular files.
    pub fn missing_files(&self) -> Vec<Problem> {
        let Some(index) = &self.index else { return Vec::new() };
        if remote::is_url(&index.path) {
            let urls: Vec<String> = self.files.iter().map(|f| f.to_string_lossy().into_owned()).collect();
            return index
                .shards
                .iter()
                .zip(remote::missing(&urls))
                .filter_map(|(shard, why)| Some(Problem::MissingShard { shard: shard.clone(), reason: why? }))
                .collect();
        }
        index
            .shards
            .iter()
            .zip(&self.files)
            .filter_map(|(shard, file)| {
                let reason = match std::fs::metadata(file) {
                    Ok(m) if m.is_file() => return None,
                    Ok(_) => "is not a regular file".to_owned(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => "does not exist".to_owned(),
                    Err(e) => format!("cannot be read: {e}"),
                };
                Some(Problem::MissingShard { shard: shard.clone(), reason })
            })
            .collect()
    }

    /// Fails naming the first shard the index lists that is not there.
    pub fn check_files(&self) -> Result<()> {
        self.first_problem(self.missing_files())
    }

    /// Every tensor-level problem, given the tensor names of each file (`names[i]` for
    /// `files[i]`; None for a file that could not be read, which is reported on its own).
    pub fn tensor_problems(&self, names: &[Option<Vec<&str>>]) -> Vec<Problem> {
        let mut problems = Vec::new();
        let mut owner: HashMap<&str, usize> = HashMap::new();
        let mut in_order = Vec::new();
        for (i, file_names) in names.iter().enumerate() {
            for &name in file_names.iter().flatten() {
                match owner.get(name) {
                    Some(&first) => problems.push(Problem::Duplicate {
                        name: name.to_owned(),
                        first: self.files[first].clone(),
                        second: self.files[i].clone(),
                    }),
                    None => {
                        owner.insert(name, i);
                        in_order.push((name, i));
                    }
                }
            }
        }
        let Some(index) = &self.index else { return problems };
        for (name, listed) in &index.weight_map {
            let listed_file = index.shards.binary_search(listed).expect("every shard of the map is listed");
            if names[listed_file].is_none() {
                continue;
            }
            match owner.get(name.as_str()) {
                Some(&found) if found == listed_file => {}
                Some(&found) => problems.push(Problem::WrongShard {
                    name: name.clone(),
                    listed: listed.clone(),
                    found: self.files[found].clone(),
                }),
                None => problems.push(Problem::NotInShards { name: name.clone(), listed: listed.clone() }),
            }
        }
        for (name, file) in in_order {
            if !index.weight_map.contains_key(name) {
                problems.push(Problem::Unlisted { name: name.to_owned(), file: self.files[file].clone() });
            }
        }
        problems
    }

    /// Every problem of the checkpoint, reading the headers of its files (for reports; a
    /// file that cannot be read is left to the caller to report).
    pub fn survey(&self) -> Vec<Problem> {
        let headers: Vec<_> = self.files.iter().map(|f| source::open(f).and_then(|s| s.header()).ok()).collect();
        let names: Vec<Option<Vec<&str>>> =
            headers.iter().map(|h| h.as_ref().map(|h| h.tensors.iter().map(|t| t.name.as_str()).collect())).collect();
        let mut problems = self.missing_files();
        problems.extend(self.tensor_problems(&names));
        problems
    }

    fn first_problem(&self, problems: Vec<Problem>) -> Result<()> {
        let more = problems.len().saturating_sub(1);
        match problems.into_iter().next() {
            Some(problem) => Err(Error::Checkpoint { path: self.report_path().to_owned(), problem, more }),
            None => Ok(()),
        }
    }
}

/// For a load of `files` verified against `verifier`, the checkpoints it was given (`given`:
/// files, directories, indexes, prefixes) resolved again and checked as a whole: an index the
/// manifest lists must hash to what it lists (it chooses the files); a directory or prefix
/// without one must have every weights file the manifest lists directly under it among the
/// files loaded (nothing outside it is asked for); and the files must be those the load opened.
pub fn check_verified(given: &[PathBuf], files: &[&Path], verifier: &Verifier) -> Result<()> {
    let manifest = &verifier.manifest;
    let mut resolved = Vec::new();
    for path in given {
        let ckpt = Checkpoint::resolve(path)?;
        let index_listed = match &ckpt.index {
            Some(index) => match manifest.entry_for(&index.path.to_string_lossy()) {
                Some((_, expected)) => {
                    let check = FileCheck::new(&index.path, index.bytes.len() as u64, expected, &manifest.origin)?;
                    check.landed_transient(0, &index.bytes);
                    check.finish()?;
                    true
                }
                None => false,
            },
            None => false,
        };
        let one_file = ckpt.index.is_none() && ckpt.files.len() == 1 && ckpt.files[0] == ckpt.path;
        if !one_file && !index_listed {
            check_directory_complete(&ckpt, verifier)?;
        }
        resolved.extend(ckpt.files);
    }
    let opened: BTreeSet<&Path> = files.iter().copied().collect();
    if let Some(changed) = resolved.iter().find(|f| !opened.contains(f.as_path())) {
        return Err(Error::InvalidArgument(format!(
            "{}: the checkpoint changed while it was being opened (this file was not among those opened)",
            changed.display()
        )));
    }
    Ok(())
}

/// Every `.safetensors` file the manifest lists in the directory of `ckpt`'s files (by the
/// name the manifest gives them) is among them.
fn check_directory_complete(ckpt: &Checkpoint, verifier: &Verifier) -> Result<()> {
    let manifest = &verifier.manifest;
    let names: BTreeSet<&str> =
        ckpt.files.iter().filter_map(|f| manifest.entry_for(&f.to_string_lossy()).map(|(name, _)| name)).collect();
    let Some(first) = names.first() else { return Ok(()) };
    let prefix = first.rsplit_once('/').map_or("", |(dir, _)| dir);
    let in_dir = |name: &str| match name.rsplit_once('/') {
        Some((dir, file)) => dir == prefix && !file.is_empty(),
        None => prefix.is_empty(),
    };
    let missing = manifest.files.keys().find(|n| n.ends_with(FILE_SUFFIX) && in_dir(n) && !names.contains(n.as_str()));
    match missing {
        Some(name) => {
            let file = name.rsplit('/').next().unwrap_or(name);
            Err(Error::NotLoaded { path: ckpt.path.join(file), manifest: manifest.origin.clone() })
        }
        None => Ok(()),
    }
}

/// The checkpoints `paths` stand for, their listed shards checked to exist.
pub fn resolve_all(paths: &[PathBuf]) -> Result<Vec<Checkpoint>> {
    let checkpoints = paths.iter().map(|p| Checkpoint::resolve(p)).collect::<Result<Vec<_>>>()?;
    checkpoints.iter().try_for_each(Checkpoint::check_files)?;
    Ok(checkpoints)
}

/// All files of `checkpoints`, in order.
pub fn files(checkpoints: &[Checkpoint]) -> Vec<PathBuf> {
    checkpoints.iter().flat_map(|c| c.files.iter().cloned()).collect()
}

/// Checks each checkpoint's tensors against its index, given where the tensors of
/// [`files`]`(checkpoints)` were placed.
pub fn check_placed(checkpoints: &[Checkpoint], tensors: &[Placement]) -> Result<()> {
    if checkpoints.iter().all(|c| c.index.is_none()) {
        return Ok(()); // duplicates across files were refused when the tensors were placed
    }
    let total: usize = checkpoints.iter().map(|c| c.files.len()).sum();
    let mut names: Vec<Option<Vec<&str>>> = vec![Some(Vec::new()); total];
    for t in tensors {
        names[t.file].as_mut().expect("every file was read").push(&t.name);
    }
    let mut start = 0;
    for c in checkpoints {
        let end = start + c.files.len();
        if c.index.is_some() {
            c.first_problem(c.tensor_problems(&names[start..end]))?;
        }
        start = end;
    }
    Ok(())
}

/// Fails if `path`, given to an operation that reads one file, is a directory.
pub fn check_single_file(path: &Path) -> Result<()> {
    if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        return Err(Error::IsDirectory { path: path.to_owned() });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("fst-checkpoint-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch(dir)
        }

        fn file(&self, name: &str, bytes: &[u8]) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, bytes).unwrap();
            path
        }

        fn index(&self, name: &str, map: &[(&str, &str)]) -> PathBuf {
            let map: BTreeMap<_, _> = map.iter().copied().collect();
            self.file(
                name,
                serde_json::json!({"metadata": {"total_size": 0}, "weight_map": map}).to_string().as_bytes(),
            )
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn names<'a>(files: &[&[&'a str]]) -> Vec<Option<Vec<&'a str>>> {
        files.iter().map(|f| Some(f.to_vec())).collect()
    }

    #[test]
    fn a_file_stands_for_itself_even_if_missing() {
        let c = Checkpoint::resolve(Path::new("/no/such/model.safetensors")).unwrap();
        assert_eq!(c.files, [PathBuf::from("/no/such/model.safetensors")]);
        assert_eq!(c.index, None);
        assert!(c.check_files().is_ok());
    }

    #[test]
    fn a_shard_whose_name_is_not_utf8_is_refused_by_name() {
        use std::os::unix::ffi::OsStrExt;
        let d = Scratch::new("not-utf8");
        d.file("a.safetensors", b"");
        let name = std::ffi::OsStr::from_bytes(b"b\xff.safetensors");
        std::fs::write(d.0.join(name), b"").unwrap();
        let err = Checkpoint::resolve(&d.0).unwrap_err().to_string();
        let shown = format!("{}/b\\xff.safetensors", d.0.display());
        assert_eq!(
            err,
            format!("{shown}: the path is not UTF-8, and fastsafetensors_rs takes UTF-8 paths only: rename the file, or link to it under a UTF-8 name")
        );
    }

    #[test]
    fn a_directory_without_index_is_its_safetensors_files_in_name_order() {
        let d = Scratch::new("plain");
        d.file("b.safetensors", b"");
        d.file("a.safetensors", b"");
        d.file("config.json", b"{}");
        d.file("notes.txt", b"");
        d.file("._a.safetensors", b"\x00\x05\x16\x07"); // macOS AppleDouble
        d.file(".m.safetensors.index.json", b"{}");
        std::fs::create_dir(d.0.join("sub.safetensors")).unwrap();
        let c = Checkpoint::resolve(&d.0).unwrap();
        assert_eq!(c.files, [d.0.join("a.safetensors"), d.0.join("b.safetensors")]);
        assert_eq!(c.report_path(), d.0);
    }

    #[test]
    fn a_directory_with_an_index_is_the_shards_it_lists() {
        let d = Scratch::new("indexed");
        d.file("model-00002-of-00002.safetensors", b"");
        d.file("model-00001-of-00002.safetensors", b"");
        d.file("consolidated.safetensors", b""); // beside the shards, as in some repositories
        let index = d.index(
            "model.safetensors.index.json",
            &[
                ("b", "model-00002-of-00002.safetensors"),
                ("a", "model-00001-of-00002.safetensors"),
                ("c", "model-00002-of-00002.safetensors"),
            ],
        );
        let c = Checkpoint::resolve(&d.0).unwrap();
        assert_eq!(
            c.files,
            [d.0.join("model-00001-of-00002.safetensors"), d.0.join("model-00002-of-00002.safetensors")]
        );
        assert_eq!(c.report_path(), index);
        assert_eq!(Checkpoint::resolve(&index).unwrap().files, c.files, "the index itself stands for the same files");
        c.check_files().unwrap();
    }

    #[test]
    fn an_empty_directory_or_several_indexes_are_refused() {
        let d = Scratch::new("empty");
        let err = Checkpoint::resolve(&d.0).unwrap_err();
        assert!(matches!(err, Error::NoCheckpointFiles { .. }), "{err}");
        d.index("model.safetensors.index.json", &[("a", "x.safetensors")]);
        d.index("model.fp16.safetensors.index.json", &[("a", "y.safetensors")]);
        let err = Checkpoint::resolve(&d.0).unwrap_err().to_string();
        assert!(err.contains("model.fp16.safetensors.index.json, model.safetensors.index.json"), "{err}");
        assert!(err.contains("pass the one to load"), "{err}");
    }

    #[test]
    fn malformed_indexes_are_refused() {
        let d = Scratch::new("bad-index");
        for (name, text, expect) in [
            ("config.json", r#"{"hidden_size": 4}"#, "missing field `weight_map`"),
            ("not-json.json", "weights", "expected value"),
            ("list.json", r#"{"weight_map": ["a"]}"#, "invalid type"),
            ("empty.json", r#"{"weight_map": {}}"#, "lists no tensors"),
            ("up.json", r#"{"weight_map": {"a": "../x.safetensors"}}"#, "does not stay inside"),
            ("abs.json", r#"{"weight_map": {"a": "/etc/x.safetensors"}}"#, "does not stay inside"),
        ] {
            let path = d.file(name, text.as_bytes());
            let err = Checkpoint::resolve(&path).unwrap_err();
            assert!(matches!(&err, Error::InvalidIndex { path: p, .. } if *p == path), "{name}: {err}");
            assert!(err.to_string().contains(expect), "{name}: {err}");
        }
        let missing = d.0.join("missing.safetensors.index.json");
        assert!(matches!(Checkpoint::resolve(&missing), Err(Error::NotFound { .. })));
    }

    #[test]
    fn missing_shards_are_named() {
        let d = Scratch::new("missing");
        d.file("a.safetensors", b"");
        std::fs::create_dir(d.0.join("dir.safetensors")).unwrap();
        let index = d.index(
            "m.safetensors.index.json",
            &[("a", "a.safetensors"), ("b", "b.safetensors"), ("c", "dir.safetensors")],
        );
        let c = Checkpoint::resolve(&index).unwrap();
        assert_eq!(
            c.missing_files(),
            [
                Problem::MissingShard { shard: "b.safetensors".into(), reason: "does not exist".into() },
                Problem::MissingShard { shard: "dir.safetensors".into(), reason: "is not a regular file".into() },
            ]
        );
        let err = c.check_files().unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "{}: lists shard b.safetensors, which does not exist (and 1 more",
                index.display()
            )),
            "{err}"
        );
    }

    #[test]
    fn tensors_are_checked_against_the_index() {
        let d = Scratch::new("tensors");
        let index = d.index(
            "m.safetensors.index.json",
            &[("a", "1.safetensors"), ("b", "1.safetensors"), ("c", "2.safetensors")],
        );
        let c = Checkpoint::resolve(&index).unwrap();
        let (one, two) = (d.0.join("1.safetensors"), d.0.join("2.safetensors"));
        assert_eq!(c.tensor_problems(&names(&[&["a", "b"], &["c"]])), []);
        assert_eq!(
            c.tensor_problems(&names(&[&["a"], &["c", "b", "extra"]])),
            [
                Problem::WrongShard { name: "b".into(), listed: "1.safetensors".into(), found: two.clone() },
                Problem::Unlisted { name: "extra".into(), file: two.clone() },
            ]
        );
        assert_eq!(
            c.tensor_problems(&names(&[&["a", "b"], &[]])),
            [Problem::NotInShards { name: "c".into(), listed: "2.safetensors".into() }]
        );
        assert_eq!(
            c.tensor_problems(&names(&[&["a", "b"], &["c", "a"]])),
            [Problem::Duplicate { name: "a".into(), first: one, second: two.clone() }]
        );
        // An unreadable shard is reported on its own, not as missing tensors.
        assert_eq!(c.tensor_problems(&[Some(vec!["a", "b"]), None]), []);
        let msg =
            Problem::WrongShard { name: "b".into(), listed: "1.safetensors".into(), found: two.clone() }.to_string();
        assert_eq!(msg, format!("maps 'b' to 1.safetensors, but it is in {}", two.display()));
    }

    #[test]
    fn placed_tensors_are_checked_per_checkpoint() {
        let d = Scratch::new("placed");
        let index = d.index("m.safetensors.index.json", &[("a", "1.safetensors")]);
        let plain = d.0.join("plain.safetensors");
        let checkpoints = vec![Checkpoint::resolve(&plain).unwrap(), Checkpoint::resolve(&index).unwrap()];
        assert_eq!(files(&checkpoints), [plain, d.0.join("1.safetensors")]);
        let placed = |name: &str, file| Placement {
            name: name.into(),
            dtype: crate::format::Dtype::U8,
            shape: vec![],
            file,
            offset: 0,
            nbytes: 0,
            aligned: true,
        };
        // "z" of the plain file is nobody's business; "a" must be in 1.safetensors.
        check_placed(&checkpoints, &[placed("z", 0), placed("a", 1)]).unwrap();
        let err = check_placed(&checkpoints, &[placed("a", 0), placed("q", 1)]).unwrap_err().to_string();
        assert!(err.contains("maps 'a' to 1.safetensors, but none of the shards it lists has it"), "{err}");
        assert!(err.contains("(and 1 more;"), "{err}");
    }

    #[test]
    fn single_file_operations_refuse_directories() {
        let d = Scratch::new("single");
        let err = check_single_file(&d.0).unwrap_err().to_string();
        assert!(err.contains("is a directory") && err.contains("load()/load_file()"), "{err}");
        check_single_file(&d.0.join("x.safetensors")).unwrap();
    }
}
