"""The thin layer every zarrckpt front (``zarrckpt.torch``, ``zarrckpt.megatron``) builds on.

It turns pieces of global tensors into calls of the Rust core (``zarrckpt._native``) with no
copy of tensor data, and runs them over a torch.distributed group.

Pieces
    A :class:`Piece` is one box (``global_offset``) or one flat range (``flat_range``: elements
    ``[start, stop)`` of the tensor's C-order flattening, as ZeRO / Megatron's distributed
    optimizer hold them) of one global tensor, held by this rank at save time or wanted at
    load time. ``tensor`` is a CPU tensor (or numpy array) in C order: it is saved from, or
    loaded into, in place. ``replica`` is 0 for the main copy, > 0 for a copy another rank
    holds as main, ``"auto"`` for a box every holder declares the same way (stored once,
    written by one of them). Any dtype of the core works, bf16 and fp8 included: data travels
    as bytes.

Objects
    Non-tensor state, saved with the tensors in the same commit, never pickled: a value is
    ``bytes`` or anything :func:`json.dumps` accepts (``allow_nan=False``). :class:`Object`
    gives the scope: ``"common"`` (one value for the job; ranks declaring it must agree),
    ``"per_rank"`` (every rank its own) or ``"sharded"`` (one value per cell of ``grid``; this
    rank's cell ``index``). ``save`` also takes a ``{key: value}`` dict of common objects.

Calls (collective: every rank of ``comm`` calls them, in the same order)::

    save(path, pieces, objects=None, *, comm=None, **options) -> dict   # report
    load(path, pieces, objects=None, *, comm=None, strict="assume_ok_unexpected", **options)
        -> dict   # report; report["objects"]: the values, in request order (None if skipped)
    async_save(path, pieces, objects=None, *, comm=None, **options) -> SaveHandle

``comm`` is ``None`` (one rank), a :class:`TorchComm`, ``_native.TcpComm``, or any object
with its byte protocol (``rank``, ``world_size``, ``all_gather``, ``broadcast``, ``barrier``,
``exchange``; see ``python/src/comm.rs``). ``options`` of save: ``overwrite``,
``compression`` (``"none"``, ``"zstd"``, ``"blosc"``), ``io_threads``, ``balance_replicas``,
``subchunk_bytes``, ``user_metadata`` (a JSON-able dict); of load: ``io_threads``,
``exchange`` (read boxes several ranks need once and share them; default on),
``read_method`` (``"pread"``, ``"mmap"``), and ``strict``, one of Megatron's modes
(``assume_ok_unexpected``, ``log_unexpected``, ``log_all``, ``raise_unexpected``,
``raise_all``, ``return_unexpected``, ``return_all``, ``ignore_all``). Load pieces may set
``cast=True`` to accept another stored float type (converted, rounded to nearest even).

The GIL is released while the core plans, reads and writes. Errors are
:mod:`zarrckpt._errors` exceptions carrying the core's message (key, chunk, rank, path).

Failing together: a rank that fails while preparing a call (building its pieces, a state dict
leaf the front refuses, an option it cannot take) still takes part in the call's first
collective, reporting its error instead of its pieces, and the core agrees on the outcome of
every later step the same way. So when one rank fails, every rank raises at once: the failed
rank its own error, every other rank the same class with ``rank R failed: <its message>``
(``details["rank"]``), never a wait for a rank that is no longer coming.

Saves and loads on one :class:`TorchComm` never overlap: a save or load first waits for an
asynchronous save still in flight on it (its background thread owns the communicator's
group meanwhile). Repeated saves on one communicator reuse the agreed plan while the
structure is unchanged (a constant-size check instead of the full agreement).
"""

from __future__ import annotations

import atexit
import builtins
import datetime
import json
import os
import sys
import threading
import warnings
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _errors, _native
from ._errors import CommError, InvalidArgumentError, ZarrckptError

__all__ = [
    "Piece",
    "Object",
    "TorchComm",
    "SaveHandle",
    "save",
    "load",
    "async_save",
    "dtype_name",
    "communicator",
]

