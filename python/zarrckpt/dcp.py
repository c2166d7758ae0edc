"""zarrckpt inside ``torch.distributed.checkpoint`` (DCP): a storage writer and reader for
``dcp.save`` / ``dcp.async_save`` / ``dcp.load``, and a planner pair that never pickles.

::

    import torch.distributed.checkpoint as dcp
    import zarrckpt.dcp as zd

    dcp.save(state, storage_writer=zd.StorageWriter("ckpt/step-1200"), planner=zd.SavePlanner())
    dcp.load(state, storage_reader=zd.StorageReader("ckpt/step-1200"), planner=zd.LoadPlanner())

Writer
    DCP's write items (tensor shards with their global offsets, uneven ones included; DCP
    has already kept one copy of each replicated shard) become zarrckpt pieces, and
    non-tensor items become zarrckpt objects; one collective zarrckpt save writes them and
    commits the index atomically. The save runs in :meth:`StorageWriter.write_data`, which DCP
    calls on every rank (``finish`` runs on the coordinator only and has nothing left to do):
    a failure on any rank leaves the previous checkpoint at the path, never a mix. No pickled
    ``.metadata`` is written; the checkpoint is an ordinary zarrckpt checkpoint, keyed by the
    ``/``-joined path of each leaf in the (nested) state dict, as :mod:`zarrckpt.torch` keys
    them (``optim/state/fc.weight/exp_avg``), so ``zarrckpt.torch.load`` and
    ``zarrckpt.open`` read it.

Reader
    DCP's ``Metadata`` is built from the zarrckpt index of any checkpoint (written through
    DCP, :mod:`zarrckpt.torch` or the Rust CLI): one ``TensorStorageMetadata`` per tensor
    (dtype, shape, one chunk: the whole tensor), one ``BytesStorageMetadata`` per common
    object; a key ``a/b.c`` is DCP's ``a.b.c``. ``read_data`` (called on every rank) loads
    every read item of the rank in one collective zarrckpt load, straight into the targets
    ``planner.resolve_tensor`` gives, reading only the subchunks that intersect them (boxes
    several ranks need are read once and shared). Nothing is cast: a stored dtype other than
    the target's is an error (``StorageReader(path, cast=True)`` converts float types).

Non-tensor values and trust
    With :class:`SavePlanner` / :class:`LoadPlanner`, JSON-able values (``None``, bools,
    numbers, strings, lists, tuples and str-keyed dicts of them) are stored as JSON and
    ``bytes`` as bytes; loading never unpickles anything (tuples come back as tuples where the
    state dict has tuples). A value that is neither is an error naming its key.

    With DCP's default planners, non-tensor values are ``torch.save`` pickles. The writer
    stores them as opaque bytes and lists their keys in the checkpoint's object
    ``__zarrckpt_dcp__`` (``{"torch_save": [...]}``, :data:`TORCH_SAVE_FLAG`). DCP's
    ``DefaultLoadPlanner`` unpickles them with ``torch.load(weights_only=False)``: that runs
    whatever code the pickle holds, so load such a checkpoint only if you trust whoever could
    write it. :class:`LoadPlanner` refuses them (or, with ``pickled="weights_only"``, reads
    them with torch's restricted unpickler, which builds tensors and plain containers and runs
    no code). JSON and plain
    bytes objects reach DCP's default planner as pickles the reader builds itself, so the
    checkpoint's own bytes are never unpickled on that path.

A JSON object that :mod:`zarrckpt.torch` stored for a whole container (``optim/param_groups``)
is offered to DCP both whole (``optim.param_groups``) and as the leaves DCP's flattening names
(``optim.param_groups.0.lr``). Per-rank and sharded zarrckpt objects are not part of DCP's
metadata (read them with ``zarrckpt.open``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import uuid
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
)
from torch.distributed.checkpoint import (
    StorageReader as _DcpStorageReader,
)
from torch.distributed.checkpoint import (
    StorageWriter as _DcpStorageWriter,
)
from torch.distributed.checkpoint._traverse import get_element, set_element
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _core, _dtensor, _native
from ._errors import InvalidArgumentError, StorageError
from .torch import _is_json, _like

__all__ = [
    "StorageWriter",
    "StorageReader",
    "SavePlanner",
    "LoadPlanner",
    "TORCH_SAVE_FLAG",
    "import_dcp",
    "import_megatron",
]

# The per-rank object, declared by every rank of a save through the writer, listing the keys
# of the objects that rank wrote as torch.save pickles: ``{"torch_save": [key, ...]}`` (the
# reader takes the union; a common object of that form counts too). Every rank declares it,
# so that every rank saves objects (the Python ``Saver`` takes the objects path only on ranks
# that have objects; DCP gives non-tensor items to one rank).
TORCH_SAVE_FLAG = "__zarrckpt_dcp__"


def _done(value: Any) -> Future:
    f: Future = Future()  # torch.futures.Future: DCP calls .wait() and .value()
    f.set_result(value)
    return f


def _path(checkpoint_id: Any) -> str:
    return os.fspath(checkpoint_id)


def _comm(process_group: Any) -> Any:
    return _core.communicator(process_group)


def _is_checkpoint(path: Any) -> bool:
    try:
        _native.Checkpoint(_path(path))
    except Exception:  # noqa: BLE001 - any failure means "not a checkpoint"
        return False
    return True


# ---------------------------------------------------------------------------------------------
# planners


class _Value(io.BytesIO):
    """A non-tensor value the save planner hands the writer as it is (JSON or bytes,
    ``value``). As a BytesIO it holds the ``torch.save`` of the value, which is what another
    storage writer (DCP's ``FileSystemWriter``, whose format is pickles) stores; zarrckpt's
    writer takes ``value``."""

    def __init__(self, value: Any) -> None:
        buf = io.BytesIO()
        torch.save(value, buf)
        super().__init__(buf.getvalue())
        self.value = value


_Boxes = dict[str, list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]]


def _strided_boxes(state_dict: Mapping[str, Any]) -> _Boxes:
    """The local boxes of each DTensor with a ``_StridedShard`` placement in a flattened state
    dict (see :mod:`zarrckpt._dtensor`)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return {}
    out: _Boxes = {}
    for fqn, obj in state_dict.items():
        if isinstance(obj, DTensor) and _dtensor.has_strided(obj.placements):
            out[fqn] = _dtensor.local_boxes(obj)
    return out


def _box_view(state_dict: Mapping[str, Any], boxes: _Boxes, index: MetadataIndex) -> Any:
    """The view of a strided DTensor's local tensor that DCP item ``index`` names."""
    offset = tuple(int(o) for o in index.offset or ())
    for g, start, sizes in boxes[index.fqn]:
        if g == offset:
            return _dtensor.view(state_dict[index.fqn].to_local(), start, sizes)
    raise InvalidArgumentError(f"`{index.fqn}`: no local box at {offset}")


class _StridedPlanner:
    """Finds, when DCP sets a planner up, the DTensors with ``_StridedShard`` placements and
    the boxes their local tensors really cover (``self._strided``)."""

    _strided: _Boxes

    def set_up_planner(self, state_dict: Any, *args: Any, **kwargs: Any) -> None:
        super().set_up_planner(state_dict, *args, **kwargs)  # type: ignore[misc]
        self._strided = _strided_boxes(self.state_dict)  # type: ignore[attr-defined]


class SavePlanner(_StridedPlanner, DefaultSavePlanner):
    """DCP's default save planner, except that non-tensor values are stored as JSON (JSON-able
    values) or bytes (``bytes``), never pickled. Any other value is an error naming its key.

    DTensors with ``_StridedShard`` placements (FSDP2 + TP) are written as the boxes their
    local tensors really cover (several interleaved boxes where the global rows a rank holds
    are not contiguous); DCP's default planner describes them by their first offset only.
    Works with any storage writer."""

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        strided = getattr(self, "_strided", {})
        if not strided or not plan.items:
            return plan
        items: list[WriteItem] = []
        for item in plan.items:
            fqn = item.index.fqn
            if fqn not in strided or item.type != WriteItemType.SHARD:
                items.append(item)
                continue
            td = item.tensor_data
            for g, _, sizes in strided[fqn]:
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, torch.Size(g)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(torch.Size(g), torch.Size(sizes)),
                            properties=td.properties,
                            size=td.size,
                        ),
                    )
                )
        plan = dataclasses.replace(plan, items=items)
        self.plan = plan
        if hasattr(self, "_pending_local_plan"):
            self._pending_local_plan = plan
        return plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in getattr(self, "_strided", {}):
            return _box_view(self.state_dict, self._strided, index)
        return super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002
        if write_item.type != WriteItemType.BYTE_IO:
            return super().transform_object(write_item, object)
        if isinstance(object, bytes | bytearray | memoryview):
            return _Value(bytes(object))
        if _is_json(object):
            return _Value(object)
        raise InvalidArgumentError(
            f"`{write_item.index.fqn}`: {type(object).__module__}.{type(object).__qualname__} "
            "is neither a tensor, bytes nor a JSON value; zarrckpt.dcp.SavePlanner pickles "
            "nothing, so convert it first"
        )


