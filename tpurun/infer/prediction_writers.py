"""Where ``tpurun predict`` streams its rows: a CSV file (class name and probabilities for a
classifier whose class names the run kept, else one column per output value), one ``.npy`` array,
or a ``.npz`` of one array per output. Each writes beside the output and renames over it at the
end, so a failed run leaves no half-written file; ``.npy`` and ``.npz`` arrays are memory-mapped
files of known size, so a multi-GB output never sits in memory.
"""

from __future__ import annotations

import csv
import os
import zipfile
from collections.abc import Sequence
from typing import Any

from tpurun.errors import TpurunError


def _flat(array: Any) -> Any:
    return array.reshape(len(array), -1)


class _Columns:
    """How outputs become CSV columns: class name and probabilities for a classifier whose class
    names the run kept, else one column per output value."""

    def __init__(self, names: list[str], arrays: list[Any], class_names: Sequence[str] | None):
        self.classes = None
        width = _flat(arrays[0]).shape[1] if len(arrays) == 1 else 0
        if class_names and len(arrays) == 1 and width in (1, len(class_names)):
            if width == len(class_names) or len(class_names) == 2:
                self.classes = list(class_names)
        if self.classes is not None:
            self.header = ["class", *self.classes]
            return
        self.header = []
        for name, array in zip(names, arrays, strict=True):
            n = _flat(array).shape[1]
            self.header += [name] if n == 1 else [f"{name}_{i}" for i in range(n)]

    def rows(self, arrays: list[Any]) -> list[list[str]]:
        import numpy as np

        if self.classes is not None:
            scores = _flat(arrays[0]).astype(np.float32)
            if scores.shape[1] == 1:  # one sigmoid unit: P(second class)
                chosen = (scores[:, 0] >= 0.5).astype(int)
                scores = np.concatenate([1 - scores, scores], axis=1)
            else:
                chosen = scores.argmax(axis=1)
            labels = np.asarray(self.classes, dtype=object)[chosen]
            return [
                [label, *values] for label, values in zip(labels, scores.astype(str), strict=True)
            ]
        values = np.concatenate([_flat(a).astype(str) for a in arrays], axis=1)
        return values.tolist()


class Writer:
    """Rows in, a complete file out: written beside the output and renamed over it at the end, so
    a failed run leaves no half-written file (and an older complete one stays)."""

    def __init__(self, path: str, records: int, id_name: str | None, class_names):
        self.path, self.records = path, records
        self.id_name, self.class_names = id_name, class_names
        folder, name = os.path.split(path)
        self.tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
        self.parts: list[str] = []
        self.written = 0
        self.header: list[str] = []

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        try:
            if kind is None:
                self.close()
                os.replace(self.tmp, self.path)
        finally:
            for leftover in [self.tmp, *self.parts]:
                if os.path.exists(leftover):
                    os.remove(leftover)

    def write(self, names: list[str], arrays: list[Any], ids: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class CsvWriter(Writer):
    def write(self, names, arrays, ids) -> None:
        if not self.written:
            self.file = open(self.tmp, "w", newline="", encoding="utf-8")
            self.csv = csv.writer(self.file)
            self.columns = _Columns(names, arrays, self.class_names)
            self.header = [self.id_name or "row", *self.columns.header]
            self.csv.writerow(self.header)
        if ids is None:
            ids = range(self.written, self.written + len(arrays[0]))
        self.csv.writerows([i, *row] for i, row in zip(ids, self.columns.rows(arrays), strict=True))
        self.written += len(arrays[0])

    def close(self) -> None:
        if self.written:
            self.file.close()


class NpyWriter(Writer):
    """``.npy``: one output's array, rows in record order (ids are not stored: use .npz)."""

    def write(self, names, arrays, ids) -> None:
        from numpy.lib.format import open_memmap

        if len(arrays) != 1:
            raise TpurunError(
                f"--output {self.path}: the model has {len(arrays)} outputs and a "
                ".npy file holds one array; name a .npz file."
            )
        if not self.written:
            shape = (self.records, *arrays[0].shape[1:])
            self.array = open_memmap(self.tmp, mode="w+", dtype=arrays[0].dtype, shape=shape)
            self.header = names
        self.array[self.written : self.written + len(arrays[0])] = arrays[0]
        self.written += len(arrays[0])

    def close(self) -> None:
        if self.written:
            self.array.flush()
            del self.array


class NpzWriter(Writer):
    """``.npz``: one array per output (and ``id``), each a memory-mapped ``.npy`` zipped at the end."""

    def write(self, names, arrays, ids) -> None:
        from numpy.lib.format import open_memmap

        if not self.written:
            self.header = list(names)
            self.arrays = []
            for array in arrays:
                part = f"{self.tmp}.{len(self.parts)}.npy"
                self.parts.append(part)
                shape = (self.records, *array.shape[1:])
                self.arrays.append(open_memmap(part, mode="w+", dtype=array.dtype, shape=shape))
            self.ids: list = []
        for target, array in zip(self.arrays, arrays, strict=True):
            target[self.written : self.written + len(array)] = array
        if ids is not None:
            self.ids.extend(ids)  # ids are small beside the predictions
        self.written += len(arrays[0])

    def close(self) -> None:
        import numpy as np

        if not self.written:
            return
        with zipfile.ZipFile(self.tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, part, array in zip(self.header, self.parts, self.arrays, strict=True):
                array.flush()
                archive.write(part, f"{name}.npy")
            if self.id_name:
                with archive.open(f"{self.id_name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, np.asarray(self.ids))
        self.arrays.clear()


WRITERS = {".csv": CsvWriter, ".npy": NpyWriter, ".npz": NpzWriter}
