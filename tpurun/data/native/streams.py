"""Streams of serialized records for the native pipeline: the same records, in the same order, as
the ``tf.data`` pipeline's stages (:mod:`tpurun.data.pipeline`), in plain Python.

- :func:`interleaved`: ``interleave(cycle_length, block_length=1)`` as TensorFlow runs it
  deterministically (checked against it on files of uneven lengths, empty ones included);
- :func:`sharded`: ``shard(n, i)``;
- :func:`shuffled`: a shuffle buffer (fill it, then emit a random slot and refill it; drain in a
  random order at the end), drawn from a generator seeded by the pass;
- :func:`training_stream`: endless passes, each with its files and records shuffled by its own
  seed, started at any record;
- :func:`scored`: the records of an exact validation weighted 1, then padding weighted 0.

Only the unshuffled order is TensorFlow's own; a shuffled stream is the same kind of
permutation drawn from numpy's generator, so a run's batches depend on its reader (and its seed).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

#: Seed of pass ``p``: its own generator from ``(seed, p)``, so passes never share a stream.
_SEED_WORDS = 0xFFFFFFFFFFFFFFFF
_DRAWS = 4096  # random slots drawn at a time (one numpy call per 4096 records)

OpenFile = Callable[[str], Iterator[bytes]]


def pass_rng(seed: int, index: int) -> np.random.Generator:
    """The generator of pass ``index`` of a stream seeded ``seed`` (any int, negative too)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed & _SEED_WORDS, index])))


def interleaved(files: Iterable[str], open_file: OpenFile, cycle_length: int) -> Iterator[bytes]:
    """One record from each of ``cycle_length`` open files in turn; a file that ends gives its
    slot to the next file of ``files`` when the turn comes back to it (TensorFlow's order)."""
    pending = iter(files)
    slots: list[Iterator[bytes] | None] = [None] * max(1, cycle_length)
    index, open_count, inputs_left = 0, 0, True
    while inputs_left or open_count:
        current = slots[index]
        if current is not None:
            record = next(current, None)
            if record is not None:
                yield record
            else:
                slots[index] = None
                open_count -= 1
            index = (index + 1) % len(slots)
        elif inputs_left:
            name = next(pending, None)
            if name is None:
                inputs_left = False
            else:
                slots[index] = open_file(name)
                open_count += 1
        else:
            index = (index + 1) % len(slots)


def sharded(records: Iterable[bytes], shard: tuple[int, int] | None) -> Iterable[bytes]:
    """Every ``num_shards``-th record from ``index`` (all of them without a shard)."""
    if not shard:
        return records
    num_shards, index = shard
    return itertools.islice(records, index, None, num_shards)


def shuffled(
    records: Iterable[bytes], buffer_size: int, rng: np.random.Generator
) -> Iterator[bytes]:
    """``records`` through a shuffle buffer of ``buffer_size`` (1 or less: unchanged)."""
    if buffer_size <= 1:
        yield from records
        return
    buffer: list[bytes] = []
    source = iter(records)
    for record in itertools.islice(source, buffer_size):
        buffer.append(record)
    draws: Iterator[int] = iter(())
    for record in source:
        slot = next(draws, None)
        if slot is None:
            draws = iter(rng.integers(0, len(buffer), _DRAWS).tolist())
            slot = next(draws)
        yield buffer[slot]
        buffer[slot] = record
    for slot in rng.permutation(len(buffer)).tolist():
        yield buffer[slot]


def training_stream(
    one_pass: Callable[[int], Iterable[bytes]],
    start_record: int = 0,
    records_per_pass: int | None = None,
) -> Iterator[bytes]:
    """Endless passes ``one_pass(0), one_pass(1), ...``, from record ``start_record``: its pass
    is started, and the records before it in that pass are read and skipped (not decoded)."""
    first_pass, skip = 0, 0
    if start_record:
        if not records_per_pass:
            raise ValueError("start_record needs records_per_pass")
        first_pass, skip = divmod(start_record, records_per_pass)
    passes = (one_pass(index) for index in itertools.count(first_pass))
    stream = itertools.chain.from_iterable(passes)
    return itertools.islice(stream, skip, None) if skip else stream


def scored(
    records: Iterable[bytes],
    first: Callable[[], bytes | None],
    score_records: int,
    batch_size: int,
    take_batches: int | None,
) -> Iterator[tuple[bytes, float]]:
    """``(record, weight)``: the first ``score_records`` records weighted 1, then copies of the
    first record (``first()``, a fresh read) weighted 0 up to a whole number of batches:
    ``take_batches`` of them when given (every process feeds as many)."""
    fed = (
        take_batches * batch_size if take_batches else -(-score_records // batch_size) * batch_size
    )
    score_records = min(score_records, fed)
    yield from ((record, 1.0) for record in itertools.islice(records, score_records))
    pad = fed - score_records
    if pad:
        copy = first()
        if copy is not None:
            yield from itertools.repeat((copy, 0.0), pad)


def batched(items: Iterable, batch_size: int) -> Iterator[list]:
    """Lists of ``batch_size`` items; a last, shorter one is dropped (``drop_remainder``)."""
    source = iter(items)
    while len(batch := list(itertools.islice(source, batch_size))) == batch_size:
        yield batch


def in_file_order(files: Sequence[str], open_file: OpenFile) -> Iterator[bytes]:
    """The files' records one file after another (``predict``: rows follow the test set)."""
    return itertools.chain.from_iterable(open_file(name) for name in files)
