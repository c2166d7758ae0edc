"""Megatron-Core ``dist_checkpointing`` save and load strategies backed by zarrckpt.

Megatron-Core (``megatron.core.dist_checkpointing``) saves a *sharded state dict*: nested
dicts and lists whose leaves are ``ShardedTensor`` (a box of a global tensor, with a
``replica_id``; pipeline stages prepend a layer axis, ``prepend_axis_num``),
``ShardedObject`` (one opaque value per cell of a grid, e.g. per layer), factories (applied by
Megatron before a strategy runs), ``LocalNonpersistentObject`` (never saved) and plain values
(the *common* state). This module stores all of it with zarrckpt: tensors as Zarr v3 arrays
that any later topology reshards (box intersection, uneven splits, the distributed
optimizer's flat ``dp_reshardable`` buckets, the legacy ``flattened_range``), objects and the
common state as zarrckpt objects, never pickled.

Switching a Megatron job, one argument::

    import zarrckpt.megatron as zm
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(sharded_sd, ckpt_dir, sharded_strategy=zm.SaveStrategy())
    state = dist_checkpointing.load(sharded_sd, ckpt_dir)  # the backend is found by name

With ``dist_checkpointing.save`` Megatron itself still writes the common state to
``common.pt`` with ``torch.save`` (its ``save`` accepts no other common strategy). For a
checkpoint without any pickle, call this module's :func:`save` instead: the same signature as
``dist_checkpointing.save``; the common state goes into the same zarrckpt commit as the
tensors. Either checkpoint loads with ``dist_checkpointing.load`` (or :func:`load`) once this
module is imported, which registers the backend ``"zarrckpt"`` (version 1) for all four
strategy actions.

Checkpoint directory (Megatron creates it before saving)::

    ckpt_dir/
      metadata.json   Megatron's marker, written last: {"sharded_backend": "zarrckpt", ...}
      common.pt       only when saved through dist_checkpointing.save (Megatron's own file)
      zarrckpt/       the zarrckpt checkpoint (spec/format.md): tensors/, objects/, zarr.json

Mapping:

* ``ShardedTensor`` -> a piece of the global tensor ``key`` (shape ``global_shape``) at
  ``global_offset``, the prepended axes as extents of 1. The main replica (``replica_id`` all
  zeros) is replica 0, any other replica 1: each box is stored once, its writes spread over
  the ranks holding it (``replicas="main"`` makes only main replicas write, as Megatron's
  ``torch_dist`` does). Several pieces of one key on one rank (the optimizer's buckets) are
  fine. A legacy ``flattened_range`` (Megatron < 0.16) is cut into the boxes it covers.
  ``allow_shape_mismatch`` loads the intersection with the stored tensor and zeroes the rest.
* ``ShardedObject`` -> the ``common`` zarrckpt object named by Megatron's ``unique_key``
  (``<key>/shard_<offset>_<shape>``, e.g. ``decoder.layers.mlp.linear_fc1._extra_state/
  shard_2_4``, as Megatron names its own files), declared by the main replica only. (Not a
  ``sharded`` zarrckpt object: zarrckpt takes one cell of a key per rank, and a pipeline stage
  holds several layers' cells.)
* The common state (what :func:`save` stores) -> the ``common`` object ``megatron/common``.

Values of objects and of the common state are encoded without pickle (:func:`encode_value`):
JSON where the value is plain JSON; otherwise a ``bytes`` value holding a tagged JSON tree and
the raw buffers of tensors, numpy arrays and bytes. Supported: None, bool, int, float (NaN and
infinities too), str, list, tuple, dict (any of these as keys), set, bytes, ``io.BytesIO``,
``torch.Tensor`` (any dtype of zarrckpt, loaded on CPU), ``torch.dtype``, ``torch.Size``,
numpy arrays and scalars, ``argparse.Namespace``, ``types.SimpleNamespace`` and enum members
(decoded as the member when its class is already imported, else as its value). Anything else
is an error naming its path; wrap such values in ``LocalNonpersistentObject`` or convert them.
"""

from __future__ import annotations

