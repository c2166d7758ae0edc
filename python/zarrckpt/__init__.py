"""zarrckpt: distributed training checkpoints as Zarr v3 arrays, from Python.

- ``zarrckpt.torch``: ``save`` / ``load`` / ``async_save`` of PyTorch state dicts (tensors,
  DTensors, modules and optimizers, JSON values, bytes; no pickle), collective over
  torch.distributed.
- ``zarrckpt.manager.CheckpointManager``: one checkpoint per training step under a root,
  saved synchronously or in the background, a ``latest`` pointer, keep-N retention, resume
  from the latest committed step (needs torch).
- ``zarrckpt.open(path)``: inspect a checkpoint and read boxes of its tensors lazily, as numpy
  (ml_dtypes for bf16 / fp8) or torch.
- ``zarrckpt._core``: the thin layer the fronts share (pieces of global tensors in, no copies).

Errors are :class:`ZarrckptError` subclasses carrying the Rust core's full message.
"""

from __future__ import annotations

from . import _native
from ._errors import (
    CommError,
    InvalidArgumentError,
    KeyMismatchError,
    MismatchError,
    PlanError,
    SaveError,
    StorageError,
    ZarrckptError,
)
from .reader import Checkpoint, LazyTensor, ObjectInfo, TensorInfo, open

__version__ = _native.__version__

__all__ = [
    "__version__",
    "open",
    "Checkpoint",
    "LazyTensor",
    "TensorInfo",
    "ObjectInfo",
    "ZarrckptError",
    "InvalidArgumentError",
    "PlanError",
    "CommError",
    "StorageError",
    "KeyMismatchError",
    "MismatchError",
    "SaveError",
]
