"""Loading a state into CUDA tensors: zarrckpt.torch.load (device path: pinned staging,
copies on the current stream) against torch DCP's FileSystemReader (dcp.load), one process,
same state, same machine, warm page cache; plus zarrckpt's async save blocking time from
CUDA memory against a plain device-to-host copy of the same bytes.

    python python/bench/bench_gpu.py --size-gb 4 --dir /tmp/bench-gpu

Needs a CUDA GPU (exits with a message otherwise). Target (issue 12): load at least 2x DCP's.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

import zarrckpt.torch as zt


def state(size: int, cols: int = 4096, n: int = 16) -> dict:
    rows = max(1, size // n // cols // 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    return {
        f"layers.{i}.weight": torch.randn(rows, cols, device="cuda", generator=g).to(torch.bfloat16)
        for i in range(n)
    }


def best(f, reps: int) -> float:
    t = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        f()
        torch.cuda.synchronize()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=4.0)
    ap.add_argument("--dir", default="zarrckpt-bench-gpu-py")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU on this machine", file=sys.stderr)
        return 2
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    sd = state(int(a.size_gb * 1e9))
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    print(f"state: {len(sd)} bf16 tensors, {nbytes / 1e9:.2f} GB on {torch.cuda.get_device_name()}")
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root / "dcp")))
    zt.save(sd, root / "zarrckpt")
    # Warm the page cache for both.
    for p in root.rglob("*"):
        if p.is_file():
            p.read_bytes()
    out = {k: torch.empty_like(v) for k, v in sd.items()}
    host = torch.empty(max(v.numel() for v in sd.values()) * 2, dtype=torch.uint8).pin_memory()

    def h2d():
        for v in out.values():
            v.view(torch.uint8).view(-1).copy_(host[: v.numel() * 2], non_blocking=True)

    def d2h():
        for v in sd.values():
            host[: v.numel() * 2].copy_(v.view(torch.uint8).view(-1), non_blocking=True)

    t_h2d = best(h2d, a.reps)
    t_d2h = best(d2h, a.reps)
    reader = str(root / "dcp")
    t_dcp = best(lambda: dcp.load(out, storage_reader=dcp.FileSystemReader(reader)), a.reps)
    t_z = best(lambda: zt.load(out, root / "zarrckpt"), a.reps)
    assert all(torch.equal(out[k], sd[k]) for k in sd)
    blocked = float("inf")
    for i in range(a.reps):
        h = zt.async_save(sd, root / f"async{i}")
        blocked = min(blocked, h.blocked_s)
        h.wait()
        shutil.rmtree(root / f"async{i}")
    gb = nbytes / 1e9
    print(f"raw pinned host->device: {gb / t_h2d:.2f} GB/s; device->host: {gb / t_d2h:.2f} GB/s")
    print(f"dcp.load (FileSystemReader) into CUDA: {gb / t_dcp:.2f} GB/s")
    print(
        f"zarrckpt.torch.load into CUDA: {gb / t_z:.2f} GB/s = {t_dcp / t_z:.2f}x DCP "
        f"(target 2x), {100 * t_h2d / t_z:.0f}% of pinned host->device"
    )
    print(
        f"zarrckpt async save from CUDA: blocked {blocked:.3f}s = {blocked / t_d2h:.2f}x a plain "
        "device->host copy (target <= 1.2x)"
    )
    shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
