"""The callbacks that let a person see the training: the input wait (measured here, judged in
:mod:`tpurun.observe.input_wait`), TensorBoard, a profile, and the learning rate in each epoch's logs (for
the CSV log and the curves).

:func:`observers` makes them; :func:`tpurun.training.callbacks.build.build_callbacks` places them around its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.display.reporter import Reporter
from tpurun.observe.input_wait import KEY, measurable
from tpurun.observe.profile import Profile
from tpurun.observe.tensorboard import TensorBoardLog
from tpurun.observe.tracker_log import TrackerLog
from tpurun.plan.plan import Plan
from tpurun.storage.rundir import RunDir

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


class _TimedIterator:
    """The batch iterator ``train_function`` reads, adding the seconds each ``next()`` took."""

    __slots__ = ("_iterator", "_owner")

    def __init__(self, iterator: Any, owner: InputWait):
        self._iterator, self._owner = iterator, owner

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            return next(self._iterator)
        finally:
            self._owner.waited += time.perf_counter() - start


class InputWait(keras.callbacks.Callback):
    """Per epoch, the seconds spent in ``next()`` over the training part of the epoch (from its
    start to its last step's end: validation is left out).

    Placed before :class:`~tpurun.training.callbacks.progress.Progress`, it puts the epoch's share into the epoch
    logs as ``input_wait`` so the progress line shows it; :class:`Withdraw`, right after
    ``Progress``, takes it out again, so the CSV log, the checkpoints and the user's callbacks see
    the model's metrics only (a resumed run's log must equal an unbroken run's).
    """

    def __init__(self, plan: Plan):
        super().__init__()
        self.enabled = measurable(plan)
        self.epoch_waits: list[tuple[float, float]] = []  # (seconds waiting, seconds training)
        self.epoch_value: float | None = None  # this epoch's share, once it ended
        self.waited = 0.0
        self._start = self._last_end = 0.0

    def on_train_begin(self, logs=None):
        # fit() has made its train_function by now (both backends); a rebuilt one (a NaN
        # restore with a schedule) is wrapped again.
        model = self._model
        function = getattr(model, "train_function", None)
        if not self.enabled or function is None or getattr(function, "_tpurun_timed", False):
            return

        if keras.backend.backend() == "jax":

            def timed(state, iterator):
                return function(state, _TimedIterator(iterator, self))
        else:

            def timed(iterator):
                return function(_TimedIterator(iterator, self))

        timed._tpurun_timed = True
        model.train_function = timed

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_value = None
        self.waited = 0.0
        self._start = self._last_end = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self._last_end = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = self._last_end - self._start
        if not self.enabled or seconds <= 0:
            return
        fraction = min(1.0, self.waited / seconds)
        self.epoch_waits.append((self.waited, seconds))
        self.epoch_value = fraction
        if logs is not None:
            logs[KEY] = round(fraction, 4)


class Withdraw(keras.callbacks.Callback):
    """Takes ``input_wait`` back out of the epoch logs once the progress line has shown it."""

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.pop(KEY, None)


def next_update_rate(optimizer: Any, read: Callable[[Any, int], Any]) -> float | None:
    """The learning rate of the optimizer's next update (a schedule's current value); None for an
    optimizer without one learning rate. ``read(schedule, batch)`` evaluates a schedule.

    ``optimizer.learning_rate`` reads a schedule at the count of batches. Under gradient
    accumulation (N batches an update) Keras applies update ``k`` at batch ``k*N + N-1``, with the
    schedule read there (``base_optimizer._backend_apply_gradients``), and tpurun's schedule is
    built for that (:func:`tpurun.training.schedule.learning_rate_schedule`): so the next update's
    rate is the schedule's at that batch, which is what the logs show, as unaccumulated runs do.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # mixed_float16's LossScaleOptimizer
    try:
        n = getattr(inner, "gradient_accumulation_steps", None) or 1
        schedule = getattr(inner, "_learning_rate", None)
        if isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            updates = int(keras.ops.convert_to_numpy(inner.iterations))  # Keras': batches // N
            value = read(schedule, updates * n + n - 1)
        else:
            value = inner.learning_rate
        return float(keras.ops.convert_to_numpy(value))
    except (AttributeError, TypeError, ValueError):
        return None


class LearningRateLog(keras.callbacks.Callback):
    """Puts the epoch's learning rate into its logs as ``learning_rate`` (Keras' own TensorBoard
    and ReduceLROnPlateau callbacks do the same), so ``log.csv``, TensorBoard and the curves have
    it: the rate of the next optimizer update (:func:`next_update_rate`).

    The schedule is read through a compiled function, made once: called op by op, Keras' warmup
    ``cond`` and cosine took 33-36 ms on the JAX backend at every epoch's end (1.1 s of the
    quickstart's 30 epochs); compiled, 0.1 ms after the first."""

    def __init__(self):
        super().__init__()
        self._compiled: dict[Any, Callable] = {}  # by schedule (a NaN restore makes a new one)

    def _read(self, schedule: Any, batch: int) -> Any:
        fn = self._compiled.get(schedule)
        if fn is None:
            fn = self._compiled[schedule] = _compile(schedule.__call__)
        return fn(batch)

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or "learning_rate" in logs:
            return
        rate = next_update_rate(getattr(self._model, "optimizer", None), self._read)
        if rate is not None:
            logs["learning_rate"] = rate


def _compile(fn: Callable) -> Callable:
    """``fn`` compiled for the backend Keras runs on (as it is elsewhere)."""
    backend = keras.backend.backend()
    if backend == "jax":
        return frameworks.jax().jit(fn)
    if backend == "tensorflow":
        return frameworks.tensorflow().function(fn)
    return fn


@dataclass
class Observers:
    """Where each goes in the list: ``before_progress`` (so the progress line can show the input
    wait), ``after_progress`` (right after it), ``last`` (just before the stop path)."""

    before_progress: list[Any] = field(default_factory=list)
    after_progress: list[Any] = field(default_factory=list)
    last: list[Any] = field(default_factory=list)


def observers(
    config: Config, plan: Plan, run: RunDir, reporter: Reporter, *, progress: Any, checkpointer: Any
) -> Observers:
    """The observing callbacks for a run. TensorBoard and the profile write into the run
    directory, so only the process that writes it gets them."""
    wait = InputWait(plan)
    out = Observers(before_progress=[wait], after_progress=[Withdraw()])
    profile = config.train.profile
    if profile is not None and run.writer:
        out.before_progress.insert(
            0,
            Profile(
                run,
                plan.backend,
                profile.start_step,
                profile.steps,
                plan.steps_per_execution,
                reporter,
            ),
        )
    out.last.append(LearningRateLog())
    tensorboard = config.callbacks.tensorboard
    if tensorboard is not None and run.writer:
        out.last.append(
            TensorBoardLog(
                run,
                plan.steps_per_epoch,
                tensorboard.loss_every_steps,
                checkpointer=checkpointer,
                progress=progress,
                input_wait=wait,
            )
        )
    if config.observe.trackers and run.writer:  # MLflow, W&B: their SDKs only when named
        out.last.append(
            TrackerLog(
                config,
                run,
                reporter,
                steps_per_epoch=plan.steps_per_epoch,
                progress=progress,
                input_wait=wait,
            )
        )
    return out


def epoch_waits(callbacks: Sequence[Any]) -> list[tuple[float, float]]:
    """The ``(seconds waiting, seconds training)`` of each epoch, from a callback list."""
    for callback in callbacks:
        if isinstance(callback, InputWait):
            return list(callback.epoch_waits)
    return []
