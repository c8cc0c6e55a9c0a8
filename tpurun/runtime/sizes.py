"""Sizes in bytes: one element of a dtype, and a byte count as a person reads it."""

from __future__ import annotations

import re
from typing import Any

_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4,
             "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8}  # fmt: skip


def itemsize(dtype: Any) -> int:
    """Bytes of one element of ``dtype`` (a name, a numpy dtype or anything with ``.name``)."""
    name = str(getattr(dtype, "name", dtype))
    if name in _ITEMSIZE:
        return _ITEMSIZE[name]
    bits = re.search(r"(\d+)", name)
    return max(1, int(bits.group(1)) // 8) if bits else 4


def size(n: float) -> str:
    """Bytes for a person: ``15.8 GiB``, ``640 KiB``, ``12 B``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
