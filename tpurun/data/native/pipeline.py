"""TFRecord files -> numpy batches, without TensorFlow: the native input pipeline (JAX backend).

It gives what :mod:`tpurun.data.pipeline` (``tf.data``) gives, with the same arguments:

seeded passes of (files shuffled -> interleaved reads -> record shuffle) -> batches of
``batch_size`` (a last partial one dropped) -> parsed and decoded a batch at a time
(:class:`~tpurun.data.native.decode.BatchParser`) -> prefetched by a background thread.

Unshuffled, the records come in ``tf.data``'s order exactly (the same interleave of up to 16
files, the same shard), so both readers make the same batches, element for element: validation,
evaluation and prediction do not depend on the reader. Shuffled, the stream is a function of the
seed alone, each pass a permutation of the records, as with ``tf.data``, drawn by numpy instead.

Why a plain iterator and not Grain: on 2 cores, a file-at-a-time Python reader read 53-68k
records/s where Grain's interleave read 14-20k (FIELD-NOTES, "Without TensorFlow"); the figures
measured for this module are in ``docs/benchmarks.md``. Keras takes the batches through
:mod:`tpurun.data.native.keras_input`.

``data.cache``: ``memory`` keeps the records of the first complete read (in the file order
``tf.data``'s cache keeps: the record shuffle still mixes them each pass); a path prefix writes
them to one TFRecord file, ``<prefix>.tfrecord``, when that read completes, and reads them from
there afterwards: a local copy of ``gs://`` data. Each run writes its file cache afresh.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpurun.data import decode as feat
from tpurun.data import files as datafiles
from tpurun.data.native import framing, streams
from tpurun.data.native.decode import BatchParser
from tpurun.data.native.prefetch import Prefetched
from tpurun.storage import fileio

CYCLE_LENGTH = 16  # files read at once, as the tf.data pipeline's interleave
#: Threads parsing batches beside the reading thread (0: it parses them itself), and batches kept
#: ready: see docs/benchmarks.md for the measurement that chose them.
PARSE_WORKERS = 0
PREFETCH_BATCHES = 4
_REMOTE_READ_AHEAD = 256  # records each open gs:// file reads ahead in its own thread


@dataclass(frozen=True)
class ArraySpec:
    """A batch element's shape (the batch dimension included) and numpy dtype."""

    shape: tuple[int, ...]
    dtype: np.dtype


