"""Callbacks: progress reporting, the one stop path, early stopping and LR plateau, the user's.

:class:`RunControl` owns everything that ends or commits an epoch: a stop request (signal, time
limit, NaN) is saved at the step it lands on and ends ``fit`` there; a finished epoch writes its
CSV row, then its checkpoint. :class:`Progress` only reports. Keras calls callbacks in list order
and ``RunControl`` is last, so the stateful callbacks have updated their counters for the epoch
before it saves them.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tpurun import frameworks
from tpurun.config import Config
from tpurun.display.lines import THROUGHPUT
from tpurun.display.reporter import Reporter
from tpurun.errors import TpurunError
from tpurun.observe.callbacks import observers
from tpurun.plan.plan import Plan, resolve_monitor
from tpurun.storage import fileio
from tpurun.storage.rundir import EARLY_STOPPING_WEIGHTS, RunDir
from tpurun.training.checkpoints.adapter import is_lora
from tpurun.training.checkpoints.checkpointer import Checkpointer, step_offset
from tpurun.training.model import import_object
from tpurun.training.signals import Stop, StopNow
from tpurun.training.token_loss import TokenLoss
from tpurun.training.validation import correctable, exact_logs

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


class Progress(keras.callbacks.Callback):
    """Feeds the reporter: each execution as it starts, progress at a bounded rate (and at each
    epoch's last step, so the view ends on the epoch's numbers), the run's first execution (it
    compiles), validation; and times epochs and the first step.

    Deliberately *not* ``async_safe``. With it (and no other batch hook), Keras 3 on JAX reads each
    step's logs on a worker thread while the main thread computes metrics; with more simulated CPU
    devices than cores, XLA's all-reduce rendezvous then starves and aborts the process ("Expected
    8 threads to join the rendezvous, but only 7 of them arrived on time", reproduced with plain
    Keras too). On the main thread the logs cost one host sync per execution, which
    ``steps_per_execution`` amortises, and which Keras' own progress bar costs as well. Its
    ``on_test_batch_end`` keeps validation's batches on the main thread for the same reason.
    """

    def __init__(self, reporter: Reporter, plan: Plan):
        super().__init__()
        self.reporter = reporter
        self.plan = plan
        self.interval = reporter.progress_interval
        self.resume_at = (0, 0)  # (epochs done, steps into the next) where this fit starts
        self.epoch_seconds: list[float] = []
        self.epoch_rates: list[float] = []
        self.first_step_seconds: float | None = None
        self.step_cost: Any = None  # observe.throughput.StepCost, once measured
        self.epoch_throughput: list[dict] = []  # its figures for each epoch
        self._train_start = time.monotonic()
        self._epoch = 0

    def on_train_begin(self, logs=None):
        self._train_start = time.monotonic()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._offset = step_offset(self.resume_at, epoch)
        self._epoch_start = self._last_report = time.monotonic()
        self._validating = 0.0  # this epoch's seconds of validation, left out of its throughput
        self._rate_from = (self._epoch_start, self._offset)  # after the compiling execution, if any
        self.reporter.epoch_begin(self._epoch, self.plan.steps_per_epoch)

    def on_train_batch_begin(self, batch, logs=None):
        first = self._offset + batch + 1
        last = min(first + self.plan.steps_per_execution - 1, self.plan.steps_per_epoch)
        self.reporter.execution_begin(self._epoch, first, last)

    def on_train_batch_end(self, batch, logs=None):
        now = time.monotonic()
        step, steps = self._offset + batch + 1, self.plan.steps_per_epoch
        if self.first_step_seconds is None:
            self.first_step_seconds = now - self._train_start
            self.reporter.compiled(self.first_step_seconds, step - self._offset)
            if step < steps:
                self._rate_from = (now, step)
        elif now - self._last_report < self.interval and step < steps:
            return
        self._last_report = now
        since, from_step = (
            self._rate_from if step > self._rate_from[1] else (self._epoch_start, self._offset)
        )
        elapsed, done = now - since, step - from_step
        rate = done * self.plan.global_batch_size / elapsed if elapsed > 0 else 0.0
        eta = (steps - step) * elapsed / done if done else 0.0
        self.reporter.progress(self._epoch, step, steps, rate, eta, logs)

    def on_test_begin(self, logs=None):
        self._val_start = self._last_val_report = time.monotonic()
        self.reporter.validation_begin(self._epoch, self.plan.validation_steps)

    def on_test_batch_end(self, batch, logs=None):
        now = time.monotonic()
        if now - self._last_val_report >= self.interval:
            self._last_val_report = now
            self.reporter.validation_progress(self._epoch, batch + 1, self.plan.validation_steps)

    def on_test_end(self, logs=None):
        seconds = time.monotonic() - self._val_start
        self._validating += seconds
        self.reporter.validation_end(self._epoch, seconds)

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.monotonic() - self._epoch_start
        steps = self.plan.steps_per_epoch - self._offset
        # The rates are over the training steps' time, as MaxText and Keras' step time count it:
        # validation left out (its FLOPs are not in a step's count, and it would understate MFU).
        training = seconds - self._validating
        rate = steps * self.plan.global_batch_size / training if training > 0 else 0.0
        self.epoch_seconds.append(seconds)
        self.epoch_rates.append(rate)
        logs = dict(logs or {})
        if self.step_cost is not None:  # tokens/s, TFLOP/s a device, MFU: for the line only
            self.epoch_throughput.append(self.step_cost.epoch(steps, training))
            logs[THROUGHPUT] = self.epoch_throughput[-1]
        self.reporter.epoch_end(epoch + 1, logs, seconds, rate)


class ExactValidation(keras.callbacks.Callback):
    """First in the list: turns the padded validation's loss means into means over the records
    scored, before any other callback reads the epoch's logs (see :mod:`tpurun.infer.evaluate`)."""

    def __init__(self, scored: int, fed: int, reporter: Reporter):
        super().__init__()
        self.scored, self.fed, self.reporter = scored, fed, reporter
        self.exact = True

    def on_train_begin(self, logs=None):
        self.exact = correctable(self._model)
        if not self.exact and self.fed != self.scored:
            self.reporter.message(
                f"val_loss: a loss with a reduction other than Keras' default is averaged over "
                f"{self.fed} validation records, {self.fed - self.scored} of them padding weighted "
                "0; the val_ metrics are exact",
                "warn",
            )

    def on_epoch_end(self, epoch, logs=None):
        if self.exact and logs is not None and "val_loss" in logs:
            exact_logs(logs, self.model, self.scored, self.fed)


