//! Kept weights end to end: a keeper started by the loads (this crate's program), entries
//! filled, attached bit for bit, private to each load, matched by the files' identity, and
//! kept within the budget. Each test has a keeper and directory of its own; they run one at
//! a time (the keeper's directory and budget come from the environment).

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use common::{safetensors, wait_until, TempDir};

use fastsafetensors::keep::{client, Reply, Request};
use fastsafetensors::load::{plan_files, LoadOptions, Loaded};
use fastsafetensors::source::ReadPath;

static SERIAL: Mutex<()> = Mutex::new(());

/// A keeper directory of the test's own (its keeper stopped at the end), with `budget`.
struct Keeper {
    dir: TempDir,
    _serial: MutexGuard<'static, ()>,
}

impl Keeper {
    fn new(tag: &str, budget: Option<&str>) -> Keeper {
        let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let dir = TempDir::new(&format!("keep-{tag}"));
        client::set_program(env!("CARGO_BIN_EXE_fastsafetensors-keeper"));
        std::env::set_var("FASTSAFETENSORS_KEEP_DIR", dir.0.join("keeper"));
        std::env::set_var("FASTSAFETENSORS_KEEP_IDLE", "60");
        match budget {
            Some(b) => std::env::set_var("FASTSAFETENSORS_KEEP_MEMORY", b),
            None => std::env::remove_var("FASTSAFETENSORS_KEEP_MEMORY"),
        }
        Keeper { dir, _serial: serial }
    }

    fn list(&self) -> Vec<fastsafetensors::keep::Listing> {
        match client::command(&Request::List).unwrap() {
            Some(Reply::Entries { entries, .. }) => entries,
            other => panic!("{other:?}"),
        }
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let _ = client::command(&Request::Stop);
    }
}

fn load(paths: &[PathBuf]) -> Loaded {
    plan_files(paths).unwrap().read_to_host_kept(&LoadOptions::default()).unwrap()
}

fn file_bytes(loaded: &Loaded, file: &[u8], path: &Path) -> Vec<(String, Vec<u8>)> {
    let header = fastsafetensors::load::read_header(path).unwrap();
    loaded
        .tensors
        .iter()
        .map(|t| {
            let h = header.tensors.iter().find(|h| h.name == t.name).unwrap();
            let want = &file[(header.data_start + h.begin) as usize..(header.data_start + h.end) as usize];
            assert_eq!(loaded.bytes(t), want, "{}", t.name);
            (t.name.clone(), loaded.bytes(t).to_vec())
        })
        .collect()
}

const TENSORS: &[(&str, &str, &[u64])] =
    &[("embed", "BF16", &[300, 70]), ("norm", "F32", &[70]), ("empty", "F16", &[0, 4]), ("scalar", "F64", &[])];

#[test]
fn a_second_load_attaches_to_the_bytes_the_first_kept() {
    let keeper = Keeper::new("attach", None);
    let bytes = safetensors(TENSORS, 8);
    let path = keeper.dir.write("model.safetensors", &bytes);
    let first = load(std::slice::from_ref(&path));
    assert_ne!(first.read_paths(), [ReadPath::Kept], "the first load reads");
    file_bytes(&first, &bytes, &path);
    let second = load(std::slice::from_ref(&path));
    assert_eq!(second.read_paths(), [ReadPath::Kept]);
    file_bytes(&second, &bytes, &path);
    let entries = keeper.list();
    assert_eq!(entries.len(), 1, "{entries:?}");
    assert_eq!((entries[0].attaches, entries[0].holders.len()), (1, 1), "{entries:?}");

    // A write into one load's memory stays there.
    let t = second.tensors.iter().find(|t| t.name == "embed").unwrap();
    let at = second.bytes(t).as_ptr() as *mut u8;
    // SAFETY: the buffer is a private, writable mapping that `second` owns.
    unsafe { *at = !*at };
    let third = load(std::slice::from_ref(&path));
    assert_eq!(third.read_paths(), [ReadPath::Kept]);
    file_bytes(&third, &bytes, &path);
    assert_ne!(second.bytes(t)[0], third.bytes(t)[0]);

    drop((first, second, third));
    // Counted out when the keeper's thread for each connection sees it close: soon, not at once.
    wait_until(10, || keeper.list()[0].holders.is_empty());
    assert!(keeper.list()[0].holders.is_empty(), "the loads let go of it when dropped");
}

