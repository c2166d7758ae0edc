"""Reads the objects of a zarrckpt checkpoint with tensorstore and zarr-python, without
zarrckpt, and compares every byte (and every JSON value) with what was saved.

Usage: python check_objects.py MANIFEST.json

The manifest (written by tests/interop.rs) gives the checkpoint directory and, per stored
value, the array's node path, key, scope, encoding, attributes expected and the value's
bytes in hex. Exits 1 naming every mismatch; the last stdout line is an `OBJECTS ...`
summary the Rust test verifies.
"""

import json
import os
import sys

from interop_common import np, ts, versions, zarr


def main():
    manifest = json.load(open(sys.argv[1]))
    root = manifest["dir"]
    fails = []
    counts = {"tensorstore": 0, "zarr": 0, "json": 0, "groups": 0}

    # The root group, the objects group and the per-rank / sharded groups open as groups.
    group = zarr.open_group(root, mode="r")
    if "objects" not in group.attrs["zarrckpt"]:
        fails.append("root index has no `objects` member")
    for g in manifest["groups"]:
        zarr.open_group(os.path.join(root, g), mode="r")
        counts["groups"] += 1

    for v in manifest["values"]:
        path = os.path.join(root, v["path"])
        want = bytes.fromhex(v["hex"])
        label = f"{v['path']} ({v['key']}, {v['scope']})"
        arr = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": path}}, read=True).result()
        got = np.asarray(arr.read().result())
        if got.dtype != np.uint8 or got.shape != (len(want),) or got.tobytes() != want:
            fails.append(f"tensorstore {label}: {got.dtype} {got.shape}, bytes differ")
        else:
            counts["tensorstore"] += 1
        za = zarr.open_array(path, mode="r")
        got = za[...]
        if got.dtype != np.uint8 or got.shape != (len(want),) or got.tobytes() != want:
            fails.append(f"zarr-python {label}: {got.dtype} {got.shape}, bytes differ")
        else:
            counts["zarr"] += 1
        attrs = dict(za.attrs)["zarrckpt"]
        for k, val in v["attributes"].items():
            if attrs.get(k) != val:
                fails.append(f"{label}: attribute {k} is {attrs.get(k)!r}, expected {val!r}")
        if v["encoding"] == "json":
            value = json.loads(got.tobytes().decode("utf-8"))
            if value != v["json"]:
                fails.append(f"{label}: JSON value {value!r}, expected {v['json']!r}")
            else:
                counts["json"] += 1

    print(versions())
    for f in fails:
        print("FAIL", f)
    print("OBJECTS " + " ".join(f"{k}={n}" for k, n in counts.items()))
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
