"""Callbacks: progress and NaN guard, host-side checkpoints, CSV log, LR plateau, early stop, user's.

Checkpoints are written by Keras' ``.keras`` / ``.weights.h5`` savers, which copy the variables to
the host and write from there, so a TPU never has to reach the local disk. Every file is written
under a temporary name and renamed (or copied, for remote paths), so a kill leaves the previous
checkpoint readable.
"""

from __future__ import annotations

import glob as globlib
import math
import os
import re
import time
from collections.abc import Sequence
from typing import Any

import keras  # imported only after process.activate() has chosen the backend
import numpy as np

from tpurun.config import Config
from tpurun.console import Reporter
from tpurun.errors import ConfigError, TpurunError
from tpurun.fileio import save_atomically, write_json
from tpurun.model import import_object
from tpurun.plan import Plan, resolve_monitor, resolve_monitor_mode
from tpurun.resume import CHECKPOINTS, LATEST_STATE, state_file
from tpurun.stopping import Stop, StopNow

BEST_MODEL = "best.keras"


class Progress(keras.callbacks.Callback):
    """Feeds the reporter at a bounded rate, and stops training on a NaN or Inf loss.

    Deliberately *not* ``async_safe``. With it (and no other batch hook), Keras 3 on JAX reads each
    step's logs on a worker thread while the main thread computes metrics; with more simulated CPU
    devices than cores, XLA's all-reduce rendezvous then starves and aborts the process ("Expected
    8 threads to join the rendezvous, but only 7 of them arrived on time", reproduced with plain
    Keras too). On the main thread the logs cost one host sync per execution, which
    ``steps_per_execution`` amortises, and which Keras' own progress bar costs as well.
    """

    def __init__(self, reporter: Reporter, plan: Plan, stop_on_nan: bool, stop: Stop):
        super().__init__()
        self.stop = stop
        self.reporter = reporter
        self.plan = plan
        self.stop_on_nan = stop_on_nan
        self.interval = reporter.progress_interval
        self.resume_at = (0, 0)  # (epochs done, steps into the next) where this fit starts
        self.epoch_seconds: list[float] = []
        self.epoch_rates: list[float] = []
        self.first_step_seconds: float | None = None
        self._train_start = time.monotonic()

    def on_train_begin(self, logs=None):
        self._train_start = time.monotonic()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._offset = step_offset(self.resume_at, epoch)
        self._epoch_start = time.monotonic()
        self._last_report = self._epoch_start
        self.reporter.epoch_begin(self._epoch, self.plan.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        now = time.monotonic()
        step = self._offset + batch + 1
        steps = self.plan.steps_per_epoch
        if self.first_step_seconds is None:
            self.first_step_seconds = now - self._train_start
        loss = (logs or {}).get("loss")
        nan = self.stop_on_nan and loss is not None and not math.isfinite(loss)
        if nan and self.stop.nan_at is None:
            self.stop.nan_at = (self._epoch, step)
        if (nan or self.stop.requested(now)) and not self._model.stop_training:
            self._model.stop_training = True
            if step < steps:
                self.stop.cut_at = (self._epoch, step)
        if now - self._last_report < self.interval or step >= steps:
            return
        self._last_report = now
        elapsed = now - self._epoch_start
        done = step - self._offset
        rate = done * self.plan.global_batch_size / elapsed if elapsed > 0 else 0.0
        eta = (steps - step) * elapsed / done
        self.reporter.progress(self._epoch, step, steps, rate, eta, logs)

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.monotonic() - self._epoch_start
        steps = self.plan.steps_per_epoch - self._offset
        rate = steps * self.plan.global_batch_size / seconds if seconds else 0.0
        self.epoch_seconds.append(seconds)
        self.epoch_rates.append(rate)
        logs = dict(logs or {})
        if self.stop_on_nan and not math.isfinite(logs.get("loss", 0.0)):
            self.stop.nan_at = self.stop.nan_at or (epoch + 1, self.plan.steps_per_epoch)
            self.stop.cut_at = self.stop.cut_at or (epoch + 1, self.plan.steps_per_epoch)
            self._model.stop_training = True
        elif self.stop.requested(time.monotonic()):
            self._model.stop_training = True  # asked (or out of time) during validation
        self.reporter.epoch_end(epoch + 1, logs, seconds, rate)


def step_offset(resume_at: tuple[int, int], epoch: int) -> int:
    """Steps already done in (0-based) ``epoch`` before this ``fit`` began: a mid-epoch resume."""
    return resume_at[1] if epoch == resume_at[0] else 0


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

    def save_best_weights(self, folder: str) -> str | None:
        """Write the best weights (``restore_best_weights``) when they changed; return the file."""
        if not self.restore_best_weights or self.best_weights is None:
            return None
        name = "early_stopping_best.npz"
        if self._saved_best_epoch != self.best_epoch:
            weights = self.best_weights

            def write(tmp: str) -> None:
                with open(tmp, "wb") as f:
                    np.savez(f, *weights)

            save_atomically(os.path.join(folder, name), write)
            self._saved_best_epoch = self.best_epoch
        return name

    def load_best_weights(self, path: str) -> None:
        with np.load(path) as npz:
            self.best_weights = [npz[f"arr_{i}"] for i in range(len(npz.files))]
        self._saved_best_epoch = (self.pending or {}).get("best_epoch")


class ReduceLROnPlateau(_Resumable, keras.callbacks.ReduceLROnPlateau):
    """Keras' ReduceLROnPlateau, resumable (the learning rate itself is an optimizer variable,
    saved with the weights; this keeps the counters)."""

    STATE = ("wait", "cooldown_counter", "best")


class CSVLogger(keras.callbacks.CSVLogger):
    """Keras' CSVLogger, always appending (a resumed run's log goes on), and writing no row for an
    epoch cut short by a stop or a NaN: the log holds finished epochs only."""

    def __init__(self, filename: str, stop: Stop):
        super().__init__(filename, append=True)
        self.stop = stop

    def on_epoch_end(self, epoch, logs=None):
        if not self.stop.cut_short(epoch + 1):
            super().on_epoch_end(epoch, logs)


class RunCheckpoint(keras.callbacks.Callback):
    """The run's resume point, and the best (and pattern-named) models.

    ``latest.json`` is the resume point: it names the weights file it goes with (weights and
    optimizer state) and records the position (epochs done, steps into the next), the best value,
    the state of the stateful callbacks, and, mid-epoch, the running metric sums. It is written
    last, after its weights, and replaced atomically, so it always names a complete file: a kill
    at any instant leaves the previous resume point intact. It is saved at each epoch end, every
    ``every_steps`` / ``every_minutes`` (checked once per execution), and when a stop is asked.
    """

    def __init__(
        self, folder: str, *, stop: Stop, steps_per_epoch: int, monitor: str, mode: str,
        save_best: bool = True, save_best_only: bool = True, filename: str | None = None,
        keep: int | None = None, every_steps: int | None = None,
        every_minutes: float | None = None, stateful: Sequence[Any] = (),
        identity: dict | None = None,
    ):  # fmt: skip
        super().__init__()
        self.folder = folder
        self.stop = stop
        self.steps_per_epoch = steps_per_epoch
        self.monitor = monitor
        self.mode = mode
        self.save_best = save_best
        self.save_best_only = save_best_only
        self.filename = filename
        self.keep = keep
        self.every_steps = every_steps
        self.every_seconds = every_minutes * 60 if every_minutes else None
        self.stateful = {type(c).__name__: c for c in stateful}
        self.identity = identity or {}
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.resume_at = (0, 0)  # (epochs done, steps into the next) where this fit starts
        self.position = (0, 0)  # the same, as of the last save
        self.lr_scale = 1.0  # on_nan: restore cuts the learning rate; kept for later sessions
        self.last_logs: dict[str, float] = {}  # the last finished epoch's metrics
        self.metrics_state: list | None = None  # running metric sums to restore mid-epoch
        self._epoch = 0
        self._last_save = (0, time.monotonic())  # (global step, time)

    # ------------------------------------------------------------------ resume
    def restore(self, state: dict, folder: str) -> None:
        """Take up a saved state: best value, callback counters, metric sums, position."""
        self.best, self.best_epoch = state.get("best"), state.get("best_epoch")
        for name, saved in (state.get("callbacks") or {}).items():
            callback = self.stateful.get(name)
            if callback is None:
                continue  # that callback is no longer configured: a harmless change
            callback.pending = saved
            best_file = saved.get("best_weights_file")
            if best_file and isinstance(callback, EarlyStopping):
                callback.load_best_weights(os.path.join(folder, best_file))
        self.resume_at = self.position = (int(state["epoch"]), int(state.get("step", 0)))
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.last_logs = dict(state.get("logs") or {})
        self.metrics_state = state.get("metrics") if self.resume_at[1] else None
        self._last_save = (self._global_step(*self.resume_at), time.monotonic())

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self.metrics_state is not None and epoch == self.resume_at[0]:
            # Keras has just reset the metrics; a resumed epoch goes on from the saved sums, so
            # its CSV row is the whole epoch's. (self._model: no JAX state sync needed here.)
            variables = self._model.metrics_variables
            if len(variables) == len(self.metrics_state):
                for variable, value in zip(variables, self.metrics_state, strict=True):
                    if tuple(variable.shape) == np.shape(value):
                        variable.assign(np.asarray(value, dtype=variable.dtype))
            self.metrics_state = None

    def _global_step(self, epochs_done: int, step: int) -> int:
        return epochs_done * self.steps_per_epoch + step

    def on_train_batch_end(self, batch, logs=None):
        step = step_offset(self.resume_at, self._epoch) + batch + 1
        if self.stop.cut_at == (self._epoch + 1, step):
            if self.stop.nan_at is None:
                self.save_latest(self._epoch, step, self.stop.reason or "stop")
            raise StopNow  # a NaN model is not saved, nor validated
        if step >= self.steps_per_epoch:
            return  # the epoch end saves
        now = time.monotonic()
        last_step, last_time = self._last_save
        if (
            self.every_steps
            and self._global_step(self._epoch, step) - last_step >= self.every_steps
        ):
            self.save_latest(self._epoch, step, "every_steps")
        elif self.every_seconds and now - last_time >= self.every_seconds:
            self.save_latest(self._epoch, step, "every_minutes")

    def state(self, epochs_done: int, step: int, reason: str) -> dict:
        """The resume state at this position (writing early stopping's best weights if they
        changed, since the state names their file)."""
        callbacks = {}
        for name, callback in self.stateful.items():
            callbacks[name] = callback.get_state()
            if isinstance(callback, EarlyStopping):
                callbacks[name]["best_weights_file"] = callback.save_best_weights(self.folder)
        state = {
            "epoch": epochs_done,
            "step": step,
            "reason": reason,
            "monitor": self.monitor,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "callbacks": callbacks,
            "lr_scale": self.lr_scale,
            "logs": self.last_logs,
            "identity": self.identity,
            "time": time.time(),
        }
        if step:
            state["metrics"] = [np.asarray(v).tolist() for v in self.model.metrics_variables]
        return state

    def save_latest(self, epochs_done: int, step: int, reason: str, state: dict | None = None):
        """Weights first, under a new name; then ``latest.json`` naming them; then old weights go.

        ``state``: this position's :meth:`state`, when the caller has it already.
        """
        name = f"latest-e{epochs_done:04d}-s{step:07d}.weights.h5"
        state = {**(state or self.state(epochs_done, step, reason)), "weights": name}
        save_atomically(os.path.join(self.folder, name), self.model.save_weights)
        write_json(os.path.join(self.folder, LATEST_STATE), state)
        for old in globlib.glob(os.path.join(self.folder, "latest-*.weights.h5")):
            if os.path.basename(old) != name:
                os.remove(old)
        self.position = (epochs_done, step)
        self._last_save = (self._global_step(epochs_done, step), time.monotonic())

    def _save_model(self, name: str, state: dict) -> None:
        """A best or pattern-named model, with its state beside it, so ``--resume`` can use it."""
        writer = self.model.save_weights if name.endswith(".weights.h5") else self.model.save
        save_atomically(os.path.join(self.folder, name), writer)
        write_json(os.path.join(self.folder, state_file(name)), {**state, "weights": name})

    # ------------------------------------------------------------------ best and named models
    def _prune(self) -> None:
        """Keep the newest ``keep`` files of the filename pattern (found by a glob, so files of
        earlier, resumed sessions count too)."""
        pattern = re.sub(r"\{[^}]*\}", "*", self.filename)
        files = [
            f for f in globlib.glob(os.path.join(self.folder, pattern))
            if not os.path.basename(f).startswith("latest-") and os.path.basename(f) != BEST_MODEL
        ]  # fmt: skip
        files.sort(key=os.path.getmtime)
        for old in files[: -self.keep]:
            os.remove(old)
            sidecar = os.path.join(self.folder, state_file(os.path.basename(old)))
            if os.path.exists(sidecar):
                os.remove(sidecar)

    def improved(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value < self.best if self.mode == "min" else value > self.best

    def on_epoch_end(self, epoch, logs=None):
        if self.stop.cut_short(epoch + 1):
            return  # a partial (or NaN) epoch is not a checkpoint: the last good one stays
        logs = logs or {}
        self.last_logs = {k: float(v) for k, v in logs.items()}
        value = logs.get(self.monitor)
        if value is None and self.save_best:
            raise ConfigError(
                [
                    f"callbacks.checkpoint.monitor: '{self.monitor}' is not among the epoch's "
                    f"metrics ({', '.join(sorted(logs))})"
                ]
            )
        better = self.save_best and self.improved(float(value))
        if better:
            self.best, self.best_epoch = float(value), epoch + 1
        state = self.state(epoch + 1, 0, "epoch")  # one state for every file this epoch writes
        if better:
            self._save_model(BEST_MODEL, state)
        if self.filename and (better or not self.save_best_only):
            try:
                name = self.filename.format(epoch=epoch + 1, **logs)
            except (KeyError, IndexError, ValueError) as exc:
                raise TpurunError(
                    f"callbacks.checkpoint.filename '{self.filename}': cannot fill it in ({exc}); "
                    f"it may use {{epoch}} and the metrics {', '.join(sorted(logs))}."
                ) from None
            self._save_model(name, state)
            if self.keep:
                self._prune()
        self.save_latest(epoch + 1, 0, "epoch", state)


def build_callbacks(
    config: Config, plan: Plan, run_dir: str, reporter: Reporter, stop: Stop, identity: dict
) -> tuple[list[Any], Progress, RunCheckpoint]:
    """The callback list for ``fit``, plus the two tpurun reads results from.

    The resume point is always kept (``callbacks.checkpoint: null`` only turns off the best and
    pattern-named models): a run directory can always be resumed.
    """
    cb = config.callbacks
    progress = Progress(reporter, plan, cb.on_nan != "ignore", stop)
    out: list[Any] = [progress]
    stateful: list[Any] = []
    if cb.reduce_lr_on_plateau is not None:
        r = cb.reduce_lr_on_plateau
        monitor = resolve_monitor(config, r.monitor)
        stateful.append(
            ReduceLROnPlateau(
                monitor=monitor, factor=r.factor, patience=r.patience, min_lr=r.min_lr,
                min_delta=r.min_delta, cooldown=r.cooldown, mode=resolve_monitor_mode(monitor, r.mode),
            )
        )  # fmt: skip
    if cb.early_stopping is not None:
        e = cb.early_stopping
        monitor = resolve_monitor(config, e.monitor)
        stateful.append(
            EarlyStopping(
                monitor=monitor, patience=e.patience, min_delta=e.min_delta,
                mode=resolve_monitor_mode(monitor, e.mode), restore_best_weights=e.restore_best_weights,
                total_epochs=config.train.epochs,
            )
        )  # fmt: skip
    out.extend(stateful)
    for spec in cb.extra:
        cls = import_object(spec.name, config.base_dir, "callbacks.extra")
        try:
            callback = cls(**spec.kwargs)
        except Exception as exc:
            raise TpurunError(
                f"callbacks.extra '{spec.name}': {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(callback, keras.callbacks.Callback):
            raise TpurunError(
                f"callbacks.extra '{spec.name}' made a {type(callback).__name__}, not a "
                "keras.callbacks.Callback."
            )
        out.append(callback)
    # The CSV row of an epoch is written before its checkpoint; a resume drops rows past the
    # checkpoint, so a kill between the two leaves neither a gap nor a duplicate.
    if cb.csv_log is not None:
        out.append(CSVLogger(os.path.join(run_dir, cb.csv_log.filename), stop))
    ck = cb.checkpoint
    checkpoint = RunCheckpoint(
        os.path.join(run_dir, CHECKPOINTS),
        stop=stop,
        steps_per_epoch=plan.steps_per_epoch,
        monitor=plan.monitor,
        mode=resolve_monitor_mode(plan.monitor, ck.mode if ck else "auto"),
        save_best=ck is not None,
        save_best_only=ck.save_best_only if ck else True,
        filename=ck.filename if ck else None,
        keep=ck.keep if ck else None,
        every_steps=ck.every_steps if ck else None,
        every_minutes=ck.every_minutes if ck else None,
        stateful=stateful,
        identity=identity,
    )
    out.append(checkpoint)
    return out, progress, checkpoint
