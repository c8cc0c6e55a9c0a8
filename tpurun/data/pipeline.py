"""TFRecord files -> a fast ``tf.data`` pipeline, used by every backend.

The training pipeline follows the TF TPU guide's advice, and fixes the seeds' recipe (one parse
thread, no prefetch, and a ``shuffle()`` whose result was discarded):

files (shuffled, repeated) -> parallel interleaved reads -> record shuffle -> batch(drop_remainder)
-> ``parse_example`` on whole batches -> decode -> prefetch.

``drop_remainder=True`` always: a partial last batch split across replicas is a known cause of NaN
losses on TPUs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tpurun.data import features as feat
from tpurun.errors import DataError

_COMPRESSION = {"none": "", "gzip": "GZIP"}


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def detect_compression(path: str) -> str:
    """GZIP files start with 1f 8b; TFRecord files start with a record length and its CRC."""
    import tensorflow as tf

    with tf.io.gfile.GFile(path, "rb") as f:
        return "gzip" if f.read(3) == b"\x1f\x8b\x08" else "none"  # magic + deflate


def _compression_type(compression: str, files: Sequence[str]) -> str:
    if compression == "auto":
        compression = detect_compression(files[0]) if files else "none"
    return _COMPRESSION[compression]


def expand(patterns: str | Sequence[str], resolve=lambda p: p) -> list[str]:
    """Expand globs (local, gs://, ram://) into a sorted file list.

    Raises:
        DataError: when a glob matches no file, naming the glob.
    """
    import tensorflow as tf

    files: list[str] = []
    for pattern in [patterns] if isinstance(patterns, str) else patterns:
        path = resolve(pattern)
        try:
            matched = tf.io.gfile.glob(path)
        except tf.errors.OpError as exc:
            raise DataError(f"{path}: cannot list files: {exc.message}") from None
        matched = [m for m in matched if not tf.io.gfile.isdir(m)]
        if not matched:
            hint = ""
            if "://" not in path:
                hint = " Relative paths are read from the config file's folder."
            raise DataError(f"{path}: no file matches this glob.{hint}")
        files.extend(sorted(matched))
    return list(dict.fromkeys(files))


# --------------------------------------------------------------------------------- record counts
def _cache_file() -> Path:
    root = os.environ.get("TPURUN_CACHE_DIR") or Path.home() / ".cache" / "tpurun"
    return Path(root) / "record_counts.json"


def _file_key(path: str) -> str:
    import tensorflow as tf

    stat = tf.io.gfile.stat(path)
    return f"{path}|{stat.length}|{stat.mtime_nsec}"


def _count_one(path: str, compression: str) -> int:
    import tensorflow as tf

    ds = tf.data.TFRecordDataset(path, compression_type=_compression_type(compression, [path]))
    try:
        return int(ds.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
    except tf.errors.OpError as exc:
        raise DataError(f"{path}: cannot read it as TFRecords: {exc.message}") from None


def count_records(files: Sequence[str], compression: str = "auto") -> int:
    """Count records, reading each file once ever.

    Counts are remembered by path, size and mtime in ``~/.cache/tpurun/record_counts.json`` (or
    ``$TPURUN_CACHE_DIR``), so a rerun, or another run on the same data, does not read it again.
    """
    cache_path = _cache_file()
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    keys = {path: _file_key(path) for path in files}
    missing = [p for p in files if keys[p] not in cache]
    if missing:
        with ThreadPoolExecutor(max_workers=min(8, len(missing))) as pool:
            for path, n in zip(
                missing, pool.map(lambda p: _count_one(p, compression), missing), strict=True
            ):
                cache[keys[path]] = n
        try:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cache))
            tmp.replace(cache_path)
        except OSError:
            pass  # a read-only home only costs a recount next time
    return sum(cache[keys[p]] for p in files)


def check_first_record(files: Sequence[str], features: Mapping[str, Any], compression: str) -> None:
    """Fail early, with a clear message, when the records do not match the declared features."""
    import tensorflow as tf

    ds = tf.data.TFRecordDataset(files[0], compression_type=_compression_type(compression, files))
    try:
        first = next(iter(ds.take(1)), None)
    except tf.errors.OpError as exc:
        raise DataError(f"{files[0]}: cannot read it as TFRecords: {exc.message}") from None
    if first is None:
        raise DataError(f"{files[0]}: the file holds no records.")
    feat.check_record(first.numpy(), features, files[0])


# -------------------------------------------------------------------------------------- datasets
def make_dataset(
    files: Sequence[str],
    data: Any,
    batch_size: int,
    *,
    training: bool,
    seed: int | None = None,
    take_batches: int | None = None,
    repeat_eval: bool = False,
    cache: str | None = None,
    num_shards: int = 1,
    shard_index: int = 0,
):
    """Build the input pipeline.

    Args:
        files: TFRecord files (already expanded).
        data: the config's ``data`` section (features, inputs, targets, shuffle, compression).
        batch_size: records per batch fed to this process (the global batch on one host).
        training: shuffle and repeat endlessly; otherwise keep order and repeat ``take_batches``.
        seed: shuffling seed.
        take_batches: for evaluation, the batches of one pass. Keras starts a fresh iterator for
            each validation, so every epoch is scored on the same batches.
        repeat_eval: repeat those batches endlessly (then pass ``validation_steps``). Needed under
            a tf.distribute strategy: there, Keras miscounts metrics at the end of a finite
            dataset (measured with MirroredStrategy on 8 CPUs: val accuracy 0.65 for batches it
            scores 0.98 on when repeated). Elsewhere the finite form is exact even when
            steps_per_execution does not divide the batch count.
        cache: cache the serialized records after the first pass: ``""`` in memory, or a file
            path prefix (TF writes ``<prefix>.index`` and data files). None: no cache.
        num_shards, shard_index: for multi-host input, each process reads its own files.

    Returns:
        A ``tf.data.Dataset`` of ``(inputs, targets)`` batches.
    """
    import tensorflow as tf

    autotune = tf.data.AUTOTUNE
    compression = _compression_type(data.compression, files)
    used = feat.used_features(data)
    spec = feat.parse_spec(used)

    ds = tf.data.Dataset.from_tensor_slices(list(files))
    if num_shards > 1:
        ds = ds.shard(num_shards, shard_index)
    n_files = max(1, len(files) // num_shards)
    if training:
        ds = ds.shuffle(n_files, seed=seed, reshuffle_each_iteration=cache is None)
        if cache is None:
            ds = ds.repeat()  # repeating the file list keeps reads streaming across epochs
    cycle_length = min(n_files, 16)
    # Local reads are CPU-bound: one reader per core beats AUTOTUNE's choice (measured +23% on
    # NAIC-like records, 2 cores). Remote reads wait on latency: let AUTOTUNE add readers there.
    remote = any("://" in f for f in files)
    ds = ds.interleave(
        lambda f: tf.data.TFRecordDataset(f, compression_type=compression),
        cycle_length=cycle_length,
        block_length=1,
        num_parallel_calls=autotune if remote else max(1, min(cycle_length, cpu_cores())),
        deterministic=not training or cache is not None,  # a cache must see one fixed pass
    )
    if cache is not None:
        ds = ds.cache(cache)
        if training:
            ds = ds.repeat()
    if training and data.shuffle_buffer > 1:
        ds = ds.shuffle(data.shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size, drop_remainder=True)
    if take_batches is not None:
        ds = ds.take(take_batches)
        if repeat_eval:
            ds = ds.repeat()

    def parse(serialized):
        decoded = feat.decode_batch(tf.io.parse_example(serialized, spec), used)
        return feat.select(decoded, data.inputs), feat.select(decoded, data.targets)

    ds = ds.map(parse, num_parallel_calls=autotune, deterministic=not training)
    options = tf.data.Options()
    options.deterministic = not training
    options.experimental_optimization.map_parallelization = True
    return ds.with_options(options).prefetch(autotune)
