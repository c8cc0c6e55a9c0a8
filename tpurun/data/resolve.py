"""From a config's ``data`` section to concrete files, features, compression and record counts.

Shared by ``tpurun train``, ``tpurun config`` and ``tpurun data bench``; checks the data before
anything is written.
"""

from __future__ import annotations

import importlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from tpurun.config import Config, DataConfig, reference_problems
from tpurun.data import pipeline
from tpurun.data import schema as schema_lib
from tpurun.errors import ConfigError, DataError


@dataclass
class ResolvedData:
    """The data a run reads: the effective ``data`` section (features filled, compression known).

    With data.skip_corrupt, damaged files are left out of the file lists and the counts, and
    listed in ``skipped``.
    """

    data: DataConfig
    train_files: list[str]
    validation_files: list[str]
    train_records: int
    validation_records: int | None
    counts_from: str  # "schema" | "counted"
    schema_files: list[str] = field(default_factory=list)
    skipped: list[pipeline.CorruptShard] = field(default_factory=list)


def kaggle_root(name: str) -> str:
    """The path of a Kaggle dataset: ``gs://...`` on TPU nodes, ``/kaggle/input/...`` on TPU VMs.

    Raises:
        DataError: outside a Kaggle notebook, where ``kaggle_datasets`` does not exist.
    """
    try:
        module = importlib.import_module("kaggle_datasets")
    except ImportError:
        raise DataError(
            f"data.kaggle_dataset: '{name}' needs the kaggle_datasets module, which only Kaggle "
            "notebooks have. Elsewhere, download the dataset and point data.train at its files."
        ) from None
    try:
        return str(module.KaggleDatasets().get_gcs_path(name)).rstrip("/")
    except Exception as exc:  # Kaggle's client raises its own types
        raise DataError(
            f"data.kaggle_dataset: Kaggle could not resolve '{name}': {exc}. Add the dataset to "
            "the notebook (Add Data); a private one on a TPU also needs the Google Cloud SDK add-on."
        ) from None


def _resolver(config: Config):
    name = config.data.kaggle_dataset
    if not name:
        return config.resolve_path
    root = kaggle_root(name)
    return lambda path: path if "://" in path or path.startswith("/") else f"{root}/{path}"


def _counts(
    files: list[str], schemas: dict, compression: str, read: dict[str, int]
) -> tuple[int, bool]:
    """Records in ``files``: from the schema files when they list them all, else counted.

    ``read`` holds counts already read; they win over a schema's (which may be older).
    """
    listed = [schema_lib.record_count(schemas[f][1], f) if f in schemas else None for f in files]
    if files and all(n is not None for n in listed):
        return sum(read.get(f, n) for f, n in zip(files, listed, strict=True)), True
    if all(f in read for f in files):
        return sum(read[f] for f in files), False
    return pipeline.count_records(files, compression), False


def _size_mismatches(files: list[str], schemas: dict) -> list[str]:
    """The files whose size differs from the one their schema file lists: cut short, likely."""
    import tensorflow as tf

    listed = {f: schema_lib.shard_bytes(schemas[f][1], f) for f in files if f in schemas}
    listed = {f: size for f, size in listed.items() if size is not None}
    if not listed:
        return []
    with ThreadPoolExecutor(max_workers=min(8, len(listed))) as pool:
        sizes = dict(
            zip(listed, pool.map(lambda f: tf.io.gfile.stat(f).length, listed), strict=True)
        )
    return [f for f in files if f in listed and sizes[f] != listed[f]]


