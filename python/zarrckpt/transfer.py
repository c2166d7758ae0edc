"""Live weight transfer for RL post-training: the trainer's shards (Megatron names, TP x PP x
EP boxes) go straight into a rollout engine's layout (HF names, vLLM's TP split or whole
tensors), in memory, over a torch.distributed group spanning both worlds (spec section 20).

The plan is the conversion table's, with the checks of ``export --vllm`` / ``export --hf``:
a layout the table cannot produce (heads not divisible, a tensor missing on either side, a
data type the engine buffer does not have) is refused on every rank, naming the rule, the key
and the numbers, before any weight byte moves. Each destination byte is sent once, by the
trainer rank holding its main replica (no tensor is gathered on a trainer rank), in rounds
where no rank sends or receives more than ``bucket_bytes`` (default 512 MiB). The plan is kept
by the :class:`Transfer` object: the next step with the same structure agrees on it with one
9-byte all-reduce.

Every rank of ``group`` (default: the default group) makes the same calls, with the same
options::

    t = Transfer("llama", config, trainer=(3, 2, 1), engine="vllm", engine_tp=3)
    # trainer ranks, after each optimizer step:
    t.send(model_chunks)                 # Megatron modules, a sharded state dict, or pieces
    # engine ranks:
    t.receive(params)                    # {vLLM name: tensor}, filled in place
    # or, for a load_weights-style engine:
    for bucket in t.buckets(wanted):     # wanted: {name: (dtype, shape)}
        model.load_weights(bucket)       # [(name, tensor), ...]

A trainer whose tensors already carry HF names (FSDP2: DTensors of a ``transformers`` model)
declares ``names="hf"`` and sends its state dict; the engine then holds whole HF tensors
(``engine="hf"``), checked against the table as ``import --hf`` checks its input::

    t = Transfer("qwen2", config, engine="hf", names="hf")
    t.send(fsdp_model.state_dict())      # trainer ranks: DTensors (Shard / Replicate) or tensors
    for bucket in t.buckets(wanted):     # engine ranks
        model.load_weights(bucket)
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from . import _core, _native
from ._errors import ConversionError, InvalidArgumentError

__all__ = ["Transfer", "ConversionError", "DEFAULT_BUCKET_BYTES", "megatron_pieces", "hf_pieces"]

DEFAULT_BUCKET_BYTES = 512 << 20


def megatron_pieces(state: Any) -> list[_core.Piece]:
    """The pieces of Megatron state: model chunks (modules with ``sharded_state_dict()``), or a
    sharded state dict. Factories are applied (fused SwiGLU fc1 as its two boxes), objects
    and non-tensor leaves left out, data moved to CPU where it is not already CPU contiguous."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from .megatron import _save_pieces

    if isinstance(state, list | tuple) and all(hasattr(m, "sharded_state_dict") for m in state):
        dicts = [m.sharded_state_dict() for m in state]
    elif hasattr(state, "sharded_state_dict"):
        dicts = [state.sharded_state_dict()]
    elif isinstance(state, Mapping):
        dicts = [state]
    else:
        raise InvalidArgumentError(
            f"transfer: Megatron model chunks or a sharded state dict, not {type(state).__name__}"
        )
    tensors = []
    for d in dicts:
        apply_factories(d)
        tensors.extend(v for v in nested_values(d) if isinstance(v, ShardedTensor))
    return _save_pieces(tensors, "main")


def hf_pieces(state: Any) -> list[_core.Piece]:
    """The pieces of an HF-named state: a module (its ``state_dict()``) or a flat mapping of
    names to tensors and DTensors (FSDP2's ``Shard``, ``Replicate`` and ``_StridedShard``
    placements, as :func:`zarrckpt.torch.save` takes them). A plain tensor or a replicated
    DTensor is declared as an automatic replica: one of its holders sends it."""
    import torch

    from .torch import DTensor, _Flattener

    if isinstance(state, torch.nn.Module):
        state = state.state_dict()
    if not isinstance(state, Mapping):
        raise InvalidArgumentError(
            f"transfer: a module or a mapping of HF names to tensors, not {type(state).__name__}"
        )
    fl = _Flattener(None, False, "")
    for name, v in state.items():
        if DTensor is not None and isinstance(v, DTensor):
            fl.dtensor(v, str(name))
        elif isinstance(v, torch.Tensor):
            fl.tensor(v, str(name))
        else:
            raise InvalidArgumentError(
                f"transfer: `{name}` is a {type(v).__name__}, not a tensor or DTensor"
            )
    return fl.plan.pieces


def _piece_tuples(pieces: list[_core.Piece]) -> tuple[list[tuple], list[Any]]:
    out, keep = [], []
    for p in pieces:
        if p.flat_range is not None:
            raise InvalidArgumentError(f"`{p.key}`: flat ranges are not supported by transfer")
        if p.replica == "auto":
            replica = None
        elif isinstance(p.replica, int) and not isinstance(p.replica, bool) and p.replica >= 0:
            replica = int(p.replica)
        else:
            raise InvalidArgumentError(f'`{p.key}`: replica is an int >= 0 or "auto"')
        t = p.tensor
        if _core._is_torch(t) and (t.device.type != "cpu" or not t.is_contiguous()):
            t = t.detach().to("cpu").contiguous()
        dt, shape, addr, nbytes = _core._memory(p.key, t, False)
        gshape = tuple(int(d) for d in p.global_shape)
        off = tuple(int(o) for o in p.global_offset) if p.global_offset else (0,) * len(gshape)
        out.append((p.key, dt, gshape, off, shape, replica, addr, nbytes))
        keep.append(t)
    return out, keep