class RunControl(keras.callbacks.Callback):
    """The one stop path, and each finished epoch's commit.

    A stop request (SIGTERM/SIGINT, ``train.time_limit``; with several processes, the one they
    all agree on: :meth:`~tpurun.training.signals.Stop.agreed`) or a NaN/Inf loss is noticed once
    per execution. Mid-epoch, a stop saves the resume point at that step and raises
    :class:`StopNow`, which ends ``fit`` at once, skipping the validation pass Keras would
    otherwise run first (a preempted VM has seconds). A NaN saves nothing: the last good
    checkpoint stays. At an epoch's last step, the epoch end decides: a NaN epoch writes no row
    and no checkpoint; otherwise the CSV row, then the checkpoint (a resume drops rows past the
    checkpoint, so a kill between the two leaves neither a gap nor a duplicate).
    """

    def __init__(
        self, run: RunDir, checkpointer: Checkpointer, stop: Stop, *, steps_per_epoch: int,
        watch_nan: bool, log: str | None,
    ):  # fmt: skip
        super().__init__()
        self.run = run
        self.checkpointer = checkpointer
        self.stop = stop
        self.steps_per_epoch = steps_per_epoch
        self.watch_nan = watch_nan
        self.log = log
        self.committed: Callable[[int, dict], None] | None = None  # after each epoch's commit
        self._epoch = 0

    def _nan(self, logs: Mapping[str, Any] | None) -> bool:
        loss = (logs or {}).get("loss")
        return self.watch_nan and loss is not None and not math.isfinite(float(loss))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        self.checkpointer.restore_metrics(self._model, epoch)  # no JAX state sync needed here

    def _agreed(self, save: str | None = None) -> tuple[bool, str | None]:
        """Whether to stop, and which mid-epoch save is due, as every process sees it
        (:meth:`Stop.agreed`: with several processes, every one stops at the same step)."""
        stopping, by_clock = self.stop.agreed(time.monotonic(), save == "every_minutes")
        if save != "every_steps":  # step-counted saves agree by themselves
            save = "every_minutes" if by_clock else None
        return stopping, save

    def on_train_batch_end(self, batch, logs=None):
        self.checkpointer.poll()  # sharded saves finished in the background are committed
        step = step_offset(self.checkpointer.resume_at, self._epoch) + batch + 1
        if self._nan(logs) and self.stop.nan_at is None:
            self.stop.nan_at = (self._epoch + 1, step)  # the loss is global: seen everywhere
        due = self.checkpointer.due(self._epoch, step) if step < self.steps_per_epoch else None
        stopping, due = self._agreed(due)
        if stopping or self.stop.nan_at is not None:
            if step >= self.steps_per_epoch:
                self._model.stop_training = True  # the epoch end commits it, or not (NaN)
                return
            if self.stop.nan_at is None:
                self.checkpointer.save_latest(self.model, self._epoch, step, self.stop.reason)
            raise StopNow
        if due:  # the epoch end saves anyway: no mid-epoch save is due at its last step
            self.checkpointer.save_latest(self.model, self._epoch, step, due)

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        if self._nan(logs) and self.stop.nan_at is None:
            self.stop.nan_at = (epoch + 1, self.steps_per_epoch)
        if self.stop.nan_at is not None:
            self._model.stop_training = True
            return  # a NaN epoch is not a checkpoint, nor a row of the log
        if self.log:
            self.run.append_log(self.log, epoch, logs)
        committed = self.committed
        # `committed` once the resume point is: a sharded one, when its folder is complete.
        then = None if committed is None else lambda: committed(epoch + 1, logs)
        self.checkpointer.epoch_end(self.model, epoch, logs, then)
        if self._agreed()[0]:
            self._model.stop_training = True  # asked (or out of time) during validation

    def on_train_end(self, logs=None):
        self.checkpointer.finish()  # the sharded saves still in flight, committed