# torch.frombuffer warns about read-only buffers (the send side of an exchange).
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


@dataclass
class Piece:
    """One box (or flat range) of one global tensor this rank holds / wants."""

    key: str
    # torch.Tensor (CPU and contiguous, or CUDA with any non-overlapping strides) or
    # numpy.ndarray (C-contiguous)
    tensor: Any
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...] | None = None
    flat_range: tuple[int, int] | None = None
    replica: int | str = 0
    cast: bool = False  # load only: accept another stored float type


@dataclass
class Object:
    """One object to save (``value``) or to load (the value comes back in the report)."""

    key: str
    value: Any = None
    scope: str = "common"
    grid: tuple[int, ...] | None = None
    index: tuple[int, ...] | None = None
    rank: int | None = None  # load of a per-rank object: whose value (default: this rank)


# ---------------------------------------------------------------------------------------------
# dtypes and memory

_TORCH_DTYPES: dict[Any, str] = {}


def _torch_dtypes() -> dict[Any, str]:
    if not _TORCH_DTYPES:
        import torch

        names = {
            "bool": "bool",
            "int8": "int8",
            "int16": "int16",
            "int32": "int32",
            "int64": "int64",
            "uint8": "uint8",
            "uint16": "uint16",
            "uint32": "uint32",
            "uint64": "uint64",
            "float16": "float16",
            "bfloat16": "bfloat16",
            "float32": "float32",
            "float64": "float64",
            "float8_e4m3fn": "float8_e4m3fn",
            "float8_e5m2": "float8_e5m2",
        }
        for attr, name in names.items():
            dt = getattr(torch, attr, None)
            if dt is not None:
                _TORCH_DTYPES[dt] = name
    return _TORCH_DTYPES


def _numpy_dtype_name(dt: np.dtype) -> str | None:
    if dt.kind in "biuf" and dt.byteorder in "=|<" and dt.name in _native.DTYPES:
        return dt.name
    # ml_dtypes: bfloat16, float8_e4m3fn, float8_e5m2 (kind 'V').
    if dt.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return dt.name
    return None


def _is_torch(x: Any) -> bool:
    mod = type(x).__module__
    return mod.startswith("torch") and hasattr(x, "data_ptr")


def dtype_name(x: Any) -> str:
    """The core's dtype name of a torch tensor / dtype or a numpy array / dtype."""
    dt = getattr(x, "dtype", x)
    if isinstance(dt, np.dtype):
        name = _numpy_dtype_name(dt)
    else:
        name = _torch_dtypes().get(dt)
    if name is None:
        raise InvalidArgumentError(
            f"data type {dt} is not supported; supported: {', '.join(_native.DTYPES)}"
        )
    return name


def _memory(key: str, x: Any, writable: bool) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype name, shape, address, nbytes) of a tensor's memory, checked."""
    if _is_torch(x):
        if x.device.type != "cpu":
            raise InvalidArgumentError(f"`{key}`: tensor on {x.device}; pieces are CPU tensors")
        if not x.is_contiguous():
            raise InvalidArgumentError(f"`{key}`: tensor is not contiguous")
        if x.is_conj() or x.is_neg():
            raise InvalidArgumentError(f"`{key}`: tensor has a lazy conjugate/negative bit")
        if getattr(x, "is_quantized", False) or x.layout.__repr__() != "torch.strided":
            raise InvalidArgumentError(f"`{key}`: only dense strided tensors can be pieces")
        nbytes = x.numel() * x.element_size()
        return dtype_name(x), tuple(x.shape), (x.data_ptr() if nbytes else 0), nbytes
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise InvalidArgumentError(f"`{key}`: array is not C-contiguous")
        if writable and not x.flags.writeable:
            raise InvalidArgumentError(f"`{key}`: array is read-only")
        return dtype_name(x), tuple(x.shape), (x.ctypes.data if x.nbytes else 0), x.nbytes
    raise InvalidArgumentError(
        f"`{key}`: a piece holds a torch.Tensor or a numpy.ndarray, not {type(x).__name__}"
    )


