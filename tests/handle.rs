//! Files held open across loads (`load::handle`): every load of a handle reads the files it
//! opened, whatever became of their paths, and finds a tensor's rows by name.

mod common;

use std::path::{Path, PathBuf};

use common::{safetensors, TempDir};

use fastsafetensors::load::handle::{Handles, OpenFiles};
use fastsafetensors::load::{read_header, LoadOptions, Loaded, Planned};
use fastsafetensors::source::{LocalFile, ReaderKind};
use fastsafetensors::{Error, Result};

const ORIGINAL: &[(&str, &str, &[u64])] = &[("embed", "BF16", &[300, 70]), ("norm", "F32", &[70])];
/// What replaces it: the same name with another shape, and a name the original lacks.
const REPLACEMENT: &[(&str, &str, &[u64])] = &[("embed", "F32", &[10, 7]), ("other", "I64", &[5])];

fn read(planned: Planned, reader: ReaderKind) -> Result<Loaded> {
    planned.read_to_host(&LoadOptions { reader, ..Default::default() })
}

/// The bytes of `name` in `file` (as written to `path` at first).
fn tensor_bytes(file: &[u8], path: &Path, name: &str) -> Vec<u8> {
    let header = read_header(path).unwrap();
    let t = header.tensors.iter().find(|t| t.name == name).unwrap();
    file[(header.data_start + t.begin) as usize..(header.data_start + t.end) as usize].to_vec()
}

/// Checks that `files` still answers from the original bytes: rows of `embed`, and every tensor.
fn check_reads_original(files: &OpenFiles, path: &Path, embed: &[u8], norm: &[u8], reader: ReaderKind) {
    let row = 70 * 2;
    let loaded = read(files.plan_rows(path, "embed", 2, 5).unwrap(), reader).unwrap();
    assert_eq!(loaded.tensors[0].shape, [3, 70], "{reader:?}");
    assert_eq!(loaded.bytes(&loaded.tensors[0]), &embed[2 * row..5 * row], "{reader:?}");
    let loaded = read(files.plan(&[path.to_owned()]).unwrap(), reader).unwrap();
    let names: Vec<&str> = loaded.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["embed", "norm"], "{reader:?}");
    assert_eq!(loaded.bytes(&loaded.tensors[0]), embed, "{reader:?}");
    assert_eq!(loaded.bytes(&loaded.tensors[1]), norm, "{reader:?}");
}

#[test]
fn a_replaced_or_deleted_file_is_read_as_it_was_opened() {
    let dir = TempDir::new("handle-replaced");
    for reader in [ReaderKind::Direct, ReaderKind::Mmap, ReaderKind::Auto] {
        let original = safetensors(ORIGINAL, 8);
        let path = dir.write("model.safetensors", &original);
        let (embed, norm) = (tensor_bytes(&original, &path, "embed"), tensor_bytes(&original, &path, "norm"));
        let files = OpenFiles::open(std::slice::from_ref(&path)).unwrap();
        let incoming = dir.write("incoming", &safetensors(REPLACEMENT, 8));
        std::fs::rename(&incoming, &path).unwrap();
        check_reads_original(&files, &path, &embed, &norm, reader);
        assert_eq!(files.header(&path).unwrap().tensors[0].shape, [300, 70], "the header as opened");
        std::fs::remove_file(&path).unwrap();
        check_reads_original(&files, &path, &embed, &norm, reader);
    }
}

#[test]
fn reopening_goes_through_the_descriptor_not_the_path() {
    let dir = TempDir::new("handle-reopen");
    let path = dir.write("gone.safetensors", b"the bytes opened");
    let file = LocalFile::open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let mut buf = Vec::new();
    std::io::Read::read_to_end(&mut file.reopen(0).unwrap(), &mut buf).unwrap();
    assert_eq!(buf, b"the bytes opened");
}