class _Resumable:
    """A Keras callback whose counters survive a restart (and a second ``fit`` in one run).

    Keras resets them in ``on_train_begin``; this keeps them: the state a resume brought
    (``pending``), else the state the previous ``fit`` of this run ended with.
    """

    STATE: tuple[str, ...] = ()
    pending: dict | None = None

    def on_train_begin(self, logs=None):
        carry = self.pending if self.pending is not None else self.get_state()
        super().on_train_begin(logs)
        self.pending = None
        for key in self.STATE:
            if carry.get(key) is not None:
                setattr(self, key, carry[key])

    def get_state(self) -> dict:
        def plain(value: Any) -> Any:  # numpy scalars -> JSON numbers (inf stays)
            return value.item() if isinstance(value, (np.floating, np.integer)) else value

        return {k: plain(getattr(self, k, None)) for k in self.STATE}

    def save_state(self, run: RunDir) -> dict:
        return self.get_state()

    def restore_state(self, saved: dict, folder: str) -> None:
        self.pending = saved


class _Trained:
    """A model as Keras' EarlyStopping sees it in a LoRA run: its weights are its trainable ones."""

    def __init__(self, model: Any):
        self._model = model

    def get_weights(self) -> list:
        return [
            np.asarray(keras.ops.convert_to_numpy(v.value)) for v in self._model.trainable_variables
        ]

    def set_weights(self, weights: list) -> None:
        for variable, value in zip(self._model.trainable_variables, weights, strict=True):
            variable.assign(value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class EarlyStopping(_Resumable, keras.callbacks.EarlyStopping):
    """Keras' EarlyStopping, resumable, best weights included.

    Keras restores the best weights in ``on_train_end`` whenever ``restore_best_weights`` is set;
    tpurun runs ``fit`` more than once per run (a resume mid-epoch, a NaN restore), so they are
    restored only when the run really ends: an early stop, or the last epoch done.
    """

    STATE = ("wait", "stopped_epoch", "best", "best_epoch")

    def __init__(self, *, total_epochs: int, **kwargs):
        super().__init__(**kwargs)
        self.total_epochs = total_epochs
        self._epochs_seen = 0
        self._saved_best_epoch: int | None = None

    @property
    def model(self):
        # A LoRA run's best weights are those that train (the adapter, a head): the frozen base
        # stays the preset's, and a copy of it at every improvement (GBs for a 2B model) would
        # fill the host's memory and the checkpoint folder.
        model = super().model
        return _Trained(model) if is_lora(model) else model

    def on_train_begin(self, logs=None):
        weights = self.best_weights  # Keras forgets them here
        super().on_train_begin(logs)
        self.best_weights = weights

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        self._epochs_seen = epoch + 1

    def on_train_end(self, logs=None):
        if self.stopped_epoch > 0 or self._epochs_seen >= self.total_epochs:
            super().on_train_end(logs)

    def save_state(self, run: RunDir) -> dict:
        """The counters, and the best weights' file (``restore_best_weights``), written when they
        changed."""
        state = self.get_state()
        state["best_weights_file"] = None
        if self.restore_best_weights and self.best_weights is not None:
            if self._saved_best_epoch != self.best_epoch:
                weights = self.best_weights

                def write(tmp: str) -> None:
                    with open(tmp, "wb") as f:
                        np.savez(f, *weights)

                run.save_checkpoint(EARLY_STOPPING_WEIGHTS, write)
                self._saved_best_epoch = self.best_epoch
            state["best_weights_file"] = EARLY_STOPPING_WEIGHTS
        return state

    def restore_state(self, saved: dict, folder: str) -> None:
        super().restore_state(saved, folder)
        if saved.get("best_weights_file"):
            data = fileio.read_bytes(fileio.join(folder, saved["best_weights_file"]))
            with np.load(io.BytesIO(data)) as npz:
                self.best_weights = [npz[f"arr_{i}"] for i in range(len(npz.files))]
            self._saved_best_epoch = saved.get("best_epoch")


class ReduceLROnPlateau(_Resumable, keras.callbacks.ReduceLROnPlateau):
    """Keras' ReduceLROnPlateau, resumable (the learning rate itself is an optimizer variable,
    saved with the weights; this keeps the counters)."""

    STATE = ("wait", "cooldown_counter", "best")


def apply_monitor_modes(modes: Mapping[str, str], control: RunControl) -> None:
    """Give the checkpoint and the stateful callbacks the directions :func:`tpurun.training.monitored.resolve_monitors`
    settled (Keras' own read it at their first epoch end)."""
    checkpointer = control.checkpointer
    if checkpointer.save_best:
        checkpointer.mode = modes["checkpoint"]
    for callback in checkpointer.stateful.values():
        key = "early_stopping" if isinstance(callback, EarlyStopping) else "reduce_lr_on_plateau"
        callback.mode = modes[key]


def build_callbacks(
    config: Config, plan: Plan, run: RunDir, reporter: Reporter, stop: Stop, identity: dict,
    sharded: bool = False,
) -> tuple[list[Any], Progress, RunControl]:  # fmt: skip
    """The callback list for ``fit``, plus the two tpurun reads results from.

    The resume point is always kept (``callbacks.checkpoint: null`` only turns off the best and
    pattern-named models): a run directory can always be resumed. ``sharded``: the model is
    split over a mesh's model axis (``ActiveRuntime.sharded``): its checkpoints are too.
    """
    cb = config.callbacks
    progress = Progress(reporter, plan)
    stateful: list[Any] = []
    if cb.reduce_lr_on_plateau is not None:
        r = cb.reduce_lr_on_plateau
        stateful.append(
            ReduceLROnPlateau(
                monitor=resolve_monitor(config, r.monitor), factor=r.factor, patience=r.patience,
                min_lr=r.min_lr, min_delta=r.min_delta, cooldown=r.cooldown, mode=r.mode,
            )
        )  # fmt: skip
    if cb.early_stopping is not None:
        e = cb.early_stopping
        stateful.append(
            EarlyStopping(
                monitor=resolve_monitor(config, e.monitor), patience=e.patience,
                min_delta=e.min_delta, mode=e.mode, restore_best_weights=e.restore_best_weights,
                total_epochs=config.train.epochs,
            )
        )  # fmt: skip
    extra = [_user_callback(spec, config) for spec in cb.extra]
    ck = cb.checkpoint
    checkpointer = Checkpointer(
        run,
        steps_per_epoch=plan.steps_per_epoch,
        monitor=plan.monitor,
        mode=None,  # settled by resolve_monitors from the compiled model
        save_best=ck is not None,
        save_best_only=ck.save_best_only if ck else True,
        filename=ck.filename if ck else None,
        keep=ck.keep if ck else None,
        every_steps=ck.every_steps if ck else None,
        every_minutes=ck.every_minutes if ck else None,
        stateful=stateful,
        identity=identity,
        sharded=sharded,
    )
    control = RunControl(
        run, checkpointer, stop, steps_per_epoch=plan.steps_per_epoch,
        watch_nan=cb.on_nan != "ignore", log=cb.csv_log.filename if cb.csv_log else None,
    )  # fmt: skip
    first = []
    if plan.validation_steps:
        fed = plan.validation_steps * plan.global_batch_size
        first.append(ExactValidation(plan.validation_scored, fed, reporter))
    if config.model.preset is not None:  # a causal LM's loss per token (keras_hub is there)
        first.append(TokenLoss())
    seen = observers(  # input wait, TensorBoard, a profile, the learning rate
        config, plan, run, reporter, progress=progress, checkpointer=checkpointer
    )
    return [
        *first, *seen.before_progress, progress, *seen.after_progress, *stateful, *extra,
        *seen.last, control,
    ], progress, control  # fmt: skip


def _user_callback(spec: Any, config: Config) -> Any:
    cls = import_object(spec.name, config.base_dir, "callbacks.extra")
    try:
        callback = cls(**spec.kwargs)
    except Exception as exc:
        raise TpurunError(f"callbacks.extra '{spec.name}': {type(exc).__name__}: {exc}") from None
    if not isinstance(callback, keras.callbacks.Callback):
        raise TpurunError(
            f"callbacks.extra '{spec.name}' made a {type(callback).__name__}, not a "
            "keras.callbacks.Callback."
        )
    return callback
