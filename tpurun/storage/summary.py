"""``summary.json``: what a run did, typed and versioned, kept up to date while it runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUMMARY_VERSION = 1
#: Statuses a summary records; ``died`` is never written, only read: see :meth:`RunDir.status`.
STATUSES = ("running", "completed", "stopped_early", "interrupted", "nan", "failed")


@dataclass
class Summary:
    """``summary.json``: what a run did, kept up to date while it runs. Versioned: readers of
    other versions see ``version`` and may refuse."""

    status: str = "running"
    epochs_completed: int = 0
    epochs: int = 0
    backend: str | None = None
    accelerator: str | None = None
    distribution: str | None = None
    replicas: int | None = None
    precision: str | None = None
    global_batch_size: int | None = None
    per_core_batch_size: int | None = None
    learning_rate: float | None = None
    steps_per_epoch: int | None = None
    validation_steps: int | None = None
    steps_per_execution: int | None = None
    best: dict = field(default_factory=lambda: {"monitor": None, "value": None, "epoch": None})
    examples_per_sec: float | None = None
    # The steady epochs' tokens_per_second (token inputs) or examples_per_second, tflops_per_device
    # and mfu (None where unknown), with the step's cost: see tpurun.observe.throughput.
    throughput: dict | None = None
    seconds: float | None = None
    time_to_first_step: float | None = None
    # JAX's compilation cache this session: its folder, programs loaded from it and compiled.
    compilation_cache: dict | None = None
    epoch_seconds: list = field(default_factory=list)
    input_wait: float | None = None  # share of the training loop's time waiting for data
    epoch_input_wait: list = field(default_factory=list)  # the same, per epoch of this session
    final_metrics: dict = field(default_factory=dict)
    resumes: list = field(default_factory=list)
    nan_restores: list = field(default_factory=list)
    skipped_shards: list = field(default_factory=list)
    skipped_records: int = 0
    run_dir: str | None = None
    processes: int = 1  # several: process 0 wrote this, for all of them
    tpurun_version: str | None = None
    pid: int | None = None  # of the process that wrote it last: with ``host``, names a live run
    host: str | None = None
    started: str | None = None  # this session's start, ISO 8601
    updated: str | None = None  # the last write
    version: int = SUMMARY_VERSION

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Summary:
        """A summary from its JSON; unknown keys (a newer tpurun's) are left out."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def steady_rate(rates: list[float]) -> float:
    """Examples/s over a run's epochs: the first epoch, which compiles, is left out when there
    are others."""
    steady = rates[1:] or rates
    return sum(steady) / len(steady) if steady else 0.0
