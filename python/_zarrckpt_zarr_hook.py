"""Registers zarrckpt's zarr-python data types right after ``import zarr`` (zarr 3.0 to 3.4.0).

zarrckpt declares its data types (bfloat16, float8_e4m3fn, float8_e5m2; module
``zarrckpt.zarr_dtypes``) as entry points in the group ``zarr.data_type``. zarr-python loads
such entry points from version 3.4.1 on; versions 3.0 to 3.4.0 collect them at import and never
load them, so an installed package alone would not teach those versions the types. This module,
imported at interpreter start by ``zarrckpt_zarr_dtypes.pth``, closes that gap without importing
anything at start-up: it puts a finder on ``sys.meta_path`` that waits for the first
``import zarr`` and, once zarr's own ``__init__`` has run, imports ``zarrckpt.zarr_dtypes``
(which registers the types) when the zarr version needs it. It never changes what zarr imports.

``ZARRCKPT_NO_ZARR_HOOK=1`` turns it off. Any failure becomes a warning, never a failed
``import zarr``.
"""

import os
import sys

# First zarr-python version whose data type registry loads `zarr.data_type` entry points.
ENTRY_POINTS_WORK_FROM = (3, 4, 1)


def _version_tuple(text):
    parts = []
    for piece in text.split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    return tuple(parts + [0] * (3 - len(parts)))


def _after_zarr_import():
    try:
        zarr = sys.modules.get("zarr")
        version = _version_tuple(getattr(zarr, "__version__", "0"))
        if version < (3,) or version >= ENTRY_POINTS_WORK_FROM:
            return  # zarr 2 has no data type registry; new versions load the entry points
        import zarrckpt.zarr_dtypes  # noqa: F401  (registers the data types)
    except Exception as e:  # never break `import zarr`
        import warnings

        warnings.warn(
            "zarrckpt: could not register the bfloat16 / float8 data types with zarr-python: "
            f"{e!r}",
            stacklevel=2,
        )


class _ZarrImportFinder:
    """A meta path finder that only watches for the top-level `zarr` package."""

    def find_spec(self, name, path=None, target=None):
        if name != "zarr":
            return None
        _uninstall()
        spec = None
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_then_register(module):
            exec_module(module)
            _after_zarr_import()

        try:
            loader.exec_module = exec_then_register
        except (AttributeError, TypeError):  # a loader that forbids it: leave zarr alone
            pass
        return spec


_FINDER = _ZarrImportFinder()


def _uninstall():
    try:
        sys.meta_path.remove(_FINDER)
    except ValueError:
        pass


def install():
    """Puts the finder in place (idempotent); registers at once if zarr is already imported."""
    if os.environ.get("ZARRCKPT_NO_ZARR_HOOK", "") not in ("", "0"):
        return
    if "zarr" in sys.modules:
        _after_zarr_import()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


install()
