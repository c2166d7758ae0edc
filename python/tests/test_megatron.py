"""zarrckpt.megatron with the real megatron-core package on CPU (gloo, several processes).

A real GPTModel (local layer spec: GQA, SwiGLU through a ShardedTensorFactory, RMSNorm
replicated across tensor-parallel ranks, pipeline stages stacking layers on a prepended axis)
is saved with tensor x pipeline parallelism 2 x 2 on 4 processes and loaded with TP 1 x PP 1
on 3 processes (data parallel 3), and in the other direction on 2 processes (TP 2 -> PP 2).
Next to the model: the distributed optimizer's `dp_reshardable` state as Megatron builds it
(each bucket one 1-D tensor, several pieces of it per rank cut at parameter boundaries and
padding), resharded from 4 data-parallel ranks to 3; ShardedObjects (per layer, with replicas)
holding tensors, arrays, tuples, bytes, NaN; common state (an argparse Namespace with a torch
dtype, the optimizer's param_groups, the iteration). Every element of every tensor is written
with bits derived from its key and global index, and every loaded element is compared with
them bit for bit; objects and common values are compared exactly.

On a machine without a GPU megatron-core needs two CUDA calls replaced
(`torch.cuda.synchronize`, `torch.cuda.current_device`); see /work/shared/notes/peers.md.
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import math
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

HERE = Path(__file__).resolve().parent
TIMEOUT_S = float(os.environ.get("ZARRCKPT_TEST_TIMEOUT_S", "600"))


def _cpu_only_patches() -> None:
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"


_cpu_only_patches()

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.dict_utils import nested_values  # noqa: E402
from megatron.core.dist_checkpointing.mapping import (  # noqa: E402
    ShardedObject,
    ShardedTensor,
    apply_factories,
)

import zarrckpt.megatron as zm  # noqa: E402

# --- deterministic contents ------------------------------------------------------------------


def _key_hash(key: str) -> int:
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


def expected_bits(key: str, dtype, global_shape, offset, extent) -> torch.Tensor:
    """The bits of the elements of box (offset, extent) of global tensor `key`, as a tensor of
    `dtype`: a hash of the key and of each element's global flat index."""
    flat = torch.zeros(tuple(extent), dtype=torch.int64)
    stride = 1
    for d in reversed(range(len(global_shape))):
        idx = torch.arange(offset[d], offset[d] + extent[d], dtype=torch.int64) * stride
        shape = [1] * len(extent)
        shape[d] = extent[d]
        flat = flat + idx.reshape(shape)
        stride *= global_shape[d]
    h = (flat * 2654435761 + _key_hash(key)) % (1 << 32)
    h = (h ^ (h >> 13)) * 1274126177 % (1 << 32)
    width = torch.empty(0, dtype=dtype).element_size()
    if width == 8:
        bits = (h << 32) | ((h * 40503) % (1 << 32))
        return bits.view(dtype)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]
    if width == 4:
        bits = torch.where(h >= (1 << 31), h - (1 << 32), h).to(torch.int32)
    elif width == 2:
        low = h % (1 << 16)
        bits = torch.where(low >= (1 << 15), low - (1 << 16), low).to(torch.int16)
    else:
        bits = (h % 256).to(torch.uint8)
    if dtype == torch.bool:
        return (bits % 2).to(torch.bool)
    return bits.to(ints).view(dtype)


