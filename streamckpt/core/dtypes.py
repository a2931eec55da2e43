"""The dtype table: safetensors dtype codes <-> torch dtypes <-> item sizes.

The safetensors code (``"F32"``, ``"BF16"``...) is the canonical spelling in
manifests, so every format shares one table.
"""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError, IncompatibleStateDictError


def _build() -> dict[str, torch.dtype]:
    table: dict[str, torch.dtype] = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
        "C128": torch.complex128,
    }
    optional = {
        "U64": "uint64",
        "U32": "uint32",
        "U16": "uint16",
        "F8_E4M3": "float8_e4m3fn",
        "F8_E4M3FNUZ": "float8_e4m3fnuz",
        "F8_E5M2": "float8_e5m2",
        "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "F8_E8M0": "float8_e8m0fnu",
    }
    for code, attr in optional.items():
        dtype = getattr(torch, attr, None)
        if dtype is not None:
            table[code] = dtype
    return table


# Immutable after import: a lookup table, not state.
_CODE_TO_DTYPE: dict[str, torch.dtype] = _build()
_DTYPE_TO_CODE: dict[torch.dtype, str] = {v: k for k, v in _CODE_TO_DTYPE.items()}

SUPPORTED_CODES: tuple[str, ...] = tuple(_CODE_TO_DTYPE)


def to_torch(code: str, *, where: str = "") -> torch.dtype:
    """The torch dtype for a stored dtype code; unknown codes are corrupt input."""
    try:
        return _CODE_TO_DTYPE[code]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(
            f"unknown dtype {code!r}{' in ' + where if where else ''}; "
            f"known: {', '.join(SUPPORTED_CODES)}"
        ) from None


def to_code(dtype: torch.dtype, *, where: str = "") -> str:
    """The stored code for a torch dtype; dtypes with no code cannot be saved."""
    try:
        return _DTYPE_TO_CODE[dtype]
    except KeyError:
        raise IncompatibleStateDictError(
            f"dtype {dtype} of {where or 'a tensor'} has no checkpoint encoding"
        ) from None


def itemsize(code: str) -> int:
    """Bytes per element of a stored dtype code."""
    return to_torch(code).itemsize
