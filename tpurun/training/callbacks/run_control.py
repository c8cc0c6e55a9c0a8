"""RunControl: the one stop path, and each finished epoch's commit (its CSV row, its checkpoint)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from tpurun import frameworks
from tpurun.storage.rundir import RunDir
from tpurun.training.checkpoints.checkpointer import Checkpointer, step_offset
from tpurun.training.signals import Stop, StopNow

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


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
        self,
        run: RunDir,
        checkpointer: Checkpointer,
        stop: Stop,
        *,
        steps_per_epoch: int,
        watch_nan: bool,
        log: str | None,
    ):
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