def box_of(sh: ShardedTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    p = sh.prepend_axis_num
    return tuple(sh.global_offset), (1,) * p + tuple(sh.local_shape)


def expected_for(sh: ShardedTensor) -> torch.Tensor:
    offset, extent = box_of(sh)
    return expected_bits(sh.key, sh.dtype, sh.global_shape, offset, extent).reshape(sh.local_shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# --- objects and common state ----------------------------------------------------------------


class Phase(enum.Enum):
    WARMUP = 1
    STABLE = 2


def object_value(layer: int, portable: bool = False):
    """What a per-layer ShardedObject holds: the value types Megatron-LM's state carries.
    `portable`: without the test's own enum class, which torch's restricted unpickler (and so
    Megatron's torch_dist format, read with it) does not know."""
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3) + layer
    if portable:
        value = object_value(layer)
        del value["phase"]
        return value
    return {
        "layer": layer,
        "weights": t.to(torch.bfloat16),
        "counts": np.arange(4, dtype=np.int64) * layer,
        "rng": ("MT19937", np.arange(5, dtype=np.uint32), layer, 0, 0.0),
        "raw": bytes([layer, 0, 255]),
        "extra_state": io.BytesIO(b"te-extra-%d" % layer),
        "nan": float("nan"),
        "by_int": {1: "a", (2, 3): "b"},
        "phase": Phase.STABLE,
        None: [None, True, -0.0, math.inf],
    }


def common_state(torch_loadable: bool = False) -> dict:
    """Common state as Megatron-LM has it. `torch_loadable`: without the enum member, which
    Megatron's own common.pt (torch.load with weights_only) refuses."""
    args = argparse.Namespace(
        hidden_size=64,
        params_dtype=torch.bfloat16,
        lr=3e-4,
        seed=7,
        data_path=["a", "b"],
    )
    if not torch_loadable:
        args.phase = Phase.WARMUP
    return {
        "args": args,
        "iteration": 1234,
        "checkpoint_version": 3.0,
        "num_floating_point_operations_so_far": 1.5e18,
        "optimizer": {
            "param_groups": [
                {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "params": [0, 1, 2], "step": 10},
                {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "params": [3], "step": 10},
            ]
        },
        "rng_tracker": torch.tensor([1, 2, 3], dtype=torch.uint8),
    }


def add_common(sd: dict, torch_loadable: bool) -> None:
    """Merges the common state into a sharded state dict (the optimizer's param_groups go next
    to its sharded param_state, as in Megatron)."""
    for k, v in common_state(torch_loadable).items():
        if isinstance(v, dict) and isinstance(sd.get(k), dict):
            sd[k].update(v)
        else:
            sd[k] = v


def assert_same(a, b, path="value"):
    """Exact equality of decoded values (types, tensors by bits, NaN == NaN)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and same_bits(a, b), path
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, io.BytesIO):
        assert isinstance(b, io.BytesIO) and a.getvalue() == b.getvalue(), path
    elif isinstance(a, argparse.Namespace):
        assert isinstance(b, argparse.Namespace), path
        assert_same(vars(a), vars(b), path)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, a, b)
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), (path, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    elif isinstance(a, float):
        assert type(b) is float and math.copysign(1, a) == math.copysign(1, b) and a == b, path
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


# --- the distributed optimizer's dp_reshardable buckets --------------------------------------

# (key prefix, dtype, parameter sizes); each bucket is the parameters one after the other, every
# parameter starting at a multiple of 64 elements (the gaps are intra-bucket padding).
BUCKETS = [
    (
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_torch.float32.bucket_idx_0",
        torch.float32,
        [300, 77, 1000, 5],
    ),
    (
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_torch.float32.bucket_idx_1",
        torch.float32,
        [4096, 130],
    ),
    (
        "optimizer.distributed.dp_group_idx_0.gbuf_idx_1.dtype_torch.bfloat16.bucket_idx_0",
        torch.bfloat16,
        [999, 64, 63],
    ),
]
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


def _bucket_layout(sizes: list[int]) -> tuple[list[tuple[int, int]], int]:
    spans, pos = [], 0
    for n in sizes:
        pos += -pos % 64
        spans.append((pos, pos + n))
        pos += n
    return spans, pos  # unpadded numel: the end of the last parameter


def dp_reshardable_state(dp_rank: int, dp_size: int, allocate: bool) -> dict:
    """Megatron's `sharded_param_state_dp_reshardable` structure for this rank: per bucket and
    state key, one ShardedTensor per parameter (or padding) range inside this rank's
    contiguous DP range, all with the bucket's key; per_bucket_numel ShardedObjects with a
    DP replica id."""
    state: dict = {}
    for b, (prefix, dtype, sizes) in enumerate(BUCKETS):
        spans, unpadded = _bucket_layout(sizes)
        padded = unpadded + (-unpadded % (dp_size * 128))
        local = padded // dp_size
        lo, hi = dp_rank * local, min((dp_rank + 1) * local, unpadded)
        hi = max(hi, lo)  # a rank whose range is all bucket padding holds nothing
        cuts = sorted(
            {lo, hi, *(s for s, _ in spans if lo < s < hi), *(e for _, e in spans if lo < e < hi)}
        )
        pieces = []
        for start, stop in zip(cuts, cuts[1:], strict=False):
            entry = {}
            for name in STATE_KEYS:
                key = f"{prefix}.{name}"
                data = None
                if allocate:
                    data = torch.empty(stop - start, dtype=dtype)
                entry[name] = ShardedTensor(
                    key,
                    data,
                    dtype,
                    (stop - start,),
                    (unpadded,),
                    (start,),
                    axis_fragmentations=None,
                    replica_id=(0, 0, 0),
                )
            pieces.append(entry)
        state[b] = pieces
    for name in ("per_bucket_numel", "per_bucket_numel_unpadded"):
        state[name] = ShardedObject(
            f"optimizer.distributed.dp_group_idx_0.{name}",
            {0: {"torch.float32": [_bucket_layout(s)[1] for _, _, s in BUCKETS]}},
            (1,),
            (0,),
            replica_id=(0, 0, dp_rank),
        )
    return state


def fill(sharded_state_dict) -> int:
    """Writes the expected bits into every ShardedTensor's data (views of the model's
    parameters after factories); returns the number of elements written."""
    n = 0
    with torch.no_grad():
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedTensor):
                if sh.data is None:
                    sh.data = torch.empty(sh.local_shape, dtype=sh.dtype)
                sh.data.copy_(expected_for(sh))
                n += sh.data.numel()
    return n


def check(sharded_state_dict) -> int:
    bad, n = [], 0
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            n += sh.data.numel()
            if not same_bits(sh.data.detach(), expected_for(sh)):
                bad.append(f"{sh.key} at {sh.global_offset}")
    assert not bad, f"{len(bad)} tensors differ: {bad[:5]}"
    return n


# --- processes -------------------------------------------------------------------------------


def _worker(rank: int, world: int, init_file: str, scenario: str, kwargs: dict) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    _cpu_only_patches()
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn = scenario if callable(scenario) else SCENARIOS[scenario]
        fn(rank=rank, world=world, **kwargs)
        dist.barrier()
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run(world: int, scenario, tmp_path: Path, **kwargs) -> None:
    """Runs `scenario` on `world` processes; fails with the first error, or after the time
    limit with every process ended (never a hang)."""
    import torch.multiprocessing as mp

    name = getattr(scenario, "__name__", scenario)
    init_file = tmp_path / f"init-{name}-{time.monotonic_ns()}"
    ctx = mp.start_processes(
        _worker,
        args=(world, str(init_file), scenario, kwargs),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            pytest.fail(f"{name} on {world} processes did not finish in {TIMEOUT_S} s")


# --- the model -------------------------------------------------------------------------------

NUM_LAYERS = 4


def build_gpt(tp: int, pp: int, seed: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    ps.initialize_model_parallel(tp, pp)
    torch.manual_seed(seed)
    cfg = TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        normalization="RMSNorm",
        params_dtype=torch.bfloat16,
        bf16=True,
        pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
    )
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=32,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    )


def layer_objects(model, tp_rank: int, dp_rank: int, portable: bool = False) -> dict:
    """One ShardedObject per layer of this pipeline stage (grid: all layers), replicated on the
    tensor-parallel ranks: Megatron's per-layer extra state shape."""
    from megatron.core import parallel_state as ps

    first = ps.get_pipeline_model_parallel_rank() * (
        NUM_LAYERS // ps.get_pipeline_model_parallel_world_size()
    )
    n = len(model.decoder.layers)
    return {
        f"layer_obj.{i}": ShardedObject(
            "test.layer_objects",
            object_value(first + i, portable),
            (NUM_LAYERS,),
            (first + i,),
            replica_id=(tp_rank, dp_rank),
        )
        for i in range(n)
    }


