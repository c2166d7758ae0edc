"""Runs a function on N ranks (spawned processes, gloo over loopback) for the tests."""

from __future__ import annotations

import json
import os
import tempfile
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
            json.dump({"ok": False, "type": type(e).__name__, "error": str(e),
                       "trace": traceback.format_exc()}, f)
        raise
    finally:
        dist.destroy_process_group()


def run(world: int, fn: Callable, *args: Any, expect_failure: bool = False) -> list[Any]:
    """Runs ``fn(rank, world, *args)`` on ``world`` processes joined by a gloo group;
    returns each rank's (JSON) result, or with ``expect_failure`` each rank's outcome dict
    (``ok``, ``type``, ``error``)."""
    with tempfile.TemporaryDirectory() as d:
        store, out = os.path.join(d, "store"), os.path.join(d, "out")
        ctx = mp.start_processes(_entry, args=(world, store, out, fn, args), nprocs=world,
                                 join=False, start_method="spawn")
        failed = None
        try:
            while not ctx.join(timeout=300):
                pass
        except Exception as e:  # a rank raised or died
            failed = e
        outcomes = []
        for r in range(world):
            try:
                with open(f"{out}.{r}") as f:
                    outcomes.append(json.load(f))
            except FileNotFoundError:
                outcomes.append({"ok": False, "type": "Died", "error": "no outcome"})
        if expect_failure:
            return outcomes
        if failed is not None:
            msgs = [o.get("trace", o.get("error")) for o in outcomes if not o["ok"]]
            raise AssertionError("ranks failed:\n" + "\n".join(msgs)) from failed
        return [o["result"] for o in outcomes]
