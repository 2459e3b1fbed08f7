//! Replays the fuzz corpus under `cargo test`: every file in `fuzz/corpus/<target>/` goes
//! through the same checks as the fuzz target of that name (`fuzz/src/lib.rs`, included
//! here), so the seeds and every input saved from a fuzzing run are exercised on each test
//! run without the nightly flags fuzzing needs. `make fuzz` runs the fuzzers themselves.

#[allow(dead_code)]
#[path = "../fuzz/src/lib.rs"]
mod checks;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target)
}

/// Runs `check` on every file of the target's corpus; fails naming every file that panics.
fn replay(target: &str, check: impl Fn(&[u8])) {
    let dir = corpus_dir(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} is empty", dir.display());
    let failed: Vec<String> = files
        .iter()
        .filter(|path| {
            let bytes = std::fs::read(path).unwrap();
            catch_unwind(AssertUnwindSafe(|| check(&bytes))).is_err()
        })
        .map(|path| path.display().to_string())
        .collect();
    assert!(failed.is_empty(), "{} of {} inputs failed:\n{}", failed.len(), files.len(), failed.join("\n"));
}

#[test]
fn parse_corpus() {
    replay("parse", |file| {
        let _ = checks::check_parse(file);
    });
}

#[test]
fn load_corpus() {
    replay("load", checks::check_load);
}

#[test]
fn differential_corpus_parses_consistently() {
    // The reference parser is a dependency of the fuzz crate only; here the files get the
    // parse checks.
    replay("differential", |file| {
        let _ = checks::check_parse(file);
    });
}

#[test]
fn place_corpus() {
    replay("place", checks::check_place);
}

#[test]
fn read_blocks_corpus() {
    replay("read_blocks", checks::check_read_blocks);
}

#[test]
fn valid_seeds_are_accepted_and_invalid_ones_rejected() {
    for target in ["parse", "load", "differential"] {
        for entry in std::fs::read_dir(corpus_dir(target)).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_owned();
            let result = fastsafetensors::format::parse(&std::fs::read(&path).unwrap());
            if name.starts_with("valid-") {
                assert!(result.is_ok(), "{name}: {}", result.unwrap_err());
            } else if name.starts_with("invalid-foreign-") {
                // Files of other formats are named as such, not as a bad header length.
                assert!(
                    matches!(result, Err(fastsafetensors::format::FormatError::NotSafetensors(_))),
                    "{name}: {result:?}"
                );
            } else if name.starts_with("invalid-") {
                assert!(result.is_err(), "{name} was accepted");
            }
        }
    }
}

#[test]
fn multi_file_inputs_split_on_the_separator() {
    let sep = checks::FILE_SEPARATOR;
    assert_eq!(checks::split_files(b"abc"), [b"abc"]);
    let joined = [&b"a"[..], sep, b"", sep, b"c"].concat();
    assert_eq!(checks::split_files(&joined), [&b"a"[..], b"", b"c"]);
    let many = vec![sep; 20].concat();
    assert_eq!(checks::split_files(&many).len(), checks::MAX_FILES);
}
