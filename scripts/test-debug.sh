#!/usr/bin/env bash
# Runs a fast subset of the tests in a debug build, so that overflow checks and debug
# assertions run too (the main suite runs in release): the library's unit tests, the error
# and corruption tests (hostile input included), the disk-full tests and the property tests.
# Its own target directory leaves the release build untouched; no debug info, to keep the
# build small. Cost, measured from scratch: about 2.5 minutes of CPU for the build (9 minutes
# of wall time on 2 cores shared with five other builds) and 30 seconds for the tests.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_PROFILE_DEV_DEBUG=false
export CARGO_TARGET_DIR="${ZARRCKPT_DEBUG_TARGET_DIR:-target/debug-checks}"
cargo test --locked --lib --test errors --test corruption --test enospc --test prop_plan \
  --test prop_roundtrip "$@"