def _is_cuda(x: Any) -> bool:
    """A torch CUDA tensor this build can move through zarrckpt's device path."""
    return _is_torch(x) and x.device.type == "cuda" and bool(_native.HAS_CUDA)


_DEVICES: dict[tuple[int, int], Any] = {}


def _device_of(x: Any) -> Any:
    """The native device of a CUDA tensor, copying on torch's current stream of that device
    (one handle per device and stream, reused, so its pinned staging is too)."""
    import torch

    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    stream = int(torch.cuda.current_stream(index).cuda_stream)
    d = _DEVICES.get((index, stream))
    if d is None:
        d = _DEVICES[(index, stream)] = _native.Device.cuda(index, stream)
    return d


def _device_tuple(p: Piece, load: bool) -> tuple:
    """The native description of a box held in CUDA memory."""
    x = p.tensor
    if p.flat_range is not None:
        raise InvalidArgumentError(f"`{p.key}`: flat ranges of CUDA tensors are not supported")
    if getattr(x, "is_quantized", False) or x.layout.__repr__() != "torch.strided":
        raise InvalidArgumentError(f"`{p.key}`: only dense strided tensors can be pieces")
    if x.is_conj() or x.is_neg():
        raise InvalidArgumentError(f"`{p.key}`: tensor has a lazy conjugate/negative bit")
    if load and p.cast:
        raise InvalidArgumentError(f"`{p.key}`: CUDA targets load the stored data type only")
    gshape = tuple(int(d) for d in p.global_shape)
    offset = (
        tuple(int(o) for o in p.global_offset)
        if p.global_offset is not None
        else (0,) * len(gshape)
    )
    if p.replica == "auto":
        replica = None
    elif isinstance(p.replica, int) and p.replica >= 0:
        replica = int(p.replica)
    else:
        raise InvalidArgumentError(f"`{p.key}`: replica is an int >= 0 or 'auto'")
    return (
        p.key,
        dtype_name(x),
        gshape,
        offset,
        tuple(int(d) for d in x.shape),
        int(x.data_ptr()),
        tuple(int(s) for s in x.stride()),
        replica,
    )


def _split(pieces: list[Piece], load: bool) -> tuple[list[tuple], list[tuple], Any]:
    """Host tuples, CUDA tuples and the device of the CUDA ones (one device per call)."""
    host, device, dev = [], [], None
    for p in pieces:
        if _is_cuda(p.tensor):
            d = _device_of(p.tensor)
            if dev is not None and d is not dev:
                raise InvalidArgumentError(
                    f"`{p.key}`: CUDA pieces of one call live on one device and stream"
                )
            dev = d
            device.append(_device_tuple(p, load))
        else:
            host.append(_piece_tuple(p, load))
    return host, device, dev


def _piece_tuple(p: Piece, load: bool) -> tuple:
    dt, shape, address, nbytes = _memory(p.key, p.tensor, writable=load)
    gshape = tuple(int(d) for d in p.global_shape)
    if p.flat_range is not None:
        if p.global_offset is not None:
            raise InvalidArgumentError(f"`{p.key}`: give a global_offset or a flat_range, not both")
        start, stop = (int(v) for v in p.flat_range)
        count = 1
        for d in shape:
            count *= d
        if stop - start != count:
            raise InvalidArgumentError(
                f"`{p.key}`: flat range {start}..{stop} holds {stop - start} elements, "
                f"the tensor {count}"
            )
        place = (None, None, (start, stop))
    else:
        offset = (
            tuple(int(o) for o in p.global_offset)
            if p.global_offset is not None
            else (0,) * len(gshape)
        )
        place = (offset, shape, None)
    if load:
        extra: Any = bool(p.cast)
    elif p.replica == "auto":
        extra = None
    elif isinstance(p.replica, int) and p.replica >= 0:
        extra = int(p.replica)
    else:
        raise InvalidArgumentError(f"`{p.key}`: replica is an int >= 0 or 'auto'")
    return (p.key, dt, gshape, *place, extra, address, nbytes)


