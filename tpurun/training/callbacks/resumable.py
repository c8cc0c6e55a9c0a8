"""Resumable: the mixin that keeps a Keras callback's counters across a restart."""

from __future__ import annotations

from typing import Any

import numpy as np

from tpurun.storage.rundir import RunDir


class Resumable:
    """A Keras callback whose counters survive a restart (and a second ``fit`` in one run).

    Keras resets them in ``on_train_begin``; this keeps them: the state a resume brought
    (``pending``), else the state the previous ``fit`` of this run ended with.
    """

    STATE: tuple[str, ...] = ()
    SECTION = ""  # the callbacks section that configures it, and names its monitor's mode
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
