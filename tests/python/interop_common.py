"""Helpers shared by the interoperability scripts run from tests/interop.rs.

Every comparison is on raw bytes (C order, little endian), never on values, so NaN payloads,
signalling NaNs and -0.0 must survive exactly.
"""

import sys

try:
    import ml_dtypes
    import numpy as np
    import tensorstore as ts
    import zarr
except ImportError as e:  # pragma: no cover - environment problem, not a test result
    sys.exit(
        f"interop: cannot import {e.name!r} ({e}); create the venv with scripts/setup-venv.sh "
        "or point ZARRCKPT_PYTHON at a python with zarr, tensorstore, numpy and ml_dtypes"
    )

PINNED = {"zarr": "3.1.6", "tensorstore": "0.1.86"}

# Zarr v3 data type name -> numpy dtype (little endian).
NUMPY_DTYPES = {
    "bool": np.dtype(np.bool_),
    "int8": np.dtype("<i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("<u1"),
    "uint16": np.dtype("<u2"),
    "uint32": np.dtype("<u4"),
    "uint64": np.dtype("<u8"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}

# The data types zarr-python 3.1.6 reads without a registered extension.
ZARR_PYTHON_DTYPES = {
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64",
}


def versions():
    from importlib.metadata import version

    have = {name: version(name) for name in ("zarr", "tensorstore", "numpy", "ml_dtypes")}
    line = " ".join(f"{k}={v}" for k, v in have.items())
    for name, want in PINNED.items():
        if have[name] != want:
            line += f" (WARNING: {name} {have[name]} is not the pinned {want}; rerun scripts/setup-venv.sh)"
    return line


def to_bytes(a):
    """The raw C-order bytes of an array (any dtype, 0-d included)."""
    return np.ascontiguousarray(a).tobytes()


def first_difference(got, want, shape, itemsize):
    """Describes the first differing element of two byte strings of one shape."""
    if len(got) != len(want):
        return f"{len(got)} bytes, expected {len(want)}"
    g = np.frombuffer(got, dtype=np.uint8).reshape(-1, itemsize)
    w = np.frombuffer(want, dtype=np.uint8).reshape(-1, itemsize)
    rows = np.nonzero((g != w).any(axis=1))[0]
    if len(rows) == 0:
        return "no difference"
    i = int(rows[0])
    index = tuple(int(x) for x in np.unravel_index(i, shape)) if shape else ()
    # Bytes shown most significant first (the element read as a little-endian integer).
    return (
        f"first differing element at index {list(index)} (flat {i}): "
        f"got 0x{g[i][::-1].tobytes().hex()}, expected 0x{w[i][::-1].tobytes().hex()}; "
        f"{len(rows)} of {g.shape[0]} elements differ"
    )


class Failures:
    """Collects mismatches so one run reports all of them."""

    def __init__(self):
        self.items = []

    def add(self, what):
        self.items.append(what)
        print(f"MISMATCH: {what}", flush=True)

    def compare(self, label, dtype_name, shape, got, want):
        """Records a failure unless the byte strings are identical. Returns True on a match."""
        if got == want:
            return True
        itemsize = NUMPY_DTYPES[dtype_name].itemsize
        self.add(f"{label} ({dtype_name}, shape {list(shape)}): {first_difference(got, want, tuple(shape), itemsize)}")
        return False

    def guard(self, label, fn):
        """Runs fn(); an exception becomes a failure naming `label`."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - every error is a test failure to report
            self.add(f"{label}: {type(e).__name__}: {e}")
            return None

    def finish(self, summary):
        print(summary, flush=True)
        if self.items:
            print(f"\nFAILED: {len(self.items)} mismatch(es):", file=sys.stderr)
            for f in self.items:
                print(f"  - {f}", file=sys.stderr)
            sys.exit(1)