def _disjoint(tuples: list[tuple]) -> list[tuple]:
    """The load targets with the same memory asked for twice (tied weights: two keys, one
    tensor) kept once; targets overlapping otherwise are an error (each is written by the
    core)."""
    out = []
    seen: set[tuple[int, int]] = set()
    for t in tuples:
        span = (t[7], t[8])
        if t[8] and span in seen:
            continue
        seen.add(span)
        out.append(t)
    spans = sorted((t[7], t[7] + t[8], t[0]) for t in out if t[8])
    for (_a0, a1, ka), (b0, _b1, kb) in zip(spans, spans[1:], strict=False):
        if b0 < a1:
            raise InvalidArgumentError(
                f"load targets `{ka}` and `{kb}` overlap in memory; load into one of them and "
                "copy, or give separate tensors"
            )
    return out


def _json_text(key: str, value: Any) -> str:
    try:
        return json.dumps(value, allow_nan=False, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(
            f"object `{key}`: its value is neither bytes nor JSON ({e}); nothing is pickled, "
            "so convert it (to a JSON-able value, bytes or a tensor) first"
        ) from e


def _object_tuples(objects: Mapping[str, Any] | Iterable[Object] | None) -> list[tuple] | None:
    if objects is None:
        return None
    if isinstance(objects, Mapping):
        objects = [Object(k, v) for k, v in objects.items()]
    out = []
    for o in objects:
        v = o.value
        if isinstance(v, bytes | bytearray | memoryview):
            value: Any = bytes(v)
        else:
            value = _json_text(o.key, v)
        grid = tuple(int(g) for g in o.grid) if o.grid is not None else None
        index = tuple(int(i) for i in o.index) if o.index is not None else None
        out.append((o.key, o.scope, grid, index, value))
    return out


def _request_tuples(objects: Iterable[Object | str] | None, rank: int) -> list[tuple] | None:
    if objects is None:
        return None
    out = []
    for o in objects:
        if isinstance(o, str):
            o = Object(o)
        r = o.rank if o.rank is not None else (rank if o.scope == "per_rank" else None)
        grid = tuple(int(g) for g in o.grid) if o.grid is not None else None
        index = tuple(int(i) for i in o.index) if o.index is not None else None
        out.append((o.key, o.scope, r, grid, index))
    return out


def _decode(value: tuple | None) -> Any:
    if value is None:
        return None
    enc, data = value
    return json.loads(data) if enc == "json" else data


def _options(options: dict, load: bool) -> dict:
    out = dict(options)
    if not load and isinstance(out.get("user_metadata"), Mapping):
        out["user_metadata"] = _json_text("user_metadata", dict(out["user_metadata"]))
    return out


# ---------------------------------------------------------------------------------------------
# the communicator over torch.distributed


# The Rust core's default timeout (zarrckpt::comm::DEFAULT_TIMEOUT), in seconds.
DEFAULT_TIMEOUT_S = 60.0


def _env_timeout() -> float:
    """``ZARRCKPT_TIMEOUT_S`` (a positive number of seconds), else :data:`DEFAULT_TIMEOUT_S`."""
    text = os.environ.get("ZARRCKPT_TIMEOUT_S", "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise InvalidArgumentError(
            f"ZARRCKPT_TIMEOUT_S={text!r}: a positive, finite number of seconds"
        )
    return value


class TorchComm:
    """zarrckpt's communicator over a torch.distributed process group.

    ``group`` is the group whose ranks save or load together (default: the default group).
    The collectives run on a dedicated gloo group over the same ranks, created on first use
    from the default store (no new port, no set-up), so they never interleave with training
    collectives on ``group`` (an asynchronous save's background thread uses it while training
    goes on) and work whatever the training backend (nccl, gloo). Only bytes travel: sizes
    and payloads as uint8 tensors, never pickled objects. A message of up to 64 KiB (less
    beyond 64 ranks) takes one collective; a longer one a second for its rest.

    ``timeout`` (seconds; default ``ZARRCKPT_TIMEOUT_S`` if set, else 60, the Rust core's
    default) bounds each collective wait: a rank that died is noticed at once (its
    connections close), one that hangs within the timeout. Unlike the core's TCP
    communicator, gloo has no heartbeat, so a rank that is alive but late by more than the
    timeout (a much larger share to write) fails the collective too: raise
    ``ZARRCKPT_TIMEOUT_S`` for such jobs. An error on one rank never waits for the timeout:
    every rank learns it at the next agreement (see the module).

    zarrckpt's core uses ``exchange`` only: its collectives (the tree all-reduce of a save's
    or load's agreement, all-gather, broadcast, barrier) are the library's own, written over
    point-to-point transfers, so each rank receives a few messages whatever the world size.
    ``all_gather``, ``broadcast`` and ``barrier`` are those same collectives too (for the
    Python layer's own agreements), so this class moves bytes only. ``received_bytes`` counts
    the bytes this rank received from other ranks through ``exchange`` (for tests and
    benchmarks).
    """

    def __init__(self, group: Any = None, timeout: float | None = None) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise InvalidArgumentError("torch.distributed is not initialised")
        if timeout is None:
            timeout = _env_timeout()
        if not (isinstance(timeout, int | float) and 0 < timeout < float("inf")):
            raise InvalidArgumentError(f"timeout: a positive number of seconds, not {timeout!r}")
        self._timeout = float(timeout)
        self._dist = dist
        self._parent = group
        self._group: Any = None
        self._lock = threading.Lock()
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._saver: Any = None
        self._inflight: SaveHandle | None = None
        self.received_bytes = 0

    # -- the group ---------------------------------------------------------------------------

    def group(self) -> Any:
        """The dedicated gloo group (created collectively on first use)."""
        with self._lock:
            if self._group is None:
                dist = self._dist
                ranks = None
                if self._parent is not None:
                    ranks = sorted(dist.get_process_group_ranks(self._parent))
                self._group = dist.new_group(
                    ranks=ranks,
                    backend="gloo",
                    use_local_synchronization=True,
                    timeout=datetime.timedelta(seconds=self._timeout),
                )
                if dist.get_rank(self._group) != self.rank:
                    raise InvalidArgumentError(
                        "the group's ranks are not in ascending order of global rank; "
                        "zarrckpt needs group rank order to follow global rank order"
                    )
            return self._group

    # -- bytes (called by the Rust core, GIL held) ------------------------------------------

    def all_gather(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``: the core's shared tree all-gather over :meth:`exchange`."""
        return _native.all_gather(self, data)

    def broadcast(self, root: int, data: bytes) -> bytes:
        """``root``'s ``data`` on every rank: the core's shared broadcast over :meth:`exchange`."""
        return _native.broadcast(self, root, data)

    def barrier(self) -> None:
        """Returns once every rank has called it (the core's shared barrier over ``exchange``)."""
        _native.barrier(self)

    def exchange(self, sends: list[tuple[int, memoryview]], recvs: list[tuple[int, memoryview]]):
        import torch

        g = self.group()
        works = []
        local_sends: list[memoryview] = []
        sent: dict[int, int] = {}
        for peer, mv in sends:
            if peer == self.rank:
                local_sends.append(mv)
                continue
            tag = sent.get(peer, 0)
            sent[peer] = tag + 1
            if len(mv):
                t = torch.frombuffer(mv, dtype=torch.uint8)
                works.append(self._dist.isend(t, group=g, group_dst=peer, tag=tag))
        got: dict[int, int] = {}
        for peer, mv in recvs:
            if peer == self.rank:
                src = local_sends.pop(0)
                mv[:] = src
                continue
            tag = got.get(peer, 0)
            got[peer] = tag + 1
            if len(mv):
                self.received_bytes += len(mv)
                t = torch.frombuffer(mv, dtype=torch.uint8)
                works.append(self._dist.irecv(t, group=g, group_src=peer, tag=tag))
        for w in works:
            w.wait()

    # -- saves in flight ---------------------------------------------------------------------

    def saver(self) -> Any:
        if self._saver is None:
            self._saver = _native.Saver(self)
        return self._saver

    def wait_idle(self) -> None:
        """Waits for an asynchronous save in flight on this communicator (errors stay with
        its handle)."""
        h = self._inflight
        if h is not None:
            h._settle()
            self._inflight = None


_COMMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_DEFAULT_COMM: dict[Any, TorchComm] = {}


def communicator(group: Any = None) -> TorchComm | None:
    """The :class:`TorchComm` of ``group`` (one per group, reused), or ``None`` when
    torch.distributed is not initialised or the job has one rank."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    if group is None:
        world = dist.group.WORLD
        c = _DEFAULT_COMM.get(world)
        if c is None:
            _DEFAULT_COMM.clear()  # a new default group after destroy/init
            c = _DEFAULT_COMM[world] = TorchComm(None)
    else:
        c = _COMMS.get(group)
        if c is None:
            c = _COMMS[group] = TorchComm(group)
    return c if c.world_size > 1 else None


# ---------------------------------------------------------------------------------------------
# save, load, async save

_local_saver: Any = None
_local_inflight: SaveHandle | None = None
# Asynchronous saves whose outcome nobody has seen yet (held strongly: a failure must be
# reported at exit even when the caller dropped its handle).
_pending: set = set()


_other_savers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _wait_idle(comm: Any) -> None:
    global _local_inflight
    if comm is None:
        if _local_inflight is not None:
            _local_inflight._settle()
            _local_inflight = None
    elif hasattr(comm, "wait_idle"):
        comm.wait_idle()


def _saver(comm: Any) -> Any:
    global _local_saver
    if comm is None:
        if _local_saver is None:
            _local_saver = _native.Saver(None)
        return _local_saver
    if hasattr(comm, "saver"):
        return comm.saver()
    s = _other_savers.get(comm)
    if s is None:
        s = _other_savers[comm] = _native.Saver(comm)
    return s


# Bytes of an error message that travel in an agreement (the rest is cut).
_AGREE_TEXT = 4000


def _outcome(error: BaseException | None, flag: bool) -> bytes:
    """This rank's message in an agreement: ok or failed, a flag, and the error's class and
    text when it failed."""
    if error is None:
        return bytes([0, int(flag)])
    cls = type(error)
    name = cls.__name__ if cls.__module__ in ("zarrckpt._errors", "builtins") else ""
    text = f"{name or cls.__qualname__}\0{error}".encode("utf-8", "replace")[:_AGREE_TEXT]
    return bytes([1, int(flag)]) + (b"Z" if name else b"-") + text


def _remote_error(rank: int, payload: bytes) -> Exception:
    """The exception raised on every other rank when ``rank`` failed: the same class (a
    zarrckpt or built-in one; otherwise :class:`CommError`) and message."""
    known, body = payload[:1] == b"Z", payload[1:].decode("utf-8", "replace")
    name, _, text = body.partition("\0")
    cls = (getattr(_errors, name, None) or getattr(builtins, name, None)) if known else None
    message = f"rank {rank} failed: {text}" if known else f"rank {rank} failed: {name}: {text}"
    err: Exception | None = None
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            err = cls(message)
        except Exception:  # noqa: BLE001 - a class whose constructor wants more
            err = None
    if err is None:
        err = CommError(message)
    if isinstance(err, ZarrckptError):
        err.kind = "RemoteFailure"
        err.details = {"rank": rank}
    return err


def _agree(comm: Any, prepare: Any, flag_of: Any = None) -> tuple[Any, list[bool]]:
    """Runs ``prepare()`` on this rank and agrees on its outcome with every rank of ``comm``
    (one all-gather of a few bytes): returns its value and every rank's ``flag_of(value)``
    when every rank succeeded; otherwise raises on every rank, this rank's own error where it
    failed, the lowest failed rank's (same class, ``rank R failed: ...``) elsewhere. A rank
    whose preparation fails thus never leaves the others waiting in a collective."""
    error: Exception | None = None
    value: Any = None
    try:
        value = prepare()
    except Exception as e:  # noqa: BLE001 - reported to every rank, then raised
        error = e
    flag = bool(flag_of(value)) if error is None and flag_of is not None else False
    if comm is None:
        if error is not None:
            raise error
        return value, [flag]
    try:
        messages = [bytes(m) for m in comm.all_gather(_outcome(error, flag))]
    except Exception as e:
        if error is not None:
            raise error from None
        if isinstance(e, CommError):
            raise
        raise CommError(f"rank {comm.rank}: agreeing on the outcome of preparing: {e}") from e
    if error is not None:
        raise error
    for r, m in enumerate(messages):
        if m[:1] == b"\x01":
            raise _remote_error(r, m[2:])
    return value, [m[1:2] == b"\x01" for m in messages]


def _prepare_save(pieces: list[Piece], objects: Any, options: dict) -> tuple:
    tuples, device, dev = _split(pieces, load=False)
    objs = _object_tuples(objects)
    opts = _options(options, load=False)
    _native.check_save(tuples, objs, opts)
    # The pieces own the memory the tuples point to (staged copies too): kept until the call.
    return tuples, device, dev, objs, opts, pieces


def _save(
    path: Any,
    prepare: Any,
    comm: Any,
    options: dict,
    asynchronous: bool,
    manager: Any = None,
    step: int = 0,
) -> Any:
    """A save (``asynchronous``: started) whose pieces and objects ``prepare()`` returns, the
    outcome of preparing agreed on by every rank first (see :func:`_agree`). It goes through
    the communicator's saver, or through ``manager`` (a ``_native.CheckpointManager``) as
    ``step``. CUDA pieces go in the same request as host pieces: the saver downloads them
    into its staging memory, and ranks with and without them run the same collectives."""
    global _local_inflight
    _wait_idle(comm)
    (tuples, device, dev, objs, opts, keep), _ = _agree(
        comm, lambda: _prepare_save(*prepare(), options)
    )
    native = manager if manager is not None else _saver(comm)
    first = step if manager is not None else str(path)
    call = native.save_async if asynchronous else native.save
    result = call(first, tuples, objs, opts, device if dev is not None else None, dev)
    del keep  # written, or copied into staging memory, by now
    if not asynchronous:
        return result
    handle = SaveHandle(result, path=str(path))
    if comm is None:
        _local_inflight = handle
    elif hasattr(comm, "wait_idle"):
        comm._inflight = handle
    _pending.add(handle)
    return handle


def save(
    path: Any,
    pieces: list[Piece],
    objects: Mapping[str, Any] | Iterable[Object] | None = None,
    *,
    comm: TorchComm | None = None,
    **options: Any,
) -> dict:
    """Saves this rank's pieces and objects into the checkpoint at ``path`` (collective).

    Returns the core's report: ``tensors``, ``chunks_written``, ``data_bytes``,
    ``file_bytes``, ``assigned_bytes``, ``write_balance``, ``plan_s``, ``gathered_bytes``,
    ``plan_reused``.
    """
    return _save(path, lambda: (pieces, objects), comm, options, asynchronous=False)


def _prepare_load(pieces: list[Piece], objects: Any, rank: int, strict: str, options: dict):
    host, device, dev = _split(pieces, load=True)
    tuples = _disjoint(host)
    # The same CUDA memory asked for twice (tied weights) is loaded once, from the first key.
    seen: set[tuple] = set()
    unique = []
    for t in device:
        memory = (t[5], t[4], t[6])  # address, shape, strides
        if memory not in seen:
            seen.add(memory)
            unique.append(t)
    reqs = _request_tuples(objects, rank)
    options = dict(options)
    staging = int(options.pop("staging_bytes", 1 << 30))
    opts = _options(options, load=True)
    opts["strict"] = strict
    _native.check_load(tuples, reqs, opts)
    # The pieces own the memory the tuples point to: kept until the call returns.
    return tuples, unique, dev, reqs, opts, staging, pieces


def _load(path: Any, prepare: Any, comm: Any, strict: str, options: dict) -> dict:
    """A load into the pieces and objects ``prepare()`` returns, the outcome of preparing
    agreed on by every rank first (see :func:`_agree`)."""
    rank = comm.rank if comm is not None else 0
    _wait_idle(comm)
    (tuples, device, dev, reqs, opts, staging, keep), _ = _agree(
        comm, lambda: _prepare_load(*prepare(), rank, strict, options)
    )
    # Every load goes through the device path (host targets in its first round), CUDA
    # targets or not, so that ranks with and without them run the same collectives.
    report = _native.load_device(str(path), tuples, device, reqs, comm, opts, dev, staging)
    del keep
    report["objects"] = [_decode(v) for v in report["objects"]]
    return report


def load(
    path: Any,
    pieces: list[Piece],
    objects: Iterable[Object | str] | None = None,
    *,
    comm: TorchComm | None = None,
    strict: str = "assume_ok_unexpected",
    **options: Any,
) -> dict:
    """Loads into the pieces' tensors in place (collective); returns the report:
    ``loaded_bytes``, ``bytes_read``, ``bytes_received``, ``bytes_sent``, ``unexpected``,
    ``missing``, and ``objects`` (one value per request, in order; ``None`` for a key the
    strict mode skipped). Pieces sharing the very same memory (tied weights under two keys)
    are loaded once, from the first one's key. Collective: every rank passes ``objects`` (a
    list, possibly empty) or every rank passes ``None``."""
    return _load(path, lambda: (pieces, objects), comm, strict, options)


class SaveHandle:
    """An asynchronous save in flight: :meth:`wait` for the report, :meth:`done` to poll,
    :meth:`exception` for the error (or ``None``)."""

    def __init__(self, native: Any, keep: Any = None, path: str = "") -> None:
        self._native = native
        self._path = path
        self._observed = False  # wait() or exception() reported the outcome
        self._keep = keep
        self._result: dict | None = None
        self._error: BaseException | None = None
        self._settled = False
        self._lock = threading.Lock()
        self.blocked_s: float = native.blocked_s
        self.staged_bytes: int = native.staged_bytes

    def _settle(self) -> None:
        with self._lock:
            if self._settled:
                return
            try:
                self._result = self._native.wait()
            except BaseException as e:  # noqa: BLE001 - kept for wait()/exception()
                self._error = e
            self._settled = True
            self._keep = None
            if self._error is None:
                _pending.discard(self)

    def done(self) -> bool:
        """True once writing, fsync and commit are over (successfully or not)."""
        return self._settled or self._native.done()

    def wait(self) -> dict:
        """Waits for the save; returns its report or raises its error."""
        self._settle()
        self._observed = True
        _pending.discard(self)
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    result = wait

    def exception(self) -> BaseException | None:
        """Waits for the save; returns its error, or ``None`` if it succeeded."""
        self._settle()
        self._observed = True
        _pending.discard(self)
        return self._error


def async_save(
    path: Any,
    pieces: list[Piece],
    objects: Mapping[str, Any] | Iterable[Object] | None = None,
    *,
    comm: TorchComm | None = None,
    **options: Any,
) -> SaveHandle:
    """Starts a save that finishes in the background (collective). Returns once this rank's
    pieces are copied into staging memory (the caller may change its tensors then) and the
    objects are taken; writing, fsync and commit go on in a background thread.

    A save that fails is never silent: if its handle was not waited on (``wait()``,
    ``exception()``) when the interpreter exits, the error is printed to stderr and the
    process exits with status 1, as an uncaught exception would."""
    return _save(path, lambda: (pieces, objects), comm, options, asynchronous=True)


@atexit.register
def _finish_pending() -> None:
    # A background save calls back into Python (the communicator): let it end before the
    # interpreter does. A failure nobody asked about is reported as loudly as an uncaught
    # exception: on stderr, and by the exit status.
    failed = False
    for h in list(_pending):
        try:
            h._settle()
        except BaseException:  # noqa: BLE001
            pass
        if h._error is not None and not h._observed:
            failed = True
            sys.stderr.write(
                f"zarrckpt: the asynchronous save to {h._path} failed and was never waited "
                f"on: {type(h._error).__name__}: {h._error}\n"
            )
    if failed:
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)
