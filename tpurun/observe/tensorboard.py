"""TensorBoard logs in the run directory, written without TensorFlow (:mod:`tpurun.observe.events`).

``<run>/train`` and ``<run>/validation`` hold the same tags (``epoch_loss``,
``epoch_accuracy``...), so TensorBoard draws training and validation on one chart, as Keras'
TensorBoard callback lays them out. ``train`` also holds ``learning_rate``, ``examples_per_sec``,
``input_wait``, ``batch_loss`` (the epoch's running loss every ``loss_every_steps`` steps), and
the throughput figures (:mod:`tpurun.observe.throughput`): ``tokens_per_sec`` for token inputs,
``tflops_per_device``, and ``mfu`` where the device's peak is known.

Steps are global: ``epochs done x steps_per_epoch + step``, so a resumed run continues its curves.
Events past the resume point (written after the last checkpoint by a session that was stopped or
killed, or before a NaN restore) are removed when training continues: no step appears twice or
goes backwards. Viewing them needs the ``tensorboard`` package (``pip install tensorboard``), which
does not need TensorFlow either.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpurun import frameworks
from tpurun.observe.events import SPLITS, EventFile, after_the_last_file, trim_events
from tpurun.storage import fileio
from tpurun.storage.rundir import RunDir

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


def epoch_figures(progress: Any, input_wait: Any) -> dict[str, float]:
    """The epoch's figures beside its metrics: ``examples_per_sec``, the throughput figures
    (``tokens_per_sec``, ``tflops_per_device``, ``mfu``) and ``input_wait``, where measured."""
    out: dict[str, float] = {}
    rates = getattr(progress, "epoch_rates", None)
    if rates:
        out["examples_per_sec"] = rates[-1]
    figures = getattr(progress, "epoch_throughput", None)
    for key, value in (figures[-1] if figures else {}).items():
        if value is not None and key != "examples_per_second":  # that one is examples_per_sec
            out[key.replace("_per_second", "_per_sec")] = value
    wait = getattr(input_wait, "epoch_value", None)
    if wait is not None:
        out["input_wait"] = wait
    return out


class TensorBoardLog(keras.callbacks.Callback):
    """Writes the run's scalars; made only for the process that writes the run directory.

    Placed after :class:`~tpurun.training.callbacks.progress.Progress` (its epoch rate) and before ``RunControl``
    (which may end ``fit`` at a batch's end).
    """

    def __init__(
        self,
        run: RunDir,
        steps_per_epoch: int,
        loss_every_steps: int | None,
        *,
        checkpointer: Any,
        progress: Any = None,
        input_wait: Any = None,
    ):
        super().__init__()
        self.folder = run.file(*run.tensorboard_parts())
        self.steps_per_epoch = steps_per_epoch
        self.every = loss_every_steps
        self.checkpointer = checkpointer  # its steps_before: where this fit sequence starts
        self.progress, self.input_wait = progress, input_wait
        self.writers: dict[str, EventFile] = {}
        self.last_step = -1  # the highest step written by this session
        self._start: int | None = None  # where the current epoch starts, until the first write
        self._epoch = 0

    # ------------------------------------------------------------------ writing
    def _open(self, start: int) -> None:
        if self.writers and self.last_step <= start:
            return  # continuing where this session's events end
        self.close()
        trim_events(self.folder, start)
        after_the_last_file(self.folder)
        self.writers = {split: EventFile(fileio.join(self.folder, split)) for split in SPLITS}
        self.last_step = start

    def _write(self, split: str, values: Mapping[str, float], step: int) -> None:
        if self._start is not None:  # opened at the first write: not before the first step
            self._open(self._start)
            self._start = None
        self.writers[split].scalars(values, step)
        self.last_step = max(self.last_step, step)

    def flush(self) -> None:
        for writer in self.writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()
        self.writers = {}

    # ------------------------------------------------------------------ hooks
    def _global_step(self, epoch: int, step: int) -> int:
        return epoch * self.steps_per_epoch + step

    def on_epoch_begin(self, epoch, logs=None):
        # Where this epoch starts: past a resume point or a NaN restore, earlier events go.
        self._epoch = epoch
        self._start = self._global_step(epoch, self.checkpointer.steps_before(epoch))

    def on_train_batch_end(self, batch, logs=None):
        if not self.every or not logs or "loss" not in logs:
            return
        offset = self.checkpointer.steps_before(self._epoch)
        step = self._global_step(self._epoch, offset + batch + 1)
        since = self.last_step if self._start is None else self._start
        if step // self.every > max(since, 0) // self.every:
            self._write("train", {"batch_loss": logs["loss"]}, step)

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        step = self._global_step(epoch + 1, 0)
        train: dict[str, float] = {}
        validation: dict[str, float] = {}
        for key, value in logs.items():
            try:
                value = float(value)
            except (TypeError, ValueError):
                continue  # a metric with several values
            if key == "learning_rate":
                train["learning_rate"] = value
            elif key.startswith("val_"):
                validation[f"epoch_{key[4:]}"] = value
            else:
                train[f"epoch_{key}"] = value
        train.update(epoch_figures(self.progress, self.input_wait))
        self._write("train", train, step)
        if validation:
            self._write("validation", validation, step)
        self.flush()  # TensorBoard shows the epoch now, and a killed run keeps it

    def on_train_end(self, logs=None):
        self.flush()
