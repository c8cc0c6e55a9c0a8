"""ReduceLROnPlateau: Keras' own, resumable."""

from __future__ import annotations

from tpurun import frameworks
from tpurun.training.callbacks.resumable import Resumable

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


class ReduceLROnPlateau(Resumable, keras.callbacks.ReduceLROnPlateau):
    """Keras' ReduceLROnPlateau, resumable (the learning rate itself is an optimizer variable,
    saved with the weights; this keeps the counters)."""

    STATE = ("wait", "cooldown_counter", "best")
    SECTION = "reduce_lr_on_plateau"
