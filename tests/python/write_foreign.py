"""Writes Zarr v3 arrays with tensorstore and zarr-python for zarrckpt to read back.

Usage: python write_foreign.py OUT_DIR

For each array: OUT_DIR/<writer>/<name>/ (the array), OUT_DIR/expected/<name>.bin (its raw
little-endian C-order bytes, fill value where chunks were never written) and an entry in
OUT_DIR/manifest.json: name, writer, dir, dtype, shape, expected, note, and `expect_error`
for arrays zarrckpt must refuse. tests/interop.rs reads every array with
zarrckpt::storage::foreign::read_array and compares bytes.
"""

import json
import math
import os
import sys

from interop_common import NUMPY_DTYPES, Failures, np, to_bytes, ts, versions, zarr

OUT = sys.argv[1]
MANIFEST = []
FAILS = Failures()

ALL_DTYPES = list(NUMPY_DTYPES)
F32_SPECIALS = [0x7FC00000, 0x7F800001, 0xFFC00123, 0x7FFFFFFF, 0x7F800000, 0xFF800000, 0x80000000, 0x00000001, 0x7F7FFFFF]
F64_SPECIALS = [
    0x7FF8000000000000, 0x7FF0000000000001, 0xFFF8000000000123, 0x7FF0000000000000,
    0xFFF0000000000000, 0x8000000000000000, 0x0000000000000001, 0x7FEFFFFFFFFFFFFF,
]


def pattern(dtype_name, shape, seed):
    """Values covering the bit space: every pattern for 1- and 2-byte types once there are
    enough elements, NaN payloads, signalling NaNs, infinities and -0 for wider floats."""
    dt = NUMPY_DTYPES[dtype_name]
    n = math.prod(shape)
    rng = np.random.default_rng(seed)
    if dtype_name == "bool":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dt.itemsize <= 2:
        bits = 8 * dt.itemsize
        raw = ((np.arange(n, dtype=np.uint64) * 0x9E37 + seed) % (1 << bits)).astype(f"<u{dt.itemsize}")
        if dtype_name == "float8_e4m3fn" and n >= 2:
            raw[:2] = [0x7E, 0x7F]  # 448 and NaN first, whatever the seed
        return raw.view(dt).reshape(shape)
    raw = np.frombuffer(rng.bytes(n * dt.itemsize), dtype=f"<u{dt.itemsize}").copy()
    specials = F32_SPECIALS if dt.itemsize == 4 else F64_SPECIALS
    k = min(n, len(specials))
    raw[:k] = specials[:k]
    return raw.view(dt).reshape(shape)


def record(name, writer, path, dtype_name, expected, note, **extra):
    os.makedirs(f"{OUT}/expected", exist_ok=True)
    exp_path = f"{OUT}/expected/{name}.bin"
    with open(exp_path, "wb") as f:
        f.write(to_bytes(expected))
    MANIFEST.append(
        {"name": name, "writer": writer, "dir": path, "dtype": dtype_name, "shape": list(expected.shape),
         "expected": exp_path, "note": note, **extra}
    )


def chunk_files(path):
    return sum(len([f for f in files if f != "zarr.json"]) for _, _, files in os.walk(path))


