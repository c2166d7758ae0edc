"""The checkpoint manager and asynchronous saves on an ``s3://`` root, from Python, against a
real S3 server on loopback (SeaweedFS, started by the ``s3_server`` fixture): steps as
sub-prefixes with their own generations, ``latest`` an object under the root, keep-N deleting
dropped steps only after the newer step committed, and a resume from the latest step."""

from __future__ import annotations

import json
import time
import urllib.parse

import pytest
from s3_server import BUCKET, s3_server  # noqa: F401  (the fixture)

torch = pytest.importorskip("torch")


def _env(server, monkeypatch):
    """Points ``s3://`` at the server, once it answers signed requests (the bucket is created
    just after the port opens)."""
    from zarrckpt.manager import CheckpointManager

    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    deadline = time.monotonic() + 60
    while True:
        try:
            CheckpointManager(f"s3://{BUCKET}/ready").latest()
            return
        except Exception as e:
            if "NoSuchBucket" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _kv(server, prefix: str):
    """The keys under ``prefix``, through tensorstore (which knows nothing of zarrckpt)."""
    ts = pytest.importorskip("tensorstore")
    return ts.KvStore.open(
        {
            "driver": "s3",
            "bucket": BUCKET,
            "path": prefix + "/",
            "endpoint": server.endpoint,
            "aws_region": "us-east-1",
            "aws_credentials": {"type": "environment"},
        }
    ).result()


def _list_with_tensorstore(server, prefix: str) -> list[str]:
    kv = _kv(server, prefix)
    return sorted(urllib.parse.unquote(k.decode()) for k in kv.list().result())


def _read(server, prefix: str, key: str) -> bytes:
    return _kv(server, prefix).read(key).result().value


def state_of(step: int) -> dict:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step,
        "iteration": step,
        "rng": bytes([step % 256]) * 8,
    }


def blank() -> dict:
    return {"w": torch.zeros(3, 4), "iteration": 0, "rng": b""}


def test_manager_on_an_s3_root_saves_async_keeps_the_last_n_and_resumes(s3_server, monkeypatch):  # noqa: F811
    from zarrckpt.manager import CheckpointManager

    _env(s3_server, monkeypatch)
    prefix = "py/manager"
    root = f"s3://{BUCKET}/{prefix}"
    m = CheckpointManager(root, keep_last=2, staging_bytes=1 << 20)
    assert m.root == root and m.latest() is None and m.steps() == []
    assert m.load_latest(blank()) is None
    for step in range(1, 6):
        state = state_of(step)
        if step == 3:
            m.save(step, state)
        else:
            h = m.async_save(step, state)
            state["w"].fill_(-1.0)  # training goes on: what was staged is what is saved
            state["iteration"] = -1
            h.wait()
    assert m.step_dir(5) == f"{root}/step-00000005"
    assert [(s.step, s.complete) for s in m.steps()] == [(4, True), (5, True)]
    assert all(s.bytes > 0 and s.dir == m.step_dir(s.step) for s in m.steps())
    assert m.latest() == 5
    keys = _list_with_tensorstore(s3_server, prefix)
    assert "latest" in keys
    gone = ("step-00000001", "step-00000002", "step-00000003")
    assert not [k for k in keys if k.split("/")[0] in gone], keys
    assert "step-00000005/zarrckpt.pointer.json" in keys, keys

    # A restarted job resumes from step 5: tensors and objects.
    again = CheckpointManager(root, keep_last=2)
    out = blank()
    assert again.load_latest(out) == 5
    want = state_of(5)
    assert torch.equal(out["w"], want["w"])
    assert out["iteration"] == 5 and out["rng"] == want["rng"]


def test_async_save_of_a_state_dict_to_an_s3_url(s3_server, monkeypatch):  # noqa: F811
    import zarrckpt.torch as zt

    _env(s3_server, monkeypatch)
    url = f"s3://{BUCKET}/py/async"
    sd = {"layer.weight": torch.arange(32 * 8, dtype=torch.float32).reshape(32, 8)}
    h = zt.async_save(sd, url)
    sd["layer.weight"].fill_(0.0)  # the call returned: the state was staged
    h.wait()
    want = torch.arange(32 * 8, dtype=torch.float32).reshape(32, 8)
    out = {"layer.weight": torch.zeros(32, 8)}
    zt.load(out, url)
    assert torch.equal(out["layer.weight"], want)
    keys = _list_with_tensorstore(s3_server, "py/async")
    generation = json.loads(_read(s3_server, "py/async", "zarrckpt.pointer.json"))["generation"]
    assert f"generations/{generation}/zarrckpt.manifest.json" in keys