def ps_dp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank()


def full_state(
    model,
    tp_rank: int,
    dp_rank: int,
    dp_size: int,
    allocate: bool,
    factories: bool,
    portable: bool = False,
) -> dict:
    """The state dict a training job saves: the model's, with its factories applied (to fill
    the parameters through them) or not (for loading: Megatron applies and merges them)."""
    sd = {"model": model.sharded_state_dict()}
    if factories:
        apply_factories(sd)
    sd["objects"] = layer_objects(model, tp_rank, ps_dp_rank(), portable)
    sd["optimizer"] = {"param_state": dp_reshardable_state(dp_rank, dp_size, allocate)}
    return sd


def gpt_save(rank: int, world: int, tp: int, pp: int, ckpt: str, saver: str, async_save: bool):
    from megatron.core import parallel_state as ps

    model = build_gpt(tp, pp, seed=1)
    portable = saver == "torch_dist"
    sd = full_state(
        model,
        ps.get_tensor_model_parallel_rank(),
        rank,
        world,
        allocate=True,
        factories=True,
        portable=portable,
    )
    fill(sd)
    add_common(sd, torch_loadable=(saver != "zarrckpt"))
    if saver == "torch_dist":  # Megatron's own format (DCP files, common.pt)
        if rank == 0:
            Path(ckpt).mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        req = dist_checkpointing.save(sd, ckpt)
    elif saver == "zarrckpt":  # everything in zarrckpt, no pickle
        req = zm.save(sd, ckpt, async_sharded_save=async_save, content_metadata={"format": "test"})
    else:  # one argument: Megatron's own save with the zarrckpt strategy
        if rank == 0:  # Megatron-LM creates the directory before saving
            Path(ckpt).mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        req = dist_checkpointing.save(
            sd, ckpt, sharded_strategy=zm.SaveStrategy(), async_sharded_save=async_save
        )
    if req is not None:
        req.execute_sync()
    assert (Path(ckpt) / "metadata.json").exists()