def grid_count(shape, chunks):
    return math.prod(-(-s // c) for s, c in zip(shape, chunks))


def blosc(typesize):
    return {"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle", "typesize": typesize, "blocksize": 0}}


ZSTD = {"name": "zstd", "configuration": {"level": 3, "checksum": False}}
GZIP = {"name": "gzip", "configuration": {"level": 5}}
CRC = {"name": "crc32c"}
BYTES = {"name": "bytes", "configuration": {"endian": "little"}}


# ---------------------------------------------------------------------------------------- tensorstore


def hex_fill(path, expected):
    """Rewrites a float8 array's numeric fill_value as the equivalent raw-bits hex string.

    tensorstore always writes float8 fill values as numbers (0.0, 448.0, "NaN"), which this
    zarrckpt cannot parse for float8_e5m2 (and only 0.0 for float8_e4m3fn); the hex form lets
    the other arrays of those types test the codec paths. The plain arrays keep the numbers.
    """
    meta_path = f"{path}/zarr.json"
    meta = json.load(open(meta_path))
    fill_byte = np.asarray(meta["fill_value"] if not isinstance(meta["fill_value"], str) else float(meta["fill_value"].replace("Infinity", "inf")),
                           dtype=expected.dtype).reshape(1).view(np.uint8)[0]
    meta["fill_value"] = f"0x{int(fill_byte):02x}"
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def ts_array(name, dtype_name, shape, chunks, codecs, *, fill=None, writes=None, key_encoding=None, note="", seed=1,
             hex_fill_value=None):
    """Creates an array with tensorstore and writes `writes` (boxes; default: everything).
    float8_e5m2 arrays get their fill value rewritten as hex unless `hex_fill_value=False`."""
    if hex_fill_value is None:
        hex_fill_value = dtype_name == "float8_e5m2"
    path = f"{OUT}/tensorstore/{name}"
    if fill is None:
        fill = False if dtype_name == "bool" else 0
    metadata = {
        "shape": list(shape),
        "data_type": dtype_name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "codecs": codecs,
        "fill_value": fill,
    }
    if key_encoding is not None:
        metadata["chunk_key_encoding"] = key_encoding

    def go():
        arr = ts.open(
            {"driver": "zarr3", "kvstore": {"driver": "file", "path": path}, "metadata": metadata},
            create=True, delete_existing=True,
        ).result()
        data = pattern(dtype_name, shape, seed)
        fill_arr = np.asarray(arr.fill_value if arr.fill_value is not None else np.zeros((), NUMPY_DTYPES[dtype_name]))
        expected = np.empty(shape, dtype=NUMPY_DTYPES[dtype_name])
        expected[...] = fill_arr
        boxes = writes if writes is not None else [tuple(slice(0, s) for s in shape)]
        for box in boxes:
            arr[box].write(data[box]).result()
            expected[box] = data[box]
        # Read back with tensorstore itself: the expectation must be what the writer means.
        back = arr.read().result()
        if to_bytes(back) != to_bytes(expected):
            FAILS.add(f"tensorstore does not read back its own array {name}")
        if writes is not None and chunk_files(path) >= grid_count(shape, chunks):
            FAILS.add(f"{name}: expected missing chunks, found {chunk_files(path)} chunk files")
        extra_note = ""
        if hex_fill_value:
            hex_fill(path, expected)
            extra_note = ", fill_value rewritten as hex"
        record(name, "tensorstore", path, dtype_name, expected, note + extra_note)

    FAILS.guard(f"tensorstore write {name} ({dtype_name})", go)


def sharding(inner, codecs, location="end"):
    return {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": list(inner),
            "codecs": codecs,
            "index_codecs": [BYTES, CRC],
            "index_location": location,
        },
    }


