#![no_main]
//! Fuzz target `shard_read`: see `zarrckpt_fuzz::check_shard_read` for the invariants.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    zarrckpt_fuzz::check_shard_read(data);
});
