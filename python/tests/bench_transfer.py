"""Live weight transfer (zarrckpt.transfer) over torch.distributed gloo (``TorchComm``) against
gloo's own point-to-point exchange of the same messages, in the same run: a synthetic
Llama-shaped model (Megatron names, each tensor's rows split over the trainer processes) goes
to engine processes holding whole HF tensors, filled in place. The transfer's exchanges are
recorded (peer and size of every message, the agreement's included) and then replayed with
``dist.isend`` / ``dist.irecv`` from and into buffers written before the clock starts. Prints
one JSON line: medians of ``--rounds`` timed transfers (cached plan) and replays, the slowest
rank's time each, and their ratio (target: the transfer at least 80% of the raw rate).

    python python/tests/bench_transfer.py --hidden 1024 --layers 8 --trainers 4 --engines 1
"""

from __future__ import annotations

import argparse
import json
import time

import distributed
import torch


class Recorder:
    """A communicator forwarding to another and recording the message sizes of each exchange."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.world_size = inner.world_size
        self.calls: list | None = None

    def exchange(self, sends, recvs) -> None:
        if self.calls is not None:
            self.calls.append(([(p, len(m)) for p, m in sends], [(p, len(m)) for p, m in recvs]))
        self.inner.exchange(sends, recvs)


def replay(calls: list, rank: int) -> float:
    """Seconds for gloo's isend / irecv of the recorded messages, call after call."""
    import torch.distributed as dist

    most = max((sum(n for _, n in s) + sum(n for _, n in r) for s, r in calls), default=0)
    buf = torch.ones(max(most, 1), dtype=torch.uint8)  # written before the clock starts
    dist.barrier()
    t0 = time.perf_counter()
    for sends, recvs in calls:
        works, at, tags = [], 0, {}
        for kind, msgs in (("send", sends), ("recv", recvs)):
            for peer, n in msgs:
                tag = tags.get((kind, peer), 0)
                tags[(kind, peer)] = tag + 1
                if peer == rank or n == 0:
                    continue
                t = buf[at : at + n]
                at += n
                if kind == "send":
                    works.append(dist.isend(t, dst=peer, tag=tag))
                else:
                    works.append(dist.irecv(t, src=peer, tag=tag))
        for w in works:
            w.wait()
    return time.perf_counter() - t0


def job(rank, world, a):
    import torch.distributed as dist

    import zarrckpt.convert as zc
    import zarrckpt.transfer as zt
    from zarrckpt import _core

    nt = a["trainers"]
    cfg = {
        "num_hidden_layers": a["layers"],
        "hidden_size": a["hidden"],
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 4 * a["hidden"],
        "vocab_size": 32000,
        "tie_word_embeddings": False,
    }
    ex = zc.expand("llama", cfg)
    comm = Recorder(_core.communicator())
    t = zt.Transfer("llama", cfg, engine="hf", bucket_bytes=a["bucket"], comm=comm)
    if rank < nt:
        pieces = []
        for key, shape in ex.megatron_tensors().items():
            if shape[0] % nt == 0:
                rows = shape[0] // nt
                local = torch.full((rows, *shape[1:]), rank + 1, dtype=torch.bfloat16)
                pieces.append(
                    _core.Piece(key, local, shape, (rank * rows,) + (0,) * (len(shape) - 1))
                )
            elif rank == 0:
                pieces.append(_core.Piece(key, torch.ones(shape, dtype=torch.bfloat16), shape))

        def step():
            return t.send(pieces)
    else:
        bufs = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in ex.hf_tensors().items()}

        def step():
            return t.receive(bufs)

    step()  # plans, and touches every buffer
    times, raws, total = [], [], 0
    for _ in range(a["rounds"]):
        comm.calls = []
        dist.barrier()
        t0 = time.perf_counter()
        rep = step()
        times.append(time.perf_counter() - t0)
        calls, comm.calls = comm.calls, None
        raws.append(replay(calls, rank))
        total = rep["total_bytes"]
    return {
        "transfer": times,
        "raw": raws,
        "total": total,
        "messages": sum(len(s) + len(r) for s, r in calls),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--trainers", type=int, default=4)
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--bucket", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    a = vars(ap.parse_args())
    out = distributed.run(a["trainers"] + a["engines"], job, a)

    def median_of_slowest(key: str) -> float:
        slowest = sorted(max(o[key][i] for o in out) for i in range(a["rounds"]))
        return slowest[len(slowest) // 2]

    tt, rt = median_of_slowest("transfer"), median_of_slowest("raw")
    gb = out[0]["total"] / 1e9
    row = {
        "transport": "torch.distributed gloo (TorchComm), 127.0.0.1",
        "bytes": out[0]["total"],
        "trainers": a["trainers"],
        "engines": a["engines"],
        "bucket": a["bucket"],
        "transfer_s": round(tt, 3),
        "transfer_gbps": round(gb / tt, 3),
        "raw_s": round(rt, 3),
        "raw_gbps": round(gb / rt, 3),
        "transfer_over_raw": round(rt / tt, 3),
        "messages_per_rank": max(o["messages"] for o in out),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
