"""The learning-rate schedule: warmup and decay in the batches Keras reads it at, and how a resumed
run of another length continues it.

Built-in Keras schedules only, so that ``model.keras`` (whose optimizer carries the schedule)
loads with plain Keras, without tpurun.
"""

from __future__ import annotations

from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.errors import TpurunError
from tpurun.plan.plan import Plan


def schedule_shape(config: Config, plan: Plan) -> dict[str, float]:
    """Where the schedule's warmup ends and how long its decay lasts, in batches (what Keras
    reads the schedule at): ``{"warmup_steps", "decay_steps"}``, as this config sets them.

    Under gradient accumulation (N batches an update) Keras reads the schedule at the count of
    *batches*, and applies update ``k`` (from 0) at batch ``k*N + N-1``
    (``base_optimizer._backend_apply_gradients``): the schedule is then stretched N times and
    moved N-1 batches later, so update ``k`` gets the very rate step ``k`` gets without
    accumulation. A wrapper schedule dividing the step by N would do it too, but would be
    tpurun's class, which ``keras.saving.load_model`` could not find without tpurun.
    """
    n = config.train.gradient_accumulation_steps
    warmup, total = plan.warmup_steps, plan.total_steps  # in updates
    return {"warmup_steps": warmup * n + n - 1, "decay_steps": max(1, total - warmup) * n}


def continued_shape(
    saved: dict[str, float] | None,
    configured: dict[str, float],
    batches_done: int,
    decays: bool = True,
) -> tuple[dict[str, float], str | None]:
    """The schedule a resumed run continues with, and one line when it is not the configured one.

    A run resumed with another length (``train.epochs`` raised or lowered) keeps its learning
    rate continuous: the decay left at the resume step is stretched (or squeezed) over the
    batches left to the new end, from where it is. A plain rebuild over the new length would jump
    (a cosine at 80% of 5 epochs is at 40% of 10: the rate would go up at the resume), and
    keeping the old horizon would leave the added epochs at the decay's end rate (0 for a
    cosine). Before the decay has begun (in the warmup), the configured schedule is already
    continuous. ``saved`` is the shape the checkpoint was trained with (None in checkpoints from
    before it was recorded: the configured one is taken). ``decays``: a cosine schedule (a
    constant one is the same at every step, whatever its shape).

    Raises:
        TpurunError: the run is made longer after its cosine decay ended: the added epochs would
            train at rate 0 and change nothing.
    """
    if saved is None or saved == configured or not decays:
        return configured, None
    end = configured["warmup_steps"] + configured["decay_steps"]
    if end == saved["warmup_steps"] + saved["decay_steps"]:
        return saved, None  # stretched in an earlier session, to this very end
    if batches_done <= saved["warmup_steps"]:
        return configured, None
    done = min(1.0, (batches_done - saved["warmup_steps"]) / saved["decay_steps"])
    if done >= 1.0:
        raise TpurunError(
            f"train.epochs: the run's cosine learning-rate schedule decayed to 0 at step "
            f"{batches_done:,}, where it stopped: more epochs would train at rate 0 and change "
            "nothing. To train on from its weights with a new schedule, start a new run from "
            "them: --resume RUN_DIR/model.keras --set name=NEW_NAME (a warm start: epoch 1, a "
            "fresh optimizer); or set train.learning_rate.schedule: constant."
        )
    if end <= batches_done:  # shortened to where it is: the run has trained its epochs
        return configured, None
    decay = (end - batches_done) / (1.0 - done)
    shape = {"warmup_steps": batches_done - done * decay, "decay_steps": decay}
    return shape, (
        f"learning rate: the run's length changed, so the decay left at step {batches_done:,} "
        f"({done:.0%} done) is stretched to end at step {end:,}; the rate goes on from its "
        "value there (docs/resume.md)."
    )


def learning_rate_schedule(
    config: Config, plan: Plan, scale: float = 1.0, shape: dict[str, float] | None = None
) -> Any:
    """A float, or a built-in Keras schedule (so ``model.keras`` loads without tpurun).

    ``scale`` multiplies it throughout (``callbacks.on_nan: restore`` cuts the learning rate).
    ``shape``: where the warmup ends and how long the decay lasts (:func:`schedule_shape`, or
    what :func:`continued_shape` made of it on a resume).
    """
    keras = frameworks.keras()

    lr = config.train.learning_rate
    peak = plan.learning_rate * scale
    n = config.train.gradient_accumulation_steps
    warmup = plan.warmup_steps  # in updates
    if lr.schedule == "constant" and warmup == 0:
        return peak
    shape = shape or schedule_shape(config, plan)
    # CosineDecay covers all cases: linear warmup to `peak` over the warmup, then cosine decay
    # to 0 over the remaining updates; alpha=1 makes the "decay" a constant. The warmup starts at
    # peak/warmup, not 0: the first update uses lr(0), and 0 would waste it.
    start = peak / warmup if warmup else peak
    if warmup:
        # The warmup's straight line in batches, through (k*N + N-1, rate of update k): it
        # starts N-1 batches before the first update, so a little lower.
        start -= (peak - start) * (n - 1) / (warmup * n)
    # Without a warmup (and N > 1), a flat one at the peak over the N-1 batches before the first
    # update moves the decay's start to that update. A stretched shape starts its decay where a
    # longer one would have been at that point (its warmup end may lie before 0: only the decay
    # after the resume step is ever read).
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=start,
        decay_steps=shape["decay_steps"],
        alpha=1.0 if lr.schedule == "constant" else 0.0,
        warmup_target=peak if shape["warmup_steps"] else None,
        warmup_steps=shape["warmup_steps"],
    )
