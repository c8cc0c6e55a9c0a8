"""A profiler trace of a few training steps (``train.profile``, ``--profile N:M``).

``jax.profiler`` on the JAX backend, ``tf.profiler`` on the TensorFlow backend. Both write
TensorBoard's profile layout, ``plugins/profile/<time>/<host>.xplane.pb``: the trace is written to a
local temporary folder (neither profiler is sure to write ``gs://``), then copied into
the run directory (``<run>/plugins/profile/``), where ``tensorboard --logdir`` finds it (the Profile tab needs the
``tensorboard-plugin-profile`` package).

Steps count from this session's first (a resumed session profiles too, and ``start_step`` can skip
the compiling first execution); a trace starts and stops at execution boundaries, so it covers whole
executions of ``steps_per_execution`` steps.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from tpurun import frameworks
from tpurun.display.reporter import Reporter
from tpurun.storage import fileio
from tpurun.storage.rundir import RunDir

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks

PROFILE_FOLDER = "plugins/profile"  # under the run's TensorBoard folder, where TensorBoard looks


def _start(backend: str, folder: str) -> None:
    if backend == "jax":
        jax = frameworks.jax()

        jax.profiler.start_trace(folder)
    else:
        tf = frameworks.tensorflow()
        tf.profiler.experimental.start(folder)


def _stop(backend: str) -> None:
    if backend == "jax":
        jax = frameworks.jax()

        jax.profiler.stop_trace()
    else:
        tf = frameworks.tensorflow()
        tf.profiler.experimental.stop()


class Profile(keras.callbacks.Callback):
    """Traces steps ``start_step`` to ``start_step + steps - 1`` of this session."""

    def __init__(
        self,
        run: RunDir,
        backend: str,
        start_step: int,
        steps: int,
        steps_per_execution: int,
        reporter: Reporter,
    ):
        super().__init__()
        self.run, self.backend, self.reporter = run, backend, reporter
        self.first, self.last = start_step, start_step + steps - 1
        self.spe = steps_per_execution
        self.done = 0  # steps this session has run
        self.traced: tuple[int, int] | None = None  # the steps covered, once written
        self.path: str | None = None  # where the trace went
        self._tmp: str | None = None
        self._from = 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._tmp is None and self.traced is None and self.done + self.spe >= self.first:
            self._tmp = tempfile.mkdtemp(prefix="tpurun-profile-")
            self._from = self.done + 1
            _start(self.backend, self._tmp)

    def on_train_batch_end(self, batch, logs=None):
        self.done += self.spe
        if self._tmp is not None and self.done >= self.last:
            self._finish()

    def on_train_end(self, logs=None):
        if self._tmp is not None:  # the run ended (or stopped) inside the traced steps
            self._finish()

    def _finish(self) -> None:
        # The batch-end logs were read on this thread (tpurun's progress callback is not
        # async-safe), so the traced steps have finished on the device.
        _stop(self.backend)
        tmp, self._tmp = self._tmp, None
        self.traced = (self._from, self.done)
        try:
            self.path = copy_trace(tmp, self.run)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if self.path:
            self.reporter.message(
                f"profile: steps {self._from}-{self.done} of this session traced into {self.path}; "
                f"view it with `tensorboard --logdir {self.run.path}` (Profile tab; "
                "pip install tensorboard-plugin-profile)",
                "note",
            )


def copy_trace(local: str, run: RunDir) -> str | None:
    """Copy a profiler's output folder into the run's TensorBoard folder; returns the trace's folder
    (``.../plugins/profile/<time>``), or None when nothing was copied."""
    folders = set()
    for root, _, files in os.walk(local):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), local).split(os.sep)
            target = run.add_file(os.path.join(root, name), *run.tensorboard_parts(), *relative)
            if target:
                folders.add(fileio.dirname(target))
    return min(folders) if folders else None