class _Loaded(io.BytesIO):
    """What the reader hands ``load_bytes``: the stored value, decoded (``value``), and its
    kind (``"json"``, ``"bytes"``, or ``"torch_save"`` for a flagged pickle). As a BytesIO
    it holds a pickle DCP's default planner can read (see the reader)."""

    def __init__(self, data: bytes, value: Any, kind: str) -> None:
        super().__init__(data)
        self.zarrckpt_value = value
        self.zarrckpt_kind = kind


class LoadPlanner(_StridedPlanner, DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values are taken as zarrckpt stored
    them (JSON values, bytes) and nothing is unpickled. Tuples come back as tuples where the
    state dict has them.

    ``pickled``: what to do with an object the checkpoint flags as a ``torch.save`` pickle
    (written through DCP's default save planner): ``"error"`` (default) or
    ``"weights_only"`` (``torch.load(weights_only=True)``: torch's restricted unpickler,
    tensors and plain containers only, no code runs). Non-tensor values from another storage
    reader (DCP's ``FileSystemReader``: pickles) are refused, or read the same way with
    ``pickled="weights_only"``.

    DTensors with ``_StridedShard`` placements are read into the boxes their local tensors
    really cover (see :class:`SavePlanner`), with any storage reader."""

    def __init__(self, *args: Any, pickled: str = "error", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if pickled not in ("error", "weights_only"):
            raise InvalidArgumentError("pickled is 'error' or 'weights_only'")
        self.pickled = pickled
        self._strided: _Boxes = {}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        if not self._strided:
            return plan
        # DCP's default plan reads a strided DTensor as one box at its first offset: read
        # each of its real boxes instead.
        items = [i for i in plan.items if i.dest_index.fqn not in self._strided]
        for fqn, boxes in self._strided.items():
            md = self.metadata.state_dict_metadata.get(fqn) if self.metadata else None
            if md is None:
                continue  # missing keys: DCP's plan above has already decided
            chunks = [ChunkStorageMetadata(torch.Size(g), torch.Size(n)) for g, _, n in boxes]
            items.extend(create_read_items_for_chunk_list(fqn, md, chunks))
        return dataclasses.replace(plan, items=items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self._strided:
            return _box_view(self.state_dict, self._strided, index)
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        kind = getattr(value, "zarrckpt_kind", None)
        if kind is None and self.pickled != "weights_only":
            raise InvalidArgumentError(
                f"`{fqn}`: zarrckpt.dcp.LoadPlanner reads non-tensor values through "
                "zarrckpt.dcp.StorageReader only (it unpickles nothing); with another reader "
                "LoadPlanner(pickled='weights_only') reads them with torch's restricted unpickler"
            )
        if kind in (None, "torch_save"):
            if self.pickled != "weights_only":
                raise InvalidArgumentError(
                    f"`{fqn}`: the checkpoint stores this value as a torch.save pickle (written "
                    "through DCP's default save planner); zarrckpt.dcp.LoadPlanner does not "
                    "unpickle. LoadPlanner(pickled='weights_only') reads it with torch's "
                    "restricted unpickler; save with zarrckpt.dcp.SavePlanner to avoid pickles"
                )
            value.seek(0)
            loaded = torch.load(value, weights_only=True)
        else:
            loaded = value.zarrckpt_value  # type: ignore[attr-defined]
        if self.flatten_state_dict:
            path = self.mappings[fqn]
            template = get_element(self.original_state_dict, path)
            set_element(self.original_state_dict, path, _like(template, loaded))
        else:
            self.state_dict[fqn] = _like(self.state_dict.get(fqn), loaded)


# ---------------------------------------------------------------------------------------------
# writer


class StorageWriter(_DcpStorageWriter):
    """Writes ``dcp.save`` / ``dcp.async_save`` into a zarrckpt checkpoint at ``path``.

    ``process_group``: the group DCP saves with (default: the default group); zarrckpt talks
    over its own gloo group on the same ranks. ``overwrite`` (default True) replaces an
    existing checkpoint at the path atomically. Other options as :func:`zarrckpt._core.save`
    (``compression``, ``io_threads``, ``user_metadata``, ...)."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        process_group: Any = None,
        overwrite: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        self.path = _path(path) if path is not None else None
        self.process_group = process_group
        self.options = dict(options)
        self.options["overwrite"] = overwrite
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.last_report: dict | None = None

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = _path(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        if kwargs.get("use_collectives", True) is False:
            raise InvalidArgumentError(
                "zarrckpt saves collectively (one atomic commit for the job); "
                "use_collectives=False is not supported"
            )

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # As DCP's FileSystemWriter: refused in DCP's planning step, so every rank raises a
        # CheckpointException naming it, with DCP's own words.
        if (
            self.path is not None
            and not self.options.get("overwrite", True)
            and _is_checkpoint(self.path)
        ):
            raise StorageError(
                f"Checkpoint already exists and overwrite=False: {self.path} holds a zarrckpt "
                "checkpoint (pass overwrite=True to replace it atomically)"
            )
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: Any) -> Future:
        results: list[WriteResult] = []

        # Resolving DCP's items (the planner's transform_object may refuse a value) is the
        # first step of the collective save: a rank that fails here still takes part, so
        # every rank raises at once instead of waiting for it.
        def prepare() -> tuple:
            if self.path is None:
                raise InvalidArgumentError("StorageWriter: no path (checkpoint_id) given")
            return self._resolve(plan, planner, results)

        comm = _comm(self.process_group)
        self.last_report = _core._save(self.path, prepare, comm, dict(self.options), False)
        return _done(results)

    def _resolve(self, plan: SavePlan, planner: Any, results: list[WriteResult]) -> tuple:
        """The pieces and objects of DCP's write items (and their results, into ``results``)."""
        mappings = getattr(planner, "mappings", None) or {}
        pieces: list[_core.Piece] = []
        objects: list[_core.Object] = []
        keys: dict[str, str] = {}
        for item in plan.items:
            fqn = item.index.fqn
            key = keys.get(fqn) or keys.setdefault(fqn, _key(fqn, mappings, plan.planner_data))
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                if isinstance(data, _Value):
                    value = data.value
                elif isinstance(data, io.BytesIO):
                    value = data.getvalue()
                else:
                    raise InvalidArgumentError(
                        f"`{fqn}`: the planner resolved a non-tensor item to "
                        f"{type(data).__name__}; expected io.BytesIO"
                    )
                objects.append(_core.Object(key, value))
                size = len(value) if isinstance(value, bytes) else 0
            else:
                td = item.tensor_data
                t = data.detach()
                if t.device.type != "cpu":
                    t = t.to("cpu")
                if not t.is_contiguous() or t.is_conj() or t.is_neg():
                    t = t.resolve_conj().resolve_neg().contiguous()
                if t.dtype != td.properties.dtype:
                    raise InvalidArgumentError(
                        f"`{fqn}`: the planner resolved a {t.dtype} tensor for a "
                        f"{td.properties.dtype} item"
                    )
                pieces.append(
                    _core.Piece(
                        key,
                        t,
                        tuple(int(d) for d in td.size),
                        tuple(int(o) for o in td.chunk.offsets),
                    )
                )
                size = t.numel() * t.element_size()
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=None))
        pickled = [] if isinstance(planner, SavePlanner) else sorted(o.key for o in objects)
        objects.append(_core.Object(TORCH_SAVE_FLAG, {"torch_save": pickled}, "per_rank"))
        return pieces, objects

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        # The collective save in write_data has committed the checkpoint on every rank.
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            p = _path(checkpoint_id)
        except TypeError:
            return False
        return not os.path.exists(p) or _is_checkpoint(p)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)


