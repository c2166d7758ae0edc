#![no_main]
//! Fuzz target `shard_footer`: see `zarrckpt_fuzz::check_shard_footer` for the invariants.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    zarrckpt_fuzz::check_shard_footer(data);
});