def gpt_load(rank: int, world: int, tp: int, pp: int, ckpt: str, saved_by: str, loader: str):
    from megatron.core import parallel_state as ps

    model = build_gpt(tp, pp, seed=2)
    sd = full_state(
        model,
        ps.get_tensor_model_parallel_rank(),
        rank,
        world,
        allocate=(rank % 2 == 0),
        factories=False,
        portable=saved_by == "torch_dist",
    )
    before = {id(sh): sh.data for sh in nested_values(sd) if isinstance(sh, ShardedTensor)}
    load = zm.load if loader == "zarrckpt" else dist_checkpointing.load
    loaded = load(sd, ckpt)
    # The model's own loading path, then its state again from the model.
    model.load_state_dict(loaded["model"])
    after = {"model": model.sharded_state_dict()}
    apply_factories(after)
    n_model = check(after)
    assert n_model > 0
    # In place: the memory given is the memory filled.
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor) and before[id(sh)] is not None:
            assert sh.data.data_ptr() == before[id(sh)].data_ptr(), sh.key
    # Optimizer buckets, as loaded (returned in the state dict structure).
    opt = loaded["optimizer"]["param_state"]
    want = dp_reshardable_state(rank, world, allocate=True)
    fill(want)
    for b in range(len(BUCKETS)):
        assert len(opt[b]) == len(want[b])
        for got_entry, want_entry in zip(opt[b], want[b], strict=True):
            for name in STATE_KEYS:
                assert same_bits(got_entry[name], want_entry[name].data), (b, name)
    assert_same(opt["per_bucket_numel"], want["per_bucket_numel"].data)
    for name, obj in loaded["objects"].items():
        layer = int(name.rsplit(".", 1)[1])
        first = ps.get_pipeline_model_parallel_rank() * (
            NUM_LAYERS // ps.get_pipeline_model_parallel_world_size()
        )
        assert_same(object_value(first + layer, saved_by == "torch_dist"), obj, name)
    for k, v in common_state(torch_loadable=(saved_by != "zarrckpt")).items():
        if k == "optimizer":
            assert_same(v["param_groups"], loaded[k]["param_groups"], k)
        else:
            assert_same(v, loaded[k], k)
    if saved_by == "zarrckpt":
        assert loaded["content_metadata"] == {"format": "test"}


SCENARIOS = {"gpt_save": gpt_save, "gpt_load": gpt_load}


# --- tests -----------------------------------------------------------------------------------


