//! The split of a file into aligned read requests (see `check_read_blocks`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| fuzz_checks::check_read_blocks(input));
