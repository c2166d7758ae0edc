"""Live weight transfer (zarrckpt.transfer, spec section 20) between real processes: a
megatron-core GPTModel on gloo trainer processes sends its weights to engine processes holding
vLLM TP buffers, over a gloo group spanning both worlds.

* SmolLM2-135M (the conversion tests' fixture) at TP3 x PP2 on 6 processes -> 3 engine
  processes at vLLM TP 3: the received buffers equal ``export --vllm --tp 3``'s files byte for
  byte and the numpy forward from them matches transformers' logits; after an SGD step the
  second transfer goes through the cached plan and equals the export of the checkpoint
  megatron-core saved after the step.
* Qwen2-shaped (qkv bias, untied head, tiny) at TP2 x PP2 on 4 processes -> vLLM TP 2 and
  TP 1; before it, an engine buffer of the wrong data type is refused on every rank (rule,
  key, types named) and nothing moves.

The trainer processes run megatron-core in their own default group (6 or 4 ranks); the
transfer runs over a separate gloo ``ProcessGroup`` of all processes, wrapped as a zarrckpt
communicator (``PgComm``: rank, world_size, exchange).
"""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import convert_fixtures as cf  # noqa: E402

import zarrckpt.convert as zc  # noqa: E402
import zarrckpt.transfer as zt  # noqa: E402

TIMEOUT_S = float(os.environ.get("ZARRCKPT_TEST_TIMEOUT_S", "600"))
PROMPT = [1, 504, 3458, 282, 4849, 314, 253, 1056, 30]


class PgComm:
    """A zarrckpt communicator over a standalone gloo ProcessGroup: point-to-point only."""

    def __init__(self, store_path: str, rank: int, world: int) -> None:
        store = torch.distributed.FileStore(store_path, world)
        self.pg = torch.distributed.ProcessGroupGloo(
            store, rank, world, datetime.timedelta(seconds=120)
        )
        self.rank = rank
        self.world_size = world

    def exchange(self, sends, recvs) -> None:
        works = []
        keep = []
        for peer, mv in sends:
            if len(mv):
                t = torch.frombuffer(bytearray(mv), dtype=torch.uint8)
                keep.append(t)
                works.append(self.pg.send([t], peer, 0))
        for peer, mv in recvs:
            if len(mv):
                t = torch.frombuffer(mv, dtype=torch.uint8)
                works.append(self.pg.recv([t], peer, 0))
        for w in works:
            w.wait()


def _read_rank(folder: Path, r: int) -> dict:
    from safetensors.torch import load_file

    state: dict = {}
    for f in sorted(folder.glob(f"model-rank-{r}-part-*.safetensors")):
        state.update(load_file(f))
    assert state, f"no files for rank {r} in {folder}"
    return state


