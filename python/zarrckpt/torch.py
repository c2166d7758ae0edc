"""PyTorch state dicts, saved and loaded the way ``torch.distributed.checkpoint`` does.

::

    import zarrckpt.torch as zc

    state = {"model": model, "optim": optimizer, "step": 1200, "rng": zc.PerRank(rng_bytes)}
    zc.save(state, "ckpt/step-1200")                # collective over torch.distributed
    handle = zc.async_save(state, "ckpt/step-1300")  # returns once the state is copied
    handle.wait()
    zc.load(state, "ckpt/step-1200")                # in place, any world size / sharding

A state dict is nested dicts, lists and tuples whose leaves are

- ``torch.Tensor``: the same on every rank (replicated), stored once; wrap it in
  :class:`PerRank` when every rank holds its own value (stored as one tensor with a leading
  rank axis, loaded back by rank);
- ``DTensor``: any device mesh, ``Shard`` / ``Replicate`` / ``_StridedShard`` (FSDP2 + TP)
  placements, uneven shards; each rank saves its local shard (replicas once; a strided one as
  the boxes it covers) and loads whatever its new sharding needs;
- objects with ``state_dict()`` / ``load_state_dict()`` (``nn.Module``, ``torch.optim``
  optimizers, schedulers, ...): their state dicts are saved, and loaded back through
  ``load_state_dict``. An optimizer whose module is in the same state dict goes through
  ``torch.distributed.checkpoint.state_dict`` (``get_optimizer_state_dict`` /
  ``set_optimizer_state_dict``): its state is keyed by parameter names, reshards with the
  parameters, and is created before a load if the optimizer has not stepped yet;
- ``None``, ``bool``, ``int``, ``float``, ``str`` and containers of them only: stored as
  JSON (one object per such container), the same on every rank (or :class:`PerRank`);
- ``bytes``: stored as they are.

Nothing is pickled, in either direction. Non-tensor values are replaced by the loaded ones
(tuples come back as tuples where the state dict had tuples); tensors are filled in place.
Keys are the ``/``-joined path of the leaf (``optim/state/fc.weight/exp_avg``).

Collective: every rank of the process group (``process_group``, default: the default group)
calls it, with state dicts of the same structure. Without torch.distributed (or with one
rank) it runs on its own. The ranks talk over a dedicated gloo group created on first use
from the default group's store: nothing to set up under ``torchrun``, no port to choose, and
never interleaved with training collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import _core, _dtensor
from ._errors import InvalidArgumentError

__all__ = ["save", "load", "async_save", "PerRank", "SaveHandle"]

SaveHandle = _core.SaveHandle


@dataclass
class PerRank:
    """A leaf every rank holds its own value of (a tensor, bytes or a JSON value): each
    rank saves its own and loads its own back. At another world size a load refuses them on
    every rank (or, with ``load(..., per_rank="skip")``, leaves them as they are); read the
    saved values with :func:`zarrckpt.open` to redistribute them."""

    value: Any


try:  # DTensor (torch >= 2.4 public API)
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # pragma: no cover - torch without distributed
    DTensor = Partial = Replicate = Shard = None  # type: ignore[assignment,misc]

_JSON_SCALARS = (type(None), bool, int, float, str)


def _is_stateful(v: Any) -> bool:
    return (
        not isinstance(v, torch.Tensor | Mapping | list | tuple)
        and callable(getattr(v, "state_dict", None))
        and callable(getattr(v, "load_state_dict", None))
    )


def _is_json(v: Any) -> bool:
    """True for JSON scalars and containers holding only JSON (str-keyed dicts)."""
    if isinstance(v, _JSON_SCALARS):
        return not (isinstance(v, int) and not isinstance(v, bool) and not -(2**63) <= v < 2**64)
    if isinstance(v, Mapping):
        return all(isinstance(k, str) and _is_json(x) for k, x in v.items())
    if isinstance(v, list | tuple):
        return all(_is_json(x) for x in v)
    return False


def _join(path: str, k: Any) -> str:
    if isinstance(k, bool) or not isinstance(k, str | int):
        raise InvalidArgumentError(
            f"state dict key {k!r} under `{path or '/'}`: keys are str or int"
        )
    return f"{path}/{k}" if path else str(k)


def _like(template: Any, value: Any) -> Any:
    """A loaded JSON value with the template's tuples restored."""
    if isinstance(template, tuple) and isinstance(value, list) and len(template) == len(value):
        items = [_like(t, v) for t, v in zip(template, value, strict=True)]
        return type(template)(*items) if hasattr(template, "_fields") else tuple(items)
    if isinstance(template, Mapping) and isinstance(value, dict):
        return {k: _like(template[k], v) if k in template else v for k, v in value.items()}
    if isinstance(template, list) and isinstance(value, list) and len(template) == len(value):
        return [_like(t, v) for t, v in zip(template, value, strict=True)]
    return value


