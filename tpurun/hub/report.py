"""What ``tpurun config`` shows about a preset: its task, sequence length, LoRA and parameters.

Counting parameters needs the task model built, and ``tpurun config`` otherwise never imports
Keras. For a preset only, it sets its own process up on the CPU (never an accelerator another
process may hold; nothing else runs in that process afterwards) and builds the model under a
stateless scope that leaves the variables uninitialised: shapes only, no weights read or drawn,
so a 7B preset counts in seconds and no memory. A factory config stays as fast as before. A child
process would keep the parent clean too, but costs the same imports again for nothing.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.hub.mesh_layout import plan_placer
from tpurun.hub.preset import location
from tpurun.hub.task_model import build_task, longest_sequence, parameter_counts
from tpurun.runtime.activate import activate
from tpurun.runtime.choice import Choice
from tpurun.runtime.memory_check import device_limit, estimate_for_model, fixes


def set_up_cpu(
    backend: str, why: str = "tpurun config counts a preset's parameters on the CPU"
) -> None:
    """Set this process up on one CPU device for ``backend``, unless it already is: for work
    that needs Keras or KerasHub but no accelerator (counting parameters, tokenising text)."""
    if frameworks.backend() is not None:
        return
    imported = sys.modules.get("keras")
    if imported is not None:
        # TensorFlow imported Keras while the data was read, which fixed its backend.
        backend = imported.backend.backend()
    choice = Choice(
        backend=backend,
        accelerator="cpu",
        distribution="default",
        replicas=1,
        precision="float32",
        reason=why,
    )
    activate(choice, seed=0)


def _pending_variables() -> list:
    """Keras' list of variables created under a stateless scope, to be initialised later
    (``keras/src/backend/common/variables.py``, ``register_uninitialized_variable``)."""
    state = frameworks.keras("src.backend.common.global_state")
    return state.get_global_attribute("uninitialized_variables", [], set_to_default=True)


@contextlib.contextmanager
def shapes_only() -> Iterator[None]:
    """Build models inside with their variables uninitialised: shapes only, no weights read or
    drawn (a 7B preset in seconds and no memory). Keras keeps a list of such variables to draw
    later; the next fit in this process would draw every one (a notebook's): these are dropped
    from it on the way out, having only ever been counted."""
    keras = frameworks.keras()
    pending = _pending_variables()
    before = len(pending)
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield
    finally:
        del pending[before:]


def describe(
    config: Config,
    backend: str = "jax",
    plan: Any = None,
    mesh: tuple[int, int] | None = None,
    limit: Any = None,
) -> dict[str, Any]:
    """``{"preset": {...}, "parameters": {"total", "trainable"}}`` for ``derived``; with a plan,
    also ``mesh``, ``layout`` and ``memory_per_device`` (see :func:`memory_report`).

    Args:
        config: a config with a ``model.preset``.
        backend: the backend to count on where the process is not set up yet (the one the config
            would train on; counts do not depend on it).
        plan, mesh: the run's plan and ``(data, model)`` (None: data parallel on its replicas).
        limit: the device's memory (:class:`tpurun.runtime.memory_check.Limit`); None: the
            config's ``runtime.device_memory``, if set.

    Raises:
        ModelError: as :func:`tpurun.hub.task_model.build_task`.
    """
    set_up_cpu(backend)
    with shapes_only():
        task = build_task(config, load_weights=False, compile=False)
    preprocessor = task.preprocessor
    lora = config.model.lora
    preset = {
        "location": location(config),
        "task": type(task).__name__,
        "backbone": type(task.backbone).__name__,
        "sequence_length": getattr(preprocessor, "sequence_length", None),
        "max_sequence_length": longest_sequence(task),
        "lora": None if lora is None else {"rank": lora.rank, "alpha": lora.alpha or lora.rank},
    }
    out = {"preset": preset, "parameters": parameter_counts(task).to_dict()}
    if plan is not None:
        out.update(memory_report(task, config, plan, mesh, limit))
    return out


def memory_report(
    model: Any, config: Config, plan: Any, mesh: tuple[int, int] | None, limit: Any = None
) -> dict[str, Any]:
    """``mesh``, ``layout`` (variables and bytes split over each axis, and whole) and
    ``memory_per_device`` (bytes by term) of a model built without the devices: the layout's rules
    applied to its variables' shapes, as the mesh's distribution would place them.

    Raises:
        ConfigError: the layout cannot place a variable (an indivisible shape, two rules).
    """
    mesh = mesh or (plan.replicas, 1)
    specs, source = plan_specs(model, config, mesh)
    est = estimate_for_model(model, config, plan, mesh, specs)
    out = {"mesh": {"data": mesh[0], "model": mesh[1]},
           "layout": {"source": source, **est.layout()},
           "memory_per_device": est.to_dict()}  # fmt: skip
    limit = limit or device_limit(config)
    if limit is not None:
        fits = est.total <= limit.bytes
        out["device_memory"] = {**limit.to_dict(), "fits": fits}
        if not fits:  # what train's refusal would say fits
            out["device_memory"]["fixes"] = [t for t, ok in fixes(est, limit, config, plan) if ok]
    return out


def plan_specs(model: Any, config: Config, mesh: tuple[int, int]) -> tuple[dict, str]:
    """Each variable's axes as the run's layout would place it on ``mesh`` (no device needed:
    the rules read only the mesh's shape), and the layout's name. Whole without a model axis."""
    if config.runtime.mesh is None:
        return {v.path: (None,) * len(v.shape) for v in model.weights}, "data parallel"
    placer = plan_placer(model, config, mesh)
    return {path: p.axes for path, p in placer.placements.items()}, placer.source