def test_gpt_tp2_pp2_on_4_ranks_loads_as_tp1_pp1_on_3_ranks(tmp_path):
    ckpt = tmp_path / "iter_0000100"
    run(4, "gpt_save", tmp_path, tp=2, pp=2, ckpt=str(ckpt), saver="zarrckpt", async_save=False)
    # Nothing pickled: Megatron's marker and the zarrckpt checkpoint, no .pt file.
    # (zarrckpt's commit lock is a sibling of its checkpoint directory.)
    names = sorted(p.name for p in ckpt.iterdir() if not p.name.endswith("-lock"))
    assert names == ["metadata.json", "zarrckpt"], names
    assert not list(ckpt.rglob("*.pt"))
    cfg = dist_checkpointing.core.maybe_load_config(str(ckpt))
    assert (cfg.sharded_backend, cfg.common_backend) == ("zarrckpt", "zarrckpt")
    run(3, "gpt_load", tmp_path, tp=1, pp=1, ckpt=str(ckpt), saved_by="zarrckpt", loader="megatron")


def test_one_argument_switch_tp2_to_pp2_with_async_save(tmp_path):
    ckpt = tmp_path / "iter_0000200"
    run(2, "gpt_save", tmp_path, tp=2, pp=1, ckpt=str(ckpt), saver="megatron", async_save=True)
    cfg = dist_checkpointing.core.maybe_load_config(str(ckpt))
    assert (cfg.sharded_backend, cfg.common_backend) == ("zarrckpt", "torch")
    run(2, "gpt_load", tmp_path, tp=1, pp=2, ckpt=str(ckpt), saved_by="megatron", loader="zarrckpt")


def _without_save_id(data: bytes) -> bytes:
    """A checkpoint file's bytes with the save's random id zeroed: in JSON (``"save_id"``) and
    in a shard's footer (spec/format.md: the id and the footer's CRC-32C that covers it)."""
    data = re.sub(rb'"save_id": "[0-9a-f]{32}"', b'"save_id": ""', data)
    at = data.rfind(b"ZCKPFOOT")
    if at >= 0:
        n = int.from_bytes(data[at + 12 : at + 16], "little")
        chunks = int.from_bytes(data[at + 40 : at + 48], "little")
        crc = at + 48 + 8 * n + 4 * chunks
        data = data[: at + 16] + bytes(16) + data[at + 32 : crc] + bytes(4) + data[crc + 4 :]
    return data