import argparse
import enum
import io
import json
import math
import os
import struct
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core.dist_checkpointing.core import (
    CheckpointingConfig,
    CheckpointingException,
    maybe_load_config,
    save_config,
)
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    StateDict,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    StrategyAction,
    register_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.base import (
    LoadCommonStrategy as _LoadCommonBase,
)
from megatron.core.dist_checkpointing.strategies.base import (
    SaveCommonStrategy as _SaveCommonBase,
)

from . import _core

__all__ = [
    "BACKEND",
    "VERSION",
    "SUBDIR",
    "COMMON_KEY",
    "SaveStrategy",
    "LoadStrategy",
    "SaveCommonStrategy",
    "LoadCommonStrategy",
    "save",
    "load",
    "register",
    "encode_value",
    "decode_value",
]

BACKEND = "zarrckpt"
VERSION = 1
SUBDIR = "zarrckpt"
COMMON_KEY = "megatron/common"


def _ckpt_path(checkpoint_dir: Any) -> Path:
    return Path(checkpoint_dir) / SUBDIR


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


# ---------------------------------------------------------------------------------------------
# values without pickle

_MAGIC = b"ZCKPTMG\x01"
_TAG = "__zarrckpt__"


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list[bytes | memoryview] = []

    def buffer(self, data: bytes | memoryview) -> int:
        self.buffers.append(data)
        return len(self.buffers) - 1

    def encode(self, v: Any, path: str) -> Any:
        if v is None or isinstance(v, bool | str):
            return v
        if isinstance(v, int) and not isinstance(v, enum.Enum):
            if -(2**63) <= v < 2**64:
                return v
            return {_TAG: "int", "v": str(v)}
        if isinstance(v, float) and not isinstance(v, enum.Enum):
            if math.isfinite(v):
                return v
            return {_TAG: "float", "v": repr(v)}
        if isinstance(v, enum.Enum):
            cls = type(v)
            return {
                _TAG: "enum",
                "cls": f"{cls.__module__}:{cls.__qualname__}",
                "name": v.name,
                "value": self.encode(v.value, f"{path}.value"),
            }
        if isinstance(v, list):
            return [self.encode(x, f"{path}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            items = [self.encode(x, f"{path}[{i}]") for i, x in enumerate(v)]
            if isinstance(v, torch.Size):
                return {_TAG: "torch.Size", "v": items}
            return {_TAG: "tuple", "v": items}
        if isinstance(v, set | frozenset):
            items = [self.encode(x, f"{path}{{}}") for x in v]
            return {_TAG: "frozenset" if isinstance(v, frozenset) else "set", "v": items}
        if isinstance(v, dict):
            if all(isinstance(k, str) for k in v) and _TAG not in v:
                return {k: self.encode(x, f"{path}.{k}") for k, x in v.items()}
            return {
                _TAG: "dict",
                "v": [
                    [self.encode(k, f"{path}<key>"), self.encode(x, f"{path}[{k!r}]")]
                    for k, x in v.items()
                ],
            }
        if isinstance(v, bytes | bytearray):
            return {_TAG: "bytes", "buf": self.buffer(bytes(v))}
        if isinstance(v, io.BytesIO):
            return {_TAG: "BytesIO", "buf": self.buffer(v.getvalue())}
        if isinstance(v, torch.Tensor):
            t = v.detach().to("cpu").contiguous()
            name = _core.dtype_name(t.dtype)
            raw = (
                t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            )
            return {
                _TAG: "tensor",
                "dtype": name,
                "shape": list(t.shape),
                "buf": self.buffer(raw.numpy().tobytes()),
            }
        if isinstance(v, torch.dtype):
            return {_TAG: "torch.dtype", "v": str(v).removeprefix("torch.")}
        if isinstance(v, np.ndarray):
            if v.dtype.hasobject or v.dtype.fields is not None:
                raise CheckpointingException(
                    f"zarrckpt.megatron: cannot store the numpy array of dtype {v.dtype} at "
                    f"`{path}` without pickle"
                )
            a = np.ascontiguousarray(v)
            return {
                _TAG: "ndarray",
                "dtype": _np_dtype_str(a.dtype),
                "shape": list(a.shape),
                "buf": self.buffer(a.tobytes()),
            }
        if isinstance(v, np.generic):
            if isinstance(v, np.bool_):
                return {_TAG: "npscalar", "dtype": "bool", "buf": self.buffer(v.tobytes())}
            return {
                _TAG: "npscalar",
                "dtype": _np_dtype_str(v.dtype),
                "buf": self.buffer(v.tobytes()),
            }
        if isinstance(v, argparse.Namespace | types.SimpleNamespace):
            kind = "Namespace" if isinstance(v, argparse.Namespace) else "SimpleNamespace"
            return {
                _TAG: kind,
                "v": {k: self.encode(x, f"{path}.{k}") for k, x in vars(v).items()},
            }
        if isinstance(v, tuple):  # a namedtuple: kept as a tuple of its values
            return {_TAG: "tuple", "v": [self.encode(x, f"{path}[{i}]") for i, x in enumerate(v)]}
        raise CheckpointingException(
            f"zarrckpt.megatron: cannot store a {type(v).__module__}.{type(v).__qualname__} at "
            f"`{path}` without pickle; convert it to plain values, tensors or bytes, or wrap it "
            "in LocalNonpersistentObject"
        )


def _np_dtype_str(dt: np.dtype) -> str:
    if dt.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return dt.name  # ml_dtypes: no type string of their own
    return dt.str


def _np_dtype(s: str) -> np.dtype:
    if s in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, s))
    dt = np.dtype(s)
    if dt.hasobject:
        raise CheckpointingException(f"zarrckpt.megatron: refusing numpy dtype {s!r}")
    return dt


