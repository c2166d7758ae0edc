"""zarr-python reads zarrckpt checkpoints of every data type through zarrckpt.zarr_dtypes.

Checkpoints are written by the Rust side (the `zarrckpt` command line: `import` of a
safetensors file holding every data type, split unevenly over 3 in-process ranks, uncompressed,
zstd and blosc; `demo`, tensor-parallel splits over 4 ranks, checked against `export`), then
opened with `zarr.open_array` and compared byte for byte with what was written. Also: a control
showing zarr-python refuses the same arrays without the extension, zarr-python writing the
three types (read back by tensorstore when installed), fill values, and registration by the
start-up hook (zarr < 3.4.1) and by entry points (zarr >= 3.4.1) in a fresh interpreter.

The Rust binary: $ZARRCKPT_BIN, else target/release/zarrckpt (scripts/test.sh builds it), else
it is built with `cargo build --release --bin zarrckpt`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON_DIR = REPO / "python"
try:
    import zarrckpt  # noqa: F401  (installed, or put on the path by conftest)
except ImportError:  # the source tree (zarr_dtypes needs no native code)
    sys.path.insert(0, str(PYTHON_DIR))

zarr = pytest.importorskip("zarr")
import zarrckpt.zarr_dtypes as zd  # noqa: E402  (registers the data types)

# Zarr v3 name -> (safetensors name, numpy dtype)
DTYPES = {
    "bool": ("BOOL", np.dtype(np.bool_)),
    "int8": ("I8", np.dtype("<i1")),
    "int16": ("I16", np.dtype("<i2")),
    "int32": ("I32", np.dtype("<i4")),
    "int64": ("I64", np.dtype("<i8")),
    "uint8": ("U8", np.dtype("<u1")),
    "uint16": ("U16", np.dtype("<u2")),
    "uint32": ("U32", np.dtype("<u4")),
    "uint64": ("U64", np.dtype("<u8")),
    "float16": ("F16", np.dtype("<f2")),
    "bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16)),
    "float32": ("F32", np.dtype("<f4")),
    "float64": ("F64", np.dtype("<f8")),
    "float8_e4m3fn": ("F8_E4M3", np.dtype(ml_dtypes.float8_e4m3fn)),
    "float8_e5m2": ("F8_E5M2", np.dtype(ml_dtypes.float8_e5m2)),
}
EXTENSION = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
# Bit patterns every float tensor starts with: NaN payloads, signalling NaNs, -0, infinities,
# the largest finite values (448 for e4m3fn, where an IEEE e4m3 reader would see NaN / inf).
SPECIAL_BITS = {
    "bfloat16": [0x7FC0, 0xFFC1, 0x7F81, 0x8000, 0x7F80, 0xFF80, 0x7F7F, 0x0001, 0x3F80],
    "float8_e4m3fn": [0x7F, 0xFF, 0x7E, 0xFE, 0x80, 0x78, 0x01, 0x38],
    "float8_e5m2": [0x7C, 0xFC, 0x7D, 0x7E, 0xFF, 0x80, 0x7B, 0x01],
    "float16": [0x7E00, 0xFE01, 0x7C01, 0x8000, 0x7C00],
    "float32": [0x7FC00000, 0xFFC00001, 0x7F800001, 0x80000000],
    "float64": [0x7FF8000000000000, 0xFFF8000000000001, 0x8000000000000000],
}
SHAPES = [(37, 5), (11, 3, 4), (64,), (7, 9), (1, 6), (5, 2, 2, 3)]


# --- independent float8 decoders (not ml_dtypes): the values a correct reader must give -------


def decode_e4m3fn(b: int) -> float:
    s = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 0x7
    if e == 15 and m == 7:
        return math.nan
    if e == 0:
        return s * m / 8 * 2.0**-6
    return s * (1 + m / 8) * 2.0 ** (e - 7)


def decode_e5m2(b: int) -> float:
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


def decode_bf16(bits: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# --- helpers ---------------------------------------------------------------------------------


def zarrckpt_bin() -> str:
    env = os.environ.get("ZARRCKPT_BIN")
    if env:
        return env
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    for profile in ("release", "debug"):
        exe = target / profile / "zarrckpt"
        if exe.is_file():
            return str(exe)
    cargo = shutil.which("cargo")
    if cargo is None:
        pytest.fail("no zarrckpt binary (set ZARRCKPT_BIN or build it with cargo build --release)")
    subprocess.run([cargo, "build", "--release", "--bin", "zarrckpt"], cwd=REPO, check=True)
    return str(target / "release" / "zarrckpt")


def run_cli(*args: str) -> str:
    out = subprocess.run([zarrckpt_bin(), *args], capture_output=True, text=True)
    assert out.returncode == 0, f"zarrckpt {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    header, blobs, offset = {}, [], 0
    for name, (st_dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": st_dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(data)],
        }
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def read_safetensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    return {
        k: (v["dtype"], tuple(v["shape"]), body[v["data_offsets"][0] : v["data_offsets"][1]])
        for k, v in header.items()
        if k != "__metadata__"
    }


def tensor_bytes(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> bytes:
    dtype = DTYPES[name][1]
    n = math.prod(shape)
    if name == "bool":
        return rng.integers(0, 2, size=n, dtype=np.uint8).tobytes()
    raw = bytearray(rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8).tobytes())
    for i, bits in enumerate(SPECIAL_BITS.get(name, [])[:n]):
        raw[i * dtype.itemsize : (i + 1) * dtype.itemsize] = bits.to_bytes(dtype.itemsize, "little")
    return bytes(raw)


def sub_box(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(d // 3, max(d // 3 + 1, (2 * d) // 3 + 1)) for d in shape)


def index_of(root: Path) -> dict:
    return json.loads((root / "zarr.json").read_text())["attributes"]["zarrckpt"]["tensors"]


def check_array(root: Path, entry: dict, want: bytes, dtype_name: str) -> None:
    """Opens one array with zarr-python; checks data type, shape, all bytes, a sub-box and the
    values of float8 / bfloat16 elements against independent decoders."""
    path = entry["path"]
    shape = tuple(entry["shape"])
    label = f"{root.name}/{path} ({dtype_name})"
    arr = zarr.open_array(str(root / path), mode="r")
    assert arr.dtype == DTYPES[dtype_name][1], label
    assert tuple(arr.shape) == shape, label
    got = np.asarray(arr[...])  # 0-d arrays come back as numpy scalars
    assert got.dtype == DTYPES[dtype_name][1], label
    assert got.tobytes() == want, f"{label}: bytes differ"
    expect = np.frombuffer(want, dtype=DTYPES[dtype_name][1]).reshape(shape)
    box = sub_box(shape)
    assert np.asarray(arr[box]).tobytes() == np.ascontiguousarray(expect[box]).tobytes(), (
        f"{label}: box {box}"
    )
    if dtype_name in FLOAT8_TABLES:
        raw = np.frombuffer(want, dtype=np.uint8)
        with np.errstate(invalid="ignore"):
            values = got.reshape(-1).astype(np.float64)
        table = FLOAT8_TABLES[dtype_name][raw]
        same = (values == table) | (np.isnan(values) & np.isnan(table))
        assert same.all(), f"{label}: wrong float8 semantics at flat {int(np.argmin(same))}"
    if dtype_name == "bfloat16":
        with np.errstate(invalid="ignore"):
            values = got.reshape(-1).astype(np.float64)
            table = decode_bf16(np.frombuffer(want, dtype="<u2"))
        assert ((values == table) | (np.isnan(values) & np.isnan(table))).all(), label


# --- checkpoints written by the Rust command line --------------------------------------------


@pytest.fixture(scope="module")
def every_dtype_model(tmp_path_factory) -> Path:
    rng = np.random.default_rng(11)
    tensors = {}
    for i, name in enumerate(DTYPES):
        shape = SHAPES[i % len(SHAPES)]
        tensors[f"layers.{i}.{name}"] = (DTYPES[name][0], shape, tensor_bytes(name, shape, rng))
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    write_safetensors(path, tensors)
    return path


@pytest.mark.parametrize("compression", ["none", "zstd", "blosc"])
def test_zarr_python_reads_every_dtype_of_a_cli_checkpoint(
    every_dtype_model, tmp_path, compression
):
    root = tmp_path / "ckpt"
    run_cli(
        "import",
        str(every_dtype_model),
        "--out",
        str(root),
        "--ranks",
        "3",
        "--compression",
        compression,
    )
    tensors = read_safetensors(every_dtype_model)
    index = index_of(root)
    assert set(index) == set(tensors)
    seen = set()
    for key, (st_dtype, shape, data) in tensors.items():
        dtype_name = index[key]["dtype"]
        assert DTYPES[dtype_name][0] == st_dtype
        assert tuple(index[key]["shape"]) == shape
        check_array(root, index[key], data, dtype_name)
        seen.add(dtype_name)
    assert seen == set(DTYPES)
    # The same arrays through the root group, as a user browsing the checkpoint would.
    group = zarr.open_group(str(root), mode="r")
    for key, (_, _, data) in tensors.items():
        node = group[index[key]["path"]]
        assert isinstance(node, zarr.Array) and node[...].tobytes() == data, key


def test_zarr_python_reads_a_tensor_parallel_demo_checkpoint(tmp_path):
    """`zarrckpt demo`: bf16 weights split by rows and by columns over 4 ranks (chunks of both
    orientations), fp32 moments, an int64 step; compared with the Rust reader's `export`."""
    root = tmp_path / "demo"
    run_cli("demo", "--dir", str(root), "--size", "1000000")
    run_cli("export", str(root), "--out", str(tmp_path / "demo.safetensors"))
    tensors = read_safetensors(tmp_path / "demo.safetensors")
    index = index_of(root)
    assert set(index) == set(tensors) and len(tensors) > 5
    dtypes = set()
    for key, (_, _, data) in tensors.items():
        check_array(root, index[key], data, index[key]["dtype"])
        dtypes.add(index[key]["dtype"])
    assert "bfloat16" in dtypes
    chunks = {
        tuple(e["chunk_shape"]) != tuple(e["shape"])
        for e in index.values()
        if e["dtype"] == "bfloat16"
    }
    assert True in chunks  # several shards per bf16 tensor