def _sgd_step(model) -> None:
    """One optimizer step with a made-up gradient (the same on tied copies)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.03)
    opt.step()


def scenario_megatron(rank, ntrain, comm, arch, ckpt, cfg, tp, pp, engine_tp, spec, out, after):
    """Trainer ranks: GPTModel loaded from `ckpt`, transfer, SGD step, transfer, Megatron save
    to `after`. Engine ranks: buffers as `spec` lists them (name, dtype, shape per engine
    rank), received twice, written to `out`. With `refuse`, a first transfer with a wrong
    engine dtype must fail on every rank."""
    import test_convert as tc

    table = "llama" if arch == "llama" else arch
    t = zt.Transfer(table, cfg, trainer=(tp, pp, 1), engine="vllm", engine_tp=engine_tp, comm=comm)
    reports = []
    if rank < ntrain:
        model = tc.build_megatron(cfg, tp, pp)
        tc._load(model, ckpt)
        reports.append(t.send([model]))
        _sgd_step(model)
        reports.append(t.send([model]))
        import zarrckpt.megatron as zm

        zm.save(model.sharded_state_dict(), after)
    else:
        from safetensors.torch import save_file

        e = rank - ntrain
        bufs = {
            n: torch.full(tuple(s), 7.0, dtype=getattr(torch, d)) for n, d, s in spec[e % engine_tp]
        }
        for step in (1, 2):
            reports.append(t.receive(bufs))
            save_file(bufs, str(Path(out) / f"step{step}-rank{e}.safetensors"))
    Path(out, f"report-{rank}.json").write_text(json.dumps(reports))


def scenario_refused(rank, ntrain, comm, ckpt, cfg, tp, pp, engine_tp, spec, out):
    """A wrong engine dtype on engine rank 0: refused on every rank; then the right buffers
    go through on the same communicator."""
    import test_convert as tc

    t = zt.Transfer(
        "qwen2", cfg, trainer=(tp, pp, 1), engine="vllm", engine_tp=engine_tp, comm=comm
    )
    if rank < ntrain:
        model = tc.build_megatron(cfg, tp, pp)
        tc._load(model, ckpt)

        def attempt():
            return t.send([model])
    else:
        e = rank - ntrain
        bufs = {n: torch.zeros(tuple(s), dtype=getattr(torch, d)) for n, d, s in spec[e]}
        wrong = dict(bufs)
        if e == 0:
            name = spec[0][1][0]
            wrong[name] = torch.zeros(tuple(spec[0][1][2]), dtype=torch.float16)

        calls = iter([wrong, bufs])

        def attempt():
            return t.receive(next(calls))

    with pytest.raises(zc.ConversionError) as info:
        attempt()
    Path(out, f"refusal-{rank}.txt").write_text(str(info.value))
    report = attempt()
    if rank >= ntrain:
        from safetensors.torch import save_file

        save_file(bufs, str(Path(out) / f"step1-rank{rank - ntrain}.safetensors"))
    Path(out, f"report-{rank}.json").write_text(json.dumps([report]))


def _worker(rank, world, ntrain, init_file, comm_file, scenario, kwargs):
    import importlib
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    import test_convert as tc

    tc._cpu_only_patches()
    import torch.distributed as dist

    trainer = rank < ntrain
    if trainer:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=ntrain
        )
    comm = PgComm(comm_file, rank, world)
    # "module:function" runs a scenario of another test module (same harness)
    module, _, name = scenario.rpartition(":")
    fn = getattr(importlib.import_module(module), name) if module else globals()[name]
    try:
        fn(rank=rank, ntrain=ntrain, comm=comm, **kwargs)
    finally:
        if trainer:
            if "megatron.core" in sys.modules:
                from megatron.core import parallel_state

                parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def run(world: int, ntrain: int, scenario: str, tmp_path: Path, **kwargs) -> None:
    import torch.multiprocessing as mp

    stamp = time.monotonic_ns()
    ctx = mp.start_processes(
        _worker,
        args=(
            world,
            ntrain,
            str(tmp_path / f"init-{stamp}"),
            str(tmp_path / f"comm-{stamp}"),
            scenario,
            kwargs,
        ),
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
            pytest.fail(f"{scenario} on {world} processes did not finish in {TIMEOUT_S} s")


def _spec(folder: Path, k: int) -> list:
    """Per vLLM rank: (name, dtype, shape) of its tensors, from export --vllm's files."""
    out = []
    for r in range(k):
        state = _read_rank(folder, r)
        out.append(
            [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in state.items()]
        )
    return out


def _same_files(got_file: Path, want: dict) -> dict:
    from safetensors.torch import load_file

    got = load_file(got_file)
    assert set(got) == set(want), set(got) ^ set(want)
    for n, t in want.items():
        assert cf.same_bits(got[n], t), (got_file.name, n)
    return got


