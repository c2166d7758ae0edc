"""zarrckpt inside torch.distributed.checkpoint: ``dcp.save`` / ``dcp.async_save`` through
``zarrckpt.dcp.StorageWriter`` on 4 ranks (DTensor model + AdamW state from
``get_state_dict``), ``dcp.load`` through ``StorageReader`` on 3 ranks with another sharding,
bit for bit; the same checkpoint read by ``zarrckpt.torch.load`` and ``zarrckpt.open``; a
checkpoint of the Rust CLI loaded through ``dcp.load``; DCP's default planner (pickles,
flagged); and a hostile checkpoint whose object is a pickle that would run code. The
single-process writer and reader tests also run on ``s3://`` (fixture ``ckpt_root``,
``conftest.py``; ``test_s3.py`` runs a DCP save and load there too); the multi-process ones
keep DCP's own ``FileSystemWriter`` format beside, which is local only."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import distributed
import pytest
import torch
import torch.distributed.checkpoint as dcp
import workflow

import zarrckpt
import zarrckpt._core as core
import zarrckpt.dcp as zd
from zarrckpt import InvalidArgumentError

try:
    from torch.distributed.checkpoint.api import CheckpointException
except ImportError:  # pragma: no cover
    from torch.distributed.checkpoint import CheckpointException

# The single-process tests run DCP without torch.distributed, on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SAVE_WORLD, LOAD_WORLD, STEPS = 4, 3, 3
REPO = Path(__file__).resolve().parents[2]

EXTRA = {"step": STEPS, "name": "run-7", "betas": (0.9, 0.99), "blob": b"\x00\x01\xff"}


@contextlib.contextmanager
def fails_with(kind, pattern):
    """DCP wraps a rank's exception in a CheckpointException: check the wrapped one."""
    with pytest.raises(CheckpointException) as info:
        yield
    errors = [e[0] if isinstance(e, tuple) else e for e in info.value.failures.values()]
    assert errors and all(isinstance(e, kind) for e in errors), errors
    assert all(re.search(pattern, str(e)) for e in errors), errors


def _wait(response):
    """``dcp.async_save`` returns a future (or a response holding the upload's future)."""
    return getattr(response, "upload_completion", response).result()


def save_job(rank, world, root):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    model, opt = workflow.make(world, seed=1)
    losses = [workflow.train_step(model, opt, s) for s in range(STEPS)]
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "extra": dict(EXTRA)}
    writer = zd.StorageWriter(f"{root}/dcp")
    dcp.save(state, storage_writer=writer, planner=zd.SavePlanner())
    out["written"] = writer.last_report["assigned_bytes"]
    out["before"] = workflow.full_state(model, opt)

    # The same state in DCP's own format (FileSystemWriter), for the import test.
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/fs"))

    # The same state through dcp.async_save (DCP's stager copies it; training goes on).
    resp = dcp.async_save(
        state, storage_writer=zd.StorageWriter(f"{root}/async"), planner=zd.SavePlanner()
    )
    _wait(resp)

    losses.append(workflow.train_step(model, opt, STEPS))
    out["losses"] = losses
    out["after"] = workflow.full_state(model, opt)

    # DCP's default save planner: non-tensor values are torch.save pickles, flagged.
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dcp.save(
        {"t": t, "meta": {"a": 1, "b": [1, 2]}},
        storage_writer=zd.StorageWriter(f"{root}/default"),
    )
    return out


