"""The final model file: ``model.keras`` as plain ``keras.saving.load_model`` opens it anywhere,
without the user's training code (a custom loss, metric or optimizer stays in the checkpoints)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tpurun import frameworks
from tpurun.training.keras_objects import short_name


def _flat(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flat(v)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flat(v)]
    return [] if value is None else [value]


def _user_code(obj: Any) -> bool:
    """Whether a compiled loss, metric or optimizer is the user's code rather than Keras' own."""
    if isinstance(obj, str):
        return False
    target = getattr(obj, "fn", obj)  # Keras wraps loss and metric functions
    module = getattr(target, "__module__", None) or type(target).__module__
    return not module.startswith("keras")


def custom_training_code(model: Any) -> list[str]:
    """The compiled loss, metrics and optimizer that are the user's code (from the config by
    import path, or from the factory's own compile): plain ``keras.saving.load_model`` cannot
    find them in another process."""
    compiled = model._compile_config.config
    objs = [model.optimizer, *_flat(compiled.get("loss")), *_flat(compiled.get("metrics")),
            *_flat(compiled.get("weighted_metrics"))]  # fmt: skip
    return [short_name(o) for o in objs if _user_code(o)]


def inference_saver(model: Any):
    """How to write ``model.keras`` so that plain ``keras.saving.load_model`` opens it anywhere.

    With a custom loss, metric or optimizer, Keras would store the training setup (its compile
    config) and then fail to load it without that code ("Could not locate function"). The final
    model is for inference: it is then saved without its training setup, and training goes on
    from the checkpoints, which keep everything.
    """
    if not custom_training_code(model):
        return model.save

    def save(path: str) -> None:
        model.get_compile_config = lambda: None  # this save only
        try:
            model.save(path)
        finally:
            del model.get_compile_config

    return save


@contextlib.contextmanager
def on_the_host(model: Any) -> Iterator[None]:
    """Every variable whole in this host's memory while the final model is written, for a model
    split over several processes' devices (a model axis across hosts): Keras' savers read each
    variable as one NumPy array, and no process holds another's shards.

    A collective: every process enters it, in the same order (each gathers every variable);
    only the writer then saves. The copies live in host memory (a TPU host has far more than a
    chip), never whole on a device; single-process runs (every shard addressable) change nothing.
    """
    optimizer = getattr(model, "optimizer", None)
    variables = {
        id(v): v
        for v in [*model.variables, *model.metrics_variables,
                  *(optimizer.variables if optimizer is not None else [])]
    }  # fmt: skip
    split = [
        v for v in variables.values() if not getattr(v.value, "is_fully_addressable", True)
    ]  # fmt: skip
    if not split:
        yield
        return
    multihost_utils = frameworks.jax("experimental.multihost_utils")

    kept = [(v, v._value) for v in split]
    try:
        for variable, value in kept:
            variable._value = multihost_utils.process_allgather(value, tiled=True)
        yield
    finally:
        for variable, value in kept:
            variable._value = value
