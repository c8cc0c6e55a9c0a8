"""The model: import the factory, build optimizer, loss, metrics and compile (the LR schedule is :mod:`.schedule`)."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
import traceback
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tpurun import frameworks
from tpurun.config import Config, NamedObject
from tpurun.errors import ModelError, TpurunError, describe
from tpurun.multihost.collectives import lost_peer
from tpurun.plan.plan import Plan
from tpurun.training import data_facts, remat
from tpurun.training.factory_source import syntax_error
from tpurun.training.input_check import check_inputs_fit, first_record_of
from tpurun.training.schedule import learning_rate_schedule


def import_object(spec: str, base_dir: Path, what: str) -> Any:
    """Import ``"path/to/file.py:name"`` (relative to ``base_dir``) or ``"package.module:name"``.

    Raises:
        ModelError: the file, module or attribute does not exist, or the module fails to import.
    """
    module_part, _, attr = spec.rpartition(":")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise ModelError(f"{what} '{spec}': no such file {path}.")
        name = f"tpurun_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            # The file's folder goes on sys.path so it can import its sibling modules.
            sys.path.insert(0, str(path.parent))
            try:
                module_spec.loader.exec_module(module)
            except Exception as exc:
                raise ModelError(
                    f"{what} '{spec}': importing {path} failed: {_brief(exc)}"
                ) from None
            sys.modules[name] = module
    else:
        if str(base_dir) not in sys.path:
            sys.path.insert(0, str(base_dir))
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            if not _names_module(module_part, exc.name):  # a package the module itself imports
                raise ModelError(
                    f"{what} '{spec}': importing {module_part} failed: {_brief(exc)}"
                ) from None
            raise ModelError(f"{what} '{spec}': no module named '{exc.name}'.") from None
        except Exception as exc:
            raise ModelError(
                f"{what} '{spec}': importing {module_part} failed: {_brief(exc)}"
            ) from None
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_")]
        close = difflib.get_close_matches(attr, names, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ModelError(f"{what} '{spec}': {module_part} has no '{attr}'.{hint}")
    return getattr(module, attr)


def _names_module(module: str, missing: str | None) -> bool:
    """Whether the missing module is ``module`` or one of its parent packages."""
    return missing is not None and (module == missing or module.startswith(f"{missing}."))


def _brief(exc: BaseException) -> str:
    """The exception, with the innermost frame of user code, in one line: a syntax error at its
    own file and line (its traceback ends in the import machinery), anything else at the last
    frame outside installed packages and Python's frozen import code."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return syntax_error(exc)
    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if "site-packages" not in f.filename and not f.filename.startswith("<")
    ]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{describe(exc)}{where}"


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
    by :func:`tpurun.hub.model.build_task`. With ``train.remat``, its blocks are recomputed in
    the backward pass (:mod:`tpurun.training.remat`)."""
    if config.model.preset is not None:
        from tpurun.hub.model import build_task

        return remat.as_configured(build_task(config), config)
    from tpurun.training import normalize

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
    message = f"model.factory '{config.model.factory}' raised {_brief(exc)}"
    text = "".join(traceback.format_exception(exc))
    if backend == "jax" and (
        "tensorflow" in text or "tf." in str(exc) or factory_imports_tensorflow(config)
    ):
        message += f". {TF_OPS_ON_JAX}"
    return ModelError(message)


# ------------------------------------------------------------------------- optimizer, loss, metrics
def _keras_object(spec: NamedObject, module: Any, what: str, config: Config, **extra: Any) -> Any:
    """Resolve a Keras name (``adam``, ``binary_crossentropy``) or ``module:Name``."""
    if ":" in spec.name:
        target = import_object(spec.name, config.base_dir, what)
        if inspect.isclass(target):
            return _call(target, {**spec.kwargs, **extra}, what, spec.name)
        if spec.kwargs or extra:
            raise ModelError(f"{what} '{spec.name}' is a function; it takes no kwargs.")
        return target
    known = [
        n
        for n in dir(module)
        if not n.startswith("_") and n not in ("get", "serialize", "deserialize")
    ]
    # Keras' own lower-case names do not camel-case back to every class ("sgd" is SGD, "rmsprop"
    # RMSprop, "adamw" AdamW), so class names also match case-insensitively, without underscores.
    classes = {n.lower(): n for n in known if inspect.isclass(getattr(module, n))}
    camel = "".join(part[:1].upper() + part[1:] for part in spec.name.split("_"))
    folded = classes.get(spec.name.replace("_", "").lower())
    for candidate in (spec.name, camel, folded):
        target = getattr(module, candidate, None) if candidate else None
        if inspect.isclass(target):
            return _call(target, {**spec.kwargs, **extra}, what, spec.name)
    if not spec.kwargs and not extra:
        try:
            return module.get(spec.name)
        except (ValueError, TypeError):
            pass
    # Compared without case, so that "adamm" suggests Adam rather than Nadam; a lower-case name
    # gets a lower-case suggestion, which resolves as above.
    lowered = {n.lower(): n for n in known}
    close = difflib.get_close_matches(spec.name.lower(), list(lowered), n=1)
    if close:
        suggestion = close[0] if spec.name.islower() else lowered[close[0]]
        hint = f"; did you mean '{suggestion}'?"
    else:
        hint = "; use a Keras name or 'module:Name'"
    raise ModelError(f"{what}: unknown name '{spec.name}'{hint}")


def _call(cls: Any, kwargs: dict, what: str, name: str) -> Any:
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{what} '{name}': {exc}") from None


def _accumulation(config: Config, optimizer_kwargs: dict, what: str) -> int | None:
    """``gradient_accumulation_steps`` for Keras' optimizer: None for 1 (Keras wants >= 2)."""
    if optimizer_kwargs.get("gradient_accumulation_steps"):
        raise ModelError(
            f"{what} sets gradient_accumulation_steps: set train.gradient_accumulation_steps "
            "instead (tpurun scales the learning rate and the schedule with it)."
        )
    n = config.train.gradient_accumulation_steps
    return n if n > 1 else None