def test_import_of_a_megatron_torch_dist_checkpoint(tmp_path):
    """A checkpoint megatron-core wrote in its own torch_dist format (TP2 x PP2 on 4 ranks:
    DCP files, .metadata, common.pt) imported into zarrckpt (every byte compared), then loaded
    by dist_checkpointing.load at TP1 x PP1 on 3 ranks, bit for bit."""
    import zarrckpt
    import zarrckpt.dcp as zd
    from zarrckpt._errors import ConversionError

    src = tmp_path / "iter_0000300"
    run(4, "gpt_save", tmp_path, tp=2, pp=2, ckpt=str(src), saver="torch_dist", async_save=False)
    cfg = dist_checkpointing.core.maybe_load_config(str(src))
    assert cfg.sharded_backend == "torch_dist"
    assert (src / "common.pt").exists() and (src / ".metadata").exists()
    assert list(src.glob("*.distcp"))
    dst = tmp_path / "imported" / "iter_0000300"
    # The library's importer (no torch, no pickle run): the objects' numpy arrays, the common
    # state's Namespace, dtype and tensors are read by its restricted reader.
    rep = zd.import_megatron(src, dst)
    assert rep["tensors"] > 10 and rep["objects"] >= NUM_LAYERS + 1
    cfg = dist_checkpointing.core.maybe_load_config(str(dst))
    assert (cfg.sharded_backend, cfg.common_backend) == ("zarrckpt", "zarrckpt")
    assert not list(dst.rglob("*.pt")) and not list(dst.rglob(".metadata"))
    ck = zarrckpt.open(dst / "zarrckpt")
    assert ck.verify()["problems"] == []
    # The layer axis of the pipeline stages is kept: [layers, ...].
    qkv = ck.tensors["decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv.shape[0] == NUM_LAYERS
    # Saved in the source's chunks (TP2: two column or row blocks per layer at least).
    assert qkv.num_chunks > 1
    run(
        3, "gpt_load", tmp_path, tp=1, pp=1, ckpt=str(dst), saved_by="torch_dist", loader="megatron"
    )
    # Another layout on the way (3 parts along the first axis), same content.
    again = tmp_path / "imported3" / "iter_0000300"
    zd.import_megatron(src, again, ranks=3)
    ck3 = zarrckpt.open(again / "zarrckpt", output="torch")
    assert ck3.tensors["decoder.layers.self_attention.linear_qkv.weight"].chunk_shape[0] == 2
    ck = zarrckpt.open(dst / "zarrckpt", output="torch")
    for key in ck.tensors:
        a, b = ck[key][...], ck3[key][...]
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), key
    # The command line (python -m zarrckpt.migrate), trusting the pickles: torch's reader and
    # unrestricted unpickler, then zarrckpt.megatron.encode_value in Python. Every file of the
    # result is byte-identical to the library's import (but for each save's random id).
    cli = tmp_path / "cli" / "iter_0000300"
    out = subprocess.run(
        [sys.executable, "-m", "zarrckpt.migrate", src, "--megatron", "--trust-pickles"]
        + ["--out", cli],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1])["tensors"] == rep["tensors"]
    ckc = zarrckpt.open(cli / "zarrckpt", output="torch")
    assert set(ckc.tensors) == set(ck.tensors) and set(ckc.objects) == set(ck.objects)
    for key in ck.tensors:
        a, b = ck[key][...], ckc[key][...]
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), key
    files = sorted(p.relative_to(dst) for p in dst.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(cli) for p in cli.rglob("*") if p.is_file())
    assert len(files) > 2 * rep["tensors"]
    for f in files:
        assert _without_save_id((dst / f).read_bytes()) == _without_save_id(
            (cli / f).read_bytes()
        ), f
    # A value the library's reader cannot read without running it (an enum member): refused,
    # naming the item and the class; the trusted path reads it.
    torch.save({"phase": Phase.WARMUP}, src / "common.pt")
    cls = re.escape(f"{Phase.__module__}.Phase")
    with pytest.raises(ConversionError, match=rf"common\.pt.*{cls}"):
        zd.import_megatron(src, tmp_path / "enum")
    zd.import_megatron(src, tmp_path / "enum-trusted", weights_only=False)
    ck_enum = zarrckpt.open(tmp_path / "enum-trusted" / "zarrckpt")
    assert zm.decode_value(ck_enum.object(zm.COMMON_KEY)) == {"phase": Phase.WARMUP}


# --- edge cases on 2 ranks: dtypes, legacy flattened_range, views, duplicates, shape mismatch,
# casts, strict modes, errors, plain tensors -----------------------------------------------------


def _st(key, dtype, gshape, offset, local, replica=0, data=True, **kw) -> ShardedTensor:
    t = None
    if data:
        t = expected_bits(key, dtype, gshape, offset, local).reshape(local).clone()
    return ShardedTensor(
        key, t, dtype, tuple(local), tuple(gshape), tuple(offset), None, replica_id=replica, **kw
    )


def _flat(key, dtype, gshape, start, stop, data=True) -> ShardedTensor:
    """A legacy (Megatron < 0.16) flattened_range piece of the whole tensor's box."""
    sh = _st(key, dtype, gshape, (0,) * len(gshape), gshape, data=False)
    full = expected_bits(key, dtype, gshape, (0,) * len(gshape), gshape).reshape(-1)
    sh.data = full[start:stop].clone() if data else torch.zeros(stop - start, dtype=dtype)
    sh.flattened_range = slice(start, stop)  # 0.16 refuses it in __init__; older versions not
    return sh


