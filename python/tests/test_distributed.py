"""zarrckpt.torch across processes (torch.multiprocessing, gloo over loopback): DTensors of
any mesh and placement saved on 4 ranks and loaded on 3 with another sharding, the training
workflow resumed bit for bit, asynchronous saves next to training collectives, sub-groups,
errors on every rank, and torchrun."""

from __future__ import annotations

import os
import textwrap

import distributed
import pytest
import torch
import workflow

SAVE_WORLD, LOAD_WORLD, STEPS = 4, 3, 3


def dtensor_specs(world):
    """(name, dtype, global shape, placements) per world size (2 x 2 mesh, then 1-D)."""
    from torch.distributed.tensor import Replicate as R
    from torch.distributed.tensor import Shard as S

    if world == 4:
        return [
            ("a", torch.float32, (10, 7), [S(0), S(1)]),
            ("b", torch.bfloat16, (9,), [S(0), R()]),
            ("c", torch.float8_e4m3fn, (5, 6), [R(), S(1)]),
            ("d", torch.int64, (3, 4), [R(), R()]),
            ("e", torch.float16, (2, 13), [S(1), S(1)]),
            ("f", torch.uint8, (3,), [S(0), S(0)]),  # one rank holds nothing
        ]
    return [
        ("a", torch.float32, (10, 7), [S(1)]),
        ("b", torch.bfloat16, (9,), [R()]),
        ("c", torch.float8_e4m3fn, (5, 6), [S(0)]),
        ("d", torch.int64, (3, 4), [S(0)]),
        ("e", torch.float16, (2, 13), [R()]),
        ("f", torch.uint8, (3,), [S(0)]),
    ]


def full_value(name, dtype, shape):
    from test_core import random_tensor

    return random_tensor(shape, dtype, seed=ord(name))


def local_box(shape, mesh, placements):
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local, strict=True))


