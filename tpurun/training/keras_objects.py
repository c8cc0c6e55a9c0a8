"""Keras objects a config names: ``adam``, ``binary_crossentropy``, ``MeanIoU`` or ``module:Name``,
resolved to the object (with a "did you mean" for a near miss), and named back in one word."""

from __future__ import annotations

import difflib
import inspect
from typing import Any

from tpurun.config import Config, NamedObject
from tpurun.errors import ModelError
from tpurun.training.user_code import import_object


def keras_object(spec: NamedObject, module: Any, what: str, config: Config, **extra: Any) -> Any:
    """Resolve a Keras name (``adam``, ``binary_crossentropy``) or ``module:Name``."""
    if ":" in spec.name:
        target = import_object(spec.name, config.base_dir, what)
        if inspect.isclass(target):
            return call(target, {**spec.kwargs, **extra}, what, spec.name)
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
            return call(target, {**spec.kwargs, **extra}, what, spec.name)
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


def call(cls: Any, kwargs: dict, what: str, name: str) -> Any:
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{what} '{name}': {exc}") from None


def short_name(obj: Any) -> str:
    """How to call a loss, metric or optimizer in one line."""
    if isinstance(obj, str):
        return obj
    return getattr(obj, "name", None) or getattr(obj, "__name__", None) or type(obj).__name__