def _check_files(
    files: list[str], split: str, schemas: dict, compression: str, *, read_all: bool
) -> tuple[dict[str, int], list[pipeline.CorruptShard]]:
    """Read the files that need it: their counts, and the damaged ones in file order.

    With data.skip_corrupt (``read_all``) every file is read through (once ever: the verdict is
    cached); otherwise only the files whose size disagrees with their schema file, since the
    others are counted by reading them anyway, or trusted to the schema.
    """
    to_read = files if read_all else _size_mismatches(files, schemas)
    counts: dict[str, int] = {}
    damaged: list[pipeline.CorruptShard] = []
    for path, verdict in zip(to_read, pipeline.verify(to_read, compression), strict=True):
        listed = schema_lib.record_count(schemas[path][1], path) if path in schemas else None
        if isinstance(verdict, int) and listed is not None and verdict < listed:
            # Cut at a record boundary: readable, but records are missing.
            schema_name = PurePosixPath(schemas[path][0]).name
            reason = f"the file ends early ({schema_name} lists {listed} records)"
            verdict = pipeline.CorruptShard(
                path, None, verdict, listed, reason, compression=compression
            )
        if isinstance(verdict, int):
            counts[path] = verdict
            continue
        verdict.split = split
        if listed is not None:
            verdict.records = listed
        damaged.append(verdict)
    return counts, damaged


def _drop_damaged(files: list[str], damaged: list[pipeline.CorruptShard], key: str) -> list[str]:
    """The files left once data.skip_corrupt drops the damaged ones; never none."""
    bad = {s.path for s in damaged}
    kept = [f for f in files if f not in bad]
    if files and not kept:
        first = damaged[0]
        raise DataError(
            f"data.{key}: all {len(files)} files are corrupt or truncated, so data.skip_corrupt "
            f"leaves nothing to read; the first, {first.path}: {first.problem()}. Re-copy or "
            "re-write the files."
        )
    return kept


def resolve(config: Config) -> ResolvedData:
    """Expand globs, read schema files, find damaged files, check the first records and count.

    Damaged files are found by reading: every file with data.skip_corrupt (which then drops them),
    else the files counted by reading and those whose size disagrees with their schema file.

    Raises:
        DataError: missing files, unreadable, corrupt or truncated records (with data.skip_corrupt:
            only when every file of a split is), or records that do not match the features.
        ConfigError: features left out with no schema to fill them, or inputs/targets that name
            no feature.
    """
    data = config.data
    resolve_path = _resolver(config)
    train_files = pipeline.expand(data.train, resolve_path, "data.train")
    val_files = (
        pipeline.expand(data.validation, resolve_path, "data.validation") if data.validation else []
    )
    schemas = schema_lib.find_for(train_files + val_files)
    first_schema = schemas.get(train_files[0], (None, None))[1]

    features = data.features
    if not features:
        if first_schema is None:
            raise ConfigError(
                [
                    f"data.features is left out, and no schema file beside {train_files[0]} "
                    "describes the records. Declare the features (`tpurun data inspect GLOB` "
                    "prints them), or write the data with `tpurun data write`."
                ]
            )
        features = first_schema["features"]
    compression = data.compression
    if compression == "auto":
        compression = (first_schema or {}).get("compression") or pipeline.detect_compression(
            train_files[0]
        )
    effective = DataConfig.model_validate(
        {**data.model_dump(mode="json"), "features": features, "compression": compression}
    )
    problems = reference_problems(effective)
    if problems:
        raise ConfigError(problems)

    skip = data.skip_corrupt
    read: dict[str, int] = {}
    skipped: list[pipeline.CorruptShard] = []
    for split, files in (("train", train_files), ("validation", val_files)):
        counts, damaged = _check_files(files, split, schemas, compression, read_all=skip)
        if damaged and not skip:
            raise pipeline.corrupt_error(damaged)
        read.update(counts)
        skipped.extend(damaged)
    train_files = _drop_damaged(train_files, skipped, "train")
    val_files = _drop_damaged(val_files, skipped, "validation")

    pipeline.check_first_record(train_files, effective.features, compression)
    if val_files:
        pipeline.check_first_record(val_files, effective.features, compression)
    train_records, train_listed = _counts(train_files, schemas, compression, read)
    val_records, val_listed = (None, True)
    if val_files:
        val_records, val_listed = _counts(val_files, schemas, compression, read)
    return ResolvedData(
        data=effective,
        train_files=train_files,
        validation_files=val_files,
        train_records=train_records,
        validation_records=val_records,
        counts_from="schema" if train_listed and val_listed else "counted",
        schema_files=sorted({path for path, _ in schemas.values()}),
        skipped=skipped,
    )