def _key(fqn: str, mappings: Mapping[str, Any], extra: Any = None) -> str:
    """The zarrckpt key of a DCP item: the ``/``-joined path of the leaf in the nested state
    dict (DCP's flattening mappings), or the FQN itself for a flat state dict."""
    path = mappings.get(fqn)
    if path is None and isinstance(extra, Mapping):
        path = extra.get(fqn)
    if path is None:
        return fqn
    return "/".join(str(p) for p in path)


# ---------------------------------------------------------------------------------------------
# reader


def _json_terminal(value: list) -> bool:
    """DCP's rule: a list is a leaf unless it holds a dict or a list that is not a leaf."""
    return not any(
        isinstance(v, dict) or (isinstance(v, list) and not _json_terminal(v)) for v in value
    )


def _json_leaves(value: Any, path: tuple[str, ...]) -> Any:
    """The (path, value) leaves of a JSON value as DCP's flattening walks a state dict (empty
    for a value that is itself a leaf)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _json_leaves(v, (*path, str(k)))
    elif isinstance(value, list) and not _json_terminal(value):
        for i, v in enumerate(value):
            yield from _json_leaves(v, (*path, str(i)))
    elif path:
        yield path, value


class StorageReader(_DcpStorageReader):
    """Reads any zarrckpt checkpoint at ``path`` for ``dcp.load``.

    ``process_group``: the group DCP loads with (default: the default group). ``cast``:
    accept a stored float type other than the target's (converted, rounded to nearest
    even); by default a mismatch is an error. Other options as :func:`zarrckpt._core.load`
    (``io_threads``, ``exchange``, ``read_method``)."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        process_group: Any = None,
        cast: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        self.path = _path(path) if path is not None else None
        self.process_group = process_group
        self.cast = cast
        self.options = options
        self.load_id = uuid.uuid4().hex
        self.keys: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.pickled: set[str] = set()
        # DCP names of the leaves of JSON containers stored as one object: (key, path).
        self.parts: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.last_report: dict | None = None

    @property
    def checkpoint_id(self) -> str | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = _path(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.path is None:
            raise InvalidArgumentError("StorageReader: no path (checkpoint_id) given")
        if kwargs.get("rank") is not None:
            raise InvalidArgumentError("a zarrckpt checkpoint has no rank-local metadata")
        ck = _native.Checkpoint(self.path)
        md: dict[str, Any] = {}
        keys: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        parts: dict[str, tuple[str, tuple[str, ...]]] = {}

        def add(key: str, entry: Any) -> str:
            fqn = key.replace("/", ".")
            if fqn in keys:
                raise InvalidArgumentError(
                    f"keys `{keys[fqn]}` and `{key}` are both `{fqn}` in DCP's dotted naming"
                )
            keys[fqn] = key
            md[fqn] = entry
            return fqn

        for t in ck.tensors():
            shape = tuple(int(d) for d in t["shape"])
            props = TensorProperties(dtype=getattr(torch, t["dtype"]))
            # One chunk, the whole tensor: the reader reads any box, so DCP then plans one
            # read item per local tensor (its whole box, contiguous memory, read in place)
            # instead of one per stored chunk it meets (sub-boxes of the local tensor, which
            # are strided views when the split is not along the first axis).
            chunks = [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))]
            fqn = add(t["key"], TensorStorageMetadata(props, torch.Size(shape), chunks))
            shapes[fqn] = shape
        pickled: list[Any] = []
        for o in ck.objects():
            if o["key"] == TORCH_SAVE_FLAG:
                if o["scope"] == "per_rank":
                    slots: list[Any] = [("rank", r) for r in range(o["world_size"] or 0)]
                else:
                    slots = ["common"]
                for slot in slots:
                    enc, data = ck.read_object(TORCH_SAVE_FLAG, slot)
                    flag = json.loads(data) if enc == "json" else {}
                    if isinstance(flag, dict) and isinstance(flag.get("torch_save"), list):
                        pickled.extend(flag["torch_save"])
            elif o["scope"] == "common":
                fqn = add(o["key"], BytesStorageMetadata())
                if o["encoding"] == "json":
                    # A container stored whole (zarrckpt.torch): its leaves as DCP names them.
                    enc, data = ck.read_object(o["key"], "common")
                    for path, _ in _json_leaves(json.loads(data), ()):
                        sub = ".".join((fqn, *path))
                        if sub not in md:
                            md[sub] = BytesStorageMetadata()
                            parts[sub] = (o["key"], path)
        self.pickled = {str(k) for k in pickled}
        for sub in list(parts):
            if sub in keys:  # a stored key of that name wins
                del parts[sub]
        self.keys, self.shapes, self.parts = keys, shapes, parts
        return Metadata(
            state_dict_metadata=md,
            planner_data={f: tuple(k.split("/")) for f, k in keys.items()},
            storage_meta=StorageMeta(
                checkpoint_id=self.path, save_id=ck.save_id(), load_id=self.load_id
            ),
        )

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.is_coordinator = is_coordinator
        if not self.keys:  # metadata from elsewhere: rebuild our key table
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: Any) -> Future:
        pieces: list[_core.Piece] = []
        tensors: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None]] = []
        requests: list[_core.Object] = []
        byte_items: list[tuple[ReadItem, int, tuple[str, ...]]] = []

        # Resolving DCP's read items is the first step of the collective load: a rank that
        # fails here still takes part, so every rank raises at once.
        def prepare() -> tuple:
            if self.path is None:
                raise InvalidArgumentError("StorageReader: no path (checkpoint_id) given")
            self._resolve(plan, planner, pieces, tensors, requests, byte_items)
            return pieces, requests

        report = _core._load(
            self.path, prepare, _comm(self.process_group), "raise_unexpected", dict(self.options)
        )
        return self._finish_read(report, planner, requests, tensors, byte_items)

    def _resolve(
        self,
        plan: LoadPlan,
        planner: Any,
        pieces: list,
        tensors: list,
        requests: list,
        byte_items: list,
    ) -> None:
        """The pieces and object requests of DCP's read items, into the lists given."""
        requested: dict[str, int] = {}
        for item in plan.items:
            fqn = item.storage_index.fqn
            key = self.keys.get(fqn)
            path: tuple[str, ...] = ()
            if key is None and item.type == LoadItemType.BYTE_IO and fqn in self.parts:
                key, path = self.parts[fqn]
            if key is None:
                raise InvalidArgumentError(f"`{fqn}` is not in the checkpoint at {self.path}")
            if item.type == LoadItemType.BYTE_IO:
                if key not in requested:
                    requested[key] = len(requests)
                    requests.append(_core.Object(key))
                byte_items.append((item, requested[key], path))
                continue
            dest = planner.resolve_tensor(item).detach()
            if tuple(dest.shape) != tuple(item.lengths):
                raise InvalidArgumentError(
                    f"`{fqn}`: the planner resolved a tensor of shape {tuple(dest.shape)} for "
                    f"a read of {tuple(item.lengths)}"
                )
            staged = None
            mem = dest
            if dest.device.type != "cpu" or not dest.is_contiguous():
                staged = mem = torch.empty(tuple(dest.shape), dtype=dest.dtype, device="cpu")
            base = item.storage_index.offset or torch.Size([0] * len(item.lengths))
            offset = tuple(int(b) + int(o) for b, o in zip(base, item.storage_offsets, strict=True))
            pieces.append(_core.Piece(key, mem, self.shapes[fqn], offset, cast=self.cast))
            tensors.append((item, dest, staged))

    def _finish_read(
        self, report: dict, planner: Any, requests: list, tensors: list, byte_items: list
    ) -> Future:
        self.last_report = report
        for item, dest, staged in tensors:
            if staged is not None:
                dest.copy_(staged)
            planner.commit_tensor(item, dest)
        values = report["objects"]
        ours = isinstance(planner, LoadPlanner)
        for item, i, path in byte_items:
            value = values[i]
            for p in path:
                value = value[p] if isinstance(value, dict) else value[int(p)]
            planner.load_bytes(item, self._bytes(requests[i].key, value, ours, bool(path)))
        return _done(None)

    def _bytes(self, key: str, value: Any, ours: bool, part: bool) -> _Loaded:
        if isinstance(value, bytes) and not part:
            if key in self.pickled:
                # DCP's own format: the user's default planner unpickles it (see the module).
                return _Loaded(value, value, "torch_save")
            kind = "bytes"
        else:
            kind = "json"
        if ours:
            return _Loaded(b"", value, kind)
        # For DCP's default planner (which torch.load's whatever it gets): a pickle built
        # here from the decoded value, never the checkpoint's own bytes.
        buf = io.BytesIO()
        torch.save(value, buf)
        return _Loaded(buf.getvalue(), value, kind)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        try:
            return _is_checkpoint(_path(checkpoint_id))
        except TypeError:
            return False


