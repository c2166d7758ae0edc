"""Device memory through the Python package: the native device path on a simulated device
(host memory posing as a GPU, with deferred copies) everywhere, and CUDA tensors through
``zarrckpt.torch`` where a GPU is present (skipped, saying so, where none is)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import zarrckpt
import zarrckpt.torch as zt
from zarrckpt import _core, _native
from zarrckpt._core import Piece


def _strides(shape):
    s = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        s[d] = s[d + 1] * shape[d + 1]
    return s


def test_load_into_simulated_device_strips(tmp_path):
    full = np.arange(40 * 30, dtype=np.float32).reshape(40, 30)
    bias = np.arange(7, dtype=np.int64)
    _core.save(tmp_path / "c", [Piece("w", full.copy(), (40, 30)), Piece("b", bias.copy(), (7,))])
    dev = _native.Device.simulated()
    # Columns 10..25 of w into a [40, 20] device matrix at column 2: a column strip.
    base = dev.alloc(40 * 20 * 4)
    target = ("w", "float32", (40, 30), (0, 10), (40, 15), base + 2 * 4, (20, 1), None)
    host = np.zeros(7, dtype=np.int64)
    host_t = _core._piece_tuple(Piece("b", host, (7,)), load=True)
    rep = _native.load_device(str(tmp_path / "c"), [host_t], [target], None, None, {}, dev, 1024)
    got = np.frombuffer(dev.read(base, 40 * 20 * 4), dtype=np.float32).reshape(40, 20)
    want = np.zeros((40, 20), dtype=np.float32)
    want[:, 2:17] = full[:, 10:25]
    assert np.array_equal(got, want)
    assert np.array_equal(host, bias)
    assert rep["rounds"] > 1 and rep["device_bytes"] == 40 * 15 * 4
    assert dev.pinned_peak() <= 1024


def test_device_targets_need_a_device_and_valid_views(tmp_path):
    _core.save(tmp_path / "c", [Piece("w", np.zeros((4, 4), np.float32), (4, 4))])
    t = ("w", "float32", (4, 4), (0, 0), (4, 4), 4096, (4, 1), None)
    with pytest.raises(ValueError, match="need a device"):
        _native.load_device(str(tmp_path / "c"), [], [t], None, None, {}, None)
    dev = _native.Device.simulated()
    bad = ("w", "float32", (4, 4), (0, 0), (4, 4), dev.alloc(64), (0, 1), None)
    with pytest.raises(zarrckpt.ZarrckptError, match="overlaps"):
        _native.load_device(str(tmp_path / "c"), [], [bad], None, None, {}, dev)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_save_from_simulated_device(tmp_path, asynchronous):
    data = np.arange(6 * 9, dtype=np.int32).reshape(6, 9)
    dev = _native.Device.simulated()
    # The piece is rows 0..6, columns 0..9 of a [6, 12] device buffer (a strided view).
    base = dev.alloc(6 * 12 * 4)
    image = np.full((6, 12), -1, dtype=np.int32)
    image[:, :9] = data
    dev.write(base, image.tobytes())
    piece = ("x", "int32", (6, 9), (0, 0), (6, 9), base, (12, 1), 0)
    # One saver for host and device pieces, with one staging budget.
    saver = _native.Saver(None, staging_bytes=1 << 20)
    other = np.arange(3, dtype=np.float64)
    host = [_core._piece_tuple(Piece("y", other, (3,)), load=False)]
    if asynchronous:
        h = saver.save_async(str(tmp_path / "c"), host, None, {}, [piece], dev)
        dev.write(base, np.zeros((6, 12), np.int32).tobytes())  # fine once the call returned
        other[:] = 7  # host pieces are staged too
        h.wait()
        assert h.staged_bytes == 6 * 9 * 4 + 3 * 8
    else:
        saver.save(str(tmp_path / "c"), host, None, {}, [piece], dev)
    ck = zarrckpt.open(tmp_path / "c")
    assert np.array_equal(ck["x"].read(), data)
    assert np.array_equal(ck["y"].read(), np.arange(3, dtype=np.float64))


CUDA = torch.cuda.is_available() and _native.Device.cuda_available()


@pytest.mark.skipif(not CUDA, reason="no CUDA GPU on this machine (CPU-only CI)")
def test_cuda_state_dict_round_trip(tmp_path):
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "w": torch.randn(300, 257, device="cuda", generator=g),
        "b": torch.randn(257, device="cuda", generator=g).to(torch.bfloat16),
        "step": 3,
    }
    zt.save(state, tmp_path / "a")
    h = zt.async_save(state, tmp_path / "b")
    h.wait()
    for step in ("a", "b"):
        out = {
            "w": torch.zeros(300, 257, device="cuda"),
            "b": torch.zeros(257, device="cuda", dtype=torch.bfloat16),
            "step": 0,
        }
        zt.load(out, tmp_path / step)
        assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
        assert out["step"] == 3
    # A non-contiguous CUDA target: columns of a wider matrix.
    wide = torch.zeros(300, 300, device="cuda")
    view = wide[:, 10:267]
    _core.load(tmp_path / "a", [Piece("w", view, (300, 257))])
    assert torch.equal(view, state["w"]) and wide[:, :10].abs().sum() == 0
