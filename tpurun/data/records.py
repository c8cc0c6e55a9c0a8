"""What a set of TFRecord files is: which files, compressed how, how many records, damaged or not.

``resolve`` (for ``train``, ``config`` and ``data bench``), ``data inspect``, doctor and the
fault path of ``training`` ask these questions; ``pipeline`` only builds datasets from the
answers. Which files and how they are compressed is :mod:`tpurun.data.files`.

Reading a file to its end is the only way to count its records and to find damage, so both come
from one pass (``verify``), and its verdicts are cached by path, size and mtime in
``~/.cache/tpurun/record_counts.json`` (or ``$TPURUN_CACHE_DIR``): a file is read once ever.
In a bucket, an object rewritten in place gets a new modification time (each upload is a new
generation, stamped when it completes), so its old verdict no longer matches and it is read again.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from tpurun.data import decode as feat
from tpurun.data import schema_file as schema_lib
from tpurun.data.files import resolve_compression, sizes
from tpurun.data.native import framing
from tpurun.errors import DataError
from tpurun.storage import fileio

#: Cache keys of damaged files: this prefix + the file's key, so an older tpurun reading the same
#: cache finds no count for them and reads the file itself.
_DAMAGED = "damaged|"
_COUNT_BATCH = 8  # files read together between two progress reports


# ------------------------------------------------------------------------------------- damage
@dataclass
class CorruptShard:
    """A TFRecord file that cannot be read to its end.

    Attributes:
        path: the file.
        offset: where the first unreadable record starts, in bytes of the file (of its
            decompressed data when ``compression`` is "gzip"); None when the reader cannot tell.
        good_records: the records read before the damage.
        records: the records lost by skipping the file: the schema's count for it when known,
            else ``good_records + 1``.
        reason: what is wrong, e.g. "truncated record".
        split: "train" or "validation", set by ``check_split``; "" until then.
        compression: "none" or "gzip", which says what ``offset`` counts.
    """

    path: str
    offset: int | None
    good_records: int
    records: int
    reason: str
    split: str = ""
    compression: str = "none"

    @classmethod
    def from_damage(cls, damage: framing.DamagedRecord) -> CorruptShard:
        """The shard of a damaged record that the reader met (one more record than the good
        ones is lost, as far as it can tell)."""
        return cls(
            damage.path,
            damage.offset,
            damage.index,
            damage.index + 1,
            damage.reason,
            compression=damage.compression,
        )

    def problem(self) -> str:
        """``truncated record at byte 1662, after 19 good records``."""
        return framing.where_damaged(self.reason, self.offset, self.good_records, self.compression)

    def describe(self) -> str:
        """One warning sentence for a shard that data.skip_corrupt left out."""
        split = f"{self.split} " if self.split else ""
        return (
            f"skipped corrupt {split}shard {self.path}: {self.problem()}; "
            f"{_plural(self.records, 'record')} left out."
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, for ``summary.json``."""
        return asdict(self)


def corrupt_error(shards: Sequence[CorruptShard]) -> DataError:
    """The error for damaged files when data.skip_corrupt is off: the first one, and how many more."""
    first, more = shards[0], [s.path for s in shards[1:]]
    also = ""
    if more:
        names = ", ".join(more[:3]) + (", ..." if len(more) > 3 else "")
        also = f" {_plural(len(more), 'more file')} cannot be read either: {names}."
    it, them = ("them", "the files") if more else ("it", "the file")
    return DataError(
        f"{first.path}: cannot read it as TFRecords: {first.problem()}.{also} Re-copy or re-write "
        f"{them}, or set data.skip_corrupt: true to skip {it}."
    )


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _unreadable(path: str, exc: OSError, how: str = "") -> DataError:
    """A local file that cannot be read (no permission, a folder, gone)."""
    reason = exc.strerror or str(exc)
    return DataError(f"{path}: cannot read it{' ' + how if how else ''}: {reason}.")


# --------------------------------------------------------------------------- reading through
def _cache_file() -> Path:
    return Path(fileio.user_cache()) / "record_counts.json"


def _file_key(path: str) -> str:
    return f"{path}|{fileio.size(path)}|{fileio.mtime(path)!r}"


