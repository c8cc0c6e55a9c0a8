"""``tpurun data bench``: how fast the configured training input runs on its own.

The answer to "is my input the bottleneck?": if the pipeline alone delivers fewer examples per
second than training consumes, the accelerator waits (Kaggle's TPU monitor calls it idle time).
"""

from __future__ import annotations

import time
from typing import Any

from tpurun.config import Config


def _file_bytes(files: list[str]) -> int:
    import tensorflow as tf

    return sum(tf.io.gfile.stat(f).length for f in files)


def bench(
    config: Config, steps: int = 100, warmup: int = 10, prepared: Any = None
) -> dict[str, Any]:
    """Time ``steps`` batches of the training pipeline after ``warmup`` batches.

    Returns:
        examples_per_sec, batches_per_sec and mb_per_sec (bytes as stored, so compressed for GZIP),
        with the batch size, the timed steps and seconds, and the CPU cores this process may use.
    """
    from tpurun.data import pipeline
    from tpurun.runner import prepare

    prepared = prepared or prepare(config)
    plan = prepared.plan
    ds = pipeline.make_dataset(
        plan.train_files, prepared.data, plan.global_batch_size, training=True, seed=config.seed
    )
    iterator = iter(ds)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    seconds = time.perf_counter() - start
    prepared.runtime.release()
    examples = steps * plan.global_batch_size
    bytes_per_record = _file_bytes(plan.train_files) / max(1, plan.train_records)
    return {
        "examples_per_sec": examples / seconds,
        "batches_per_sec": steps / seconds,
        "mb_per_sec": examples * bytes_per_record / seconds / 1e6,
        "global_batch_size": plan.global_batch_size,
        "steps": steps,
        "warmup_steps": warmup,
        "seconds": seconds,
        "cpu_cores": pipeline.cpu_cores(),
        "train_files": len(plan.train_files),
        "train_records": plan.train_records,
        "bytes_per_record": bytes_per_record,
    }
