"""Monitors, in one home: which metric each callback watches, checked against the metrics a
compiled model will log before the first step, which way it improves, and whether a value did.

``monitor: auto`` becomes ``val_loss`` or ``loss`` in the plan (:func:`tpurun.plan.plan.resolve_monitor`,
below training, as the plan records the checkpoint's monitor); everything else about monitors is
here. The names a compiled (and built) model logs are known once Keras has built its metrics, which
``fit`` does before ``on_train_begin``; the direction of a ``mode: auto`` comes from the metric
object itself, as Keras' ``MonitorCallback`` reads it, not from its name.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.errors import ConfigError
from tpurun.plan.plan import resolve_monitor


def logged_metrics(model: Any) -> dict[str, Any]:
    """The metric objects of a compiled, built model by the name ``fit`` logs them under.

    Compiled metrics and losses are nested in Keras' containers; their names are what the logs
    use (before a ``val_`` prefix).
    """
    compile_utils = frameworks.keras("src.trainers.compile_utils")

    containers = (compile_utils.CompileMetrics, compile_utils.MetricsList)
    found: dict[str, Any] = {}
    for metric in model.metrics:
        inner = metric.metrics if isinstance(metric, containers) else [metric]
        for m in inner:
            found.setdefault(m.name, m)
    return found


def monitor_mode(metrics: Mapping[str, Any], monitor: str, mode: str) -> str | None:
    """``min`` or ``max`` for a monitor: as given, else the metric object's own direction (as
    Keras' ``MonitorCallback`` reads it); None when that cannot be known."""
    if mode != "auto":
        return mode
    name = monitor.removeprefix("val_")
    if name == "loss" or name.endswith("_loss"):
        return "min"
    direction = getattr(metrics.get(name), "_direction", None)
    return {"up": "max", "down": "min"}.get(direction)


def monitors(config: Config) -> dict[str, tuple[str, str]]:
    """``{callbacks section: (monitor, mode)}`` for the sections that watch a metric."""
    cb = config.callbacks
    out = {}
    if cb.checkpoint is not None:
        out["checkpoint"] = (resolve_monitor(config, cb.checkpoint.monitor), cb.checkpoint.mode)
    for key in ("early_stopping", "reduce_lr_on_plateau"):
        section = getattr(cb, key)
        if section is not None:
            out[key] = (resolve_monitor(config, section.monitor), section.mode)
    return out


def resolve_monitors(model: Any, config: Config) -> dict[str, str]:
    """Check every monitor against the metrics the compiled (and built) model will log, and settle
    each ``mode: auto``: ``{callbacks section: "min" | "max"}``. ``train`` calls it before the first
    step (a typo found after epoch 1 costs an epoch), ``doctor`` after its model step.

    Raises:
        ConfigError: a monitor that will never be logged (with "did you mean", or naming the
            missing validation set), or one whose direction cannot be known.
    """
    metrics = logged_metrics(model)
    has_validation = bool(config.data.validation)
    logged = [*metrics, *(f"val_{m}" for m in metrics if has_validation)]
    problems, modes = [], {}
    for key, (monitor, mode) in monitors(config).items():
        where = f"callbacks.{key}.monitor: '{monitor}'"
        if monitor not in logged:
            if monitor.startswith("val_") and not has_validation and monitor[4:] in metrics:
                problems.append(
                    f"{where} needs a validation set, and data.validation is not set; monitor "
                    f"'{monitor[4:]}' instead, or add data.validation"
                )
                continue
            close = difflib.get_close_matches(monitor, logged, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"the model logs {', '.join(logged)}"
            problems.append(f"{where} is not a metric this model logs; {hint}")
            continue
        modes[key] = monitor_mode(metrics, monitor, mode)
        if modes[key] is None:
            problems.append(
                f"callbacks.{key}.mode: auto cannot tell whether '{monitor}' improves up or down "
                "(its metric does not say); set mode: max or mode: min"
            )
    if problems:
        raise ConfigError(problems)
    return modes


def apply_monitor_modes(modes: Mapping[str, str], checkpointer: Any) -> None:
    """Give the checkpointer and its stateful callbacks the directions :func:`resolve_monitors`
    settled (Keras' own read it at their first epoch end)."""
    if checkpointer.save_best:
        checkpointer.mode = modes["checkpoint"]
    for callback in checkpointer.stateful.values():
        callback.mode = modes[callback.SECTION]


def improved(value: float, best: float | None, mode: str | None) -> bool:
    """Whether ``value`` beats ``best`` in the monitor's direction (a NaN or Inf never does; the
    first finite value always does)."""
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value < best if mode == "min" else value > best
