"""Megatron save / load: zarrckpt.megatron against Megatron's own torch_dist, same state.

    python python/tests/bench_megatron.py [--hidden 1024] [--layers 8] [--vocab 32768]

A GPTModel (bf16) built with TP 2 x PP 2 on 4 processes saves with each backend; 3 processes
(TP 1 x PP 1, data parallel 3) load it back. Prints seconds and GB/s of the state's bytes
(warm page cache: each checkpoint is written, then read right away). A benchmark: it prints
figures and asserts nothing about speed. Not collected by pytest (file name).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_megatron as tm  # noqa: E402
import torch  # noqa: E402


def build(tp: int, pp: int, a):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tp, pp)
    cfg = TransformerConfig(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.hidden // 64,
        num_query_groups=max(1, a.hidden // 256),
        ffn_hidden_size=a.hidden * 4,
        use_cpu_initialization=True,
        perform_initialization=False,
        gated_linear_unit=True,
        normalization="RMSNorm",
        params_dtype=torch.bfloat16,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=a.vocab,
        max_sequence_length=128,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    )
    with torch.no_grad():  # random contents (all-zero subchunks would be stored sparsely)
        for p in model.parameters():
            p.normal_()
    return model


def _bytes(sd) -> int:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sd)
    n = 0
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor) and all(r == 0 for r in sh.replica_id):
            n += sh.data.numel() * sh.data.element_size()
    return n


def bench_save(rank: int, world: int, ckpt: str, backend: str, a):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import zarrckpt.megatron as zm

    model = build(2, 2, a)
    t = torch.tensor([_bytes(model.sharded_state_dict())], dtype=torch.int64)
    dist.all_reduce(t)
    if rank == 0:
        Path(ckpt).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sd = model.sharded_state_dict()
    t0 = time.perf_counter()
    if backend == "zarrckpt":
        zm.save(sd, ckpt)
    else:
        dist_checkpointing.save(sd, ckpt)
    dist.barrier()
    dt = time.perf_counter() - t0
    if rank == 0:
        gb = int(t.item()) / 1e9
        print(f"save {backend:9s} TP2xPP2 on 4: {dt:6.2f} s  {gb / dt:5.2f} GB/s  ({gb:.3f} GB)")


def bench_load(rank: int, world: int, ckpt: str, backend: str, a):
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    import zarrckpt.megatron as zm

    model = build(1, 1, a)
    sd = model.sharded_state_dict()
    gb = _bytes(model.sharded_state_dict()) / 1e9
    dist.barrier()
    t0 = time.perf_counter()
    state = (zm.load if backend == "zarrckpt" else dist_checkpointing.load)(sd, ckpt)
    dist.barrier()
    dt = time.perf_counter() - t0
    model.load_state_dict(state)
    if rank == 0:
        print(
            f"load {backend:9s} TP1xPP1xDP3 on 3: {dt:6.2f} s  {gb / dt:5.2f} GB/s per rank "
            f"({gb:.3f} GB each)"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dir", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        d = Path(d)
        for backend in ("torch_dist", "zarrckpt"):
            ckpt = d / backend
            tm.run(4, bench_save, d, ckpt=str(ckpt), backend=backend, a=a)
            tm.run(3, bench_load, d, ckpt=str(ckpt), backend=backend, a=a)
            size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
            entries = len(list(ckpt.rglob("*")))
            print(f"      {backend:9s} on disk: {size / 1e9:.3f} GB, {entries} entries")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