# ---------------------------------------------------------------------------------------------
# migration: an existing DCP checkpoint into zarrckpt


class _TrustedPlanner(DefaultLoadPlanner):
    """Loads a DCP checkpoint's non-tensor values with ``torch.load(weights_only=False)``:
    torch's unrestricted unpickler, which runs whatever code the pickle holds (the
    ``weights_only=False`` imports only)."""

    def __init__(self) -> None:
        super().__init__(allow_partial_load=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = torch.load(value, map_location="cpu", weights_only=False)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _read_dcp_trusted(src: str) -> tuple[Metadata, dict[str, Any], Mapping]:
    """Every value of the DCP checkpoint directory ``src`` read in this process with torch's
    own reader and unrestricted unpickler: ``(metadata, {fqn: value}, flattening mappings)``."""
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(src)
    md = reader.read_metadata()
    mappings = md.planner_data if isinstance(md.planner_data, Mapping) else {}
    state: dict[str, Any] = {}
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            state[fqn] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
        else:
            state[fqn] = None
    if state:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, storage_reader=reader, planner=_TrustedPlanner(), no_dist=True)
    return md, state, mappings


def _boxes_for(
    shape: tuple[int, ...], entry: Any, ranks: int | None
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """``(offset, sizes)`` of the pieces an imported tensor is written as: the chunks the
    source saved (``ranks=None``), or ``ranks`` parts along the first axis (torch.chunk
    style, uneven last part)."""
    if not shape:
        return [((), ())]
    if ranks is None:
        chunks = getattr(entry, "chunks", None) or []
        boxes = [
            (tuple(int(o) for o in c.offsets), tuple(int(n) for n in c.sizes))
            for c in chunks
            if all(int(n) > 0 for n in c.sizes)
        ]
        covered = sum(math.prod(n) for _, n in boxes)
        if boxes and covered == math.prod(shape):
            return sorted(boxes)
        ranks = 1  # no usable chunk list: whole
    part = -(-shape[0] // ranks)
    out = []
    for r in range(ranks):
        lo = min(r * part, shape[0])
        hi = min(lo + part, shape[0])
        if hi > lo:
            out.append(((lo, *(0,) * (len(shape) - 1)), (hi - lo, *shape[1:])))
    return out or [((0,) * len(shape), shape)]


def _pieces(key: str, t: torch.Tensor, boxes: list) -> list[_core.Piece]:
    out = []
    shape = tuple(t.shape)
    for offset, sizes in boxes:
        v = t
        for d, (o, n) in enumerate(zip(offset, sizes, strict=True)):
            if o != 0 or n != shape[d]:
                v = v.narrow(d, o, n)
        out.append(_core.Piece(key, v.contiguous(), shape, offset))
    return out


def _verify_tensors(dst: str, tensors: dict[str, torch.Tensor]) -> None:
    from .reader import open as _open

    ck = _open(dst, output="torch")
    for key, want in tensors.items():
        got = ck[key][...]
        if not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            raise InvalidArgumentError(f"`{key}`: the imported tensor differs from the source")


def _native_import(
    fn: Any,
    src: str | os.PathLike,
    dst: str | os.PathLike,
    ranks: int | None,
    overwrite: bool,
    options: Mapping[str, Any],
) -> dict:
    """Runs the library importer ``fn`` (an extension function) and returns its report."""
    extra = sorted(set(options) - {"compression"})
    if extra:
        raise InvalidArgumentError(f"{fn.__name__}: unknown options {extra} (compression)")
    compression = options.get("compression", "none")
    text = fn(_path(src), _path(dst), ranks=ranks, overwrite=overwrite, compression=compression)
    return json.loads(text)


def import_dcp(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    weights_only: bool = True,
    ranks: int | None = None,
    overwrite: bool = False,
    **options: Any,
) -> dict:
    """Converts the DCP checkpoint directory ``src`` (``FileSystemWriter``'s format: a
    pickled ``.metadata`` and ``.distcp`` files, as torchtitan writes) into a zarrckpt
    checkpoint at ``dst``, then reads every tensor chunk and object back from ``dst`` and
    compares it with the source's, byte for byte.

    The library's importer does the work (through the extension; ``zarrckpt import --dcp``
    in the CLI calls the same function): it reads the pickles with a restricted reader that
    runs nothing (the globals it may name are an allow-list of the torch classes DCP and
    ``torch.save`` use), so no torch reader is involved and no code in the checkpoint runs.

    Layout: each tensor is written in the chunks the source saved (one piece per saved
    shard, so a job with the source's sharding reads exactly its own chunks), or, with
    ``ranks=N``, split ``N`` ways along its first axis as ``N`` ranks would hold it (any
    layout loads any other; this only picks the chunking). ``options``: ``compression``
    (``"none"``, ``"zstd"``, ``"blosc"``).

    The result holds no pickle: tensors as tensors (a non-tensor value that is a tensor too),
    plain data (``dict`` with ``str`` keys, ``list``, ``tuple``, ``str``, ``int``, ``float``,
    ``bool``, ``None``) as JSON, ``bytes`` as bytes; any other value is an error naming its
    key. Keys are the ``/``-joined state-dict paths DCP recorded (as the writer here keys
    them). Returns ``tensors``, ``objects``, ``tensor_bytes`` and a summary of the save
    (``save``).

    ``weights_only=False`` instead reads the source with torch's own DCP reader and
    unpickles non-tensor values with torch's unrestricted unpickler, which runs whatever
    code they hold (the values must still come out as tensors, bytes or plain data): use it
    only on checkpoints you trust."""
    if ranks is not None and ranks < 1:
        raise InvalidArgumentError("ranks must be at least 1")
    if weights_only:
        return _native_import(_native.import_dcp, src, dst, ranks, overwrite, options)
    return _import_dcp_torch(src, dst, ranks=ranks, overwrite=overwrite, **options)


def _import_dcp_torch(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    ranks: int | None,
    overwrite: bool,
    **options: Any,
) -> dict:
    """:func:`import_dcp` with ``weights_only=False``: torch's DCP reader and unrestricted
    unpickler, in this process."""
    md, state, mappings = _read_dcp_trusted(_path(src))
    pieces: list[_core.Piece] = []
    objects: list[_core.Object] = []
    tensors: dict[str, torch.Tensor] = {}
    keys: dict[str, str] = {}
    for fqn, value in state.items():
        key = _key(fqn, mappings)
        if key in keys:
            raise InvalidArgumentError(f"`{fqn}`: two DCP keys map to the zarrckpt key `{key}`")
        keys[key] = fqn
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu()
            tensors[key] = t
            boxes = _boxes_for(tuple(t.shape), md.state_dict_metadata.get(fqn), ranks)
            pieces.extend(_pieces(key, t, boxes))
        elif isinstance(value, bytes | bytearray) or _is_json(value):
            objects.append(
                _core.Object(key, bytes(value) if isinstance(value, bytearray) else value)
            )
        else:
            raise InvalidArgumentError(
                f"`{fqn}`: {type(value).__module__}.{type(value).__qualname__} is neither a "
                "tensor, bytes nor a JSON value; zarrckpt stores no pickles"
            )
    objects.append(_core.Object(TORCH_SAVE_FLAG, {"torch_save": []}, "per_rank"))
    report = _core.save(_path(dst), pieces, objects, comm=None, overwrite=overwrite, **options)
    # Every byte back, compared with the source's.
    _verify_tensors(_path(dst), tensors)
    from .reader import open as _open

    ck = _open(_path(dst), output="torch")
    for o in objects[:-1]:  # the last one is the flag
        got = ck.object(o.key)
        want = (
            o.value if isinstance(o.value, bytes) else json.loads(_core._json_text(o.key, o.value))
        )
        if got != want:
            raise InvalidArgumentError(f"`{o.key}`: the imported object differs from the source")
    return {
        "tensors": len(tensors),
        "objects": len(objects) - 1,
        "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "save": report,
    }


def import_megatron(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    weights_only: bool = True,
    ranks: int | None = None,
    overwrite: bool = False,
    **options: Any,
) -> dict:
    """Converts a Megatron-LM ``torch_dist`` checkpoint directory ``src`` (an ``iter_*``
    directory: ``metadata.json``, ``common.pt`` and DCP's ``.metadata`` and ``.distcp``
    files) into a zarrckpt-backed Megatron checkpoint directory ``dst``, as
    :func:`zarrckpt.megatron.save` writes it (``metadata.json`` naming backend ``zarrckpt``,
    ``dst/zarrckpt/`` the zarrckpt checkpoint): ``dist_checkpointing.load`` reads it in any
    topology once :mod:`zarrckpt.megatron` is imported, and ``zarrckpt.open(dst + "/zarrckpt")``
    without Megatron.

    Tensors keep Megatron's keys and global shapes (layer axes included); ShardedObjects
    become ``common`` objects named by their unique key, the content of ``common.pt`` the
    object ``megatron/common``, both encoded as :func:`zarrckpt.megatron.encode_value` encodes
    them (no pickle). Layout (``ranks``) and ``options`` (``compression``) as
    :func:`import_dcp`. Every tensor box and object is read back and compared byte for byte.
    Returns ``tensors``, ``objects`` (ShardedObjects and the common state), ``tensor_bytes``
    and ``save``.

    Trust: ``common.pt``, the objects and ``.metadata`` are pickles. By default the library's
    importer does the work (through the extension; ``zarrckpt import --megatron`` in the CLI
    calls the same function, and neither needs torch or megatron-core): its pickle reader runs
    nothing, and reads tensors, numpy arrays and scalars of numeric dtypes, plain data (also
    tuples, sets, non-string dict keys, NaN), ``torch.Size`` / ``torch.dtype``,
    ``argparse.Namespace``, ``types.SimpleNamespace`` and ``io.BytesIO``; any other value
    (an enum member, your own class) is an error naming the item, where in it, and its class.

    ``weights_only=False`` (CLI: ``python -m zarrckpt.migrate --megatron --trust-pickles``)
    instead reads the source with torch's DCP reader and unrestricted unpickler (needs torch
    and megatron-core), which runs whatever code the pickles hold: the one path of this
    package that executes a checkpoint's pickles, for values the library's reader refuses.
    Use it only on checkpoints you trust."""
    if ranks is not None and ranks < 1:
        raise InvalidArgumentError("ranks must be at least 1")
    if weights_only:
        return _native_import(_native.import_megatron, src, dst, ranks, overwrite, options)
    return _import_megatron_torch(src, dst, ranks=ranks, overwrite=overwrite, **options)


def _import_megatron_torch(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    ranks: int | None,
    overwrite: bool,
    **options: Any,
) -> dict:
    """:func:`import_megatron` with ``weights_only=False``: torch's DCP reader and
    unrestricted unpickler, in this process."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    import zarrckpt.megatron as zm

    src_p = _path(src)
    try:
        with open(os.path.join(src_p, "metadata.json")) as f:
            config = json.load(f)
    except FileNotFoundError as e:
        raise InvalidArgumentError(
            f"{src_p}: no metadata.json (not a Megatron dist_checkpointing directory)"
        ) from e
    backend = config.get("sharded_backend") if isinstance(config, dict) else None
    if backend != "torch_dist":
        raise InvalidArgumentError(
            f"{src_p}: sharded backend {backend!r}; only 'torch_dist' checkpoints are imported"
        )
    dst_p = _path(dst)
    ck_dir = os.path.join(dst_p, zm.SUBDIR)
    md, state, _ = _read_dcp_trusted(src_p)
    pieces: list[_core.Piece] = []
    objects: list[_core.Object] = []
    tensors: dict[str, torch.Tensor] = {}
    sources: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu()
            tensors[key] = t
            boxes = _boxes_for(tuple(t.shape), md.state_dict_metadata.get(key), ranks)
            pieces.extend(_pieces(key, t, boxes))
        else:
            # torch_dist stores a ShardedObject as the list of the values the saving rank held
            # under its unique key (copies of one value); Megatron's loader hands out the first.
            if not isinstance(value, list) or not value:
                raise InvalidArgumentError(
                    f"`{key}`: a torch_dist object is a non-empty list, not {type(value).__name__}"
                )
            value = value[0]
            sources[key] = value
            objects.append(_core.Object(key, zm._stored(zm.encode_value(value, path=key))))
    common_path = os.path.join(src_p, "common.pt")
    if os.path.exists(common_path):
        common = torch.load(common_path, map_location="cpu", weights_only=False)
        sources[zm.COMMON_KEY] = common
        objects.append(
            _core.Object(zm.COMMON_KEY, zm._stored(zm.encode_value(common, path="common")))
        )
    os.makedirs(dst_p, exist_ok=True)
    report = _core.save(ck_dir, pieces, objects, comm=None, overwrite=overwrite, **options)
    _verify_tensors(ck_dir, tensors)
    from .reader import open as _open

    ck = _open(ck_dir, output="torch")
    for key, value in sources.items():
        again = zm.encode_value(zm.decode_value(ck.object(key)), path=key)
        if again != zm.encode_value(value, path=key):
            raise InvalidArgumentError(f"`{key}`: the imported object differs from the source")
    save_config(CheckpointingConfig(zm.BACKEND, zm.VERSION, zm.BACKEND, zm.VERSION), dst_p)
    return {
        "tensors": len(tensors),
        "objects": len(sources),
        "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "save": report,
    }