def dtensors(world, fill):
    """This rank's DTensors, built from local slices (gloo cannot broadcast fp8)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", workflow.MESH[world])
    out = {}
    for name, dtype, shape, placements in dtensor_specs(world):
        box = local_box(shape, mesh, placements)
        full = full_value(name, dtype, shape)
        local = full[box].clone() if fill else torch.zeros_like(full[box])
        out[name] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=full.stride()
        )
    return out


def save_job(rank, world, root):
    import torch.distributed as dist

    import zarrckpt
    import zarrckpt.torch as zc

    out = {}
    # 1. The training workflow: a few steps, save, one more step.
    model, opt = workflow.make(world, seed=1)
    losses = [workflow.train_step(model, opt, s) for s in range(STEPS)]
    state = {"model": model, "optim": opt, "step": STEPS, "rng": zc.PerRank(bytes([rank] * 4))}
    zc.save(state, f"{root}/train")
    out["before"] = workflow.full_state(model, opt)
    losses.append(workflow.train_step(model, opt, STEPS))
    out["losses"] = losses
    out["after"] = workflow.full_state(model, opt)

    # 2. DTensors of every placement, plain replicated and per-rank tensors.
    state = dtensors(world, fill=True)
    state["replicated"] = torch.arange(6, dtype=torch.int32)
    state["own"] = zc.PerRank(torch.full((2,), rank, dtype=torch.int16))
    rep = zc.save(state, f"{root}/dtensors")
    out["written"] = rep["assigned_bytes"]

    # 3. An asynchronous save while training collectives run on the default group.
    w = torch.full((1000,), float(rank))
    h = zc.async_save({"w": zc.PerRank(w), "step": 7}, f"{root}/async")
    w.add_(100)  # staged already
    acc = torch.ones(1)
    for _ in range(20):
        dist.all_reduce(acc)
    out["allreduce"] = acc.item()
    out["async"] = h.wait()["data_bytes"]
    dist.barrier()
    if rank == 0:
        ck = zarrckpt.open(f"{root}/async")
        got = ck["w"].torch[...]
        out["async_ok"] = all(
            torch.equal(got[r], torch.full((1000,), float(r))) for r in range(world)
        )

    # 4. A sub-group saves on its own.
    group = dist.new_group([1, 2])
    if rank in (1, 2):
        zc.save({"x": zc.PerRank(torch.tensor([rank]))}, f"{root}/sub", process_group=group)
        out["sub_world"] = zarrckpt.open(f"{root}/sub").world_size
    dist.barrier()
    return out


def comm_checks(rank, world):
    """TorchComm's byte collectives (the core's shared ones over its exchange) with messages
    of several sizes (empty, small, larger than a socket buffer, different lengths on
    different ranks)."""
    from zarrckpt import _core

    c = _core.communicator()
    sizes = [0, 5, 256, 257, 3 * 65536 + 7]
    ok = []
    for base in sizes:
        mine = bytes((rank * 31 + i) % 256 for i in range(base + rank))
        got = c.all_gather(mine)
        ok.append(got == [bytes((r * 31 + i) % 256 for i in range(base + r)) for r in range(world)])
        b = c.broadcast(world - 1, mine if rank == world - 1 else b"")
        ok.append(b == bytes(((world - 1) * 31 + i) % 256 for i in range(base + world - 1)))
    c.barrier()
    # exchange: every rank sends two messages to every rank (itself included), in order
    sends, recvs = [], []
    for peer in range(world):
        for k in range(2):
            sends.append((peer, memoryview(bytes([rank, peer, k]) * (k * 1000 + 1))))
            recvs.append((peer, memoryview(bytearray(3 * (k * 1000 + 1)))))
    c.exchange(sends, recvs)
    ok.append(
        all(
            bytes(mv) == bytes([peer, rank, i % 2]) * ((i % 2) * 1000 + 1)
            for i, (peer, mv) in enumerate(recvs)
        )
    )
    return ok


def load_job(rank, world, root):
    import zarrckpt.torch as zc

    out = {"comm": comm_checks(rank, world)}
    model, opt = workflow.make(world, seed=2)  # other weights, no optimizer state yet
    state = {"model": model, "optim": opt, "step": 0, "rng": zc.PerRank(b"")}
    # 4 -> 3 ranks: each rank takes the per-rank values its rank saved (opted in).
    zc.load(state, f"{root}/train", per_rank="by_rank")
    out["before"] = workflow.full_state(model, opt)
    out["loss"] = workflow.train_step(model, opt, state["step"])
    out["after"] = workflow.full_state(model, opt)
    out["step"] = state["step"]
    out["rng"] = list(state["rng"].value)

    state = dtensors(world, fill=False)
    state["replicated"] = torch.zeros(6, dtype=torch.int32)
    state["own"] = zc.PerRank(torch.zeros(2, dtype=torch.int16))
    rep = zc.load(state, f"{root}/dtensors", per_rank="by_rank")
    bad = []
    for name, dtype, shape, placements in dtensor_specs(world):
        dt = state[name]
        want = full_value(name, dtype, shape)[local_box(shape, dt.device_mesh, placements)]
        if not torch.equal(
            dt.to_local().reshape(-1).view(torch.uint8),
            want.contiguous().reshape(-1).view(torch.uint8),
        ):
            bad.append(name)
    out["bad"] = bad
    out["replicated"] = state["replicated"].tolist()
    out["own"] = state["own"].value.tolist()
    out["bytes_read"] = rep["bytes_read"]
    return out


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dist"))
    saved = distributed.run(SAVE_WORLD, save_job, root)
    loaded = distributed.run(LOAD_WORLD, load_job, root)
    return saved, loaded


def test_training_resumes_bit_exactly_on_another_sharding(jobs):
    saved, loaded = jobs
    # Every rank of each job computed the same thing.
    assert all(s["losses"] == saved[0]["losses"] for s in saved)
    assert all(r["loss"] == loaded[0]["loss"] for r in loaded)
    # The state loaded on 3 ranks (1-D mesh) is the state saved on 4 (2 x 2 mesh), bit for
    # bit: parameters, Adam moments and step counts...
    assert loaded[0]["before"] == saved[0]["before"]
    assert loaded[0]["step"] == STEPS
    # ...and one more step gives the loss and parameters of the run that never stopped.
    assert loaded[0]["loss"] == saved[0]["losses"][STEPS]
    assert loaded[0]["after"] == saved[0]["after"]
    # The run actually trains (the comparison is not between constants).
    assert saved[0]["losses"][0] != saved[0]["losses"][STEPS]
    assert saved[0]["after"] != saved[0]["before"]
    # Per-rank objects come back to their ranks.
    assert [r["rng"] for r in loaded] == [[r] * 4 for r in range(LOAD_WORLD)]


def test_dtensors_of_any_placement_reshard(jobs):
    saved, loaded = jobs
    assert all(r["bad"] == [] for r in loaded), [r["bad"] for r in loaded]
    assert all(r["replicated"] == list(range(6)) for r in loaded)
    assert [r["own"] for r in loaded] == [[r, r] for r in range(LOAD_WORLD)]
    # Replicated pieces were written once: the ranks' shares add up to the data.
    total = sum(r["written"] for r in saved)
    data = (
        sum(torch.empty(s, dtype=d).nbytes for _, d, s, _ in dtensor_specs(4)) + 6 * 4 + 4 * 2 * 2
    )
    assert total == data


def test_async_save_next_to_training_collectives(jobs):
    saved, _ = jobs
    assert all(s["allreduce"] == SAVE_WORLD**20 for s in saved)
    assert saved[0]["async_ok"] is True
    assert all(s["async"] > 0 for s in saved)


def test_byte_collectives_over_gloo(jobs):
    _, loaded = jobs
    assert all(all(r["comm"]) and len(r["comm"]) == 11 for r in loaded), [r["comm"] for r in loaded]


def test_sub_group_saves_alone(jobs):
    saved, _ = jobs
    assert [s.get("sub_world") for s in saved] == [None, 2, 2, None]


def disagreeing_job(rank, world, root):
    import zarrckpt.torch as zc

    dtype = torch.float32 if rank == 0 else torch.float64
    zc.save({"layer": {"w": torch.zeros(3, dtype=dtype)}}, f"{root}/bad")


def dying_job(rank, world, root):
    import zarrckpt.torch as zc

    zc.save({"w": torch.zeros(3)}, f"{root}/first")  # the group is up
    if rank == 1:
        os._exit(3)
    zc.save({"w": torch.zeros(3)}, f"{root}/second")


def test_errors_on_every_rank(tmp_path):
    out = distributed.run(2, disagreeing_job, str(tmp_path), expect_failure=True)
    assert [o["type"] for o in out] == ["PlanError", "PlanError"], out
    assert all("`layer/w`" in o["error"] and "float64" in o["error"] for o in out), out
    assert not (tmp_path / "bad" / "zarr.json").exists()


def test_a_dead_rank_is_an_error_not_a_hang(tmp_path):
    os.environ["ZARRCKPT_TIMEOUT_S"] = "60"
    try:
        out = distributed.run(2, dying_job, str(tmp_path), expect_failure=True)
    finally:
        del os.environ["ZARRCKPT_TIMEOUT_S"]
    assert out[0]["type"] == "CommError", out[0]
    assert "rank 0" in out[0]["error"]
    assert not (tmp_path / "second" / "zarr.json").exists()


# Failing together: one rank's error reaches every rank at once. ZARRCKPT_TIMEOUT_S is set
# far above the harness's bound, so a rank left waiting shows up as "hung" (a failure), never
# as a timeout error that would pass for an agreed one.
AGREE_LIMIT_S = 120


def _failing(world, fn, *args):
    os.environ["ZARRCKPT_TIMEOUT_S"] = "900"
    try:
        return distributed.run(world, fn, *args, expect_failure=True, timeout=AGREE_LIMIT_S)
    finally:
        del os.environ["ZARRCKPT_TIMEOUT_S"]


def _readme_state(rank):
    import zarrckpt.torch as zc

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return {
        "model": model,
        "step": 1200,
        "rng": zc.PerRank(torch.full((8,), rank, dtype=torch.uint8)),
    }


def per_rank_job(rank, world, root, mode):
    import zarrckpt.torch as zc

    state = _readme_state(rank)
    if mode == "save":
        zc.save(state, f"{root}/ckpt")
        return None
    state["model"].weight.data.zero_()
    state["rng"].value.fill_(100 + rank)  # what a rank holds before loading
    if mode in ("skip", "by_rank"):
        report = zc.load(state, f"{root}/ckpt", per_rank=mode)
        return {
            "skipped": report["per_rank_skipped"],
            "rng": state["rng"].value.tolist(),
            "weight": state["model"].weight.sum().item(),
        }
    zc.load(state, f"{root}/ckpt")


def test_per_rank_values_at_a_new_world_size_are_refused_on_every_rank(tmp_path):
    """The README's state saved by 2 ranks, loaded by 3: rank 2 has no saved rng. Every rank
    raises the same error (before: rank 2 raised, ranks 0 and 1 waited in a collective)."""
    distributed.run(2, per_rank_job, str(tmp_path), "save")
    out = _failing(3, per_rank_job, str(tmp_path), "load")
    assert [o["type"] for o in out] == ["InvalidArgumentError"] * 3, out
    assert len({o["error"] for o in out}) == 1, out
    assert "`rng`" in out[0]["error"] and "saved by 2 ranks, this job has 3" in out[0]["error"]
    # Opting in: per-rank values stay as they are, the rest loads.
    got = distributed.run(3, per_rank_job, str(tmp_path), "skip")
    assert [g["skipped"] for g in got] == [["rng"]] * 3
    assert [g["rng"] for g in got] == [[100 + r] * 8 for r in range(3)]
    torch.manual_seed(0)
    want = torch.nn.Linear(4, 2).weight.sum().item()
    assert all(g["weight"] == want for g in got), (got, want)
    # Or by rank: ranks 0 and 1 take the values their ranks saved, rank 2 keeps its own.
    got = distributed.run(3, per_rank_job, str(tmp_path), "by_rank")
    assert [g["skipped"] for g in got] == [[], [], ["rng"]]
    assert [g["rng"] for g in got] == [[0] * 8, [1] * 8, [102] * 8]


def one_rank_fails_job(rank, world, root, where):
    import zarrckpt._core as core
    import zarrckpt.torch as zc

    bad = rank == world - 1
    if where == "save":
        # A leaf zarrckpt does not save, on one rank only: refused while flattening.
        zc.save({"w": torch.zeros(3), "x": object() if bad else 1}, f"{root}/s")
    elif where == "load":
        zc.save({"w": torch.zeros(3)}, f"{root}/l")
        zc.load({"w": torch.zeros(3), "extra": {1, 2} if bad else torch.zeros(3)}, f"{root}/l")
    elif where == "core":
        # A key the core refuses before its first collective (checked natively).
        key = "../escape" if bad else "w"
        t = torch.zeros(3)
        core.save(
            f"{root}/c", [core.Piece(key, t, (3,), (0,), replica="auto")], comm=core.communicator()
        )
    elif where == "async":
        h = zc.async_save({"w": torch.zeros(3), "x": object() if bad else 1}, f"{root}/a")
        h.wait()


@pytest.mark.parametrize("where", ["save", "load", "core", "async"])
def test_an_error_on_one_rank_reaches_every_rank(tmp_path, where):
    out = _failing(3, one_rank_fails_job, str(tmp_path), where)
    types = [o["type"] for o in out]
    assert types == ["InvalidArgumentError"] * 3, out
    own = out[2]["error"]
    for o in out[:2]:
        assert o["error"] == f"rank 2 failed: {own}", out
    assert not (tmp_path / "s" / "zarr.json").exists()


TORCHRUN_SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    import zarrckpt, zarrckpt.torch as zc
    dist.init_process_group("gloo")  # as a training script does under torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    path = sys.argv[1]
    zc.save({"w": zc.PerRank(torch.full((3,), rank)), "n": world}, path)
    t = {"w": zc.PerRank(torch.zeros(3, dtype=torch.int64)), "n": 0}
    zc.load(t, path)
    assert t["n"] == world and t["w"].value.tolist() == [rank] * 3
    dist.barrier()
    if rank == 0:
        print("torchrun ok", zarrckpt.open(path).world_size)
    dist.destroy_process_group()
""")