def load_job(rank, world, root):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import zarrckpt.torch as zc

    out = {}
    for name in ("dcp", "async"):
        model, opt = workflow.make(world, seed=2)  # other weights, no optimizer state yet
        msd, osd = get_state_dict(model, opt)
        extra = {"step": 0, "name": "", "betas": (0.0, 0.0), "blob": b""}
        state = {"model": msd, "optim": osd, "extra": extra}
        reader = zd.StorageReader(f"{root}/{name}")
        dcp.load(state, storage_reader=reader, planner=zd.LoadPlanner())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        out[f"{name}_before"] = workflow.full_state(model, opt)
        loaded = state["extra"]
        out[f"{name}_extra"] = {
            "step": loaded["step"],
            "name": loaded["name"],
            "betas_tuple": isinstance(loaded["betas"], tuple),
            "betas": list(loaded["betas"]),
            "blob": list(loaded["blob"]),
        }
        if name == "dcp":
            out["loss"] = workflow.train_step(model, opt, STEPS)
            out["after"] = workflow.full_state(model, opt)
            out["bytes_read"] = reader.last_report["bytes_read"]

    # The DCP checkpoint read by zarrckpt.torch (its tensors; DCP flattens the param groups
    # into other keys than zarrckpt.torch's single JSON object, so strict=False).
    model, opt = workflow.make(world, seed=3)
    rep = zc.load({"model": model, "optim": opt}, f"{root}/dcp", strict=False)
    out["zc_before"] = workflow.full_state(model, opt)
    out["zc_unexpected"] = rep["unexpected"]

    # A checkpoint of zarrckpt.torch read through dcp.load (tensor keys agree).
    zc.save({"model": model, "optim": opt}, f"{root}/zc")
    model, opt = workflow.make(world, seed=4)
    msd, osd = get_state_dict(model, opt)
    osd["param_groups"][0]["lr"] = 0.5  # the load must bring 0.02 back
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=zd.StorageReader(f"{root}/zc"), planner=zd.LoadPlanner())
    out["zc_dcp_lr"] = state["optim"]["param_groups"][0]["lr"]
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["zc_dcp_before"] = workflow.full_state(model, opt)
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    saved = distributed.run(SAVE_WORLD, save_job, root)
    loaded = distributed.run(LOAD_WORLD, load_job, root)
    return root, saved, loaded


def test_dcp_save_on_4_ranks_loads_bit_exactly_on_3(jobs):
    _, saved, loaded = jobs
    assert all(s["losses"] == saved[0]["losses"] for s in saved)
    for r in loaded:
        assert r["dcp_before"] == saved[0]["before"]
        assert r["loss"] == saved[0]["losses"][STEPS]
        assert r["after"] == saved[0]["after"]
    # Training moved (the comparisons are not between constants).
    assert saved[0]["losses"][0] != saved[0]["losses"][STEPS]
    assert saved[0]["after"] != saved[0]["before"]
    want = {**EXTRA, "betas_tuple": True, "betas": list(EXTRA["betas"])}
    want["blob"] = list(EXTRA["blob"])
    assert all(r["dcp_extra"] == want for r in loaded)
    # Replicated shards were written once: the ranks' shares add up to the data.
    assert sum(s["written"] for s in saved) > 0
    assert all(r["bytes_read"] > 0 for r in loaded)


def test_dcp_async_save(jobs):
    _, saved, loaded = jobs
    assert all(r["async_before"] == saved[0]["before"] for r in loaded)
    assert all(r["async_extra"] == loaded[0]["dcp_extra"] for r in loaded)


def test_dcp_checkpoint_is_an_ordinary_zarrckpt_checkpoint(jobs):
    root, saved, loaded = jobs
    assert all(r["zc_before"] == saved[0]["before"] for r in loaded)
    # Only non-tensor keys differ between the two fronts' namings.
    assert all(r["zc_unexpected"] == ["optim/param_groups"] for r in loaded)
    ck = zarrckpt.open(f"{root}/dcp", output="torch")
    assert set(ck.tensors) >= {"model/w1", "optim/state/w1/exp_avg", "optim/state/w1/step"}
    w1 = ck["model/w1"][...]
    bits = w1.view(torch.int32).flatten().tolist()
    assert bits == saved[0]["before"]["w1"]
    assert ck.object("extra/step") == STEPS
    assert ck.object("extra/betas") == [0.9, 0.99]
    assert ck.object("extra/blob") == EXTRA["blob"]
    assert ck.object("optim/param_groups/0/lr") == 0.02
    assert [ck.object(zd.TORCH_SAVE_FLAG, rank=r) for r in range(SAVE_WORLD)] == [
        {"torch_save": []}
    ] * SAVE_WORLD
    assert not list(Path(root, "dcp").rglob(".metadata"))
    assert ck.verify()["problems"] == []
    # tensorstore reads every array without zarrckpt, found through the index alone, bit
    # for bit what zarrckpt reads.
    import tensorstore as ts

    index = json.loads(Path(root, "dcp", "zarr.json").read_text())["attributes"]["zarrckpt"]
    assert set(index["tensors"]) == set(ck.tensors)
    ref = zarrckpt.open(f"{root}/dcp")
    for key, entry in index["tensors"].items():
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": f"{root}/dcp/{entry['path']}"},
        }
        arr = ts.open(spec, read=True).result()
        assert arr.dtype.name == entry["dtype"] and list(arr.shape) == entry["shape"], key
        got = arr.read().result()
        want = ref[key][...]
        assert got.tobytes() == want.tobytes(), key
    assert "model/w1" in index["tensors"]


