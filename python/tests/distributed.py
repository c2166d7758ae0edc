"""Runs a function on N ranks (spawned processes, gloo over loopback) for the tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# Gloo binds to the loopback interface: no other address is ever used.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _entry(rank: int, world: int, store: str, out: str, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        with open(f"{out}.{rank}", "w") as f:
            json.dump({"ok": True, "result": result}, f)
    except BaseException as e:
        with open(f"{out}.{rank}", "w") as f:
            json.dump(
                {
                    "ok": False,
                    "type": type(e).__name__,
                    "error": str(e),
                    "trace": traceback.format_exc(),
                },
                f,
            )
        os._exit(1)  # peers may be gone: no collective teardown
    dist.destroy_process_group()


def run(
    world: int, fn: Callable, *args: Any, expect_failure: bool = False, timeout: float = 600
) -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` processes joined by a gloo group;
    returns each rank's (JSON) result, or with ``expect_failure`` each rank's outcome dict
    (``ok``, ``type``, ``error``). Every process is waited for (a rank that fails does not
    stop the others), at most ``timeout`` seconds in all."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as d:
        store, out = os.path.join(d, "store"), os.path.join(d, "out")
        procs = [
            ctx.Process(target=_entry, args=(r, world, store, out, fn, args), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes = []
        for r in range(world):
            try:
                with open(f"{out}.{r}") as f:
                    outcomes.append(json.load(f))
            except FileNotFoundError:
                why = "hung" if r in hung else f"exit code {procs[r].exitcode}"
                outcomes.append({"ok": False, "type": "Died", "error": f"no outcome ({why})"})
        if expect_failure:
            return outcomes
        if any(not o["ok"] for o in outcomes):
            msgs = [o.get("trace", o.get("error")) for o in outcomes if not o["ok"]]
            raise AssertionError("ranks failed:\n" + "\n".join(msgs))
        return [o["result"] for o in outcomes]


def torchrun(
    script: os.PathLike | str, *args: Any, nproc: int = 2, cwd: Any = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Starts ``script`` (with ``args``) under torchrun on ``nproc`` CPU processes, gloo over
    loopback and one thread each, as a user would; returns the finished process."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            str(script),
            *map(str, args),
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
