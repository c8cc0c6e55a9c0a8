"""Arrays as a source: a ``.npz`` file, a ``.npy`` file, or a folder of ``.npy`` files, read a
block at a time (memory-mapped or streamed from the zip), so an array may be larger than RAM."""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, get_args

import numpy as np

from tpurun.config import RawDType
from tpurun.data.sources.base import ACCEPTED, OVERHEAD_PER_FEATURE, Source
from tpurun.errors import DataError

_RAW_DTYPES = set(get_args(RawDType))


@dataclass
class _Array:
    """One named array whose first axis is the record axis, read ``blocks(size)`` at a time."""

    name: str
    where: str
    shape: tuple[int, ...]
    dtype: np.dtype
    blocks: Callable[[int], Iterator[np.ndarray]]


def npy_array(path: str) -> _Array:
    # mmap: slicing a block reads only that block, so the array may be larger than RAM.
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot read it as a .npy file: {exc}") from None
    stem = os.path.splitext(os.path.basename(path))[0]

    def blocks(size: int) -> Iterator[np.ndarray]:
        for start in range(0, len(array), size):
            yield array[start : start + size]

    return _Array(stem, path, array.shape, array.dtype, blocks)


def npz_arrays(path: str) -> list[_Array]:
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.namelist() if m.endswith(".npy")]
            headers = {}
            for member in members:
                with archive.open(member) as f:
                    headers[member] = _npy_header(f, f"{path}:{member}")
    except (OSError, zipfile.BadZipFile) as exc:
        raise DataError(f"{path}: cannot read it as a .npz file: {exc}") from None
    if not members:
        raise DataError(f"{path}: the .npz file holds no array; expected {ACCEPTED}.")
    arrays = []
    for member in members:
        shape, _, dtype = headers[member]
        blocks = partial(_npz_blocks, path, member)
        arrays.append(_Array(member[: -len(".npy")], f"{path}:{member}", shape, dtype, blocks))
    return arrays


def _npy_header(f: Any, where: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    if version == (2, 0):
        return np.lib.format.read_array_header_2_0(f)
    raise DataError(
        f"{where}: .npy format version {version} is not supported; save it with np.savez."
    )


def _npz_blocks(path: str, member: str, size: int) -> Iterator[np.ndarray]:
    # An .npz member cannot be memory-mapped when compressed, but it can be streamed: its bytes
    # are the rows in order (C order), so each block is one sequential read.
    with zipfile.ZipFile(path) as archive, archive.open(member) as f:
        shape, fortran_order, dtype = _npy_header(f, f"{path}:{member}")
        if fortran_order:  # rows are not contiguous: rare enough to read the array whole
            array = np.frombuffer(f.read(), dtype).reshape(shape, order="F")
            for start in range(0, shape[0], size):
                yield array[start : start + size]
            return
        row_bytes = dtype.itemsize * math.prod(shape[1:])
        for start in range(0, shape[0], size):
            rows = min(size, shape[0] - start)
            data = f.read(rows * row_bytes)
            if len(data) != rows * row_bytes:
                raise DataError(f"{path}:{member}: the array is truncated; save the .npz again.")
            yield np.frombuffer(data, dtype).reshape((rows, *shape[1:]))


def _array_feature(array: _Array) -> dict[str, Any]:
    """Per-record arrays go raw (dtype kept); scalars as int64 or float; strings as bytes."""
    shape, kind = list(array.shape[1:]), array.dtype.kind
    if 0 in shape:
        raise DataError(f"{array.where}: each record is empty (shape {shape}); drop this array.")
    if kind in "SU":
        return {"type": "bytes", "shape": shape}
    if kind == "b" and shape:  # bools are stored as their bytes, 0 or 1
        return {"type": "raw", "dtype": "uint8", "shape": shape}
    if not shape and kind in "biu":
        return {"type": "int64", "shape": []}
    if not shape and kind == "f":
        return {"type": "float", "shape": []}
    if shape and array.dtype.name in _RAW_DTYPES:
        return {"type": "raw", "dtype": array.dtype.name, "shape": shape}
    raise DataError(
        f"{array.where}: arrays of dtype {array.dtype} cannot be written; convert it to one of "
        f"{', '.join(sorted(_RAW_DTYPES))}, or to strings."
    )


class ArraySource(Source):
    """Named arrays (an .npz, one .npy or a folder of them); the first axis counts records."""

    def __init__(self, path: str, arrays: list[_Array]):
        self.path = path
        for array in arrays:
            if not array.shape:
                raise DataError(
                    f"{array.where}: a single value, not an array of records; the first axis must "
                    "count the records."
                )
        lengths = {array.name: array.shape[0] for array in arrays}
        if len(set(lengths.values())) > 1:
            found = ", ".join(f"{name}: {n}" for name, n in lengths.items())
            raise DataError(
                f"{path}: the arrays hold different numbers of records ({found}); the first axis "
                "of every array must have the same length."
            )
        self.records = arrays[0].shape[0]
        if self.records == 0:
            raise DataError(f"{path}: the arrays hold no record.")
        self._arrays = arrays
        self.features = {array.name: _array_feature(array) for array in arrays}
        per_record = sum(
            OVERHEAD_PER_FEATURE + array.dtype.itemsize * math.prod(array.shape[1:])
            for array in arrays
        )
        self.nbytes = per_record * self.records

    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        readers = [array.blocks(size) for array in self._arrays]
        for blocks in zip(*readers, strict=True):
            chunk = {}
            for array, block in zip(self._arrays, blocks, strict=True):
                if self.features[array.name]["type"] == "raw":
                    # decode_raw reads little-endian bytes; bools become their uint8 bytes
                    dtype = np.uint8 if array.dtype.kind == "b" else array.dtype.newbyteorder("<")
                    block = np.ascontiguousarray(block).astype(dtype, copy=False)
                    chunk[array.name] = [row.tobytes() for row in block]
                else:
                    chunk[array.name] = np.asarray(block)
            yield chunk
