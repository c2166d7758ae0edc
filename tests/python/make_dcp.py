"""Writes DCP checkpoints with the venv's torch for tests/dcp_import.rs.

    make_dcp.py good OUT   # a 2-rank gloo save (a DTensor sharded on dim 0, replicated
                           # tensors, plain-data values, bytes), plus OUT.expect/: every
                           # tensor as torch's own DCP load returns it (raw bytes) and the
                           # objects (objects.json)
    make_dcp.py evil OUT MARKER   # OUT/.metadata is a pickle calling os.system (touch MARKER)
    make_dcp.py huge OUT   # a tensor whose metadata declares 2**40 x 2**40 elements
    make_dcp.py object OUT # a value that is not plain data (a set)
"""

import json
import os
import pickle
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

warnings.filterwarnings("ignore")


def state(rank: int, world: int) -> dict:
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    w = torch.randn(7, 5, generator=g)
    return {
        "model": {
            "w": distribute_tensor(w, mesh, [Shard(0)]),
            "emb": torch.randn(4, 3, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "ids": torch.arange(10, dtype=torch.int64),
        },
        "step": 42,
        "cfg": {"lr": 0.001, "name": "run", "betas": [0.9, 0.95], "flag": True, "none": None},
        "blob": b"\x00\x01raw",
    }


def worker(rank: int, world: int, out: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    dcp.save(state(rank, world), checkpoint_id=out)
    dist.barrier()
    dist.destroy_process_group()


def good(out: str) -> None:
    import torch.multiprocessing as mp

    init = "file://" + out + ".init"
    mp.spawn(worker, args=(2, out, init), nprocs=2, join=True)
    # torch's own DCP load, in one process, into full plain tensors.
    md = dcp.FileSystemReader(out).read_metadata()
    want = {}
    for fqn, e in md.state_dict_metadata.items():
        if hasattr(e, "size"):
            want[fqn] = torch.empty(tuple(e.size), dtype=e.properties.dtype)
    dcp.load(want, checkpoint_id=out, no_dist=True)
    exp = out + ".expect"
    os.makedirs(exp)
    index = {}
    for fqn, t in want.items():
        key = "/".join(str(p) for p in md.planner_data.get(fqn, (fqn,)))
        name = key.replace("/", "__")
        t.contiguous().reshape(-1).view(torch.uint8).numpy().tofile(f"{exp}/{name}.bin")
        index[key] = {"file": f"{name}.bin", "dtype": str(t.dtype).removeprefix("torch."),
                      "shape": list(t.shape)}
    objs = {"step": 42, "cfg/lr": 0.001, "cfg/name": "run", "cfg/betas": [0.9, 0.95],
            "cfg/flag": True, "cfg/none": None}
    with open(f"{exp}/index.json", "w") as f:
        json.dump({"tensors": index, "objects": objs, "blob": list(b"\x00\x01raw")}, f)


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def evil(out: str, marker: str) -> None:
    dcp.save({"x": torch.ones(3)}, checkpoint_id=out, no_dist=True)
    with open(os.path.join(out, ".metadata"), "wb") as f:
        pickle.dump(Evil(marker), f)


def huge(out: str) -> None:
    dcp.save({"x": torch.ones(3)}, checkpoint_id=out, no_dist=True)
    p = os.path.join(out, ".metadata")
    with open(p, "rb") as f:
        md = pickle.load(f)
    md.state_dict_metadata["x"].size = torch.Size([2**40, 2**40])
    with open(p, "wb") as f:
        pickle.dump(md, f)


def obj(out: str) -> None:
    dcp.save({"x": torch.ones(3), "odd": {1, 2}}, checkpoint_id=out, no_dist=True)


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    {"good": lambda: good(out), "evil": lambda: evil(out, sys.argv[3]),
     "huge": lambda: huge(out), "object": lambda: obj(out)}[mode]()
