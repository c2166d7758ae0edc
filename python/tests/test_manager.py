"""zarrckpt.manager.CheckpointManager: one checkpoint per step through one saver (objects,
asynchronous saves, keep-N, latest), in one process, on two gloo processes, and under
torchrun."""

from __future__ import annotations

import textwrap

import distributed
import pytest
import torch

import zarrckpt
from zarrckpt.manager import CheckpointManager


def state_of(step: int) -> dict:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + step,
        "iteration": step,
        "rng": bytes([step % 256]) * 8,
        "sched": {"lr": 0.1 / (step + 1), "milestones": [1, 2, step]},
    }


def blank() -> dict:
    return {
        "w": torch.zeros(3, 4),
        "iteration": 0,
        "rng": b"",
        "sched": {"lr": 0.0, "milestones": [0, 0, 0]},
    }


def test_steps_saved_sync_and_async_keep_the_last_n_and_resume(tmp_path):
    root = tmp_path / "run"
    m = CheckpointManager(root, keep_last=2, keep_every=4, staging_bytes=1 << 20)
    assert m.latest() is None and m.steps() == []
    assert m.load_latest(blank()) is None
    for step in range(1, 7):
        state = state_of(step)
        if step % 2:
            m.save(step, state)
        else:
            h = m.async_save(step, state)
            state["w"].fill_(-1.0)  # training goes on: what was staged is what is saved
            state["iteration"] = -1
            h.wait()
    # Steps 5 and 6 are the last two; 4 is a multiple of keep_every; the rest are gone.
    assert [s.step for s in m.steps()] == [4, 5, 6]
    assert all(s.complete and s.bytes > 0 for s in m.steps())
    assert m.latest() == 6
    assert (root / "latest").read_text() == "step-00000006\n"
    assert m.step_dir(6) == str(root / "step-00000006")
    out = blank()
    assert m.load_latest(out) == 6
    want = state_of(6)
    assert torch.equal(out["w"], want["w"])
    assert out["iteration"] == 6 and out["rng"] == want["rng"] and out["sched"] == want["sched"]
    # The whole training state is in the step: tensors and objects.
    ck = zarrckpt.open(m.step_dir(6))
    assert set(ck.tensors) == {"w"}
    assert ck.object("iteration") == 6 and ck.object("rng") == want["rng"]


def test_an_incomplete_later_step_is_skipped(tmp_path):
    root = tmp_path / "run"
    m = CheckpointManager(root)
    m.save(3, state_of(3))
    (root / "step-00000009" / "tensors").mkdir(parents=True)  # a crashed save
    assert m.latest() == 3
    assert [(s.step, s.complete) for s in m.steps()] == [(3, True), (9, False)]
    out = blank()
    assert m.load_latest(out) == 3 and out["iteration"] == 3


def test_a_step_saved_again_replaces_the_earlier_one(tmp_path):
    m = CheckpointManager(tmp_path / "run")
    m.save(1, state_of(1))
    m.async_save(1, state_of(2)).wait()
    out = blank()
    assert m.load_latest(out) == 1 and out["iteration"] == 2


def ranks_job(rank, world, root):
    """Two ranks: replicated and per-rank state saved asynchronously for three steps (keep
    the last two), then a step whose JSON value differs between ranks, which fails at the
    call on every rank (a planning error), then a resume into fresh state."""
    import torch

    import zarrckpt.torch as zc
    from zarrckpt.manager import CheckpointManager

    m = CheckpointManager(root, keep_last=2)
    for step in (10, 20, 30):
        state = {
            "w": torch.full((4, 5), float(step)),
            "mine": zc.PerRank(torch.full((3,), step + rank, dtype=torch.int64)),
            "step": step,
        }
        h = m.async_save(step, state)
        state["w"].zero_()
        h.wait()
    error = None
    try:
        m.async_save(40, {"w": torch.zeros(4, 5), "step": rank})
    except zarrckpt.ZarrckptError as e:
        error = str(e)
    out = {
        "w": torch.zeros(4, 5),
        "mine": zc.PerRank(torch.zeros(3, dtype=torch.int64)),
        "step": 0,
    }
    got = m.load_latest(out)
    return {
        "latest": got,
        "step": out["step"],
        "w": out["w"].sum().item(),
        "mine": out["mine"].value.tolist(),
        "steps": [s.step for s in m.steps()],
        "error": error,
    }


def test_two_ranks_save_asynchronously_and_resume(tmp_path):
    import zarrckpt  # noqa: F401  (the spawned ranks import it too)

    out = distributed.run(2, ranks_job, str(tmp_path / "run"))
    for rank, o in enumerate(out):
        assert o["latest"] == 30 and o["step"] == 30
        assert o["w"] == 30.0 * 20
        assert o["mine"] == [30 + rank] * 3
        assert o["steps"] == [20, 30]
        assert o["error"] is not None and "step" in o["error"], o
    assert not (tmp_path / "run" / "step-00000040" / "zarr.json").exists()


TORCHRUN_SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    import zarrckpt.torch as zc
    from zarrckpt.manager import CheckpointManager
    dist.init_process_group("gloo")  # as a training script does under torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m = CheckpointManager(sys.argv[1], keep_last=1)
    state = {"model": model, "optim": opt, "step": 0, "rank": zc.PerRank(rank)}
    for step in range(1, 4):
        with torch.no_grad():
            model.weight.add_(1.0)
        state["step"] = step
        m.async_save(step, state)
    m.load_latest(state)  # waits for the save in flight first
    fresh = torch.nn.Linear(4, 3)
    new = {"model": fresh, "optim": torch.optim.SGD(fresh.parameters(), lr=0.1), "step": 0,
           "rank": zc.PerRank(-1)}
    assert m.load_latest(new) == 3
    assert torch.equal(fresh.weight, model.weight) and new["step"] == 3
    assert new["rank"].value == rank
    assert [s.step for s in m.steps()] == [3]
    dist.barrier()
    if rank == 0:
        print("manager ok", m.latest())
    dist.destroy_process_group()
""")


def test_manager_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    out = distributed.torchrun(script, tmp_path / "run")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "manager ok 3" in out.stdout


@pytest.mark.parametrize("keep_every", [None, 2])
def test_retention_options(tmp_path, keep_every):
    m = CheckpointManager(tmp_path / "run", keep_last=1, keep_every=keep_every)
    for step in range(1, 5):
        m.save(step, state_of(step))
    want = [4] if keep_every is None else [2, 4]
    assert [s.step for s in m.steps()] == want
