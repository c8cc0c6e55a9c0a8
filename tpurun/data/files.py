"""Which TFRecord files a glob names, their sizes, and how they are compressed.

Questions about the files, asked long before (and often without) any dataset: by ``resolve``,
``data inspect``, ``data bench``, doctor and the loaders of ``evaluate``/``predict``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tpurun.errors import DataError
from tpurun.storage import fileio

_COMPRESSION = {"none": "", "gzip": "GZIP"}


@dataclass(frozen=True)
class PathRule:
    """Where a relative local path is read from, and how a message says so. Absolute and
    ``scheme://`` paths stay as they are."""

    base: str
    says: str  # "the config file's folder", "the working directory", ...

    def __call__(self, path: str) -> str:
        if "://" in path or os.path.isabs(path):
            return path
        return os.path.join(self.base, path)


def working_directory() -> PathRule:
    """The rule of a path given on the command line."""
    return PathRule(os.getcwd(), "the working directory")


def expand(patterns: str | Sequence[str], rule: PathRule | None = None, key: str = "") -> list[str]:
    """Expand globs (local, gs://, ram://) into a sorted file list; folders are left out.

    Args:
        patterns: a glob or several.
        rule: how a relative local glob becomes a path (default: from the working directory);
            a glob that matches nothing says which rule applied.
        key: what to call the globs in messages (``data.train``, ``--data``).

    Raises:
        DataError: when a glob matches no file, naming the glob.
        StorageError: a gs:// glob cannot be listed (storage unreachable, no permission, no such
            bucket), naming the bucket and the fix.
    """
    rule = rule or working_directory()
    files: list[str] = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        path = rule(pattern)
        matched = fileio.glob(path, files_only=True)
        if not matched:
            hint = ""
            if path != pattern:
                hint = f" '{pattern}' is relative: it is read from {rule.says}, {rule.base}."
            where = f"{key}: " if key else ""
            raise DataError(f"{where}{path}: no file matches this glob.{hint}")
        files.extend(sorted(matched))
    return list(dict.fromkeys(files))


def sizes(files: Sequence[str]) -> list[int]:
    """Each file's size in bytes, asked several at a time (one request each in a bucket)."""
    if not files:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(files))) as pool:
        return list(pool.map(fileio.size, files))


def detect_compression(path: str) -> str:
    """GZIP files start with 1f 8b; TFRecord files start with a record length and its CRC."""
    with fileio.open_binary(path) as f:
        return "gzip" if f.read(3) == b"\x1f\x8b\x08" else "none"  # magic + deflate


def resolve_compression(compression: str, files: Sequence[str]) -> str:
    """data.compression as "none" or "gzip": "auto" is read from the first file."""
    if compression == "auto":
        return detect_compression(files[0]) if files else "none"
    return compression


def compression_type(compression: str, files: Sequence[str]) -> str:
    """TF's ``compression_type`` ("" or "GZIP") for data.compression, "auto" read from a file."""
    return _COMPRESSION[resolve_compression(compression, files)]
