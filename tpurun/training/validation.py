"""Exact validation: loss means over the records scored, not the records fed.

The evaluation stream pads its last batch with records weighted 0 (static shapes, divisible over
any replica count; see ``pipeline.make_dataset(score_records=...)``). Keras' weighted metrics are
then exact. Its loss is not quite: with the default ``sum_over_batch_size`` reduction a batch's
loss is ``sum(weight x loss) / batch size``, and the loss trackers average those batch losses
weighted by the batch size, padding included, so the reported mean is divided by the records fed
instead of the records scored. :func:`exact_logs` undoes exactly that. A weight regulariser adds
the same penalty to every batch's loss; it is taken out before the correction and put back after.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

_CORRECTABLE = ("sum_over_batch_size", "mean")  # Keras' default reduction, and its alias


def _losses(spec: Any) -> list[Any]:
    if isinstance(spec, Mapping):
        return [x for v in spec.values() for x in _losses(v)]
    if isinstance(spec, (list, tuple)):
        return [x for v in spec for x in _losses(v)]
    return [spec]


def correctable(model: Any) -> bool:
    """Whether the compiled losses reduce as :func:`exact_logs` assumes (Keras' default does;
    a loss object built with another ``reduction`` does not)."""
    return all(
        getattr(loss, "reduction", "sum_over_batch_size") in _CORRECTABLE
        for loss in _losses(model.loss)
    )


def regularization(model: Any) -> float:
    """The weight-regularisation penalty every batch's loss includes (0 without regularisers)."""
    penalties = model._get_regularization_losses()  # Keras' own sum, as its losses add it
    return float(sum(float(p) for p in penalties)) if penalties else 0.0


def exact_logs(
    logs: MutableMapping[str, Any], model: Any, scored: int, fed: int, prefix: str = "val_"
) -> None:
    """Turn the loss means of a padded evaluation into means over the ``scored`` records.

    Args:
        logs: the epoch's (or evaluation's) logs; changed in place.
        model: the compiled model (for its losses and regularisers).
        scored: records that count; ``fed``: records fed, padding included.
        prefix: ``val_`` in ``fit``'s logs, ``""`` for ``evaluate``'s.
    """
    if scored == fed or not scored:
        return
    factor = fed / scored
    total = f"{prefix}loss"
    for key in list(logs):
        if key.startswith(prefix) and key.endswith("loss") and key != total:
            logs[key] = float(logs[key]) * factor  # per-output losses: no regulariser in them
    if total in logs:
        penalty = regularization(model)
        logs[total] = (float(logs[total]) - penalty) * factor + penalty
