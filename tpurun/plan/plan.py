"""Derived values: what a config means on this machine and this data.

Replicas, global and effective batch, scaled learning rate, steps and ``steps_per_execution`` are
computed here once, written into the run directory's ``config.yaml`` and shown by ``tpurun config``.

A *step* is one batch of ``global_batch_size``, which is what ``steps_per_epoch``, checkpoints and
TensorBoard count. With ``train.gradient_accumulation_steps: N`` the optimizer updates the weights
every N steps, with their mean gradient: the *effective* batch, N x the global batch, is what the
learning rate is scaled for, and ``warmup_steps`` and ``total_steps`` count those updates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tpurun.config import Config
from tpurun.errors import ConfigError, DataError
from tpurun.runtime.choice import Choice

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
    global_batch_size: int  # one step's batch
    gradient_accumulation_steps: int
    effective_global_batch_size: int  # one optimizer update's: global batch x accumulation steps
    learning_rate: float
    learning_rate_factor: float
    steps_per_epoch: int
    validation_steps: int | None
    validation_scored: int | None  # records each validation scores (the last batch is padded)
    num_processes: int
    per_process_batch_size: int  # what each process feeds: global batch / processes
    steps_per_execution: int
    warmup_steps: int  # in optimizer updates, as the learning-rate schedule counts them
    total_steps: int  # optimizer updates in the whole run
    monitor: str
    warnings: list[str] = field(default_factory=list)
    reader: str = ""  # native | tf_data: what reads the records (tpurun.data.reader.choose)
    reader_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def batch_sizes(config: Config, replicas: int) -> tuple[int, int, list[str]]:
    """Per-core and global batch size for a replica count, with the Kaggle TPU recipe's advice as warnings."""
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


def lr_factor(config: Config, effective_batch: int) -> float:
    """The learning rate's multiplier for the batch of one optimizer update."""
    lr = config.train.learning_rate
    if lr.base_batch_size is None or lr.scaling == "none":
        return 1.0
    ratio = effective_batch / lr.base_batch_size
    return ratio if lr.scaling == "linear" else math.sqrt(ratio)


def auto_steps_per_execution(steps_per_epoch: int, limit: int | None) -> int:
    """The largest divisor of the epoch's steps up to 32, so every execution is full."""
    cap = min(limit or MAX_AUTO_STEPS_PER_EXECUTION, MAX_AUTO_STEPS_PER_EXECUTION, steps_per_epoch)
    return max(d for d in range(1, cap + 1) if steps_per_epoch % d == 0)


def _train_steps(value: int | str, records: int, batch: int, processes: int) -> int:
    """Steps per epoch. Training drops the last partial batch (a partial batch split over TPU
    cores is a classic NaN), and its stream repeats, so an explicit count may pass a pass's end.

    ``records`` is the smallest process's share and ``batch`` the per-process batch: every process
    must run the same steps, or the others would wait forever at an epoch's end.
    """
    if value != "auto":
        return int(value)
    steps = records // batch
    if steps == 0:
        share = f" (the smallest of {processes} processes' shares)" if processes > 1 else ""
        which = "per-process batch" if processes > 1 else "global batch"
        raise DataError(
            f"train.steps_per_epoch: auto found {records} training records{share}, fewer than one "
            f"{which} of {batch}. Lower train.per_core_batch_size (or global_batch_size), or set "
            "train.steps_per_epoch: the training stream repeats, so batches then span passes."
        )
    return steps


def validation_steps(value: int | str, records: int, batch: int) -> int:
    """Validation batches: every record scored once, the last batch padded with records weighted
    0 (see ``pipeline.make_dataset(score_records=...)``), so any count of records works. An
    explicit count scores the first ``value`` batches, never more than there are. ``records`` is
    the largest process's share, ``batch`` the per-process batch."""
    whole = -(-records // batch)
    return whole if value == "auto" else min(int(value), whole)


def scored_records(shares: list[int], steps: int, batch: int) -> int:
    """Records that ``steps`` validation batches of ``batch`` per process score, over all
    processes; the rest of what they feed is padding."""
    return sum(min(share, steps * batch) for share in shares)


def _check_accumulation(choice: Choice, accumulation: int) -> None:
    """Keras' accumulation on TensorFlow under a ``tf.distribute`` strategy fails in the first step:
    the optimizer's update and accumulate branches (an ``ops.cond``) each call ``merge_call``,
    which TensorFlow refuses inside a ``cond`` (checked with Keras 3.15 on 2 CPU replicas)."""
    if accumulation > 1 and choice.backend == "tensorflow" and choice.distribution != "default":
        raise ConfigError(
            [
                f"train.gradient_accumulation_steps: {accumulation} on the TensorFlow backend with "
                f"a {choice.distribution} strategy fails inside Keras (merge_call inside the "
                "optimizer's cond); use runtime.backend: jax, which accumulates on any number of "
                "replicas, or set gradient_accumulation_steps: 1"
            ]
        )


def _accumulation_warnings(steps: int, epochs: int, accumulation: int) -> list[str]:
    """Keras accumulates across an epoch's end: an update may take batches of two epochs, which is
    harmless (checkpoints keep the partial sums, so a resume stays exact), but batches past the
    run's last whole update are trained on for nothing."""
    if accumulation == 1 or steps % accumulation == 0:
        return []
    left = steps * epochs % accumulation
    tail = f"; the run's last {left} batch(es) make no update" if left else ""
    return [
        f"train.steps_per_epoch: {steps} is not a multiple of gradient_accumulation_steps "
        f"{accumulation}: some updates average batches of two epochs{tail}."
    ]


def resolve_monitor(config: Config, monitor: str) -> str:
    if monitor != "auto":
        return monitor
    return "val_loss" if config.data.validation else "loss"


def make_plan(
    config: Config,
    choice: Choice,
    replicas: int,
    train_shares: list[int],
    validation_shares: list[int] | None,
) -> Plan:
    """Derive every value that depends on the machine and the data's record counts.

    Args:
        train_shares, validation_shares: each process's records (one number on one process).
    """
    per_core, global_batch, warnings = batch_sizes(config, replicas)
    warnings = [*choice.warnings, *warnings]
    train = config.train
    processes = len(train_shares)
    batch = global_batch // processes
    steps = _train_steps(train.steps_per_epoch, min(train_shares), batch, processes)
    val_steps = scored = None
    if validation_shares is not None:
        val_steps = validation_steps(train.validation_steps, max(validation_shares), batch)
        scored = scored_records(validation_shares, val_steps, batch)
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
    accumulation = train.gradient_accumulation_steps
    _check_accumulation(choice, accumulation)
    warnings += _accumulation_warnings(steps, train.epochs, accumulation)
    factor = lr_factor(config, global_batch * accumulation)
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
        gradient_accumulation_steps=accumulation,
        effective_global_batch_size=global_batch * accumulation,
        learning_rate=lr.base * factor,
        learning_rate_factor=factor,
        steps_per_epoch=steps,
        validation_steps=val_steps,
        validation_scored=scored,
        num_processes=processes,
        per_process_batch_size=batch,
        steps_per_execution=int(spe),
        warmup_steps=round(lr.warmup_epochs * steps / accumulation),
        total_steps=steps * train.epochs // accumulation,
        monitor=monitor,
        warnings=warnings,
    )
