"""What a fit is given and what it gives back: :class:`TrainJob`, :class:`TrainResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpurun.display.reporter import Reporter
from tpurun.plan.prepare import Prepared
from tpurun.runtime.activate import ActiveRuntime
from tpurun.storage.rundir import RunDir
from tpurun.storage.summary import Summary
from tpurun.training.checkpoints.resume import ResumePoint
from tpurun.training.signals import Stop


@dataclass
class TrainJob:
    """What :func:`train` needs: the prepared config on an activated runtime, where to write, where
    to start, and the stop request it obeys."""

    prepared: Prepared
    runtime: ActiveRuntime
    run: RunDir
    point: ResumePoint | None  # where to continue from; None: epoch 1
    identity: dict  # what the checkpoints are bound to (resume.identity)
    effective: dict  # config.yaml's content
    summary: Summary  # written with config.yaml once Keras has checked the model against the data
    reporter: Reporter
    stop: Stop


@dataclass
class TrainResult:
    """How the fit ended: where, with which metrics, how fast. Why it ended is ``job.stop``."""

    model: Any
    position: tuple[int, int]  # (epochs done, steps into the next) of the last save
    best: dict | None  # {monitor, value, epoch}; None when callbacks.checkpoint is off
    last_logs: dict  # the last finished epoch's metrics
    epoch_seconds: list[float]
    epoch_rates: list[float]  # examples/s per epoch
    first_step_seconds: float | None
    nan_restores: list[dict] = field(default_factory=list)
    input_waits: list[tuple[float, float]] = field(default_factory=list)  # (waiting, training) s
    throughput: dict | None = None  # tokens/s, TFLOP/s a device, MFU: see observe.throughput
