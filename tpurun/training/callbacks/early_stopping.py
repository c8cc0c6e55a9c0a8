"""EarlyStopping: Keras' own, resumable, best weights included (a LoRA run's: what trains)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from tpurun import frameworks
from tpurun.storage import fileio
from tpurun.storage.rundir import EARLY_STOPPING_WEIGHTS, RunDir
from tpurun.training.callbacks.resumable import Resumable
from tpurun.training.checkpoints.adapter import is_lora

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


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


class EarlyStopping(Resumable, keras.callbacks.EarlyStopping):
    """Keras' EarlyStopping, resumable, best weights included.

    Keras restores the best weights in ``on_train_end`` whenever ``restore_best_weights`` is set;
    tpurun runs ``fit`` more than once per run (a resume mid-epoch, a NaN restore), so they are
    restored only when the run really ends: an early stop, or the last epoch done.
    """

    STATE = ("wait", "stopped_epoch", "best", "best_epoch")
    SECTION = "early_stopping"

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
