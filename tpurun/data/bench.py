"""``tpurun data bench``: how fast the configured training input runs on its own.

The answer to "is my input the bottleneck?": if the pipeline alone delivers fewer examples per
second than training consumes, the accelerator waits (Kaggle's TPU monitor calls it idle time).
"""

from __future__ import annotations

import time
from typing import Any

from tpurun.config import Config
from tpurun.data import files as datafiles


def bench(config: Config, steps: int = 100, warmup: int = 10) -> dict[str, Any]:
    """Time ``steps`` batches of the training pipeline after ``warmup`` batches.

    Returns:
        examples_per_sec, batches_per_sec and mb_per_sec (bytes as stored, so compressed for GZIP),
        with the batch size, the timed steps and seconds, and the CPU cores this process may use.
    """
    from tpurun.data import pipeline
    from tpurun.runtime.prepare import prepare_here

    # The plan without activation: timing a CPU pipeline must not take the accelerator.
    prepared = prepare_here(config)
    plan, data = prepared.plan, prepared.data
    ds = pipeline.make_dataset(
        data.train_files, prepared.config.data, plan.global_batch_size, training=True,
        seed=config.seed,
    )  # fmt: skip
    iterator = iter(ds)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    seconds = time.perf_counter() - start
    examples = steps * plan.global_batch_size
    bytes_per_record = sum(datafiles.sizes(data.train_files)) / max(1, data.train_records)
    return {
        "examples_per_sec": examples / seconds,
        "batches_per_sec": steps / seconds,
        "mb_per_sec": examples * bytes_per_record / seconds / 1e6,
        "global_batch_size": plan.global_batch_size,
        "steps": steps,
        "warmup_steps": warmup,
        "seconds": seconds,
        "cpu_cores": pipeline.cpu_cores(),
        "train_files": len(data.train_files),
        "train_records": data.train_records,
        "bytes_per_record": bytes_per_record,
    }