def test_torchrun_with_an_initialised_process_group(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    out = distributed.torchrun(script, tmp_path / "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "torchrun ok 2" in out.stdout


def all_reduce_job(rank, world):
    """One all-reduce through TorchComm (byte-wise maximum of 1,000 bytes per rank): whether
    the result is right, and the bytes this rank received."""
    from zarrckpt import _core, _native

    comm = _core.communicator()
    mine = bytes((rank * 37 + i) % 256 for i in range(1000))
    before = comm.received_bytes
    got = _native.all_reduce_max(comm, mine)
    want = bytes(max((r * 37 + i) % 256 for r in range(world)) for i in range(1000))
    return {"ok": got == want, "received": comm.received_bytes - before}


def test_an_all_reduce_through_torchcomm_receives_a_few_messages_per_rank():
    """The agreement's all-reduce is the library's tree over TorchComm's point-to-point
    transfers: a rank receives its children's partial results and the result (each with a
    16-byte header), whatever the world size; an all-gather would give each of the 9 ranks
    the 8 others' messages."""
    out = distributed.run(9, all_reduce_job)
    assert all(o["ok"] for o in out), out
    received = [o["received"] for o in out]
    assert max(received) <= 3 * (1000 + 16), received
    # Leaves (ranks 4 to 8) receive the result only.
    assert received[4:] == [1000 + 16] * 5, received
