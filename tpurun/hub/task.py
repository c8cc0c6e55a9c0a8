"""The KerasHub task class ``model.task`` names, checked against the preset's backbone.

``Task.from_preset`` builds any task class whose own backbone class, or a subclass's, is the
preset's: ``CausalLM`` finds ``GemmaCausalLM`` for a Gemma preset (``find_subclass`` in
keras_hub/src/utils/preset_utils.py). Any other class fails deep inside the load; the same rule is
checked here first, so the message names the key and the tasks that fit.
"""

from __future__ import annotations

import difflib
from typing import Any

from tpurun import frameworks
from tpurun.errors import ModelError
from tpurun.hub.preset import Preset


def _task_classes(keras_hub: Any) -> dict[str, type]:
    """The task classes KerasHub exports, by name."""
    base = keras_hub.models.Task
    found = {}
    for name in dir(keras_hub.models):
        value = getattr(keras_hub.models, name)
        if isinstance(value, type) and issubclass(value, base) and value is not base:
            found[name] = value
    return found


def _descendants(cls: type) -> list[type]:
    out, stack = [], [cls]
    while stack:
        current = stack.pop()
        out.append(current)
        stack.extend(current.__subclasses__())
    return out


def fits(cls: type, backbone_cls: type) -> bool:
    """Whether ``from_preset`` on ``cls`` builds a preset of ``backbone_cls``."""
    return any(getattr(c, "backbone_cls", None) is backbone_cls for c in _descendants(cls))


def concrete(cls: type, preset: Preset) -> type:
    """The subclass of ``cls`` that ``from_preset`` builds for the preset (``GemmaCausalLM`` for
    ``CausalLM`` on a Gemma preset); ``cls`` itself where the backbone is unknown."""
    backbone_cls = _backbone_class(preset)
    if backbone_cls is None:
        return cls
    found = [c for c in _descendants(cls) if getattr(c, "backbone_cls", None) is backbone_cls]
    return found[0] if found else cls


def task_class(preset: Preset, requested: str | None) -> type:
    """The task class to build: ``requested`` (``model.task``), else the preset's own.

    Raises:
        ModelError: KerasHub has no such task class, or it does not fit the preset's backbone.
    """
    keras_hub = frameworks.keras_hub()
    name = requested or preset.default_task()
    classes = _task_classes(keras_hub)
    cls = classes.get(name)
    if cls is None:
        close = difflib.get_close_matches(name, list(classes), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        key = "model.task" if requested else f"the task {preset.location} was saved as"
        raise ModelError(
            f"{key}: KerasHub {keras_hub.__version__} has no task class '{name}'.{hint} A task is "
            "a class of keras_hub.models, such as GemmaCausalLM, CausalLM or BertTextClassifier."
        )
    backbone_cls = _backbone_class(preset)
    if backbone_cls is not None and not fits(cls, backbone_cls):
        raise ModelError(_mismatch(preset, name, cls, backbone_cls, classes))
    return cls


def _backbone_class(preset: Preset) -> type | None:
    """The preset's backbone class from Keras' registry (None: unknown before it is loaded)."""
    if not preset.registered_name:
        return None
    found = frameworks.keras().saving.get_registered_object(preset.registered_name)
    return found if isinstance(found, type) else None


def _mismatch(preset: Preset, name: str, cls: type, backbone_cls: type, classes: dict) -> str:
    own = getattr(cls, "backbone_cls", None)
    built_on = f"is built on {own.__name__}" if own else "has no subclass for it"
    serving = sorted(
        n for n, c in classes.items() if getattr(c, "backbone_cls", None) is backbone_cls
    )
    default = preset.saved_task or (preset.tasks[0] if len(preset.tasks) == 1 else None)
    fix = f"set model.task to a task for {backbone_cls.__name__}: {', '.join(serving) or 'none found'}"
    fix = (
        f"Leave model.task out to build {default}, or {fix}"
        if default
        else fix[:1].upper() + fix[1:]
    )
    return (
        f"model.task: {name} does not fit the preset {preset.location}: {name} {built_on}, and "
        f"the preset holds a {backbone_cls.__name__}. {fix}."
    )
