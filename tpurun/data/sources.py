"""What ``tpurun data write`` reads: arrays, CSV files and folders of images.

Every source knows its record count and its features (in the config's feature-spec form) before
the first record is read, and yields records a chunk at a time, as ``{feature: column}`` where each
column is a numpy array or a list of bytes that ``write.example_bytes`` accepts row by row. Only
one chunk is held in memory, so a source larger than RAM can be written.

Sources are local files; copy a remote one here first (``gsutil -m cp -r``). CSV files have their
own module, ``tabular``, for their options (label, packed columns, missing values).
"""

from __future__ import annotations

import glob
import math
import os
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, get_args

import numpy as np

from tpurun import frameworks
from tpurun.config import RawDType
from tpurun.data.decode import image_format
from tpurun.errors import DataError

if TYPE_CHECKING:
    from tpurun.data.tabular import TableOptions

ACCEPTED = (
    "a .npz file, a .npy file, a folder of .npy files, CSV files with a header row (a path or a "
    "glob), or a folder of images with one subfolder per class"
)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
_RAW_DTYPES = set(get_args(RawDType))
# A tf.train.Example spends a few bytes per feature on the key and the list headers.
_OVERHEAD_PER_FEATURE = 12


class Source:
    """A dataset to write: its size and features up front, then its records a chunk at a time.

    Attributes:
        path: the source as the user named it (recorded in the schema file).
        records: how many records ``chunks`` yields in total.
        features: ``{name: feature spec}`` in the config's form, e.g. ``{"type": "float"}``.
        nbytes: the estimated size of all records once serialized, to size the shards.
        class_names: the class of each label value (image folders, a CSV's text label).
        layout: what the schema file should also say of how records were made from the source
            (a CSV's label, packed columns and fills); ``{}`` for most sources.
    """

    path: str
    records: int
    features: dict[str, dict[str, Any]]
    nbytes: int
    class_names: list[str] | None = None
    layout: dict[str, Any] = {}  # read only here; a source that fills it sets its own

    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        """Yield ``{feature: column}`` dicts of at most ``size`` records each, in order."""
        raise NotImplementedError


def open_source(
    path: str,
    *,
    image_size: tuple[int, int] | None = None,
    seed: int = 0,
    table: TableOptions | None = None,
) -> Source:
    """Recognize what ``path`` is and open it as a source.

    Args:
        path: a .npz or .npy file, a folder of .npy files, a CSV file or glob, or an image folder.
        image_size: for image folders, re-encode every image at this ``(height, width)``.
        seed: for image folders, the seed of the shuffled file order.
        table: for CSV files, the label, packed columns and missing-value fill.

    Raises:
        DataError: the path is missing, empty, or none of the accepted kinds, or an option does
            not apply to its kind.
    """
    source = _open(str(path), image_size, seed, table)
    if image_size is not None and not isinstance(source, ImageFolderSource):
        raise DataError(
            f"{path}: image_size={tuple(image_size)} resizes images, but this source holds "
            "arrays or CSV rows; leave it out."
        )
    return source


def _open(
    path: str, image_size: tuple[int, int] | None, seed: int, table: TableOptions | None
) -> Source:
    from tpurun.data.tabular import CsvSource

    if table and not (any(c in path for c in "*?[") or path.lower().endswith(".csv")):
        raise DataError(
            f"{path}: --label, --pack and --fill-missing apply to CSV files, and this source is "
            "not one; leave them out."
        )
    if "://" in path:
        raise DataError(
            f"{path}: sources are read from local files; copy it to this machine first "
            "(e.g. gsutil -m cp -r), then write from the local copy."
        )
    if any(c in path for c in "*?[") or path.lower().endswith(".csv"):
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
        if not files:
            raise DataError(f"{path}: no file matches this path; expected {ACCEPTED}.")
        if all(f.lower().endswith(".csv") for f in files):
            return CsvSource(path, files, table)
        others = [f for f in files if not f.lower().endswith(".csv")]
        raise DataError(
            f"{path}: matches {others[0]}, which is not a .csv file; a glob names CSV files."
        )
    if os.path.isfile(path) and path.endswith(".npz"):
        return ArraySource(path, _npz_arrays(path))
    if os.path.isfile(path) and path.endswith(".npy"):
        return ArraySource(path, [_npy_array(path)])
    if os.path.isdir(path):
        npy = sorted(glob.glob(os.path.join(glob.escape(path), "*.npy")))
        if npy:
            return ArraySource(path, [_npy_array(f) for f in npy])
        if _visible_subfolders(path):
            return ImageFolderSource(path, image_size=image_size, seed=seed)
        raise DataError(
            f"{path}: the folder holds no .npy file and no subfolder; expected {ACCEPTED}."
        )
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or folder; expected {ACCEPTED}.")
    raise DataError(f"{path}: not a kind of source tpurun can write; expected {ACCEPTED}.")