TORCH_DTYPES = {
    "bool": "bool", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float64",
    "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
}  # fmt: skip


def test_zarr_python_reads_every_dtype_saved_through_the_python_api(tmp_path):
    """torch tensors of every dtype saved by zarrckpt._core (the Rust API underneath; rows in
    two boxes and a flat range, as ranks would hold them), read with zarr.open_array."""
    torch = pytest.importorskip("torch")
    core = pytest.importorskip("zarrckpt._core")
    rng = np.random.default_rng(3)
    pieces, want = [], {}
    for name, attr in TORCH_DTYPES.items():
        shape = (9, 5)
        data = tensor_bytes(name, shape, rng)
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, attr))
        t = t.reshape(shape)
        key = f"api/{name}"
        want[key] = (name, data)
        pieces.append(core.Piece(key, t[:4].clone(), shape, global_offset=(0, 0)))
        pieces.append(core.Piece(key, t[4:7].clone(), shape, global_offset=(4, 0)))
        pieces.append(core.Piece(key, t[7:].reshape(-1).clone(), shape, flat_range=(35, 45)))
    root = tmp_path / "api"
    core.save(root, pieces)
    index = index_of(root)
    for key, (name, data) in want.items():
        assert index[key]["dtype"] == name
        check_array(root, index[key], data, name)


