"""The device mesh (``runtime.mesh``) and the Keras distribution that places every weight on it.

Model parallelism is JAX only: Keras' distribution API on TensorFlow is marked as a prototype not to
use. The mesh's axes are ``data`` (each row of devices takes a slice of every batch) and ``model``
(each device in a row holds a slice of every weight the layout splits). The global batch stays
``train.per_core_batch_size`` times all the devices whatever the mesh's shape, as MaxText counts
it: a run's steps, learning rate and checkpoints do not depend on the shape, so a checkpoint written
under 2x4 resumes under 4x2 or 8x1 as the same run.

Several processes: each feeds its own share of every batch (``tpurun.multihost.shares``), so each
must hold whole rows of the data axis: the data axis is a multiple of the process count.
"""

from __future__ import annotations

import re
from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.config.mesh_config import AXES
from tpurun.errors import ConfigError
from tpurun.runtime.auto_layout import Weight
from tpurun.runtime.layout import Placer, Rule, check_placements
from tpurun.runtime.machine import installed_version
from tpurun.runtime.sizes import itemsize

#: Keras before 3.15 silently dropped weights across shards when it loaded sharded H5 files.
KERAS_FOR_MESH = (3, 15)


def check_support(mesh: Any, backend: str, keras_version: str | None = None) -> None:
    """A model axis needs JAX, and a Keras that loads sharded weights whole (3.15 or later;
    ``keras_version``: the installed one's unless given)."""
    if mesh is None or mesh.model <= 1:
        return
    found = keras_version or installed_version("keras") or ""
    numbers = tuple(int(n) for n in re.findall(r"\d+", found)[:2])
    if numbers and numbers < KERAS_FOR_MESH:
        wanted = ".".join(map(str, KERAS_FOR_MESH))
        raise ConfigError(
            [
                f"runtime.mesh: a model axis ({mesh.model}) needs Keras {wanted} or later, and "
                f"Keras {found} is installed: earlier versions silently drop weights across shards "
                f"when they load a sharded model. Run pip install -U 'keras>={wanted}', then "
                "restart the kernel or process."
            ]
        )
    if backend != "jax":
        raise ConfigError(
            [
                f"runtime.mesh: a model axis ({mesh.model}) needs the JAX backend, and this run "
                f"uses {backend}. Keras' distribution API on TensorFlow is a prototype not meant for "
                "use, so tpurun splits models over devices on JAX only. Set runtime.backend: jax "
                "(pip install jax), or drop runtime.mesh to train data parallel."
            ]
        )


def resolve(mesh: Any, devices: int, processes: int = 1) -> tuple[int, int]:
    """``(data, model)`` for ``devices`` devices (all processes').

    Raises:
        ConfigError: the product is not the device count, ``auto`` cannot fill it, or the data
            axis does not give each process whole rows.
    """
    model = mesh.model
    if mesh.data == "auto":
        if devices % model:
            raise ConfigError(
                [
                    f"runtime.mesh: model: {model} does not divide the {devices} devices, so `data: "
                    f"auto` cannot fill the mesh. Use a model axis that divides {devices} "
                    f"({', '.join(str(k) for k in range(1, devices + 1) if devices % k == 0)})."
                ]
            )
        data = devices // model
    else:
        data = mesh.data
    if data * model != devices:
        raise ConfigError(
            [
                f"runtime.mesh: data {data} x model {model} = {data * model} devices, and this run "
                f"has {devices}. The product must be the device count of all processes: set data: "
                "auto (it takes the rest), or sizes whose product is "
                f"{devices}."
            ]
        )
    if processes > 1 and data % processes:
        raise ConfigError(
            [
                f"runtime.mesh: the data axis ({data}) must be a multiple of the {processes} "
                "processes: each process feeds its own slice of every batch, so each must hold whole "
                f"rows of the mesh. Use data: {processes} or a multiple of it (with a model axis of "
                f"{devices // processes} or less per process)."
            ]
        )
    return data, model


