"""Save and load GB/s against torch.distributed.checkpoint (DCP), two modes.

``--mode dcp`` (the default): ``dcp.save`` / ``dcp.load`` through zarrckpt's
``StorageWriter`` / ``StorageReader`` (with ``zd.SavePlanner`` / ``zd.LoadPlanner``) against
the same calls through DCP's ``FileSystemWriter`` / ``FileSystemReader``, on the state below
(4 processes save, 3 load it sharded over 3). Loads are timed cold (every file of the
contender evicted from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``; the
writers fsync'd them) and then warm. The raw limits are measured by the same processes in
the same rounds: write + fsync of each save rank's bytes to one file, and cold and warm reads
of a third of them per load rank. Bytes read per byte loaded come from ``/proc/self/io``
(``rchar``: what read calls returned; ``read_bytes``: what came from the device) and from
zarrckpt's own report. The contenders rotate from round to round; every load of the first
round is checked.

``--mode torch``: zarrckpt.torch against DCP with its FileSystemWriter / FileSystemReader, and
against zarrckpt's Rust API, on the same work (described below).

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
  processes over TCP (``zarrckpt launch``) in its turn, the Python ranks idle meanwhile;
- the machine's limit, measured by the same processes in the same rounds: each save rank
  writes its bytes to one file and fsyncs it; each load rank reads a third of those bytes
  back from the page cache.

Each figure is the checkpoint's bytes over the slowest rank's time from a barrier to the end
of the call; the order of the four rotates from round to round, everything is synced to disk
before each. Medians over rounds are printed with every round, and the medians of the
ratios within a round (the disk here swings between rounds). The first three loads of each
kind are checked against the saved contents.

    "$(scripts/build-python.sh | tail -n1)" python/bench/bench_dcp.py [--mode dcp|torch]
        [--size 2000000000] [--rounds 3] [--dir /tmp/zarrckpt-pybench] [--json]

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
# the model (SynthModel::gpt of src/bin/zarrckpt/synth.rs, row-parallel axis 1)


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


def state(model, rank, world, contents: bool, dotted: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    sd = {}
    for seed, (key, dt, shape, split) in enumerate(model, start=1):
        if dotted:  # DCP's own naming (the zarrckpt reader offers `a/b` as `a.b`)
            key = key.replace("/", ".")
        off, ext = box(shape, split, rank, world)
        local = torch.zeros(ext, dtype=dt)
        if contents:
            fill(local, shape, off, seed)
        if not shape:
            sd[key] = local
            continue
        placements = [Shard(split)] if split is not None else [Replicate()]
        sd[key] = DTensor.from_local(
            local,
            mesh,
            placements,
            run_check=False,
            shape=torch.Size(shape),
            stride=torch.empty(shape, device="meta").stride(),
        )
    return sd


def check(model, sd, rank, world, dotted: bool = False) -> bool:
    for seed, (key, dt, shape, split) in enumerate(model, start=1):
        if dotted:
            key = key.replace("/", ".")
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


def _wait_file(path: str) -> None:
    while not os.path.exists(path):
        time.sleep(0.02)


def _raw_write(sd, path, rank) -> None:
    """The machine's limit for the save: this rank's bytes (replicated tensors on rank 0
    only: the checkpoint's bytes in all) written to one file, fsync'd."""
    with open(f"{path}.{rank}", "wb") as f:
        for v in sd.values():
            replicated = not hasattr(v, "placements") or not any(p.is_shard() for p in v.placements)
            t = v.to_local() if hasattr(v, "to_local") else v
            if t.numel() and (rank == 0 or not replicated):
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _raw_read(path, rank, world, buf) -> None:
    """The machine's limit for the load: this rank's share of the raw files' bytes, read
    from the page cache into memory it holds."""
    files = sorted(Path(path).parent.glob(Path(path).name + ".*"))
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)
    lo, hi = rank * total // world, (rank + 1) * total // world
    at, pos = 0, 0
    view = memoryview(buf)
    for f, n in zip(files, sizes, strict=True):
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            with open(f, "rb", buffering=0) as fh:
                fh.seek(a - at)
                got = 0
                while got < b - a:
                    n_read = fh.readinto(view[pos + got : pos + b - a])
                    if not n_read:
                        raise RuntimeError(f"bench: {f} is shorter than expected")
                    got += n_read
            pos += b - a
        at += n


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
    buf = bytearray(nbytes(model) // world + 1) if job == "load" else None
    if buf is not None:
        raw = sum(f.stat().st_size for f in Path(args.dir).glob("raw.*"))
        assert raw == nbytes(model), (raw, nbytes(model))
    # The Rust API runs in its slot of the rotation too (the driver launches it): a disk
    # that slows down under sustained writes penalises every contender alike.
    contenders = ["zarrckpt", "dcp", "raw", "rust"]
    results = []
    for rnd in range(args.rounds):
        order = contenders[rnd % 4 :] + contenders[: rnd % 4]
        for who in order:
            path = f"{args.dir}/{who}"
            if rank == 0:
                if job == "save" and who not in ("raw", "rust"):
                    # Every contender writes a fresh directory (removing the last round's
                    # checkpoint is not part of the save).
                    shutil.rmtree(path, ignore_errors=True)
                os.sync()
            if who == "rust":
                if rank == 0:
                    Path(f"{args.dir}/sync.{job}.{rnd}.ready").touch()
                    _wait_file(f"{args.dir}/sync.{job}.{rnd}.go")
                dist.barrier()
                continue
            dist.barrier()
            t0 = time.perf_counter()
            if who == "zarrckpt":
                (zc.save if job == "save" else zc.load)(sd, path)
            elif who == "dcp" and job == "save":
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))
            elif who == "dcp":
                dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
            elif job == "save":
                _raw_write(sd, path, rank)
            else:
                _raw_read(f"{args.dir}/raw", rank, world, buf)
            secs = time.perf_counter() - t0
            dist.barrier()
            ok = None
            if job == "load" and who != "raw" and rnd < 3:
                ok = check(model, sd, rank, world)
                for v in sd.values():  # the next contender starts from zeros
                    (v.to_local() if hasattr(v, "to_local") else v).zero_()
            results.append({"round": rnd, "who": who, "secs": secs, "ok": ok})
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def python_and_rust(job, world, args) -> list[dict]:
    """The Python ranks" rounds, the Rust API launched in its turn of each round."""
    rust = []
    with tempfile.TemporaryDirectory() as d:
        store, out = f"{d}/store", f"{d}/out"
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, store, job, args, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for rnd in range(args.rounds):
            ready = f"{args.dir}/sync.{job}.{rnd}.ready"
            while not os.path.exists(ready):
                if any(p.exitcode not in (None, 0) for p in procs):
                    sys.exit(f"bench: a {job} rank failed")
                time.sleep(0.05)
            rust.append(rust_job(job, world, args, rnd))
            Path(f"{args.dir}/sync.{job}.{rnd}.go").touch()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            sys.exit(f"bench: a {job} rank failed")
        per_rank = [json.load(open(f"{out}.{r}")) for r in range(world)]
    rows = []
    for i, first in enumerate(per_rank[0]):
        rows.append(
            {
                "round": first["round"],
                "who": first["who"],
                "secs": max(p[i]["secs"] for p in per_rank),
                "ok": None if first["ok"] is None else all(p[i]["ok"] for p in per_rank),
            }
        )
    return rows + rust


# ---------------------------------------------------------------------------------------------
# --mode dcp: dcp.save / dcp.load through zarrckpt's writer and reader against DCP's own


def _evict(paths) -> None:
    """Drops the page cache of every file under ``paths`` (clean pages: every contender
    fsyncs what it writes), so that the next read comes from the disk."""
    for root in paths:
        files = [Path(root)] if Path(root).is_file() else Path(root).rglob("*")
        for f in files:
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _proc_io() -> dict[str, int]:
    """This process's I/O counters: ``rchar`` (bytes its read calls returned, page cache or
    not) and ``read_bytes`` (bytes it made the kernel fetch from the block device)."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out


def _local_bytes(sd) -> int:
    n = 0
    for v in sd.values():
        t = v.to_local() if hasattr(v, "to_local") else v
        n += t.numel() * t.element_size()
    return n


def _dcp_rank_main(rank, world, store, job, args, out):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import zarrckpt.dcp as zd
    from zarrckpt import _core

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    _core.communicator().group()  # zarrckpt's gloo group, set up before timing
    model = gpt(args.size)
    sd = state(model, rank, world, contents=(job == "save"), dotted=True)
    buf = bytearray(nbytes(model) // world + 1) if job == "load" else None
    mine = _local_bytes(sd)
    contenders = ["zarrckpt", "dcp", "raw"]
    results = []
    for rnd in range(args.rounds):
        order = contenders[rnd % 3 :] + contenders[: rnd % 3]
        for who in order:
            path = f"{args.dir}/{who}"
            temps = ("cold", "warm") if job == "load" else ("",)
            for temp in temps:
                if rank == 0:
                    if job == "save" and who != "raw":
                        shutil.rmtree(path, ignore_errors=True)
                    os.sync()
                    if temp == "cold":
                        files = sorted(Path(args.dir).glob("raw.*")) if who == "raw" else [path]
                        _evict(files)
                dist.barrier()
                io0 = _proc_io()
                t0 = time.perf_counter()
                report = None
                if who == "zarrckpt" and job == "save":
                    dcp.save(sd, storage_writer=zd.StorageWriter(path), planner=zd.SavePlanner())
                elif who == "zarrckpt":
                    reader = zd.StorageReader(path)
                    dcp.load(sd, storage_reader=reader, planner=zd.LoadPlanner())
                    report = reader.last_report
                elif who == "dcp" and job == "save":
                    dcp.save(sd, storage_writer=dcp.FileSystemWriter(path))
                elif who == "dcp":
                    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
                elif job == "save":
                    _raw_write(sd, f"{args.dir}/raw", rank)
                else:
                    _raw_read(f"{args.dir}/raw", rank, world, buf)
                secs = time.perf_counter() - t0
                io1 = _proc_io()
                dist.barrier()
                ok = None
                if job == "load" and who != "raw" and rnd == 0:
                    ok = check(model, sd, rank, world, dotted=True)
                if job == "load" and who != "raw":
                    for v in sd.values():  # the next load starts from zeros
                        (v.to_local() if hasattr(v, "to_local") else v).zero_()
                results.append(
                    {
                        "round": rnd,
                        "who": who,
                        "temp": temp,
                        "secs": secs,
                        "ok": ok,
                        "rchar": io1["rchar"] - io0["rchar"],
                        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
                        "loaded": mine if who != "raw" else len(buf or b"") * 0,
                        "zarrckpt_bytes_read": (report or {}).get("bytes_read"),
                    }
                )
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def dcp_job(job, world, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        store, out = f"{d}/store", f"{d}/out"
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_dcp_rank_main, args=(r, world, store, job, args, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            sys.exit(f"bench: a {job} rank failed")
        per_rank = [json.load(open(f"{out}.{r}")) for r in range(world)]
    rows = []
    for i, first in enumerate(per_rank[0]):
        rows.append(
            {
                "job": job,
                "round": first["round"],
                "who": first["who"],
                "temp": first["temp"],
                "secs": max(p[i]["secs"] for p in per_rank),
                "ok": None if first["ok"] is None else all(p[i]["ok"] for p in per_rank),
                "rchar": sum(p[i]["rchar"] for p in per_rank),
                "read_bytes": sum(p[i]["read_bytes"] for p in per_rank),
                "loaded": sum(p[i]["loaded"] for p in per_rank),
                "zarrckpt_bytes_read": (
                    None
                    if first["zarrckpt_bytes_read"] is None
                    else sum(p[i]["zarrckpt_bytes_read"] for p in per_rank)
                ),
            }
        )
    return rows


def main_dcp(args) -> None:
    model = gpt(args.size)
    total = nbytes(model)
    print(
        f"bench --mode dcp: GPT-like state of {total / 1e9:.2f} GB ({len(model)} tensors) as "
        f"DTensors; dcp.save on {SAVE_WORLD} processes, dcp.load on {LOAD_WORLD} (another "
        f"sharding), cold (page cache evicted) and warm; {args.rounds} rounds, "
        f"{os.cpu_count()} cores, torch {torch.__version__}",
        flush=True,
    )
    rows = dcp_job("save", SAVE_WORLD, args) + dcp_job("load", LOAD_WORLD, args)
    for r in rows:
        r["gbps"] = total / r["secs"] / 1e9
        if any(x["ok"] is False for x in rows):
            sys.exit(f"bench: {r['who']} loaded wrong data")
    kinds = [("save", ""), ("load", "cold"), ("load", "warm")]
    names = {
        "zarrckpt": "dcp + zarrckpt writer/reader",
        "dcp": "dcp + FileSystemWriter/Reader",
        "raw": "raw limit",
    }
    summary: dict = {}
    for job, temp in kinds:
        by = {
            w: {r["round"]: r for r in rows if (r["job"], r["temp"], r["who"]) == (job, temp, w)}
            for w in names
        }
        tag = f"{job}{'/' + temp if temp else ''}"
        for w in names:
            summary[f"{tag}/{w}"] = statistics.median(r["gbps"] for r in by[w].values())
        for a, b in (("zarrckpt", "dcp"), ("zarrckpt", "raw"), ("dcp", "raw")):
            summary[f"{tag}/{a}:{b}"] = statistics.median(
                by[a][n]["gbps"] / by[b][n]["gbps"] for n in range(args.rounds)
            )
        if job == "load":
            for w in ("zarrckpt", "dcp"):
                rs = list(by[w].values())
                summary[f"{tag}/{w}/amplification_rchar"] = statistics.median(
                    r["rchar"] / r["loaded"] for r in rs
                )
                summary[f"{tag}/{w}/amplification_disk"] = statistics.median(
                    r["read_bytes"] / r["loaded"] for r in rs
                )
            summary[f"{tag}/zarrckpt/amplification_counted"] = statistics.median(
                r["zarrckpt_bytes_read"] / r["loaded"] for r in by["zarrckpt"].values()
            )
            summary[f"{tag}/raw/disk_fraction"] = statistics.median(
                r["read_bytes"] / total for r in by["raw"].values()
            )
    if args.json:
        print(json.dumps({"bytes": total, "rows": rows, "summary": summary}, indent=1))
    for job, temp in kinds:
        tag = f"{job}{'/' + temp if temp else ''}"
        what = "write + fsync" if job == "save" else f"{temp} read"
        print(
            f"\n{tag}, {SAVE_WORLD if job == 'save' else LOAD_WORLD} processes "
            f"(GB/s, median of {args.rounds} rounds; raw limit = {what} of the same bytes)"
        )
        for w in names:
            rounds = ", ".join(
                f"{r['gbps']:.2f}"
                for r in sorted(
                    (r for r in rows if (r["job"], r["temp"], r["who"]) == (job, temp, w)),
                    key=lambda r: r["round"],
                )
            )
            print(f"  {names[w]:<32} {summary[f'{tag}/{w}']:6.2f}   (rounds: {rounds})")
        print(
            "  medians of per-round ratios: "
            f"zarrckpt / DCP {summary[f'{tag}/zarrckpt:dcp']:.2f}x, "
            f"zarrckpt / raw {summary[f'{tag}/zarrckpt:raw']:.2f}, "
            f"DCP / raw {summary[f'{tag}/dcp:raw']:.2f}"
        )
        if job == "load":
            print(
                "  bytes read / bytes loaded: "
                f"zarrckpt {summary[f'{tag}/zarrckpt/amplification_rchar']:.3f} (read calls), "
                f"{summary[f'{tag}/zarrckpt/amplification_counted']:.3f} (counted by zarrckpt), "
                f"{summary[f'{tag}/zarrckpt/amplification_disk']:.3f} (from the device); "
                f"DCP {summary[f'{tag}/dcp/amplification_rchar']:.3f} (read calls), "
                f"{summary[f'{tag}/dcp/amplification_disk']:.3f} (from the device); "
                f"raw read from the device: {summary[f'{tag}/raw/disk_fraction']:.3f} of its bytes"
            )
    shutil.rmtree(args.dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# the Rust ranks


def rust_job(job, world, args, rnd) -> dict:
    exe = REPO / "target" / "release" / "zarrckpt"
    path = f"{args.dir}/rust"
    report = f"{args.dir}/report"
    cmd = [
        str(exe),
        "launch",
        "-n",
        str(world),
        "--",
        str(exe),
        "worker",
        job,
        "--dir",
        path,
        "--size",
        str(args.size),
        "--hidden",
        str(HIDDEN),
        "--tp",
        str(world),
        "--report",
        report,
    ]
    if job == "save":
        shutil.rmtree(path, ignore_errors=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
    ap.add_argument(
        "--mode",
        choices=("dcp", "torch"),
        default="dcp",
        help="dcp: dcp.save/load through zarrckpt's writer/reader against DCP's FileSystemWriter/"
        "Reader, cold and warm (default); torch: zarrckpt.torch against DCP and the Rust API",
    )
    args = ap.parse_args()
    if args.mode == "dcp":
        shutil.rmtree(args.dir, ignore_errors=True)
        os.makedirs(args.dir)
        main_dcp(args)
        return
    exe = REPO / "target" / "release" / "zarrckpt"
    if not exe.exists():
        sys.exit(f"bench: build the CLI first (cargo build --release): {exe} is missing")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    model = gpt(args.size)
    total = nbytes(model)
    print(
        f"bench: GPT-like state of {total / 1e9:.2f} GB ({len(model)} tensors), "
        f"{SAVE_WORLD} processes save, {LOAD_WORLD} load (another sharding), "
        f"{args.rounds} rounds, {os.cpu_count()} cores, torch {torch.__version__}",
        flush=True,
    )

    rows = []
    rows += [dict(r, job="save") for r in python_and_rust("save", SAVE_WORLD, args)]
    rows += [dict(r, job="load") for r in python_and_rust("load", LOAD_WORLD, args)]
    for r in rows:
        r["gbps"] = total / r["secs"] / 1e9

    who_all = ("zarrckpt", "dcp", "rust", "raw")
    names = {
        "zarrckpt": "zarrckpt.torch",
        "dcp": "DCP FileSystemWriter/Reader",
        "rust": "zarrckpt Rust API (TCP)",
        "raw": "raw limit",
    }
    summary: dict = {}
    for job in ("save", "load"):
        mine = [r for r in rows if r["job"] == job]
        by = {w: {r["round"]: r for r in mine if r["who"] == w} for w in who_all}
        for w in who_all:
            summary[f"{job}/{w}"] = statistics.median(r["gbps"] for r in by[w].values())
            if any(r["ok"] is False for r in by[w].values()):
                sys.exit(f"bench: {w} loaded wrong data")
        # Ratios within each round (the disk's speed swings between rounds).
        for a, b in (
            ("zarrckpt", "dcp"),
            ("zarrckpt", "rust"),
            ("zarrckpt", "raw"),
            ("dcp", "raw"),
            ("rust", "raw"),
        ):
            summary[f"{job}/{a}:{b}"] = statistics.median(
                by[a][n]["gbps"] / by[b][n]["gbps"] for n in range(args.rounds)
            )
    if args.json:
        print(json.dumps({"bytes": total, "rows": rows, "summary": summary}, indent=1))
    for job in ("save", "load"):
        what = "write + fsync" if job == "save" else "page-cache read"
        print(
            f"\n{job}, {SAVE_WORLD if job == 'save' else LOAD_WORLD} processes "
            f"(GB/s, median of {args.rounds} rounds; raw limit = {what} of the same bytes)"
        )
        for w in who_all:
            rounds = ", ".join(
                f"{r['gbps']:.2f}"
                for r in sorted(
                    (r for r in rows if r["job"] == job and r["who"] == w), key=lambda r: r["round"]
                )
            )
            print(f"  {names[w]:<30} {summary[f'{job}/{w}']:6.2f}   (rounds: {rounds})")
        print(
            "  medians of per-round ratios: "
            f"zarrckpt.torch / DCP {summary[f'{job}/zarrckpt:dcp']:.2f}x, "
            f"zarrckpt.torch / Rust API {summary[f'{job}/zarrckpt:rust']:.2f}, "
            f"zarrckpt.torch / raw {summary[f'{job}/zarrckpt:raw']:.2f}, "
            f"DCP / raw {summary[f'{job}/dcp:raw']:.2f}, "
            f"Rust API / raw {summary[f'{job}/rust:raw']:.2f}"
        )
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
