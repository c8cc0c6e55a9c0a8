"""The shard files of one ``write_dataset``: named, filled, then committed all at once.

A write is all or nothing: shards are written under hidden ``.<name>.partial`` names (which no
``*.tfrecord`` glob matches), renamed once every shard is complete, and the old shards of the
prefix are removed after. Paths are local, gs:// or ram:// (:mod:`tpurun.storage.fileio`), and
records are framed by :mod:`tpurun.data.native.framing`, without TensorFlow.

In a bucket, a shard is uploaded as its writer closes (an object appears whole, or not at all), and
a rename is a server-side copy followed by a delete of the source. Each final shard still appears whole, at once; a kill between the copy and
the delete leaves a ``.partial`` beside it, which the next write to the prefix removes.
"""

from __future__ import annotations

import contextlib
import re

from tpurun.data import schema_file as schema
from tpurun.data.native import framing
from tpurun.errors import DataError
from tpurun.storage import fileio


class ShardSet:
    """One split's shards, filled one after another with contiguous ranges of its records.

    Only one file is open at a time, however many shards, and each is first written as a
    ``.<name>.partial`` file beside its final name.
    """

    def __init__(self, paths: list[str], sizes: list[int], compression: str):
        self.paths, self.sizes, self.compression = paths, sizes, compression
        self.partials = [_partial_path(p) for p in paths]
        self.index, self.count, self.writer = 0, 0, None

    def write(self, record: bytes) -> None:
        if self.writer is None:
            if self.index == len(self.paths):
                raise DataError("the source yielded more records than it counted.")
            self.writer = framing.RecordWriter(self.partials[self.index], self.compression)
        self.writer.write(record)
        self.count += 1
        if self.count == self.sizes[self.index]:
            self.writer.close()
            self.writer, self.index, self.count = None, self.index + 1, 0

    def finish(self) -> list[tuple[str, int, int]]:
        """Check every shard is complete; return ``(path, records, bytes)`` for each."""
        if self.index != len(self.paths):
            raise DataError("the source yielded fewer records than it counted.")
        sizes = [fileio.size(p) for p in self.partials]
        return list(zip(self.paths, self.sizes, sizes, strict=True))

    def abandon(self) -> None:
        """Close and remove whatever this set wrote; used when the write fails."""
        if self.writer is not None:
            with contextlib.suppress(Exception):
                self.writer.close()
            self.writer = None
        for partial in self.partials:
            with contextlib.suppress(Exception):  # the failure being handled matters more
                remove(partial)


def commit(out_prefix: str, folder: str, base: str, shard_sets: list[ShardSet]) -> None:
    """Replace the dataset of this prefix: old schema out, new shards in, old shards out.

    Renames are atomic one file at a time only: a kill between them leaves shards without a schema
    file, which readers handle by counting records.
    """
    new = {basename(path) for s in shard_sets for path in s.paths}
    old = [path for path in files_of(folder, base, partial=False) if basename(path) not in new]
    # The old schema may name shards that the new set reuses with other counts: without a schema,
    # readers count records instead of trusting a wrong number.
    remove(schema.schema_path(out_prefix))
    for shard_set in shard_sets:
        for partial, path in zip(shard_set.partials, shard_set.paths, strict=True):
            fileio.rename(partial, path)
    for path in old:
        remove(path)


def split_prefix(out_prefix: str) -> tuple[str, str]:
    folder, _, base = out_prefix.rpartition("/")
    return folder or ".", base


def basename(path: str) -> str:
    return path.rpartition("/")[2]


def _partial_path(path: str) -> str:
    folder, _, name = path.rpartition("/")
    return f"{folder}/.{name}.partial" if folder else f".{name}.partial"


def refuse_existing(out_prefix: str, folder: str, base: str) -> None:
    """Refuse to replace a dataset the user may not mean to lose: its shards or schema file."""
    if not fileio.isdir(folder):
        return
    found = files_of(folder, base, partial=False)
    schema_file = schema.schema_path(out_prefix)
    if fileio.exists(schema_file):
        found.append(schema_file)
    if found:
        names = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise DataError(
            f"{out_prefix}: a dataset is already written there ({len(found)} file(s): {names}). "
            "Pass --overwrite to replace it, or choose another OUT_PREFIX."
        )


def prepare_folder(folder: str, base: str) -> None:
    """Create the output folder; remove partial shards that a killed write left behind."""
    if not fileio.isdir(folder):
        fileio.makedirs(folder)
    for stale in files_of(folder, base, partial=True):
        remove(stale)


def files_of(folder: str, base: str, *, partial: bool) -> list[str]:
    """The shards (or partial shards) of prefix ``folder/base``, with or without a split."""
    name = rf"{re.escape(base)}(-train|-validation)?-\d{{5,}}-of-\d{{5,}}\.tfrecord"
    pattern = re.compile(rf"\.{name}\.partial" if partial else name)
    stem = fileio.escape(base) + "*"
    listed = fileio.glob(fileio.join(fileio.escape(folder), f".{stem}" if partial else stem))
    return [path for path in listed if pattern.fullmatch(fileio.basename(path))]


def remove(path: str) -> None:
    fileio.remove(path, missing_ok=True)
