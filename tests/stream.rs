//! Selective and streaming loads on real files: every selected tensor arrives with the file's
//! bytes, in file then offset order, within the memory budget; stopping early, a file changing
//! mid-stream and bad selections end cleanly.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::{safetensors, TempDir};

use fastsafetensors::device::HostMemoryDevice;
use fastsafetensors::load::device_stream::{Copier, DeviceStream};
use fastsafetensors::load::stream::{StreamOptions, TensorStream};
use fastsafetensors::load::{plan_files, read_header, LoadOptions};
use fastsafetensors::plan::select::{MatchMode, RowRange, Selection, TensorFilter};
use fastsafetensors::plan::{align_up, IO_ALIGN};
use fastsafetensors::source::{ReadPath, ReaderKind};
use fastsafetensors::Error;

const READERS: [ReaderKind; 3] = [ReaderKind::Direct, ReaderKind::Mmap, ReaderKind::Auto];

/// The bytes of tensor `name` in `file` (written at `path`).
fn expected_bytes(file: &[u8], path: &Path, name: &str) -> Vec<u8> {
    let header = read_header(path).unwrap();
    let t = header.tensors.iter().find(|t| t.name == name).unwrap();
    file[(header.data_start + t.begin) as usize..(header.data_start + t.end) as usize].to_vec()
}

/// A two-file, layer-shaped checkpoint: `layers` layers of three tensors of various sizes
/// (some larger than a page, some empty, one scalar), in file order.
/// A file of `count` U8 tensors `t0`, `t1`, ... of `len` bytes each.
fn u8_tensors(dir: &TempDir, file: &str, count: usize, len: u64) -> PathBuf {
    let names: Vec<String> = (0..count).map(|i| format!("t{i}")).collect();
    let shape = [len];
    let spec: Vec<(&str, &str, &[u64])> = names.iter().map(|n| (n.as_str(), "U8", &shape[..])).collect();
    dir.write(file, &safetensors(&spec, 8))
}

fn checkpoint(dir: &TempDir, layers: usize) -> (Vec<PathBuf>, Vec<Vec<u8>>) {
    let names: Vec<[String; 4]> = (0..layers)
        .map(|i| {
            let p = format!("model.layers.{i}");
            [format!("{p}.attn.weight"), format!("{p}.mlp.weight"), format!("{p}.norm"), format!("{p}.empty")]
        })
        .collect();
    let mut files = vec![Vec::new(), Vec::new()];
    let mut specs: [Vec<(&str, &str, &[u64])>; 2] = [Vec::new(), Vec::new()];
    for (i, n) in names.iter().enumerate() {
        let file = usize::from(i >= layers / 2);
        specs[file].push((&n[0], "BF16", &[70, 90]));
        specs[file].push((&n[1], "F32", &[3000]));
        specs[file].push((&n[2], "F64", &[]));
        specs[file].push((&n[3], "F16", &[0, 5]));
    }
    for (file, spec) in specs.iter().enumerate() {
        files[file] = safetensors(spec, 8);
    }
    let paths = files.iter().enumerate().map(|(i, f)| dir.write(&format!("model-{i}.safetensors"), f)).collect();
    (paths, files)
}

/// Every group of a stream, with a check at each step that the memory in use stays within
/// `max(budget, largest group)` when each group is dropped before the next is asked for.
fn drain(stream: &mut TensorStream, budget: u64) -> Vec<(String, usize, Vec<u8>, ReadPath)> {
    let monitor = stream.monitor();
    let mut out = Vec::new();
    let mut largest = 0;
    while let Some(group) = stream.next_group().unwrap() {
        // A group reserves its aligned length (a mapping may stop short, at the end of the file).
        largest = largest.max(align_up(group.buffer.as_slice().len() as u64, IO_ALIGN));
        let in_use = monitor.memory_in_use();
        assert!(in_use <= budget.max(largest), "{in_use} bytes in use, budget {budget}, largest group {largest}");
        for t in &group.tensors {
            out.push((t.name.clone(), t.file, group.bytes(t).to_vec(), group.read_path));
        }
    }
    out
}

