"""Bytes each rank receives through TorchComm (gloo over loopback) in the agreement of a save
(100 row-sharded DTensors) and in one all-reduce of 1,000 bytes, per world size.

    python python/tests/bench_agreement.py 8,16
"""

from __future__ import annotations

import json
import sys
import tempfile

import distributed
import torch


def job(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import zarrckpt.torch as zc
    from zarrckpt import _core, _native

    mesh = init_device_mesh("cpu", (world,))
    local = torch.full((4, 8), float(rank))
    state = {
        f"layer{i}": {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)}
        for i in range(100)
    }
    comm = _core.communicator()
    zc.save(state, f"{root}/warm")
    before = comm.received_bytes
    zc.save(state, f"{root}/ckpt")
    save = comm.received_bytes - before
    before = comm.received_bytes
    _native.all_reduce_max(comm, bytes(1000))
    return {"save": save, "all_reduce": comm.received_bytes - before}


def main() -> None:
    for world in [int(w) for w in sys.argv[1].split(",")]:
        with tempfile.TemporaryDirectory() as d:
            out = distributed.run(world, job, d)
        for k in ("save", "all_reduce"):
            v = sorted(o[k] for o in out)
            row = {"world": world, "what": k, "median": v[len(v) // 2], "max": v[-1]}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
