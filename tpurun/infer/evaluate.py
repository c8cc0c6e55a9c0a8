"""Scoring every record exactly once: validation during ``train``, and ``tpurun evaluate``.

The evaluation stream pads its last batch with records weighted 0 (static shapes, divisible over
any replica count; see ``pipeline.make_dataset(score_records=...)``). Keras' weighted metrics are
then exact. Its loss is not quite: with the default ``sum_over_batch_size`` reduction a batch's
loss is ``sum(weight x loss) / batch size``, and the loss trackers average those batch losses
weighted by the batch size, padding included, so the reported mean is divided by the records fed
instead of the records scored. :func:`exact_logs` undoes exactly that. A weight regulariser adds
the same penalty to every batch's loss; it is taken out before the correction and put back after.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from tpurun import frameworks
from tpurun.errors import DataError

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
    return all(getattr(loss, "reduction", "sum_over_batch_size") in _CORRECTABLE
               for loss in _losses(model.loss))  # fmt: skip


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


# ---------------------------------------------------------------------------- tpurun evaluate
@dataclass(frozen=True)
class _CompilePlan:
    """What :func:`tpurun.training.model.compile_model` reads from a plan. Evaluation takes no training
    step, so the learning rate only has to be valid."""

    learning_rate: float
    steps_per_execution: int
    warmup_steps: int = 0
    total_steps: int = 1


def split_name(data: str | None) -> str:
    """``eval-<name>.json``'s name: ``validation``, or the glob's file name up to its first
    wildcard (``data/test-*.tfrecord`` -> ``test``)."""
    if not data:
        return "validation"
    stem = re.split(r"[*?\[{]", data.rstrip("/").rsplit("/", 1)[-1])[0]
    stem = re.sub(r"\.(tfrecords?|tfrec|gz)$", "", stem)
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-_.") or "data"


def _check_targets(data: Any, found: Any) -> None:
    """A test set without labels cannot be evaluated: say so, and what to use instead; then check
    the targets' types and shapes."""
    tf = frameworks.tensorflow()
    from tpurun.config import DataConfig
    from tpurun.data import decode as feat
    from tpurun.infer.loading import first_record

    targets = {n: data.features[n] for n in DataConfig.names(data.targets)}
    serialized = first_record(found)
    stored = tf.train.Example.FromString(serialized).features.feature
    missing = [n for n, f in targets.items() if feat.record_key(n, f) not in stored]
    if missing:
        raise DataError(
            f"{found.files[0]}: the records hold no target {', '.join(repr(m) for m in missing)} "
            f"(data.targets), only {', '.join(sorted(stored)) or 'nothing'}. evaluate scores "
            "predictions against the targets; to predict on a test set without them, use "
            "tpurun predict RUN_DIR --data GLOB --output FILE."
        )
    feat.check_record(serialized, targets, found.files[0])


def evaluate(
    run_dir: str, data: str | None = None, checkpoint: str = "best", *, machine: Any = None
) -> dict[str, Any]:
    """Score a split with a run's checkpoint: every record once, the last partial batch included.

    The records go through the validation path of ``train`` (the last batch padded with records
    weighted 0, metrics compiled as weighted, the loss corrected by :func:`exact_logs`), so the
    result equals Keras' own ``evaluate`` over the same records on any replica count. Writes
    ``eval-<name>.json`` into the run directory.

    Args:
        run_dir: the run directory ``train`` made.
        data: a glob of records with the same features; None: the config's data.validation.
        checkpoint: best, latest, or a checkpoint file.
        machine: facts about the machine (tests inject them); probed when None.

    Raises:
        TpurunError: no such run or checkpoint, no records, records without targets or not
            matching the features.
    """
    from tpurun.config import DataConfig
    from tpurun.data import pipeline
    from tpurun.data.resolve import path_resolver
    from tpurun.infer import loading
    from tpurun.runtime.plan import auto_steps_per_execution
    from tpurun.storage.rundir import now_iso
    from tpurun.training.model import compile_model

    started = time.monotonic()
    trained = loading.open_run(run_dir)
    config = trained.config
    found_checkpoint = loading.find_checkpoint(trained, checkpoint)
    if data is None and not config.data.validation:
        raise DataError(
            f"{trained.run.path}: its config has no data.validation to evaluate on; pass "
            "--data GLOB (records with the same features and their targets)."
        )
    runtime = loading.activate_for(trained, machine)
    try:
        inputs = {n: config.data.features[n] for n in DataConfig.names(config.data.inputs)}
        if data is None:
            found = loading.find_records(config.data.validation, inputs, "data.validation",
                                         path_resolver(config))  # fmt: skip
        else:
            found = loading.find_records(data, inputs, "--data")
        _check_targets(config.data, found)
        batch = loading.global_batch(config, runtime.replicas)
        batches = -(-found.records // batch)
        distributed = runtime.strategy is not None  # see make_dataset(repeat_eval=...)
        dataset = pipeline.make_dataset(
            found.files, config.data.model_copy(update={"compression": found.compression}),
            batch, training=False, score_records=found.records, repeat_eval=distributed,
        )  # fmt: skip
        model = loading.build(trained, found_checkpoint, runtime)
        spe = auto_steps_per_execution(batches, runtime.choice.max_steps_per_execution)
        with runtime.scope():
            compile_model(model, config, _CompilePlan(config.train.learning_rate.base, spe))
        with warnings.catch_warnings():
            # A finite dataset "runs out", on purpose, at its end.
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            logs = model.evaluate(dataset, steps=batches if distributed else None, verbose=0,
                                  return_dict=True)  # fmt: skip
        fed = batches * batch
        exact = correctable(model)
        if exact:
            exact_logs(logs, model, found.records, fed, prefix="")
    finally:
        runtime.release()
    name = split_name(data)
    result = {
        "name": name,
        "metrics": {k: float(v) for k, v in logs.items()},
        "records": found.records,
        "data": found.source,
        "files": len(found.files),
        "checkpoint": found_checkpoint.path,
        "checkpoint_label": found_checkpoint.label,
        "run_dir": trained.run.path,
        "backend": runtime.choice.backend,
        "replicas": runtime.replicas,
        "global_batch_size": batch,
        "batches": batches,
        "padding_records": fed - found.records,
        # False only for a loss with a reduction other than Keras' default (its mean then
        # includes the padding, weighted 0); the metrics are exact either way.
        "loss_exact": exact or fed == found.records,
        "seconds": round(time.monotonic() - started, 3),
        "evaluated": now_iso(),
    }
    result["written"] = trained.run.write_eval(name, result)
    return result
