"""A batch of serialized ``tf.train.Example`` records to numpy arrays, without TensorFlow.

:class:`BatchParser` returns what the ``tf.data`` path gives for the same records,
``decode.decode_batch(tf.io.parse_example(batch, decode.parse_spec(used)), used)`` as numpy:
the same keys (feature names), dtypes, shapes and values, for every type of
:mod:`tpurun.data.decode`'s table. Each record is parsed once, by protobuf's C implementation
(upb), and each feature's values land straight in a preallocated batch array. Images decode in
threads (their decoders release the GIL).

Where the model reads only raw, float and int64 features and a batch's records share one
layout, the batch is parsed at once instead, with numpy: as columns of its records' bytes where
every record has the same length (:mod:`tpurun.data.native.layout`), else walking all its records
together (:mod:`tpurun.data.native.varying`: int64 lists of varying byte lengths, such as token
ids). Any other batch is parsed record by record, with the same results and the same errors.

A record that does not hold a feature as declared (missing, another list kind, another length)
fails the batch with a :class:`RecordMismatch` naming the feature, as ``parse_example`` fails it.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from tpurun.config import (
    CategoryFeature,
    ImageFeature,
    RawFeature,
    TextFeature,
)
from tpurun.data import categories
from tpurun.data.decode import record_key
from tpurun.data.native import example, images, layout, varying
from tpurun.data.native.recycle import BatchArrays
from tpurun.errors import DataError

_LIST = {"int64": "int64_list", "float": "float_list", "bytes": "bytes_list"}
_DTYPES = {"int64_list": np.int64, "float_list": np.float32, "bytes_list": object}
_KIND_NAME = {"int64_list": "int64", "float_list": "float", "bytes_list": "bytes"}
_PATHS = ("columns", "walked", "records")  # the parsers a batch may take, in the order tried
#: Images a decoding thread takes at least (fewer cost more in threads than they save).
_PARALLEL_IMAGES = 4


class RecordMismatch(DataError):
    """A record of the batch does not hold a feature as declared.

    Attributes:
        index: the record's position in the batch.
        name, key: the feature and its record key.
    """

    def __init__(self, message: str, index: int, name: str, key: str):
        super().__init__(message)
        self.index, self.name, self.key = index, name, key


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a config dtype name (``bfloat16`` through ml_dtypes, as JAX has it)."""
    if name == "bfloat16":
        import ml_dtypes  # JAX's own dependency; only a bfloat16 feature needs it

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


class _Column:
    """One feature of the batch: where its values go, and how they are finished."""

    def __init__(self, name: str, spec: Any):
        self.name, self.spec, self.key = name, spec, record_key(name, spec)
        if isinstance(spec, (RawFeature, ImageFeature, TextFeature, CategoryFeature)):
            self.kind, self.shape = "bytes_list", []
        else:
            self.kind, self.shape = _LIST[spec.type], list(spec.shape)
        self.size = math.prod(self.shape)
        self.scalar = self.size == 1  # its values gather in a list, a Python object a record
        cast = getattr(spec, "cast", None)
        self.cast = numpy_dtype(cast) if cast else None

    def allocate(self, n: int) -> np.ndarray | list:
        if self.scalar:
            return [None] * n
        return np.empty((n, self.size), _DTYPES[self.kind])


