"""Reading a checkpoint without a training job: ``zarrckpt.open(path)``.

::

    ckpt = zarrckpt.open("ckpt")
    ckpt.tensors["decoder.weight"]          # TensorInfo: dtype, shape, chunk_shape, ...
    w = ckpt["decoder.weight"][0:128, :]   # numpy (ml_dtypes for bf16 / fp8)
    t = ckpt["decoder.weight"].torch[0:128]  # torch
    ckpt.object("iteration")               # an object's value (JSON or bytes)

Indexing reads only the shard files and subchunks that intersect the box asked for
(integers, slices with any step, ``...`` and ``None``; a slice with a step reads its bounding
box). The data is read straight into the returned array.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _native

__all__ = ["open", "Checkpoint", "TensorInfo", "ObjectInfo", "LazyTensor", "numpy_dtype"]


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a core dtype name (ml_dtypes for bfloat16 and float8)."""
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def torch_dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


@dataclass(frozen=True)
class TensorInfo:
    """What the index says about one tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    subchunk_shape: tuple[int, ...]
    compression: str
    num_chunks: int
    nbytes: int


@dataclass(frozen=True)
class ObjectInfo:
    """What the index says about one object."""

    key: str
    scope: str
    encoding: str
    size: int | None
    world_size: int | None
    grid: tuple[int, ...] | None
    values: int


def _box(index: Any, shape: tuple[int, ...]) -> tuple[list[int], list[int], tuple]:
    """(offset, extent, post-index) of a numpy-style basic index: the bounding box to read
    and what to apply to it (steps, integer axes dropped, new axes)."""
    if not isinstance(index, tuple):
        index = (index,)
    n_real = sum(1 for i in index if i is not None and i is not Ellipsis)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if n_real > len(shape):
        raise IndexError(f"too many indices: {n_real} for a tensor of {len(shape)} dimensions")
    expanded: list[Any] = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (len(shape) - n_real))
        else:
            expanded.append(i)
    if Ellipsis not in index:
        expanded.extend([slice(None)] * (len(shape) - n_real))
    offset: list[int] = []
    extent: list[int] = []
    post: list[Any] = []
    d = 0
    for i in expanded:
        if i is None:
            post.append(None)
            continue
        size = shape[d]
        if isinstance(i, slice):
            start, stop, step = i.indices(size)
            idx = range(start, stop, step)
            if len(idx) == 0:
                offset.append(0)
                extent.append(0)
                post.append(slice(0, 0))
            else:
                lo, hi = min(idx[0], idx[-1]), max(idx[0], idx[-1]) + 1
                offset.append(lo)
                extent.append(hi - lo)
                post.append(slice(None, None, step))
        else:
            try:
                k = int(i.__index__())
            except (AttributeError, TypeError):
                raise IndexError(
                    f"only integers, slices, '...' and None are valid indices, not {i!r}"
                ) from None
            if k < -size or k >= size:
                raise IndexError(f"index {k} is out of bounds for axis {d} with size {size}")
            k %= size
            offset.append(k)
            extent.append(1)
            post.append(0)
        d += 1
    return offset, extent, tuple(post)


class LazyTensor:
    """A tensor of an open checkpoint; indexing reads only what it needs."""

    def __init__(self, ckpt: Checkpoint, info: TensorInfo, output: str = "numpy") -> None:
        self._ckpt = ckpt
        self.info = info
        self._output = output

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def ndim(self) -> int:
        return len(self.info.shape)

    @property
    def torch(self) -> LazyTensor:
        """The same tensor, indexed into torch tensors."""
        return LazyTensor(self._ckpt, self.info, "torch")

    @property
    def numpy(self) -> LazyTensor:
        """The same tensor, indexed into numpy arrays."""
        return LazyTensor(self._ckpt, self.info, "numpy")

    def __len__(self) -> int:
        if not self.info.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.info.shape[0]

    def __repr__(self) -> str:
        i = self.info
        return f"LazyTensor({i.key!r}, dtype={i.dtype}, shape={i.shape}, chunks={i.chunk_shape})"

    def read_box(self, offset: list[int], extent: list[int]) -> tuple[Any, dict]:
        """Reads a box into a new array / tensor; returns it and the read report."""
        if self._output == "torch":
            import torch

            out: Any = torch.empty(tuple(extent), dtype=torch_dtype(self.info.dtype))
            address, nbytes = out.data_ptr(), out.numel() * out.element_size()
        else:
            out = np.empty(tuple(extent), dtype=numpy_dtype(self.info.dtype))
            address, nbytes = out.ctypes.data, out.nbytes
        if nbytes == 0:
            return out, {"bytes_read": 0, "loaded_bytes": 0}
        report = self._ckpt._native.read_region(self.info.key, offset, extent, address, nbytes)
        return out, report

    def __getitem__(self, index: Any) -> Any:
        offset, extent, post = _box(index, self.info.shape)
        out, _ = self.read_box(offset, extent)
        if all(p == slice(None, None, 1) for p in post):
            return out
        if self._output == "torch":
            # torch has no negative steps: flip those axes, then step forward.
            fixed: list[Any] = []
            flip: list[int] = []
            axis = 0
            for p in post:
                if isinstance(p, slice) and p.step is not None and p.step < 0:
                    flip.append(axis)
                    fixed.append(slice(None, None, -p.step))
                else:
                    fixed.append(p)
                if p is not None:
                    axis += 1
            if flip:
                out = out.flip(flip)
            return out[tuple(fixed)].contiguous()
        return np.ascontiguousarray(out[post])

    def read(self) -> Any:
        """The whole tensor."""
        return self[...]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.numpy.read()
        return a if dtype is None else a.astype(dtype)


class Checkpoint(Mapping):
    """A committed checkpoint opened for reading: a mapping from tensor keys to
    :class:`LazyTensor`, plus objects and metadata."""

    def __init__(self, path: Any, output: str = "numpy") -> None:
        if output not in ("numpy", "torch"):
            raise ValueError("output is 'numpy' or 'torch'")
        self._native = _native.Checkpoint(str(path))
        self._output = output
        self.tensors: dict[str, TensorInfo] = {
            t["key"]: TensorInfo(**t) for t in self._native.tensors()
        }
        self.objects: dict[str, ObjectInfo] = {
            o["key"]: ObjectInfo(**o) for o in self._native.objects()
        }

    @property
    def path(self) -> str:
        return str(self._native.path)

    @property
    def metadata(self) -> dict:
        """The free-form user metadata stored at save time."""
        return json.loads(self._native.user_metadata())

    @property
    def world_size(self) -> int:
        """The number of ranks that saved the checkpoint."""
        return self._native.world_size()

    def __getitem__(self, key: str) -> LazyTensor:
        try:
            info = self.tensors[key]
        except KeyError:
            raise KeyError(key) from None
        return LazyTensor(self, info, self._output)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        return (
            f"zarrckpt.Checkpoint({self.path!r}, {len(self.tensors)} tensors, "
            f"{len(self.objects)} objects)"
        )

    def object(self, key: str, *, rank: int | None = None, shard: Any = None) -> Any:
        """The value of an object: a common one, rank ``rank``'s of a per-rank one, or the
        shard at index ``shard`` of a sharded one. JSON comes back as Python values, bytes
        as bytes."""
        if rank is not None:
            slot: Any = ("rank", int(rank))
        elif shard is not None:
            slot = ("shard", [int(i) for i in shard])
        else:
            slot = "common"
        enc, data = self._native.read_object(key, slot)
        return json.loads(data) if enc == "json" else data

    def verify(self, threads: int = 0) -> dict:
        """Reads every chunk and checks every checksum; ``problems`` lists what is wrong."""
        return self._native.verify(threads)


def open(path: Any, output: str = "numpy") -> Checkpoint:  # noqa: A001 - the package's verb
    """Opens a committed checkpoint for reading (reads only its index). ``output``:
    ``"numpy"`` (ml_dtypes for bf16 / fp8) or ``"torch"`` for what indexing returns."""
    return Checkpoint(path, output)