def _count_one(path: str, compression: str) -> int | CorruptShard:
    """Read one file to its end, checking every record: its record count, or where it is damaged.

    Raises:
        DataError: the file cannot be read for another reason than damage (permissions, ...).
        StorageError: a remote file cannot be read (unreachable, no permission).
    """
    try:
        verdict = framing.scan(path, resolve_compression(compression, [path]))
    except OSError as exc:
        raise _unreadable(path, exc) from None
    if isinstance(verdict, framing.DamagedRecord):
        return CorruptShard.from_damage(verdict)
    return verdict[0]


def verify(
    files: Sequence[str], compression: str = "auto", *, reread: bool = False
) -> list[int | CorruptShard]:
    """Each file's record count, or its damage, in order.

    Reads only files not read before (``reread``: all of them), several at a time: verdicts are
    cached by path, size and mtime.
    """
    cache_path = _cache_file()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    keys = {path: _file_key(path) for path in files}
    found: dict[str, int | CorruptShard] = {}
    for path in [] if reread else files:
        damage, count = cache.get(_DAMAGED + keys[path]), cache.get(keys[path])
        if isinstance(damage, dict):
            with contextlib.suppress(TypeError):  # an entry from another tpurun version
                found[path] = CorruptShard(path, **damage)
                continue
        if isinstance(count, int):
            found[path] = count
    missing = [p for p in dict.fromkeys(files) if p not in found]
    if missing:
        with ThreadPoolExecutor(max_workers=min(8, len(missing))) as pool:
            verdicts = pool.map(lambda p: _count_one(p, compression), missing)
            for path, verdict in zip(missing, verdicts, strict=True):
                found[path] = verdict
                if isinstance(verdict, CorruptShard):
                    cache.pop(keys[path], None)
                    damage = verdict.to_dict()
                    del damage["path"], damage["split"]
                    cache[_DAMAGED + keys[path]] = damage
                else:
                    cache.pop(_DAMAGED + keys[path], None)
                    cache[keys[path]] = verdict
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_path)
        except OSError:
            pass  # a read-only home only costs a recount next time
    return [found[p] for p in files]


def count_records(files: Sequence[str], compression: str = "auto") -> int:
    """Count records, reading each file once ever (see ``verify``).

    Raises:
        DataError: a file is corrupt or truncated, naming it, the offset and the good records.
    """
    return sum(record_counts(files, {}, compression)[0])


