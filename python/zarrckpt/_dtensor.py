"""Where a DTensor's local tensor lies in its global tensor, as boxes.

With ``Shard`` placements a rank's local tensor is one box of the global tensor. With
``_StridedShard`` (FSDP2 over a tensor-parallel model, and views of it) the rows a rank holds
along a dimension are a list of global indices that need not be contiguous: torch 2.15's
DCP helpers (``compute_local_shape_and_global_offset``) report only the first of them, which
describes the local tensor correctly only when the list happens to be one run. Here the list
is computed in full with torch's own placement rules (``_local_shard_size_and_offset`` with
every offset), cut into runs of consecutive indices, and the local tensor is described as the
product of the runs over its dimensions: several boxes, each a plain view (``narrow``) of the
local tensor.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch


def _strided_type() -> Any:
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover - older torch
        return None
    return _StridedShard


def has_strided(placements: Any) -> bool:
    strided = _strided_type()
    return strided is not None and any(isinstance(p, strided) for p in placements)


def _runs(index: list[int]) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of the runs of consecutive global indices."""
    out: list[tuple[int, int, int]] = []
    for j, g in enumerate(index):
        if out and out[-1][1] + out[-1][2] == g:
            ls, gs, n = out[-1]
            out[-1] = (ls, gs, n + 1)
        else:
            out.append((j, g, 1))
    return out


def global_indices(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: list[int], placements: Any
) -> tuple[list[int], dict[int, list[int]]]:
    """The local shape and, per sharded dimension, the global index of each local position
    (torch's left-to-right placement rules; ``_StridedShard`` with every offset)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

    strided = _strided_type()
    local = list(shape)
    index: dict[int, torch.Tensor] = {}
    for md, p in enumerate(placements):
        if strided is not None and isinstance(p, strided):
            size, offs = p._local_shard_size_and_offset(
                local[p.dim], mesh_shape[md], coord[md], offset_mode=_StridedShardOffsetMode.ALL
            )
            idx = torch.tensor(list(offs or [])[:size], dtype=torch.long)
        elif isinstance(p, Shard):
            size, off = p._local_shard_size_and_offset(local[p.dim], mesh_shape[md], coord[md])
            idx = torch.arange(int(off), int(off) + int(size))
        else:
            continue
        size = int(size)
        prev = index.get(p.dim)
        index[p.dim] = idx if prev is None else prev[idx]
        local[p.dim] = size
    return local, {d: [int(i) for i in v.tolist()] for d, v in index.items()}


def local_boxes(dt: Any) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The boxes of DTensor ``dt``'s local tensor: ``(global offset, local offset, sizes)``
    each; an empty list when this rank holds none of it (or is outside its mesh)."""
    mesh = dt.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return []
    shape = tuple(int(d) for d in dt.shape)
    local, index = global_indices(shape, tuple(mesh.shape), list(coord), dt.placements)
    if any(n == 0 for n in local):
        return []
    per_dim: list[list[tuple[int, int, int]]] = []
    for d, n in enumerate(local):
        per_dim.append(_runs(index[d]) if d in index else [(0, 0, n)])
    boxes = []
    for combo in itertools.product(*per_dim):
        boxes.append(
            (
                tuple(g for _, g, _ in combo),
                tuple(s for s, _, _ in combo),
                tuple(n for _, _, n in combo),
            )
        )
    return boxes


def view(local: torch.Tensor, start: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The box ``start`` + ``sizes`` of ``local``, as a view."""
    t = local
    for d, (s, n) in enumerate(zip(start, sizes, strict=True)):
        if s != 0 or n != t.shape[d]:
            t = t.narrow(d, s, n)
    return t
