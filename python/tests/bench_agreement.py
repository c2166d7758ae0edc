"""Bytes each rank receives from the others in the agreement of a save (100 row-sharded
tensors, one piece per rank each) and in one all-reduce of 1,000 bytes, through TorchComm
(gloo over loopback) and through the core's TCP communicator (``zarrckpt._native.TcpComm``),
per world size. Both run the core's shared collectives over their point-to-point transfers,
so the figures match (payload bytes, the 16-byte headers of the collectives' messages
included; TCP's own 32-byte frame headers, heartbeats and the rendezvous are not counted).

    python python/tests/bench_agreement.py 8,16
"""

from __future__ import annotations

import json
import socket
import sys
import tempfile

import distributed
import torch


def job(rank, world, root):
    import torch.distributed as dist

    from zarrckpt import _core, _native

    # Rank 0 picks a free port for the TCP communicator's rendezvous and tells the others.
    port = [0]
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    torch_comm = _core.communicator()
    tcp = _native.TcpComm(rank, world, "127.0.0.1", port[0])
    local = torch.full((4, 8), float(rank))
    pieces = [_core.Piece(f"layer{i}.w", local, (4 * world, 8), (4 * rank, 0)) for i in range(100)]
    out = {}
    for name, comm in (("torch", torch_comm), ("tcp", tcp)):
        _core.save(f"{root}/{name}-warm", pieces, comm=comm)
        before = comm.received_bytes
        _core.save(f"{root}/{name}", pieces, comm=comm)
        out[f"{name}_save"] = comm.received_bytes - before
        before = comm.received_bytes
        _native.all_reduce_max(comm, bytes(1000))
        out[f"{name}_all_reduce"] = comm.received_bytes - before
    # Everybody is done with TCP before anybody leaves it.
    dist.barrier()
    tcp.close()
    return out


def main() -> None:
    for world in [int(w) for w in sys.argv[1].split(",")]:
        with tempfile.TemporaryDirectory() as d:
            out = distributed.run(world, job, d)
        for what in ("save", "all_reduce"):
            row = {"world": world, "what": what}
            for name in ("torch", "tcp"):
                v = sorted(o[f"{name}_{what}"] for o in out)
                row[f"{name}_median"], row[f"{name}_max"] = v[len(v) // 2], v[-1]
            row["match"] = all(o[f"torch_{what}"] == o[f"tcp_{what}"] for o in out)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