def edge_cases(rank: int, world: int, ckpt: str):
    from megatron.core.dist_checkpointing.validation import StrictHandling

    assert world == 2
    r = rank
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    sd = {
        "bf16": _st("w.bf16", torch.bfloat16, (10, 6), (5 * r, 0), (5, 6)),
        "e4m3": _st("w.e4m3", e4m3, (7, 3), (4 * r, 0), (4 - r, 3)),
        "e5m2": _st("w.e5m2", e5m2, (7, 3), (4 * r, 0), (4 - r, 3)),
        "vocab": _st("vocab", torch.float32, (10, 4), (5 * r, 0), (5, 4)),
        "tied": _st("tied", torch.float32, (4, 4), (0, 0), (4, 4), replica=r + 1),
        "obj": ShardedObject("obj", {"rank": r, "t": torch.ones(2) * r}, (2,), (r,)),
    }
    if r == 0:  # one box twice on one rank, the main replica second
        sd["tied_main"] = _st("tied", torch.float32, (4, 4), (0, 0), (4, 4), replica=0)
    zm.save(sd, ckpt)
    # The legacy flattened_range (whole-tensor flat ranges split 23 / 37), in another checkpoint.
    flat_ckpt = ckpt + "-flat"
    cut = (0, 23) if r == 0 else (23, 60)
    zm.save(
        {"flat": _flat("flat", torch.float32, (6, 10), *cut)},
        flat_ckpt,
        validate_access_integrity=False,
    )

    # Load in another split: columns, a non-contiguous destination, duplicate targets.
    cols = (0, 3) if r == 0 else (3, 3)
    bf16 = _st(
        "w.bf16", torch.bfloat16, (10, 6), (0, cols[0]), (10, cols[1]), replica=0, data=False
    )
    if r == 0:
        bf16.data = torch.empty(3, 10, dtype=torch.bfloat16).t()  # a [10, 3] view, strided
    want = {
        "bf16": bf16,
        "e4m3": _st("w.e4m3", e4m3, (7, 3), (0, 0), (7, 3), replica=r, data=False),
        "e5m2": _st("w.e5m2", e5m2, (7, 3), (4 * r, 0), (4 - r, 3), data=False),
        # Padded (12 rows requested, 10 stored): rows 10 and 11 come back zero.
        "vocab": _st(
            "vocab",
            torch.float32,
            (12, 4),
            (6 * r, 0),
            (6, 4),
            data=False,
            allow_shape_mismatch=True,
        ),
        "tied": _st("tied", torch.float32, (4, 4), (0, 0), (4, 4), replica=r, data=False),
        "tied2": _st("tied", torch.float32, (4, 4), (0, 0), (4, 4), replica=1, data=False),
        "obj": ShardedObject("obj", None, (2,), (1 - r,)),
    }
    got = dist_checkpointing.load(want, ckpt)
    if r == 0:  # loaded in place into the strided view (through a staging copy)
        assert got["bf16"].data_ptr() == bf16.data.data_ptr()
        assert not got["bf16"].is_contiguous()
    assert same_bits(
        got["bf16"], expected_bits("w.bf16", torch.bfloat16, (10, 6), (0, cols[0]), (10, cols[1]))
    )
    assert same_bits(got["e4m3"], expected_bits("w.e4m3", e4m3, (7, 3), (0, 0), (7, 3)))
    e5 = (0, 4) if r == 0 else (4, 3)
    assert same_bits(got["e5m2"], expected_bits("w.e5m2", e5m2, (7, 3), (e5[0], 0), (e5[1], 3)))
    full_vocab = torch.zeros(12, 4)
    full_vocab[:10] = expected_bits("vocab", torch.float32, (10, 4), (0, 0), (10, 4))
    assert same_bits(got["vocab"], full_vocab[6 * r : 6 * r + 6])
    tied = expected_bits("tied", torch.float32, (4, 4), (0, 0), (4, 4))
    assert same_bits(got["tied"], tied) and same_bits(got["tied2"], tied)
    assert_same({"rank": 1 - r, "t": torch.ones(2) * (1 - r)}, got["obj"])

    # A stored bfloat16 into float32 only when asked for.
    f32 = {"w": _st("w.bf16", torch.float32, (10, 6), (5 * r, 0), (5, 6), data=False)}
    with pytest.raises(Exception, match="w.bf16"):
        dist_checkpointing.load(f32, ckpt, sharded_strategy=zm.LoadStrategy())
    f32 = {"w": _st("w.bf16", torch.float32, (10, 6), (5 * r, 0), (5, 6), data=False)}
    got = dist_checkpointing.load(f32, ckpt, sharded_strategy=zm.LoadStrategy(cast=True))
    want_f32 = expected_bits("w.bf16", torch.bfloat16, (10, 6), (5 * r, 0), (5, 6)).float()
    assert same_bits(got["w"], want_f32)

    # Legacy flat ranges load as boxes, and boxes load into flat ranges.
    whole = dist_checkpointing.load(
        {"f": _st("flat", torch.float32, (6, 10), (0, 0), (6, 10), replica=r, data=False)},
        flat_ckpt,
    )
    assert same_bits(whole["f"], expected_bits("flat", torch.float32, (6, 10), (0, 0), (6, 10)))
    part = (7, 41) if r == 0 else (41, 60)
    flat = dist_checkpointing.load(
        {"f": _flat("flat", torch.float32, (6, 10), *part, data=False)},
        flat_ckpt,
        validate_access_integrity=False,
    )
    full = expected_bits("flat", torch.float32, (6, 10), (0, 0), (6, 10)).reshape(-1)
    assert same_bits(flat["f"], full[part[0] : part[1]])

    # Strict modes see the checkpoint's keys (tensors and objects) through the strategy.
    ask = {
        "e4m3": _st("w.e4m3", e4m3, (7, 3), (0, 0), (7, 3), replica=r, data=False),
        "nope": _st("nope", torch.float32, (3,), (0,), (3,), replica=r, data=False),
    }
    _, missing, unexpected = dist_checkpointing.load(ask, ckpt, strict=StrictHandling.RETURN_ALL)
    assert unexpected == {"nope"}, unexpected
    assert {"w.bf16", "w.e5m2", "vocab", "tied", "obj"} <= missing, missing
    # The default mode: a key the checkpoint lacks is an error naming it.
    ask = {"nope": _st("nope", torch.float32, (3,), (0,), (3,), replica=r, data=False)}
    with pytest.raises(Exception, match="nope"):
        dist_checkpointing.load(ask, ckpt)
    # Plain full tensors (Megatron's load_plain_tensors: metadata from the strategy).
    plain = dist_checkpointing.load_plain_tensors(ckpt)
    assert set(plain) == {"w.bf16", "w.e4m3", "w.e5m2", "vocab", "tied"}
    assert same_bits(plain["w.e4m3"], expected_bits("w.e4m3", e4m3, (7, 3), (0, 0), (7, 3)))
    assert same_bits(plain["vocab"], full_vocab[:10])


