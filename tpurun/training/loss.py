"""The loss: the config's, else the one the factory (or KerasHub) compiled; a cross-entropy that
would read a preset's logits as probabilities is refused."""

from __future__ import annotations

from typing import Any

from tpurun import frameworks
from tpurun.config import Config, NamedObject
from tpurun.errors import ModelError
from tpurun.training.keras_objects import keras_object


def build_loss(config: Config) -> Any:
    keras = frameworks.keras()

    loss = config.model.loss
    if isinstance(loss, list):
        return [keras_object(s, keras.losses, "model.loss", config) for s in loss]
    if isinstance(loss, dict):
        return {
            k: keras_object(s, keras.losses, f"model.loss.{k}", config) for k, s in loss.items()
        }
    return keras_object(loss, keras.losses, "model.loss", config)


def check_logits_loss(config: Config) -> None:
    """A KerasHub task outputs logits: a cross-entropy named without ``from_logits: true`` would
    read them as probabilities and train on a wrong loss without a word.

    Raises:
        ModelError: naming the loss and the two ways out.
    """
    spec = config.model.loss
    if config.model.preset is None or not isinstance(spec, NamedObject):
        return
    if spec.name.replace("_", "").lower().endswith("crossentropy") and not spec.kwargs.get(
        "from_logits"
    ):
        raise ModelError(
            f"model.loss: {spec.name} on a preset's task, which outputs logits: write "
            f"`loss: {{name: {spec.name}, from_logits: true}}`, or leave model.loss out for "
            "the task's own loss."
        )


def compiled_loss(config: Config, factory: dict | None) -> Any:
    """The config's loss, else the factory's (or KerasHub's) compiled one.

    Raises:
        ModelError: neither, or a cross-entropy that would read a preset's logits wrongly.
    """
    if config.model.loss is not None:
        check_logits_loss(config)
        return build_loss(config)
    if factory is not None:
        return factory["loss"]
    raise ModelError(
        "model.loss is not set, and the factory returned a model it did not compile: name a "
        "Keras loss (binary_crossentropy, sparse_categorical_crossentropy, mse, ...), or "
        "compile the model in the factory."
    )
