"""zarr-python data types for ``bfloat16``, ``float8_e4m3fn`` and ``float8_e5m2``.

zarr-python 3 has no such data types, so ``zarr.open_array`` refuses the typical bf16 or fp8
checkpoint tensor. This module teaches it the three names zarrckpt writes in ``data_type``
(spec/format.md, sections 6.1 and 13), backed by the numpy types of ``ml_dtypes``:

==================  =============================  ================================
``data_type``       numpy type                     ``fill_value`` written
==================  =============================  ================================
``bfloat16``        ``ml_dtypes.bfloat16``         a JSON number (``0.0``)
``float8_e4m3fn``   ``ml_dtypes.float8_e4m3fn``    a hex string of the bits (``"0x00"``)
``float8_e5m2``     ``ml_dtypes.float8_e5m2``      a hex string of the bits (``"0x00"``)
==================  =============================  ================================

Reads return ml_dtypes arrays whose bytes are exactly the stored bytes (no conversion is ever
made: chunks are viewed with the ml_dtypes type); writes (``zarr.create_array(...,
dtype=ml_dtypes.bfloat16)``) produce arrays zarrckpt and tensorstore read back bit-exactly.
Fill values are read from a number, ``"NaN"``, ``"Infinity"``, ``"-Infinity"`` or a hex string
of the element's bits (``"0x3f80"`` is bfloat16 1.0). ``float8_e4m3fn`` (finite only, largest
448) is never treated as the Zarr registry's ``float8_e4m3`` (which has infinities). Zarr v3
only: Zarr v2 has no name for these types.

Registration:

* ``import zarrckpt.zarr_dtypes`` registers the three types in zarr-python's data type registry
  (``zarr.core.dtype.data_type_registry``); ``register()`` does it again (idempotent) and
  ``unregister()`` removes them.
* Installed with the ``zarrckpt`` package, the types are also declared as entry points in the
  group ``zarr.data_type``; zarr-python loads those on its own from version 3.4.1 on (versions
  3.0 to 3.4.0 collect the entry points but never load them). For those older versions the
  package installs a start-up hook (``zarrckpt_zarr_dtypes.pth`` and
  :mod:`zarrckpt._zarr_hook`) that registers the types right after ``import zarr``; set
  ``ZARRCKPT_NO_ZARR_HOOK=1`` to turn it off.
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import HasEndianness, HasItemSize
from zarr.core.dtype.wrapper import ZDType

try:  # zarr >= 3.2 moved it; importing it from its old place warns there
    from zarr.errors import DataTypeValidationError
except ImportError:  # pragma: no cover - zarr 3.0 / 3.1
    from zarr.core.dtype.common import DataTypeValidationError

__all__ = [
    "DATA_TYPES",
    "BFloat16",
    "Float8E4M3FN",
    "Float8E5M2",
    "register",
    "unregister",
]

_SPECIAL = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_HEX = re.compile(r"0x[0-9a-fA-F]+\Z")


@dataclass(frozen=True, kw_only=True)
class _MLFloat(ZDType, HasItemSize):  # type: ignore[type-arg]
    """A Zarr v3 data type wrapping one floating-point type of ml_dtypes."""

    _zarr_v3_name: ClassVar[str]
    _ml_type: ClassVar[type]
    _has_inf: ClassVar[bool] = True
    # The bit pattern written for NaN when the value is the type's canonical NaN.
    _canonical_nan_bits: ClassVar[int]
    # float8 fill values are written as hex strings of their bits, as zarrckpt writes them.
    _fill_as_hex: ClassVar[bool] = False

    # --- the native (numpy) data type ------------------------------------------------------

    @classmethod
    def _native(cls) -> np.dtype:
        return np.dtype(cls._ml_type)

    @classmethod
    def _check_native_dtype(cls, dtype: Any) -> bool:
        return isinstance(dtype, np.dtype) and type(dtype) is type(cls._native())

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> _MLFloat:
        if cls._check_native_dtype(dtype):
            return cls()
        raise DataTypeValidationError(
            f"Invalid data type: {dtype!r}. Expected numpy.dtype(ml_dtypes.{cls._ml_type.__name__})"
        )

    def to_native_dtype(self) -> np.dtype:
        return self._native()

    @property
    def item_size(self) -> int:
        return self._native().itemsize

    # --- data type JSON ----------------------------------------------------------------------

    @classmethod
    def _check_json_v3(cls, data: Any) -> bool:
        if data == cls._zarr_v3_name:
            return True
        # The object form {"name": ..., "configuration": {}} names the same type.
        return (
            isinstance(data, dict)
            and data.get("name") == cls._zarr_v3_name
            and set(data) <= {"name", "configuration"}
            and data.get("configuration", {}) in ({}, None)
        )

    @classmethod
    def _from_json_v3(cls, data: Any) -> _MLFloat:
        if cls._check_json_v3(data):
            return cls()
        raise DataTypeValidationError(
            f"Invalid JSON representation of {cls.__name__}. Got {data!r}, "
            f"expected {cls._zarr_v3_name!r}."
        )

    @classmethod
    def _from_json_v2(cls, data: Any) -> _MLFloat:
        # Zarr v2 names data types by numpy type strings; ml_dtypes types have none of their own
        # ("<V2" is any two-byte void), so there is nothing to match.
        raise DataTypeValidationError(
            f"{cls._zarr_v3_name} has no Zarr v2 representation (got {data!r})"
        )

    def to_json(self, zarr_format: Literal[2, 3]) -> str:  # type: ignore[override]
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(
            f"{self._zarr_v3_name} can be stored in Zarr v3 arrays only (zarr_format={zarr_format})"
        )

    # --- scalars -----------------------------------------------------------------------------

    def _bits_to_scalar(self, bits: int) -> np.generic:
        raw = np.array([bits], dtype=f"<u{self.item_size}")
        return raw.view(self._native())[0]

    def _scalar_bits(self, value: np.generic) -> int:
        return int(np.array([value], dtype=self._native()).view(f"<u{self.item_size}")[0])

    def _from_float(self, x: float) -> np.generic:
        if math.isinf(x) and not self._has_inf:
            raise ValueError(f"{self._zarr_v3_name} has no infinities: cannot represent {x!r}")
        if math.isfinite(x):
            limit = float(ml_dtypes.finfo(self._ml_type).max)
            if abs(x) > limit and not self._has_inf:
                raise ValueError(
                    f"{x!r} is out of range for {self._zarr_v3_name} (largest finite {limit})"
                )
        return self._ml_type(x)

    def _check_scalar(self, data: object) -> bool:
        if isinstance(data, str):
            return data in _SPECIAL or bool(_HEX.match(data)) or _is_float_str(data)
        if isinstance(data, bool | np.bool_):
            return False
        return isinstance(data, int | float | np.integer | np.floating) or (
            isinstance(data, np.generic) and type(data) in _ML_SCALARS
        )

    def cast_scalar(self, data: object) -> np.generic:
        if not self._check_scalar(data):
            raise TypeError(
                f"Cannot convert object {data!r} with type {type(data)} to a scalar compatible "
                f"with the data type {self}."
            )
        if isinstance(data, np.generic) and type(data) is self._ml_type:
            return data
        if isinstance(data, str):
            return self._from_json_str(data)
        return self._from_float(float(data))  # type: ignore[arg-type]

    def default_scalar(self) -> np.generic:
        return self._ml_type(0)

    def _from_json_str(self, data: str) -> np.generic:
        if data in _SPECIAL:
            return self._from_float(_SPECIAL[data])
        if _HEX.match(data):
            digits = len(data) - 2
            if digits != 2 * self.item_size:
                raise ValueError(
                    f"fill value {data!r}: a {self._zarr_v3_name} bit pattern has "
                    f"{2 * self.item_size} hex digits"
                )
            return self._bits_to_scalar(int(data, 16))
        if _is_float_str(data):
            return self._from_float(float(data))
        raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}")

    def from_json_scalar(self, data: Any, *, zarr_format: Literal[2, 3]) -> np.generic:
        if isinstance(data, str):
            return self._from_json_str(data)
        if isinstance(data, int | float) and not isinstance(data, bool):
            return self._from_float(float(data))
        raise TypeError(
            f"Invalid fill value {data!r} for {self._zarr_v3_name}: expected a number, "
            "'NaN', 'Infinity', '-Infinity' or a hex string of the bits"
        )

    def to_json_scalar(self, data: object, *, zarr_format: Literal[2, 3]) -> float | str:
        value = self.cast_scalar(data)
        bits = self._scalar_bits(value)
        width = 2 * self.item_size
        if self._fill_as_hex:
            return f"0x{bits:0{width}x}"
        x = float(value)
        if math.isnan(x):
            return "NaN" if bits == self._canonical_nan_bits else f"0x{bits:0{width}x}"
        if math.isinf(x):
            return "Infinity" if x > 0 else "-Infinity"
        return x


def _is_float_str(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class BFloat16(_MLFloat, HasEndianness):
    """``bfloat16``: the upper 16 bits of an IEEE 754 binary32 (``ml_dtypes.bfloat16``).

    Chunks are stored little endian (the ``bytes`` codec's ``endian``); a big-endian array
    cannot be viewed as ml_dtypes data and is refused with an error rather than misread."""

    _zarr_v3_name: ClassVar[str] = "bfloat16"
    _ml_type: ClassVar[type] = ml_dtypes.bfloat16
    _canonical_nan_bits: ClassVar[int] = 0x7FC0
    dtype_cls = type(np.dtype(ml_dtypes.bfloat16))

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> BFloat16:
        if cls._check_native_dtype(dtype):
            return cls(endianness="little")
        return super().from_native_dtype(dtype)  # type: ignore[return-value]

    def to_native_dtype(self) -> np.dtype:
        if self.endianness != "little":
            raise ValueError(
                "bfloat16 stored big endian cannot be read as ml_dtypes.bfloat16 "
                "(ml_dtypes types have no byte-swapped form); zarrckpt writes little endian"
            )
        return self._native()


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(_MLFloat):
    """``float8_e4m3fn``: 1 sign, 4 exponent (bias 7), 3 mantissa bits, finite only (largest
    448, NaN ``S.1111.111``), PyTorch's ``torch.float8_e4m3fn`` (``ml_dtypes.float8_e4m3fn``).
    Not the Zarr registry's ``float8_e4m3``, which has infinities."""

    _zarr_v3_name: ClassVar[str] = "float8_e4m3fn"
    _ml_type: ClassVar[type] = ml_dtypes.float8_e4m3fn
    _has_inf: ClassVar[bool] = False
    _canonical_nan_bits: ClassVar[int] = 0x7F
    _fill_as_hex: ClassVar[bool] = True
    dtype_cls = type(np.dtype(ml_dtypes.float8_e4m3fn))


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(_MLFloat):
    """``float8_e5m2``: 1 sign, 5 exponent (bias 15), 2 mantissa bits, IEEE-like with
    infinities and NaN (``torch.float8_e5m2``, ``ml_dtypes.float8_e5m2``)."""

    _zarr_v3_name: ClassVar[str] = "float8_e5m2"
    _ml_type: ClassVar[type] = ml_dtypes.float8_e5m2
    _canonical_nan_bits: ClassVar[int] = 0x7E
    _fill_as_hex: ClassVar[bool] = True
    dtype_cls = type(np.dtype(ml_dtypes.float8_e5m2))


DATA_TYPES: tuple[type[_MLFloat], ...] = (BFloat16, Float8E4M3FN, Float8E5M2)
_ML_SCALARS = (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.float16)


def register(registry: Any = None) -> None:
    """Registers the three data types in zarr-python's data type registry (idempotent)."""
    registry = data_type_registry if registry is None else registry
    for cls in DATA_TYPES:
        registry.register(cls._zarr_v3_name, cls)


def unregister(registry: Any = None) -> None:
    """Removes the three data types from the registry (those not registered are skipped)."""
    registry = data_type_registry if registry is None else registry
    for cls in DATA_TYPES:
        if registry.contents.get(cls._zarr_v3_name) is cls:
            registry.unregister(cls._zarr_v3_name)


if sys.byteorder != "little":  # pragma: no cover
    raise ImportError(
        "zarrckpt.zarr_dtypes needs a little-endian host (ml_dtypes arrays are native order)"
    )

register()