#[test]
fn a_file_changed_in_place_fails_the_next_read_naming_it() {
    let dir = TempDir::new("handle-in-place");
    for reader in [ReaderKind::Direct, ReaderKind::Mmap, ReaderKind::Auto] {
        let path = dir.write("model.safetensors", &safetensors(ORIGINAL, 8));
        let files = OpenFiles::open(std::slice::from_ref(&path)).unwrap();
        // The same inode, truncated and rewritten.
        std::fs::write(&path, safetensors(REPLACEMENT, 8)).unwrap();
        for planned in
            [files.plan_rows(&path, "embed", 0, 2).unwrap(), files.plan(std::slice::from_ref(&path)).unwrap()]
        {
            let err = read(planned, reader).err().expect("a read of a changed file fails");
            assert!(matches!(&err, Error::Changed { path: p, .. } | Error::Truncated { path: p, .. } if p == &path));
            let message = err.to_string();
            assert!(message.starts_with(&path.display().to_string()) && !message.contains('\n'), "{message}");
        }
    }
}

#[test]
fn rows_are_found_by_name_in_the_file_asked_for() {
    let dir = TempDir::new("handle-rows");
    let first = dir.write("a.safetensors", &safetensors(ORIGINAL, 8));
    let second = dir.write("b.safetensors", &safetensors(&[("other", "I64", &[5, 2])], 8));
    let files = OpenFiles::open(&[first.clone(), second.clone()]).unwrap();
    let planned = files.plan_rows(&second, "other", 1, 3).unwrap();
    assert_eq!((planned.sources.len(), planned.tensors.len()), (1, 1), "one file, one tensor");
    assert_eq!((planned.tensors[0].shape.as_slice(), planned.tensors[0].nbytes), (&[2, 2][..], 32));
    for (path, name) in [(&first, "other"), (&second, "embed"), (&first, "nothing")] {
        let err = files.plan_rows(path, name, 0, 1).err().unwrap();
        assert!(
            matches!(&err, Error::NoSuchTensor { name: n, files } if n == name && files == std::slice::from_ref(path))
        );
    }
    let err = files.plan_rows(&first, "embed", 299, 301).err().unwrap().to_string();
    assert!(err.contains(&first.display().to_string()) && err.contains("300 rows"), "{err}");
    let stranger = PathBuf::from("/elsewhere/c.safetensors");
    let err = files.plan(&[stranger]).err().unwrap().to_string();
    assert!(err.contains("/elsewhere/c.safetensors") && err.contains("not one of the files"), "{err}");
    // A plan of some of the files numbers them in the order asked for.
    let planned = files.plan(&[second.clone(), first.clone()]).unwrap();
    assert_eq!(planned.paths(), [second, first]);
    assert_eq!(
        planned.tensors.iter().map(|t| (t.name.as_str(), t.file)).collect::<Vec<_>>(),
        [("other", 0), ("embed", 1), ("norm", 1)]
    );
}

#[test]
fn handles_number_open_files_until_removed() {
    let dir = TempDir::new("handle-table");
    let path = dir.write("model.safetensors", &safetensors(ORIGINAL, 8));
    let handles = Handles::new();
    let id = handles.insert(OpenFiles::open(std::slice::from_ref(&path)).unwrap());
    let other = handles.insert(OpenFiles::open(std::slice::from_ref(&path)).unwrap());
    assert!(id > 0 && other != id);
    let files = handles.get(id).unwrap();
    assert!(handles.remove(id));
    assert!(!handles.remove(id), "removed once");
    assert!(handles.get(id).err().unwrap().to_string().contains("closed"));
    assert!(files.plan_rows(&path, "norm", 0, 1).is_ok(), "a load running from the files keeps them");
    assert!(handles.get(other).is_ok());
}

#[test]
fn opening_refuses_what_a_load_refuses() {
    let dir = TempDir::new("handle-refuse");
    let a = dir.write("a.safetensors", &safetensors(ORIGINAL, 8));
    let b = dir.write("b.safetensors", &safetensors(&[("norm", "F32", &[3])], 8));
    assert!(matches!(OpenFiles::open(&[a.clone(), b]), Err(Error::DuplicateTensor { .. })));
    assert!(matches!(OpenFiles::open(std::slice::from_ref(&dir.0)), Err(Error::IsDirectory { .. })));
    let bad = dir.write("bad.safetensors", b"\x05\0\0\0\0\0\0\0{}");
    let err = OpenFiles::open(&[a, bad.clone()]).err().unwrap();
    assert!(err.to_string().starts_with(&bad.display().to_string()), "{err}");
}