def rules_for(config: Config, mesh: Any, backbone: Any) -> tuple[list[Rule], list[Rule], str, bool]:
    """The config's rules, the preset's, the layout's name, and whether ``auto`` places the rest.
    ``backbone``: a preset's backbone class (:func:`tpurun.hub.mesh_layout.backbone_class`), None
    for a ``model.factory`` model.

    Raises:
        ConfigError: ``layout: preset`` on a model with no layout of its own.
    """
    layout = config.runtime.layout
    mine = [(r.pattern, tuple(r.axes)) for r in layout] if isinstance(layout, list) else []
    if layout == "auto" or not _has_layout(backbone):
        if layout == "preset":
            what = f"the backbone {backbone.__name__}" if backbone else "a model.factory model"
            raise ConfigError(
                [
                    f"runtime.layout: preset, and {what} has no layout of its own (KerasHub gives "
                    "Gemma, Llama and Qwen one). Set runtime.layout: auto (every large weight split "
                    "along a dimension the model axis divides), or give rules: [{pattern, axes}, ...]."
                ]
            )
        return mine, [], "auto" if not mine else "runtime.layout, then auto", True
    name = f"the preset's ({backbone.__name__})"
    return mine, _preset_rules(backbone, mesh), name, False


def _has_layout(backbone: Any) -> bool:
    return backbone is not None and hasattr(backbone, "get_layout_map")


def _preset_rules(backbone: Any, mesh: Any) -> list[Rule]:
    layout_map = backbone.get_layout_map(
        mesh, model_parallel_dim_name="model", data_parallel_dim_name="data"
    )
    return [(pattern, tuple(layout.axes)) for pattern, layout in layout_map.items()]


def _device_mesh(keras: Any, shape: tuple[int, int], devices: list) -> Any:
    """Devices in the order the hardware links them (``mesh_utils`` on a TPU slice), so a
    model-axis all-reduce stays between neighbours; on CPUs and GPUs, as JAX lists them."""
    mesh_utils = frameworks.jax("experimental.mesh_utils")

    try:
        ordered = mesh_utils.create_device_mesh(shape, devices=devices).reshape(-1).tolist()
    except (ValueError, NotImplementedError, AssertionError):
        ordered = devices
    return keras.distribution.DeviceMesh(shape, list(AXES), devices=ordered)


def weight_of(layer: Any, name: str) -> Weight | None:
    """What ``layer`` says of the dimensions of its weight ``name`` (the ``auto`` rule's
    :class:`~tpurun.runtime.auto_layout.Weight`): an EinsumDense kernel's equation, an
    embedding's vocabulary; None for any other layer (its shape alone places it)."""
    keras = frameworks.keras()
    if isinstance(layer, keras.layers.EinsumDense) and name == "kernel":
        return Weight(type(layer).__name__, equation=layer.equation)
    if isinstance(layer, keras.layers.Embedding) and name.endswith("embeddings"):
        return Weight(type(layer).__name__, vocabulary=int(layer.input_dim))
    return None


def weights_of(model: Any) -> dict[str, Weight]:
    """:func:`weight_of` for each variable of a built ``model``, by path (a layer's variables are
    at its path)."""
    layers = {layer.path: layer for layer in model._flatten_layers(include_self=False)}
    out = {}
    for variable in model.variables:
        parent, _, name = variable.path.rpartition("/")
        weight = weight_of(layers.get(parent), name)
        if weight is not None:
            out[variable.path] = weight
    return out


def _creating_layer(path: str) -> Any:
    """The layer creating the variable at ``path`` now: Keras' ``add_weight`` opens the layer's
    name scope with the layer as its caller."""
    state = frameworks.keras("src.backend.common.global_state")
    stack = state.get_global_attribute("name_scope_stack") or []
    caller = stack[-1].caller if stack else None
    return caller if getattr(caller, "path", None) == path.rpartition("/")[0] else None


_PLACING: Any = None