def test_zarrckpt_torch_checkpoint_through_dcp_load(jobs):
    _, _, loaded = jobs
    assert all(r["zc_dcp_before"] == loaded[0]["zc_before"] for r in loaded)
    # zarrckpt.torch stored the param groups as one JSON object; DCP asked for its leaves.
    assert all(r["zc_dcp_lr"] == 0.02 for r in loaded)


def test_default_planner_pickles_are_flagged(jobs):
    root, _, _ = jobs
    path = f"{root}/default"
    ck = zarrckpt.open(path)
    flags = [ck.object(zd.TORCH_SAVE_FLAG, rank=r)["torch_save"] for r in range(SAVE_WORLD)]
    assert sorted(k for f in flags for k in f) == ["meta/a", "meta/b"]
    # DCP's default planner reads its own pickles back (the user's trust decision)...
    state = {"t": torch.zeros(3, 4), "meta": {"a": 0, "b": []}}
    dcp.load(state, storage_reader=zd.StorageReader(path))
    assert torch.equal(state["t"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert state["meta"] == {"a": 1, "b": [1, 2]}
    # ...zarrckpt's planner refuses to unpickle, or uses torch's restricted unpickler.
    state = {"t": torch.zeros(3, 4), "meta": {"a": 0, "b": []}}
    with fails_with(InvalidArgumentError, "torch.save pickle"):
        dcp.load(state, storage_reader=zd.StorageReader(path), planner=zd.LoadPlanner())
    state = {"t": torch.zeros(3, 4), "meta": {"a": 0, "b": []}}
    planner = zd.LoadPlanner(pickled="weights_only")
    dcp.load(state, storage_reader=zd.StorageReader(path), planner=planner)
    assert state["meta"] == {"a": 1, "b": [1, 2]}


def test_save_planner_refuses_what_it_would_have_to_pickle(ckpt_root):
    class Opaque:
        pass

    with fails_with(InvalidArgumentError, "`x`.*Opaque.*pickles nothing"):
        dcp.save(
            {"x": Opaque(), "t": torch.ones(2)},
            storage_writer=zd.StorageWriter(ckpt_root / "c"),
            planner=zd.SavePlanner(),
        )


def bytesio_job(rank, world, root):
    # DCP's own e2e case: a replicated io.BytesIO, which DCP gives to one rank to write and
    # zarrckpt's planner refuses there (it pickles nothing).
    state = {"w": torch.arange(8.0), "buf": io.BytesIO(b"abc")}
    try:
        dcp.save(state, storage_writer=zd.StorageWriter(f"{root}/c"), planner=zd.SavePlanner())
    except CheckpointException as e:
        return {"failed": True, "text": str(e)}
    return {"failed": False, "text": ""}


def test_a_rank_refused_by_the_planner_does_not_strand_the_others(tmp_path):
    """Before: the refusing rank waited in DCP's gather while the others waited forever in
    the collective save inside write_data. Now every rank raises CheckpointException."""
    os.environ["ZARRCKPT_TIMEOUT_S"] = "900"  # a rank left waiting shows up as hung
    try:
        out = distributed.run(SAVE_WORLD, bytesio_job, str(tmp_path), timeout=120)
    finally:
        del os.environ["ZARRCKPT_TIMEOUT_S"]
    assert all(o["failed"] for o in out), out
    assert all("pickles nothing" in o["text"] for o in out), out
    assert not (tmp_path / "c" / "zarr.json").exists()


def test_dcp_conventions_overwrite_and_save_id(ckpt_root):
    path = ckpt_root / "c"
    dcp.save({"t": torch.ones(2)}, storage_writer=zd.StorageWriter(path), planner=zd.SavePlanner())
    first = zd.StorageReader(path).read_metadata().storage_meta.save_id
    assert re.fullmatch("[0-9a-f]{32}", first or ""), first
    # PyTorch's own overwrite test matches these words.
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        dcp.save(
            {"t": torch.zeros(2)},
            storage_writer=zd.StorageWriter(path, overwrite=False),
            planner=zd.SavePlanner(),
        )
    assert zd.StorageReader(path).read_metadata().storage_meta.save_id == first
    dcp.save({"t": torch.zeros(2)}, storage_writer=zd.StorageWriter(path), planner=zd.SavePlanner())
    second = zd.StorageReader(path).read_metadata().storage_meta.save_id
    assert re.fullmatch("[0-9a-f]{32}", second or "") and second != first


def test_import_of_a_dcp_checkpoint(jobs):
    """DCP's own format (FileSystemWriter, 4 ranks, DTensor shards) imported into zarrckpt
    holds what zarrckpt's writer stored from the same state, bit for bit."""
    root, _, _ = jobs
    rep = zd.import_dcp(f"{root}/fs", f"{root}/imported")
    ours = zarrckpt.open(f"{root}/dcp", output="torch")
    imported = zarrckpt.open(f"{root}/imported", output="torch")
    assert set(imported.tensors) == set(ours.tensors) and rep["tensors"] == len(ours.tensors)
    for key in ours.tensors:
        assert ours.tensors[key].dtype == imported.tensors[key].dtype, key
        a, b = ours[key][...], imported[key][...]
        a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        assert torch.equal(a, b), key
    assert set(imported.objects) == set(ours.objects)
    for key in set(ours.objects) - {zd.TORCH_SAVE_FLAG}:
        assert imported.object(key) == ours.object(key), key
    assert rep["tensor_bytes"] == sum(i.nbytes for i in ours.tensors.values())
    # A plain DCP load reads the import back.
    state = {"extra": {"step": 0, "name": "", "betas": (0.0, 0.0), "blob": b""}}
    dcp.load(state, storage_reader=zd.StorageReader(f"{root}/imported"), planner=zd.LoadPlanner())
    assert state["extra"] == EXTRA


# ---------------------------------------------------------------------------------------------
# FSDP2 (fully_shard over a CPU mesh)


def fsdp_job(rank, world, root, mode):
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0 if mode == "save" else 1)
    model = nn.Sequential(nn.Linear(10, 37), nn.Tanh(), nn.Linear(37, 6))
    mesh = init_device_mesh("cpu", (world,))
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 10, generator=g), torch.randn(8, 6, generator=g)

    def step():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    def full():
        msd, osd = get_state_dict(model, opt)
        out = {k: v.full_tensor().view(torch.int32).flatten().tolist() for k, v in msd.items()}
        for p, st in osd["state"].items():
            for k, v in st.items():
                v = v.full_tensor() if hasattr(v, "full_tensor") else v
                out[f"{p}.{k}"] = v.float().view(torch.int32).flatten().tolist()
        return out

    path = f"{root}/fsdp"
    if mode == "save":
        for _ in range(2):
            step()
        msd, osd = get_state_dict(model, opt)
        dcp.save(
            {"model": msd, "optim": osd},
            storage_writer=zd.StorageWriter(path),
            planner=zd.SavePlanner(),
        )
        return {"state": full(), "loss": step()}
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, storage_reader=zd.StorageReader(path), planner=zd.LoadPlanner())
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"state": full(), "loss": step()}


