"""zarrckpt.torch on one process: every kind of leaf round-trips, in place; the save / load
tests on a local directory and on ``s3://`` (the ``ckpt_root`` fixture, ``conftest.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections import namedtuple

import pytest
import torch
from conftest import is_local
from test_core import TORCH_DTYPES, random_tensor, same_bits
from torch import nn

import zarrckpt
import zarrckpt.torch as zc


def test_tensors_of_every_dtype_and_nesting(ckpt_root):
    state = {f"t/{i}": random_tensor((3, 4), dt, seed=i) for i, dt in enumerate(TORCH_DTYPES)}
    state["nested"] = {
        "a": [random_tensor((2,), torch.float32, 1), {"b": random_tensor((), torch.int64, 2)}]
    }
    zc.save(state, ckpt_root / "c")
    target = {k: torch.zeros_like(v) for k, v in state.items() if k != "nested"}
    target["nested"] = {"a": [torch.zeros(2), {"b": torch.zeros((), dtype=torch.int64)}]}
    ptrs = {k: v.data_ptr() for k, v in target.items() if isinstance(v, torch.Tensor)}
    zc.load(target, ckpt_root / "c")
    for k, v in ptrs.items():
        assert target[k].data_ptr() == v  # in place
        assert same_bits(target[k], state[k])
    assert same_bits(target["nested"]["a"][0], state["nested"]["a"][0])
    assert same_bits(target["nested"]["a"][1]["b"], state["nested"]["a"][1]["b"])
    keys = set(zarrckpt.open(ckpt_root / "c").tensors)
    assert {"t/0", "nested/a/0", "nested/a/1/b"} <= keys


def test_non_contiguous_and_non_cpu_layouts_are_staged(ckpt_root):
    base = torch.arange(20.0).reshape(4, 5)
    zc.save({"t": base.T, "s": base[:, 1]}, ckpt_root / "c")
    ck = zarrckpt.open(ckpt_root / "c")
    assert torch.equal(ck["t"].torch[...], base.T) and torch.equal(ck["s"].torch[...], base[:, 1])
    out = torch.zeros(4, 5)
    target = {"t": out.T, "s": torch.zeros(8)[::2]}
    zc.load(target, ckpt_root / "c")
    assert torch.equal(out.T, base.T) and torch.equal(target["s"], base[:, 1])


def make_training(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    return model, opt, sched


def train(model, opt, sched, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 5, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def test_module_optimizer_scheduler_resume_identically(ckpt_root):
    model, opt, sched = make_training(0)
    train(model, opt, sched, 3)
    zc.save({"model": model, "optim": opt, "sched": sched, "step": 3}, ckpt_root / "c")
    expected = train(model, opt, sched, 2, seed=5)

    model2, opt2, sched2 = make_training(1)  # other weights, no optimizer state yet
    state = {"model": model2, "optim": opt2, "sched": sched2, "step": 0}
    zc.load(state, ckpt_root / "c")
    assert state["step"] == 3
    assert opt2.param_groups[0]["betas"] == (0.8, 0.95)  # a tuple again
    assert sched2.last_epoch == 3
    assert train(model2, opt2, sched2, 2, seed=5) == expected
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    # The optimizer state is keyed by parameter names (torch.distributed.checkpoint.state_dict).
    keys = set(zarrckpt.open(ckpt_root / "c").tensors)
    assert "optim/state/0.weight/exp_avg" in keys and "model/2.bias" in keys


def test_optimizer_without_its_module(ckpt_root):
    model, opt, sched = make_training(0)
    train(model, opt, sched, 2)
    zc.save({"optim": opt}, ckpt_root / "c")
    model2, opt2, _ = make_training(0)
    zc.load({"optim": opt2}, ckpt_root / "c")  # state created before loading into it
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k])


def test_json_bytes_per_rank_and_tuples(ckpt_root):
    Point = namedtuple("Point", "x y")
    state = {
        "cfg": {"name": "run ✓", "dims": (4, 5), "p": Point(1, 2), "none": None, "f": 0.1},
        "flag": True,
        "blob": b"\x00\xffraw",
        "mixed": (torch.ones(2), "label", 3),
        "rng": zc.PerRank(torch.get_rng_state()),
        "seed": zc.PerRank(1234),
        "list": [1, "two", [3.0]],
    }
    zc.save(state, ckpt_root / "c")
    target = {
        "cfg": {"name": "", "dims": (0, 0), "p": Point(0, 0), "none": 1, "f": 0.0},
        "flag": False,
        "blob": b"",
        "mixed": (torch.zeros(2), "", 0),
        "rng": zc.PerRank(torch.zeros_like(torch.get_rng_state())),
        "seed": zc.PerRank(0),
        "list": [],
    }
    zc.load(target, ckpt_root / "c")
    assert target["cfg"] == state["cfg"] and isinstance(target["cfg"]["p"], Point)
    assert isinstance(target["cfg"]["dims"], tuple)
    assert target["flag"] is True and target["blob"] == state["blob"]
    assert torch.equal(target["mixed"][0], torch.ones(2)) and target["mixed"][1:] == ("label", 3)
    assert torch.equal(target["rng"].value, state["rng"].value)
    assert target["seed"].value == 1234 and target["list"] == [1, "two", [3.0]]
    ck = zarrckpt.open(ckpt_root / "c")
    assert ck.object("cfg")["dims"] == [4, 5]  # stored as plain JSON
    assert ck.objects["seed"].scope == "per_rank"
    assert ck.tensors["rng"].shape[0] == 1  # a leading rank axis


def test_tied_weights_are_loaded_once(ckpt_root):
    emb = nn.Embedding(11, 4)
    head = nn.Linear(4, 11, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    zc.save({"model": model}, ckpt_root / "c")
    emb2 = nn.Embedding(11, 4)
    head2 = nn.Linear(4, 11, bias=False)
    head2.weight = emb2.weight
    model2 = nn.ModuleDict({"emb": emb2, "head": head2})
    zc.load({"model": model2}, ckpt_root / "c")
    assert torch.equal(emb2.weight, emb.weight) and head2.weight is emb2.weight


def test_strict_and_missing_keys(ckpt_root):
    zc.save({"a": torch.ones(2), "n": 1}, ckpt_root / "c")
    with pytest.raises(zarrckpt.KeyMismatchError, match="`b`") as e:
        zc.load({"a": torch.zeros(2), "b": torch.zeros(1)}, ckpt_root / "c")
    assert e.value.details["keys"] == ["b"]
    target = {"a": torch.zeros(2), "b": torch.zeros(1), "m": 5}
    rep = zc.load(target, ckpt_root / "c", strict=False)
    assert sorted(rep["unexpected"]) == ["b", "m"]
    assert torch.equal(target["a"], torch.ones(2)) and target["m"] == 5  # skipped, unchanged
    with pytest.raises(zarrckpt.MismatchError, match="requested float64, stored float32"):
        zc.load({"a": torch.zeros(2, dtype=torch.float64)}, ckpt_root / "c")
    target = {"a": torch.zeros(2, dtype=torch.bfloat16)}
    zc.load(target, ckpt_root / "c", cast=True)
    assert torch.equal(target["a"], torch.ones(2, dtype=torch.bfloat16))


def test_leaves_that_cannot_be_saved(ckpt_root):
    with pytest.raises(zarrckpt.InvalidArgumentError, match="`x/y`: builtins.object is not a leaf"):
        zc.save({"x": {"y": object()}}, ckpt_root / "c")
    with pytest.raises(zarrckpt.InvalidArgumentError, match="nothing is pickled"):
        zc.save({"x": float("inf")}, ckpt_root / "c")
    with pytest.raises(zarrckpt.InvalidArgumentError, match="keys are str or int"):
        zc.save({"x": {(1, 2): torch.ones(1)}}, ckpt_root / "c")
    with pytest.raises(zarrckpt.InvalidArgumentError, match="is a dict"):
        zc.save([torch.ones(1)], ckpt_root / "c")
    with pytest.raises(zarrckpt.InvalidArgumentError, match="not supported"):
        zc.save({"c": torch.ones(2, dtype=torch.complex64)}, ckpt_root / "c")
    if is_local(ckpt_root):
        assert not (ckpt_root / "c").exists()
    else:
        with pytest.raises(zarrckpt.ZarrckptError):
            zarrckpt.open(ckpt_root / "c")


def test_async_save_and_overwrite(tmp_path):
    model, opt, sched = make_training(0)
    train(model, opt, sched, 1)
    state = {"model": model, "optim": opt, "step": 1}
    h = zc.async_save(state, tmp_path / "c")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, opt, sched, 1)  # training goes on while the save is written
    rep = h.wait()
    assert h.done() and h.exception() is None and rep["tensors"] > 0
    ck = zarrckpt.open(tmp_path / "c")
    for k, v in saved.items():
        assert torch.equal(ck[f"model/{k}"].torch[...], v)
    # the default overwrite replaces the checkpoint (atomically)
    state["step"] = 2
    zc.async_save(state, tmp_path / "c").wait()
    assert zarrckpt.open(tmp_path / "c").object("step") == 2
    with pytest.raises(zarrckpt.StorageError):
        zc.save(state, tmp_path / "c", overwrite=False)


def test_checkpoint_is_plain_zarr_json(tmp_path):
    zc.save({"w": torch.ones(3, dtype=torch.bfloat16), "cfg": {"a": 1}}, tmp_path / "c")
    root = json.loads((tmp_path / "c" / "zarr.json").read_text())
    assert root["zarr_format"] == 3


# ---------------------------------------------------------------------------------------------
# a failed asynchronous save is never silent


def _run(script: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_failed_async_save_never_waited_on_fails_the_process(tmp_path):
    (tmp_path / "notckpt").mkdir()
    (tmp_path / "notckpt" / "keep.txt").write_text("keep")
    out = _run(
        """
        import torch, zarrckpt.torch as zc
        zc.async_save({"w": torch.zeros(2)}, "notckpt")
        print("script done")
        """,
        tmp_path,
    )
    assert "script done" in out.stdout, out.stderr
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "never waited on" in out.stderr and "StorageError" in out.stderr, out.stderr
    # overwrite is on (the default): the message says why, not "pass overwrite".
    assert "not a zarrckpt checkpoint" in out.stderr, out.stderr
    assert "pass overwrite" not in out.stderr, out.stderr
    assert (tmp_path / "notckpt" / "keep.txt").read_text() == "keep"


def test_a_failed_async_save_seen_by_the_caller_exits_normally(tmp_path):
    (tmp_path / "notckpt").mkdir()
    (tmp_path / "notckpt" / "keep.txt").write_text("keep")
    out = _run(
        """
        import torch, zarrckpt.torch as zc
        h = zc.async_save({"w": torch.zeros(2)}, "notckpt")
        print("caught", type(h.exception()).__name__)
        ok = zc.async_save({"w": torch.zeros(2)}, "fresh")
        ok.wait()
        zc.async_save({"w": torch.ones(2)}, "fresh")  # succeeds, never waited on: fine
        """,
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "caught StorageError" in out.stdout
    assert "never waited on" not in out.stderr