# ---------------------------------------------------------------------------------------------
# stateful objects (modules, optimizers) and their state dicts


def _dsd():
    try:
        from torch.distributed.checkpoint import state_dict as dsd
    except ImportError:  # pragma: no cover
        return None
    return dsd


class _Stateful:
    """A stateful leaf: how to get its state dict and how to hand one back."""

    def __init__(self, obj: Any, modules: list[torch.nn.Module]) -> None:
        self.obj = obj
        self.model: torch.nn.Module | None = None
        dsd = _dsd()
        if isinstance(obj, torch.optim.Optimizer) and dsd is not None:
            params = {id(p) for g in obj.param_groups for p in g["params"]}
            for m in modules:
                if params <= {id(p) for p in m.parameters()}:
                    self.model = m
                    break
        self.dsd = dsd

    def state_dict(self, for_load: bool) -> Any:
        obj, dsd = self.obj, self.dsd
        if self.model is not None:
            return dsd.get_optimizer_state_dict(self.model, obj)
        if isinstance(obj, torch.nn.Module) and dsd is not None:
            return dsd.get_model_state_dict(obj)
        if isinstance(obj, torch.optim.Optimizer) and for_load and dsd is not None:
            dsd._init_optim_state(obj)  # the state must exist to be loaded into
        return obj.state_dict()

    def load_state_dict(self, sd: Any) -> None:
        obj, dsd = self.obj, self.dsd
        if self.model is not None:
            dsd.set_optimizer_state_dict(self.model, obj, sd)
        elif isinstance(obj, torch.nn.Module) and dsd is not None:
            dsd.set_model_state_dict(obj, sd)
        else:
            obj.load_state_dict(sd)


def _modules(node: Any, out: list[torch.nn.Module]) -> list[torch.nn.Module]:
    if isinstance(node, torch.nn.Module):
        out.append(node)
    elif isinstance(node, Mapping):
        for v in node.values():
            _modules(v, out)
    elif isinstance(node, list | tuple):
        for v in node:
            _modules(v, out)
    return out


# ---------------------------------------------------------------------------------------------
# flattening


@dataclass
class _Plan:
    """What one rank saves or loads: pieces, objects and what to do afterwards."""

    pieces: list[_core.Piece]
    objects: list[_core.Object]
    # load: per object, how to put its value back (setter(value)), and the template
    setters: list[tuple[Callable[[Any], None], Any]]
    # load: copies from staging tensors back into the state's tensors
    copy_back: list[tuple[torch.Tensor, torch.Tensor]]
    # load: stateful objects to hand their state dicts back to (in a 1-element list), in order
    statefuls: list[tuple[_Stateful, list]]
    # load: per-rank keys left as they are (``per_rank="skip"`` at another world size)
    skipped: list[str] = dataclasses.field(default_factory=list)