fn glob(patterns: &[&str]) -> Selection {
    Selection::filtered(TensorFilter::new(MatchMode::Glob, patterns).unwrap())
}

#[test]
fn every_reader_streams_the_selected_tensors_bit_exact_in_read_order() {
    let dir = TempDir::new("stream-exact");
    let (paths, files) = checkpoint(&dir, 8);
    let selections = [
        ("all", Selection::all()),
        ("glob", glob(&["model.layers.[1-2].*", "*.7.mlp.weight"])),
        ("regex", Selection::filtered(TensorFilter::new(MatchMode::Regex, &[r"\.(norm|empty)$"]).unwrap())),
        (
            "exact",
            Selection::filtered(
                TensorFilter::new(MatchMode::Exact, &["model.layers.5.attn.weight", "model.layers.0.norm"]).unwrap(),
            ),
        ),
    ];
    for (label, selection) in &selections {
        let want: Vec<_> = plan_files(&paths).unwrap().select(selection).unwrap().tensors;
        assert!(!want.is_empty(), "{label}");
        for reader in READERS {
            for budget in [1, 3 * IO_ALIGN, 64 << 10, u64::MAX] {
                for group in [IO_ALIGN, 3 * IO_ALIGN, 1 << 20] {
                    let options =
                        StreamOptions { reader, block: IO_ALIGN, group, ..StreamOptions::with_budget(budget) };
                    let planned = plan_files(&paths).unwrap().select(selection).unwrap();
                    let mut stream = TensorStream::open(planned, options).unwrap();
                    assert_eq!(stream.tensor_count(), want.len());
                    let got = drain(&mut stream, budget);
                    let ctx = format!("{label} {reader:?} budget {budget} group {group}");
                    let order: Vec<_> = got.iter().map(|g| g.0.as_str()).collect();
                    let expected: Vec<_> = want.iter().map(|t| t.name.as_str()).collect();
                    assert_eq!(order, expected, "{ctx}: tensors out of read order");
                    for (name, file, bytes, path) in &got {
                        assert_eq!(*bytes, expected_bytes(&files[*file], &paths[*file], name), "{ctx}: {name}");
                        match reader {
                            ReaderKind::Mmap => assert_eq!(*path, ReadPath::Mmap, "{ctx}"),
                            ReaderKind::Direct => {
                                assert!(matches!(path, ReadPath::Direct | ReadPath::Buffered), "{ctx}")
                            }
                            ReaderKind::Auto => {}
                        }
                    }
                    assert!(stream.next_group().unwrap().is_none(), "a finished stream stays finished");
                }
            }
        }
    }
}

#[test]
fn memory_stays_within_the_budget_while_reads_run_ahead() {
    let dir = TempDir::new("stream-budget");
    // 64 tensors of 20000 bytes: with groups of 16 KiB, each is a group (of 24 KiB) alone.
    let path = u8_tensors(&dir, "big.safetensors", 64, 20000);
    for budget in [1u64, 24576, 100_000, 1 << 20] {
        let options = StreamOptions {
            reader: ReaderKind::Direct,
            block: 8192,
            group: 16384,
            ..StreamOptions::with_budget(budget)
        };
        let mut stream = TensorStream::open(plan_files(std::slice::from_ref(&path)).unwrap(), options).unwrap();
        let monitor = Arc::new(stream.monitor());
        // A second thread samples the memory in use while the consumer works.
        let (stop, peak) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let sampler = {
            let (monitor, stop, peak) = (Arc::clone(&monitor), Arc::clone(&stop), Arc::clone(&peak));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(monitor.memory_in_use(), Ordering::Relaxed);
                    std::thread::yield_now();
                }
            })
        };
        let got = drain(&mut stream, budget);
        stop.store(true, Ordering::Relaxed);
        sampler.join().unwrap();
        assert_eq!(got.len(), 64);
        let bound = budget.max(24576);
        assert!(peak.load(Ordering::Relaxed) <= bound, "budget {budget}: peak {}", peak.load(Ordering::Relaxed));
        assert_eq!(monitor.memory_in_use(), 0, "every buffer is released once its tensors are");
    }
}

