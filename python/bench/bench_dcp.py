"""Save and load GB/s: zarrckpt.torch against torch.distributed.checkpoint (DCP) with its
FileSystemWriter / FileSystemReader, and against zarrckpt's Rust API, on the same work.

The work (one run, one machine, warm page cache): a GPT-like state of about ``--size``
bytes (by default 2 GB: bf16 weights with fp32 Adam moments, split by tensor parallelism
along their first or second axis, replicated fp32 norms, an int64 step; exactly the model of
``zarrckpt bench`` / ``zarrckpt worker``) held as DTensors by 4 processes (``Shard`` on a
1-D mesh of 4, norms ``Replicate``), saved; then loaded by 3 processes holding it sharded
over 3. The three contenders run in alternation, round after round:

- ``zarrckpt.torch.save`` / ``load`` of the DTensor state dict (processes joined by gloo);
- ``dcp.save`` / ``dcp.load`` of the same state dict with ``FileSystemWriter`` /
  ``FileSystemReader`` (DCP's defaults: one file per rank, fsync);
- the Rust API on the same layout: ``zarrckpt worker save|load`` launched as 4 and 3
  processes over TCP (``zarrckpt launch``).

Each figure is the checkpoint's bytes over the slowest rank's time from a barrier to the end
of the call; medians over rounds are printed with every round. Every load is checked
against the saved contents once.

    "$(scripts/build-python.sh | tail -n1)" python/bench/bench_dcp.py [--size 2000000000]
        [--rounds 3] [--dir /tmp/zarrckpt-pybench] [--json]

Not part of the test run (it takes a few minutes and needs ~4x --size of free disk).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[2]
HIDDEN = 2048
SAVE_WORLD, LOAD_WORLD = 4, 3


# ---------------------------------------------------------------------------------------------
# the model (SynthModel::gpt of src/synth.rs, row-parallel axis 1)


def gpt(target_bytes: int, h: int = HIDDEN) -> list[tuple[str, torch.dtype, tuple, int | None]]:
    """(key, dtype, shape, split axis) of every tensor, in the Rust model's order."""
    vocab = 8 * h + 3
    per_layer = 12 * h * h * 10 + 9 * h * 4 * 3
    embed = vocab * h * 10
    layers = max(1, max(0, target_bytes - embed) // per_layer)
    out: list[tuple[str, torch.dtype, tuple, int | None]] = []

    def param(name, shape, split):
        out.append((name, torch.bfloat16, shape, split))
        out.append((f"optimizer/exp_avg/{name}", torch.float32, shape, split))
        out.append((f"optimizer/exp_avg_sq/{name}", torch.float32, shape, split))

    def norm(name):
        out.append((name, torch.float32, (h,), None))

    param("embedding.word_embeddings.weight", (vocab, h), 0)
    for layer in range(layers):
        p = f"decoder.layers.{layer}"
        norm(f"{p}.input_layernorm.weight")
        param(f"{p}.self_attention.linear_qkv.weight", (3 * h, h), 0)
        param(f"{p}.self_attention.linear_qkv.bias", (3 * h,), 0)
        param(f"{p}.self_attention.linear_proj.weight", (h, h), 1)
        norm(f"{p}.pre_mlp_layernorm.weight")
        param(f"{p}.mlp.linear_fc1.weight", (4 * h, h), 0)
        param(f"{p}.mlp.linear_fc2.weight", (h, 4 * h), 1)
    norm("decoder.final_layernorm.weight")
    out.append(("optimizer/step", torch.int64, (), None))
    return out


def nbytes(model) -> int:
    total = 0
    for _, dt, shape, _ in model:
        n = 1
        for d in shape:
            n *= d
        total += n * torch.empty((), dtype=dt).element_size()
    return total


def box(shape, split, rank, world):
    """torch.chunk-style split (what DTensor's Shard does): (offset, extent) per axis."""
    off, ext = [0] * len(shape), list(shape)
    if split is not None:
        dim = shape[split]
        size = -(-dim // world)
        o = min(rank * size, dim)
        off[split], ext[split] = o, min(size, dim - o)
    return off, ext


def fill(t: torch.Tensor, shape, off, seed: int) -> None:
    """Deterministic contents of a box: a function of the global element index."""
    if t.numel() == 0:
        return
    if t.dim() == 0:
        t.fill_(seed)
        return
    cols = shape[-1] if len(shape) > 1 else 1
    flat = t.view(-1, t.shape[-1]) if t.dim() > 1 else t.view(1, -1)
    row0 = off[0] if len(shape) > 1 else 0
    col0 = off[-1]
    c = torch.arange(col0, col0 + flat.shape[1], dtype=torch.int64)
    step = 4096
    for r in range(0, flat.shape[0], step):
        rows = torch.arange(row0 + r, row0 + min(r + step, flat.shape[0]), dtype=torch.int64)
        g = rows[:, None] * cols + c[None, :]
        flat[r : r + step] = ((g * 7 + seed) % 251).to(t.dtype)


def state(model, rank, world, contents: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for seed, (key, dt, shape, split) in enumerate(model, start=1):
        off, ext = box(shape, split, rank, world)
        local = torch.zeros(ext, dtype=dt)
        if contents:
            fill(local, shape, off, seed)
        if not shape:
            sd[key] = local
            continue
        placements = [Shard(split)] if split is not None else [Replicate()]
        sd[key] = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    return sd


def check(model, sd, rank, world) -> bool:
    for seed, (key, dt, shape, split) in enumerate(model, start=1):
        off, ext = box(shape, split, rank, world)
        want = torch.zeros(ext, dtype=dt)
        fill(want, shape, off, seed)
        v = sd[key]
        got = v.to_local() if hasattr(v, "to_local") else v
        if not torch.equal(got, want):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# the Python ranks


def _rank_main(rank, world, store, job, args, out):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import zarrckpt.torch as zc

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    # zarrckpt's gloo group exists once a job has checkpointed: set it up before timing (as
    # the Rust workers connect before their barrier).
    from zarrckpt import _core

    _core.communicator().group()
    model = gpt(args.size)
    sd = state(model, rank, world, contents=(job == "save"))
    results = []
    for rnd in range(args.rounds):
        order = ["zarrckpt", "dcp"] if rnd % 2 == 0 else ["dcp", "zarrckpt"]
        for who in order:
            path = f"{args.dir}/{who}"
            if job == "save" and rank == 0 and who == "dcp":
                shutil.rmtree(path, ignore_errors=True)  # DCP overwrites file by file
            dist.barrier()
            t0 = time.perf_counter()
            if who == "zarrckpt":
                (zc.save if job == "save" else zc.load)(sd, path)
            elif job == "save":
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))
            else:
                dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
            secs = time.perf_counter() - t0
            dist.barrier()
            ok = None
            if job == "load" and rnd == 0:
                ok = check(model, sd, rank, world)
                for v in sd.values():  # the next contender starts from zeros
                    (v.to_local() if hasattr(v, "to_local") else v).zero_()
            results.append({"round": rnd, "who": who, "secs": secs, "ok": ok})
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def python_job(job, world, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        store, out = f"{d}/store", f"{d}/out"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, world, store, job, args, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            sys.exit(f"bench: a {job} rank failed")
        per_rank = [json.load(open(f"{out}.{r}")) for r in range(world)]
    rows = []
    for i, first in enumerate(per_rank[0]):
        rows.append({
            "round": first["round"], "who": first["who"],
            "secs": max(p[i]["secs"] for p in per_rank),
            "ok": None if first["ok"] is None else all(p[i]["ok"] for p in per_rank),
        })
    return rows


# ---------------------------------------------------------------------------------------------
# the Rust ranks


def rust_job(job, world, args, rnd) -> dict:
    exe = REPO / "target" / "release" / "zarrckpt"
    path = f"{args.dir}/rust"
    report = f"{args.dir}/report"
    cmd = [str(exe), "launch", "-n", str(world), "--", str(exe), "worker", job, "--dir", path,
           "--size", str(args.size), "--hidden", str(HIDDEN), "--tp", str(world),
           "--report", report]
    if job == "save":
        cmd.append("--overwrite")
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    reps = []
    for r in range(world):
        p = Path(f"{report}.{r}")
        reps.append(json.loads(p.read_text()))
        p.unlink()
    ok = all(r.get("verified", True) for r in reps) if job == "load" else None
    return {"round": rnd, "who": "rust", "secs": max(r["secs"] for r in reps), "ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=2_000_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/zarrckpt-pybench")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    exe = REPO / "target" / "release" / "zarrckpt"
    if not exe.exists():
        sys.exit(f"bench: build the CLI first (cargo build --release): {exe} is missing")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    model = gpt(args.size)
    total = nbytes(model)
    print(f"bench: GPT-like state of {total / 1e9:.2f} GB ({len(model)} tensors), "
          f"{SAVE_WORLD} processes save, {LOAD_WORLD} load (another sharding), "
          f"{args.rounds} rounds, {os.cpu_count()} cores, torch {torch.__version__}",
          flush=True)

    rows = []
    rows += [dict(r, job="save") for r in python_job("save", SAVE_WORLD, args)]
    rows += [dict(rust_job("save", SAVE_WORLD, args, rnd), job="save") for rnd in range(args.rounds)]
    rows += [dict(r, job="load") for r in python_job("load", LOAD_WORLD, args)]
    rows += [dict(rust_job("load", LOAD_WORLD, args, rnd), job="load") for rnd in range(args.rounds)]
    for r in rows:
        r["gbps"] = total / r["secs"] / 1e9

    summary = {}
    for job in ("save", "load"):
        for who in ("zarrckpt", "dcp", "rust"):
            mine = [r for r in rows if r["job"] == job and r["who"] == who]
            summary[f"{job}/{who}"] = statistics.median(r["gbps"] for r in mine)
            if job == "load" and any(r["ok"] is False for r in mine):
                sys.exit(f"bench: {who} loaded wrong data")
    if args.json:
        print(json.dumps({"bytes": total, "rows": rows, "median_gbps": summary}, indent=1))
    names = {"zarrckpt": "zarrckpt.torch", "dcp": "DCP FileSystemWriter/Reader",
             "rust": "zarrckpt Rust API (TCP)"}
    for job in ("save", "load"):
        print(f"\n{job} ({SAVE_WORLD if job == 'save' else LOAD_WORLD} processes)")
        for who in ("zarrckpt", "dcp", "rust"):
            rounds = ", ".join(f"{r['gbps']:.2f}" for r in rows
                               if r["job"] == job and r["who"] == who)
            print(f"  {names[who]:<30} {summary[f'{job}/{who}']:6.2f} GB/s   (rounds: {rounds})")
        z, d, r = (summary[f"{job}/{w}"] for w in ("zarrckpt", "dcp", "rust"))
        print(f"  zarrckpt.torch / DCP: {z / d:.2f}x    zarrckpt.torch / Rust API: {z / r:.2f}")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
