"""The ``train`` section: batch sizes and gradient accumulation, epochs and steps, the learning rate
and its schedule, the time limit and profiles."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from tpurun.config.base import Auto, Section


class LearningRateConfig(Section):
    base: float = Field(1e-3, gt=0, description="The learning rate tuned for `base_batch_size`.")
    base_batch_size: int | None = Field(
        None,
        ge=1,
        description="The batch size `base` was tuned for. Unset: the effective batch, so no scaling.",
    )
    scaling: Literal["linear", "sqrt", "none"] = Field(
        "linear",
        description="lr = base x f(effective batch / `base_batch_size`), f being the identity, the "
        "square root, or 1; the effective batch is the global batch x `gradient_accumulation_steps`.",
    )
    warmup_epochs: float = Field(
        0,
        ge=0,
        description="Linear warmup to the scaled learning rate, in epochs (fractions allowed), counted "
        "in optimizer updates.",
    )
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="After the warmup: constant, or a cosine decay to 0 at the last optimizer update.",
    )


_DURATION = re.compile(
    r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*$"
)


def parse_duration(value: Any) -> float | None:
    """``8h45m``, ``90m``, ``30s`` or a number of seconds -> seconds."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        if value is not None and value <= 0:
            raise ValueError("expected a positive duration")
        return value
    if isinstance(value, str):
        try:
            return parse_duration(float(value))  # "90" or "0.5": seconds
        except ValueError:
            pass
    match = _DURATION.match(str(value))
    if not isinstance(value, str) or not value.strip() or not match:
        raise ValueError("expected a duration such as 8h45m, 90m, 30s, or a number of seconds")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError("expected a positive duration")
    return total


class ProfileConfig(Section):
    start_step: int = Field(
        10,
        ge=1,
        description="The first step traced, counted from this session's first step (the first "
        "execution compiles: start after it).",
    )
    steps: int = Field(
        5,
        ge=1,
        description="How many steps to trace (whole executions of `steps_per_execution` steps).",
    )


class TrainConfig(Section):
    per_core_batch_size: int | None = Field(
        None,
        ge=1,
        description="The batch per replica: global batch = this x replicas. 16 when neither this nor "
        "`global_batch_size` is given.",
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Instead of `per_core_batch_size` (not both): the global batch, which must divide "
        "by the replica count.",
    )
    epochs: int = Field(
        10, ge=1, description="Epochs to train, counted over every session of the run."
    )
    steps_per_epoch: int | Auto = Field(
        "auto",
        description="An integer, or `auto`: train records // global batch (counted once and cached).",
    )
    validation_steps: int | Auto = Field(
        "auto",
        description="An integer, or `auto`: every validation record once (the last batch is padded "
        "with records weighted 0).",
    )
    steps_per_execution: int | Auto = Field(
        "auto",
        description="Batches per device call. `auto`: the largest divisor of the epoch's steps up to "
        "32 (1 where keras#19246 applies). An epoch is rounded down to whole executions.",
    )
    gradient_accumulation_steps: int = Field(
        1,
        ge=1,
        description="One optimizer update every N batches, with their mean gradient (for a batch "
        "that does not fit in memory): the effective batch, N x the global batch, is what the "
        "learning rate is scaled for; warmup and schedule count updates, steps count batches. An "
        "update may take batches of two epochs. Not with TensorFlow on several replicas.",
    )
    # A switch, not Keras' RematScope modes: "full" in a scope marks every operation, nested models
    # too (the forward recomputed once per level), and "activations"/"larger_than" mark single
    # operations, whose recomputation keeps about what the next layer keeps anyway. What saves
    # memory is MaxText's `remat_policy: full`: each repeated block recomputed once
    # (tpurun/training/remat.py says how, and why not RematScope).
    remat: bool = Field(
        False,
        description="Rematerialise: keep only each block's inputs for the backward pass and "
        "recompute the rest (a KerasHub backbone's transformer layers; in a factory's model, each "
        "layer that holds layers of its own, e.g. a Layer subclass or MultiHeadAttention). Less "
        "memory for activations, about one more forward pass per step, the same loss. A model "
        "without such a block is refused.",
    )
    learning_rate: LearningRateConfig = Field(
        default_factory=LearningRateConfig,
        description="The learning rate: its base, scaling with the effective batch, warmup and "
        "schedule.",
    )
    time_limit: float | None = Field(
        None,
        description="Stop cleanly with a checkpoint after this long (`8h45m`, `90m`, `30s` or seconds; "
        "also `--time-limit`), before a session's deadline: exit 3, and rerunning continues.",
    )
    profile: ProfileConfig | None = Field(
        None,
        description="`{start_step: N, steps: M}` (also `--profile N:M`): trace steps N to N+M-1 of "
        "this session with the backend's profiler into `<run>/plugins/profile/`.",
    )

    @field_validator("time_limit", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return parse_duration(value)

    @field_validator("steps_per_epoch", "validation_steps", "steps_per_execution", mode="before")
    @classmethod
    def _auto_or_positive(cls, value: Any) -> Any:
        # One clear message instead of pydantic's one-per-union-member.
        if value == "auto" or (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1
        ):
            return value
        raise ValueError("expected 'auto' or an integer >= 1")

    @model_validator(mode="after")
    def _one_batch_size(self) -> TrainConfig:
        if self.per_core_batch_size is not None and self.global_batch_size is not None:
            raise ValueError("give per_core_batch_size or global_batch_size, not both")
        return self
