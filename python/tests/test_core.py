"""zarrckpt._core and the extension on one rank: every dtype bit for bit, boxes and flat
ranges, objects, zero copies, the GIL, and errors mapped to Python exceptions. The save / load /
read tests run on a local directory and on ``s3://`` (fixture ``ckpt_root``, ``conftest.py``)."""

from __future__ import annotations

import os
import threading
import time

import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import is_local

import zarrckpt
from zarrckpt import _core
from zarrckpt._core import Object, Piece

TORCH_DTYPES = [
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def random_tensor(shape, dtype, seed=0):
    """Random bit patterns of ``dtype`` (every pattern, NaNs included; bool 0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) if shape else 1
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exactly(ckpt_root, dtype):
    full = random_tensor((6, 5), dtype, seed=hash(str(dtype)) % 1000)
    scalar = random_tensor((), dtype, seed=7)
    empty = random_tensor((0, 3), dtype)
    # Saved as two row blocks from one rank, loaded as column blocks and whole.
    pieces = [
        Piece("w", full[:4].contiguous(), (6, 5), (0, 0)),
        Piece("w", full[4:].contiguous(), (6, 5), (4, 0)),
        Piece("s", scalar, ()),
        Piece("e", empty, (0, 3)),
    ]
    report = _core.save(ckpt_root / "c", pieces)
    assert report["data_bytes"] == full.numel() * full.element_size() + scalar.element_size()
    left = torch.zeros((6, 2), dtype=dtype)
    right = torch.zeros((6, 3), dtype=dtype)
    s = torch.zeros((), dtype=dtype)
    e = torch.zeros((0, 3), dtype=dtype)
    _core.load(
        ckpt_root / "c",
        [
            Piece("w", left, (6, 5), (0, 0)),
            Piece("w", right, (6, 5), (0, 2)),
            Piece("s", s, ()),
            Piece("e", e, (0, 3)),
        ],
    )
    assert same_bits(left, full[:, :2]) and same_bits(right, full[:, 2:])
    assert same_bits(s, scalar) and same_bits(e, empty)
    # The reader gives the same bits, as numpy (ml_dtypes) and as torch.
    ck = zarrckpt.open(ckpt_root / "c")
    assert ck.tensors["w"].dtype == _core.dtype_name(dtype)
    t = ck["w"].torch[...]
    assert same_bits(t, full)
    a = ck["w"][...]
    assert a.dtype == zarrckpt.reader.numpy_dtype(_core.dtype_name(dtype))
    assert a.tobytes() == full.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_numpy_arrays_are_pieces_too(ckpt_root):
    a = np.arange(24, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(4, 6)
    _core.save(ckpt_root / "c", [Piece("a", a, (4, 6))])
    out = np.zeros((2, 6), dtype=ml_dtypes.bfloat16)
    _core.load(ckpt_root / "c", [Piece("a", out, (4, 6), (2, 0))])
    assert out.tobytes() == a[2:].tobytes()
    with pytest.raises(zarrckpt.InvalidArgumentError, match="read-only"):
        ro = np.zeros((4, 6), dtype=ml_dtypes.bfloat16)
        ro.flags.writeable = False
        _core.load(ckpt_root / "c", [Piece("a", ro, (4, 6))])


def test_flat_ranges_save_and_load_across_layouts(ckpt_root):
    full = torch.arange(7 * 9, dtype=torch.float32).reshape(7, 9)
    flat = full.flatten()
    cuts = [0, 5, 23, 40, 63]  # ZeRO-style shares, crossing rows
    pieces = [
        Piece("w", flat[a:b].clone(), (7, 9), flat_range=(a, b))
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    _core.save(ckpt_root / "c", pieces)
    box = torch.zeros(3, 4)
    share = torch.zeros(30)
    _core.load(
        ckpt_root / "c",
        [Piece("w", box, (7, 9), (2, 5)), Piece("w", share, (7, 9), flat_range=(11, 41))],
    )
    assert torch.equal(box, full[2:5, 5:9])
    assert torch.equal(share, flat[11:41])


def test_load_is_in_place_and_copies_nothing(ckpt_root):
    w = torch.randn(64, 64)
    _core.save(ckpt_root / "c", [Piece("w", w, (64, 64))])
    target = torch.zeros(64, 64)
    ptr = target.data_ptr()
    _core.load(ckpt_root / "c", [Piece("w", target, (64, 64))])
    assert target.data_ptr() == ptr and torch.equal(target, w)
    # A view into a bigger buffer is filled where it lies.
    buf = torch.zeros(2, 64, 64)
    _core.load(ckpt_root / "c", [Piece("w", buf[1], (64, 64))])
    assert torch.equal(buf[1], w) and not buf[0].any()


def test_objects_json_bytes_and_scopes(ckpt_root):
    objs = [
        Object("config", {"lr": 1e-3, "name": "gpt ✓", "layers": [1, 2, 3], "none": None}),
        Object("iteration", 1200),
        Object("rng", b"\x00\x01\xff", scope="per_rank"),
        Object("stage", {"pp": 0}, scope="sharded", grid=(1,), index=(0,)),
    ]
    with pytest.raises(zarrckpt.InvalidArgumentError, match="declared twice"):
        _core.save(ckpt_root / "dup", [], objs + [Object("iteration", 1200)])
    with pytest.raises(zarrckpt.PlanError, match=r"no rank declares shard \[1\]"):
        _core.save(ckpt_root / "grid", [], [Object("s", 0, scope="sharded", grid=(2,), index=(0,))])
    _core.save(ckpt_root / "c", [], objs + [Object("other", 1.5)])
    rep = _core.load(
        ckpt_root / "c",
        [],
        [
            "config",
            Object("iteration"),
            Object("rng", scope="per_rank"),
            Object("stage", scope="sharded", grid=(1,), index=(0,)),
        ],
    )
    assert rep["objects"] == [objs[0].value, 1200, b"\x00\x01\xff", {"pp": 0}]
    ck = zarrckpt.open(ckpt_root / "c")
    assert ck.objects["rng"].scope == "per_rank" and ck.objects["rng"].encoding == "bytes"
    assert ck.object("rng", rank=0) == b"\x00\x01\xff"
    assert ck.object("other") == 1.5
    assert ck.objects["stage"].grid == (1,)
    with pytest.raises(zarrckpt.MismatchError, match="`stage`"):
        _core.load(ckpt_root / "c", [], [Object("stage", scope="per_rank")])


def test_values_that_are_not_json_are_refused(tmp_path):
    for bad in (float("nan"), {"x": object()}, {1: "int key"} if False else {"t": torch.ones(1)}):
        with pytest.raises(zarrckpt.InvalidArgumentError, match="nothing is pickled"):
            _core.save(tmp_path / "c", [], {"v": bad})


def test_user_metadata_and_compression(ckpt_root):
    w = torch.zeros(256, 256)
    _core.save(
        ckpt_root / "c",
        [Piece("w", w, (256, 256))],
        compression="zstd",
        user_metadata={"step": 7, "run": "a"},
    )
    ck = zarrckpt.open(ckpt_root / "c")
    assert ck.metadata == {"step": 7, "run": "a"}
    assert ck.tensors["w"].compression == "zstd"
    if is_local(ckpt_root):
        files = (ckpt_root / "c").rglob("*")
        assert sum(f.stat().st_size for f in files if f.is_file()) < w.nbytes / 10
    assert torch.equal(ck["w"].torch[...], w)


def test_reader_reads_only_the_chunks_it_needs(ckpt_root):
    full = torch.randn(64, 32)
    _core.save(
        ckpt_root / "c",
        [
            Piece("w", full[i * 16 : (i + 1) * 16].contiguous(), (64, 32), (i * 16, 0))
            for i in range(4)
        ],
    )
    ck = zarrckpt.open(ckpt_root / "c")
    info = ck.tensors["w"]
    assert info.num_chunks == 4 and info.chunk_shape == (16, 32)
    lazy = ck["w"]
    _, rep = lazy.read_box([3, 0], [10, 32])  # inside the first shard
    assert rep["loaded_bytes"] == 10 * 32 * 4
    assert rep["bytes_read"] < full.nbytes / 4 + 4096
    _, rep_all = lazy.read_box([0, 0], [64, 32])
    assert rep_all["bytes_read"] >= full.nbytes


INDEXES = [
    (slice(None),),
    (3,),
    (-1,),
    (slice(2, 50, 3),),
    (slice(None, None, -1),),
    (slice(40, 5, -7), slice(1, 30, 4)),
    (Ellipsis, 5),
    (None, 4, slice(2, 9)),
    (slice(5, 5),),
    (slice(-10, None), -3),
    (Ellipsis,),
    (0, 0),
]


@pytest.mark.parametrize("index", INDEXES, ids=repr)
def test_reader_indexing_matches_numpy(ckpt_root, index):
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    path = ckpt_root / "c"
    _core.save(
        path,
        [
            Piece("w", torch.from_numpy(full[i * 16 : (i + 1) * 16].copy()), (64, 32), (i * 16, 0))
            for i in range(4)
        ],
    )
    ck = zarrckpt.open(path)
    got = ck["w"][index]
    np.testing.assert_array_equal(got, full[index])
    got_t = ck["w"].torch[index]
    np.testing.assert_array_equal(got_t.numpy(), full[index])
    with pytest.raises(IndexError):
        ck["w"][0, 0, 0]
    with pytest.raises(IndexError):
        ck["w"][64]


def test_gil_is_released_during_io(tmp_path):
    # 128 MiB of shards, loaded in a thread with one I/O thread: meanwhile the main thread
    # keeps running Python, with no gap near the load's duration.
    w = torch.randn(32 * 1024 * 1024 // 4 * 4).reshape(4, -1)
    _core.save(
        tmp_path / "c", [Piece("w", w[i : i + 1].clone(), tuple(w.shape), (i, 0)) for i in range(4)]
    )
    out = torch.empty_like(w)
    done = threading.Event()
    spans: list[float] = []

    def work():
        t0 = time.monotonic()
        for _ in range(6):
            _core.load(tmp_path / "c", [Piece("w", out, tuple(w.shape))], io_threads=1)
        spans.append(time.monotonic() - t0)
        done.set()

    th = threading.Thread(target=work)
    stamps = [time.monotonic()]
    th.start()
    while not done.is_set():
        stamps.append(time.monotonic())
    th.join()
    assert torch.equal(out, w)
    gaps = np.diff(stamps)
    # Holding the GIL through the six loads would stall this loop for their whole duration.
    assert gaps.max() < 0.5 * spans[0], (gaps.max(), spans[0])


def test_errors_keep_the_core_message(tmp_path):
    path = tmp_path / "c"
    _core.save(path, [Piece("dec/w", torch.zeros(4, 3, dtype=torch.bfloat16), (4, 3))], {"it": 1})
    # dtype mismatch: nothing is cast silently
    with pytest.raises(zarrckpt.MismatchError) as e:
        _core.load(path, [Piece("dec/w", torch.zeros(4, 3), (4, 3))])
    assert e.value.kind == "DtypeMismatch"
    assert "`dec/w`" in str(e.value) and str(path) in str(e.value) and "bfloat16" in str(e.value)
    assert e.value.details == {"rank": 0, "key": "dec/w", "path": str(path)}
    assert isinstance(e.value, ValueError)
    # ... unless asked for
    t = torch.ones(4, 3)
    _core.load(path, [Piece("dec/w", t, (4, 3), cast=True)])
    assert not t.any()
    with pytest.raises(zarrckpt.MismatchError, match=r"global shape \[5, 3\]") as e:
        _core.load(path, [Piece("dec/w", torch.zeros(5, 3, dtype=torch.bfloat16), (5, 3))])
    assert e.value.kind == "ShapeMismatch"
    with pytest.raises(zarrckpt.KeyMismatchError, match="`nope`") as e:
        _core.load(path, [Piece("nope", torch.zeros(1), (1,))], strict="raise_unexpected")
    assert e.value.kind == "UnexpectedKeys" and e.value.details["keys"] == ["nope"]
    rep = _core.load(path, [Piece("nope", torch.zeros(1), (1,))], strict="return_unexpected")
    assert rep["unexpected"] == ["nope"]
    with pytest.raises(zarrckpt.KeyMismatchError, match="requested by no rank"):
        _core.load(path, [], strict="raise_all")
    with pytest.raises(zarrckpt.StorageError, match="not a zarrckpt checkpoint") as e:
        _core.load(tmp_path / "missing", [])
    assert isinstance(e.value, OSError)
    with pytest.raises(zarrckpt.InvalidArgumentError, match="dot segment"):
        _core.save(tmp_path / "d", [Piece("a/../b", torch.zeros(1), (1,))])
    with pytest.raises(
        zarrckpt.InvalidArgumentError, match=r"`w`: region \[1..5, 0..3\] is out of bounds"
    ):
        _core.save(tmp_path / "d", [Piece("w", torch.zeros(4, 3), (4, 3), (1, 0))])
    with pytest.raises(zarrckpt.PlanError, match="`w`"):
        _core.save(tmp_path / "d", [Piece("w", torch.zeros(2, 3), (4, 3))])  # rows 2..4 missing
    with pytest.raises(zarrckpt.InvalidArgumentError, match="not supported"):
        _core.save(tmp_path / "d", [Piece("w", torch.zeros(2, dtype=torch.complex64), (2,))])
    with pytest.raises(zarrckpt.InvalidArgumentError, match="not contiguous"):
        _core.save(tmp_path / "d", [Piece("w", torch.zeros(3, 4).T, (4, 3))])
    buf = torch.zeros(10)
    with pytest.raises(zarrckpt.InvalidArgumentError, match="overlap"):
        _core.load(path, [Piece("a", buf[:6], (6,)), Piece("b", buf[4:], (6,))])
    with pytest.raises(ValueError, match="unknown save option `overwrit`"):
        _core.save(tmp_path / "d", [], overwrit=True)
    # saving over a checkpoint needs overwrite=True; never over another kind of directory
    with pytest.raises(zarrckpt.StorageError):
        _core.save(path, [Piece("x", torch.zeros(1), (1,))])
    other = tmp_path / "not-a-checkpoint"
    other.mkdir()
    (other / "precious.txt").write_text("keep me")
    with pytest.raises(zarrckpt.StorageError):
        _core.save(other, [Piece("x", torch.zeros(1), (1,))], overwrite=True)
    assert (other / "precious.txt").read_text() == "keep me"


def test_corruption_is_an_error_naming_key_chunk_and_file(tmp_path):
    path = tmp_path / "c"
    _core.save(path, [Piece("w", torch.randn(8, 8), (8, 8))])
    shards = [
        p
        for p in path.rglob("*")
        if p.is_file() and p.name != "zarr.json" and "w" in str(p.relative_to(path))
    ]
    assert shards
    shard = shards[0]
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(zarrckpt.StorageError) as e:
        _core.load(path, [Piece("w", torch.zeros(8, 8), (8, 8))])
    msg = str(e.value)
    assert "`w`" in msg and str(shard) in msg and "chunk" in msg
    report = zarrckpt.open(path).verify()
    assert report["problems"] and str(shard) in report["problems"][0]


class FailingComm:
    """Two ranks, of which this one's communicator raises: the error comes back as a
    CommError chained to the original exception."""

    rank, world_size = 0, 2

    def all_gather(self, data):
        raise RuntimeError("the network is down")

    broadcast = barrier = exchange = all_gather


def test_communicator_failures_are_chained(tmp_path):
    with pytest.raises(zarrckpt.CommError, match="the network is down") as e:
        _core.save(tmp_path / "c", [Piece("w", torch.zeros(2), (2,))], comm=FailingComm())
    assert isinstance(e.value.__cause__, RuntimeError)
    assert "rank 0" in str(e.value)


def test_async_save_handle(tmp_path):
    w = torch.arange(1 << 20, dtype=torch.float32)
    h = _core.async_save(tmp_path / "c", [Piece("w", w, tuple(w.shape))], {"it": 3})
    w.zero_()  # staged during the call: what is saved is what it held then
    rep = h.wait()
    assert h.done() and h.exception() is None and rep["data_bytes"] == w.nbytes
    ck = zarrckpt.open(tmp_path / "c")
    assert torch.equal(ck["w"].torch[...], torch.arange(1 << 20, dtype=torch.float32))
    assert ck.object("it") == 3
    # The same structure again reuses the plan; a failure comes from wait()/exception().
    h2 = _core.async_save(
        tmp_path / "c", [Piece("w", w, tuple(w.shape))], {"it": 4}, overwrite=True
    )
    assert h2.wait()["plan_reused"]
    bad = tmp_path / "file"
    bad.write_text("x")
    h3 = _core.async_save(bad, [Piece("w", w, tuple(w.shape))], {"it": 5})
    err = h3.exception()
    assert isinstance(err, zarrckpt.StorageError) and str(bad) in str(err)
    with pytest.raises(zarrckpt.StorageError):
        h3.wait()
    assert zarrckpt.open(tmp_path / "c").object("it") == 4


def test_import_does_not_need_torch():
    # The reader and _core work on numpy alone; torch is imported lazily.
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None\nimport zarrckpt, zarrckpt._core\nprint('ok')"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ}
    )
    assert out.stdout.strip() == "ok", out.stderr
