//! End-to-end tests of the loader on real files: every reader returns the file's bytes.

mod common;

use std::path::{Path, PathBuf};

use common::{safetensors, TempDir};

use fastsafetensors::load::{plan_files, read_header, LoadOptions, Loaded};
use fastsafetensors::source::{ReadPath, ReaderKind};
use fastsafetensors::{Error, Result};

fn load(paths: &[PathBuf], options: &LoadOptions) -> Result<Loaded> {
    plan_files(paths)?.read_to_host(options)
}

fn expected_bytes(file: &[u8], path: &Path, name: &str) -> Vec<u8> {
    let header = read_header(path).unwrap();
    let t = header.tensors.iter().find(|t| t.name == name).unwrap();
    file[(header.data_start + t.begin) as usize..(header.data_start + t.end) as usize].to_vec()
}

const TENSORS: &[(&str, &str, &[u64])] = &[
    ("embed", "BF16", &[300, 70]),
    ("norm", "F32", &[70]),
    ("ids", "I64", &[5]),
    ("empty", "F16", &[0, 4]),
    ("scalar", "F64", &[]),
    ("packed", "F4", &[3, 2]),
];

#[test]
fn every_reader_returns_the_files_bytes() {
    let dir = TempDir::new("readers");
    let bytes = safetensors(TENSORS, 8);
    let path = dir.write("model.safetensors", &bytes);
    for (reader, block) in
        [(ReaderKind::Direct, 4096), (ReaderKind::Direct, 1 << 20), (ReaderKind::Mmap, 4096), (ReaderKind::Auto, 8192)]
    {
        let loaded = load(std::slice::from_ref(&path), &LoadOptions { reader, block, ..Default::default() }).unwrap();
        assert_eq!(loaded.tensors.len(), TENSORS.len());
        for t in &loaded.tensors {
            assert_eq!(loaded.bytes(t), expected_bytes(&bytes, &path, &t.name), "{reader:?} {}", t.name);
            assert!(t.aligned, "a padded header keeps {} aligned", t.name);
        }
    }
}

#[test]
fn forced_readers_report_their_path() {
    let dir = TempDir::new("paths");
    let path = dir.write("a.safetensors", &safetensors(TENSORS, 8));
    let read =
        |reader| load(std::slice::from_ref(&path), &LoadOptions { reader, ..Default::default() }).unwrap().read_paths();
    assert_eq!(read(ReaderKind::Mmap), [ReadPath::Mmap]);
    // O_DIRECT, or buffered where the temp dir's filesystem refuses it (tmpfs).
    assert!(matches!(read(ReaderKind::Direct)[..], [ReadPath::Direct | ReadPath::Buffered]));
    // Just written, so resident: auto maps it.
    assert_eq!(read(ReaderKind::Auto), [ReadPath::Mmap]);
}

#[test]
fn unpadded_header_flags_misaligned_tensors() {
    let dir = TempDir::new("misaligned");
    let bytes = safetensors(&[("w", "F32", &[4]), ("b", "U8", &[3])], 1);
    let path = dir.write("m.safetensors", &bytes);
    let loaded = load(std::slice::from_ref(&path), &LoadOptions::default()).unwrap();
    let header = read_header(&path).unwrap();
    for t in &loaded.tensors {
        assert_eq!(t.aligned, t.offset % t.dtype.alignment() == 0);
        assert_eq!(loaded.bytes(t), expected_bytes(&bytes, &path, &t.name));
    }
    assert_eq!(loaded.tensors[0].aligned, header.data_start % 4 == 0);
}

#[test]
fn many_files_load_together() {
    let dir = TempDir::new("multi");
    let a = safetensors(&[("a.weight", "F16", &[1000, 33])], 8);
    let b = safetensors(&[("b.weight", "I32", &[77]), ("b.bias", "U8", &[9])], 8);
    let paths = [dir.write("1.safetensors", &a), dir.write("2.safetensors", &b)];
    let loaded = load(&paths, &LoadOptions { reader: ReaderKind::Direct, block: 4096, ..Default::default() }).unwrap();
    let names: Vec<_> = loaded.tensors.iter().map(|t| (t.name.as_str(), t.file)).collect();
    assert_eq!(names, [("a.weight", 0), ("b.weight", 1), ("b.bias", 1)]);
    for t in &loaded.tensors {
        let src = if t.file == 0 { &a } else { &b };
        assert_eq!(loaded.bytes(t), expected_bytes(src, &paths[t.file], &t.name));
    }
}

