#![no_main]
//! Fuzz target `tensor_key`: see `zarrckpt_fuzz::check_tensor_key` for the invariants.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    zarrckpt_fuzz::check_tensor_key(data);
});
