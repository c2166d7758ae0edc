"""Reads zarrckpt checkpoints with tensorstore and zarr-python and compares every byte.

Usage: python check_zarrckpt.py MANIFEST.json

The manifest (written by tests/interop.rs) lists checkpoints; for each, its directory, world
size and tensors (key, array path, data type, shape, file of expected raw bytes). Exits 1
naming every mismatch (array, data type, first differing index); the last stdout line is a
`CHECKED ...` summary the Rust test verifies.
"""

import json
import math
import sys

from interop_common import NUMPY_DTYPES, ZARR_PYTHON_DTYPES, Failures, np, to_bytes, ts, versions, zarr


def decode_e4m3fn(b):
    """float8_e4m3fn (OCP / PyTorch): finite only, max 448, NaN = S.1111.111, no inf."""
    s = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    if e == 15 and m == 7:
        return math.nan
    if e == 0:
        return s * m / 8 * 2.0**-6
    return s * (1 + m / 8) * 2.0 ** (e - 7)


def decode_e5m2(b):
    """float8_e5m2: IEEE-like, with inf and NaN."""
    s = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 2) & 0x1F, b & 0x3
    if e == 31:
        return s * math.inf if m == 0 else math.nan
    if e == 0:
        return s * m / 4 * 2.0**-14
    return s * (1 + m / 4) * 2.0 ** (e - 15)


FLOAT8_TABLES = {
    "float8_e4m3fn": np.array([decode_e4m3fn(b) for b in range(256)]),
    "float8_e5m2": np.array([decode_e5m2(b) for b in range(256)]),
}


def check_float8_values(fails, label, dtype_name, got):
    """Checks that the data type a reader hands out decodes every byte with the right
    semantics (the float8_e4m3fn trap: an IEEE e4m3 reader turns |x| >= 256 into inf/NaN)."""
    table = FLOAT8_TABLES.get(dtype_name)
    if table is None or got.size == 0:
        return
    raw = np.ascontiguousarray(got).reshape(-1).view(np.uint8)
    values = np.ascontiguousarray(got).reshape(-1).astype(np.float64)
    want = table[raw]
    bad = ~((values == want) | (np.isnan(values) & np.isnan(want)))
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        fails.add(
            f"{label} ({dtype_name}): byte 0x{raw[i]:02x} at flat index {i} reads as {values[i]!r}, "
            f"expected {want[i]!r} (wrong float8 semantics)"
        )
    if dtype_name == "float8_e4m3fn" and np.isinf(values).any():
        fails.add(f"{label} ({dtype_name}): reads contain inf, which float8_e4m3fn cannot represent")