#[test]
fn two_loads_at_once_read_once() {
    let keeper = Keeper::new("twice", None);
    let bytes = safetensors(&[("big", "F32", &[1 << 20])], 8);
    let path = keeper.dir.write("model.safetensors", &bytes);
    let loads: Vec<Loaded> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2).map(|_| s.spawn(|| load(std::slice::from_ref(&path)))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let kept = loads.iter().filter(|l| l.read_paths() == [ReadPath::Kept]).count();
    assert_eq!(kept, 1, "one load filled, the other attached");
    loads.iter().for_each(|l| drop(file_bytes(l, &bytes, &path)));
    assert_eq!(keeper.list().len(), 1);
}

#[test]
fn a_changed_file_is_read_again_and_its_entry_dropped() {
    let keeper = Keeper::new("changed", None);
    let bytes = safetensors(TENSORS, 8);
    let path = keeper.dir.write("model.safetensors", &bytes);
    drop(load(std::slice::from_ref(&path)));
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    // Other bytes of the same size, the modification time put back.
    let mut changed = bytes.clone();
    let last = changed.len() - 1;
    changed[last] ^= 0xff;
    std::fs::write(&path, &changed).unwrap();
    std::fs::File::options().write(true).open(&path).unwrap().set_modified(mtime).unwrap();
    let again = load(std::slice::from_ref(&path));
    assert_ne!(again.read_paths(), [ReadPath::Kept]);
    file_bytes(&again, &changed, &path);
    let entries = keeper.list();
    assert_eq!(entries.len(), 1, "the stale entry went: {entries:?}");
    assert_eq!(entries[0].attaches, 0);
}

#[test]
fn entries_stay_within_the_budget() {
    let keeper = Keeper::new("budget", Some("1M"));
    let small = safetensors(&[("w", "F32", &[100_000])], 8); // 400 KB
    let paths: Vec<PathBuf> = (0..3).map(|i| keeper.dir.write(&format!("m{i}.safetensors"), &small)).collect();
    let large = keeper.dir.write("large.safetensors", &safetensors(&[("w", "F32", &[300_000])], 8));
    // Too large for the budget: read, not kept.
    let l = load(std::slice::from_ref(&large));
    assert_ne!(l.read_paths(), [ReadPath::Kept]);
    assert!(keeper.list().is_empty());
    // Two fit; the third evicts the least recently attached one nobody holds.
    let held = load(&paths[0..1]);
    drop(load(&paths[1..2]));
    drop(load(&paths[2..3]));
    let files: Vec<String> = keeper.list().iter().flat_map(|e| e.files.clone()).collect();
    let name = |i: usize| std::fs::canonicalize(&paths[i]).unwrap().to_string_lossy().into_owned();
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(files.contains(&name(0)) && files.contains(&name(2)), "the held one stays: {files:?}");
    drop(held);
}

#[test]
fn a_keeper_holding_nothing_exits_after_its_idle_time() {
    let keeper = Keeper::new("idle", None);
    std::env::set_var("FASTSAFETENSORS_KEEP_IDLE", "1");
    let path = keeper.dir.write("model.safetensors", &safetensors(TENSORS, 8));
    drop(load(std::slice::from_ref(&path)));
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert_eq!(keeper.list().len(), 1, "an entry is something held: the keeper stays");
    match client::command(&Request::Drop { path: path.to_string_lossy().into_owned() }).unwrap() {
        Some(Reply::Dropped { count: 1 }) => {}
        other => panic!("{other:?}"),
    }
    let socket = keeper.dir.0.join("keeper").join(fastsafetensors::keep::SOCKET);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while socket.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(!socket.exists(), "the keeper exited, removing its socket");
    assert!(client::command(&Request::List).unwrap().is_none(), "no keeper answers");
}