def test_without_the_extension_zarr_python_refuses_these_arrays(every_dtype_model, tmp_path):
    """The control: the same reads fail once the three data types are unregistered."""
    root = tmp_path / "ckpt"
    run_cli("import", str(every_dtype_model), "--out", str(root), "--ranks", "2")
    tensors = read_safetensors(every_dtype_model)
    index = index_of(root)
    registry = zarr.core.dtype.data_type_registry
    registry._lazy_load()  # entry points first (zarr >= 3.4.1 would load them on the next call)
    zd.unregister()
    try:
        for key, (_, _, data) in tensors.items():
            name = index[key]["dtype"]
            if name in EXTENSION:
                with pytest.raises(
                    ValueError, match=f"No Zarr data type found that matches '{name}'"
                ):
                    zarr.open_array(str(root / index[key]["path"]), mode="r")
            else:
                check_array(root, index[key], data, name)
    finally:
        zd.register()
    for key, (_, _, data) in tensors.items():
        check_array(root, index[key], data, index[key]["dtype"])


def test_float8_e4m3_is_not_float8_e4m3fn():
    """The Zarr registry's float8_e4m3 has infinities; its bytes must never be read as
    float8_e4m3fn (and vice versa): the names select different types."""
    from zarr.core.dtype import data_type_registry

    assert data_type_registry.match_json("float8_e4m3fn", zarr_format=3) == zd.Float8E4M3FN()
    for cls in zd.DATA_TYPES:
        with pytest.raises(ValueError):
            cls.from_json("float8_e4m3", zarr_format=3)
    # 448 is the largest e4m3fn value; an IEEE e4m3 reader would see NaN for 0x7e.
    assert float(np.array([0x7E], dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)[0]) == 448.0