def test_fsdp2_state_saved_on_4_ranks_loads_on_3(tmp_path):
    saved = distributed.run(SAVE_WORLD, fsdp_job, str(tmp_path), "save")
    loaded = distributed.run(LOAD_WORLD, fsdp_job, str(tmp_path), "load")
    assert all(r["state"] == saved[0]["state"] for r in loaded)
    assert any(k.endswith("exp_avg") for k in saved[0]["state"])
    # FSDP2 averages gradients over the ranks (4 vs 3 terms): the next step agrees to rounding.
    assert loaded[0]["loss"] == pytest.approx(saved[0]["loss"], rel=1e-5)


# ---------------------------------------------------------------------------------------------
# a hostile checkpoint


def _hostile_pickle(sentinel: Path) -> bytes:
    """A pickle whose loading runs ``open(sentinel, 'w')`` (hand-assembled opcodes)."""
    code = f"open({str(sentinel)!r}, 'w').close()"
    return b"cbuiltins\nexec\n(V" + code.encode() + b"\ntR."


def test_hostile_pickle_object_runs_nothing(tmp_path):
    sentinel = tmp_path / "pwned"
    payload = _hostile_pickle(sentinel)
    w = torch.arange(5, dtype=torch.float32)
    for name, flagged in (("plain", []), ("flagged", ["evil"])):
        core.save(
            tmp_path / name,
            [core.Piece("w", w, (5,))],
            [
                core.Object("evil", payload),
                core.Object(zd.TORCH_SAVE_FLAG, {"torch_save": flagged}),
            ],
        )
    # An unflagged bytes object comes back as the bytes, with either planner.
    for planner in (zd.LoadPlanner(), None):
        state = {"w": torch.zeros(5), "evil": b""}
        dcp.load(state, storage_reader=zd.StorageReader(tmp_path / "plain"), planner=planner)
        assert state["evil"] == payload and torch.equal(state["w"], w)
    # A flagged one is refused by zarrckpt's planner, and torch's restricted unpickler (the
    # opt-in) refuses the call.
    state = {"w": torch.zeros(5), "evil": b""}
    with fails_with(InvalidArgumentError, "torch.save pickle"):
        dcp.load(
            state, storage_reader=zd.StorageReader(tmp_path / "flagged"), planner=zd.LoadPlanner()
        )
    with fails_with(Exception, "exec|Unsupported|weights_only"):
        dcp.load(
            state,
            storage_reader=zd.StorageReader(tmp_path / "flagged"),
            planner=zd.LoadPlanner(pickled="weights_only"),
        )
    assert not sentinel.exists()
    # The payload is live: the unrestricted unpickler DCP's default planner uses runs it.
    try:
        torch.load(io.BytesIO(payload), weights_only=False)
    except Exception:  # noqa: BLE001 - not a torch file; the code ran before that was noticed
        pass
    assert sentinel.exists()