class Transfer:
    """One rank's end of a live weight transfer, kept from step to step.

    Args:
        table: conversion table (built-in name such as ``"llama"``, path, or JSON text).
        config: the model's HF config (dict, or path to ``config.json``).
        trainer: the trainer's (tp, pp, ep) layout (fixes vocabulary padding).
        engine: ``"vllm"`` (buffers as vLLM's TP rank ``engine_index % engine_tp`` holds them,
            as ``export --vllm`` writes them) or ``"hf"`` (whole HF tensors).
        names: the names the trainer's tensors carry: ``"megatron"`` (Megatron model chunks,
            sharded state dicts) or ``"hf"`` (an HF-named state dict, FSDP2 DTensors; for
            ``engine="hf"``).
        engine_tp: the engine's tensor-parallel size for ``"vllm"``.
        bucket_bytes: the most bytes one rank sends, and one rank receives, per round.
        cast: accept engine buffers of another float type than the trainer's.
        group: the torch.distributed group spanning trainer and engine ranks.
        comm: instead of ``group``, any zarrckpt communicator object (``rank``,
            ``world_size`` and ``exchange(sends, recvs)``, as ``zarrckpt._core.TorchComm``),
            e.g. over a process group created apart from the default one.
    """

    def __init__(
        self,
        table: str,
        config: Mapping | str,
        *,
        trainer: tuple[int, int, int] = (1, 1, 1),
        engine: str = "vllm",
        engine_tp: int = 1,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        cast: bool = False,
        names: str = "megatron",
        group: Any = None,
        comm: Any = None,
    ) -> None:
        if not isinstance(config, Mapping):
            with open(config) as f:
                config = json.load(f)
        self._native = _native.Transfer(
            table,
            json.dumps(dict(config)),
            tuple(int(x) for x in trainer),
            engine,
            int(engine_tp),
            int(bucket_bytes),
            bool(cast),
            str(names),
        )
        self.names = str(names)
        self.group = group
        self.comm = comm
        self.last_report: dict | None = None

    def _comm(self) -> Any:
        if self.comm is not None:
            return self.comm
        c = _core.communicator(self.group)
        if c is None:
            raise InvalidArgumentError(
                "transfer: torch.distributed must be initialised with trainer and engine ranks"
            )
        return c

    def send(self, state: Any) -> dict:
        """Trainer side: sends this rank's share of ``state`` (Megatron model chunks, a
        Megatron sharded state dict, or with ``names="hf"`` a module or HF-named state dict
        of tensors / DTensors; or a list of :class:`zarrckpt.Piece`). Returns the report
        (``planned``, ``rounds``, ``bytes_sent``, ``busiest_sent``, ...)."""
        if isinstance(state, list) and all(isinstance(p, _core.Piece) for p in state):
            pieces = state
        elif self.names == "hf":
            pieces = hf_pieces(state)
        else:
            pieces = megatron_pieces(state)
        tuples, keep = _piece_tuples(pieces)
        self.last_report = self._native.send(self._comm(), tuples)
        del keep
        return self.last_report

    def receive(self, buffers: Mapping[str, Any]) -> dict:
        """Engine side: fills ``buffers`` (name -> CPU contiguous tensor or numpy array, each
        of the dtype and shape the engine holds) in place."""
        tensors = []
        for name, t in buffers.items():
            dt, shape, addr, nbytes = _core._memory(name, t, True)
            tensors.append((name, dt, shape, addr, nbytes))
        self.last_report = self._native.receive(self._comm(), tensors)
        return self.last_report

    def receive_buckets(self, wanted: Mapping[str, tuple[Any, tuple[int, ...]]], on_bucket) -> dict:
        """Engine side, checkpoint format: ``wanted`` maps names to (dtype, shape);
        ``on_bucket([(name, tensor), ...])`` is called with the tensors completed in each
        round (e.g. ``model.load_weights``)."""
        import torch

        spec = [
            (name, dt if isinstance(dt, str) else _core.dtype_name(dt), tuple(int(s) for s in sh))
            for name, (dt, sh) in wanted.items()
        ]

        def convert(items: list) -> None:
            out = []
            for name, dt, shape, data in items:
                raw = bytearray(data)
                t = (
                    torch.frombuffer(raw, dtype=torch.uint8).view(getattr(torch, dt)).reshape(shape)
                    if raw
                    else torch.empty(shape, dtype=getattr(torch, dt))
                )
                out.append((name, t))
            on_bucket(out)

        self.last_report = self._native.receive_buckets(self._comm(), spec, convert)
        return self.last_report

    def buckets(self, wanted: Mapping[str, tuple[Any, tuple[int, ...]]]) -> Iterator[list]:
        """``receive_buckets`` as a generator: yields ``[(name, tensor), ...]`` per round
        while the transfer runs (in a thread; the next round waits until the consumer asks
        for it, so at most one bucket is held). Iterate to the end: the transfer is
        collective."""
        q: queue.Queue = queue.Queue(maxsize=1)
        done = object()
        box: dict = {}

        def run() -> None:
            try:
                box["report"] = self.receive_buckets(wanted, q.put)
            except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
                box["error"] = e
            finally:
                q.put(done)

        th = threading.Thread(target=run, name="zarrckpt-transfer", daemon=True)
        th.start()
        while True:
            item = q.get()
            if item is done:
                break
            yield item
        th.join()
        if "error" in box:
            raise box["error"]

    def plan_info(self) -> dict | None:
        """This rank's cached plan (rounds, bytes sent / received, its destinations), or
        None before the first transfer."""
        return self._native.plan_info()
