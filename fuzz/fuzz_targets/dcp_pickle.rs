#![no_main]
//! Fuzz target `dcp_pickle`: see `zarrckpt_fuzz::check_dcp_pickle` for the invariants.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    zarrckpt_fuzz::check_dcp_pickle(data);
});