def sub_box(shape):
    """A box strictly inside the array where possible (crossing chunk boundaries), or None."""
    if not shape or any(d == 0 for d in shape):
        return None
    box = []
    for d in shape:
        lo = d // 3
        hi = max(lo + 1, min(d, (2 * d) // 3 + 1))
        box.append(slice(lo, hi))
    return tuple(box)


def main():
    manifest = json.load(open(sys.argv[1]))
    fails = Failures()
    counts = {"tensorstore": 0, "tensorstore_partial": 0, "zarr": 0, "zarr_partial": 0, "groups": 0, "float8": 0,
              "multi_shard": 0, "multi_subchunk": 0}
    print(f"versions: {versions()}", flush=True)

    for ckpt in manifest["checkpoints"]:
        root_dir = ckpt["dir"]
        name = ckpt["label"]
        tensors = ckpt["tensors"]

        # The root group and its `zarrckpt` attribute, through zarr-python.
        def check_root():
            group = zarr.open_group(root_dir, mode="r")
            attr = group.attrs["zarrckpt"]
            if attr.get("format") != "zarrckpt":
                fails.add(f"[{name}] root attribute format is {attr.get('format')!r}")
            if attr.get("world_size") != ckpt["world_size"]:
                fails.add(f"[{name}] world_size is {attr.get('world_size')!r}, expected {ckpt['world_size']}")
            got_keys = set(attr.get("tensors", {}))
            want_keys = {t["key"] for t in tensors}
            if got_keys != want_keys:
                fails.add(
                    f"[{name}] tensor list differs: missing {sorted(want_keys - got_keys)}, "
                    f"unexpected {sorted(got_keys - want_keys)}"
                )
            for t in tensors:
                e = attr.get("tensors", {}).get(t["key"])
                if e is None:
                    continue
                for field, want in (("path", t["path"]), ("dtype", t["dtype"]), ("shape", t["shape"])):
                    if e.get(field) != want:
                        fails.add(f"[{name}] {t['key']}: index {field} is {e.get(field)!r}, expected {want!r}")
                if e.get("compression") != ckpt["compression"]:
                    fails.add(f"[{name}] {t['key']}: compression is {e.get('compression')!r}, expected {ckpt['compression']!r}")
            counts["groups"] += 1
            return group

        group = fails.guard(f"[{name}] zarr.open_group({root_dir!r}) and attribute `zarrckpt`", check_root)

        for t in tensors:
            key, path, dtype_name, shape = t["key"], t["path"], t["dtype"], tuple(t["shape"])
            label = f"[{name}] {key} ({path})"
            want_bytes = open(t["expected"], "rb").read()
            want = np.frombuffer(want_bytes, dtype=NUMPY_DTYPES[dtype_name]).reshape(shape)
            array_dir = f"{root_dir}/{path}"

            # What the layout exercises: several shards, several subchunks per shard.
            def layout():
                meta = json.load(open(f"{array_dir}/zarr.json"))
                outer = meta["chunk_grid"]["configuration"]["chunk_shape"]
                inner = meta["codecs"][0]["configuration"]["chunk_shape"]
                counts["multi_shard"] += math.prod(-(-s // c) for s, c in zip(shape, outer)) > 1
                counts["multi_subchunk"] += math.prod(o // i for o, i in zip(outer, inner)) > 1

            fails.guard(f"{label}: zarr.json", layout)

            # tensorstore: every data type, whole array and a sub-box.
            def check_tensorstore():
                arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": array_dir}}, read=True).result()
                if arr.dtype.name != dtype_name:
                    fails.add(f"{label}: tensorstore data type {arr.dtype.name}, expected {dtype_name}")
                    return
                if tuple(arr.shape) != shape:
                    fails.add(f"{label}: tensorstore shape {list(arr.shape)}, expected {list(shape)}")
                    return
                got = arr.read().result()
                if fails.compare(f"{label} via tensorstore", dtype_name, shape, to_bytes(got), want_bytes):
                    counts["tensorstore"] += 1
                if dtype_name in FLOAT8_TABLES:
                    check_float8_values(fails, f"{label} via tensorstore", dtype_name, got)
                    counts["float8"] += 1
                box = sub_box(shape)
                if box is not None:
                    part = arr[box].read().result()
                    sub = want[box]
                    if fails.compare(f"{label} via tensorstore, box {box}", dtype_name, sub.shape, to_bytes(part), to_bytes(sub)):
                        counts["tensorstore_partial"] += 1

            fails.guard(f"{label}: tensorstore", check_tensorstore)

            if dtype_name not in ZARR_PYTHON_DTYPES:
                continue

            # zarr-python: the standard data types, whole array, a sub-box, and via the group.
            def check_zarr():
                arr = zarr.open_array(array_dir, mode="r")
                if arr.dtype != NUMPY_DTYPES[dtype_name]:
                    fails.add(f"{label}: zarr-python dtype {arr.dtype}, expected {NUMPY_DTYPES[dtype_name]}")
                    return
                if tuple(arr.shape) != shape:
                    fails.add(f"{label}: zarr-python shape {list(arr.shape)}, expected {list(shape)}")
                    return
                if arr.attrs.get("zarrckpt", {}).get("key") != key:
                    fails.add(f"{label}: zarr-python array attribute zarrckpt.key is {arr.attrs.get('zarrckpt')!r}")
                got = arr[...]
                if fails.compare(f"{label} via zarr-python", dtype_name, shape, to_bytes(got), want_bytes):
                    counts["zarr"] += 1
                box = sub_box(shape)
                if box is not None:
                    part = arr[box]
                    sub = want[box]
                    if fails.compare(f"{label} via zarr-python, box {box}", dtype_name, sub.shape, to_bytes(part), to_bytes(sub)):
                        counts["zarr_partial"] += 1
                if group is not None:
                    node = group[path]
                    if not isinstance(node, zarr.Array) or tuple(node.shape) != shape:
                        fails.add(f"{label}: zarr-python group[{path!r}] is {node!r}")

            fails.guard(f"{label}: zarr-python", check_zarr)

    fails.finish("CHECKED " + " ".join(f"{k}={v}" for k, v in counts.items()))


if __name__ == "__main__":
    main()
