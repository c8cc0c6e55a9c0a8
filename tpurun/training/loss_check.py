"""Does the loss fit the labels? A built-in classification loss checked against the model's output
and a real batch of labels before training, the message naming the loss that fits."""

from __future__ import annotations

from typing import Any

from tpurun.config import Config, NamedObject
from tpurun.errors import ModelError

_CATEGORICAL = ("categoricalcrossentropy", "categoricalfocalcrossentropy", "categoricalhinge")
_SPARSE = ("sparsecategoricalcrossentropy",)
_BINARY = ("binarycrossentropy", "binaryfocalcrossentropy")


def check_loss_fits(model: Any, config: Config, targets: Any) -> None:
    """Check a built-in classification loss against the output width and the labels of a real
    batch, before training: the wrong pair either fails with a shape error that blames the data,
    or, worse, trains silently to nonsense (sparse cross-entropy on one sigmoid unit).

    Only a single Keras loss on a single-output model is checked; anything else is left to Keras.

    Raises:
        ModelError: naming model.loss, what the labels and the output are, and the loss that fits.
    """
    import numpy as np

    loss = config.model.loss
    outputs = getattr(model, "outputs", None)
    if not isinstance(loss, NamedObject) or ":" in loss.name or not outputs or len(outputs) != 1:
        return
    if isinstance(targets, (dict, list, tuple)):
        return
    kind = loss.name.replace("_", "").lower()
    shape = tuple(outputs[0].shape)
    width = shape[-1] if len(shape) > 1 else 1
    y = np.asarray(targets)
    label_shape = y.shape[1:]
    one_per_record = label_shape in ((), (1,))
    target = config.data.targets if isinstance(config.data.targets, str) else "the target"
    lo, hi = (float(y.min()), float(y.max())) if y.size else (0.0, 0.0)
    labels = f"data.targets '{target}'"
    if kind in _CATEGORICAL and one_per_record and width > 1:
        raise ModelError(
            f"model.loss: {loss.name} expects one-hot targets, {width} values per record, and "
            f"{labels} holds one class index per record. Use sparse_categorical_crossentropy "
            "(accuracy then follows it), or store one-hot labels."
        )
    if kind in _SPARSE:
        if width == 1:
            raise ModelError(
                f"model.loss: {loss.name} needs one output unit per class, and the model's output "
                "has 1 unit: it would train to nonsense. For two classes on one sigmoid unit use "
                "binary_crossentropy; for K classes end the model with Dense(K, "
                "activation='softmax')."
            )
        if not one_per_record:
            raise ModelError(
                f"model.loss: {loss.name} expects one class index per record, and {labels} holds "
                f"{int(np.prod(label_shape))} values per record (one-hot?): use "
                "categorical_crossentropy."
            )
        if lo < 0 or hi >= width or lo != int(lo) or hi != int(hi):
            raise ModelError(
                f"model.loss: {loss.name} needs class indices 0..{width - 1} for the model's "
                f"{width} output units, and {labels} runs from {lo:g} to {hi:g} in the first batch. "
                f"Give the last layer {int(hi) + 1} units, or check data.targets."
            )
    matches_output = one_per_record or label_shape == shape[1:]
    if kind in _BINARY and matches_output and (lo < 0 or hi > 1):
        classes = f"{int(hi) + 1} classes" if hi == int(hi) and lo >= 0 else "labels like these"
        raise ModelError(
            f"model.loss: {loss.name} needs labels in [0, 1], and {labels} runs from {lo:g} to "
            f"{hi:g} in the first batch. For {classes} use sparse_categorical_crossentropy with a "
            "softmax output of one unit per class."
        )
