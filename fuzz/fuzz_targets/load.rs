//! End to end: the bytes are written to a file and loaded into host memory with every
//! reader (see `check_load`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|file: &[u8]| fuzz_checks::check_load(file));
