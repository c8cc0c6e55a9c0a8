"""The model: the factory called (or the preset built) and checked against the data, then compiled
with the optimizer (:mod:`.optimizer`, its learning-rate schedule :mod:`.schedule`), the loss
(:mod:`.loss`) and the metrics (:mod:`.metrics`)."""

from __future__ import annotations

import inspect
import traceback
import types
from collections.abc import Sequence
from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.errors import ModelError, TpurunError
from tpurun.hub.task_model import build_task
from tpurun.multihost.collectives import lost_peer
from tpurun.plan.plan import Plan
from tpurun.training import data_facts, normalize, remat
from tpurun.training.input_check import check_inputs_fit, first_record_of
from tpurun.training.keras_objects import short_name
from tpurun.training.loss import compiled_loss
from tpurun.training.metrics import build_metrics, is_function, task_metrics
from tpurun.training.optimizer import build_optimizer, factory_optimizer
from tpurun.training.user_code import brief, import_object


def build_model(
    config: Config,
    backend: str,
    normalization: dict | None = None,
    data_files: Sequence[str] = (),
) -> Any:
    """Call the factory with its kwargs and check that it returned a Keras model whose inputs fit
    the features (:func:`tpurun.training.input_check.check_inputs_fit`; the first record of
    ``data_files`` says what the records hold when they do not); put a Normalization layer in
    front of each input whose feature has ``normalize: true`` (:func:`tpurun.training.normalize.wrap`,
    with ``normalization``'s numbers: None takes the schema file's). A ``model.preset`` is built
    by :func:`tpurun.hub.task_model.build_task`. With ``train.remat``, its blocks are recomputed in
    the backward pass (:mod:`tpurun.training.remat`)."""
    if config.model.preset is not None:
        return remat.as_configured(build_task(config), config)
    keras = frameworks.keras()

    factory = import_object(config.model.factory, config.base_dir, "model.factory")
    if not callable(factory):
        raise ModelError(f"model.factory '{config.model.factory}' is not callable.")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C function: nothing to check against
        signature = None
    kwargs = {**data_facts.factory_keywords(signature, config), **config.model.kwargs}
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            raise ModelError(
                f"model.kwargs do not fit {config.model.factory}{signature}: {exc}"
            ) from None
    try:
        model = factory(**kwargs)
    except TpurunError:  # the mesh's layout refused a variable as it was created
        raise
    except Exception as exc:
        if lost_peer(exc):  # building the variables is a collective: another process is gone
            raise
        raise _factory_failed(config, backend, exc) from None
    if not isinstance(model, keras.Model):
        raise ModelError(
            f"model.factory '{config.model.factory}' returned {type(model).__name__}, not a Keras "
            "model (keras.Model, Sequential or a functional model)."
        )
    data_facts.check_string_features(model, config, backend)
    first = first_record_of(data_files, config.data.compression) if data_files else None
    check_inputs_fit(model, config.data, first)
    return remat.as_configured(normalize.wrap(model, config, normalization), config)


#: What a model that fails on JAX because of TensorFlow ops is told.
TF_OPS_ON_JAX = (
    "The model runs on the JAX backend, and its factory's module uses TensorFlow: TensorFlow ops "
    "(tf.*) run only on runtime.backend: tensorflow. Set it, or use keras.ops."
)


def factory_imports_tensorflow(config: Config) -> bool:
    """Whether the factory's module has TensorFlow (or a part of it) among its names."""
    if config.model.factory is None:
        return False
    try:
        factory = import_object(config.model.factory, config.base_dir, "model.factory")
    except ModelError:
        return False
    module = inspect.getmodule(factory)
    return module is not None and any(
        isinstance(value, types.ModuleType) and value.__name__.split(".")[0] == "tensorflow"
        for value in vars(module).values()
    )


def _factory_failed(config: Config, backend: str, exc: BaseException) -> ModelError:
    message = f"model.factory '{config.model.factory}' raised {brief(exc)}"
    text = "".join(traceback.format_exception(exc))
    if backend == "jax" and (
        "tensorflow" in text or "tf." in str(exc) or factory_imports_tensorflow(config)
    ):
        message += f". {TF_OPS_ON_JAX}"
    return ModelError(message)


def compile_model(model: Any, config: Config, plan: Plan) -> str | None:
    """Compile with the config's optimizer (at tpurun's learning rate), loss and metrics.

    A factory may compile its model itself. What the config's ``model`` section leaves out is then
    the factory's (its optimizer class and settings at tpurun's scaled learning rate, its loss, its
    metrics); what the config sets replaces the factory's. Returns one line saying which, when
    the factory had compiled.

    Raises:
        ModelError: no loss anywhere, or Keras refuses the combination.
    """
    given = config.model.model_fields_set
    factory = model._compile_config.config if getattr(model, "compiled", False) else None
    theirs_optimizer = getattr(model, "optimizer", None)
    loss = compiled_loss(config, factory)
    if factory is not None and "optimizer" not in given:
        optimizer = factory_optimizer(theirs_optimizer, config, plan)
    else:
        optimizer = build_optimizer(config, plan)
    # An empty list adds nothing: a run's config.yaml writes `metrics: []` for a factory's (or a
    # preset's) own, and evaluate, predict and export reload that file.
    metrics_given = bool(config.model.metrics)
    if factory is not None and not metrics_given:
        metrics = [*(factory.get("metrics") or []), *(factory.get("weighted_metrics") or [])]
    else:
        metrics = build_metrics(config)
    metrics += task_metrics(model, config, metrics)
    try:
        model.compile(
            optimizer=optimizer,
            loss=loss,
            # Weighted: validation pads its last batch with records weighted 0, so that every
            # record is scored once (tpurun.infer.evaluate); training feeds no weights, so nothing
            # else changes. Keras' plain `metrics` ignore sample weights.
            weighted_metrics=[m for m in metrics if not is_function(m)],
            # A metric function may reduce a batch to one number, which cannot be weighted: it
            # is left unweighted (so it also counts the validation padding).
            metrics=[m for m in metrics if is_function(m)] or None,
            steps_per_execution=plan.steps_per_execution,
        )
    except ValueError as exc:
        raise ModelError(f"model.compile failed: {exc}") from None
    if factory is None:
        return None
    kept = [k for k, set_ in (("optimizer", "optimizer" in given), ("loss", config.model.loss is not None),
                              ("metrics", metrics_given)) if not set_]  # fmt: skip
    replaced = [k for k in ("optimizer", "loss", "metrics") if k not in kept]
    parts = []
    whose = "KerasHub's" if config.model.preset else "the factory's"
    if replaced:
        parts.append(f"the config's model.{'/'.join(replaced)} replace(s) {whose}")
    if kept:
        parts.append(f"{whose} {'/'.join(kept)} kept (left out of the config)")
    own = f"KerasHub compiled {type(model).__name__}"
    who = own if config.model.preset else "the factory compiled its model"
    return (
        f"{who} ({type(theirs_optimizer).__name__}, loss "
        f"{short_name(factory.get('loss'))}): "
        + "; ".join(parts)
        + "; the learning rate is tpurun's "
        "(train.learning_rate)"
    )
