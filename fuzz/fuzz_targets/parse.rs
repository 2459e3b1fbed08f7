//! Header parsing and validation on arbitrary bytes taken as a whole file, then planning
//! of what it accepts (see `check_parse`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|file: &[u8]| {
    let _ = fuzz_checks::check_parse(file);
});