def _placing_class(keras: Any) -> Any:
    """A ``ModelParallel`` that asks the :class:`Placer` where each variable goes (made once:
    Keras is imported only after the runtime is set up)."""
    global _PLACING
    if _PLACING is None:
        jnp = frameworks.jax("numpy")

        class PlacingModelParallel(keras.distribution.ModelParallel):
            def __init__(self, *, placer: Placer, **kwargs):
                super().__init__(**kwargs)
                self.placer = placer

            def get_variable_layout(self, variable):
                if getattr(variable, "_layout", None) is not None:
                    return variable._layout
                itemsize = jnp.dtype(variable.dtype).itemsize
                path = variable.path
                weight = weight_of(_creating_layer(path), path.rpartition("/")[2])
                axes = self.placer.place(path, variable.shape, itemsize, weight)
                return keras.distribution.TensorLayout(list(axes), self.device_mesh)

        _PLACING = PlacingModelParallel
    return _PLACING


def placing(placer: Placer, keras_mesh: Any, auto_shard: bool = True) -> Any:
    """A Keras ``ModelParallel`` distribution over ``keras_mesh`` that places each variable where
    ``placer`` says, as it is created (``auto_shard``: Keras splits a dataset over the processes
    itself; off where each process reads its own share)."""
    keras = frameworks.keras()
    return _placing_class(keras)(
        placer=placer,
        batch_dim_name="data",
        auto_shard_dataset=auto_shard,
        layout_map=keras.distribution.LayoutMap(keras_mesh),
    )


def install(runtime: Any, config: Config, backbone: Any) -> Placer | None:
    """Set the mesh's distribution for the model ``config`` describes (before it is built);
    ``backbone`` as for :func:`rules_for`. A run without a mesh keeps the distribution activate
    set."""
    if runtime.mesh is None:
        return None
    keras = frameworks.keras()

    data, model = runtime.mesh
    keras_mesh = _device_mesh(keras, (data, model), runtime.devices)
    rules, preset, source, auto = rules_for(config, keras_mesh, backbone)
    placer = Placer(rules, {"data": data, "model": model}, source, preset=preset, auto=auto)
    runtime.placer = placer
    if data * model == 1:
        # One device: no distribution, as activate sets none for one device (over a one-device
        # mesh Keras leaves the variables uncommitted beside committed batches, and each step
        # compiled 3 times); :func:`check` places the built model's weights instead.
        return placer
    distribution = placing(placer, keras_mesh, auto_shard=not runtime.choice.cluster.multi)
    keras.distribution.set_distribution(distribution)
    runtime.distribution = distribution
    return placer


def plan_placer(model: Any, config: Config, mesh: tuple[int, int], backbone: Any) -> Placer:
    """The run's layout applied to a model built without the devices (a stateless scope): each
    variable placed as the mesh's distribution would place it as it is created. No device is
    needed: the rules read only the mesh's shape. ``backbone`` as for :func:`rules_for`.

    Raises:
        ConfigError: the layout cannot place a variable (an indivisible shape, two rules).
    """
    keras = frameworks.keras()
    # Any n objects stand for the devices: get_layout_map reads the mesh's axis names only.
    devices = [f"device:{i}" for i in range(mesh[0] * mesh[1])]
    shape = keras.distribution.DeviceMesh(mesh, list(AXES), devices=devices)
    mine, preset, source, auto = rules_for(config, shape, backbone)
    placer = Placer(mine, {"data": mesh[0], "model": mesh[1]}, source, preset, auto=auto)
    _place_weights(placer, model)
    return placer


def _place_weights(placer: Placer, model: Any) -> None:
    """Each of the built ``model``'s variables placed as the mesh's distribution places it as it
    is created."""
    weights = weights_of(model)
    for v in model.weights:
        placer.place(v.path, v.shape, itemsize(v.dtype), weights.get(v.path))


def check(runtime: Any, model: Any, config: Config) -> None:
    """After building under :func:`install`: the layout holds (see
    :func:`tpurun.runtime.layout.check_placements`). LoRA adapters may stay whole."""
    if runtime.placer is None:
        return
    if runtime.distribution is None and not runtime.placer.placements:
        _place_weights(runtime.placer, model)  # a one-device mesh (see install): placed now
    exempt = [v.path for v in model.trainable_variables if "lora_kernel" in v.path]
    paths = [v.path for v in model.variables]
    check_placements(
        runtime.placer, paths, exempt, config_rules=isinstance(config.runtime.layout, list)
    )
