"""Command-line entry of the DCP and Megatron ``torch_dist`` importers::

    python -m zarrckpt.migrate DIR --out CKPT [--megatron] [--ranks N] [--trust-pickles]
        [--overwrite] [--compression none|zstd|blosc]

``DIR`` is a DCP checkpoint directory (``FileSystemWriter``'s format, e.g. a torchtitan step)
or, with ``--megatron``, a Megatron-LM ``torch_dist`` checkpoint (an ``iter_*`` directory);
see :func:`zarrckpt.dcp.import_dcp` and :func:`zarrckpt.dcp.import_megatron`. Without
``--trust-pickles`` this runs the library's importers, as the Rust CLI's ``zarrckpt import
--dcp DIR`` and ``zarrckpt import --megatron DIR`` do: their pickle reader runs nothing.
``--trust-pickles`` is the one path that executes the checkpoint's pickles (torch's reader
and unrestricted unpickler, in this process; ``--megatron`` then needs megatron-core), for
values the library's reader refuses (an enum member, your own class): use it only on
checkpoints you trust. Prints one JSON line (``tensors``, ``objects``, ``tensor_bytes``,
``seconds``, ``out``); on an error, a message on stderr and exit status 1 (2 for bad
arguments).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zarrckpt.migrate", description=__doc__.split("\n")[0]
    )
    p.add_argument("src", help="the DCP (or, with --megatron, torch_dist) checkpoint directory")
    p.add_argument("--out", required=True, help="the zarrckpt checkpoint to write")
    p.add_argument("--megatron", action="store_true", help="SRC is a Megatron torch_dist dir")
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="write each tensor split N ways along its first axis (default: the source's chunks)",
    )
    p.add_argument(
        "--trust-pickles",
        action="store_true",
        help="read the source with torch and its unrestricted unpickler, which runs whatever "
        "code the pickles hold (only for checkpoints you trust)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing checkpoint")
    p.add_argument("--compression", default="none", choices=("none", "zstd", "blosc"))
    a = p.parse_args(argv)
    from . import dcp
    from ._errors import ZarrckptError

    fn = dcp.import_megatron if a.megatron else dcp.import_dcp
    t0 = time.monotonic()
    try:
        rep = fn(
            a.src,
            a.out,
            weights_only=not a.trust_pickles,
            ranks=a.ranks,
            overwrite=a.overwrite,
            compression=a.compression,
        )
    except (ZarrckptError, OSError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = {k: rep[k] for k in ("tensors", "objects", "tensor_bytes")}
    out["seconds"] = round(time.monotonic() - t0, 3)
    out["out"] = a.out
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