def spec_of(batch: Any) -> Any:
    """The structure of a batch with each array replaced by its :class:`ArraySpec`."""
    if isinstance(batch, Mapping):
        return {key: spec_of(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(spec_of(value) for value in batch)
    array = np.asarray(batch)
    return ArraySpec(tuple(array.shape), array.dtype)


class Batches:
    """The native pipeline's dataset: numpy batches, read afresh from the start by each ``iter()``.

    Attributes:
        num_batches: batches in one iteration; None for an endless stream.
    """

    def __init__(
        self,
        items: Callable[[], Iterator],
        parse: Callable[[Any], Any],
        num_batches: int | None,
        workers: int = PARSE_WORKERS,
        depth: int = PREFETCH_BATCHES,
    ):
        self._items, self._parse = items, parse
        self._workers, self._depth = workers, depth
        self.num_batches = num_batches
        self._live: weakref.WeakSet[Prefetched] = weakref.WeakSet()

    def iterate(
        self, skip_batches: int = 0, then: Callable[[Any], Any] | None = None
    ) -> Prefetched:
        """The batches from the ``skip_batches``-th on (those before it are read, not parsed);
        ``then``: what becomes of each batch after its parse, in the same background thread."""
        items = self._items()
        if skip_batches:
            items = itertools.islice(items, skip_batches, None)
        parse = self._parse if then is None else lambda item: then(self._parse(item))
        iterator = Prefetched(items, parse, self._workers, self._depth)
        self._live.add(iterator)
        return iterator

    def __iter__(self) -> Prefetched:
        return self.iterate()

    def as_numpy_iterator(self) -> Prefetched:
        """The batches (already numpy), as ``tf.data.Dataset.as_numpy_iterator`` gives them."""
        return self.iterate()

    def close(self) -> None:
        """Stop the background threads of every iteration still open."""
        for iterator in list(self._live):
            iterator.close()


# -------------------------------------------------------------------------------------- datasets
def make_dataset(
    files: Sequence[str],
    data: Any,
    batch_size: int,
    *,
    training: bool,
    seed: int = 0,
    start_record: int = 0,
    records_per_pass: int | None = None,
    take_batches: int | None = None,
    score_records: int | None = None,
    repeat_eval: bool = False,
    cache: str | None = None,
    shard: tuple[int, int] | None = None,
    transform: Any = None,
) -> Batches:
    """The input pipeline: the arguments and the batches of :func:`tpurun.data.pipeline.make_dataset`
    (see it for each argument), as numpy arrays.

    Returns:
        :class:`Batches` of ``(inputs, targets[, weights])`` (or what ``transform`` makes of them).
    """
    read = _reader(files, _compression(data.compression, files), shard)
    store = _store(cache)
    parse = _parser(data, transform, scored=score_records is not None)
    if training:

        def one_pass(index: int) -> Iterator[bytes]:
            rng = streams.pass_rng(seed, index)
            # Cached records keep one file order; the record shuffle mixes them.
            records = store.records(lambda: read(files)) if store else read(_permuted(files, rng))
            return streams.shuffled(records, data.shuffle_buffer, rng)

        def endless() -> Iterator[list]:
            stream = streams.training_stream(one_pass, start_record, records_per_pass)
            return streams.batched(stream, batch_size)

        return Batches(endless, parse, None)

    def in_order() -> Iterable[bytes]:
        return store.records(lambda: read(files)) if store else read(files)

    num_batches = take_batches
    if score_records is not None:
        whole = take_batches or math.ceil(score_records / batch_size)

        def one_read() -> Iterator[list]:
            first = lambda: next(iter(read(files)), None)  # noqa: E731
            pairs = streams.scored(in_order(), first, score_records, batch_size, take_batches)
            return streams.batched(pairs, batch_size)

        num_batches = whole
    else:

        def one_read() -> Iterator[list]:
            batches = streams.batched(in_order(), batch_size)
            return itertools.islice(batches, take_batches) if take_batches else batches

    if repeat_eval:
        repeated = lambda: itertools.chain.from_iterable(one_read() for _ in itertools.count())  # noqa: E731
        return Batches(repeated, parse, None)
    return Batches(one_read, parse, num_batches)


def _permuted(files: Sequence[str], rng: np.random.Generator) -> list[str]:
    return [files[i] for i in rng.permutation(len(files)).tolist()]


def _compression(compression: str, files: Sequence[str]) -> str:
    """The compression as "none" or "gzip"; "auto" read from the first file."""
    if compression == "auto":
        return datafiles.detect_compression(files[0]) if files else "none"
    return compression


def _reader(
    files: Sequence[str], compression: str, shard: tuple[int, int] | None
) -> Callable[[Iterable[str]], Iterable[bytes]]:
    """A function from file names to their records: interleaved as ``tf.data`` interleaves
    them, then this process's shard."""
    cycle = min(max(1, len(files)), CYCLE_LENGTH)
    remote = any(fileio.is_remote(f) for f in files)

    def open_file(path: str) -> Iterator[bytes]:
        records = framing.iter_records(path, compression)
        # A bucket answers each read after a round trip: each open file reads ahead on its own.
        return Prefetched(records, _same, depth=_REMOTE_READ_AHEAD) if remote else records

    def read(names: Iterable[str]) -> Iterable[bytes]:
        return streams.sharded(streams.interleaved(names, open_file, cycle), shard)

    return read


def _same(value: Any) -> Any:
    return value


def _parser(data: Any, transform: Any, *, scored: bool) -> Callable[[list], Any]:
    """A list of serialized records (``(record, weight)`` pairs when ``scored``) -> the batch."""
    parse = BatchParser(feat.used_features(data))

    def batch(items: list) -> Any:
        weights = None
        if scored:
            weights = np.fromiter((w for _, w in items), np.float32, len(items))
            items = [record for record, _ in items]
        decoded = parse(items)
        out = (feat.select(decoded, data.inputs), feat.select(decoded, data.targets))
        out = out if weights is None else (*out, weights)
        return out if transform is None else transform(*out)

    return batch


# -------------------------------------------------------------------------------------- caches
class _MemoryCache:
    """``data.cache: memory``: the records of the first complete read, kept for the later ones (a
    read left unfinished keeps nothing)."""

    def __init__(self) -> None:
        self._kept: list[bytes] | None = None
        self._lock = threading.Lock()

    def records(self, read: Callable[[], Iterable[bytes]]) -> Iterable[bytes]:
        with self._lock:
            kept = self._kept
        return iter(kept) if kept is not None else self._filling(read())

    def _filling(self, source: Iterable[bytes]) -> Iterator[bytes]:
        kept = []
        for record in source:
            kept.append(record)
            yield record
        with self._lock:
            self._kept = kept


class _FileCache(_MemoryCache):
    """``data.cache: PREFIX``: the first complete read written to ``PREFIX.tfrecord``, read back
    from there afterwards."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.path = f"{prefix}.tfrecord"
        self._written = False

    def records(self, read: Callable[[], Iterable[bytes]]) -> Iterable[bytes]:
        if self._written:
            return framing.iter_records(self.path)
        return self._filling(read())

    def _filling(self, source: Iterable[bytes]) -> Iterator[bytes]:
        partial = f"{self.path}.partial"
        with framing.RecordWriter(partial) as writer:
            for record in source:
                writer.write(record)
                yield record
        fileio.rename(partial, self.path)
        self._written = True


def _store(cache: str | None) -> _MemoryCache | None:
    if cache is None:
        return None
    return _MemoryCache() if cache == "" else _FileCache(cache)


# ------------------------------------------------------------------------------- in file order
def make_ordered_dataset(
    files: Sequence[str],
    compression: str,
    batch_size: int,
    *,
    records: int,
    features: Any,
    inputs: Any,
    extra: Sequence[str] = (),
) -> Batches:
    """Every record exactly once, in file order, for ``tpurun predict``: the arguments and the
    batches of :func:`tpurun.data.pipeline.make_ordered_dataset`, as numpy arrays."""
    compression = _compression(compression, files)
    parse = BatchParser(features)

    def open_file(path: str) -> Iterator[bytes]:
        return framing.iter_records(path, compression)

    def one_read() -> Iterator[list]:
        first = lambda: next(framing.iter_records(files[0], compression), None)  # noqa: E731
        pairs = streams.scored(
            streams.in_file_order(files, open_file), first, records, batch_size, None
        )
        return streams.batched(pairs, batch_size)

    def batch(items: list) -> tuple[Any, dict]:
        decoded = parse([record for record, _ in items])
        return feat.select(decoded, inputs), {name: decoded[name] for name in extra}

    return Batches(one_read, batch, math.ceil(records / batch_size))
