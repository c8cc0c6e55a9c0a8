"""The activations term of the memory estimate: what the backward pass keeps of the forward pass,
per example of a device's slice of the batch (:class:`Activations`).

Korthikanti et al.'s count for a KerasHub transformer backbone (:func:`transformer_activations`),
else every layer's output (:func:`layer_activations`). Approximate: XLA may fuse, rematerialise or
keep temporaries this does not count. With ``train.remat`` (each block recomputed in the backward
pass), a transformer's term is the paper's full recomputation; the every-layer-output term is
unchanged (it cannot see inside a block). Imports no framework.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from tpurun.runtime.sizes import itemsize


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
        return replace(
            self,
            basis=f"{self.basis}, each recomputed in the backward pass",
            whole=whole,
            split=split,
            remat=None,
        )

    def scaled(self, factor: float) -> Activations:
        """Every figure times ``factor`` (a compute dtype of another size)."""
        remat = None if self.remat is None else tuple(x * factor for x in self.remat)
        return replace(self, whole=self.whole * factor, split=self.split * factor, remat=remat)


def transformer_activations(
    layers: int,
    hidden: int,
    heads: int,
    sequence: int,
    batch: int,
    compute_itemsize: int,
    vocabulary: int | None = None,
) -> Activations:
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
    return Activations(
        f"Korthikanti et al. 2022, {layers} layers of {sequence} tokens",
        batch,
        layers * per_layer_whole,
        layers * per_layer_split + logits,
        remat,
    )


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


def activations_of(
    model: Any, batch: int, sequence: int | None = None, remat: bool = False
) -> Activations | None:
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
            return transformer_activations(
                dims["layers"],
                dims["hidden"],
                dims["heads"],
                int(sequence),
                batch,
                compute,
                vocabulary,
            )
    return layer_activations(model, batch)


def _transformer_dims(backbone: Any) -> dict[str, int] | None:
    layers = getattr(backbone, "num_layers", None)
    hidden = getattr(backbone, "hidden_dim", None)
    heads = getattr(backbone, "num_query_heads", None) or getattr(backbone, "num_heads", None)
    if not (layers and hidden and heads):
        return None
    max_seq = getattr(backbone, "max_sequence_length", None)
    return {"layers": layers, "hidden": hidden, "heads": heads, "max_seq": max_seq}