# ---------------------------------------------------------------------------------------- arrays
@dataclass
class _Array:
    """One named array whose first axis is the record axis, read ``blocks(size)`` at a time."""

    name: str
    where: str
    shape: tuple[int, ...]
    dtype: np.dtype
    blocks: Callable[[int], Iterator[np.ndarray]]


def _npy_array(path: str) -> _Array:
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


def _npz_arrays(path: str) -> list[_Array]:
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
            _OVERHEAD_PER_FEATURE + array.dtype.itemsize * math.prod(array.shape[1:])
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


# ---------------------------------------------------------------------------------------- images
def _visible_subfolders(path: str) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


class ImageFolderSource(Source):
    """``<folder>/<class>/**/*.jpg|jpeg|png``: features ``image`` (encoded bytes) and ``label``.

    Labels index the sorted class subfolder names, as Keras' ``image_dataset_from_directory``
    does. The files are written in an order shuffled by ``seed``: listed in class order, every
    shard would otherwise hold one or two classes.
    """

    def __init__(self, path: str, *, image_size: tuple[int, int] | None, seed: int):
        self.path = path
        self.class_names = _visible_subfolders(path)
        files: list[tuple[str, int]] = []
        for label, name in enumerate(self.class_names):
            for root, dirs, names in os.walk(os.path.join(path, name)):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                files.extend(
                    (os.path.join(root, f), label)
                    for f in sorted(names)
                    if f.lower().endswith(IMAGE_SUFFIXES) and not f.startswith(".")
                )
        if not files:
            raise DataError(
                f"{path}: no .jpg, .jpeg or .png file in its subfolders "
                f"({', '.join(self.class_names)}); expected one subfolder of images per class."
            )
        first_height, first_width, channels = _image_shape(_read_image(files[0][0]), files[0][0])
        # Gray+alpha is read as gray (configs allow 1, 3 or 4 channels) and RGBA as RGB: JPEGs
        # cannot be decoded to 4 channels, and a class folder often mixes JPEGs and PNGs.
        channels = 1 if channels <= 2 else 3
        self._size = tuple(image_size) if image_size else None
        height, width = self._size or (first_height, first_width)
        self._channels = channels
        self.features = {
            "image": {"type": "image", "shape": [height, width, channels]},
            "label": {"type": "int64", "shape": []},
        }
        self.records = len(files)
        order = np.random.default_rng(seed).permutation(len(files))
        self._files = [files[i] for i in order]
        self.nbytes = sum(os.path.getsize(f) for f, _ in files)
        if self._size:  # encoded size grows roughly with the pixel count
            self.nbytes = int(self.nbytes * height * width / (first_height * first_width))
        self.nbytes += 2 * _OVERHEAD_PER_FEATURE * self.records

    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        for start in range(0, self.records, size):
            batch = self._files[start : start + size]
            images = []
            for file, _ in batch:
                data = _read_image(file)
                images.append(self._resize(data, file) if self._size else data)
            yield {"image": images, "label": np.array([label for _, label in batch], np.int64)}

    def _resize(self, data: bytes, file: str) -> bytes:
        tf = frameworks.tensorflow()
        try:
            image = tf.io.decode_image(data, channels=self._channels, expand_animations=False)
        except tf.errors.OpError as exc:
            raise DataError(f"{file}: cannot decode the image: {exc.message}") from None
        image = tf.image.resize(image, self._size, antialias=True)
        image = tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)
        if image_format(data) == "png":
            return tf.io.encode_png(image).numpy()
        return tf.io.encode_jpeg(image, quality=95).numpy()


def _read_image(file: str) -> bytes:
    with open(file, "rb") as f:
        data = f.read()
    if image_format(data) is None:
        raise DataError(
            f"{file}: not a JPEG or PNG image (by its first bytes); remove or convert it."
        )
    return data


def _image_shape(data: bytes, file: str) -> tuple[int, int, int]:
    tf = frameworks.tensorflow()
    try:
        shape = tf.io.decode_image(data, expand_animations=False).shape
    except tf.errors.OpError as exc:
        raise DataError(f"{file}: cannot decode the image: {exc.message}") from None
    return int(shape[0]), int(shape[1]), int(shape[2])
