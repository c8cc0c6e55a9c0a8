"""Progress: feeds the reporter as training goes, and times epochs and the first step."""

from __future__ import annotations

import time
from typing import Any

from tpurun import frameworks
from tpurun.display.lines import THROUGHPUT
from tpurun.display.reporter import Reporter
from tpurun.plan.plan import Plan
from tpurun.runtime import compile_cache
from tpurun.training.checkpoints.checkpointer import step_offset

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
            loaded = compile_cache.use.hits  # programs JAX did not compile again
            self.reporter.compiled(self.first_step_seconds, step - self._offset, loaded)
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
