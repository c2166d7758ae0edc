"""Exceptions raised by zarrckpt.

Every error of the Rust core arrives as one of these classes with the core's full message
(tensor key, chunk, rank, path), ``kind`` (the core's error variant, e.g. ``"DtypeMismatch"``)
and ``details`` (a dict with the ``rank``, ``ranks``, ``key``, ``keys`` or ``path`` the error
names, where it names them). A failure of the communicator (torch.distributed) is a
:class:`CommError` chained (``__cause__``) to the original exception.
"""

from __future__ import annotations


class ZarrckptError(Exception):
    """Base class of every zarrckpt error."""

    kind: str = "Other"
    details: dict

    def __init__(self, message: str = "", *args: object) -> None:
        super().__init__(message, *args)
        self.details = {}

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(ZarrckptError, ValueError):
    """A tensor piece, key, object or state dict handed in is invalid."""


class PlanError(ZarrckptError):
    """The ranks' declarations do not form a valid checkpoint (coverage, dtype, shape)."""


class CommError(ZarrckptError):
    """Communication between ranks failed, or another rank failed."""


class StorageError(ZarrckptError, OSError):
    """Reading or writing the checkpoint failed (missing, corrupt or incomplete files)."""


class KeyMismatchError(ZarrckptError, LookupError):
    """Keys requested but not in the checkpoint, or in it but requested by no rank."""


class MismatchError(ZarrckptError, ValueError):
    """A request disagrees with what is stored (dtype, shape, object scope or grid)."""


class SaveError(ZarrckptError):
    """An asynchronous save could not start or its background writer failed."""


class TableError(PlanError, ValueError):
    """A conversion table that does not parse, does not validate against the schema, or whose
    expressions or checks fail for a given config.json and layout (``zarrckpt.convert``)."""


class ConversionError(ZarrckptError, RuntimeError):
    """A conversion (``zarrckpt.convert``) refused (rule, key and numbers) or failed (file)."""


__all__ = [
    "ZarrckptError",
    "InvalidArgumentError",
    "PlanError",
    "CommError",
    "StorageError",
    "KeyMismatchError",
    "MismatchError",
    "SaveError",
    "TableError",
    "ConversionError",
]