def tensorstore_arrays():
    for i, d in enumerate(ALL_DTYPES):
        # Exactly as tensorstore writes them (numeric float8 fill values included).
        ts_array(f"ts_plain_{d}", d, (13, 7), (4, 3), [BYTES], note="bytes only, partial edge chunks", seed=10 + i,
                 hex_fill_value=False)
    for i, d in enumerate(["bfloat16", "float8_e4m3fn", "float32", "int16", "float8_e5m2"]):
        size = NUMPY_DTYPES[d].itemsize
        ts_array(f"ts_blosc_{d}", d, (13, 7), (4, 3), [BYTES, blosc(size)], note="blosc lz4 shuffle", seed=30 + i)
    for i, d in enumerate(["float8_e5m2", "float64", "uint32", "bfloat16", "float8_e4m3fn"]):
        ts_array(f"ts_zstd_{d}", d, (13, 7), (4, 3), [BYTES, ZSTD], note="zstd", seed=40 + i)
    for i, d in enumerate(["float8_e4m3fn", "int64", "float16", "bfloat16"]):
        ts_array(f"ts_gzip_{d}", d, (13, 7), (4, 3), [BYTES, GZIP], note="gzip", seed=50 + i)
    inner_variants = [
        ([BYTES, ZSTD], "end"),
        ([BYTES, blosc(0)], "start"),
        ([BYTES, GZIP], "end"),
        ([BYTES, CRC], "start"),
        ([BYTES], "end"),
    ]
    for i, d in enumerate(["bfloat16", "float8_e4m3fn", "float32", "float8_e5m2", "uint8", "bool", "int64"]):
        codecs, location = inner_variants[i % len(inner_variants)]
        codecs = [c if c["name"] != "blosc" else blosc(NUMPY_DTYPES[d].itemsize) for c in codecs]
        ts_array(
            f"ts_shard_{d}", d, (37, 21), (16, 14), [sharding((4, 7), codecs, location)],
            note=f"sharding_indexed, inner {[c['name'] for c in codecs]}, index at {location}", seed=60 + i,
        )
    # Missing chunks: only a few boxes written; the rest must read as the fill value.
    missing = [(slice(0, 4), slice(0, 4)), (slice(8, 10), slice(4, 8))]
    for i, (d, fill) in enumerate(
        [("bfloat16", 1.5), ("float32", "NaN"), ("int32", -7), ("float8_e5m2", -2.0), ("uint16", 65535),
         ("bool", True), ("float8_e4m3fn", 0.0), ("float64", "-Infinity"), ("float16", -0.0)]
    ):
        ts_array(f"ts_missing_{d}", d, (10, 9), (4, 4), [BYTES, ZSTD], fill=fill, writes=missing,
                 note=f"missing chunks, fill {fill}", seed=80 + i)
    ts_array("ts_missing_float8_e5m2_numeric_fill", "float8_e5m2", (10, 9), (4, 4), [BYTES], fill=-2.0,
             writes=missing, note="missing chunks, fill -2.0 as tensorstore writes it", seed=89, hex_fill_value=False)
    shard_missing = [(slice(0, 5), slice(0, 7))]
    for i, (d, fill) in enumerate([("float32", 0.25), ("bfloat16", -2.0), ("float8_e4m3fn", 0.0), ("int8", 5)]):
        ts_array(f"ts_missing_shard_{d}", d, (37, 21), (16, 14), [sharding((4, 7), [BYTES, ZSTD])], fill=fill,
                 writes=shard_missing, note=f"sharded, missing subchunks and shards, fill {fill}", seed=90 + i)
    # Nonzero float8_e4m3fn fill values (448 is the largest finite; 0x7f is NaN).
    ts_array("ts_missing_float8_e4m3fn_fill448", "float8_e4m3fn", (10, 9), (4, 4), [BYTES], fill=448.0,
             writes=missing, note="missing chunks, fill 448", seed=95)
    ts_array("ts_missing_float8_e4m3fn_fillnan", "float8_e4m3fn", (10, 9), (4, 4), [BYTES], fill="NaN",
             writes=missing, note="missing chunks, fill NaN", seed=96)
    # Big-endian bytes, alone and after a transpose: zarrckpt must hand back little-endian C order.
    for i, d in enumerate(["int32", "float64", "uint16", "bfloat16", "float16"]):
        ts_array(f"ts_be_{d}", d, (6, 11), (4, 5), [{"name": "bytes", "configuration": {"endian": "big"}}, ZSTD],
                 note="big-endian bytes + zstd", seed=120 + i)
    for i, d in enumerate(["int32", "float64", "uint16", "bfloat16", "float16"]):
        ts_array(f"ts_transpose_be_{d}", d, (6, 11), (4, 5),
                 [{"name": "transpose", "configuration": {"order": [1, 0]}}, {"name": "bytes", "configuration": {"endian": "big"}}],
                 note="transpose [1,0] + big-endian bytes", seed=100 + i)
    ts_array("ts_3d_float16", "float16", (5, 6, 7), (2, 4, 3), [BYTES, ZSTD], note="3-d, zstd", seed=110)
    ts_array("ts_scalar_float64", "float64", (), (), [BYTES], note="0-d", seed=111)
    ts_array("ts_scalar_float8_e4m3fn", "float8_e4m3fn", (), (), [BYTES], note="0-d", seed=118)
    ts_array("ts_empty_int8", "int8", (0, 5), (2, 2), [BYTES], note="zero-size dimension", seed=112)
    ts_array("ts_size1_bfloat16", "bfloat16", (1,), (1,), [BYTES, CRC], note="size 1, crc32c", seed=113)
    ts_array("ts_v2key_int16", "int16", (9, 9), (4, 4), [BYTES],
             key_encoding={"name": "v2", "configuration": {"separator": "."}}, note="v2 chunk keys", seed=114)
    ts_array("ts_dotkey_uint64", "uint64", (9, 9), (4, 4), [BYTES],
             key_encoding={"name": "default", "configuration": {"separator": "."}}, note="default keys, '.'", seed=115)


# ---------------------------------------------------------------------------------------- zarr-python


