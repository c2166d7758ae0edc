"""Saving straight to an object store from Python: ``zarrckpt._core.save("s3://...", ...)`` and
``zarrckpt.torch.save`` against a
real S3 server on loopback (SeaweedFS, started by the ``s3_server`` fixture). The committed
generation is read back with tensorstore, which knows nothing of zarrckpt beyond the pointer."""

import json

import numpy as np
import pytest
from s3_server import BUCKET

from zarrckpt import _core


def _env(server, monkeypatch):
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)


def _kvstore(server, path: str) -> dict:
    return {
        "driver": "s3",
        "bucket": BUCKET,
        "path": path,
        "endpoint": server.endpoint,
        "aws_region": "us-east-1",
        "aws_credentials": {"type": "environment"},
    }


def test_save_to_an_s3_url_commits_a_generation_that_tensorstore_reads(s3_server, monkeypatch):
    ts = pytest.importorskip("tensorstore")
    _env(s3_server, monkeypatch)
    prefix = "py/step-1"
    url = f"s3://{BUCKET}/{prefix}"
    a = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    report = _core.save(url, [_core.Piece("w", a, a.shape)], {"step": 1})
    assert report["tensors"] == 1 and report["chunks_written"] >= 1
    # A second save without overwrite is refused, naming the URL; with it, a new generation.
    with pytest.raises(Exception, match="already exists"):
        _core.save(url, [_core.Piece("w", a, a.shape)])
    b = a * 2
    _core.save(url, [_core.Piece("w", b, b.shape)], overwrite=True)

    kv = ts.KvStore.open(_kvstore(s3_server, prefix + "/")).result()
    pointer = json.loads(kv.read("zarrckpt.pointer.json").result().value)
    generation = pointer["generation"]
    manifest = json.loads(
        kv.read(f"generations/{generation}/zarrckpt.manifest.json").result().value
    )
    keys = {o["key"] for o in manifest["objects"]}
    assert "zarr.json" in keys and "tensors/w/zarr.json" in keys
    arr = ts.open(
        {
            "driver": "zarr3",
            "kvstore": _kvstore(s3_server, f"{prefix}/generations/{generation}/tensors/w/"),
        },
        read=True,
    ).result()
    np.testing.assert_array_equal(arr.read().result(), b)


def test_torch_save_of_a_state_dict_to_an_s3_url(s3_server, monkeypatch):
    torch = pytest.importorskip("torch")
    ts = pytest.importorskip("tensorstore")
    import zarrckpt.torch as zt

    _env(s3_server, monkeypatch)
    prefix = "py/torch"
    sd = {"layer.weight": torch.arange(32 * 8, dtype=torch.float32).reshape(32, 8)}
    zt.save(sd, f"s3://{BUCKET}/{prefix}")
    kv = ts.KvStore.open(_kvstore(s3_server, prefix + "/")).result()
    generation = json.loads(kv.read("zarrckpt.pointer.json").result().value)["generation"]
    manifest = json.loads(
        kv.read(f"generations/{generation}/zarrckpt.manifest.json").result().value
    )
    arrays = [o["key"] for o in manifest["objects"] if o["key"].endswith("weight/zarr.json")]
    assert len(arrays) == 1, manifest
    arr = ts.open(
        {
            "driver": "zarr3",
            "kvstore": _kvstore(
                s3_server, f"{prefix}/generations/{generation}/{arrays[0][: -len('zarr.json')]}"
            ),
        },
        read=True,
    ).result()
    np.testing.assert_array_equal(arr.read().result(), sd["layer.weight"].numpy())


def test_torch_load_and_open_read_straight_from_an_s3_url(s3_server, monkeypatch):
    """A state dict saved to a URL loads back from the URL bit for bit (ranged reads of the
    committed generation, no local copy), and ``zarrckpt.open`` reads boxes of it."""
    torch = pytest.importorskip("torch")
    import zarrckpt
    import zarrckpt.torch as zt

    _env(s3_server, monkeypatch)
    url = f"s3://{BUCKET}/py/roundtrip"
    g = torch.Generator().manual_seed(7)
    sd = {
        "w": torch.randn(96, 40, generator=g),
        "b": torch.randn(40, generator=g).to(torch.bfloat16),
        "step": torch.tensor(12, dtype=torch.int64),
    }
    zt.save(sd, url)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    zt.load(out, url)
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
    ck = zarrckpt.open(url)
    (w,) = [k for k in ck if k.split("/")[-1].split(".")[-1] == "w"]
    np.testing.assert_array_equal(np.asarray(ck[w][10:20, 3:9]), sd["w"][10:20, 3:9].numpy())
    # A missing checkpoint at a URL is an error naming it, never an empty load.
    with pytest.raises(Exception, match="nothing-here"):
        zt.load(out, f"s3://{BUCKET}/py/nothing-here")


def test_dcp_writer_and_reader_on_an_s3_url(s3_server, monkeypatch):
    """``dcp.save`` through ``zarrckpt.dcp.StorageWriter`` and ``dcp.load`` through
    ``StorageReader`` on an ``s3://`` URL (one process, no process group)."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    import zarrckpt.dcp as zd

    _env(s3_server, monkeypatch)
    url = f"s3://{BUCKET}/py/dcp"
    g = torch.Generator().manual_seed(3)
    state = {"model.w": torch.randn(33, 17, generator=g), "model.v": torch.randn(5, generator=g)}
    dcp.save(state, storage_writer=zd.StorageWriter(url), planner=zd.SavePlanner())
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=zd.StorageReader(url), planner=zd.LoadPlanner())
    for k, v in state.items():
        assert torch.equal(back[k], v), k