class _Flattener:
    def __init__(
        self, comm: _core.TorchComm | None, load: bool, path: str, per_rank: str = "same_world"
    ) -> None:
        self.comm = comm
        self.per_rank_mode = per_rank
        self._saved_world: int | None = None
        self.rank = comm.rank if comm is not None else 0
        self.world = comm.world_size if comm is not None else 1
        self.load = load
        self.path = path
        self.plan = _Plan([], [], [], [], [])
        self.keys: set[str] = set()
        self.modules: list[torch.nn.Module] = []
        self._stored: dict[str, Any] | None = None

    def key(self, key: str) -> str:
        if not key:
            raise InvalidArgumentError("a state dict leaf needs a key: the top level is a dict")
        if key in self.keys:
            raise InvalidArgumentError(f"two leaves of the state dict flatten to the key `{key}`")
        self.keys.add(key)
        return key

    def stored(self) -> dict[str, Any]:
        """The checkpoint's tensors (read from its index once, for per-rank tensors)."""
        if self._stored is None:
            self._stored = {t["key"]: t for t in _core._native.Checkpoint(self.path).tensors()}
        return self._stored

    def saved_world(self) -> int:
        """The number of ranks that saved the checkpoint (read from its index once)."""
        if self._saved_world is None:
            self._saved_world = int(_core._native.Checkpoint(self.path).world_size())
        return self._saved_world

    def per_rank_loads(self, key: str) -> bool:
        """Whether per-rank leaf ``key`` is loaded: at the saving world size; at another one,
        refused (``per_rank="same_world"``), loaded where this rank saved one (``"by_rank"``)
        or left as it is (``"skip"``)."""
        saved = self.saved_world()
        if saved == self.world:
            return True
        if self.per_rank_mode == "skip" or (self.per_rank_mode == "by_rank" and self.rank >= saved):
            self.plan.skipped.append(key)
            return False
        if self.per_rank_mode == "by_rank":
            return True
        raise InvalidArgumentError(
            f"per-rank value `{key}`: the checkpoint at {self.path} was saved by {saved} ranks, "
            f"this job has {self.world}; per-rank values load only at the same world size. "
            "Pass per_rank='skip' to keep the current values (then redistribute the saved ones "
            "read with zarrckpt.open), or load with the saving world size"
        )

    # -- nodes -------------------------------------------------------------------------------

    def node(self, node: Any, key: str, setter: Callable[[Any], None] | None) -> Any:
        """Flattens ``node``; on load returns the node to put in its place."""
        if isinstance(node, PerRank):
            self.per_rank(node.value, key, setter)
            return node
        if DTensor is not None and isinstance(node, DTensor):
            self.dtensor(node, key)
            return node
        if isinstance(node, torch.Tensor):
            self.tensor(node, key)
            return node
        if isinstance(node, bytes | bytearray):
            self.object(key, bytes(node), "common", setter, node)
            return node
        if _is_json(node):
            self.object(key, node, "common", setter, node)
            return node
        if _is_stateful(node):
            s = _Stateful(node, self.modules)
            # The state dict is filled in place, or replaced whole if it is plain JSON.
            holder = [s.state_dict(self.load)]
            self.node(holder[0], key, lambda v: holder.__setitem__(0, v))
            if self.load:
                self.plan.statefuls.append((s, holder))
            return node
        if isinstance(node, Mapping):
            for k in list(node.keys()):
                sub = _join(key, k)

                def put(v: Any, node: Any = node, k: Any = k) -> None:
                    node[k] = v

                self.node(node[k], sub, put)
            return node
        if isinstance(node, list):
            for i in range(len(node)):

                def put_item(v: Any, node: Any = node, i: int = i) -> None:
                    node[i] = v

                self.node(node[i], _join(key, i), put_item)
            return node
        if isinstance(node, tuple):
            # Immutable: values loaded into it rebuild it, through the parent's setter.
            items = list(node)
            for i in range(len(items)):

                def put_tuple(v: Any, items: list = items, i: int = i, node: Any = node) -> None:
                    items[i] = v
                    if setter is not None:
                        rebuilt = type(node)(*items) if hasattr(node, "_fields") else tuple(items)
                        setter(rebuilt)

                self.node(items[i], _join(key, i), put_tuple)
            return node
        raise InvalidArgumentError(
            f"`{key}`: {type(node).__module__}.{type(node).__qualname__} is not a leaf zarrckpt "
            "saves (tensors, DTensors, objects with state_dict(), JSON values, bytes); nothing "
            "is pickled, so convert it first"
        )

    # -- leaves ------------------------------------------------------------------------------

    def object(self, key: str, value: Any, scope: str, setter: Any, template: Any) -> None:
        key = self.key(key)
        self.plan.objects.append(_core.Object(key, None if self.load else value, scope))
        if self.load:
            self.plan.setters.append((setter, template))

    def _memory(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """The CPU, contiguous tensor to save from / load into (``t`` itself when it is)."""
        if t.is_sparse or t.layout != torch.strided:
            raise InvalidArgumentError(f"`{key}`: only dense (strided) tensors are saved")
        t = t.detach()
        if t.device.type == "cpu" and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            return t
        if _core._is_cuda(t) and not (t.is_conj() or t.is_neg()):
            # CUDA memory goes through zarrckpt's device path (pinned staging, copies on the
            # current stream), strided views included: no full host copy by torch. A view
            # whose rows are not contiguous (a transpose: element-sized pitched copies) or
            # that overlaps itself goes through a contiguous copy on the GPU instead.
            if _disjoint_strides(t) and (t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1):
                return t
            if self.load:
                staged = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                self.plan.copy_back.append((t, staged))
                return staged
            return t.contiguous()
        staged = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        if self.load:
            self.plan.copy_back.append((t, staged))
        else:
            staged.copy_(t.resolve_conj().resolve_neg())
        return staged

    def tensor(self, t: torch.Tensor, key: str) -> None:
        key = self.key(key)
        mem = self._memory(key, t)
        shape = tuple(t.shape)
        self.plan.pieces.append(_core.Piece(key, mem, shape, (0,) * len(shape), replica="auto"))

    def dtensor(self, dt: Any, key: str) -> None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        key = self.key(key)
        replicated = False
        for p in dt.placements:
            if isinstance(p, Partial):
                raise InvalidArgumentError(
                    f"`{key}`: a DTensor with a Partial placement holds unreduced values; "
                    "redistribute it to Shard or Replicate first"
                )
            if not (isinstance(p, Shard | Replicate) or _dtensor.has_strided([p])):
                raise InvalidArgumentError(f"`{key}`: unsupported placement {p}")
        mesh = dt.device_mesh
        if mesh.get_coordinate() is None:
            return  # this rank is not in the DTensor's mesh: it holds nothing of it
        for d, p in enumerate(dt.placements):
            if isinstance(p, Replicate) and mesh.size(d) > 1:
                replicated = True
        gshape = tuple(dt.shape)
        local = dt.to_local()
        if _dtensor.has_strided(dt.placements):
            # FSDP2 + TP: the local tensor may be several interleaved boxes of the global one.
            boxes = _dtensor.local_boxes(dt)
            local_shape = [
                max((b[1][d] + b[2][d] for b in boxes), default=0) for d in range(dt.ndim)
            ]
            if tuple(local.shape) != tuple(local_shape) and boxes:
                raise InvalidArgumentError(
                    f"`{key}`: the local tensor's shape {tuple(local.shape)} is not the shape "
                    f"{tuple(local_shape)} its placements give"
                )
            for g, start, sizes in boxes:
                mem = self._memory(key, _dtensor.view(local, start, sizes))
                self.plan.pieces.append(
                    _core.Piece(key, mem, gshape, g, replica="auto" if replicated else 0)
                )
            return
        local_shape, offset = compute_local_shape_and_global_offset(dt.shape, mesh, dt.placements)
        if tuple(local.shape) != tuple(local_shape):
            raise InvalidArgumentError(
                f"`{key}`: the local tensor's shape {tuple(local.shape)} is not the shape "
                f"{tuple(local_shape)} its placements give"
            )
        mem = self._memory(key, local)
        self.plan.pieces.append(
            _core.Piece(
                key, mem, gshape, tuple(int(o) for o in offset), replica="auto" if replicated else 0
            )
        )

    def per_rank(self, value: Any, key: str, setter: Any) -> None:
        if self.load and (isinstance(value, torch.Tensor | bytes | bytearray) or _is_json(value)):
            if not self.per_rank_loads(key):
                self.key(key)
                return
        if isinstance(value, torch.Tensor) and not (DTensor and isinstance(value, DTensor)):
            key = self.key(key)
            mem = self._memory(key, value).reshape((1, *value.shape))
            world = self.world
            if self.load:
                stored = self.stored().get(key)
                if stored is not None:
                    world = stored["shape"][0] if stored["shape"] else 0
                    if self.rank >= world:
                        raise InvalidArgumentError(
                            f"per-rank tensor `{key}`: the checkpoint has values for {world} "
                            f"ranks, this is rank {self.rank}; read them with zarrckpt.open "
                            "and redistribute"
                        )
            gshape = (world, *value.shape)
            self.plan.pieces.append(
                _core.Piece(key, mem, gshape, (self.rank,) + (0,) * value.dim())
            )
        elif isinstance(value, bytes | bytearray) or _is_json(value):

            def put(v: Any) -> None:
                if setter is not None:
                    setter(PerRank(v))

            v = bytes(value) if isinstance(value, bytearray) else value
            self.object(key, v, "per_rank", put, value)
        else:
            raise InvalidArgumentError(
                f"`{key}`: PerRank holds a tensor, bytes or a JSON value, not "
                f"{type(value).__name__}"
            )


def _flatten(
    state_dict: Any, comm: Any, load: bool, path: str, per_rank: str = "same_world"
) -> _Plan:
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(
            f"the state dict is a dict (of tensors, modules, ...), not {type(state_dict).__name__}"
        )
    f = _Flattener(comm, load, path, per_rank)
    f.modules = _modules(state_dict, [])
    for k in list(state_dict.keys()):

        def put(v: Any, k: Any = k) -> None:
            state_dict[k] = v  # type: ignore[index]

        f.node(state_dict[k], _join("", k), put)
    return f.plan


def _save_options(overwrite: bool, options: dict) -> dict:
    out = dict(options)
    out["overwrite"] = overwrite
    return out


def _disjoint_strides(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory (an expanded view does)."""
    span = 1
    for stride, n in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride < span:
            return False
        span += stride * (n - 1)
    return True


def save(
    state_dict: Mapping[str, Any],
    path: Any,
    *,
    process_group: Any = None,
    overwrite: bool = True,
    **options: Any,
) -> dict:
    """Saves ``state_dict`` to the checkpoint directory ``path`` (collective).

    ``overwrite`` replaces an existing checkpoint at ``path`` atomically (never another kind
    of directory). Other options as :func:`zarrckpt._core.save` (``compression``,
    ``io_threads``, ``user_metadata``, ...). Returns this rank's save report.
    """
    return _save_state(state_dict, path, process_group, overwrite, options, False)


def async_save(
    state_dict: Mapping[str, Any],
    path: Any,
    *,
    process_group: Any = None,
    overwrite: bool = True,
    **options: Any,
) -> SaveHandle:
    """Starts saving ``state_dict`` (collective) and returns a :class:`SaveHandle` once the
    state is copied (tensors into staging memory, objects serialised): training may change
    it at once. Writing, fsync and the commit go on in a background thread; ``wait()``
    returns the report or raises, ``done()`` polls, ``exception()`` gives the error."""
    return _save_state(state_dict, path, process_group, overwrite, options, True)


def _save_state(
    state_dict: Mapping[str, Any],
    path: Any,
    process_group: Any,
    overwrite: bool,
    options: dict[str, Any],
    background: bool,
) -> Any:
    """:func:`save` (``background=False``) or :func:`async_save` (``True``)."""
    comm = _core.communicator(process_group)

    def prepare() -> tuple:
        plan = _flatten(state_dict, comm, load=False, path=str(path))
        return plan.pieces, plan.objects

    return _core._save(path, prepare, comm, _save_options(overwrite, options), background)


def load(
    state_dict: Mapping[str, Any],
    path: Any,
    *,
    process_group: Any = None,
    strict: bool | str = True,
    cast: bool = False,
    per_rank: str = "same_world",
    **options: Any,
) -> dict:
    """Loads the checkpoint at ``path`` into ``state_dict`` in place (collective), whatever
    the world size and sharding it was saved with: tensors and DTensor shards are filled,
    other values replaced, stateful objects get ``load_state_dict``.

    ``strict``: True (a key of the state dict missing from the checkpoint is an error,
    naming it), False (such keys are left as they are and listed in the report's
    ``unexpected``), or one of Megatron's mode names. ``cast``: accept a stored float type
    other than the tensor's (converted, rounded to nearest even); by default a dtype
    mismatch is an error. Returns this rank's load report.

    ``per_rank``: what :class:`PerRank` leaves do when the checkpoint was saved by another
    number of ranks than this job has (at the same world size, rank ``r`` loads rank ``r``'s
    value). ``"same_world"`` (default): the load is refused, on every rank alike, naming the
    key and both world sizes, so nothing is silently dropped or left unset. ``"by_rank"``:
    rank ``r`` loads the value saved by rank ``r`` where there is one; ranks beyond the saving
    world keep their current values, and saved values of ranks beyond this job's are not
    loaded. ``"skip"``: per-rank leaves keep their current values. Keys a rank left as they
    were are listed in its report's ``per_rank_skipped``; read the saved values with
    :func:`zarrckpt.open` to redistribute them.

    Collective: when one rank fails (a leaf it cannot load, a key the checkpoint lacks, a
    refused per-rank value), every rank raises at once (see :mod:`zarrckpt._core`).
    """
    if strict is True:
        mode = "raise_unexpected"
    elif strict is False:
        mode = "return_unexpected"
    else:
        mode = str(strict)
    if per_rank not in ("same_world", "by_rank", "skip"):
        raise InvalidArgumentError(
            f"per_rank is 'same_world', 'by_rank' or 'skip', not {per_rank!r}"
        )
    comm = _core.communicator(process_group)
    plans: list[_Plan] = []

    def prepare() -> tuple:
        plan = _flatten(state_dict, comm, load=True, path=str(path), per_rank=per_rank)
        if cast:
            for p in plan.pieces:
                p.cast = True
                if _core._is_cuda(p.tensor):
                    # Conversions run on the host path: load into host memory, then copy over.
                    staged = torch.empty(p.tensor.shape, dtype=p.tensor.dtype, device="cpu")
                    plan.copy_back.append((p.tensor, staged))
                    p.tensor = staged
        plans.append(plan)
        return plan.pieces, plan.objects

    report = _core._load(path, prepare, comm, mode, options)
    plan = plans[0]
    report["per_rank_skipped"] = list(plan.skipped)
    skipped = set(report["unexpected"])
    for (setter, template), obj, value in zip(
        plan.setters, plan.objects, report["objects"], strict=True
    ):
        if obj.key in skipped or setter is None:
            continue
        setter(_like(template, value))
    for dst, staged in plan.copy_back:
        dst.copy_(staged)
    for stateful, holder in plan.statefuls:
        stateful.load_state_dict(holder[0])
    return report