# --- writing with zarr-python ----------------------------------------------------------------


@pytest.mark.parametrize("name", EXTENSION)
def test_zarr_python_writes_the_three_types(tmp_path, name):
    dtype = DTYPES[name][1]
    shape = (12, 10)
    rng = np.random.default_rng(5)
    data = np.frombuffer(tensor_bytes(name, shape, rng), dtype=dtype).reshape(shape)
    path = tmp_path / f"{name}.zarr"
    arr = zarr.create_array(
        store=str(path), shape=shape, dtype=dtype, shards=(6, 10), chunks=(3, 5), compressors=None
    )
    arr[...] = data
    meta = json.loads((path / "zarr.json").read_text())
    assert meta["data_type"] == name
    # The fill values zarrckpt writes (spec section 6.3): 0.0 for bfloat16, "0x00" for float8.
    assert meta["fill_value"] == (0.0 if name == "bfloat16" else "0x00")
    serializer = meta["codecs"][0]["configuration"]["codecs"][0]
    assert serializer["name"] == "bytes"
    if name == "bfloat16":
        assert serializer["configuration"]["endian"] == "little"
    back = zarr.open_array(str(path), mode="r")[...]
    assert back.dtype == dtype and back.tobytes() == data.tobytes()
    # Another reader agrees (tensorstore names the same data types).
    ts = pytest.importorskip("tensorstore")
    t = ts.open(
        {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}, read=True
    ).result()
    assert t.dtype.name == name
    assert np.ascontiguousarray(t.read().result()).tobytes() == data.tobytes()


@pytest.mark.parametrize(
    ("name", "fill", "bits"),
    [
        ("bfloat16", "0x3f80", 0x3F80),
        ("bfloat16", "NaN", 0x7FC0),
        ("bfloat16", "0xffc1", 0xFFC1),
        ("bfloat16", -2.5, 0xC020),
        ("float8_e4m3fn", "0x7e", 0x7E),
        ("float8_e4m3fn", "NaN", 0x7F),
        ("float8_e5m2", "-Infinity", 0xFC),
        ("float8_e5m2", 1.5, 0x3E),
    ],
)
def test_fill_values_of_unwritten_chunks(tmp_path, name, fill, bits):
    dtype = DTYPES[name][1]
    path = tmp_path / "a.zarr"
    zarr.create_array(store=str(path), shape=(4, 4), dtype=dtype, chunks=(2, 2), fill_value=fill)
    got = zarr.open_array(str(path), mode="r")[...]
    width = f"<u{dtype.itemsize}"
    assert (got.view(width) == bits).all(), got.view(width)


# --- data type and fill value JSON -----------------------------------------------------------


