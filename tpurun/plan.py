"""Derived values: what a config means on this machine and this data.

Replicas, global batch, scaled learning rate, steps and ``steps_per_execution`` are computed here
once, written into the run directory's ``config.yaml`` and shown by ``tpurun config``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tpurun.config import Config
from tpurun.errors import ConfigError, DataError
from tpurun.runtime import Choice

DEFAULT_PER_CORE_BATCH = 16
MAX_AUTO_STEPS_PER_EXECUTION = 32


@dataclass
class Plan:
    backend: str
    accelerator: str
    distribution: str
    replicas: int
    precision: str
    reason: str
    per_core_batch_size: int
    global_batch_size: int
    learning_rate: float
    learning_rate_factor: float
    steps_per_epoch: int
    validation_steps: int | None
    validation_scored: int | None  # records each validation scores (the last batch is padded)
    steps_per_execution: int
    warmup_steps: int
    total_steps: int
    monitor: str
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def batch_sizes(config: Config, replicas: int) -> tuple[int, int, list[str]]:
    """Per-core and global batch size for a replica count, with the seeds' advice as warnings."""
    train = config.train
    if train.global_batch_size is not None:
        if train.global_batch_size % replicas:
            raise ConfigError(
                [
                    f"train.global_batch_size: {train.global_batch_size} does not divide evenly "
                    f"over {replicas} replicas; use a multiple of {replicas}, or set "
                    "train.per_core_batch_size instead"
                ]
            )
        per_core = train.global_batch_size // replicas
    else:
        per_core = train.per_core_batch_size or DEFAULT_PER_CORE_BATCH
    warnings = []
    if per_core < 8 or per_core % 8:
        warnings.append(
            f"per-core batch size {per_core} is {'below 8' if per_core < 8 else 'not a multiple of 8'}"
            ": TPU cores work in 8x128 tiles; 128 per core keeps the 128x128 MXU busy."
        )
    return per_core, per_core * replicas, warnings


def lr_factor(config: Config, global_batch: int) -> float:
    lr = config.train.learning_rate
    if lr.base_batch_size is None or lr.scaling == "none":
        return 1.0
    ratio = global_batch / lr.base_batch_size
    return ratio if lr.scaling == "linear" else math.sqrt(ratio)


def auto_steps_per_execution(steps_per_epoch: int, limit: int | None) -> int:
    """The largest divisor of the epoch's steps up to 32, so every execution is full."""
    cap = min(limit or MAX_AUTO_STEPS_PER_EXECUTION, MAX_AUTO_STEPS_PER_EXECUTION, steps_per_epoch)
    return max(d for d in range(1, cap + 1) if steps_per_epoch % d == 0)


def _train_steps(value: int | str, records: int, global_batch: int) -> int:
    """Steps per epoch. Training drops the last partial batch (a partial batch split over TPU
    cores is a classic NaN), and its stream repeats, so an explicit count may pass a pass's end."""
    if value != "auto":
        return int(value)
    steps = records // global_batch
    if steps == 0:
        raise DataError(
            f"train.steps_per_epoch: auto found {records} training records, fewer than one global "
            f"batch of {global_batch}. Lower train.per_core_batch_size (or global_batch_size), or "
            "set train.steps_per_epoch: the training stream repeats, so batches then span passes."
        )
    return steps


def validation_steps(value: int | str, records: int, global_batch: int) -> int:
    """Validation batches: every record scored once, the last batch padded with records weighted
    0 (see ``pipeline.make_dataset(score_records=...)``), so any count of records works. An
    explicit count scores the first ``value`` batches, never more than there are."""
    whole = -(-records // global_batch)
    return whole if value == "auto" else min(int(value), whole)


def scored_records(records: int, steps: int, global_batch: int) -> tuple[int, int]:
    """``(records scored, records fed)`` for ``steps`` validation batches: the difference is the
    padding of the last batch."""
    return min(records, steps * global_batch), steps * global_batch


def resolve_monitor(config: Config, monitor: str) -> str:
    if monitor != "auto":
        return monitor
    return "val_loss" if config.data.validation else "loss"


def make_plan(
    config: Config,
    choice: Choice,
    replicas: int,
    train_records: int,
    validation_records: int | None,
) -> Plan:
    """Derive every value that depends on the machine and the data's record counts."""
    per_core, global_batch, warnings = batch_sizes(config, replicas)
    warnings = [*choice.warnings, *warnings]
    train = config.train
    steps = _train_steps(train.steps_per_epoch, train_records, global_batch)
    val_steps = None
    if validation_records is not None:
        val_steps = validation_steps(train.validation_steps, validation_records, global_batch)
    spe = train.steps_per_execution
    if spe == "auto":
        spe = auto_steps_per_execution(steps, choice.max_steps_per_execution)
    elif spe > steps:
        warnings.append(
            f"train.steps_per_execution: {spe} is more than the {steps} steps of an epoch; using {steps}."
        )
        spe = steps
    elif steps % spe:
        # Keras runs whole executions: 10 steps at 4 per execution would silently run 12.
        rounded = steps - steps % spe
        warnings.append(
            f"train.steps_per_epoch: {steps} is not a multiple of steps_per_execution {spe}; "
            f"using {rounded} so every epoch runs the steps it reports."
        )
        steps = rounded
    factor = lr_factor(config, global_batch)
    lr = train.learning_rate
    checkpoint = config.callbacks.checkpoint
    monitor = resolve_monitor(config, checkpoint.monitor if checkpoint else "auto")
    return Plan(
        backend=choice.backend,
        accelerator=choice.accelerator,
        distribution=choice.distribution,
        replicas=replicas,
        precision=choice.precision,
        reason=choice.reason,
        per_core_batch_size=per_core,
        global_batch_size=global_batch,
        learning_rate=lr.base * factor,
        learning_rate_factor=factor,
        steps_per_epoch=steps,
        validation_steps=val_steps,
        validation_scored=(
            None
            if val_steps is None
            else scored_records(validation_records, val_steps, global_batch)[0]
        ),
        steps_per_execution=int(spe),
        warmup_steps=round(lr.warmup_epochs * steps),
        total_steps=steps * train.epochs,
        monitor=monitor,
        warnings=warnings,
    )
