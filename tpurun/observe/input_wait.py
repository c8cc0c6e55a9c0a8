"""Input wait: the share of the training loop's time spent waiting for the next batch.

Kaggle's TPU monitor calls it idle time; Levanter logs it as ``throughput/loading_time``. Keras 3
fetches batches *inside* ``model.train_function`` on both backends (JAX: ``next(iterator)`` before
each step of an execution; TensorFlow: ``iterator.get_next()`` in the graph), not between
``on_train_batch_end`` and the next ``on_train_batch_begin``: timing the gap between those hooks
measures nothing. So :class:`tpurun.observe.callbacks.InputWait` wraps ``train_function`` and hands it the iterator behind a
proxy that times each ``next()``: two clock reads per batch, with the pipeline untouched.

On TensorFlow a Python iterator makes Keras take its eager path (each step a ``tf.function`` call
fed by ``next()``), which runs the same step function; it is taken only with one step per
execution and no TPU (where the graph's own loop is what ``steps_per_execution`` buys). Elsewhere
on TensorFlow the wait cannot be told from compute and is not measured (None).

With JAX's asynchronous dispatch, the host may wait in ``next()`` while the accelerator is still
busy with earlier steps: a pipeline almost fast enough can read higher here than the accelerator's
own idle time. ``tpurun data bench`` measures the pipeline alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from tpurun.plan.plan import Plan

KEY = "input_wait"  # in the epoch logs while the progress line is made, then taken out
INPUT_BOUND = 0.4  # at least this share waiting: the input pipeline limits training
COMPUTE_BOUND = 0.15  # below this share: the model's steps do
JUDGED_SECONDS = 1.0  # of training measured (after the first epoch) before a verdict is given


def measurable(plan: Plan) -> bool:
    """Whether the input wait can be measured for this plan (see the module's docstring)."""
    if plan.backend == "jax":
        return True
    return plan.steps_per_execution == 1 and plan.accelerator != "tpu"


def _steady(waits: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    # The first epoch includes compiling the step and filling the shuffle buffer: left out when
    # there are others, as for examples/s.
    return list(waits[1:] or waits)


def overall(waits: Sequence[tuple[float, float]]) -> float | None:
    """The run's share of time waiting for data (None: not measured)."""
    steady = _steady(waits)
    total = sum(seconds for _, seconds in steady)
    return min(1.0, sum(w for w, _ in steady) / total) if total > 0 else None


def verdict(waits: Sequence[tuple[float, float]], config_file: str) -> tuple[str, str] | None:
    """What the input wait says about the run, and the message level; None when it was not
    measured, measured only on the first epoch (which compiles), or over too short a time to
    judge (a few seconds of a toy run).

    Args:
        waits: ``(seconds waiting, seconds training)`` per epoch.
        config_file: the config to name in ``tpurun data bench`` (the run's ``config.yaml``).
    """
    fraction = overall(waits)
    if len(waits) < 2:
        return None  # only the epoch that compiled: its wait is diluted by the compile time
    if fraction is None or sum(seconds for _, seconds in _steady(waits)) < JUDGED_SECONDS:
        return None
    share = f"{fraction:.0%} of the training loop's time waiting for the next batch"
    if fraction >= INPUT_BOUND:
        return (
            f"input-bound: {share}. The model waits while the input pipeline catches up: "
            f"measure the pipeline alone with `tpurun data bench {config_file}`; data.cache: memory "
            "(when the records fit), smaller stored images (`tpurun data write --image-size`), or "
            "more shards read in parallel help",
            "warn",
        )
    if fraction < COMPUTE_BOUND:
        return f"compute-bound: {share}; the input pipeline keeps up", "note"
    return (
        f"partly input-bound: {share}; `tpurun data bench {config_file}` measures the input "
        "pipeline alone",
        "note",
    )


def fractions(waits: Sequence[tuple[float, float]]) -> list[float]:
    """Each epoch's share of time waiting, rounded for ``summary.json``."""
    return [round(min(1.0, w / s), 4) for w, s in waits if s > 0]