def zp_array(name, dtype_name, shape, chunks, *, shards=None, compressors="auto", fill=0, writes=None, note="", seed=1):
    path = f"{OUT}/zarr-python/{name}"

    def go():
        arr = zarr.create_array(
            store=path, shape=shape, chunks=chunks, shards=shards, dtype=NUMPY_DTYPES[dtype_name],
            fill_value=fill, compressors=compressors, zarr_format=3, overwrite=True,
        )
        data = pattern(dtype_name, shape, seed)
        expected = np.empty(shape, dtype=NUMPY_DTYPES[dtype_name])
        expected[...] = np.asarray(arr.fill_value, dtype=NUMPY_DTYPES[dtype_name])
        boxes = writes if writes is not None else [tuple(slice(0, s) for s in shape)]
        for box in boxes:
            arr[box] = data[box]
            expected[box] = data[box]
        back = zarr.open_array(path, mode="r")[...]
        if to_bytes(back) != to_bytes(expected):
            FAILS.add(f"zarr-python does not read back its own array {name}")
        outer = shards if shards is not None else chunks
        if writes is not None and chunk_files(path) >= grid_count(shape, outer):
            FAILS.add(f"{name}: expected missing chunks, found {chunk_files(path)} chunk files")
        record(name, "zarr-python", path, dtype_name, expected, note)

    FAILS.guard(f"zarr-python write {name} ({dtype_name})", go)


def zarr_python_arrays():
    standard = [d for d in ALL_DTYPES if d not in ("bfloat16", "float8_e4m3fn", "float8_e5m2")]
    for i, d in enumerate(standard):
        zp_array(f"zp_plain_{d}", d, (13, 7), (4, 3), note="default codecs (zstd), partial edge chunks", seed=200 + i)
    variants = [
        ([zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")], "blosc"),
        ([zarr.codecs.GzipCodec(level=5)], "gzip"),
        (None, "uncompressed"),
        ("auto", "default (zstd)"),
    ]
    for i, d in enumerate(["float32", "int64", "uint16", "bool", "float16", "int8"]):
        comp, label = variants[i % len(variants)]
        zp_array(f"zp_shard_{d}", d, (37, 21), (4, 7), shards=(16, 14), compressors=comp,
                 note=f"sharded, {label}", seed=220 + i)
    missing = [(slice(0, 4), slice(0, 4)), (slice(8, 10), slice(4, 8))]
    for i, (d, fill) in enumerate([("int16", 3), ("float64", float("nan")), ("float32", -0.0), ("uint8", 255)]):
        zp_array(f"zp_missing_{d}", d, (10, 9), (4, 4), fill=fill, writes=missing, note=f"missing chunks, fill {fill}", seed=240 + i)
    zp_array("zp_missing_shard_float32", "float32", (37, 21), (4, 7), shards=(16, 14), fill=1.0,
             writes=[(slice(0, 5), slice(0, 7))], note="sharded, missing subchunks and shards, fill 1.0", seed=250)
    zp_array("zp_scalar_int32", "int32", (), (), note="0-d", seed=251)
    zp_array("zp_empty_float32", "float32", (0, 3), (2, 2), note="zero-size dimension", seed=252)

    # A data type zarrckpt does not support: read_array must refuse it with an error.
    def complex_array():
        path = f"{OUT}/zarr-python/zp_complex64"
        arr = zarr.create_array(store=path, shape=(3,), chunks=(2,), dtype="complex64", zarr_format=3, overwrite=True)
        arr[...] = np.arange(3, dtype=np.complex64)
        MANIFEST.append({"name": "zp_complex64", "writer": "zarr-python", "dir": path, "dtype": "complex64",
                         "shape": [3], "expected": None, "note": "unsupported data type",
                         "expect_error": "complex64"})

    FAILS.guard("zarr-python write zp_complex64", complex_array)


def main():
    os.makedirs(OUT, exist_ok=True)
    print(f"versions: {versions()}", flush=True)
    tensorstore_arrays()
    zarr_python_arrays()
    with open(f"{OUT}/manifest.json", "w") as f:
        json.dump({"arrays": MANIFEST}, f, indent=1)
    writers = {}
    for m in MANIFEST:
        writers[m["writer"]] = writers.get(m["writer"], 0) + 1
    FAILS.finish("WROTE " + " ".join(f"{k}={v}" for k, v in sorted(writers.items())))


if __name__ == "__main__":
    main()
