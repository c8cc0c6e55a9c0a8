"""``tpurun config CONFIG --placement``: where each weight of the model would live on the run's mesh,
which rule put it there, and what it costs each device, without training.

The model is built on this process's CPU with its variables uninitialised (shapes only, as
``tpurun config`` counts a preset's parameters: :func:`tpurun.hub.report.shapes_only`), and the
run's layout is applied to it as the mesh's distribution applies it while ``train`` builds the model
(:func:`tpurun.hub.mesh_layout.plan_placer`): the same rules, the same refusal of a shape that does not
divide. No accelerator is needed, so a v5e-8 run's placement can be read on a laptop.
"""

from __future__ import annotations

import math
from typing import Any

from tpurun.config import Config
from tpurun.hub.mesh_layout import plan_placer
from tpurun.hub.report import set_up_cpu, shapes_only
from tpurun.hub.task_model import build_task
from tpurun.runtime.layout import check_rules_match
from tpurun.runtime.memory_check import run_mesh
from tpurun.runtime.sizes import itemsize
from tpurun.training.model import build_model

#: The rule a variable has without a model axis.
DATA_PARALLEL = "whole (data parallel: no runtime.mesh)"


def _shapes_only_model(config: Config, prepared: Any) -> Any:
    set_up_cpu(prepared.choice.backend, "tpurun config --placement builds the model on the CPU")
    with shapes_only():
        if config.model.preset is not None:
            return build_task(config, load_weights=False, compile=False)
        return build_model(
            config,
            prepared.choice.backend,
            prepared.normalization,
            data_files=prepared.data.train_files,
        )


def placement(config: Config, prepared: Any) -> dict[str, Any]:
    """Every variable of the model ``config`` builds, as the run's mesh would hold it.

    Returns:
        ``{"mesh": {"data", "model"}, "layout": its name, "variables": [{"path", "shape",
        "axes", "rule", "bytes", "bytes_per_device"}, ...], "bytes_per_device", "bytes"}``, the
        variables in the model's order; ``rule`` is how the listing names it (``runtime.layout:
        PATTERN``, ``GemmaBackbone.get_layout_map: PATTERN``, ``auto: attention heads``).

    Raises:
        ConfigError: the layout cannot place a variable, as ``train`` would refuse it.
        ModelError: the model cannot be built.
    """
    model = _shapes_only_model(config, prepared)
    mesh = run_mesh(config, prepared.choice, prepared.plan) or (prepared.plan.replicas, 1)
    sizes = {"data": mesh[0], "model": mesh[1]}
    if config.runtime.mesh is None:
        rows = [(v.path, tuple(v.shape), math.prod(v.shape) * itemsize(v.dtype),
                 (None,) * len(v.shape), DATA_PARALLEL) for v in model.weights]  # fmt: skip
        layout = "data parallel"
    else:
        placer = plan_placer(model, config, mesh)
        check_rules_match(placer)  # as train would, before any row: a rule of yours placed nothing
        rows = [(p.path, p.shape, p.nbytes, p.axes, p.how) for p in placer.placements.values()]
        layout = placer.source
    variables = []
    for path, shape, nbytes, axes, rule in rows:
        shards = math.prod(sizes[a] for a in axes if a)
        variables.append(
            {
                "path": path,
                "shape": list(shape),
                "axes": list(axes),
                "rule": rule,
                "bytes": nbytes,
                "bytes_per_device": nbytes // shards,
            }
        )
    return {
        "mesh": sizes,
        "layout": layout,
        "variables": variables,
        "bytes_per_device": sum(v["bytes_per_device"] for v in variables),
        "bytes": sum(v["bytes"] for v in variables),
    }
