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
- **activations**, the approximate term (see :func:`transformer_activations` and
  :func:`layer_activations`): what the backward pass keeps of the forward pass for the per-device
  slice of the batch. XLA may fuse, rematerialise or keep temporaries this does not count. With
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
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tpurun.config.mesh_config import AXES

Spec = tuple[Any, ...]  # per dimension: None, an axis name, or a tuple of axis names

_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "uint32": 4,
             "float32": 4, "int64": 8, "uint64": 8, "float64": 8, "complex64": 8}  # fmt: skip


def itemsize(dtype: Any) -> int:
    """Bytes of one element of ``dtype`` (a name, a numpy dtype or anything with ``.name``)."""
    name = str(getattr(dtype, "name", dtype))
    if name in _ITEMSIZE:
        return _ITEMSIZE[name]
    bits = re.search(r"(\d+)", name)
    return max(1, int(bits.group(1)) // 8) if bits else 4


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
        for size, part in zip(self.shape, self.spec, strict=False):
            parts = math.prod(mesh.get(a, 1) for a in _names(part))
            elements *= -(-size // parts)
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


# -------------------------------------------------------------------------------- activations
@dataclass(frozen=True)
class Activations:
    """Bytes the backward pass keeps, per example of the device's batch slice: ``whole`` on
    every device of a model-axis group, ``split`` divided over the model axis. ``remat``: the
    same ``(whole, split)`` with every block recomputed (``train.remat``), where the term can
    tell; None where it cannot, or where remat is already counted."""

    basis: str
    batch: int  # examples per device (the global batch / the data axis)
    whole: float
    split: float = 0.0
    remat: tuple[float, float] | None = None

    def bytes(self, model: int = 1, batch: int | None = None) -> int:
        return int((self.batch if batch is None else batch) * (self.whole + self.split / model))

    def rematerialised(self) -> Activations:
        """The term with ``train.remat`` on (itself where it cannot tell)."""
        if self.remat is None:
            return self
        whole, split = self.remat
        return replace(self, basis=f"{self.basis}, each recomputed in the backward pass",
                       whole=whole, split=split, remat=None)  # fmt: skip

    def scaled(self, factor: float) -> Activations:
        """Every figure times ``factor`` (a compute dtype of another size)."""
        remat = None if self.remat is None else tuple(x * factor for x in self.remat)
        return replace(self, whole=self.whole * factor, split=self.split * factor, remat=remat)


def transformer_activations(layers: int, hidden: int, heads: int, sequence: int, batch: int,
                            compute_itemsize: int, vocabulary: int | None = None) -> Activations:  # fmt: skip
    """Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
    section 4.2): a transformer layer keeps ``s*b*h*(34 + 5*a*s/h)`` bytes of 16-bit activations
    (s the sequence, b the batch, h the hidden size, a the heads); with tensor parallelism over
    t devices and no sequence parallelism, ``s*b*h*(10 + 24/t + 5*a*s/(h*t))``: the layer norms'
    and residuals' ``10*s*b*h`` stay whole on each device, the attention and MLP inside are split
    (KerasHub's Gemma, Llama and Qwen layouts split them as Megatron does). Scaled by the compute
    dtype (x2 in float32), plus the float32 logits the loss reads, ``4*s*b*v/t`` (section 4.3).

    With every layer recomputed (``train.remat``; the paper's full recomputation, section 5):
    each layer keeps only its input, ``2*s*b*h`` (whole on each device), and the backward pass
    recomputes one layer at a time, holding that layer's activations above once, beside the
    logits: ``2*s*b*h*L + s*b*h*(10 + 24/t + 5*a*s/(h*t)) + 4*s*b*v/t``. Lower from 2 layers on.

    Approximate: it counts dropout masks a model without dropout does not keep, assumes
    full attention scores (a flash-attention kernel keeps far less), and grouped-query attention's
    smaller key/value projections and a wider MLP than 4h (Gemma's) move it a little either way.
    """
    scale = compute_itemsize / 2
    per_layer_whole = sequence * hidden * 10 * scale
    per_layer_split = sequence * hidden * (24 + 5 * heads * sequence / hidden) * scale
    logits = 4 * sequence * vocabulary if vocabulary else 0
    inputs = layers * 2 * sequence * hidden * scale  # what each layer keeps with remat
    remat = (inputs + per_layer_whole, per_layer_split + logits)
    return Activations(f"Korthikanti et al. 2022, {layers} layers of {sequence} tokens", batch,
                       layers * per_layer_whole, layers * per_layer_split + logits, remat)  # fmt: skip


def layer_activations(model: Any, batch: int) -> Activations | None:
    """Every layer's output for the per-device batch, in its compute dtype: what backpropagation
    keeps of a functional or sequential model (an upper bound where XLA fuses elementwise layers,
    a lower one for a layer's own temporaries). None where the layers' outputs are unknown (a
    subclassed model).

    ``train.remat`` leaves it as it is: the blocks it recomputes (layers holding layers) are
    among these layers, counted by their output alone. With remat a block keeps its inputs, the
    outputs of the layers before it, counted already; what it stops keeping, its inside, this
    term never saw. So it cannot tell what remat saves, and remat is not offered as a fix on it.
    """
    per_example = 0
    try:
        for layer in _leaf_layers(model):
            for out in _outputs(layer):
                elements = math.prod(int(n) for n in tuple(out.shape)[1:] if n is not None)
                per_example += elements * itemsize(getattr(out, "dtype", "float32"))
    except (AttributeError, ValueError):
        return None
    if not per_example:
        return None
    return Activations("every layer's output for the batch", batch, per_example)


def _leaf_layers(model: Any) -> list[Any]:
    out = []
    for layer in getattr(model, "layers", []):
        nested = getattr(layer, "layers", None)
        out += _leaf_layers(layer) if nested else [layer]
    return out


def _outputs(layer: Any) -> list[Any]:
    outputs = layer.output
    return list(outputs) if isinstance(outputs, list | tuple) else [outputs]


def activations_of(model: Any, batch: int, sequence: int | None = None,
                   remat: bool = False) -> Activations | None:  # fmt: skip
    """Korthikanti's term for a KerasHub transformer backbone, else :func:`layer_activations`;
    with ``remat``, as ``train.remat`` changes it."""
    term = _activations(model, batch, sequence)
    return term.rematerialised() if remat and term is not None else term


def _activations(model: Any, batch: int, sequence: int | None) -> Activations | None:
    backbone = getattr(model, "backbone", None)
    dims = _transformer_dims(backbone) if backbone is not None else None
    compute = itemsize(getattr(getattr(model, "dtype_policy", None), "compute_dtype", "float32"))
    if dims is not None:
        preprocessor = getattr(model, "preprocessor", None)
        sequence = sequence or getattr(preprocessor, "sequence_length", None) or dims["max_seq"]
        if sequence:
            vocabulary = getattr(backbone, "vocabulary_size", None)
            return transformer_activations(dims["layers"], dims["hidden"], dims["heads"],
                                           int(sequence), batch, compute, vocabulary)  # fmt: skip
    return layer_activations(model, batch)


def _transformer_dims(backbone: Any) -> dict[str, int] | None:
    layers = getattr(backbone, "num_layers", None)
    hidden = getattr(backbone, "hidden_dim", None)
    heads = getattr(backbone, "num_query_heads", None) or getattr(backbone, "num_heads", None)
    if not (layers and hidden and heads):
        return None
    max_seq = getattr(backbone, "max_sequence_length", None)
    return {"layers": layers, "hidden": hidden, "heads": heads, "max_seq": max_seq}


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
        per_slot = self.gradients
        total = per_slot * (self.slots.per_variable + (self.accumulation > 1))
        if self.slots.factored:
            total += sum(_factored(e) for e in self.trainable)
        return total + 4 * self.slots.scalars + self.counters

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


def estimate(entries: list[Entry], mesh: tuple[int, int] | None, slots: Slots, *,
             accumulation: int = 1, counters: int = 4,
             activations: Activations | None = None) -> Estimate:  # fmt: skip
    """Bytes per device of ``entries`` on ``mesh`` (``(data, model)``; None: one replica per
    device, every variable whole)."""
    return Estimate(list(entries), mesh_sizes(mesh), slots, accumulation, counters, activations)


def size(n: float) -> str:
    """Bytes for a person: ``15.8 GiB``, ``640 KiB``, ``12 B``."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