SCENARIOS["edge_cases"] = edge_cases


def test_edge_cases_on_2_ranks(tmp_path):
    run(2, "edge_cases", tmp_path, ckpt=str(tmp_path / "ckpt"))


# --- without processes -----------------------------------------------------------------------


def test_values_round_trip_without_pickle():
    for value in (object_value(3), common_state(), {"a": [1, 2.5, None, "x"]}, [], 7, None):
        encoded = zm.encode_value(value)
        assert b"pickle" not in (encoded if isinstance(encoded, bytes) else encoded.encode())
        stored = encoded if isinstance(encoded, bytes) else __import__("json").loads(encoded)
        assert_same(value, zm.decode_value(stored))
    # Plain JSON stays readable JSON.
    assert zm.encode_value({"iteration": 5, "lr": 0.1}) == '{"iteration":5,"lr":0.1}'
    with pytest.raises(Exception, match=r"value\.fn"):
        zm.encode_value({"fn": print})
    with pytest.raises(Exception, match="not written by zarrckpt.megatron"):
        zm.decode_value(b"\x80\x04K\x01.")  # a pickle is refused, never loaded


def test_flat_boxes_cover_every_range_exactly_once():
    for shape in ((5,), (3, 4), (2, 3, 4), (2, 1, 3, 2)):
        n = math.prod(shape)
        for start in range(n + 1):
            for stop in range(start, n + 1):
                covered = []
                for off, ext, fs in zm._flat_boxes(shape, start, stop):
                    idx = np.ravel_multi_index(
                        np.meshgrid(
                            *[np.arange(o, o + e) for o, e in zip(off, ext, strict=True)],
                            indexing="ij",
                        ),
                        shape,
                    ).reshape(-1)
                    assert list(idx) == list(range(fs, fs + len(idx)))  # contiguous, in order
                    covered.extend(idx)
                assert covered == list(range(start, stop)), (shape, start, stop)