#[test]
fn errors_name_the_file() {
    let dir = TempDir::new("errors");
    let missing = dir.0.join("missing.safetensors");
    let err = load(std::slice::from_ref(&missing), &LoadOptions::default()).err().unwrap();
    assert!(matches!(err, Error::NotFound { .. }));
    assert_eq!(err.to_string(), format!("No such file or directory: {}", missing.display()));

    let err = load(std::slice::from_ref(&dir.0), &LoadOptions::default()).err().unwrap();
    assert!(matches!(err, Error::NotAFile { .. }), "{err}");

    let mut bytes = safetensors(TENSORS, 8);
    bytes.truncate(bytes.len() - 1);
    let short = dir.write("short.safetensors", &bytes);
    let err = load(std::slice::from_ref(&short), &LoadOptions::default()).err().unwrap();
    assert!(err.to_string().contains("short.safetensors"), "{err}");
    assert!(matches!(err, Error::Format { .. }), "{err}");

    let small = dir.write("small.safetensors", &[1, 2, 3]);
    let err = load(&[small], &LoadOptions::default()).err().unwrap().to_string();
    assert!(err.contains("small.safetensors") && err.contains("too small"), "{err}");
}

#[test]
fn duplicate_names_across_files_fail_before_reading() {
    let dir = TempDir::new("dup");
    let bytes = safetensors(&[("w", "U8", &[4])], 8);
    let paths = [dir.write("x.safetensors", &bytes), dir.write("y.safetensors", &bytes)];
    let err = load(&paths, &LoadOptions::default()).err().unwrap().to_string();
    assert!(err.contains("'w'") && err.contains("x.safetensors") && err.contains("y.safetensors"), "{err}");
}

#[test]
fn reader_names_parse_and_bad_ones_are_rejected() {
    assert_eq!(ReaderKind::resolve(Some("direct")).unwrap(), ReaderKind::Direct);
    assert_eq!(ReaderKind::resolve(Some("mmap")).unwrap(), ReaderKind::Mmap);
    assert_eq!(ReaderKind::resolve(Some("auto")).unwrap(), ReaderKind::Auto);
    let err = ReaderKind::resolve(Some("fast")).unwrap_err().to_string();
    assert!(err.contains("unknown reader 'fast'"), "{err}");
}

#[test]
fn a_file_truncated_or_rewritten_after_planning_is_an_error_not_a_crash() {
    let dir = TempDir::new("changed");
    let bytes = safetensors(TENSORS, 8);
    for reader in [ReaderKind::Mmap, ReaderKind::Direct, ReaderKind::Auto] {
        let path = dir.write("t.safetensors", &bytes);
        let planned = plan_files(std::slice::from_ref(&path)).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(100).unwrap();
        let err = planned.read_to_host(&LoadOptions { reader, ..Default::default() }).err().unwrap();
        assert!(matches!(err, Error::Changed { .. } | Error::Truncated { .. }), "{reader:?}: {err}");
        assert!(err.to_string().contains("t.safetensors"), "{err}");
    }
    // Same size, new contents: caught by the modification time.
    let path = dir.write("r.safetensors", &bytes);
    let planned = plan_files(std::slice::from_ref(&path)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&path, &bytes).unwrap();
    let err = planned.read_to_host(&LoadOptions::default()).err().unwrap();
    assert!(matches!(err, Error::Changed { .. }), "{err}");
}

#[test]
fn special_files_are_refused_without_blocking() {
    let dir = TempDir::new("special");
    let fifo = dir.0.join("pipe.safetensors");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    for path in [fifo, PathBuf::from("/dev/zero"), dir.0.clone()] {
        let err = plan_files(std::slice::from_ref(&path)).err().unwrap();
        assert!(matches!(err, Error::NotAFile { .. }), "{}: {err}", path.display());
    }
}

#[test]
fn a_file_given_twice_is_named_once() {
    let dir = TempDir::new("twice");
    let path = dir.write("x.safetensors", &safetensors(TENSORS, 8));
    let err = plan_files(&[path.clone(), path.clone()]).err().expect("a file given twice is refused").to_string();
    assert_eq!(err, format!("{}: given twice: pass each file once", path.display()));
}

#[test]
fn rows_of_a_tensor_in_no_file_name_the_tensor_not_a_filter() {
    use fastsafetensors::plan::select::{RowRange, Selection};
    let dir = TempDir::new("rows-missing");
    let path = dir.write("x.safetensors", &safetensors(TENSORS, 8));
    let rows = Selection { filter: None, rows: vec![RowRange { name: "nope".into(), start: 0, stop: 1 }] };
    let err = plan_files(std::slice::from_ref(&path)).unwrap().select(&rows).err().unwrap().to_string();
    assert_eq!(err, format!("{}: no tensor named 'nope'", path.display()));
}
