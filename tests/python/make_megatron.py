"""Writes a Megatron-LM torch_dist checkpoint with the venv's megatron-core for
tests/megatron_import.rs (one gloo process; no zarrckpt involved)::

    make_megatron.py OUT MARKER

OUT: tensors (two dtypes, a 0-d one), a ShardedObject and common.pt holding what Megatron-LM's
common state holds. OUT.expect/KEY.bin: each tensor's raw bytes. OUT.hostile/: replacements
for common.pt: enum.pt (an enum member), evil.pt (a pickle calling os.system to touch MARKER),
lying.pt (a numpy array whose shape claims 2**40 elements over 8 bytes of data).
"""

import argparse
import enum
import io
import os
import sys
import warnings
import zipfile

import numpy as np
import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor  # noqa: E402


class Phase(enum.Enum):
    WARMUP = 1


class Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Lying:
    def __reduce__(self):
        rec = np._core.multiarray._reconstruct
        state = (1, (1 << 40,), np.dtype("<i8"), False, b"\0" * 8)
        return (rec, (np.ndarray, (0,), b"b"), state)


def common() -> dict:
    args = argparse.Namespace(
        hidden_size=64, params_dtype=torch.bfloat16, lr=3e-4, seed=7, data_path=["a", "b"]
    )
    return {
        "args": args,
        "iteration": 1234,
        "checkpoint_version": 3.0,
        "num_floating_point_operations_so_far": 1.5e18,
        "optimizer": {"param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0, 1]}]},
        "rng_tracker": torch.tensor([1, 2, 3], dtype=torch.uint8),
        "np": np.arange(6, dtype=np.int32).reshape(2, 3),
        "npf": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
        "np_scalar": np.float32(0.5),
        "np_bool": np.bool_(True),
        "sets": ({1, 2}, frozenset({"x"})),
        "extra": io.BytesIO(b"te-extra"),
        "by_int": {1: "a", (2, 3): "b", None: float("nan")},
        "text": "h\u00e9 \"q\"\n",
    }


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 6, generator=g)
    e = torch.randn(5, 2, generator=g).to(torch.bfloat16)
    s = torch.tensor(2.5, dtype=torch.float64)
    sd = {
        "w": ShardedTensor.from_rank_offsets("decoder.w", w, replica_id=0),
        "e": ShardedTensor.from_rank_offsets("embedding.e", e, replica_id=0),
        "s": ShardedTensor.from_rank_offsets("scale", s, replica_id=0),
        "obj": ShardedObject("decoder.extra", {"layer": 1, "t": torch.arange(3.0)}, (1,), (0,)),
    }
    sd.update(common())
    return sd


def main() -> None:
    out, marker = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{out}.init", rank=0, world_size=1)
    try:
        dist_checkpointing.save(state(), out)
    finally:
        dist.destroy_process_group()
    if os.path.exists(f"{out}.init"):
        os.remove(f"{out}.init")
    # torch.save's archive is what the importer reads; check it is one.
    assert zipfile.is_zipfile(os.path.join(out, "common.pt"))
    os.makedirs(f"{out}.expect", exist_ok=True)
    for v in state().values():
        if isinstance(v, ShardedTensor):
            raw = v.data.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            with open(f"{out}.expect/{v.key}.bin", "wb") as f:
                f.write(raw)
    hostile = f"{out}.hostile"
    os.makedirs(hostile, exist_ok=True)
    torch.save({"phase": Phase.WARMUP}, os.path.join(hostile, "enum.pt"))
    torch.save({"x": Evil(marker)}, os.path.join(hostile, "evil.pt"))
    torch.save({"x": Lying()}, os.path.join(hostile, "lying.pt"))


if __name__ == "__main__":
    main()
