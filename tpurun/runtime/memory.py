"""What one device holds while a model trains: an estimate in bytes, made before anything compiles.

Four terms, per device (every device of a mesh holds the same shard shapes, the layout checks
having refused an uneven split):

- **parameters**: every variable's shard, ``ceil(dim / axis size)`` along each dimension the
  layout splits (a replicated variable whole);
- **gradients**: one per trainable variable, with its sharding and dtype (what ``jax.grad`` of
  Keras' stateless train step returns);
- **optimizer state**: the slots the optimizer's class adds per trainable variable, read from its
  type and settings *without building it* (building allocates them on the devices, the very thing
  the check runs before): Adam, AdamW, Lamb, Adamax, Nadam, Adadelta, Ftrl 2 (Adam with
  ``amsgrad`` 3); SGD with momentum, Adagrad, Lion 1; RMSprop 1, +1 with momentum, +1 centered;
  SGD without momentum 0; Adafactor a velocity plus its factored row and column statistics
  (replicated). Each slot has its variable's shape, dtype and sharding (Keras'
  ``add_variable_from_reference``), so LoRA's float32 adapters get float32 slots and frozen
  weights none. Also ``train.gradient_accumulation_steps`` > 1's accumulators (one more copy of the
  trainable variables), ``use_ema``'s averages, and Keras' scalars: the iteration counter (int32 on
  JAX, int64 on TensorFlow), the learning rate where it is a number rather than a schedule,
  Nadam's running product. An optimizer class tpurun does not know is counted as 2 slots, and said.
  Under data parallelism the slots are split over the devices (``runtime.shard_optimizer_state``,
  :mod:`tpurun.runtime.optimizer_split`): each device holds its share of a variable's slot where
  the device count divides one of its dimensions.
- **activations**, the approximate term (:mod:`tpurun.runtime.activations`): what the backward
  pass keeps of the forward pass for the per-device slice of the batch. XLA may fuse, rematerialise or keep temporaries this does not count. With
  ``train.remat`` (each block recomputed in the backward pass), a transformer's term is
  Korthikanti et al.'s full recomputation: each layer's input, plus one layer's activations and
  the logits; the every-layer-output term is unchanged (it cannot see inside a block).

The estimate reads variables through a small interface, :class:`Entry` (path, shape, dtype,
partition spec over the mesh axes ``("data", "model")``, trainable), so it serves both a live
model (each variable's ``value.sharding.spec``) and a plan made without the devices (the layout's
rules applied to the shapes: ``specs``). Imports no framework.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tpurun.config.mesh_config import AXES
from tpurun.runtime.activations import Activations
from tpurun.runtime.optimizer_split import split_dim
from tpurun.runtime.sizes import itemsize, size

Spec = tuple[Any, ...]  # per dimension: None, an axis name, or a tuple of axis names


@dataclass(frozen=True)
class Entry:
    """One variable, as the estimate needs it."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: Spec  # one entry per dimension (padded with None)
    trainable: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def lora(self) -> bool:
        return "lora_kernel" in self.path

    def axes(self) -> set[str]:
        return {a for part in self.spec for a in _names(part)}

    def shard_bytes(self, mesh: Mapping[str, int]) -> int:
        """Bytes one device holds of it on ``mesh`` (``{"data": d, "model": m}``)."""
        elements = 1
        for dim, part in zip(self.shape, self.spec, strict=False):
            parts = math.prod(mesh.get(a, 1) for a in _names(part))
            elements *= -(-dim // parts)
        return elements * itemsize(self.dtype)


def _names(part: Any) -> tuple[str, ...]:
    if part is None:
        return ()
    return (part,) if isinstance(part, str) else tuple(part)


def _padded(spec: Iterable[Any] | None, ndim: int) -> Spec:
    spec = tuple(spec or ())
    return spec + (None,) * (ndim - len(spec))


def entries_of(model: Any, specs: Mapping[str, Spec] | None = None) -> list[Entry]:
    """The model's variables (each once) as entries. A variable's spec is ``specs[path]`` where
    given (a plan made without the devices), else its value's sharding (a live model), else
    replicated."""
    trainable = {id(v) for v in model.trainable_weights}
    out, seen = [], set()
    for v in model.weights:
        if id(v) in seen:
            continue
        seen.add(id(v))
        shape = tuple(int(n) for n in v.shape)
        if specs is not None:
            spec = specs.get(v.path)
        else:
            sharding = getattr(_value(v), "sharding", None)
            spec = getattr(sharding, "spec", None)
        dtype = str(getattr(v.dtype, "name", v.dtype))
        out.append(Entry(v.path, shape, dtype, _padded(spec, len(shape)), id(v) in trainable))
    return out


def _value(variable: Any) -> Any:
    try:
        return variable.value
    except Exception:  # an uninitialised variable (a stateless scope): no value, no sharding
        return None


# ----------------------------------------------------------------------------- optimizer state
@dataclass(frozen=True)
class Slots:
    """What an optimizer adds per trainable variable, known from its class and settings."""

    name: str  # the class, as Keras names it
    per_variable: int  # slots of the variable's shape, dtype and sharding
    factored: bool = False  # Adafactor's row and column statistics
    scalars: int = 0  # Nadam's running product and the like (4 bytes each)
    known: bool = True

    def describe(self) -> str:
        n = self.per_variable
        what = f"{n} slot{'s' if n != 1 else ''}"
        if self.factored:
            what = "factored statistics and 1 slot"
        guess = ", assumed: tpurun does not know this optimizer" if not self.known else ""
        return f"{self.name}: {what} per trainable variable{guess}"


_TWO = ("adam", "adamw", "lamb", "adamax", "nadam", "adadelta", "ftrl", "muon",
        "schedulefreeadamw")  # fmt: skip


def slots_for(name: str, settings: Mapping[str, Any]) -> Slots:
    """The slots of the optimizer class ``name`` (``adam``, ``AdamW``, ``module:Class``) with
    ``settings`` (its kwargs or ``get_config()``); Keras 3.15's ``build`` methods, read."""
    cls = name.rpartition(":")[2].rpartition(".")[2]
    key = cls.replace("_", "").lower()
    ema = 1 if settings.get("use_ema") else 0
    if key == "sgd":
        n = 1 if settings.get("momentum", 0.0) else 0
    elif key == "rmsprop":
        n = 1 + (settings.get("momentum", 0.0) > 0) + bool(settings.get("centered"))
    elif key in ("adagrad", "lion"):
        n = 1
    elif key in ("adam", "adamw"):
        n = 3 if settings.get("amsgrad") else 2
    elif key == "adafactor":
        return Slots(cls, 1 + ema, factored=True)
    elif key in _TWO:
        n = 2
    else:
        return Slots(cls, 2 + ema, known=False)
    return Slots(cls, n + ema, scalars=1 if key == "nadam" else 0)


def slots_of(optimizer: Any) -> Slots:
    """The slots of a Keras optimizer instance (unbuilt is fine); a loss-scale wrapper's inner."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        found = slots_of(inner)
        return replace(found, scalars=found.scalars + 2)  # its scale and step counter
    return slots_for(type(optimizer).__name__, optimizer.get_config())


# ----------------------------------------------------------------------------------- estimate
@dataclass
class Estimate:
    """Bytes per device, by term, and what they were computed from (to recompute what would fit)."""

    entries: list[Entry]
    mesh: dict[str, int]  # {"data": d, "model": m}; {"data": 1, "model": 1} without a mesh
    slots: Slots
    accumulation: int = 1  # train.gradient_accumulation_steps
    counters: int = 4  # bytes of Keras' scalars (iteration, a learning-rate variable)
    activations: Activations | None = None
    notes: list[str] = field(default_factory=list)
    optimizer_devices: int = 1  # the data-parallel devices the optimizer's slots are split over

    @property
    def trainable(self) -> list[Entry]:
        return [e for e in self.entries if e.trainable]

    @property
    def parameters(self) -> int:
        return sum(e.shard_bytes(self.mesh) for e in self.entries)

    @property
    def gradients(self) -> int:
        return sum(e.shard_bytes(self.mesh) for e in self.trainable)

    @property
    def optimizer(self) -> int:
        per_slot = sum(self._slot_bytes(e) for e in self.trainable)
        total = per_slot * (self.slots.per_variable + (self.accumulation > 1))
        if self.slots.factored:
            total += sum(_factored(e) for e in self.trainable)
        return total + 4 * self.slots.scalars + self.counters

    def _slot_bytes(self, entry: Entry) -> int:
        """One optimizer slot of ``entry`` on a device: its share where the state is split
        (:mod:`tpurun.runtime.optimizer_split`), else the variable's shard whole."""
        whole = entry.shard_bytes(self.mesh)
        devices = self.optimizer_devices
        return whole // devices if split_dim(entry.shape, devices) is not None else whole

    @property
    def activation_bytes(self) -> int | None:
        if self.activations is None:
            return None
        return self.activations.bytes(self.mesh.get("model", 1))

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + (self.activation_bytes or 0)

    def on(self, mesh: Mapping[str, int] | None = None, **changes: Any) -> Estimate:
        """The same model on another mesh (or with other fields): ``est.on({"data": 1, "model": 8})``."""
        return replace(self, mesh=dict(mesh or self.mesh), **changes)

    def to_dict(self) -> dict[str, Any]:
        """``memory_per_device`` for ``tpurun config --json``: bytes by term."""
        out = {"parameters": self.parameters, "gradients": self.gradients,
               "optimizer": self.optimizer, "activations": self.activation_bytes,
               "total": self.total}  # fmt: skip
        return out

    def counts(self) -> dict[str, int]:
        """``parameters: {total, trainable}``: elements, not bytes."""
        return {"total": sum(math.prod(e.shape) for e in self.entries),
                "trainable": sum(math.prod(e.shape) for e in self.trainable)}  # fmt: skip

    def layout(self) -> dict[str, Any]:
        """How many variables (and bytes, unsharded) are split over each axis, and replicated."""
        split = {}
        for axis in AXES:
            over = [e for e in self.entries if axis in e.axes()]
            split[axis] = {"variables": len(over), "bytes": sum(e.nbytes for e in over)}
        whole = [e for e in self.entries if not e.axes()]
        return {"variables": len(self.entries), "bytes": sum(e.nbytes for e in self.entries),
                "split": split,
                "replicated": {"variables": len(whole), "bytes": sum(e.nbytes for e in whole)}}  # fmt: skip

    def terms_text(self) -> str:
        """``parameters 1.2 GiB, gradients ..., optimizer state ..., activations ...``."""
        parts = [f"parameters {size(self.parameters)}", f"gradients {size(self.gradients)}",
                 f"optimizer state {size(self.optimizer)} ({self.slots.describe()})"]  # fmt: skip
        if self.activation_bytes is not None:
            parts.append(f"activations about {size(self.activation_bytes)}")
        return ", ".join(parts)


def _factored(entry: Entry) -> int:
    """Adafactor's row and column statistics of a variable (replicated: ``add_variable`` gets no
    layout of the variable's); a placeholder int32 scalar for each below 2 dimensions."""
    if len(entry.shape) < 2:
        return 8
    rows = math.prod(entry.shape[:-1])
    columns = math.prod(entry.shape[:-2]) * entry.shape[-1]
    return (rows + columns) * itemsize(entry.dtype)


def mesh_sizes(mesh: tuple[int, int] | None) -> dict[str, int]:
    data, model = mesh or (1, 1)
    return {"data": data, "model": model}


def counter_bytes(backend: str, learning_rate_variable: bool) -> int:
    """Keras' scalars: the iteration counter ("int" is int32 on JAX, int64 on TensorFlow) and the
    learning rate, a float32 variable where it is a number (a schedule is not a variable)."""
    return (4 if backend == "jax" else 8) + (4 if learning_rate_variable else 0)


def estimate(
    entries: list[Entry],
    mesh: tuple[int, int] | None,
    slots: Slots,
    *,
    accumulation: int = 1,
    counters: int = 4,
    activations: Activations | None = None,
    optimizer_devices: int = 1,
) -> Estimate:
    """Bytes per device of ``entries`` on ``mesh`` (``(data, model)``; None: one replica per
    device, every variable whole); ``optimizer_devices``: the devices the optimizer's state is
    split over (:func:`tpurun.runtime.optimizer_split.devices_for`)."""
    return Estimate(list(entries), mesh_sizes(mesh), slots, accumulation, counters, activations,
                    optimizer_devices=optimizer_devices)  # fmt: skip
