#![no_main]
//! Fuzz target `root_metadata`: see `zarrckpt_fuzz::check_root_metadata` for the invariants.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    zarrckpt_fuzz::check_root_metadata(data);
});
