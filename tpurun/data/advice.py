"""What ``tpurun data inspect`` advises about a set of TFRecord files: shard count and size, storage
dtypes, record sizes."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from tpurun.data.write import SHARD_MB, SHARD_MULTIPLE, shard_count

_MAX_RECORD_BYTES = 2**31 - 1  # protobuf cannot parse a message larger than this


def format_bytes(size: float) -> str:
    """``1.5 MB``, ``150 MB``: decimal units, as storage consoles show them."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            value = size / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(size)} B"


def _image_like(shape: list[int]) -> list[int] | None:
    """The image shape a raw uint8 tensor may have: its own if [H, W, C], else a square one."""
    if len(shape) == 3 and shape[2] in (1, 3, 4):
        return shape
    for channels in (3, 1):  # a count is never both 3 x a square and a square
        side = math.isqrt(shape[0] // channels) if len(shape) == 1 else 0
        if side >= 8 and side * side * channels == shape[0]:
            return [side, side, channels]
    return None


_SHARD_NAME = re.compile(r"^(.*)-\d{5}-of-(\d{5})(\.[\w.]+)?$")


def _splits(files: Sequence[Any]) -> list[list[Any]]:
    """The files grouped by the set they were written as (``PREFIX-00003-of-00008...``); files
    not named that way are one set."""
    groups: dict[tuple, list[Any]] = {}
    for f in files:
        match = _SHARD_NAME.match(f.path.rsplit("/", 1)[-1])
        groups.setdefault(match.group(1, 2) if match else (), []).append(f)
    return list(groups.values())


def advise(
    files: Sequence[Any],
    compression: str,
    features: Sequence[Any],
    largest_record: int = 0,
) -> list[str]:
    """Actionable lines about sharding, storage dtypes, record sizes and config settings."""
    n, total = len(files), sum(f.bytes for f in files)
    records_total = sum(f.records for f in files)
    # The count `tpurun data write` would write with its defaults, split by split (a glob may
    # match a train and a validation split; each gets its own multiple of 8).
    shards = sum(
        shard_count(
            sum(f.records for f in split), sum(f.bytes for f in split), SHARD_MB, SHARD_MULTIPLE
        )
        for split in _splits(files)
    )
    rewrite = (
        f"rewrite them into {shards} shard{'s' if shards > 1 else ''} of "
        f"~{format_bytes(total / shards)}"
    )
    average = total / n if n else 0
    advice = []
    if compression == "gzip":
        advice.append(
            "the files are GZIP-compressed (data.compression: auto detects it): decompressing "
            "costs host CPU; if `tpurun data bench CONFIG` shows the input is the bottleneck, write "
            "uncompressed shards"
        )
    if not records_total:
        advice.append("the files hold no records: check the glob, or rewrite the data")
    elif n < SHARD_MULTIPLE and shards > n:
        advice.append(
            f"{n} file{'s' if n > 1 else ''}: use a multiple of 8 shards (one stream per TPU "
            f"core) so every core reads its own file in parallel; {rewrite}"
        )
    elif average < 10**7 and n > shards:
        advice.append(
            f"{n} files average {format_bytes(average)}: too many small files (each open is a "
            f"request, slow on gs://); {rewrite} (100-200 MB is the target)"
        )
    elif n % SHARD_MULTIPLE and shards != n:
        advice.append(
            f"{n} files is not a multiple of 8: TPU cores and hosts get uneven shares; {rewrite}"
        )
    if average > 10**9:
        advice.append(
            f"files average {format_bytes(average)}: too few and too large to stream in parallel "
            f"and shuffle well; target 100-200 MB per shard: {rewrite}"
        )
    for f in features:
        spec = f.spec or {}
        if spec.get("type") == "raw" and spec.get("dtype") == "float64":
            advice.append(
                f"feature '{f.name}' is stored as raw float64: write it as float32 (half the bytes "
                "to store and read) unless the model needs the precision"
            )
        elif spec.get("type") == "raw" and spec.get("dtype") == "uint8" and not spec.get("cast"):
            image = _image_like(spec["shape"])
            if image:
                advice.append(
                    f"feature '{f.name}' (raw uint8) may be an image of shape {image}: uint8 is "
                    "fine to store (4x smaller than float32); add `cast: float32`, or cast and "
                    "scale in the model"
                )
    # File size / records is a floor for the largest record (compressed sizes even more so).
    largest = max([largest_record, *(f.bytes / f.records for f in files if f.records)])
    if largest > _MAX_RECORD_BYTES:
        advice.append(
            f"records reach {format_bytes(largest)}: a record over 2 GB cannot be parsed "
            "(TensorFlow fails with 'Unable to parse tensor proto'); split each example into "
            "several records"
        )
    return advice
