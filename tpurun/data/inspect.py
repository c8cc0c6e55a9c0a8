"""``tpurun data inspect``: what a set of TFRecord files holds, and a ``features:`` block to paste.

Record counts come from the schema file written beside the shards when it lists every file, else
from reading the files once (cached: see :mod:`tpurun.data.records`). Features are inferred from the
first records (see :mod:`tpurun.data.feature_inference`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import yaml

from tpurun.data import feature_inference, records, schema_file
from tpurun.data import files as datafiles
from tpurun.data.advice import advise
from tpurun.data.feature_inference import FeatureInfo
from tpurun.data.native import example as examples
from tpurun.data.native import framing
from tpurun.errors import DataError

VERSION = 1


@dataclass
class FileInfo:
    path: str
    bytes: int
    records: int


@dataclass
class InspectReport:
    """What :func:`inspect` found. ``to_dict()`` is the ``--json`` output."""

    files: list[FileInfo]
    total_bytes: int
    total_records: int
    counts_from: str  # "schema" (a schema file lists every file) or "counted"
    compression: str  # "none" or "gzip", as in the config's data.compression
    sampled_records: int
    largest_sampled_record: int  # bytes
    features: list[FeatureInfo]
    features_yaml: str
    advice: list[str]
    class_names: list[str] | None = None
    schema_path: str | None = None
    # Records written with --tokenize: the schema's entry, with "lengths" (statistics.tokens).
    tokenized: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"version": VERSION, **asdict(self)}


def inspect(
    patterns: str | list[str],
    *,
    sample: int = 16,
    progress: Callable[[int, int], None] | None = None,
) -> InspectReport:
    """Describe the TFRecord files matched by ``patterns``.

    Args:
        patterns: glob(s), local, gs:// or ram://.
        sample: records read (from the first file, then the next ones) to infer the features.
        progress: called as ``progress(done_files, total_files)`` while records are counted; not
            called when the schema file gives the counts.

    Raises:
        DataError: a glob matches no file, or a file is not a TFRecord file of tf.train.Example.
        ValueError: ``sample`` is below 1.
    """
    if sample < 1:
        raise ValueError(f"sample must be at least 1; received sample={sample}")
    paths = datafiles.expand(patterns)
    sizes = datafiles.sizes(paths)
    # An empty first shard says nothing about the compression of the others.
    first = next((p for p, s in zip(paths, sizes, strict=True) if s), paths[0])
    compression = datafiles.detect_compression(first)
    # Sampling first: a glob that matched the wrong files fails in a second, not after a count.
    samples = _read_samples(paths, compression, sample)
    schemas = schema_file.find_for(paths)
    counts, from_schema = records.record_counts(paths, schemas, compression, progress=progress)
    files = [FileInfo(p, s, n) for p, s, n in zip(paths, sizes, counts, strict=True)]
    for f in files:
        # TensorFlow reads a file shorter than one record header as empty, without an error.
        if f.bytes and not f.records and compression == "none":
            raise DataError(
                f"{f.path}: not a TFRecord file: {f.bytes} bytes but no record.{_write_hint(f.path)}"
            )

    features = feature_inference.infer([example for example, _ in samples])
    schema_path, schema = schemas.get(paths[0]) or next(iter(schemas.values()), (None, None))
    if schema:
        features = feature_inference.apply_schema(features, schema.get("features") or {})
    feature_inference.describe_texts(features, [example for example, _ in samples], schema)
    tokenized = feature_inference.describe_tokens(features, samples[0][0], schema)
    largest = max((size for _, size in samples), default=0)
    return InspectReport(
        files=files,
        total_bytes=sum(sizes),
        total_records=sum(counts),
        counts_from="schema" if from_schema else "counted",
        compression=compression,
        sampled_records=len(samples),
        largest_sampled_record=largest,
        features=features,
        features_yaml=features_yaml(features),
        advice=advise(files, compression, features, largest),
        class_names=schema.get("class_names") if schema else None,
        schema_path=schema_path,
        tokenized=tokenized,
    )


_SOURCE_KINDS = {".csv": "a CSV file", ".npz": "NumPy arrays", ".npy": "a NumPy array",
                 ".jpg": "an image", ".jpeg": "an image", ".png": "an image"}  # fmt: skip


def _write_hint(path: str) -> str:
    """For a file `tpurun data write` reads: the command that makes TFRecords of it."""
    suffix = "." + path.rsplit(".", 1)[-1].lower() if "." in path.rsplit("/", 1)[-1] else ""
    kind = _SOURCE_KINDS.get(suffix)
    if kind is None:
        return ""
    if kind == "an image":
        what, source = "its folder (one subfolder per class)", "IMAGE_FOLDER"
    else:
        what, source = "it", path
    return (
        f" It looks like {kind}: make TFRecords of {what} with "
        f"`tpurun data write {source} OUT_PREFIX`, then inspect OUT_PREFIX-*.tfrecord."
    )


# ------------------------------------------------------------------------------------ reading
def _read_samples(paths: Sequence[str], compression: str, sample: int) -> list[tuple[Any, int]]:
    """The first ``sample`` records, as (parsed tf.train.Example, serialized bytes) pairs."""
    samples: list[tuple[Any, int]] = []
    for path in paths:
        records = _first_records(path, compression, sample - len(samples))
        for record in records:
            try:
                example = examples.parse(record)
            except Exception:  # protobuf raises its own DecodeError type
                example = None
            if example is None or not example.features.feature:
                raise DataError(
                    f"{path}: the records are not tf.train.Example; tpurun reads Examples "
                    "(SequenceExample and raw tensors are not supported)."
                )
            # The serialized size is what protobuf's 2 GB limit applies to.
            samples.append((example, len(record)))
        if len(samples) >= sample:
            break
    return samples


def _first_records(path: str, compression: str, count: int) -> list[bytes]:
    """Up to ``count`` records from the start of ``path``.

    Raises:
        DataError: the file is not TFRecords (damaged where its first records should be).
    """
    reader = framing.iter_records(path, compression)
    records: list[bytes] = []
    try:
        while len(records) < count and (record := next(reader, None)) is not None:
            records.append(record)
    except framing.DamagedRecord as damage:
        problem = framing.where_damaged(damage.reason, damage.offset, damage.index, compression)
        raise DataError(
            f"{path}: not a TFRecord file (compression: {compression}): {problem}."
            + _write_hint(path)
        ) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read it: {exc.strerror or exc}.") from None
    finally:
        reader.close()
    return records


# --------------------------------------------------------------------------------- rendering
class _FlowDict(dict):
    """A feature entry: dumped on one line, as users write them."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(
    _FlowDict,
    lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True),
)


def features_yaml(features: Sequence[FeatureInfo]) -> str:
    """The ``features:`` block for the features tpurun can read, one line per feature."""
    block = {f.name: _FlowDict(f.spec) for f in features if f.spec is not None}
    return yaml.dump(
        {"features": block}, Dumper=_Dumper, sort_keys=False, width=float("inf"), indent=2
    )
