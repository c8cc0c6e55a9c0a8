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
from dataclasses import dataclass
from typing import Any

import keras  # imported only after runtime.activate() has chosen the backend

from tpurun.config import Config
from tpurun.console import Reporter
from tpurun.errors import ConfigError, TpurunError
from tpurun.fileio import save_atomically, write_json
from tpurun.model import import_object
from tpurun.plan import Plan, resolve_monitor, resolve_monitor_mode

LATEST_WEIGHTS = "latest.weights.h5"
LATEST_STATE = "latest.json"
BEST_MODEL = "best.keras"


@dataclass
class Stop:
    """Why training stopped early, shared by the callbacks and the runner."""

    reason: str | None = None  # SIGTERM, SIGINT or train.time_limit: stop at the next step
    deadline: float | None = None  # time.monotonic() at which train.time_limit runs out
    nan_at: tuple[int, int] | None = None  # (epoch, step) of a NaN or Inf loss
    cut_at: tuple[int, int] | None = None  # (epoch, step) where an epoch was cut short

    def requested(self, now: float) -> bool:
        """Whether training should stop: a signal came, or the time limit has run out."""
        if self.reason is None and self.deadline is not None and now >= self.deadline:
            self.reason = "train.time_limit"
        return self.reason is not None

    def cut_short(self, epoch: int) -> bool:
        return self.cut_at is not None and self.cut_at[0] == epoch


class Progress(keras.callbacks.Callback):
    """Feeds the reporter at a bounded rate, and stops training on a NaN or Inf loss.

    Deliberately *not* ``async_safe``. With it (and no other batch hook), Keras 3 on JAX reads each
    step's logs on a worker thread while the main thread computes metrics; with more simulated CPU
    devices than cores, XLA's all-reduce rendezvous then starves and aborts the process ("Expected
    8 threads to join the rendezvous, but only 7 of them arrived on time", reproduced with plain
    Keras too). On the main thread the logs cost one host sync per execution, which
    ``steps_per_execution`` amortises, and which Keras' own progress bar costs as well.
    """

    def __init__(self, reporter: Reporter, plan: Plan, epochs: int, stop_on_nan: bool, stop: Stop):
        super().__init__()
        self.stop = stop
        self.reporter = reporter
        self.plan = plan
        self.epochs = epochs
        self.stop_on_nan = stop_on_nan
        self.interval = reporter.progress_interval
        self.epoch_seconds: list[float] = []
        self.epoch_rates: list[float] = []
        self.first_step_seconds: float | None = None
        self._train_start = time.monotonic()

    def on_train_begin(self, logs=None):
        self._train_start = time.monotonic()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch + 1
        self._epoch_start = time.monotonic()
        self._last_report = self._epoch_start
        self.reporter.epoch_begin(self._epoch, self.plan.steps_per_epoch)

    def on_train_batch_end(self, batch, logs=None):
        now = time.monotonic()
        step = batch + 1
        if self.first_step_seconds is None:
            self.first_step_seconds = now - self._train_start
        loss = (logs or {}).get("loss")
        nan = self.stop_on_nan and loss is not None and not math.isfinite(loss)
        if nan and self.stop.nan_at is None:
            self.stop.nan_at = (self._epoch, step)
        if (nan or self.stop.requested(now)) and not self._model.stop_training:
            self._model.stop_training = True
            if step < self.plan.steps_per_epoch:
                self.stop.cut_at = (self._epoch, step)
        if now - self._last_report < self.interval or step >= self.plan.steps_per_epoch:
            return
        self._last_report = now
        elapsed = now - self._epoch_start
        rate = step * self.plan.global_batch_size / elapsed if elapsed > 0 else 0.0
        eta = (self.plan.steps_per_epoch - step) * elapsed / step
        self.reporter.progress(self._epoch, step, self.plan.steps_per_epoch, rate, eta, logs)

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.monotonic() - self._epoch_start
        rate = self.plan.steps_per_epoch * self.plan.global_batch_size / seconds if seconds else 0.0
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