#[test]
fn a_consumer_that_keeps_every_group_still_gets_them_all() {
    let dir = TempDir::new("stream-keep");
    let (paths, files) = checkpoint(&dir, 6);
    let options = StreamOptions { reader: ReaderKind::Direct, group: IO_ALIGN, ..StreamOptions::with_budget(IO_ALIGN) };
    let mut stream = TensorStream::open(plan_files(&paths).unwrap(), options).unwrap();
    let monitor = stream.monitor();
    let mut kept = Vec::new();
    while let Some(group) = stream.next_group().unwrap() {
        kept.push(group);
    }
    assert_eq!(kept.iter().map(|g| g.tensors.len()).sum::<usize>(), 24);
    for g in &kept {
        for t in &g.tensors {
            assert_eq!(g.bytes(t), expected_bytes(&files[t.file], &paths[t.file], &t.name));
        }
    }
    assert!(monitor.memory_in_use() > IO_ALIGN, "the kept groups are over the budget, admitted one at a time");
    drop(stream);
    drop(kept);
    assert_eq!(monitor.memory_in_use(), 0);
}

#[test]
fn a_tensor_larger_than_the_budget_loads_alone() {
    let dir = TempDir::new("stream-large");
    let bytes = safetensors(&[("small", "U8", &[10]), ("large", "F32", &[100_000]), ("after", "U8", &[10])], 8);
    let path = dir.write("l.safetensors", &bytes);
    for reader in READERS {
        let options = StreamOptions { reader, ..StreamOptions::with_budget(64 << 10) };
        let mut stream = TensorStream::open(plan_files(std::slice::from_ref(&path)).unwrap(), options).unwrap();
        let mut groups = Vec::new();
        while let Some(g) = stream.next_group().unwrap() {
            groups.push(g.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>());
            for t in &g.tensors {
                assert_eq!(g.bytes(t), expected_bytes(&bytes, &path, &t.name), "{reader:?}");
            }
        }
        assert!(groups.contains(&vec!["large".to_owned()]), "{reader:?}: {groups:?}");
    }
}

#[test]
fn dropping_the_stream_early_stops_its_reads_and_frees_its_memory() {
    let dir = TempDir::new("stream-drop");
    let path = u8_tensors(&dir, "d.safetensors", 256, 65536);
    for reader in READERS {
        // Unlimited: the scheduler queues every read at once, so most are pending at the drop.
        let options = StreamOptions { reader, block: IO_ALIGN, group: 65536, ..StreamOptions::with_budget(u64::MAX) };
        let mut stream = TensorStream::open(plan_files(std::slice::from_ref(&path)).unwrap(), options).unwrap();
        let first = stream.next_group().unwrap().unwrap();
        let monitor = stream.monitor();
        drop(stream);
        assert_eq!(monitor.reads_in_flight(), 0, "{reader:?}: reads still running after the drop");
        assert_eq!(monitor.memory_in_use(), first.buffer.as_slice().len() as u64, "{reader:?}: only the kept group");
        assert_eq!(first.bytes(&first.tensors[0]).len(), 65536, "a group outlives its stream");
        drop(first);
        assert_eq!(monitor.memory_in_use(), 0, "{reader:?}");
    }
}

#[test]
fn a_file_that_changes_mid_stream_ends_the_stream_with_an_error() {
    let dir = TempDir::new("stream-changed");
    let (paths, files) = checkpoint(&dir, 8);
    for reader in [ReaderKind::Direct, ReaderKind::Mmap] {
        for shrink in [true, false] {
            for (path, file) in paths.iter().zip(&files) {
                std::fs::write(path, file).unwrap();
            }
            // A budget of one byte: each group is read only once the consumer asks for it.
            let options = StreamOptions { reader, group: IO_ALIGN, ..StreamOptions::with_budget(1) };
            let mut stream = TensorStream::open(plan_files(&paths).unwrap(), options).unwrap();
            assert!(stream.next_group().unwrap().is_some());
            std::thread::sleep(std::time::Duration::from_millis(20)); // a distinct modification time
            if shrink {
                std::fs::OpenOptions::new().write(true).open(&paths[1]).unwrap().set_len(100).unwrap();
            } else {
                std::fs::write(&paths[1], &files[1]).unwrap();
            }
            let err = loop {
                match stream.next_group() {
                    Ok(Some(_)) => continue,
                    Ok(None) => panic!("{reader:?}: the stream ended without noticing the change"),
                    Err(e) => break e,
                }
            };
            assert!(matches!(err, Error::Changed { .. } | Error::Truncated { .. }), "{reader:?}: {err}");
            assert!(err.to_string().contains("model-1.safetensors"), "{err}");
            assert!(stream.next_group().unwrap().is_none(), "a stream stops at its first error");
        }
    }
}