def _reports(out: Path, world: int) -> list:
    return [json.loads((out / f"report-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("transfer")


def test_smollm2_tp3pp2_to_vllm_tp3(work, tmp_path):
    pytest.importorskip("megatron.core")
    from transformers import AutoModelForCausalLM

    smol = cf.smollm2()
    cfg = cf.hf_config(smol)
    ckpt = work / "smol-tp3pp2"
    zc.import_hf(smol, ckpt, "llama", tp=3, pp=2)
    vllm = work / "smol-vllm-tp3"
    zc.export_vllm(ckpt, vllm, "llama", tp=3)
    spec = _spec(vllm, 3)
    out = tmp_path / "out"
    out.mkdir()
    after = tmp_path / "after-step"
    run(
        9,
        6,
        "scenario_megatron",
        tmp_path,
        arch="llama",
        ckpt=str(ckpt),
        cfg=cfg,
        tp=3,
        pp=2,
        engine_tp=3,
        spec=spec,
        out=str(out),
        after=str(after),
    )
    # step 1: byte for byte export --vllm --tp 3, and the forward matches transformers
    ranks = []
    for r in range(3):
        got = _same_files(out / f"step1-rank{r}.safetensors", _read_rank(vllm, r))
        ranks.append(cf.tensor_getter(got))
    model = AutoModelForCausalLM.from_pretrained(smol, dtype=torch.float32)
    with torch.no_grad():
        want_logits = model(torch.tensor([PROMPT])).logits[0].numpy()
    logits = cf.llama_forward_tp(ranks, cfg, PROMPT)
    assert np.abs(logits - want_logits).max() <= 1e-5 * np.abs(want_logits).max()
    # step 2 (after an optimizer step) through the cached plan: equals the export of the
    # checkpoint megatron-core saved after the step
    vllm2 = tmp_path / "vllm-after"
    zc.export_vllm(after, vllm2, "llama", tp=3, config=smol / "config.json")
    changed = 0
    for r in range(3):
        got2 = _same_files(out / f"step2-rank{r}.safetensors", _read_rank(vllm2, r))
        got1 = _read_rank(vllm, r)
        changed += sum(not cf.same_bits(got1[n], got2[n]) for n in got1)
    assert changed > 0
    reps = _reports(out, 9)
    assert all(r[0]["planned"] and not r[1]["planned"] for r in reps)
    sent = [r[0]["bytes_sent"] for r in reps[:6]]
    total = reps[0][0]["total_bytes"]
    assert sum(sent) == total
    assert all(r[0]["bytes_sent"] == 0 for r in reps[6:])
    # every trainer rank sends (no gather onto one rank): TP ranks of a stage send equal shares
    assert min(sent) > 0.25 * max(sent), sent


def test_qwen2_tp2pp2_to_vllm_tp2_and_tp1_refusal_first(work, tmp_path):
    pytest.importorskip("megatron.core")
    from transformers import AutoModelForCausalLM

    hf_dir = cf.make_tiny("qwen2", work / "qwen2-hf", seed=7, attention_bias=True)
    cfg = cf.hf_config(hf_dir)
    ckpt = work / "qwen2-tp2pp2"
    zc.import_hf(hf_dir, ckpt, "qwen2", tp=2, pp=2)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    ids = [1, 5, 9, 200, 31, 7]
    with torch.no_grad():
        want_logits = model(torch.tensor([ids])).logits[0].numpy()
    for k in (2, 1):
        vllm = work / f"qwen2-vllm-tp{k}"
        zc.export_vllm(ckpt, vllm, "qwen2", tp=k)
        spec = _spec(vllm, k)
        out = tmp_path / f"out{k}"
        out.mkdir()
        run(
            4 + k,
            4,
            "scenario_refused",
            tmp_path,
            ckpt=str(ckpt),
            cfg=cfg,
            tp=2,
            pp=2,
            engine_tp=k,
            spec=spec,
            out=str(out),
        )
        msgs = [(out / f"refusal-{r}.txt").read_text() for r in range(4 + k)]
        bad = spec[0][1][0]
        for m in msgs:
            assert bad in m and "float16" in m and "bfloat16" in m and "engine rank 0" in m, m
        ranks = []
        for r in range(k):
            got = _same_files(out / f"step1-rank{r}.safetensors", _read_rank(vllm, r))
            ranks.append(cf.tensor_getter(got))
        logits = cf.llama_forward_tp(ranks, cfg, ids)
        assert np.abs(logits - want_logits).max() <= 1e-5 * np.abs(want_logits).max()
        reps = _reports(out, 4 + k)
        assert all(r[0]["planned"] for r in reps)