def build_optimizer(config: Config, plan: Plan) -> Any:
    keras = frameworks.keras()

    spec = config.model.optimizer
    if "learning_rate" in spec.kwargs:
        raise ModelError(
            "model.optimizer.learning_rate: set the learning rate in train.learning_rate.base "
            "(tpurun scales it with the batch size and applies warmup and schedule)."
        )
    schedule = learning_rate_schedule(config, plan)
    extra: dict[str, Any] = {"learning_rate": schedule}
    accumulation = _accumulation(config, spec.kwargs, "model.optimizer")
    if accumulation:  # only then: an optimizer class of the user's may not take the argument
        extra["gradient_accumulation_steps"] = accumulation
    return _keras_object(spec, keras.optimizers, "model.optimizer", config, **extra)


def build_loss(config: Config) -> Any:
    keras = frameworks.keras()

    loss = config.model.loss
    if isinstance(loss, list):
        return [_keras_object(s, keras.losses, "model.loss", config) for s in loss]
    if isinstance(loss, dict):
        return {
            k: _keras_object(s, keras.losses, f"model.loss.{k}", config) for k, s in loss.items()
        }
    return _keras_object(loss, keras.losses, "model.loss", config)


def build_metrics(config: Config) -> list[Any]:
    keras = frameworks.keras()

    out = []
    for spec in config.model.metrics:
        if spec.kwargs or ":" in spec.name:
            out.append(_keras_object(spec, keras.metrics, "model.metrics", config))
            continue
        try:
            keras.metrics.get(spec.name)
        except ValueError:
            # A class name in another case ("meaniou"), or an error with a suggestion.
            out.append(_keras_object(spec, keras.metrics, "model.metrics", config))
            continue
        # Passed as the string: Keras picks e.g. sparse_categorical_accuracy for 'accuracy' from
        # the loss and target shapes.
        out.append(spec.name)
    return out


def _function(metric: Any) -> bool:
    """A plain function given as a metric (not a Keras name or Metric object)."""
    return inspect.isfunction(metric)


def short_name(obj: Any) -> str:
    """How to call a loss, metric or optimizer in one line."""
    if isinstance(obj, str):
        return obj
    return getattr(obj, "name", None) or getattr(obj, "__name__", None) or type(obj).__name__


def _task_metrics(model: Any, config: Config, metrics: list) -> list:
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


def _check_logits_loss(config: Config) -> None:
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


def _loss(config: Config, factory: dict | None) -> Any:
    """The config's loss, else the factory's (or KerasHub's) compiled one.

    Raises:
        ModelError: neither, or a cross-entropy that would read a preset's logits wrongly.
    """
    if config.model.loss is not None:
        _check_logits_loss(config)
        return build_loss(config)
    if factory is not None:
        return factory["loss"]
    raise ModelError(
        "model.loss is not set, and the factory returned a model it did not compile: name a "
        "Keras loss (binary_crossentropy, sparse_categorical_crossentropy, mse, ...), or "
        "compile the model in the factory."
    )


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
    loss = _loss(config, factory)
    if factory is not None and "optimizer" not in given:
        theirs = theirs_optimizer.get_config()
        settings = {
            **theirs,
            "learning_rate": learning_rate_schedule(config, plan),
            "gradient_accumulation_steps": _accumulation(config, theirs, "the factory's optimizer"),
        }
        optimizer = _call(
            type(theirs_optimizer),
            settings,
            "the factory's optimizer",
            short_name(theirs_optimizer),
        )
    else:
        optimizer = build_optimizer(config, plan)
    # An empty list adds nothing: a run's config.yaml writes `metrics: []` for a factory's (or a
    # preset's) own, and evaluate, predict and export reload that file.
    metrics_given = bool(config.model.metrics)
    if factory is not None and not metrics_given:
        metrics = [*(factory.get("metrics") or []), *(factory.get("weighted_metrics") or [])]
    else:
        metrics = build_metrics(config)
    metrics += _task_metrics(model, config, metrics)
    try:
        model.compile(
            optimizer=optimizer,
            loss=loss,
            # Weighted: validation pads its last batch with records weighted 0, so that every
            # record is scored once (tpurun.infer.evaluate); training feeds no weights, so nothing
            # else changes. Keras' plain `metrics` ignore sample weights.
            weighted_metrics=[m for m in metrics if not _function(m)],
            # A metric function may reduce a batch to one number, which cannot be weighted: it
            # is left unweighted (so it also counts the validation padding).
            metrics=[m for m in metrics if _function(m)] or None,
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
