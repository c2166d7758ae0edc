#![no_main]
//! Fuzz target `layout_decode`: see `zarrckpt_fuzz::check_layout_decode` for the invariants.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    zarrckpt_fuzz::check_layout_decode(data);
});