def record_counts(
    files: Sequence[str],
    schemas: Mapping[str, tuple[str, dict]],
    compression: str = "auto",
    *,
    known: Mapping[str, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[int], bool]:
    """Each file's record count, and whether they all came from schema files.

    The schema files' counts are used when they list every file: a schema naming only some of
    them is from another write in the same folder. Counts in ``known`` (read just now) win over a
    schema's, which may be older. Other files are read (once ever, see ``verify``).

    Args:
        files: the files, in order.
        schemas: ``schema.find_for(files)``; ``{}`` to count by reading.
        compression: "none", "gzip" or "auto".
        known: counts already read, by path.
        progress: called as ``progress(files_done, files_total)`` while files are read.

    Raises:
        DataError: a file read is corrupt or truncated (every damaged one is named).
    """
    counts = dict(known or {})
    listed = [schema_lib.record_count(schemas[f][1], f) if f in schemas else None for f in files]
    if files and all(n is not None for n in listed):
        return [counts.get(f, n) for f, n in zip(files, listed, strict=True)], True
    to_read = [f for f in dict.fromkeys(files) if f not in counts]
    damaged: list[CorruptShard] = []
    # Without progress to report, one ``verify`` reads every file in parallel and writes the
    # cache once.
    batch = _COUNT_BATCH if progress is not None else max(1, len(to_read))
    for start in range(0, len(to_read), batch):
        chunk = to_read[start : start + batch]
        for done, (path, verdict) in enumerate(zip(chunk, verify(chunk, compression), strict=True)):
            if isinstance(verdict, CorruptShard):
                damaged.append(verdict)
            else:
                counts[path] = verdict
            if progress is not None:
                progress(start + done + 1, len(to_read))
    if damaged:
        raise corrupt_error(damaged)
    return [counts[f] for f in files], False


def find_corrupt(files: Sequence[str], compression: str) -> list[CorruptShard]:
    """Read every file through again and return the damaged ones, in order.

    For naming the culprit after TF failed mid-training with a ``DataLossError``, which does not
    say which file it was reading. Cached verdicts are not trusted here: a file damaged in place
    keeps its size and mtime.
    """
    verdicts = verify(files, compression, reread=True)
    return [v for v in verdicts if isinstance(v, CorruptShard)]


def check_first_record(files: Sequence[str], features: Mapping[str, Any], compression: str) -> None:
    """Fail early, with a clear message, when the records do not match the declared features."""
    try:
        records = framing.iter_records(files[0], resolve_compression(compression, files))
        first = next(records, None)
        records.close()
    except framing.DamagedRecord as damage:
        raise corrupt_error([CorruptShard.from_damage(damage)]) from None
    except OSError as exc:
        raise _unreadable(files[0], exc, "as TFRecords") from None
    if first is None:
        raise DataError(f"{files[0]}: the file holds no records.")
    feat.check_record(first, features, files[0])


# ------------------------------------------------------------------------------ one data split
@dataclass
class CheckedSplit:
    """One split's files once checked: those to read, their records, and those left out."""

    files: list[str]
    records: int
    from_schema: bool  # every count came from a schema file
    skipped: list[CorruptShard]
    counts: list[int] = field(default_factory=list)  # per file, as ``files``


def check_split(
    files: Sequence[str],
    split: str,
    schemas: Mapping[str, tuple[str, dict]],
    features: Mapping[str, Any],
    compression: str,
    *,
    skip_corrupt: bool,
) -> CheckedSplit:
    """Find damaged files, check the first record against the features, count the records.

    Damaged files are found by reading: every file with ``skip_corrupt`` (which then leaves them
    out), else the files whose size disagrees with their schema file and those counted by reading.

    Args:
        files: the split's files (``expand``-ed).
        split: "train" or "validation", the data.<split> key named in messages.
        schemas: ``schema.find_for(files)``.
        features: the effective data.features.
        compression: "none" or "gzip" (already resolved from "auto").
        skip_corrupt: data.skip_corrupt.

    Raises:
        DataError: unreadable, corrupt or truncated files (with ``skip_corrupt``: only when every
            file is), or a first record that does not match the features.
    """
    to_read = list(files) if skip_corrupt else _size_mismatches(files, schemas)
    counts: dict[str, int] = {}
    damaged: list[CorruptShard] = []
    for path, verdict in zip(to_read, verify(to_read, compression), strict=True):
        listed = schema_lib.record_count(schemas[path][1], path) if path in schemas else None
        if isinstance(verdict, int) and listed is not None and verdict < listed:
            # Cut at a record boundary: readable, but records are missing.
            schema_name = PurePosixPath(schemas[path][0]).name
            reason = f"the file ends early ({schema_name} lists {listed} records)"
            verdict = CorruptShard(path, None, verdict, listed, reason, compression=compression)
        if isinstance(verdict, int):
            counts[path] = verdict
            continue
        verdict.split = split
        if listed is not None:
            verdict.records = listed
        damaged.append(verdict)
    if damaged and not skip_corrupt:
        raise corrupt_error(damaged)
    bad = {s.path for s in damaged}
    kept = [f for f in files if f not in bad]
    if files and not kept:
        raise DataError(
            f"data.{split}: all {len(files)} files are corrupt or truncated, so "
            f"data.skip_corrupt leaves nothing to read; the first, {damaged[0].path}: "
            f"{damaged[0].problem()}. Re-copy or re-write the files."
        )
    check_first_record(kept, features, compression)
    record_list, from_schema = record_counts(kept, schemas, compression, known=counts)
    return CheckedSplit(kept, sum(record_list), from_schema, damaged, list(record_list))


def _size_mismatches(files: Sequence[str], schemas: Mapping[str, tuple[str, dict]]) -> list[str]:
    """The files whose size differs from the one their schema file lists: cut short, likely."""
    listed = {f: schema_lib.shard_bytes(schemas[f][1], f) for f in files if f in schemas}
    listed = {f: size for f, size in listed.items() if size is not None}
    if not listed:
        return []
    actual = dict(zip(listed, sizes(list(listed)), strict=True))
    return [f for f in files if f in listed and actual[f] != listed[f]]
