#!/usr/bin/env bash
# Creates (idempotently) the Python virtual environment used by the interoperability tests
# (tests/interop.rs): zarr-python and tensorstore at pinned versions, from PyPI.
#
#   scripts/setup-venv.sh            # creates <repo>/.venv, prints its python path last
#   ZARRCKPT_VENV=/some/dir scripts/setup-venv.sh
#   ZARRCKPT_BASE_PYTHON=python3.12 scripts/setup-venv.sh   # interpreter to build it from
#   ZARRCKPT_VENV_FORCE=1 scripts/setup-venv.sh               # rebuild from scratch
#
# Then: ZARRCKPT_PYTHON="$(scripts/setup-venv.sh | tail -n1)" cargo test --test interop
# (tests/interop.rs finds <repo>/.venv/bin/python on its own.)
#
# Needs CPython >= 3.11 and access to PyPI. Progress goes to stderr; the only line on stdout
# is the venv's python path. Works where `python3 -m venv` lacks ensurepip (Debian without
# python3-venv): the venv is then created --without-pip and pip bootstrapped from its PyPI wheel.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ZARRCKPT_VENV:-$REPO/.venv}"
BASE_PYTHON="${ZARRCKPT_BASE_PYTHON:-python3}"

# Everything pinned, transitive dependencies included: `pip freeze` of a fresh install of
# zarr==3.1.6 tensorstore==0.1.86 numpy ml_dtypes on CPython 3.11.
# zarr 3.1.6 and numpy 2.4 need Python >= 3.11. Bump versions here; the stamp follows.
REQUIREMENTS="zarr==3.1.6
tensorstore==0.1.86
numpy==2.4.6
ml_dtypes==0.6.0
numcodecs==0.16.6
donfig==0.8.1.post1
google-crc32c==1.9.0
packaging==26.3
PyYAML==6.0.3
typing_extensions==4.16.0"
# Used only when the base interpreter has no ensurepip.
BOOTSTRAP_PIP_VERSION="25.1.1"

log() { printf 'setup-venv: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

command -v "$BASE_PYTHON" >/dev/null 2>&1 || die "'$BASE_PYTHON' not found; install CPython >= 3.11 or set ZARRCKPT_BASE_PYTHON"
"$BASE_PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
    || die "$("$BASE_PYTHON" -V 2>&1) is too old: zarr 3.1.6 needs Python >= 3.11 (set ZARRCKPT_BASE_PYTHON)"

PY="$VENV/bin/python"
STAMP="$VENV/.zarrckpt-requirements"
# The stamp records the requirements and the interpreter they were installed for.
WANT_STAMP="$(printf '%s\n# base: %s\n' "$REQUIREMENTS" "$("$BASE_PYTHON" -c 'import sys; print(sys.version.split()[0])')")"

# Serialise concurrent runs (several engineers share one tree).
LOCK="${TMPDIR:-/tmp}/zarrckpt-venv-$(printf '%s' "$VENV" | cksum | cut -d' ' -f1).lock"
if command -v flock >/dev/null 2>&1; then
    exec 9>"$LOCK"
    if ! flock -n 9; then
        log "another setup-venv.sh is running for $VENV; waiting"
        flock 9
    fi
fi

# True when the venv's installed distributions are exactly the pinned versions.
venv_matches() {
    [ -x "$PY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT_STAMP" ] || return 1
    printf '%s\n' "$REQUIREMENTS" | "$PY" -c '
import sys
from importlib.metadata import version, PackageNotFoundError
bad = []
for line in sys.stdin.read().split():
    name, want = line.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    if have != want:
        bad.append(f"{name}: want {want}, have {have}")
import numpy, ml_dtypes, zarr, tensorstore  # noqa: E401,F401  (they must import)
sys.exit(1 if bad else 0)
' >/dev/null 2>&1
}

if [ "${ZARRCKPT_VENV_FORCE:-0}" != "1" ] && venv_matches; then
    log "up to date: $VENV"
    printf '%s\n' "$PY"
    exit 0
fi

if [ "${ZARRCKPT_VENV_FORCE:-0}" = "1" ] || [ ! -x "$PY" ] || ! "$PY" -c 'import sys' >/dev/null 2>&1; then
    log "creating $VENV with $("$BASE_PYTHON" -V 2>&1)"
    rm -rf "$VENV"
    if ! "$BASE_PYTHON" -m venv "$VENV" >&2; then
        log "'$BASE_PYTHON -m venv' failed (no ensurepip?); retrying with --without-pip"
        rm -rf "$VENV"
        "$BASE_PYTHON" -m venv --without-pip "$VENV" >&2 || die "cannot create a venv at $VENV"
    fi
fi

if ! "$PY" -m pip --version >/dev/null 2>&1; then
    if "$PY" -m ensurepip --upgrade --default-pip >&2 2>/dev/null; then
        log "pip installed with ensurepip"
    else
        log "no ensurepip; bootstrapping pip $BOOTSTRAP_PIP_VERSION from its PyPI wheel"
        "$PY" - "$BOOTSTRAP_PIP_VERSION" >&2 <<'EOF' || die "cannot bootstrap pip from PyPI"
import hashlib, json, os, subprocess, sys, tempfile, urllib.request
version = sys.argv[1]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
# PEP 691 JSON form of the simple index (the API pip itself uses).
req = urllib.request.Request(f"{index}/pip/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(req, timeout=60) as r:
    files = json.load(r)["files"]
name = f"pip-{version}-py3-none-any.whl"
wheel = next(f for f in files if f["filename"] == name)
with urllib.request.urlopen(wheel["url"], timeout=120) as r:
    data = r.read()
if hashlib.sha256(data).hexdigest() != wheel["hashes"]["sha256"]:
    sys.exit(f"{name}: sha256 mismatch")
with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(data)
    # A pip wheel can run itself to install itself.
    subprocess.check_call([sys.executable, os.path.join(path, "pip"), "install", "--no-index",
                           "--disable-pip-version-check", path])
EOF
    fi
fi

REQ_FILE="$(mktemp)"
trap 'rm -f "$REQ_FILE"' EXIT
printf '%s\n' "$REQUIREMENTS" >"$REQ_FILE"
log "installing pinned packages (binary wheels only)"
rm -f "$STAMP"
"$PY" -m pip install --disable-pip-version-check --no-input --only-binary=:all: -r "$REQ_FILE" >&2 \
    || die "pip install failed (is PyPI reachable? are wheels published for $(uname -m) and this Python?)"

printf '%s\n' "$WANT_STAMP" >"$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
venv_matches || die "installed versions do not match the pins (see '$PY -m pip freeze')"
"$PY" -c 'import zarr, tensorstore, numpy, ml_dtypes; print("setup-venv: zarr", zarr.__version__, "numpy", numpy.__version__, "ml_dtypes", ml_dtypes.__version__)' >&2
log "ready: $VENV"
printf '%s\n' "$PY"
