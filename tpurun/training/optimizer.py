"""The optimizer: the config's (or the factory's own) at tpurun's learning rate, with gradient
accumulation as ``train.gradient_accumulation_steps`` sets it (the schedule is :mod:`.schedule`)."""

from __future__ import annotations

from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.errors import ModelError
from tpurun.plan.plan import Plan
from tpurun.training.keras_objects import call, keras_object, short_name
from tpurun.training.schedule import learning_rate_schedule


def accumulation_steps(config: Config, optimizer_kwargs: dict, what: str) -> int | None:
    """``gradient_accumulation_steps`` for Keras' optimizer: None for 1 (Keras wants >= 2)."""
    if optimizer_kwargs.get("gradient_accumulation_steps"):
        raise ModelError(
            f"{what} sets gradient_accumulation_steps: set train.gradient_accumulation_steps "
            "instead (tpurun scales the learning rate and the schedule with it)."
        )
    n = config.train.gradient_accumulation_steps
    return n if n > 1 else None


def build_optimizer(config: Config, plan: Plan) -> Any:
    """``model.optimizer`` at tpurun's learning rate (and schedule).

    Raises:
        ModelError: it sets its own learning rate or accumulation, or Keras refuses it.
    """
    keras = frameworks.keras()

    spec = config.model.optimizer
    if "learning_rate" in spec.kwargs:
        raise ModelError(
            "model.optimizer.learning_rate: set the learning rate in train.learning_rate.base "
            "(tpurun scales it with the batch size and applies warmup and schedule)."
        )
    schedule = learning_rate_schedule(config, plan)
    extra: dict[str, Any] = {"learning_rate": schedule}
    accumulation = accumulation_steps(config, spec.kwargs, "model.optimizer")
    if accumulation:  # only then: an optimizer class of the user's may not take the argument
        extra["gradient_accumulation_steps"] = accumulation
    return keras_object(spec, keras.optimizers, "model.optimizer", config, **extra)


def factory_optimizer(theirs: Any, config: Config, plan: Plan) -> Any:
    """The optimizer a factory compiled its model with, made again with its own settings at
    tpurun's learning rate (and the config's accumulation)."""
    own = theirs.get_config()
    settings = {
        **own,
        "learning_rate": learning_rate_schedule(config, plan),
        "gradient_accumulation_steps": accumulation_steps(config, own, "the factory's optimizer"),
    }
    return call(type(theirs), settings, "the factory's optimizer", short_name(theirs))
