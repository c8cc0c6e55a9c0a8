"""The compiled metrics: the config's (a Keras name passed on as the string, so Keras picks the
variant for the loss and targets), and a causal LM's perplexity where none is given."""

from __future__ import annotations

import inspect
from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.training.keras_objects import keras_object


def build_metrics(config: Config) -> list[Any]:
    keras = frameworks.keras()

    out = []
    for spec in config.model.metrics:
        if spec.kwargs or ":" in spec.name:
            out.append(keras_object(spec, keras.metrics, "model.metrics", config))
            continue
        try:
            keras.metrics.get(spec.name)
        except ValueError:
            # A class name in another case ("meaniou"), or an error with a suggestion.
            out.append(keras_object(spec, keras.metrics, "model.metrics", config))
            continue
        # Passed as the string: Keras picks e.g. sparse_categorical_accuracy for 'accuracy' from
        # the loss and target shapes.
        out.append(spec.name)
    return out


def is_function(metric: Any) -> bool:
    """A plain function given as a metric (not a Keras name or Metric object)."""
    return inspect.isfunction(metric)


def task_metrics(model: Any, config: Config, metrics: list) -> list:
    """What tpurun adds to a preset task's metrics (its own or the config's): a causal LM's
    perplexity, unless one is there. KerasHub's metric sums the loss and the weights over the
    weighted tokens of every batch, so it is exact over a validation set (padding records and
    prompt tokens weigh 0), where the loss, a mean per batch that counts every position, is not a
    token mean; evaluate reports the loss per token from it."""
    if config.model.preset is None:
        return []
    keras_hub = frameworks.keras_hub()
    if not isinstance(model, keras_hub.models.CausalLM) or any(
        isinstance(m, keras_hub.metrics.Perplexity) for m in metrics
    ):
        return []
    return [keras_hub.metrics.Perplexity(from_logits=True, name="perplexity")]
