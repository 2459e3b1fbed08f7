//! Planning over several files at once: names across files, offsets, alignment flags
//! (see `check_place`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: &[u8]| fuzz_checks::check_place(input));
