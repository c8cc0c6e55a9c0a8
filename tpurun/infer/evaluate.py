"""``tpurun evaluate``: a split scored with a checkpoint, every record exactly once.

The records stream in order with the last batch padded by records weighted 0, as validation during
training does; :func:`tpurun.training.validation.exact_logs` turns the loss means into means over
the records scored.
"""

from __future__ import annotations

import re
import time
import warnings
from dataclasses import dataclass
from typing import Any

from tpurun.config import DataConfig
from tpurun.data import decode as feat
from tpurun.data import reader as readers
from tpurun.data.native import example
from tpurun.data.resolve import path_resolver
from tpurun.errors import DataError
from tpurun.hub.batches import take_preprocessing
from tpurun.infer import trained_run
from tpurun.infer.trained_run import first_record
from tpurun.plan.plan import auto_steps_per_execution
from tpurun.storage.rundir import now_iso
from tpurun.training.model import compile_model
from tpurun.training.validation import correctable, exact_logs


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
    targets = {n: data.features[n] for n in DataConfig.names(data.targets)}
    serialized = first_record(found)
    stored = example.parse(serialized).features.feature
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
    weighted 0, metrics compiled as weighted, the loss corrected by :func:`~tpurun.training.validation.exact_logs`), so the
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
    started = time.monotonic()
    trained = trained_run.open_run(run_dir)
    found_checkpoint = trained_run.find_checkpoint(trained, checkpoint)
    if data is None and not trained.config.data.validation:
        raise DataError(
            f"{trained.run.path}: its config has no data.validation to evaluate on; pass "
            "--data GLOB (records with the same features and their targets)."
        )
    runtime = trained_run.activate_for(trained, machine)
    try:
        scored = _score(trained, found_checkpoint, runtime, data)
    finally:
        runtime.release()
    name = split_name(data)
    result = {
        "name": name,
        **scored,
        "checkpoint": found_checkpoint.path,
        "checkpoint_label": found_checkpoint.label,
        "run_dir": trained.run.path,
        "backend": runtime.choice.backend,
        "replicas": runtime.replicas,
        "seconds": round(time.monotonic() - started, 3),
        "evaluated": now_iso(),
    }
    result["written"] = trained.run.write_eval(name, result)
    return result


def _score(trained: Any, checkpoint: Any, runtime: Any, data: str | None) -> dict[str, Any]:
    """Every record of the split once through the checkpoint's model: the metrics, and how the
    records were batched."""
    from tpurun.training import token_loss  # lazy: it imports Keras at module level

    config = trained.config
    inputs = {n: config.data.features[n] for n in DataConfig.names(config.data.inputs)}
    if data is None:
        found = trained_run.find_records(
            config.data.validation, inputs, "data.validation", path_resolver(config)
        )
    else:
        found = trained_run.find_records(data, inputs, "--data", run_config=config)
    _check_targets(config.data, found)
    batch = trained_run.global_batch(config, runtime.replicas)
    batches = -(-found.records // batch)
    distributed = runtime.strategy is not None  # see make_dataset(repeat_eval=...)
    reader = readers.for_config(config, runtime.choice)
    model = trained_run.build(trained, checkpoint, runtime)
    preprocessor, transform = take_preprocessing(model, config, found.tokenized)
    dataset = readers.make_dataset(
        reader,
        found.files,
        config.data.model_copy(update={"compression": found.compression}),
        batch,
        training=False,
        score_records=found.records,
        repeat_eval=distributed,
        transform=transform,
    )
    spe = auto_steps_per_execution(batches, runtime.choice.max_steps_per_execution)
    with runtime.scope():
        compile_model(model, config, _CompilePlan(config.train.learning_rate.base, spe))
        per_token = token_loss.per_token_metric(model) if preprocessor is not None else None
    with warnings.catch_warnings():
        # A finite dataset "runs out", on purpose, at its end.
        warnings.filterwarnings("ignore", message="Your input ran out of data")
        logs = model.evaluate(
            readers.for_keras(dataset),
            steps=batches if distributed else None,
            verbose=0,
            return_dict=True,
        )
    fed = batches * batch
    exact = correctable(model)
    if per_token:  # a causal LM: the loss per weighted token, over the whole split, as trained
        token_loss.per_token(logs, per_token)
        logs["perplexity"] = float(logs.pop(per_token))
    elif exact:
        exact_logs(logs, model, found.records, fed, prefix="")
    return {
        "metrics": {k: float(v) for k, v in logs.items()},
        "records": found.records,
        "data": found.source,
        "files": len(found.files),
        "global_batch_size": batch,
        "batches": batches,
        "padding_records": fed - found.records,
        # False only for a loss with a reduction other than Keras' default (its mean then
        # includes the padding, weighted 0); the metrics are exact either way.
        "loss_exact": bool(per_token) or exact or fed == found.records,
        **({"loss_per": "token"} if per_token else {}),
    }
