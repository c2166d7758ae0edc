#!/usr/bin/env bash
# Builds the Python package (python/: the PyO3 extension zarrckpt._native and the pure-Python
# modules) and installs it, editable, into the venv of scripts/setup-venv.sh (created first if
# needed). Prints the venv's python path last.
#
#   scripts/build-python.sh
#   "$(scripts/build-python.sh | tail -n1)" -c 'import zarrckpt.torch'
#
# Builds from source with cargo (release profile, the shared target/ directory): nothing
# prebuilt is fetched. Progress goes to stderr.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$("$REPO/scripts/setup-venv.sh" | tail -n1)"
VENV="$(dirname "$(dirname "$PY")")"
# pyo3 builds against the venv's interpreter (the same for maturin and cargo clippy, so
# neither rebuilds pyo3 for the other).
export PYO3_PYTHON="$PY"
(cd "$REPO/python" && PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV" maturin develop --release --locked >&2)
"$PY" -c 'import zarrckpt; print("build-python: zarrckpt", zarrckpt.__version__, "from", zarrckpt.__file__)' >&2
printf '%s\n' "$PY"
