"""The optimizer's state split over the data-parallel devices (ZeRO stage 1), not copied whole to each.

Keras' ``DataParallel`` keeps a whole copy of every variable on each device, the optimizer's too,
and each device runs the whole update: for Adam, two more copies of the weights on every device,
and an update bound by memory done once per device. With the state split, each device keeps and
updates its own share of every optimizer variable; the weights stay whole on each device, and
XLA's SPMD partitioner gathers what they need. The updates are the same: on the NAIC-like MLP
over 8 CPU devices (docs/benchmarks.md), the weights and the optimizer's state after 4 epochs
were bit for bit those of the whole copies, and the steady epochs went from 1.6 s to 1.0 s (8
copies of Adam's update shared 2 cores' memory bandwidth). On accelerators it is memory: Adam's
moments take ``2/N`` of the weights' size per device instead of twice it.

Where (:func:`devices_for`): the JAX backend, data parallel over several devices of one process,
and ``runtime.shard_optimizer_state`` left on. Not under a ``runtime.mesh`` (its layout places
every variable), nor with several processes: a checkpoint reads every value on its process's host,
and a share held by another process is not addressable there.

Which (:func:`split_dim`): each variable with a dimension the device count divides, along the
largest such dimension; the rest (scalars such as the iteration count, a bias of one unit) stay
whole. A weight's dimensions count the same way in the memory check (:mod:`.memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tpurun import frameworks


def devices_for(plan: Any, config: Any) -> int:
    """Over how many devices the optimizer's state is split for ``plan`` (1: not split)."""
    if (
        config.runtime.shard_optimizer_state
        and plan.backend == "jax"
        and plan.distribution == "data_parallel"
        and config.runtime.mesh is None
        and plan.num_processes == 1
        and plan.replicas > 1
    ):
        return plan.replicas
    return 1


def split_dim(shape: Sequence[int], devices: int) -> int | None:
    """The dimension a variable of ``shape`` is split along over ``devices``: the largest that
    they divide, the first of equals; None where none is (it stays whole on each device)."""
    dims = [i for i, size in enumerate(shape) if size >= devices and size % devices == 0]
    return max(dims, key=lambda i: (shape[i], -i)) if devices > 1 and dims else None


def place(model: Any, runtime: Any, devices: int) -> int:
    """Split the built optimizer's variables of ``model`` over the data axis of ``runtime``'s
    distribution, ``devices`` of them (:func:`devices_for`). Call before the training step is
    compiled: Keras takes the step's output shardings from the variables' arrays then. Returns
    how many variables were split.
    """
    if devices <= 1 or runtime.distribution is None:
        return 0
    jax, keras = frameworks.jax(), frameworks.keras()
    mesh = runtime.distribution.device_mesh
    split = 0
    for variable in model.optimizer.variables:
        dim = split_dim(tuple(variable.shape), devices)
        if dim is None:
            continue
        spec: list[str | None] = [None] * len(variable.shape)
        spec[dim] = mesh.axis_names[0]
        layout = keras.distribution.TensorLayout(spec, mesh)
        # Keras has no public setter for a variable's layout (3.15): its JAX variable places an
        # assigned value by ``_layout`` (a resume's, a NaN restore's: split the same way) and
        # holds its array in ``_value``.
        variable._layout = layout
        variable._value = jax.device_put(variable.value, layout.backend_layout)
        split += 1
    return split