@pytest.mark.parametrize("cls", zd.DATA_TYPES)
def test_every_bit_pattern_survives_fill_value_json(cls):
    """to_json_scalar -> JSON text -> from_json_scalar keeps the bits of every element value,
    NaN payloads and -0 included."""
    dt = cls()
    width = dt.item_size
    for bits in range(1 << (8 * width)):
        value = np.array([bits], dtype=f"<u{width}").view(dt.to_native_dtype())[0]
        text = json.dumps(dt.to_json_scalar(value, zarr_format=3))
        back = dt.from_json_scalar(json.loads(text), zarr_format=3)
        got = int(np.array([back], dtype=dt.to_native_dtype()).view(f"<u{width}")[0])
        assert got == bits, (cls.__name__, hex(bits), text, hex(got))


def test_fill_value_json_forms():
    bf, e4, e5 = zd.BFloat16(), zd.Float8E4M3FN(), zd.Float8E5M2()
    for v in (0.0, 0, "0x0000", "0e0"):
        assert float(bf.from_json_scalar(v, zarr_format=3)) == 0.0
    assert float(e4.from_json_scalar("0x00", zarr_format=3)) == 0.0
    assert float(e5.from_json_scalar(0.0, zarr_format=3)) == 0.0
    assert math.isinf(float(e5.from_json_scalar("Infinity", zarr_format=3)))
    assert float(bf.from_json_scalar("-Infinity", zarr_format=3)) == -math.inf
    with pytest.raises(ValueError, match="no infinities"):
        e4.from_json_scalar("Infinity", zarr_format=3)
    with pytest.raises(ValueError, match="out of range"):
        e4.cast_scalar(1000.0)
    with pytest.raises(ValueError, match="hex digits"):
        e4.from_json_scalar("0x000", zarr_format=3)
    with pytest.raises(ValueError, match="hex digits"):
        bf.from_json_scalar("0x00", zarr_format=3)
    for bad in (True, None, [0], "zero"):
        with pytest.raises(TypeError):
            bf.from_json_scalar(bad, zarr_format=3)
    assert bf.to_json_scalar(1.0, zarr_format=3) == 1.0
    assert e4.to_json_scalar(448.0, zarr_format=3) == "0x7e"
    assert e5.to_json_scalar(0, zarr_format=3) == "0x00"
    assert bf.to_json(zarr_format=3) == "bfloat16"
    with pytest.raises(ValueError, match="Zarr v3 arrays only"):
        bf.to_json(zarr_format=2)


def test_native_dtype_matching():
    from zarr.core.dtype import data_type_registry

    for name in EXTENSION:
        dt = data_type_registry.match_dtype(DTYPES[name][1])
        assert dt.to_json(zarr_format=3) == name
        assert dt.to_native_dtype() == DTYPES[name][1]
    # Two-byte and one-byte void, float16 and uint8 stay what they were.
    assert data_type_registry.match_dtype(np.dtype("<f2")).to_json(zarr_format=3) == "float16"
    assert data_type_registry.match_dtype(np.dtype("u1")).to_json(zarr_format=3) == "uint8"
    assert not isinstance(data_type_registry.match_dtype(np.dtype("V2")), zd.DATA_TYPES)
    with pytest.raises(ValueError, match="big endian"):
        zd.BFloat16(endianness="big").to_native_dtype()


# --- registration in a fresh interpreter: start-up hook and entry points ---------------------

ENTRY_POINTS = """\
[zarr.data_type]
bfloat16 = zarrckpt.zarr_dtypes:BFloat16
float8_e4m3fn = zarrckpt.zarr_dtypes:Float8E4M3FN
float8_e5m2 = zarrckpt.zarr_dtypes:Float8E5M2
"""


def zarr_version() -> tuple[int, ...]:
    sys.path.insert(0, str(PYTHON_DIR))
    try:
        import _zarrckpt_zarr_hook as hook
    finally:
        sys.path.remove(str(PYTHON_DIR))
    return hook._version_tuple(zarr.__version__)


def installed_distribution():
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        return distribution("zarrckpt")
    except PackageNotFoundError:
        return None


def package_parent() -> str:
    """The directory holding the zarrckpt package this test imported."""
    return str(Path(zd.__file__).resolve().parents[1])