class BatchParser:
    """Parses batches of serialized Examples into ``{feature name: numpy array}``.

    Args:
        features: the features to decode (``tpurun.data.decode.used_features(data)``).
        threads: images decoded at once (default: the CPU count, at most 8).
        fast_path: parse a batch at once where its records share one layout (False: always
            record by record).
    """

    def __init__(
        self, features: Mapping[str, Any], *, threads: int | None = None, fast_path: bool = True
    ):
        self.columns = [_Column(name, spec) for name, spec in features.items()]
        self.threads = threads or min(8, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._arrays = BatchArrays()  # the batches' arrays, used again once dropped
        wanted = [_wanted(column) for column in self.columns]
        self._layouts: list[Any] = []
        if fast_path and None not in wanted:
            self._layouts = [
                layout.FixedLayout(wanted, self._arrays),
                varying.VaryingLayout(wanted, self._arrays),
            ]
        self._paths = dict.fromkeys(_PATHS, 0)
        self._counting = threading.Lock()  # parse workers share the parser

    @property
    def batches_by_path(self) -> dict[str, int]:
        """Batches parsed so far by each path: ``columns`` (records of one length, as columns of
        their bytes), ``walked`` (records of one structure, walked together) and ``records``
        (one by one, where the batch failed too)."""
        with self._counting:
            return dict(self._paths)

    def __call__(self, serialized: Sequence[bytes]) -> dict[str, np.ndarray]:
        """Decode one batch.

        Raises:
            RecordMismatch: a record lacks a feature, or holds it as another kind or length.
            DataError: a record is not a ``tf.train.Example``; an image does not decode.
        """
        n = len(serialized)
        path, arrays = self._at_once(serialized)
        with self._counting:
            self._paths[path] += 1
        if arrays is None:
            values = [column.allocate(n) for column in self.columns]
            _fill(serialized, self.columns, values)
            arrays = [self._finish(c, out, n) for c, out in zip(self.columns, values, strict=True)]
        return {
            column.name: self._cast(column, array)
            for column, array in zip(self.columns, arrays, strict=True)
        }

    def _at_once(self, serialized: Sequence[bytes]) -> tuple[str, list[np.ndarray] | None]:
        """The batch parsed by the first layout its records share, and that path; else
        ``("records", None)``."""
        for found, path in zip(self._layouts, _PATHS, strict=False):
            arrays = found.parse(serialized)
            if arrays is not None:
                return path, arrays
        return "records", None

    def _finish(self, column: _Column, out: Any, n: int) -> np.ndarray:
        spec = column.spec
        if isinstance(spec, RawFeature):
            return _raw(column, out, n)
        if isinstance(spec, ImageFeature):
            return self._images(column, out)
        if column.scalar:
            array = np.empty(n, _DTYPES[column.kind])
            array[:] = out
            return array.reshape(n, *column.shape)
        return out.reshape(n, *column.shape)

    def _images(self, column: _Column, encoded: list[bytes]) -> np.ndarray:
        spec = column.spec
        out = self._arrays.empty((len(encoded), *spec.shape), np.float32)

        def one(i: int) -> None:
            try:
                images.load(encoded[i], spec.shape, spec.scale, out[i])
            except images.ImageError as exc:
                raise images.ImageError(
                    f"feature '{column.name}' (record key '{column.key}'), record {i} of the "
                    f"batch: {exc.message}"
                ) from None

        def every(first: int, step: int) -> None:
            for i in range(first, len(encoded), step):
                one(i)

        threads = min(self.threads, len(encoded) // _PARALLEL_IMAGES)
        if threads > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="tpurun-images")
            # One task a thread, not one an image: a task per image hands the GIL over at each,
            # and on 2 cores decoded 5.3k images/s against 7.9k this way (192x192 JPEGs).
            list(self._pool.map(every, range(threads), [threads] * threads))
        else:
            every(0, 1)
        return out

    def _cast(self, column: _Column, array: np.ndarray) -> np.ndarray:
        if isinstance(column.spec, CategoryFeature):
            return categories.encode_numpy(array, column.spec)
        if column.cast is None or array.dtype == column.cast:  # a layout may have cast it
            return array
        with np.errstate(all="ignore"):  # TF casts out-of-range values without a word too
            return self._arrays.cast(array, column.cast)

    def close(self) -> None:
        """Stop the image threads (a parser that decoded no image has none)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


def _wanted(column: _Column) -> layout.Wanted | None:
    """How the column's values lie in a record when their size is fixed in bytes (else None)."""
    spec, shape = column.spec, tuple(column.shape)
    if isinstance(spec, RawFeature):
        dtype = numpy_dtype(spec.dtype).newbyteorder("<")  # decode_raw reads little-endian
        return layout.Wanted(
            column.key,
            column.kind,
            dtype.itemsize * math.prod(spec.shape),
            dtype,
            tuple(spec.shape),
        )
    if column.kind == "float_list":
        return layout.Wanted(column.key, column.kind, 4 * column.size, np.dtype("<f4"), shape)
    if column.kind == "int64_list":  # its count (in bytes too, where every value is 0-127)
        return layout.Wanted(
            column.key, column.kind, column.size, np.dtype(np.uint8), shape, column.cast
        )
    return None


def _fill(serialized: Sequence[bytes], columns: list[_Column], values: list[Any]) -> None:
    """Parse each record once and put each feature's values in its row of ``values``."""
    parse = example.Example.FromString
    plan = [(c.key, c.kind, c.size, c.scalar, out) for c, out in zip(columns, values, strict=True)]
    for i, record in enumerate(serialized):
        try:
            stored = parse(record).features.feature
        except DecodeError:
            raise DataError(
                f"record {i} of the batch is not a tf.train.Example (protobuf cannot parse its "
                f"{len(record)} bytes)."
            ) from None
        for key, kind, size, scalar, out in plan:
            feature = stored.get(key)
            if feature is None:
                raise _missing(columns, key, i, stored)
            found = getattr(feature, kind).value
            if len(found) != size:
                raise _mismatch(columns, key, i, feature)
            out[i] = found[0] if scalar else found


def _raw(column: _Column, values: list[bytes], n: int) -> np.ndarray:
    """``tf.io.decode_raw`` (little-endian) of each record's bytes, reshaped to the shape."""
    spec = column.spec
    dtype = numpy_dtype(spec.dtype).newbyteorder("<")  # decode_raw reads little-endian
    size = dtype.itemsize * math.prod(spec.shape)
    for i, value in enumerate(values):
        if len(value) != size:
            raise RecordMismatch(
                f"feature '{column.name}' (record key '{column.key}') is declared raw "
                f"{spec.dtype} of shape {spec.shape}, which is {size} bytes, but record {i} of "
                f"the batch holds {len(value)} bytes. Fix the feature's dtype and shape (tpurun "
                "data inspect shows what the records hold).",
                i,
                column.name,
                column.key,
            )
    data = bytearray().join(values)  # writable, as TF's tensors are (one copy)
    return np.frombuffer(data, dtype).reshape(n, *spec.shape)


def _declared(column: _Column) -> str:
    spec = column.spec
    if isinstance(spec, (RawFeature, ImageFeature)):
        return f"{spec.type} (one bytes value)"
    if isinstance(spec, (TextFeature, CategoryFeature)):
        return f"{spec.type} (one UTF-8 string)"
    return f"{spec.type} of shape {spec.shape} ({column.size} value{'s' * (column.size != 1)})"


def _missing(columns: list[_Column], key: str, i: int, stored: Any) -> RecordMismatch:
    column = next(c for c in columns if c.key == key)
    present = ", ".join(sorted(stored)[:8]) or "(none)"
    return RecordMismatch(
        f"feature '{column.name}' (record key '{column.key}') is not in record {i} of the batch; "
        f"it holds: {present}. Every record must hold each feature the model reads.",
        i,
        column.name,
        column.key,
    )


def _mismatch(columns: list[_Column], key: str, i: int, feature: Any) -> RecordMismatch:
    column = next(c for c in columns if c.key == key)
    kind = feature.WhichOneof("kind")
    held = len(getattr(feature, kind).value) if kind else 0
    what = f"{held} {_KIND_NAME[kind]} value{'s' * (held != 1)}" if kind else "no value"
    return RecordMismatch(
        f"feature '{column.name}' (record key '{column.key}') is declared {_declared(column)}, "
        f"but record {i} of the batch holds {what}. Fix the feature (tpurun data inspect shows "
        "what the records hold) or the records.",
        i,
        column.name,
        column.key,
    )