# ---------------------------------------------------------------------------------------------
# a checkpoint of the Rust CLI


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


def cli_job(rank, world, root, axes="last"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ck = zarrckpt.open(root, output="torch")
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for key, info in ck.tensors.items():
        empty = torch.zeros(info.shape, dtype=getattr(torch, info.dtype))
        if axes == "last":  # another split than the demo's (it splits most weights by rows)
            axis = len(info.shape) - 1
        else:  # the axis the demo's ranks split (its chunks are narrower than the tensor)
            pairs = enumerate(zip(info.chunk_shape, info.shape, strict=True))
            split = [d for d, (c, n) in pairs if c < n]
            axis = split[0] if split else 0
        placements = [Shard(axis)] if info.shape else []
        state[key.replace("/", ".")] = (
            distribute_tensor(empty, mesh, placements) if placements else empty
        )
    reader = zd.StorageReader(root)
    dcp.load(state, storage_reader=reader, planner=zd.LoadPlanner())
    bad = []
    for key in ck.tensors:
        got = state[key.replace("/", ".")]
        local = got.full_tensor() if hasattr(got, "full_tensor") else got
        want = ck[key][...]
        if not torch.equal(local.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            bad.append(key)
    rep = reader.last_report
    return {
        "bad": bad,
        "n": len(ck.tensors),
        "read": rep["bytes_read"],
        "loaded": rep["loaded_bytes"],
        "total": sum(i.nbytes for i in ck.tensors.values()),
    }


def test_rust_cli_checkpoint_through_dcp_load(tmp_path):
    root = tmp_path / "demo"
    out = subprocess.run(
        [zarrckpt_bin(), "demo", "--dir", str(root), "--size", "1000000"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    results = distributed.run(LOAD_WORLD, cli_job, str(root))
    assert all(r["bad"] == [] for r in results), results
    assert results[0]["n"] > 5
    # Each rank read only the subchunks of its own column blocks (a split the demo did not
    # save): no rank read the whole checkpoint, and the ranks' reads add up to about its size.
    total = results[0]["total"]
    assert all(0 < r["read"] < total for r in results)
    # Cutting axes the demo did not cut reads whole subchunks for a part of them (subchunks
    # are thin along the saved split, whole along the other axes): about 2.5x in all (see the
    # README). Split along the saved axes, 4 -> 3 parts, the load reads little more than it
    # needs.
    loaded = sum(r["loaded"] for r in results)
    assert 2.0 < sum(r["read"] for r in results) / loaded < 3.0
    same = distributed.run(LOAD_WORLD, cli_job, str(root), "saved")
    assert all(r["bad"] == [] for r in same), same
    assert sum(r["read"] for r in same) / sum(r["loaded"] for r in same) <= 1.05


# ---------------------------------------------------------------------------------------------
# _StridedShard: FSDP2 over a tensor-parallel model, and interleaved local tensors


def _bits(t):
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t.detach().contiguous().reshape(-1).view(torch.uint8).tolist()


# Tensors built directly with _StridedShard placements whose local tensors are not one box:
# on the 2 x 2 save mesh, and on the 1-D load mesh of 3 (uneven everywhere).
def _strided_placements(world):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if world == 4:
        return {
            "rows": [Shard(0), _StridedShard(0, split_factor=2)],
            "cols": [Replicate(), _StridedShard(1, split_factor=3)],
            "both": [_StridedShard(1, split_factor=2), _StridedShard(0, split_factor=3)],
        }
    return {
        "rows": [_StridedShard(0, split_factor=2)],
        "cols": [Shard(0)],
        "both": [_StridedShard(1, split_factor=2)],
    }


STRIDED_SHAPES = {"rows": (11, 6), "cols": (5, 14), "both": (13, 9)}


def _tp_fsdp_model(world):
    """A tensor-parallel MLP sharded by FSDP2 over data parallelism (dp 2 x tp 2 on 4 ranks;
    FSDP2 alone on 3)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0 if world == 4 else 1)
    model = nn.Sequential(nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 7))
    if world == 4:
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        dp = mesh["dp"]
    else:
        dp = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
    return model, opt


def strided_job(rank, world, root, mode):
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    import zarrckpt.torch as zc

    model, opt = _tp_fsdp_model(world)
    mesh = init_device_mesh("cpu", (2, 2) if world == 4 else (world,))
    place = _strided_placements(world)
    out = {}
    if mode == "save":
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(8, 10, generator=g), torch.randn(8, 7, generator=g)
        for _ in range(2):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        extra = {}
        for name, shape in STRIDED_SHAPES.items():
            full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
            # src_data_rank=None: each rank cuts its own part (torch's rules; uneven too).
            extra[name] = distribute_tensor(full, mesh, place[name], src_data_rank=None)
            # torch itself agrees on what the strided DTensor holds.
            assert torch.equal(extra[name].full_tensor(), full), name
        msd, osd = get_state_dict(model, opt)
        out["strided"] = sorted(k for k, v in msd.items() if zd._dtensor.has_strided(v.placements))
        out["pieces"] = {k: len(zd._dtensor.local_boxes(v)) for k, v in extra.items()}
        state = {"model": msd, "optim": osd, "extra": extra}
        dcp.save(state, storage_writer=zd.StorageWriter(f"{root}/zc"), planner=zd.SavePlanner())
        # zd.SavePlanner fixes the plan for any storage writer, DCP's own too.
        dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/fs"), planner=zd.SavePlanner())
        zc.save(state, f"{root}/torch")
    else:
        extra = {}
        for name, shape in STRIDED_SHAPES.items():
            extra[name] = distribute_tensor(
                torch.zeros(shape), mesh, place[name], src_data_rank=None
            )
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "extra": extra}
        if mode == "torch":  # zarrckpt.torch's own save and load
            zc.load(state, f"{root}/torch")
        else:
            if mode == "fs":
                reader = dcp.FileSystemReader(f"{root}/fs")
            else:
                reader = zd.StorageReader(f"{root}/{mode}")
            # DCP's own format holds the param groups as pickles: torch's restricted unpickler.
            planner = zd.LoadPlanner(pickled="weights_only" if mode == "fs" else "error")
            dcp.load(state, storage_reader=reader, planner=planner)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    msd, osd = get_state_dict(model, opt)
    out["model"] = {k: _bits(v) for k, v in msd.items()}
    out["optim"] = {f"{p}.{k}": _bits(v) for p, st in osd["state"].items() for k, v in st.items()}
    out["extra"] = {k: _bits(v) for k, v in extra.items()}
    return out


def test_strided_shard_fsdp2_tp_saved_on_2x2_loads_on_3(tmp_path):
    root = str(tmp_path)
    saved = distributed.run(SAVE_WORLD, strided_job, root, "save")
    # FSDP2 over the colwise-parallel layer makes _StridedShard placements.
    assert saved[0]["strided"] == ["0.bias", "0.weight"], saved[0]["strided"]
    # Some local tensors are several boxes (DCP's default planner describes them by their
    # first offset: "Failed to validate global plan: ... overlapping chunks").
    assert max(n for s in saved for n in s["pieces"].values()) > 1
    for mode in ("zc", "fs", "torch"):
        loaded = distributed.run(LOAD_WORLD, strided_job, root, mode)
        for r in loaded:
            for part in ("model", "optim", "extra"):
                assert r[part] == saved[0][part], (mode, part)
    ck = zarrckpt.open(f"{root}/zc", output="torch")
    for name, shape in STRIDED_SHAPES.items():
        want = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
        assert torch.equal(ck[f"extra/{name}"][...], want), name
    assert ck.verify()["problems"] == []


# ---------------------------------------------------------------------------------------------
# the command lines: python -m zarrckpt.migrate and zarrckpt import --dcp (the same importer)


def built_cli() -> str:
    """The CLI binary scripts/test.sh builds (target/release/zarrckpt); skips without it."""
    exe = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target")) / "release" / "zarrckpt"
    exe = Path(os.environ.get("ZARRCKPT_BIN", exe))
    if not exe.is_file():
        pytest.skip(f"no CLI binary at {exe} (cargo build --release builds it)")
    return str(exe)


def test_migrate_command_imports_a_dcp_checkpoint(jobs, tmp_path):
    root, _, _ = jobs
    cmd = [sys.executable, "-m", "zarrckpt.migrate", f"{root}/fs", "--out", str(tmp_path / "cli")]
    out = subprocess.run([*cmd, "--ranks", "3"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    ours = zarrckpt.open(f"{root}/dcp", output="torch")
    assert summary["tensors"] == len(ours.tensors)
    cli = zarrckpt.open(tmp_path / "cli", output="torch")
    for key, info in ours.tensors.items():
        a, b = ours[key][...], cli[key][...]
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), key
        if len(info.shape) and info.shape[0] >= 3:  # split 3 ways along the first axis
            assert cli.tensors[key].chunk_shape[0] == -(-info.shape[0] // 3), key
    assert cli.object("extra/step") == STEPS
    # The target exists: refused without --overwrite.
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode != 0 and "exist" in again.stderr, again.stderr


def test_cli_imports_dcp_without_python(jobs, tmp_path):
    """The Rust CLI imports a DCP checkpoint with the library's importer (the same as
    zarrckpt.dcp.import_dcp): no Python started, the same values; --trust-pickles (running
    the pickles) is only in the Python package, and the refusal names its command."""
    root, _, _ = jobs
    exe = built_cli()
    env = {**os.environ, "ZARRCKPT_PYTHON": str(tmp_path / "no-python"), "PATH": "/nonexistent"}
    out = subprocess.run(
        [exe, "import", "--dcp", f"{root}/fs", "--out", str(tmp_path / "cli")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    ours = zarrckpt.open(f"{root}/dcp", output="torch")
    cli = zarrckpt.open(tmp_path / "cli", output="torch")
    assert summary["tensors"] == len(ours.tensors) == len(cli.tensors)
    for key in ours.tensors:
        a, b = ours[key][...], cli[key][...]
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), key
    assert cli.object("extra/step") == STEPS
    bad = subprocess.run(
        [exe, "import", "--dcp", f"{root}/fs", "--trust-pickles", "--out", str(tmp_path / "never")],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode != 0
    assert f"python -m zarrckpt.migrate {root}/fs --out {tmp_path / 'never'} --trust-pickles" in (
        bad.stderr
    ), bad.stderr
    assert not (tmp_path / "never").exists()
