"""A quantized base under LoRA (QLoRA): ``model.quantize: int8 | int4`` on a preset's backbone.

:func:`quantize` runs between loading and ``enable_lora`` (:func:`tpurun.hub.task_model.build_task`):
Keras' ``quantize`` replaces each Dense, EinsumDense and Embedding kernel of the backbone with
integers and float32 scales (int8: one byte an element; int4: two elements a byte, scales per
block of 128 inputs), all frozen; ``enable_lora`` then adds float32 adapters beside the integer
kernels of the attention query and value layers (keras ``EinsumDense.enable_lora`` takes both
modes). The task's own head, outside the backbone, stays as it is.

Checked on Keras 3.15.1:

- **The int8 tied embedding's gradient.** ``ReversibleEmbedding._int8_call(reverse=True)`` (the
  logits of a Gemma, a Llama) quantizes its inputs with a plain ``round`` and no custom gradient,
  so the gradient that reaches the decoder is noise (cosine 0.0-0.4 against the float model's
  here, and the loss did not fall). Dense and EinsumDense have a straight-through gradient. So the
  embeddings are int8 weights only (``activation_quantizer=None``: the logits' matmul takes float
  inputs), which gives the float model's gradient (cosine 1.000 here). int4 quantizes weights only
  already.
- **Without LoRA** nothing of the quantized layers trains (their kernels are non-trainable
  integers): the config refuses ``quantize`` without ``lora``.
- **Deterministic**: the same preset, mode and Keras give the same integers and scales
  (``to_numpy`` rounding on the host). :func:`record` fingerprints the quantized base (each integer
  kernel's exact, order-free checksum, computed where the shards are); an adapter checkpoint keeps
  it and a resume whose rebuilt base differs is refused
  (:func:`tpurun.training.checkpoints.adapter.load`).
- ``Embedding`` LoRA under int4 (keras#23393, fixed after 3.15.1) is never reached: LoRA adapts
  the attention query and value layers only.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any

from tpurun import frameworks
from tpurun.errors import ConfigError, ModelError, describe

#: ``model.quantize``'s modes, as Keras names them.
MODES = ("int8", "int4")
#: The task attribute :func:`quantize` leaves its :func:`record` in (what an adapter file keeps).
RECORD_ATTRIBUTE = "_tpurun_quantized"
#: The task attribute that says how many more elements the quantized base stores than the float.
STORED_ATTRIBUTE = "_tpurun_quantized_elements"
#: The attribute :func:`plan` marks a task built without its weights with (read by the memory
#: estimate, which imports no framework and so names it itself).
PLANNED_ATTRIBUTE = "_tpurun_quantize_planned"
#: The layer classes whose ``quantize`` Keras 3.15 implements for int8 and int4.
QUANTIZED_CLASSES = ("Dense", "EinsumDense", "Embedding", "ReversibleEmbedding")


def plan(task: Any, mode: str) -> None:
    """Mark ``task``, built without its weights (``tpurun config``, doctor), as quantized to
    ``mode`` when it trains: Keras' ``quantize`` reads every float value, which such a model would
    draw on the host. The memory estimate counts its kernels as quantized
    (:func:`tpurun.runtime.memory_check.planned_entries`).

    Raises:
        ModelError: as :func:`quantize`, for a backbone with no layer Keras quantizes.
    """
    _check_mode(mode)
    if not any(
        callable(getattr(type(layer), "quantize", None))
        and type(layer).__name__ in QUANTIZED_CLASSES
        for layer in task.backbone._flatten_layers(include_self=False)
    ):
        _nothing_quantized(task.backbone, mode)
    setattr(task, PLANNED_ATTRIBUTE, mode)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ModelError(
            f"model.quantize: '{mode}' is not a mode tpurun trains under LoRA; "
            f"use one of {', '.join(MODES)}."
        )


def _nothing_quantized(backbone: Any, mode: str) -> None:
    raise ModelError(
        f"model.quantize: {mode} quantized no layer of {type(backbone).__name__} (Keras "
        "quantizes Dense, EinsumDense and Embedding layers; this backbone has none), so "
        "nothing would be smaller. Remove model.quantize."
    )


def quantize(task: Any, mode: str) -> None:
    """Quantize ``task``'s backbone in place to ``mode`` (before LoRA) and keep its :func:`record`
    on the task.

    Raises:
        ModelError: ``mode`` is not one Keras' layers take, or the backbone has no layer it
            quantizes.
    """
    _check_mode(mode)
    keras = frameworks.keras()
    backbone = task.backbone
    embedding = keras.layers.ReversibleEmbedding
    before = _elements(backbone)

    def tied(layer: Any) -> bool:
        return isinstance(layer, embedding)

    try:
        with warnings.catch_warnings():
            # Keras warns once per norm, dropout and rotary layer that it has nothing to quantize.
            warnings.filterwarnings("ignore", message=".*does not have a `quantize` method")
            if mode == "int8":
                weights_only = keras.quantizers.Int8QuantizationConfig(activation_quantizer=None)
                backbone.quantize(mode, config=weights_only, filters=tied)
            backbone.quantize(
                mode, filters=None if mode == "int4" else lambda layer: not tied(layer)
            )
    except ConfigError as exc:  # the mesh's layout refused a quantized variable as it was made
        raise ConfigError(
            [
                f"model.quantize: {mode} makes new kernels ({_shapes(mode)}), and the mesh's layout "
                f"cannot place one: {'; '.join(exc.problems)} With a model axis, use "
                "model.quantize: int8 (its kernels keep the float ones' shapes, so the preset's "
                "layout splits them as before), or set runtime.layout: auto (tpurun's rule splits "
                "int4's packed kernels too)."
            ]
        ) from None
    except (ValueError, NotImplementedError, TypeError) as exc:
        raise ModelError(
            f"model.quantize: {type(backbone).__name__}.quantize('{mode}') failed: "
            f"{describe(exc)}. Remove model.quantize, or try the other mode."
        ) from None
    if not quantized_layers(backbone):
        _nothing_quantized(backbone, mode)
    # The model's parameters are the float ones: int4 stores two a byte, and scales are extra.
    setattr(task, STORED_ATTRIBUTE, _elements(backbone) - before)
    setattr(task, RECORD_ATTRIBUTE, record(backbone, mode))


def _elements(model: Any) -> int:
    return sum(math.prod(v.shape) for v in {id(v): v for v in model.weights}.values())


def stored_over_parameters(model: Any) -> int:
    """How many more elements a quantized ``model`` stores than it has parameters (0 for a model
    :func:`quantize` left alone)."""
    return getattr(model, STORED_ATTRIBUTE, 0)


def _shapes(mode: str) -> str:
    if mode == "int4":
        return "int4 packs two values a byte and EinsumDense's kernels into 2 dimensions"
    return "int8 keeps each kernel's shape, with scales beside it"


def quantized_layers(backbone: Any) -> list[Any]:
    """The backbone's layers with a quantization mode."""
    return [
        layer
        for layer in backbone._flatten_layers(include_self=False)
        if getattr(layer, "quantization_mode", None)
    ]