def fresh_interpreter_reads(
    root: Path, site_dir: Path | None, hook: bool
) -> subprocess.CompletedProcess:
    """A new python that never imports zarrckpt itself: `import zarr`, then open the three
    arrays of extension types. `site_dir` is processed like site-packages (.pth files)."""
    index = index_of(root)
    paths = [str(root / e["path"]) for e in index.values() if e["dtype"] in EXTENSION]
    code = textwrap.dedent(
        f"""
        import site, sys
        if {str(site_dir)!r} != "None":
            site.addsitedir({str(site_dir)!r})
        import zarr
        for p in {paths!r}:
            a = zarr.open_array(p, mode="r")
            a[...]
            print(p.rsplit("/", 1)[-1], a.dtype)
        print("explicitly imported:", "zarrckpt.zarr_dtypes" in sys.modules)
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = package_parent()
    env["ZARRCKPT_NO_ZARR_HOOK"] = "0" if hook else "1"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


@pytest.fixture(scope="module")
def small_checkpoint(every_dtype_model, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("small") / "ckpt"
    run_cli("import", str(every_dtype_model), "--out", str(root), "--ranks", "2")
    return root


@pytest.fixture()
def simulated_install(tmp_path) -> Path:
    """A site directory as `pip install zarrckpt` leaves it: the .pth start-up hook and a
    distribution declaring the entry points (the package itself comes from PYTHONPATH)."""
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(PYTHON_DIR / "zarrckpt_zarr_dtypes.pth", site)
    shutil.copy(PYTHON_DIR / "_zarrckpt_zarr_hook.py", site)
    dist = site / "zarrckpt_simulated-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: zarrckpt-simulated\nVersion: 0.0\n"
    )
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


def test_installed_package_registers_without_an_import(small_checkpoint, simulated_install):
    out = fresh_interpreter_reads(small_checkpoint, simulated_install, hook=True)
    assert out.returncode == 0, out.stderr
    for name in EXTENSION:
        assert f" {name}\n" in out.stdout, out.stdout


def test_entry_points_alone(small_checkpoint, simulated_install):
    """With the hook off, zarr >= 3.4.1 loads the entry points itself; older versions collect
    them and never load them (why the hook exists)."""
    out = fresh_interpreter_reads(small_checkpoint, simulated_install, hook=False)
    if zarr_version() >= (3, 4, 1):
        assert out.returncode == 0, out.stderr
        assert "explicitly imported: True" in out.stdout  # loaded by zarr through the entry point
    else:
        assert out.returncode != 0 and "No Zarr data type found that matches" in out.stderr, out


def test_nothing_installed_nothing_registered(small_checkpoint):
    if installed_distribution() is not None:
        pytest.skip("zarrckpt is installed: see test_the_real_installation")
    out = fresh_interpreter_reads(small_checkpoint, None, hook=True)
    assert out.returncode != 0 and "No Zarr data type found that matches" in out.stderr, out


def test_the_real_installation(small_checkpoint):
    """When the zarrckpt distribution is installed (pip / maturin), its metadata declares the
    entry points and plain `import zarr` reads the three types."""
    dist = installed_distribution()
    if dist is None:
        pytest.skip("the zarrckpt distribution is not installed (source tree on PYTHONPATH)")
    eps = {e.name: e.value for e in dist.entry_points if e.group == "zarr.data_type"}
    assert eps == {
        "bfloat16": "zarrckpt.zarr_dtypes:BFloat16",
        "float8_e4m3fn": "zarrckpt.zarr_dtypes:Float8E4M3FN",
        "float8_e5m2": "zarrckpt.zarr_dtypes:Float8E5M2",
    }
    direct = dist.read_text("direct_url.json") or ""
    if json.loads(direct or "{}").get("dir_info", {}).get("editable"):
        if zarr_version() < (3, 4, 1):
            pytest.skip(
                "editable install (maturin develop): the start-up hook is only in wheels "
                "(pip install ./python), and this zarr does not load entry points"
            )
    out = fresh_interpreter_reads(small_checkpoint, None, hook=True)
    assert out.returncode == 0, out.stderr
