"""A causal LM's loss as users read it: the mean over the tokens that count, so that
perplexity = exp(loss).

Keras' loss for a batch is ``sum(weight x token loss) / positions``: every position counts in the
divisor, the padding and a prompt's tokens too (they weigh 0), and its loss tracker then averages
those batch means by batch size. For a causal LM that figure is neither the per-token mean nor
the log of the perplexity beside it. KerasHub's ``Perplexity`` metric (which
:func:`tpurun.training.model.compile_model` gives every causal LM) sums the loss and the weights of
the weighted tokens over every batch of an epoch or an evaluation, so ``log(perplexity)`` is the
exact per-token mean over all of them (padding records of a padded validation weigh 0 too).

Every loss a user reads (the progress line, ``log.csv``, ``summary.json``, TensorBoard, the best
checkpoint's monitor, early stopping, ``evaluate``) is that one. The gradient is left as KerasHub
computes it (a batch's positions in the divisor), so learning rates from KerasHub's recipes keep
their meaning.
"""

from __future__ import annotations

import math
from collections.abc import MutableMapping
from typing import Any

from tpurun import frameworks

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


def per_token_metric(model: Any) -> str | None:
    """For a causal LM compiled with the token cross-entropy and KerasHub's ``Perplexity`` as a
    weighted metric, that metric's name (its ``log`` is the per-token loss); else None."""
    keras_hub = frameworks.keras_hub()
    if not isinstance(model, keras_hub.models.CausalLM):
        return None
    weighted = model._compile_config.config.get("weighted_metrics") or []
    found = [m for m in weighted if isinstance(m, keras_hub.metrics.Perplexity)]
    loss = model.loss
    name = getattr(getattr(loss, "fn", None), "__name__", None) or getattr(loss, "__name__", loss)
    logits = bool(getattr(loss, "_fn_kwargs", {}).get("from_logits", False))
    return found[0].name if found and name == "sparse_categorical_crossentropy" and logits else None


def per_token(logs: MutableMapping[str, Any], metric: str, prefix: str = "") -> None:
    """Set ``logs[prefix + "loss"]`` to ``log`` of the perplexity logged as ``prefix + metric``.

    A perplexity of 0 is KerasHub's figure for no weighted token yet: the loss is then left as
    Keras' (0 as well, every weight being 0).
    """
    perplexity = logs.get(prefix + metric)
    if perplexity is None or f"{prefix}loss" not in logs:
        return
    perplexity = float(perplexity)
    if perplexity != 0.0:
        logs[f"{prefix}loss"] = math.log(perplexity) if perplexity > 0 else math.nan


class TokenLoss(keras.callbacks.Callback):
    """Right after :class:`~tpurun.training.callbacks.exact_validation.ExactValidation`: a causal LM's ``loss`` and
    ``val_loss`` become the per-token means (:func:`per_token`) before any other callback reads
    a step's or an epoch's logs (Keras hands every callback the same dict, in list order)."""

    def __init__(self):
        super().__init__()
        self.metric: str | None = None

    def on_train_begin(self, logs=None):
        self.metric = per_token_metric(self._model)

    def on_train_batch_end(self, batch, logs=None):
        if self.metric and logs is not None:
            per_token(logs, self.metric)

    def on_epoch_end(self, epoch, logs=None):
        if self.metric and logs is not None:
            per_token(logs, self.metric)
            per_token(logs, self.metric, prefix="val_")
