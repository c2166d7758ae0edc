"""Checkpoints of a training run, one per step, with a ``latest`` pointer and retention.

::

    from zarrckpt.manager import CheckpointManager

    manager = CheckpointManager("run", keep_last=3)       # collective over torch.distributed
    state = {"model": model, "optim": optimizer, "step": 0}
    if (step := manager.load_latest(state)) is not None:   # resume where the run stopped
        ...
    for step in range(start, steps):
        train_step()
        if step % 100 == 0:
            manager.async_save(step, state)              # returns once the state is copied

Each step is a checkpoint directory ``ROOT/step-NNNNNNNN`` (spec § "Checkpoint manager"); a
step's commit, the ``latest`` pointer and the removal of steps beyond ``keep_last`` (except
multiples of ``keep_every``) follow in the background of an asynchronous save, and a step is
only ever removed after a newer one is committed. The root may be an object-store URL
(``"s3://bucket/run1"``; endpoint and credentials from the environment): each step is then a
checkpoint under ``ROOT/step-NNNNNNNN``, ``latest`` an object under the root, and a dropped
step's objects are deleted only after the newer step's commit. State dicts are those of
:mod:`zarrckpt.torch` (tensors, DTensors, modules, optimizers, JSON values, bytes, CUDA
tensors): the whole training state, tensors and objects, in one commit per step.

This is zarrckpt's Rust ``CheckpointManager`` wrapping its ``Saver``: one staging budget
(``staging_bytes``) reused from step to step, every planning error raised by the call
itself, and background errors by the returned handle's ``wait()`` (or at exit, as
:func:`zarrckpt.torch.async_save`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import _core, _native
from . import torch as _torch

__all__ = ["CheckpointManager", "StepInfo"]


@dataclass(frozen=True)
class StepInfo:
    """One step directory under the root."""

    step: int
    dir: str
    complete: bool
    bytes: int


class CheckpointManager:
    """Checkpoints of a training run under ``root``, saved through one saver.

    ``keep_last``: keep the last this many committed steps (0: keep every step).
    ``keep_every``: also keep every step that is a multiple of this. ``process_group``: the
    ranks that save (default: the default group; none without torch.distributed).
    ``staging_bytes``: the cap on the memory an asynchronous save copies the state into
    (host memory, or page-locked memory for CUDA tensors), reused from save to save.
    ``lower_priority``: run the background writer at a lower CPU priority.

    Collective: every rank creates its manager over the same root and calls :meth:`save`,
    :meth:`async_save` and :meth:`load_latest` in the same order; :meth:`latest` and
    :meth:`steps` are local.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        keep_last: int = 0,
        keep_every: int | None = None,
        process_group: Any = None,
        staging_bytes: int | None = None,
        lower_priority: bool = True,
    ) -> None:
        self._group = process_group
        self._comm = _core.communicator(process_group)
        self._native = _native.CheckpointManager(
            os.fspath(root), self._comm, keep_last, keep_every, staging_bytes, lower_priority
        )

    @property
    def root(self) -> str:
        """The root directory (or object-store URL)."""
        return os.fspath(self._native.root)

    def step_dir(self, step: int) -> str:
        """The directory of ``step``: ``ROOT/step-`` and the step with at least 8 digits."""
        return os.fspath(self._native.step_dir(step))

    def latest(self) -> int | None:
        """The latest committed step (incomplete steps skipped), or ``None``. Local."""
        return self._native.latest()

    def steps(self) -> list[StepInfo]:
        """Every step directory by increasing step, complete or not, with its size. Local."""
        return [StepInfo(s, os.fspath(d), c, b) for s, d, c, b in self._native.steps()]

    def _save(self, step: int, state_dict: Mapping[str, Any], asynchronous: bool, options):
        path = self.step_dir(step)
        comm = self._comm

        def prepare() -> tuple:
            plan = _torch._flatten(state_dict, comm, load=False, path=path)
            return plan.pieces, plan.objects

        opts = _torch._save_options(options.pop("overwrite", True), options)
        return _core._save(path, prepare, comm, opts, asynchronous, self._native, step)

    def save(self, step: int, state_dict: Mapping[str, Any], **options: Any) -> dict:
        """Saves ``state_dict`` as ``step`` (collective), then points ``latest`` at it and
        applies retention. Options as :func:`zarrckpt.torch.save` (``overwrite`` defaults to
        True: a step saved again replaces the earlier one atomically). Returns this rank's
        save report."""
        return self._save(step, state_dict, False, options)

    def async_save(
        self, step: int, state_dict: Mapping[str, Any], **options: Any
    ) -> _core.SaveHandle:
        """Starts saving ``state_dict`` as ``step`` (collective) and returns a handle once
        the state is copied; writing, the commit, the ``latest`` pointer and retention go on
        in the background. Planning errors (a layout or objects the ranks disagree on) are
        raised here, on every rank; background errors by ``wait()``."""
        return self._save(step, state_dict, True, options)

    def load_latest(self, state_dict: Mapping[str, Any], **options: Any) -> int | None:
        """Loads the latest committed step into ``state_dict`` in place (collective; rank 0
        picks the step, after any save in flight) and returns it, or ``None`` (nothing
        loaded) when the root holds no committed step. Options as
        :func:`zarrckpt.torch.load` (``strict``, ``cast``, ``per_rank``, ...)."""
        _core._wait_idle(self._comm)
        step = self._native.agreed_latest()
        if step is None:
            return None
        _torch.load(state_dict, self.step_dir(step), process_group=self._group, **options)
        return step