def quantized_variables(backbone: Any) -> list[Any]:
    """The integer variables Keras' quantize made (kernels, embeddings, int4 zero points)."""
    out = []
    for layer in quantized_layers(backbone):
        for variable in layer.non_trainable_weights:
            if str(getattr(variable.dtype, "name", variable.dtype)).startswith(("int", "uint")):
                out.append(variable)
    return out


def record(backbone: Any, mode: str) -> dict[str, Any]:
    """The quantized base's fingerprint: ``{"mode", "keras", "digest", "variables": {path:
    "dtype[shape] checksum"}}``. Each checksum is exact and independent of how the variable is
    sharded or summed (integer arithmetic modulo 2**32), computed on the devices that hold it:
    the scales are not summed (floats), the integers they made are."""
    keras = frameworks.keras()
    checksum = _checksum_function()
    variables = {}
    for variable in quantized_variables(backbone):
        dtype = str(getattr(variable.dtype, "name", variable.dtype))
        value = int(keras.ops.convert_to_numpy(checksum(variable.value))) & 0xFFFFFFFF
        variables[variable.path] = f"{dtype}{list(variable.shape)} {value:08x}"
    digest = hashlib.sha256("\n".join(f"{k} {v}" for k, v in variables.items()).encode())
    return {"mode": mode, "keras": keras.__version__, "digest": digest.hexdigest()[:16],
            "variables": variables}  # fmt: skip


def _checksum_function() -> Any:
    """``x -> sum(x * (i % 65521 + 1))`` in wrapping int32 over the flattened ``x``: exact in any
    order. Jitted on JAX, so a sharded variable is summed where its shards are (one scalar comes
    back, on every process)."""
    keras = frameworks.keras()
    ops = keras.ops

    def checksum(x: Any) -> Any:
        flat = ops.reshape(ops.cast(x, "int32"), (-1,))
        weights = ops.mod(ops.arange(flat.shape[0], dtype="int32"), 65521) + 1
        return ops.sum(flat * weights)

    if keras.backend.backend() == "jax":
        return frameworks.jax().jit(checksum)
    return checksum


def record_of(task: Any) -> dict[str, Any] | None:
    """The record :func:`quantize` left on ``task``; None for a float base."""
    return getattr(task, RECORD_ATTRIBUTE, None)


def changes(saved: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    """How the quantized base rebuilt now differs from the one a checkpoint recorded, one phrase
    each (empty: the same, or neither quantized)."""
    if not saved and not now:
        return []
    if not saved or not now:
        was, is_ = (saved or {}).get("mode", "float"), (now or {}).get("mode", "float")
        return [f"the base was {was}, it is {is_} now"]
    out = []
    if saved["mode"] != now["mode"]:
        out.append(f"mode {saved['mode']} -> {now['mode']}")
    if saved.get("keras") != now.get("keras"):
        out.append(f"keras {saved.get('keras')} -> {now.get('keras')}")
    before, after = saved.get("variables", {}), now.get("variables", {})
    for path in [p for p in before if p in after and before[p] != after[p]][:3]:
        out.append(f"{path}: {before[path]} -> {after[path]}")
    gone, added = sorted(set(before) - set(after)), sorted(set(after) - set(before))
    out += [f"{p} gone" for p in gone[:2]] + [f"{p} added" for p in added[:2]]
    if not out and saved.get("digest") != now.get("digest"):
        out.append(f"digest {saved.get('digest')} -> {now.get('digest')}")
    return out
