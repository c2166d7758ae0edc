"""Live weight transfer (zarrckpt.transfer), the remaining real-model cases of issue 22, on
gloo processes (the harness of test_transfer.py: trainer ranks in their own default group,
the transfer over a separate gloo group of every process):

* FSDP2: a transformers Qwen2-shaped model sharded by ``fully_shard`` over 4 CPU ranks (the
  state dict is DTensors, ``Shard(0)``) sends to one engine rank holding whole HF tensors.
  Before it, an engine tensor of a data type the engine cannot take (int32 for a bf16 weight)
  is refused on every rank, naming the tensor and both types, with the engine's buffers
  untouched. Step 1 arrives through the bucket-yielding side (``Transfer.buckets``, a small
  bucket so several rounds): equal to the HF files byte for byte. After an SGD step, step 2
  arrives through the cached plan into the engine's tensors in place: equal to the trainer's
  full tensors after the step (gathered by torch's own ``full_tensor``).
* Qwen3-MoE at EP 4 (megatron-core GPTModel, SequentialMLP experts, the conversion tests' tiny
  model) sends to an engine at vLLM TP 2: rank 0 filled in place, rank 1 through buckets; both
  equal ``export --vllm --tp 2``'s files byte for byte, and vLLM's FusedMoE layout computed here
  from the HF tensors (w13 = per expert [gate rows of the rank; up rows of the rank], w2 split
  on its last axis).
* Negatives on a megatron-core Qwen2-shaped model at TP 2 x PP 2 with 3 engine ranks: engine
  TP 3 (4 heads, 2 kv groups) and an engine rank with a tensor missing are refused on every
  rank before any byte moves (rule, key and numbers named; engine buffers untouched); then a
  trainer rank that dies (os._exit) between two rounds of a transfer is an error on the ranks
  that wait for it, within the communicator's timeout, and no rank hangs.
* HF names, one unsharded trainer (plain tensors, automatic replicas) and one engine rank: a
  state dict missing a tensor (``import --hf``'s check, naming the rule and the tensor) and HF
  names into a vLLM layout are refused on both ranks; then the module goes through whole.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import convert_fixtures as cf  # noqa: E402
import test_transfer as tt  # noqa: E402

import zarrckpt  # noqa: E402
import zarrckpt.convert as zc  # noqa: E402
import zarrckpt.transfer as zt  # noqa: E402

MOD = "test_transfer_cases"
SMALL_BUCKET = 64 << 10


def _sentinel(spec) -> dict:
    return {n: torch.full(tuple(s), 7.0, dtype=getattr(torch, d)) for n, d, s in spec}


def _untouched(bufs: dict) -> bool:
    return all(bool((t == 7).all()) for t in bufs.values())


def _write(out: str, name: str, value) -> None:
    Path(out, name).write_text(json.dumps(value))


def _run(tmp_path: Path, world: int, ntrain: int, scenario: str, **kwargs) -> tuple[Path, list]:
    """Runs ``scenario`` of this module on ``world`` processes (the first ``ntrain`` trainers)
    with a fresh ``out`` folder; returns it and each rank's log (None where a rank wrote
    none)."""
    out = tmp_path / "out"
    out.mkdir()
    tt.run(world, ntrain, f"{MOD}:{scenario}", tmp_path, out=str(out), **kwargs)
    logs = []
    for r in range(world):
        f = out / f"log-{r}.json"
        logs.append(json.loads(f.read_text()) if f.exists() else None)
    return out, logs


def _take_buckets(t, spec) -> tuple[dict, list[int]]:
    """Engine side through ``Transfer.buckets``: every tensor of ``spec`` ((name, dtype,
    shape) each), received once, and the number of tensors per bucket."""
    wanted = {n: (d, tuple(s)) for n, d, s in spec}
    got: dict = {}
    sizes = []
    for bucket in t.buckets(wanted):
        sizes.append(len(bucket))
        for name, tensor in bucket:
            assert name not in got, name
            got[name] = tensor
    return got, sizes


# ---------------------------------------------------------------------------------------------
# FSDP2 -> whole HF tensors


def scenario_fsdp2(rank, ntrain, comm, hf_dir, cfg, spec, out):
    from safetensors.torch import save_file

    out_p = Path(out)
    t = zt.Transfer("qwen2", cfg, engine="hf", names="hf", bucket_bytes=SMALL_BUCKET, comm=comm)
    log: dict = {}
    if rank < ntrain:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
        mesh = init_device_mesh("cpu", (ntrain,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sd = model.state_dict()
        log["dtensors"] = sum(isinstance(v, DTensor) for v in sd.values())
        log["tensors"] = len(sd)
        with pytest.raises(zc.ConversionError) as info:
            t.send(sd)
        log["refusal"] = str(info.value)
        log["reports"] = [t.send(model.state_dict())]
        tt._sgd_step(model)
        log["reports"].append(t.send(model.state_dict()))
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        if rank == 0:
            save_file(full, str(out_p / "trainer-after.safetensors"))
    else:
        wanted = {n: (d, tuple(s)) for n, d, s in spec}
        first = spec[0][0]
        # the refused attempt: an in-place fill whose buffers must stay untouched
        bufs = _sentinel(spec)
        bad = dict(bufs)
        bad[first] = torch.zeros(wanted[first][1], dtype=torch.int32)
        with pytest.raises(zc.ConversionError) as info:
            t.receive(bad)
        log["refusal"] = str(info.value)
        log["untouched"] = _untouched(bufs)
        got, log["buckets"] = _take_buckets(t, spec)
        log["reports"] = [t.last_report]
        save_file(got, str(out_p / "step1.safetensors"))
        log["reports"].append(t.receive(bufs))
        save_file(bufs, str(out_p / "step2.safetensors"))
    _write(out, f"log-{rank}.json", log)


def test_fsdp2_to_whole_hf_tensors(tmp_path):
    from safetensors.torch import load_file

    hf_dir = cf.make_tiny("qwen2", tmp_path / "qwen2-hf", seed=11, attention_bias=True)
    cfg = cf.hf_config(hf_dir)
    hf = cf.read_hf(hf_dir)
    spec = [(n, str(v.dtype).removeprefix("torch."), list(v.shape)) for n, v in hf.items()]
    out, logs = _run(tmp_path, 5, 4, "scenario_fsdp2", hf_dir=str(hf_dir), cfg=cfg, spec=spec)
    first = spec[0][0]
    for lg in logs:
        m = lg["refusal"]
        assert first in m and "int32" in m and "bfloat16" in m and "engine rank 0" in m, m
    assert logs[4]["untouched"]
    # the trainer's state is DTensors (FSDP2), every one of them
    assert all(lg["dtensors"] == lg["tensors"] == len(spec) for lg in logs[:4])
    # step 1, through buckets: the HF files byte for byte, in several buckets
    got = load_file(out / "step1.safetensors")
    assert set(got) == set(hf)
    for n, v in hf.items():
        assert cf.same_bits(got[n], v), n
    assert len(logs[4]["buckets"]) > 1, logs[4]["buckets"]
    # step 2, cached plan, in place: the trainer's full tensors after the step
    after = load_file(out / "trainer-after.safetensors")
    got2 = load_file(out / "step2.safetensors")
    assert set(got2) == set(after) == set(hf)
    for n, v in after.items():
        assert cf.same_bits(got2[n], v), n
    assert sum(not cf.same_bits(got2[n], hf[n]) for n in hf) > 0
    reps = [lg["reports"] for lg in logs]
    assert all(r[0]["planned"] and not r[1]["planned"] for r in reps)
    total = reps[0][0]["total_bytes"]
    assert total == sum(v.numel() * v.element_size() for v in hf.values())
    sent = [r[0]["bytes_sent"] for r in reps[:4]]
    assert sum(sent) == total
    # every FSDP rank sends its own shard, nothing gathered: a quarter each
    assert max(sent) <= 1.1 * total / 4, sent
    assert reps[4][0]["bytes_received"] == total and reps[4][1]["bytes_received"] == total
    print(f"\nFSDP2: {total} bytes, sent per rank {sent}, buckets {logs[4]['buckets']}")


def scenario_hf_names(rank, ntrain, comm, hf_dir, cfg, spec, out):
    """One unsharded trainer (plain tensors: automatic replicas) and one engine rank: a state
    dict missing a tensor, and HF names into a vLLM layout, are refused on both ranks; then the
    module itself goes through."""
    from safetensors.torch import save_file

    log: dict = {}
    t = zt.Transfer("qwen2", cfg, engine="hf", names="hf", comm=comm)
    tv = zt.Transfer("qwen2", cfg, engine="vllm", engine_tp=1, names="hf", comm=comm)
    bufs = _sentinel(spec)
    if rank < ntrain:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
        sd = model.state_dict()
        calls = [
            lambda: t.send({k: v for k, v in sd.items() if k != "model.norm.weight"}),
            lambda: tv.send(sd),
            lambda: t.send(model),
        ]
    else:
        calls = [lambda: t.receive(bufs), lambda: tv.receive(bufs), lambda: t.receive(bufs)]
    for what, call in zip(("missing", "vllm"), calls, strict=False):
        with pytest.raises(zc.ConversionError) as info:
            call()
        log[what] = str(info.value)
    log["untouched"] = _untouched(bufs)
    log["report"] = calls[2]()
    if rank >= ntrain:
        save_file(bufs, str(Path(out) / "whole.safetensors"))
    _write(out, f"log-{rank}.json", log)


def test_hf_names_refusals_and_plain_tensors(tmp_path):
    from safetensors.torch import load_file

    hf_dir = cf.make_tiny("qwen2", tmp_path / "qwen2-hf", seed=13, attention_bias=True)
    cfg = cf.hf_config(hf_dir)
    hf = cf.read_hf(hf_dir)
    spec = [(n, str(v.dtype).removeprefix("torch."), list(v.shape)) for n, v in hf.items()]
    out, logs = _run(tmp_path, 2, 1, "scenario_hf_names", hf_dir=str(hf_dir), cfg=cfg, spec=spec)
    for lg in logs:
        m = lg["missing"]
        assert "rule `" in m and "hf tensor `model.norm.weight` is not in the input" in m, m
        m = lg["vllm"]
        assert "HF-named tensors" in m and "vLLM TP 1" in m, m
        assert lg["untouched"]
    got = load_file(out / "whole.safetensors")
    for n, v in hf.items():
        assert cf.same_bits(got[n], v), n
    assert logs[0]["report"]["bytes_sent"] == logs[1]["report"]["bytes_received"] > 0


# ---------------------------------------------------------------------------------------------
# Qwen3-MoE EP 4 -> vLLM TP 2


def scenario_moe(rank, ntrain, comm, ckpt, cfg, spec, out):
    import test_convert as tc
    from safetensors.torch import save_file

    t = zt.Transfer(
        "qwen3_moe",
        cfg,
        trainer=(1, 1, 4),
        engine="vllm",
        engine_tp=2,
        bucket_bytes=SMALL_BUCKET,
        comm=comm,
    )
    log: dict = {}
    if rank < ntrain:
        model = tc.build_megatron(cfg, 1, 1, 4, moe=True)
        tc._load(model, ckpt)
        log["reports"] = [t.send([model])]
    else:
        e = rank - ntrain
        if e == 0:
            bufs = _sentinel(spec[e])
            log["reports"] = [t.receive(bufs)]
        else:
            bufs, log["buckets"] = _take_buckets(t, spec[e])
            log["reports"] = [t.last_report]
        save_file(bufs, str(Path(out) / f"rank{e}.safetensors"))
    _write(out, f"log-{rank}.json", log)


def test_qwen3_moe_ep4_to_vllm_tp2(tmp_path):
    pytest.importorskip("megatron.core")
    moe = cf.make_tiny("qwen3_moe", tmp_path / "qwen3-moe-hf", seed=3)
    cfg = cf.hf_config(moe)
    ckpt = tmp_path / "moe-ep4"
    zc.import_hf(moe, ckpt, "qwen3_moe", tp=1, pp=1, ep=4)
    vllm = tmp_path / "moe-vllm-tp2"
    zc.export_vllm(ckpt, vllm, "qwen3_moe", tp=2)
    spec = tt._spec(vllm, 2)
    out, logs = _run(tmp_path, 6, 4, "scenario_moe", ckpt=str(ckpt), cfg=cfg, spec=spec)
    ref = cf.vllm_reference(cf.read_hf(moe), cfg, 2)
    for r in range(2):
        got = tt._same_files(out / f"rank{r}.safetensors", tt._read_rank(vllm, r))
        # vLLM's FusedMoE layout, computed from the HF tensors, for every tensor of the rank
        assert set(got) == set(ref[r]), set(got) ^ set(ref[r])
        for n, v in ref[r].items():
            assert cf.same_bits(got[n], v), (r, n)
        assert any("w13_weight" in n for n in got) and any("w2_weight" in n for n in got)
    assert len(logs[5]["buckets"]) > 1
    reps = [lg["reports"][0] for lg in logs]
    total = reps[0]["total_bytes"]
    sent = [r["bytes_sent"] for r in reps[:4]]
    assert sum(sent) == total and all(s > 0 for s in sent), sent
    assert reps[4]["bytes_received"] + reps[5]["bytes_received"] == total
    print(f"\nMoE EP4: {total} bytes, sent per rank {sent}, rank-1 buckets {logs[5]['buckets']}")


# ---------------------------------------------------------------------------------------------
# Negatives: refused layouts, a rank dying mid-transfer


def scenario_negatives(rank, ntrain, comm, ckpt, cfg, spec1, out, die_after):
    import test_convert as tc

    log: dict = {}
    ne = rank - ntrain
    model = None
    if rank < ntrain:
        model = tc.build_megatron(cfg, 2, 2)
        tc._load(model, ckpt)

    def attempt(t, bufs):
        if model is not None:
            return t.send([model])
        return t.receive(bufs)

    # 1. engine TP 3: 4 heads in 2 kv groups do not split in 3
    t3 = zt.Transfer("qwen2", cfg, trainer=(2, 2, 1), engine="vllm", engine_tp=3, comm=comm)
    bufs = _sentinel(spec1) if model is None else {}
    with pytest.raises(zc.ConversionError) as info:
        attempt(t3, bufs)
    log["tp3"] = str(info.value)
    log["tp3_untouched"] = _untouched(bufs)
    # 2. engine TP 1 (3 replicas), engine rank 1 without one tensor
    t1 = zt.Transfer(
        "qwen2",
        cfg,
        trainer=(2, 2, 1),
        engine="vllm",
        engine_tp=1,
        bucket_bytes=SMALL_BUCKET,
        comm=comm,
    )
    missing = spec1[3][0]
    if ne == 1:
        bufs = {n: v for n, v in bufs.items() if n != missing}
    with pytest.raises(zc.ConversionError) as info:
        attempt(t1, bufs)
    log["missing"] = str(info.value)
    log["missing_untouched"] = _untouched(bufs)
    # 3. the right buffers go through
    bufs = _sentinel(spec1) if model is None else {}
    log["ok"] = attempt(t1, bufs)["rounds"]
    # 4. trainer rank 1 dies between two rounds of the next transfer
    if rank == 1:
        seen = [0]
        orig = comm.exchange

        def dying(sends, recvs):
            if any(p >= ntrain and len(mv) > 64 for p, mv in sends):
                seen[0] += 1
                if seen[0] == die_after:
                    os._exit(0)
            return orig(sends, recvs)

        comm.exchange = dying
    t0 = time.monotonic()
    try:
        attempt(t1, bufs)
        log["died"] = None
    except zarrckpt.ZarrckptError as e:
        log["died"] = [type(e).__name__, str(e)]
    log["died_after_s"] = time.monotonic() - t0
    _write(out, f"log-{rank}.json", log)


def test_negatives_refused_everywhere_and_a_dying_rank(tmp_path):
    pytest.importorskip("megatron.core")
    # a vocabulary of 768 (3 x 256: padded for TP 2 it still splits in 3), so that engine TP 3
    # is refused for the attention heads (4 query heads, 2 kv groups), not the vocabulary
    hf_dir = cf.make_tiny(
        "qwen2", tmp_path / "qwen2-hf", seed=7, attention_bias=True, vocab_size=768
    )
    cfg = cf.hf_config(hf_dir)
    assert cf.padded_vocab(768, 2) == 768
    ckpt = tmp_path / "qwen2-tp2pp2"
    zc.import_hf(hf_dir, ckpt, "qwen2", tp=2, pp=2)
    vllm = tmp_path / "qwen2-vllm-tp1"
    zc.export_vllm(ckpt, vllm, "qwen2", tp=1)
    spec1 = tt._spec(vllm, 1)[0]
    timeout = 120  # PgComm's gloo timeout
    t0 = time.monotonic()
    _, logs = _run(
        tmp_path, 7, 4, "scenario_negatives", ckpt=str(ckpt), cfg=cfg, spec1=spec1, die_after=2
    )
    elapsed = time.monotonic() - t0
    alive = [r for r in range(7) if r != 1]
    assert logs[1] is None  # it died before writing
    assert all(logs[r] is not None for r in alive)
    for r in alive:
        lg = logs[r]
        m = lg["tp3"]
        # the vLLM rule, the HF tensor, the units that do not split, the TP size
        assert "rule `vllm:" in m and "self_attn" in m and "not divisible by vLLM tp = 3" in m, m
        assert lg["tp3_untouched"], r
        m = lg["missing"]
        missing = spec1[3][0]
        assert missing in m and "engine rank 1" in m and "declares no buffer" in m, m
        assert lg["missing_untouched"], r
        assert lg["ok"] > 1
    # every engine rank needs bytes from trainer rank 1 after its death: a CommError, in time
    for r in (4, 5, 6):
        died = logs[r]["died"]
        assert died is not None and died[0] == "CommError", (r, died)
        assert logs[r]["died_after_s"] < timeout + 30, logs[r]["died_after_s"]
    for r in (0, 2, 3):
        if logs[r]["died"] is not None:
            assert logs[r]["died"][0] == "CommError", logs[r]["died"]
            assert logs[r]["died_after_s"] < timeout + 30
    assert elapsed < tt.TIMEOUT_S
    print(f"\nrefusal (engine TP 3): {logs[0]['tp3']}\nrefusal (missing): {logs[0]['missing']}")
    for r in alive:
        print(f"rank {r} after the death: {logs[r]['died']} in {logs[r]['died_after_s']:.2f} s")
