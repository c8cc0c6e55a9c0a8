"""What ``tpurun data write`` reads: arrays, CSV and JSONL files, and folders of images.

Every source knows its record count and its features (in the config's feature-spec form) before
the first record is read, and yields records a chunk at a time, as ``{feature: column}`` where each
column is a numpy array or a list of bytes that ``write.example_bytes`` accepts row by row. Only
one chunk is held in memory, so a source larger than RAM can be written.

Sources are local files; copy a remote one here first (``gsutil -m cp -r``). One module per kind:
:mod:`.arrays`, :mod:`.images`, :mod:`.tabular` (CSV files, with their options: label, packed
columns, missing values, text columns), :mod:`.jsonl` (JSONL files: text, a label), :mod:`.chat` (JSONL conversations); :mod:`.base`
is what they all share, :mod:`.columns` what the two tables share. This module recognises which
kind a path is.
"""

from __future__ import annotations

import glob
import os

from tpurun.data.sources import chat
from tpurun.data.sources.arrays import ArraySource, npy_array, npz_arrays
from tpurun.data.sources.base import ACCEPTED, Source
from tpurun.data.sources.columns import TableOptions
from tpurun.data.sources.images import ImageFolderSource, visible_subfolders
from tpurun.data.sources.jsonl import SUFFIXES as JSONL_SUFFIXES
from tpurun.data.sources.jsonl import JsonlSource
from tpurun.data.sources.tabular import CsvSource
from tpurun.errors import DataError

__all__ = ["ACCEPTED", "Source", "open_source"]


def open_source(
    path: str,
    *,
    image_size: tuple[int, int] | None = None,
    seed: int = 0,
    table: TableOptions | None = None,
) -> Source:
    """Recognize what ``path`` is and open it as a source.

    Args:
        path: a .npz or .npy file, a folder of .npy files, a CSV or JSONL file or glob, or an
            image folder.
        image_size: for image folders, re-encode every image at this ``(height, width)``.
        seed: for image folders, the seed of the shuffled file order.
        table: for CSV files, the label, packed columns, missing-value fill and text columns;
            for JSONL files, the label and text columns.

    Raises:
        DataError: the path is missing, empty, or none of the accepted kinds, or an option does
            not apply to its kind.
    """
    source = _open(str(path), image_size, seed, table)
    if image_size is not None and not isinstance(source, ImageFolderSource):
        raise DataError(
            f"{path}: image_size={tuple(image_size)} resizes images, but this source holds "
            "arrays or table rows; leave it out."
        )
    return source


def _is_table(path: str) -> bool:
    """A glob, or a path named as a CSV or JSONL file."""
    return any(c in path for c in "*?[") or path.lower().endswith((".csv", *JSONL_SUFFIXES))


def _open(
    path: str, image_size: tuple[int, int] | None, seed: int, table: TableOptions | None
) -> Source:
    if table and not _is_table(path):
        raise DataError(
            f"{path}: --label, --text, --pack and --fill-missing apply to CSV files (--label and "
            "--text to JSONL files too), and this source is not one; leave them out."
        )
    if "://" in path:
        raise DataError(
            f"{path}: sources are read from local files; copy it to this machine first "
            "(e.g. gsutil -m cp -r), then write from the local copy."
        )
    if _is_table(path):
        files = sorted(f for f in glob.glob(path) if os.path.isfile(f))
        if not files:
            raise DataError(f"{path}: no file matches this path; expected {ACCEPTED}.")
        kinds = [".csv" if f.lower().endswith(".csv") else
                 ".jsonl" if f.lower().endswith(JSONL_SUFFIXES) else None for f in files]  # fmt: skip
        if all(kind == ".csv" for kind in kinds):
            return CsvSource(path, files, table)
        if all(kind == ".jsonl" for kind in kinds):
            if chat.is_chat(files):
                if table:
                    raise DataError(
                        f"{path}: --label and --text apply to JSONL files of named values, and "
                        "this is chat data (one 'messages' list a line); leave them out."
                    )
                return chat.ChatSource(path, files)
            return JsonlSource(path, files, table)
        other = next((f for f, kind in zip(files, kinds, strict=True) if kind is None), None)
        found = (
            f"{other}, which is not a .csv or .jsonl file"
            if other
            else "both .csv and .jsonl files"
        )
        raise DataError(
            f"{path}: matches {found}; a glob names CSV files or JSONL files (.jsonl, .ndjson), "
            "one kind."
        )
    if os.path.isfile(path) and path.endswith(".npz"):
        return ArraySource(path, npz_arrays(path))
    if os.path.isfile(path) and path.endswith(".npy"):
        return ArraySource(path, [npy_array(path)])
    if os.path.isdir(path):
        npy = sorted(glob.glob(os.path.join(glob.escape(path), "*.npy")))
        if npy:
            return ArraySource(path, [npy_array(f) for f in npy])
        if visible_subfolders(path):
            return ImageFolderSource(path, image_size=image_size, seed=seed)
        raise DataError(
            f"{path}: the folder holds no .npy file and no subfolder; expected {ACCEPTED}."
        )
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or folder; expected {ACCEPTED}.")
    raise DataError(f"{path}: not a kind of source tpurun can write; expected {ACCEPTED}.")
