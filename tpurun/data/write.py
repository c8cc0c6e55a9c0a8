"""Writing ``tf.train.Example`` records: ``tpurun data write``, the example data generators, tests.

``write_dataset`` turns a source (arrays, CSV, an image folder: see ``sources`` and ``tabular``)
into TFRecord shards and a schema file, holding one chunk of records in memory at a time. A write
is all or nothing (``shards``), and the schema file comes last.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tpurun.data import schema_file as schema
from tpurun.data import shards
from tpurun.data.native import example, framing
from tpurun.data.sources import Source, open_source
from tpurun.data.sources.columns import TableOptions, table_options
from tpurun.data.statistics import Statistics
from tpurun.errors import DataError, TpurunError


def example_bytes(record: Mapping[str, Any]) -> bytes:
    """Serialize one record as a ``tf.train.Example`` (see :func:`tpurun.data.native.example.serialize`).

    ``bytes``/``str`` (or lists of them) become a bytes_list; integer values or arrays become an
    int64_list; float values or arrays become a float_list. Encode a ``raw`` feature yourself with
    ``array.astype(dtype).tobytes()``.
    """
    return example.serialize(record)


def write_shards(
    prefix: str, records: Iterable[Mapping[str, Any]], num_shards: int, compression: str = "none"
) -> list[str]:
    """Write records round-robin into ``<prefix>-00000-of-0000N.tfrecord`` shards.

    Returns:
        The shard paths, in order.
    """
    paths = schema.shard_names(prefix, None, num_shards)
    writers = [framing.RecordWriter(p, compression) for p in paths]
    try:
        for i, record in enumerate(records):
            writers[i % num_shards].write(example_bytes(record))
    finally:
        for w in writers:
            w.close()
    return paths


# ------------------------------------------------------------------------------ tpurun data write
#: The most bytes of records one chunk holds, whatever ``chunk_records`` asks (large images).
CHUNK_BYTES = 256 * 2**20
#: Defaults of ``tpurun data write``, which ``data inspect`` advises too: shards of 100-200 MB
#: stream well, and a multiple of 8 gives each core of a TPU host its own files.
SHARD_MB = 150.0
SHARD_MULTIPLE = 8
_MB = 10**6


@dataclass
class WriteReport:
    """What ``write_dataset`` wrote.

    Attributes:
        schema_path: the schema file, ``<OUT_PREFIX>.schema.json``.
        source: the source as given.
        features: ``{name: feature spec}``, as a config's ``data.features`` takes them, in the
            source's column order.
        class_names: the class of each label value (image folders, a CSV's text label), else None.
        splits: ``{split: [(shard path, records, bytes), ...]}``; the split is "all" when the
            records were not split, else "train" and "validation".
        compression: "none" or "gzip".
        records: the records written, in all splits.
        seconds: how long the whole write took.
        layout: for CSV sources, the label, packed columns and fills (as in the schema file).
        warnings: what the user should know of how the source was read.
    """

    schema_path: str
    source: str
    features: dict[str, dict[str, Any]]
    class_names: list[str] | None
    splits: dict[str, list[tuple[str, int, int]]]
    compression: str
    records: int
    seconds: float
    layout: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, for ``--json``."""
        report = asdict(self)
        report["splits"] = {
            split: [{"path": path, "records": n, "bytes": size} for path, n, size in written]
            for split, written in self.splits.items()
        }
        return report


def write_dataset(
    source: str | os.PathLike | Source,
    out_prefix: str,
    *,
    shard_mb: float = SHARD_MB,
    shard_multiple: int = SHARD_MULTIPLE,
    compression: str = "none",
    validation_fraction: float = 0.0,
    seed: int = 0,
    image_size: tuple[int, int] | None = None,
    chunk_records: int = 4096,
    progress: Callable[[int, int], None] | None = None,
    label: str | None = None,
    pack: Mapping[str, Sequence[str] | None] | Sequence[str] | None = None,
    fill_missing: float | str | None = None,
    overwrite: bool = False,
    text: Sequence[str] | None = None,
    map_source: Callable[[Source], Source] | None = None,
) -> WriteReport:
    """Write a source as TFRecord shards plus ``<out_prefix>.schema.json``.

    A dataset already written under ``out_prefix`` is replaced only with ``overwrite``. An
    interrupted write (an error, Ctrl-C) removes its partial files, so that dataset, if any, stays
    as it was.

    Args:
        source: a .npz/.npy file, a folder of .npy files, CSV file(s), an image folder (see
            ``sources.open_source``), or an opened ``Source``.
        out_prefix: shards are ``<out_prefix>[-<split>]-00000-of-00008.tfrecord``; local, gs://
            or ram://.
        shard_mb, shard_multiple: the target size of a shard in MB (10^6 bytes), estimated from
            the source; each split's shard count is a multiple of ``shard_multiple``, so that hosts
            and cores read equal shares (a split with fewer records is one shard).
        compression: "none" or "gzip".
        validation_fraction, seed: this fraction of the records, drawn with ``seed``, is written
            as a "validation" split and the rest as "train"; 0 writes a single split, "all".
            ``seed`` also shuffles an image folder's file order.
        image_size: ``(height, width)`` to re-encode images at (JPEG quality 95, PNG stays PNG).
        chunk_records, progress: records held at a time (fewer past ``CHUNK_BYTES``), and
            ``progress(records_done, records_total)`` called after each chunk.
        label, pack, fill_missing, text: CSV and JSONL options (``sources.columns``).
        overwrite: replace the shards and schema file of a dataset written under this prefix.
        map_source: applied to the opened source before anything is written: a
            ``sources.base.MappedSource`` that changes its records (``--tokenize``'s token ids).

    Returns:
        What was written, where.

    Raises:
        DataError: the source cannot be read, holds no record, has missing values without a fill,
            or changed while being read; or ``out_prefix`` holds a dataset and not ``overwrite``.
        TpurunError: an option is out of range.
        StorageError: a gs:// ``out_prefix`` cannot be written (unreachable, no permission, no
            such bucket).
    """
    started = time.monotonic()
    _check_options(
        out_prefix,
        shard_mb,
        shard_multiple,
        compression,
        validation_fraction,
        chunk_records,
        image_size,
    )
    if not overwrite:
        _refuse_existing(out_prefix)
    table = table_options(label, pack, fill_missing, text)
    source = _opened(source, image_size, seed, table, map_source)
    is_validation = split_mask(source.records, validation_fraction, seed)
    is_validation = _split_of(source, is_validation)
    shard_sets = _shard_sets(
        source, out_prefix, is_validation, shard_mb, shard_multiple, compression
    )
    splits, statistics = _committed(
        source, out_prefix, shard_sets, is_validation, chunk_records, progress
    )
    schema_path = _write_schema(source, out_prefix, splits, compression, statistics)
    return _report(source, schema_path, splits, compression, time.monotonic() - started)


def _refuse_existing(out_prefix: str) -> None:
    """Refuse to write over a dataset already written under ``out_prefix``.

    Raises:
        DataError: ``out_prefix`` holds a dataset, or its local folder cannot be read.
    """
    folder, base = shards.split_prefix(out_prefix)
    with _writing_to(out_prefix):
        shards.refuse_existing(out_prefix, folder, base)


def _report(
    source: Source, schema_path: str, splits: dict, compression: str, seconds: float
) -> WriteReport:
    """What was written from ``source``, for the caller and ``--json``."""
    return WriteReport(
        schema_path=schema_path,
        source=source.path,
        features=source.features,
        class_names=source.class_names,
        splits=splits,
        compression=compression,
        records=source.records,
        seconds=seconds,
        layout=dict(source.layout),
        warnings=list(source.warnings),
    )


def _opened(
    source: Any, image_size: Any, seed: int, table: TableOptions, map_source: Any = None
) -> Source:
    """The source, opened from its path with the table options, or as it was given; then
    through ``map_source`` when there is one."""
    if isinstance(source, (str, os.PathLike)):
        opened = open_source(os.fspath(source), image_size=image_size, seed=seed, table=table)
        if map_source is None and opened.layout.get("chat"):
            raise DataError(
                f"{opened.path}: chat data becomes tokens only through a preset's chat format: "
                "write it with `tpurun data write SOURCE OUT_PREFIX --tokenize PRESET "
                "--sequence-length N`."
            )
        return opened if map_source is None else map_source(opened)
    if map_source is not None:
        return map_source(_opened(source, image_size, seed, table))
    if table:
        raise TpurunError(
            "label, pack, fill_missing and text apply when the source is a CSV or JSONL path; an "
            "opened Source lays out its own features."
        )
    return source


def _split_of(source: Source, is_validation: Any) -> Any:
    """The source told the split (a CSV's mean fill: of the train split only), and the split
    of the records it yields: a packing source yields fewer train records than it was drawn
    over, several examples in each."""
    written = source.use_split(is_validation)
    return is_validation if written is None else written


def _shard_sets(
    source: Source,
    out_prefix: str,
    is_validation: Any,
    shard_mb: float,
    shard_multiple: int,
    compression: str,
) -> dict[str, shards.ShardSet]:
    """Each split's shards, named and sized: ``all``, or ``train`` and ``validation``."""
    total = source.records
    if is_validation is None:
        split_records = {"all": total}
    else:
        n_validation = int(is_validation.sum())
        split_records = {"train": total - n_validation, "validation": n_validation}
    shard_sets = {}
    for split, records in split_records.items():
        count = shard_count(records, source.nbytes * records / total, shard_mb, shard_multiple)
        paths = schema.shard_names(out_prefix, None if split == "all" else split, count)
        shard_sets[split] = shards.ShardSet(paths, balanced_sizes(records, count), compression)
    return shard_sets


def _write_schema(
    source: Source, out_prefix: str, splits: dict, compression: str, statistics: dict | None
) -> str:
    """``<out_prefix>.schema.json``, written last: the dataset is complete once it is there."""
    schema_file = schema.schema_path(out_prefix)
    schema.write(
        schema_file,
        schema.make(
            source.features,
            {
                split: {shards.basename(path): n for path, n, _ in written}
                for split, written in splits.items()
            },
            compression=compression,
            class_names=source.class_names,
            source=source.path,
            shard_bytes={
                split: {shards.basename(path): size for path, _, size in written}
                for split, written in splits.items()
            },
            layout=source.layout,
            statistics=statistics,
        ),
    )
    return schema_file


@contextlib.contextmanager
def _writing_to(out_prefix: str):
    """A local folder that cannot be written as a DataError naming ``out_prefix`` (a bucket's
    failures are StorageErrors already: unreachable, no permission, no such bucket)."""
    try:
        yield
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename else ""
        raise DataError(f"{out_prefix}: cannot write the shards there: {reason}{where}.") from None


def _committed(
    source: Source,
    out_prefix: str,
    shard_sets: dict[str, shards.ShardSet],
    is_validation: Any,
    chunk_records: int,
    progress: Callable[[int, int], None] | None,
) -> tuple[dict[str, list[tuple[str, int, int]]], dict[str, Any] | None]:
    """Write every record of ``source`` into its split's shards, in chunks of at most
    ``chunk_records`` (fewer past ``CHUNK_BYTES``), then commit them under ``out_prefix``; an
    interrupted write (an error, Ctrl-C) abandons the partial files.

    Returns:
        Each split's shards written (path, records, bytes), and the statistics of
        :func:`_write_records` as the schema file holds them.
    """
    chunk_size = max(1, min(chunk_records, CHUNK_BYTES * source.records // max(1, source.nbytes)))
    folder, base = shards.split_prefix(out_prefix)
    committed = False
    try:
        with _writing_to(out_prefix):
            shards.prepare_folder(folder, base)
            stats = _write_records(source, shard_sets, is_validation, chunk_size, progress)
            splits = {split: shard_set.finish() for split, shard_set in shard_sets.items()}
            shards.commit(out_prefix, folder, base, list(shard_sets.values()))
        committed = True
    finally:
        if not committed:
            for shard_set in shard_sets.values():
                shard_set.abandon()
    return splits, stats.to_schema("all" if is_validation is None else "train")


def _write_records(source, shard_sets, is_validation, chunk_size, progress) -> Statistics:
    """Serialize every record of ``source`` into the shard set of its split.

    Returns:
        The numeric features' statistics, of the train split only (of every record when there is
        no split): statistics of the validation records would leak them into a model.
    """
    stats = Statistics(source.features, tokenized=source.layout.get(schema.TOKENIZED))
    done = 0
    changed = "did the source change during the write? Write it again."
    for chunk in source.chunks(chunk_size):
        columns = list(chunk.items())
        rows = len(columns[0][1])
        if done + rows > source.records:
            raise DataError(
                f"{source.path}: more than the {source.records} records counted; {changed}"
            )
        stats.update(chunk, None if is_validation is None else ~is_validation[done : done + rows])
        for i in range(rows):
            record = example_bytes({name: column[i] for name, column in columns})
            if is_validation is None:
                shard_sets["all"].write(record)
            elif is_validation[done + i]:
                shard_sets["validation"].write(record)
            else:
                shard_sets["train"].write(record)
        done += rows
        if progress is not None:
            progress(done, source.records)
    if done != source.records:
        raise DataError(
            f"{source.path}: {done} records, not the {source.records} counted; {changed}"
        )
    return stats


def _check_options(
    out_prefix, shard_mb, shard_multiple, compression, fraction, chunk_records, image_size
):
    problems = [
        (not out_prefix or out_prefix.endswith("/"), f"out_prefix={out_prefix!r}",
         "a path prefix such as data/flowers (shards are named <prefix>-00000-of-00008.tfrecord)"),
        (not shard_mb > 0, f"shard_mb={shard_mb}", "a size in MB greater than 0"),
        (shard_multiple < 1, f"shard_multiple={shard_multiple}", "an integer >= 1"),
        (compression not in ("none", "gzip"), f"compression={compression!r}", "'none' or 'gzip'"),
        (not 0 <= fraction < 1, f"validation_fraction={fraction}", "a fraction in [0, 1)"),
        (chunk_records < 1, f"chunk_records={chunk_records}", "an integer >= 1"),
        (image_size is not None and (len(image_size) != 2 or min(image_size) < 1),
         f"image_size={image_size}", "(height, width), both >= 1"),
    ]  # fmt: skip
    for bad, received, expected in problems:
        if bad:
            raise TpurunError(f"Invalid option {received}. Expected {expected}.")


# ----------------------------------------------------------------------------- sizes and splits
def split_mask(records: int, fraction: float, seed: int):
    """Which records go to validation: ``round(records * fraction)`` of them (at least one).

    Returns:
        A bool array over the record indices, drawn by a permutation seeded with ``seed``; None
        when ``fraction`` is 0.

    Raises:
        DataError: the split would leave no training record.
    """
    import numpy as np

    if fraction <= 0:
        return None
    n_validation = max(1, round(records * fraction))
    if n_validation >= records:
        raise DataError(
            f"validation_fraction={fraction} of {records} records leaves no training record; "
            "lower it or write more records."
        )
    mask = np.zeros(records, bool)
    mask[np.random.default_rng(seed).permutation(records)[:n_validation]] = True
    return mask


def shard_count(records: int, nbytes: float, shard_mb: float, multiple: int) -> int:
    """Shards of about ``shard_mb`` each, a multiple of ``multiple``, and none empty.

    At least ``multiple`` shards, except that fewer records than ``multiple`` make one shard: a
    shard per record would only add files, and no host split of them can be even anyway.
    """
    if records < multiple:
        return 1
    wanted = max(1, math.ceil(nbytes / (shard_mb * _MB)))
    return min(math.ceil(wanted / multiple) * multiple, records // multiple * multiple)


def balanced_sizes(records: int, shards: int) -> list[int]:
    """Records per shard for contiguous ranges whose sizes differ by at most one."""
    return [(k + 1) * records // shards - k * records // shards for k in range(shards)]
