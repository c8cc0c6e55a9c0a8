"""``tpurun data bench``: how fast the configured training input runs on its own.

The answer to "is my input the bottleneck?": if the pipeline alone delivers fewer examples per
second than training consumes, the accelerator waits (Kaggle's TPU monitor calls it idle time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tpurun.config import Config, DataConfig
from tpurun.data import files as datafiles
from tpurun.data import reader as readers
from tpurun.data.pipeline import cpu_cores
from tpurun.plan.prepare import prepare_here


def bench(
    config: Config,
    steps: int = 100,
    warmup: int = 10,
    preprocessing: Callable[[DataConfig, dict | None], Callable] | None = None,
    lengths: Callable[[DataConfig, list[str]], dict | None] | None = None,
) -> dict[str, Any]:
    """Time ``steps`` batches of the training pipeline after ``warmup`` batches.

    Args:
        config: the experiment.
        steps, warmup: batches timed, and read before timing.
        preprocessing: for a preset, ``(data, tokenized) ->`` the transform training maps over
            the records (:func:`tpurun.hub.batches.pipeline_preprocessing`): its tokenising is
            part of the input's cost, unless the records were tokenised once.
        lengths: for a preset, ``(data, train files) ->`` the token lengths of a sample of the
            records against the sequence length (:func:`tpurun.hub.lengths.measurer`), or None.

    Returns:
        examples_per_sec, batches_per_sec and mb_per_sec (bytes as stored, so compressed for GZIP),
        with the batch size, the timed steps and seconds, and the CPU cores this process may use;
        for token batches, tokens_per_sec (positions: examples x the sequence length the model
        reads), what preprocessing ran and ``token_lengths`` (the share the sequence length cuts); the reader training would use (``data.reader``), which
        is the one measured, and why.
    """
    # The plan without activation: timing a CPU pipeline must not take the accelerator.
    prepared = prepare_here(config)
    plan, data = prepared.plan, prepared.data
    transform = preprocessing(prepared.config.data, data.tokenized) if preprocessing else None
    ds = readers.make_dataset(
        prepared.reader,
        data.train_files,
        prepared.config.data,
        plan.global_batch_size,
        training=True,
        seed=config.seed,
        transform=transform,
    )
    iterator = iter(ds)
    try:
        first = next(iterator)
        for _ in range(max(0, warmup - 1)):
            next(iterator)
        start = time.perf_counter()
        for _ in range(steps):
            next(iterator)
        seconds = time.perf_counter() - start
    finally:
        readers.close(ds)
    examples = steps * plan.global_batch_size
    bytes_per_record = sum(datafiles.sizes(data.train_files)) / max(1, data.train_records)
    positions = _positions(first)
    return {
        "examples_per_sec": examples / seconds,
        "tokens_per_sec": examples * positions / seconds if positions else None,
        "positions": positions,
        "preprocessing": _preprocessing(transform, data.tokenized),
        "batches_per_sec": steps / seconds,
        "mb_per_sec": examples * bytes_per_record / seconds / 1e6,
        "global_batch_size": plan.global_batch_size,
        "steps": steps,
        "warmup_steps": max(1, warmup),  # the first batch tells the token positions
        "seconds": seconds,
        "cpu_cores": cpu_cores(),
        "train_files": len(data.train_files),
        "train_records": data.train_records,
        "bytes_per_record": bytes_per_record,
        "reader": prepared.reader.name,
        "reader_reason": prepared.reader.reason,
        "token_lengths": lengths(prepared.config.data, data.train_files) if lengths else None,
    }


def _positions(batch: Any) -> int | None:
    """The token positions per example of a batch of token ids (``x["token_ids"]``), else None."""
    x = batch[0] if isinstance(batch, tuple) else batch
    if isinstance(x, dict) and "token_ids" in x:
        return int(x["token_ids"].shape[-1])
    return None


def _preprocessing(transform: Any, tokenized: dict | None) -> str | None:
    if tokenized:
        return (
            f"none: records tokenised once for {tokenized['task']} "
            f"(tpurun data write --tokenize), read as they are"
        )
    if transform is not None:
        return "the preset's preprocessor tokenises each batch in the pipeline"
    return None