def encode_value(value: Any, path: str = "value") -> str | bytes:
    """Encodes a value without pickle: JSON text when it is plain JSON (no tensors, bytes,
    tuples, non-string keys or special floats), else ``bytes``: ``ZCKPTMG\\x01``, the length of
    a JSON header (8 bytes, little endian), the header (``{"value": TREE, "buffers": [[offset,
    length], ...]}``) and the buffers, each at an offset that is a multiple of 8."""
    enc = _Encoder()
    tree = enc.encode(value, path)
    if not enc.buffers and not _has_tag(tree):
        return json.dumps(tree, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    spans, offset = [], 0
    for b in enc.buffers:
        spans.append([offset, len(b)])
        offset += len(b) + (-len(b) % 8)
    header = json.dumps({"value": tree, "buffers": spans}, allow_nan=False).encode()
    header += b" " * (-len(header) % 8)
    out = bytearray(_MAGIC + struct.pack("<Q", len(header)) + header)
    for b in enc.buffers:
        out += b
        out += b"\0" * (-len(b) % 8)
    return bytes(out)


def _has_tag(tree: Any) -> bool:
    if isinstance(tree, dict):
        return _TAG in tree or any(_has_tag(v) for v in tree.values())
    if isinstance(tree, list):
        return any(_has_tag(v) for v in tree)
    return False


class _Decoder:
    def __init__(self, body: memoryview, spans: list[list[int]]) -> None:
        self.body = body
        self.spans = spans

    def buf(self, i: int) -> memoryview:
        off, n = self.spans[i]
        if off < 0 or n < 0 or off + n > len(self.body):
            raise CheckpointingException("zarrckpt.megatron: object buffer out of range")
        return self.body[off : off + n]

    def decode(self, t: Any) -> Any:
        if isinstance(t, list):
            return [self.decode(x) for x in t]
        if not isinstance(t, dict):
            return t
        tag = t.get(_TAG)
        if tag is None:
            return {k: self.decode(v) for k, v in t.items()}
        if tag == "int":
            return int(t["v"])
        if tag == "float":
            return float(t["v"])
        if tag == "tuple":
            return tuple(self.decode(x) for x in t["v"])
        if tag == "torch.Size":
            return torch.Size(self.decode(x) for x in t["v"])
        if tag in ("set", "frozenset"):
            items = [self.decode(x) for x in t["v"]]
            return set(items) if tag == "set" else frozenset(items)
        if tag == "dict":
            return {_hashable(self.decode(k)): self.decode(v) for k, v in t["v"]}
        if tag == "bytes":
            return bytes(self.buf(t["buf"]))
        if tag == "BytesIO":
            return io.BytesIO(bytes(self.buf(t["buf"])))
        if tag == "tensor":
            dtype = getattr(torch, t["dtype"])
            shape = [int(d) for d in t["shape"]]
            raw = bytearray(self.buf(t["buf"]))
            flat = (
                torch.frombuffer(raw, dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            return (
                flat.view(dtype).reshape(shape).clone() if raw else torch.empty(shape, dtype=dtype)
            )
        if tag == "torch.dtype":
            dt = getattr(torch, t["v"], None)
            if not isinstance(dt, torch.dtype):
                raise CheckpointingException(f"zarrckpt.megatron: unknown torch dtype {t['v']!r}")
            return dt
        if tag == "ndarray":
            dt = _np_dtype(t["dtype"])
            return np.frombuffer(bytes(self.buf(t["buf"])), dtype=dt).reshape(t["shape"]).copy()
        if tag == "npscalar":
            dt = np.dtype(np.bool_) if t["dtype"] == "bool" else _np_dtype(t["dtype"])
            return np.frombuffer(bytes(self.buf(t["buf"])), dtype=dt)[0]
        if tag == "Namespace":
            return argparse.Namespace(**{k: self.decode(v) for k, v in t["v"].items()})
        if tag == "SimpleNamespace":
            return types.SimpleNamespace(**{k: self.decode(v) for k, v in t["v"].items()})
        if tag == "enum":
            return _enum_member(t["cls"], t["name"], self.decode(t["value"]))
        raise CheckpointingException(f"zarrckpt.megatron: unknown value tag {tag!r}")


def _hashable(k: Any) -> Any:
    if isinstance(k, list):
        return tuple(_hashable(x) for x in k)
    if isinstance(k, set):
        return frozenset(k)
    return k


def _enum_member(cls_path: str, name: str, value: Any) -> Any:
    """The enum member if its class is already imported (nothing is imported on behalf of a
    checkpoint), else its value."""
    module, _, qualname = cls_path.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if obj is not None else None
    if isinstance(obj, type) and issubclass(obj, enum.Enum) and name in obj.__members__:
        return obj[name]
    return value


def decode_value(stored: Any) -> Any:
    """The inverse of :func:`encode_value` (given the value as zarrckpt returns it: parsed
    JSON or ``bytes``)."""
    if isinstance(stored, bytes | bytearray | memoryview):
        data = memoryview(bytes(stored))
        if len(data) < 16 or bytes(data[:8]) != _MAGIC:
            raise CheckpointingException(
                "zarrckpt.megatron: a bytes object not written by zarrckpt.megatron"
            )
        (n,) = struct.unpack("<Q", data[8:16])
        header = json.loads(bytes(data[16 : 16 + n]))
        return _Decoder(data[16 + n :], header["buffers"]).decode(header["value"])
    return _Decoder(memoryview(b""), []).decode(stored)


# ---------------------------------------------------------------------------------------------
# ShardedTensor <-> pieces


def _flat_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The boxes (offset, extent, flat start) that elements [start, stop) of a C-order array of
    `shape` form, each contiguous in the flattening, in order."""
    if start >= stop:
        return
    if len(shape) == 0:
        yield (), (), 0
        return
    if len(shape) == 1:
        yield (start,), (stop - start,), start
        return
    inner = math.prod(shape[1:])
    r0, c0 = divmod(start, inner)
    r1, c1 = divmod(stop, inner)
    if r0 == r1:
        for off, ext, fs in _flat_boxes(shape[1:], c0, c1):
            yield (r0, *off), (1, *ext), r0 * inner + fs
        return
    if c0:
        for off, ext, fs in _flat_boxes(shape[1:], c0, inner):
            yield (r0, *off), (1, *ext), r0 * inner + fs
        r0 += 1
    if r1 > r0:
        yield (r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner
    if c1:
        for off, ext, fs in _flat_boxes(shape[1:], 0, c1):
            yield (r1, *off), (1, *ext), r1 * inner + fs


def _boxes(sh: ShardedTensor, data: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(global offset, tensor of the box's full-rank shape) for each box `sh` covers; the
    tensors are views of `data`."""
    p = sh.prepend_axis_num
    pre = tuple(int(o) for o in sh.global_offset[:p])
    base = tuple(int(o) for o in sh.global_offset[p:])
    local = tuple(int(d) for d in sh.local_shape)
    fr = getattr(sh, "flattened_range", None)
    if fr is None:
        return [(pre + base, data.reshape((1,) * p + local))]
    out = []
    flat = data.reshape(-1)
    for off, ext, fs in _flat_boxes(local, fr.start, fr.stop):
        n = math.prod(ext)
        view = flat[fs - fr.start : fs - fr.start + n].view((1,) * p + ext)
        out.append((pre + tuple(b + o for b, o in zip(base, off, strict=True)), view))
    return out


def _cpu_contiguous(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous()


def _save_pieces(sharded: list[ShardedTensor], replicas: str) -> list[_core.Piece]:
    pieces: list[_core.Piece] = []
    seen: dict[tuple, int] = {}
    for sh in sharded:
        main = is_main_replica(sh.replica_id)
        if replicas == "main" and not main:
            continue
        if sh.data is None:
            raise CheckpointingException(f"`data` attr is None for {sh}")
        data = sh.data.detach()
        if not _cpu_contiguous(data):
            data = data.to("cpu").contiguous()
        for offset, t in _boxes(sh, data):
            if t.numel() == 0:
                continue
            ident = (sh.key, offset, tuple(t.shape))
            replica = 0 if main else 1
            if ident in seen:  # one box twice on this rank (e.g. tied weights): store it once
                i = seen[ident]
                if replica == 0:
                    pieces[i].replica = 0
                continue
            seen[ident] = len(pieces)
            pieces.append(
                _core.Piece(
                    key=sh.key,
                    tensor=t,
                    global_shape=tuple(int(d) for d in sh.global_shape),
                    global_offset=offset,
                    replica=replica,
                )
            )
    return pieces


def _save_objects(objects: list[ShardedObject]) -> list[_core.Object]:
    out, seen = [], set()
    for o in objects:
        if not is_main_replica(o.replica_id) or o.unique_key in seen:
            continue
        seen.add(o.unique_key)
        out.append(
            _core.Object(
                key=o.unique_key,
                value=_stored(encode_value(o.data, path=o.unique_key)),
                scope="common",
            )
        )
    return out


def _object_from_unique_key(unique_key: str) -> ShardedObject | None:
    """The (empty) ShardedObject a stored object key names, or None for another key."""
    key, _, shard = unique_key.rpartition("/")
    parts = shard.split("_")
    if not key or len(parts) != 3 or parts[0] != "shard":
        return None
    try:
        offset = tuple(int(i) for i in parts[1].split("."))
        shape = tuple(int(i) for i in parts[2].split("."))
    except ValueError:
        return None
    if len(offset) != len(shape):
        return None
    return ShardedObject(key, None, shape, offset, replica_id=0)


def _stored(encoded: str | bytes) -> Any:
    """What _core takes: bytes, or a JSON value (re-parsed from the encoder's text)."""
    return encoded if isinstance(encoded, bytes) else json.loads(encoded)


# ---------------------------------------------------------------------------------------------
# the checkpoint's index, read without the core (metadata only)


def _index(checkpoint_dir: Any) -> dict:
    root = _ckpt_path(checkpoint_dir) / "zarr.json"
    try:
        doc = json.loads(root.read_text())
        return doc["attributes"]["zarrckpt"]
    except FileNotFoundError as e:
        raise CheckpointingException(
            f"{_ckpt_path(checkpoint_dir)} is not a committed zarrckpt checkpoint (no zarr.json)"
        ) from e
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointingException(f"{root}: not a zarrckpt index ({e})") from e


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointingException(f"zarrckpt.megatron: no torch dtype for {name!r}")
    return dt


# ---------------------------------------------------------------------------------------------
# strategies


class SaveStrategy(AsyncSaveShardedStrategy):
    """Saves ShardedTensors and ShardedObjects with zarrckpt (backend ``"zarrckpt"``).

    Args:
        group: the torch.distributed group saving together (default: the default group; every
            rank of it calls ``dist_checkpointing.save``).
        replicas: ``"balanced"`` (default): each replicated box is written once, by one of its
            holders, spread by bytes; ``"main"``: by its main replica only.
        options: passed to ``zarrckpt._core.save`` (``compression``, ``io_threads``,
            ``subchunk_bytes``, ...).
    """

    def __init__(
        self,
        backend: str = BACKEND,
        version: int = VERSION,
        *,
        group: Any = None,
        replicas: str = "balanced",
        **options: Any,
    ) -> None:
        super().__init__(backend, version)
        if replicas not in ("balanced", "main"):
            raise ValueError(f"replicas is 'balanced' or 'main', not {replicas!r}")
        self.group = group
        self.replicas = replicas
        self.options = options
        self.last_report: dict | None = None
        # Set by this module's save(): the common state, stored by rank 0 in the same commit.
        self._common: dict | None = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _prepare(self, sharded_state_dict: ShardedStateDict) -> tuple[list, list]:
        leaves = list(nested_values(sharded_state_dict))
        tensors = [v for v in leaves if isinstance(v, ShardedTensor)]
        objects = [v for v in leaves if isinstance(v, ShardedObject)]
        other = [v for v in leaves if not isinstance(v, ShardedTensor | ShardedObject)]
        if other:
            raise CheckpointingException(
                f"zarrckpt.megatron: unexpected leaves in the sharded part: {other[:3]}"
            )
        pieces = _save_pieces(tensors, self.replicas)
        objs = _save_objects(objects)
        common, self._common = self._common, None
        if common is not None and _rank() == 0:
            objs.append(
                _core.Object(
                    key=COMMON_KEY,
                    value=_stored(encode_value(common, path="common")),
                    scope="common",
                )
            )
        return pieces, objs

    def _options(self) -> dict:
        opts = {"overwrite": True, **self.options}
        return opts

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> None:
        pieces, objs = self._prepare(sharded_state_dict)
        self.last_report = _core.save(
            _ckpt_path(checkpoint_dir),
            pieces,
            objs,
            comm=_core.communicator(self.group),
            **self._options(),
        )

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> AsyncRequest:
        """Copies this rank's state into staging memory and returns; writing and the commit go
        on in a background thread of this process. The returned request has no ``async_fn``
        (nothing to run in Megatron's worker process); its finalisation waits for the
        background save (Megatron calls it on every rank, then writes metadata.json). With
        Megatron's async queue that wait happens at the first ``maybe_finalize_async_calls``
        after scheduling: call it late (e.g. before the next save) to keep training going
        meanwhile."""
        pieces, objs = self._prepare(sharded_state_dict)
        handle = _core.async_save(
            _ckpt_path(checkpoint_dir),
            pieces,
            objs,
            comm=_core.communicator(self.group),
            **self._options(),
        )

        def finalize() -> None:
            self.last_report = handle.wait()

        return AsyncRequest(None, (), [finalize])


class LoadStrategy(LoadShardedStrategy):
    """Loads ShardedTensors and ShardedObjects from a zarrckpt-backed Megatron checkpoint, in
    place into the tensors of the sharded state dict (allocated on CPU where ``data`` is None),
    in any topology.

    Args:
        group: the torch.distributed group loading together (default: the default group).
        cast: accept a stored float type other than the requested one (converted, rounded to
            nearest even); by default a different dtype is an error, never a silent cast.
        options: passed to ``zarrckpt._core.load`` (``io_threads``, ``exchange``, ...).
    """

    def __init__(self, *, group: Any = None, cast: bool = False, **options: Any) -> None:
        super().__init__()
        self.group = group
        self.cast = cast
        self.options = options
        self.last_report: dict | None = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(
                f"zarrckpt.megatron.LoadStrategy reads backend {BACKEND!r}, the checkpoint "
                f"has {loaded_backend!r}"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(
                f"zarrckpt.megatron reads version {VERSION}, the checkpoint has {loaded_version}"
            )

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: Any) -> StateDict:
        path = _ckpt_path(checkpoint_dir)
        leaves = list(nested_values(sharded_state_dict))
        stored_shapes: dict[str, tuple[int, ...]] | None = None
        if any(isinstance(v, ShardedTensor) and v.allow_shape_mismatch for v in leaves):
            stored_shapes = {
                k: tuple(e["shape"]) for k, e in _index(checkpoint_dir)["tensors"].items()
            }

        pieces: list[_core.Piece] = []
        posts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (staging, destination)
        first: dict[tuple, torch.Tensor] = {}  # one load per box on this rank
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        requests: list[_core.Object] = []
        objects: list[ShardedObject] = []

        for sh in leaves:
            if isinstance(sh, ShardedObject):
                objects.append(sh)
                requests.append(_core.Object(key=sh.unique_key, scope="common"))
                continue
            if not isinstance(sh, ShardedTensor):
                continue
            if sh.data is None:
                init = torch.zeros if sh.allow_shape_mismatch else torch.empty
                sh.data = init(sh.local_shape, dtype=sh.dtype, device="cpu")
            else:
                sh.data = sh.data.detach()
                if sh.allow_shape_mismatch:
                    sh.data.zero_()
            gshape = tuple(int(d) for d in sh.global_shape)
            for offset, dest in _boxes(sh, sh.data):
                if sh.allow_shape_mismatch:
                    stored = stored_shapes.get(sh.key) if stored_shapes else None
                    if stored is None:
                        raise CheckpointingException(f"tensor `{sh.key}` is not in {path}")
                    if len(stored) != len(offset):
                        raise CheckpointingException(
                            f"tensor `{sh.key}`: stored with {len(stored)} dimensions, "
                            f"requested with {len(offset)}"
                        )
                    ext = [
                        max(0, min(o + e, s) - o)
                        for o, e, s in zip(offset, dest.shape, stored, strict=True)
                    ]
                    dest = dest[tuple(slice(0, e) for e in ext)]
                    gshape = stored
                if dest.numel() == 0:
                    continue
                ident = (sh.key, offset, tuple(dest.shape))
                if ident in first:
                    copies.append((first[ident], dest))
                    continue
                first[ident] = dest
                target = dest
                if not _cpu_contiguous(dest):
                    target = torch.empty(dest.shape, dtype=dest.dtype, device="cpu")
                    posts.append((target, dest))
                pieces.append(
                    _core.Piece(
                        key=sh.key,
                        tensor=target,
                        global_shape=gshape,
                        global_offset=offset,
                        cast=self.cast,
                    )
                )

        report = _core.load(
            path, pieces, requests, comm=_core.communicator(self.group), **self.options
        )
        self.last_report = report
        for staging, dest in posts:
            dest.copy_(staging)
        for src, dest in copies:
            dest.copy_(src)
        values = {id(o): decode_value(v) for o, v in zip(objects, report["objects"], strict=True)}

        def result(v: Any) -> Any:
            if isinstance(v, ShardedTensor):
                return v.data
            if isinstance(v, ShardedObject):
                return values[id(v)]
            return v

        return dict_list_map_inplace(result, sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Any) -> dict[str, ShardedTensor]:
        out = {}
        for key, e in _index(checkpoint_dir)["tensors"].items():
            meta = torch.empty(tuple(e["shape"]), dtype=_torch_dtype(e["dtype"]), device="meta")
            out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: Any) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.load_tensors_metadata(checkpoint_dir))
        for key in _index(checkpoint_dir).get("objects", {}):
            o = _object_from_unique_key(key)
            if o is not None:
                out[o.unique_key] = o
        return out


class SaveCommonStrategy(_SaveCommonBase):
    """Megatron's common-strategy interface for the zarrckpt backend. The common state is
    stored by the sharded save, in the same commit (see :func:`save`); this object only hands
    it over."""

    def __init__(self, sharded: SaveStrategy | None = None) -> None:
        super().__init__(BACKEND, VERSION)
        self.sharded = sharded

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def save_common(self, common_state_dict: StateDict, checkpoint_dir: Any) -> None:
        if self.sharded is None:
            raise CheckpointingException(
                "zarrckpt.megatron.SaveCommonStrategy stores the common state together with the "
                "sharded state: use zarrckpt.megatron.save"
            )
        self.sharded._common = common_state_dict


class LoadCommonStrategy(_LoadCommonBase):
    """Reads the common state of a checkpoint saved by :func:`save` (the ``common`` object
    ``megatron/common``); no collective."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != BACKEND:
            raise CheckpointingException(f"common backend {loaded_backend!r} is not {BACKEND!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise CheckpointingException(f"common backend version {loaded_version} != {VERSION}")

    def load_common(self, checkpoint_dir: Any) -> StateDict:
        import zarrckpt

        ckpt = zarrckpt.open(_ckpt_path(checkpoint_dir))
        return decode_value(ckpt.object(COMMON_KEY))

    def load_sharded_objects(
        self, sharded_objects_state_dict: ShardedStateDict, checkpoint_dir: Any
    ):
        import zarrckpt

        ckpt = zarrckpt.open(_ckpt_path(checkpoint_dir))

        def one(o: ShardedObject) -> Any:
            return decode_value(ckpt.object(o.unique_key))

        return dict_list_map_inplace(one, sharded_objects_state_dict)


# ---------------------------------------------------------------------------------------------
# entry points


def register() -> None:
    """Registers the backend ``"zarrckpt"`` (version 1) with dist_checkpointing for the four
    strategy actions (idempotent; done on import)."""
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, SaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())
    register_default_strategy(StrategyAction.SAVE_COMMON, BACKEND, VERSION, SaveCommonStrategy())
    register_default_strategy(StrategyAction.LOAD_COMMON, BACKEND, VERSION, LoadCommonStrategy())


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: SaveStrategy | None = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
    preprocess_common_before_consistancy_check: Any = None,
    content_metadata: dict | None = None,
) -> AsyncRequest | None:
    """``dist_checkpointing.save`` with everything in zarrckpt, nothing pickled: the same
    arguments and steps (factories, non-persistent objects dropped, sharding integrity and
    common state checks, ``metadata.json`` written last by rank 0); the common state is stored
    by rank 0 in the same zarrckpt commit as the tensors and objects. ``metadata.json`` names
    ``"zarrckpt"`` as both sharded and common backend."""
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    if common_strategy is not None:
        raise CheckpointingException("zarrckpt.megatron.save stores the common state itself")
    strategy = sharded_strategy if sharded_strategy is not None else SaveStrategy()
    if not isinstance(strategy, SaveStrategy):
        raise CheckpointingException(
            f"zarrckpt.megatron.save needs a zarrckpt.megatron.SaveStrategy, not {strategy}"
        )
    rank = _rank()
    if rank == 0:
        os.makedirs(checkpoint_dir, exist_ok=True)
    if content_metadata is not None:
        sharded_state_dict["content_metadata"] = content_metadata
    sharded_part, common_state_dict = save_preprocess(
        sharded_state_dict, validate_access_integrity, preprocess_common_before_consistancy_check
    )
    SaveCommonStrategy(strategy).save_common(common_state_dict, checkpoint_dir)

    def finalize() -> None:
        if _rank() == 0:
            save_config(CheckpointingConfig(BACKEND, VERSION, BACKEND, VERSION), checkpoint_dir)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    if not async_sharded_save:
        strategy.save(sharded_part, checkpoint_dir)
        finalize()
        return None
    request = strategy.async_save(sharded_part, checkpoint_dir)
    request.finalize_fns.append(finalize)
    return request


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: LoadStrategy | None = None,
    common_strategy: Any = None,
    validate_access_integrity: bool = True,
    strict: Any = "assume_ok_unexpected",
) -> Any:
    """``dist_checkpointing.load`` (its arguments, strict modes and return values) for a
    zarrckpt-backed checkpoint; only makes sure the backend is registered."""
    from megatron.core.dist_checkpointing import load as mcore_load

    register()
    config = maybe_load_config(checkpoint_dir)
    if config is not None and config.sharded_backend == BACKEND and sharded_strategy is None:
        sharded_strategy = LoadStrategy()
    return mcore_load(
        sharded_state_dict,
        checkpoint_dir,
        sharded_strategy=sharded_strategy,
        common_strategy=common_strategy,
        validate_access_integrity=validate_access_integrity,
        strict=strict,
    )


register()