#[test]
fn a_filter_that_selects_nothing_streams_nothing() {
    let dir = TempDir::new("stream-none");
    let (paths, _) = checkpoint(&dir, 2);
    let planned = plan_files(&paths).unwrap().select(&glob(&["no.such.*"])).unwrap();
    assert!(planned.tensors.is_empty());
    let mut stream = TensorStream::open(planned, StreamOptions::with_budget(1 << 20)).unwrap();
    assert_eq!(stream.group_count(), 0);
    assert!(stream.next_group().unwrap().is_none());
    let loaded = plan_files(&paths)
        .unwrap()
        .select(&glob(&["no.such.*"]))
        .unwrap()
        .read_to_host(&LoadOptions::default())
        .unwrap();
    assert!(loaded.tensors.is_empty() && loaded.buffers.is_empty());
    assert_eq!(loaded.read_paths(), [ReadPath::NotRead, ReadPath::NotRead]);
}

#[test]
fn exact_names_in_no_file_are_listed() {
    let dir = TempDir::new("stream-missing");
    let (paths, _) = checkpoint(&dir, 2);
    let filter =
        TensorFilter::new(MatchMode::Exact, &["model.layers.0.norm", "lm_head.weight", "model.layers.9.norm"]).unwrap();
    let err = plan_files(&paths).unwrap().select(&Selection::filtered(filter)).err().unwrap();
    assert!(matches!(err, Error::MissingTensors { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("2 tensors that are in none of the files")
            && msg.contains("'lm_head.weight', 'model.layers.9.norm'")
            && msg.contains("model-0.safetensors"),
        "{msg}"
    );
}

#[test]
fn selective_loads_read_only_the_selected_ranges() {
    let dir = TempDir::new("select-load");
    let (paths, files) = checkpoint(&dir, 16);
    for reader in READERS {
        let selection = glob(&["model.layers.1[45].*"]);
        let loaded = plan_files(&paths)
            .unwrap()
            .select(&selection)
            .unwrap()
            .read_to_host(&LoadOptions { reader, ..Default::default() })
            .unwrap();
        assert_eq!(loaded.tensors.len(), 8);
        for t in &loaded.tensors {
            assert_eq!(loaded.bytes(t), expected_bytes(&files[t.file], &paths[t.file], &t.name), "{reader:?}");
        }
        let selected: u64 = loaded.tensors.iter().map(|t| t.nbytes).sum();
        let read: u64 = loaded.extents.iter().map(|e| e.len).sum();
        assert!(read <= selected + 2 * IO_ALIGN, "{reader:?}: {read} bytes read for {selected} selected");
        assert_eq!(loaded.read_paths()[0], ReadPath::NotRead, "layers 14-15 are all in the second file");
    }
}

#[test]
fn row_ranges_read_only_those_rows() {
    let dir = TempDir::new("rows");
    let bytes = safetensors(&[("w", "BF16", &[1000, 64]), ("s", "F32", &[])], 8);
    let path = dir.write("w.safetensors", &bytes);
    let whole = expected_bytes(&bytes, &path, "w");
    for reader in READERS {
        for (start, stop) in [(0, 1000), (0, 1), (500, 750), (999, 1000), (10, 10)] {
            let selection = Selection {
                filter: Some(TensorFilter::new(MatchMode::Exact, &["w"]).unwrap()),
                rows: vec![RowRange { name: "w".into(), start, stop }],
            };
            let planned = plan_files(std::slice::from_ref(&path)).unwrap().select(&selection).unwrap();
            let loaded = planned.read_to_host(&LoadOptions { reader, ..Default::default() }).unwrap();
            let t = &loaded.tensors[0];
            assert_eq!(t.shape, [stop - start, 64]);
            assert_eq!(
                loaded.bytes(t),
                &whole[start as usize * 128..stop as usize * 128],
                "{reader:?} {start}..{stop}"
            );
            let read: u64 = loaded.extents.iter().map(|e| e.len).sum();
            assert!(read <= (stop - start) * 128 + 2 * IO_ALIGN, "{reader:?}: read {read} bytes for the rows");
        }
    }
    let rows =
        |name: &str, start, stop| Selection { filter: None, rows: vec![RowRange { name: name.into(), start, stop }] };
    let err = plan_files(std::slice::from_ref(&path)).unwrap().select(&rows("w", 900, 1001)).err().unwrap().to_string();
    assert!(err.contains("w.safetensors") && err.contains("has 1000 rows; rows [900, 1001)"), "{err}");
    let err = plan_files(std::slice::from_ref(&path)).unwrap().select(&rows("s", 0, 1)).err().unwrap().to_string();
    assert!(err.contains("scalar"), "{err}");
    let err = plan_files(std::slice::from_ref(&path)).unwrap().select(&rows("nope", 0, 1)).err().unwrap().to_string();
    assert!(err.contains("'nope'"), "{err}");
}

// ---------------------------------------------------------------- streaming to a device

/// Copies every group of `stream` into the stand-in's memory as a consumer does: group k + 1
/// is submitted before group k is waited for. Allocations are laid end to end, `misalign`
/// bytes past a page boundary. Returns (name, file, bytes) of every tensor, in order.
fn stream_to_device(
    copier: &Copier,
    device: &HostMemoryDevice,
    misalign: u64,
) -> fastsafetensors::Result<Vec<(String, usize, Vec<u8>)>> {
    let stream = copier.stream();
    let mut bases = Vec::new();
    let mut end = 0;
    for k in 0..stream.group_count() {
        bases.push(end + misalign);
        end = (end + misalign + stream.alloc_len(k)).next_multiple_of(4096);
    }
    let mut out = Vec::new();
    if stream.group_count() > 0 {
        copier.submit(0, bases[0], 0)?;
    }
    for k in 0..stream.group_count() {
        if k + 1 < stream.group_count() {
            copier.submit(k + 1, bases[k + 1], 0)?;
        }
        let landed = copier.wait(k)?;
        let memory = device.memory();
        for t in stream.tensors(k) {
            let at = (bases[k] + landed.offset + stream.offset_of(k, t)) as usize;
            out.push((t.name.clone(), t.file, memory[at..at + t.nbytes as usize].to_vec()));
        }
    }
    Ok(out)
}

fn device_copier(paths: &[PathBuf], selection: &Selection, options: StreamOptions) -> (Copier, Arc<HostMemoryDevice>) {
    let stream = DeviceStream::open(plan_files(paths).unwrap().select(selection).unwrap(), &options).unwrap();
    let len: u64 = (0..stream.group_count()).map(|k| stream.alloc_len(k) + 8192).sum();
    let device = Arc::new(HostMemoryDevice::new(len as usize));
    let shared = Arc::clone(&device);
    (Copier::start(stream, move |_| Ok(Arc::clone(&shared))).unwrap(), device)
}

#[test]
fn device_streams_land_every_selected_tensor_bit_exact() {
    let dir = TempDir::new("device-stream");
    let (paths, files) = checkpoint(&dir, 8);
    for (label, selection) in [("all", Selection::all()), ("glob", glob(&["*.[357].*", "*.0.norm"]))] {
        let want: Vec<_> = plan_files(&paths).unwrap().select(&selection).unwrap().tensors;
        for reader in READERS {
            for (group, block) in [(IO_ALIGN, IO_ALIGN), (3 * IO_ALIGN, 2 * IO_ALIGN), (1 << 20, 8192)] {
                for misalign in [0, 512] {
                    let options = StreamOptions { reader, block, group, ..StreamOptions::with_budget(4 * group) };
                    let (copier, device) = device_copier(&paths, &selection, options);
                    assert_eq!(copier.stream().tensor_count(), want.len());
                    let got = stream_to_device(&copier, &device, misalign).unwrap();
                    let ctx = format!("{label} {reader:?} group {group} misalign {misalign}");
                    let names: Vec<_> = got.iter().map(|g| g.0.as_str()).collect();
                    assert_eq!(names, want.iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), "{ctx}");
                    for (name, file, bytes) in &got {
                        assert_eq!(*bytes, expected_bytes(&files[*file], &paths[*file], name), "{ctx}: {name}");
                    }
                    assert_eq!(device.in_flight(), 0, "{ctx}: copies left queued");
                    assert_eq!(device.freed_in_flight(), 0, "{ctx}: staging freed under a copy");
                }
            }
        }
    }
}

#[test]
fn device_stream_groups_stay_within_their_size_unless_one_tensor_is_larger() {
    let dir = TempDir::new("device-groups");
    let bytes = safetensors(&[("small", "U8", &[10]), ("large", "F32", &[100_000]), ("tail", "U8", &[7000])], 8);
    let path = dir.write("g.safetensors", &bytes);
    let options = StreamOptions { group: 16384, ..StreamOptions::with_budget(64 << 10) };
    let stream = DeviceStream::open(plan_files(std::slice::from_ref(&path)).unwrap(), &options).unwrap();
    for k in 0..stream.group_count() {
        let tensors = stream.tensors(k);
        assert!(stream.alloc_len(k) <= 16384 + IO_ALIGN || tensors.len() == 1, "group {k} too large");
    }
    assert!((0..stream.group_count()).any(|k| stream.tensors(k).iter().any(|t| t.name == "large")));
}

#[test]
fn a_failed_device_copy_is_an_error_not_a_hang_and_the_copier_stops_cleanly() {
    let dir = TempDir::new("device-fail");
    let (paths, _) = checkpoint(&dir, 8);
    let options = StreamOptions { block: IO_ALIGN, group: 2 * IO_ALIGN, ..StreamOptions::with_budget(8 * IO_ALIGN) };
    let stream = DeviceStream::open(plan_files(&paths).unwrap(), &options).unwrap();
    let device = Arc::new(HostMemoryDevice::new(1 << 22).failing_at_copy(3));
    let shared = Arc::clone(&device);
    let copier = Copier::start(stream, move |_| Ok(Arc::clone(&shared))).unwrap();
    let err = stream_to_device(&copier, &device, 0).unwrap_err();
    assert!(err.to_string().contains("injected"), "{err}");
    drop(copier);
    assert_eq!(device.in_flight(), 0);
}

#[test]
fn dropping_a_copier_with_queued_groups_skips_them() {
    let dir = TempDir::new("device-drop");
    let (paths, _) = checkpoint(&dir, 8);
    let options = StreamOptions { group: IO_ALIGN, ..StreamOptions::with_budget(IO_ALIGN) };
    let (copier, device) = device_copier(&paths, &Selection::all(), options);
    let count = copier.stream().group_count();
    for k in 0..count {
        copier.submit(k, (k as u64) * 3 * IO_ALIGN, 0).unwrap();
    }
    drop(copier); // returns once the copy running (if any) is done
    assert_eq!(device.in_flight(), 0);
}

#[test]
fn device_stream_misuse_is_an_error() {
    let dir = TempDir::new("device-misuse");
    let (paths, _) = checkpoint(&dir, 2);
    let (copier, _device) = device_copier(&paths, &Selection::all(), StreamOptions::with_budget(1 << 20));
    let count = copier.stream().group_count();
    assert!(copier.wait(0).unwrap_err().to_string().contains("was not submitted"));
    assert!(copier.submit(count, 0, 0).unwrap_err().to_string().contains(&format!("no group {count}")));
    copier.submit(0, 0, 0).unwrap();
    assert!(copier.submit(0, 0, 0).unwrap_err().to_string().contains("submitted already"));
    copier.wait(0).unwrap();
}

#[test]
fn a_file_that_changes_mid_device_stream_is_an_error() {
    let dir = TempDir::new("device-changed");
    let (paths, _) = checkpoint(&dir, 8);
    let options = StreamOptions { reader: ReaderKind::Direct, group: IO_ALIGN, ..StreamOptions::with_budget(IO_ALIGN) };
    let (copier, device) = device_copier(&paths, &Selection::all(), options);
    copier.submit(0, 0, 0).unwrap();
    copier.wait(0).unwrap();
    std::fs::OpenOptions::new().write(true).open(&paths[1]).unwrap().set_len(100).unwrap();
    let last = copier.stream().group_count() - 1;
    copier.submit(last, 0, 0).unwrap();
    let err = copier.wait(last).unwrap_err();
    assert!(matches!(err, Error::Changed { .. } | Error::Truncated { .. }), "{err}");
    assert_eq!(device.in_flight(), 0);
}

/// Verified streams, to host memory and to the device stand-in: every group arrives when the
/// digests match; with file 0's digest wrong, the stream fails at file 0's last group and
/// hands out no group of file 1.
#[test]
fn verified_streams_stop_at_a_bad_file_before_the_next() {
    use fastsafetensors::load::plan_verified;
    use fastsafetensors::source;
    use fastsafetensors::verify::{manifest, Verifier};
    use sha2::Digest as _;
    let dir = TempDir::new("verified-stream");
    let (paths, files) = checkpoint(&dir, 8);
    let digests = |wrong: bool| {
        let mut d: std::collections::BTreeMap<String, String> = paths
            .iter()
            .zip(&files)
            .map(|(p, f)| {
                (p.file_name().unwrap().to_string_lossy().into_owned(), format!("{:x}", sha2::Sha256::digest(f)))
            })
            .collect();
        if wrong {
            let first = paths[0].file_name().unwrap().to_string_lossy().into_owned();
            d.insert(first, "00".repeat(32));
        }
        Verifier::new(manifest::from_digests(&d).unwrap(), false)
    };
    let options = StreamOptions { block: IO_ALIGN, group: 2 * IO_ALIGN, ..StreamOptions::with_budget(8 * IO_ALIGN) };
    let planned = |wrong| plan_verified(source::open_all(&paths).unwrap(), Some(&digests(wrong))).unwrap();

    // Host memory.
    let mut stream = TensorStream::open(planned(false), options.clone()).unwrap();
    let mut count = 0;
    while let Some(group) = stream.next_group().unwrap() {
        count += group.tensors.len();
    }
    assert_eq!(count, stream.tensor_count());
    let mut stream = TensorStream::open(planned(true), options.clone()).unwrap();
    let mut seen = Vec::new();
    let err = loop {
        match stream.next_group() {
            Ok(Some(group)) => seen.push(group.file),
            Ok(None) => panic!("the stream ended without the mismatch"),
            Err(e) => break e,
        }
    };
    assert!(matches!(&err, Error::DigestMismatch { path, .. } if *path == paths[0]), "{err}");
    assert!(!seen.contains(&1), "a group of file 1 was handed out before file 0 failed");

    // The device stand-in, through the copier.
    for wrong in [false, true] {
        let stream = DeviceStream::open(planned(wrong), &options).unwrap();
        let len: u64 = (0..stream.group_count()).map(|k| stream.alloc_len(k) + 8192).sum();
        let device = Arc::new(HostMemoryDevice::new(len as usize));
        let shared = Arc::clone(&device);
        let copier = Copier::start(stream, move |_| Ok(Arc::clone(&shared))).unwrap();
        let mut base = 0;
        let mut outcome = Ok(());
        let mut waited = Vec::new();
        for k in 0..copier.stream().group_count() {
            copier.submit(k, base, 0).unwrap();
            base += copier.stream().alloc_len(k) + 8192;
            match copier.wait(k) {
                Ok(_) => waited.push(copier.stream().file(k).0),
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
        }
        drop(copier);
        assert_eq!(device.in_flight(), 0);
        match (wrong, outcome) {
            (false, outcome) => assert!(outcome.is_ok(), "{outcome:?}"),
            (true, Err(Error::DigestMismatch { path, .. })) => {
                assert_eq!(path, paths[0]);
                assert!(!waited.contains(&1), "a group of file 1 was handed out before file 0 failed");
            }
            (true, other) => panic!("expected a digest mismatch, got {other:?}"),
        }
    }
}