class RunCheckpoint(keras.callbacks.Callback):
    """The latest weights (with optimizer state) every epoch, and the best model by ``monitor``.

    ``latest.json`` beside the weights records the epoch and the best value so far: a resume reads
    it rather than trusting file times.
    """

    def __init__(
        self, folder: str, monitor: str, mode: str, save_best_only: bool, filename: str | None,
        stop: Stop,
        keep: int | None = None,
    ):  # fmt: skip
        super().__init__()
        self.stop = stop
        self.keep = keep
        self.folder = folder
        self.monitor = monitor
        self.mode = mode
        self.save_best_only = save_best_only
        self.filename = filename
        self.best: float | None = None
        self.best_epoch: int | None = None

    def _prune(self) -> None:
        """Keep the newest ``keep`` files of the filename pattern (found by a glob, so files of
        earlier, resumed sessions count too)."""
        pattern = re.sub(r"\{[^}]*\}", "*", self.filename)
        files = sorted(globlib.glob(os.path.join(self.folder, pattern)), key=os.path.getmtime)
        for old in files[: -self.keep]:
            os.remove(old)

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
        value = logs.get(self.monitor)
        if value is None:
            raise ConfigError(
                [
                    f"callbacks.checkpoint.monitor: '{self.monitor}' is not among the epoch's "
                    f"metrics ({', '.join(sorted(logs))})"
                ]
            )
        better = self.improved(float(value))
        if better:
            self.best, self.best_epoch = float(value), epoch + 1
            save_atomically(os.path.join(self.folder, BEST_MODEL), self.model.save)
        if self.filename and (better or not self.save_best_only):
            try:
                name = self.filename.format(epoch=epoch + 1, **logs)
            except (KeyError, IndexError, ValueError) as exc:
                raise TpurunError(
                    f"callbacks.checkpoint.filename '{self.filename}': cannot fill it in ({exc}); "
                    f"it may use {{epoch}} and the metrics {', '.join(sorted(logs))}."
                ) from None
            path = os.path.join(self.folder, name)
            writer = self.model.save_weights if name.endswith(".weights.h5") else self.model.save
            save_atomically(path, writer)
            if self.keep:
                self._prune()
        save_atomically(os.path.join(self.folder, LATEST_WEIGHTS), self.model.save_weights)
        write_json(
            os.path.join(self.folder, LATEST_STATE),
            {
                "epoch": epoch + 1,
                "monitor": self.monitor,
                "best": self.best,
                "best_epoch": self.best_epoch,
                "logs": {k: float(v) for k, v in logs.items()},
                "time": time.time(),
            },
        )


def build_callbacks(
    config: Config, plan: Plan, run_dir: str, reporter: Reporter, stop: Stop
) -> tuple[list[Any], Progress, RunCheckpoint | None]:
    """The callback list for ``fit``, plus the two tpurun reads results from."""
    cb = config.callbacks
    progress = Progress(reporter, plan, config.train.epochs, cb.terminate_on_nan, stop)
    out: list[Any] = [progress]
    if cb.reduce_lr_on_plateau is not None:
        r = cb.reduce_lr_on_plateau
        monitor = resolve_monitor(config, r.monitor)
        out.append(
            keras.callbacks.ReduceLROnPlateau(
                monitor=monitor, factor=r.factor, patience=r.patience, min_lr=r.min_lr,
                min_delta=r.min_delta, cooldown=r.cooldown, mode=resolve_monitor_mode(monitor, r.mode),
            )
        )  # fmt: skip
    if cb.early_stopping is not None:
        e = cb.early_stopping
        monitor = resolve_monitor(config, e.monitor)
        out.append(
            keras.callbacks.EarlyStopping(
                monitor=monitor, patience=e.patience, min_delta=e.min_delta,
                mode=resolve_monitor_mode(monitor, e.mode), restore_best_weights=e.restore_best_weights,
            )
        )  # fmt: skip
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
        out.append(
            keras.callbacks.CSVLogger(
                os.path.join(run_dir, cb.csv_log.filename), append=cb.csv_log.append
            )
        )
    checkpoint = None
    if cb.checkpoint is not None:
        checkpoint = RunCheckpoint(
            folder=os.path.join(run_dir, "checkpoints"),
            monitor=plan.monitor,
            mode=resolve_monitor_mode(plan.monitor, cb.checkpoint.mode),
            save_best_only=cb.checkpoint.save_best_only,
            filename=cb.checkpoint.filename,
            stop=stop,
            keep=cb.checkpoint.keep,
        )
        out.append(checkpoint)
    return out, progress, checkpoint
