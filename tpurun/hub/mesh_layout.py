"""A model's layout over the mesh, with a preset's own: the backbone class a ``model.preset``
builds, whose ``get_layout_map`` (KerasHub gives Gemma, Llama and Qwen one) ``layout: preset``
reads, handed down to :mod:`tpurun.runtime.mesh`, which installs the layout or plans it.

A ``model.factory`` model has no backbone here: :mod:`tpurun.runtime.mesh` then places it by the
config's rules and ``auto``. The preset is read only for a run with a mesh.
"""

from __future__ import annotations

from typing import Any

from tpurun.config import Config
from tpurun.hub.preset import read
from tpurun.hub.task import concrete, task_class
from tpurun.runtime import mesh
from tpurun.runtime.layout import Placer


def backbone_class(config: Config) -> Any:
    """The backbone class of ``config``'s preset (its task's ``backbone_cls``); None for a
    ``model.factory`` model."""
    if config.model.preset is None:
        return None
    preset = read(config)
    cls = concrete(task_class(preset, config.model.task), preset)
    return getattr(cls, "backbone_cls", None)


def install(runtime: Any, config: Config) -> Placer | None:
    """:func:`tpurun.runtime.mesh.install` for the model ``config`` describes (before it is
    built). A run without a mesh keeps the distribution activate set."""
    if runtime.mesh is None:
        return None
    return mesh.install(runtime, config, backbone_class(config))


def plan_placer(model: Any, config: Config, shape: tuple[int, int]) -> Placer:
    """:func:`tpurun.runtime.mesh.plan_placer` for ``model``, built from ``config`` without the
    devices, on a mesh of ``shape`` ``(data, model)``.

    Raises:
        ConfigError: the layout cannot place a variable (an indivisible shape, two rules).
    """
    return mesh.plan_placer(model, config, shape, backbone_class(config))
