"""tpurun's ``auto`` layout: along which dimension a weight is split over the model axis, read from
its shape and, where Keras says more, from the layer that holds it.

KerasHub gives a layout map to a few families only (Gemma, Llama, Qwen); Gemma 3, Qwen 3, Mistral,
Mixtral and Phi-3 have none (keras-hub#2807). Their weights are the same few kinds, and the layer
says which kind, whatever the family calls it:

- an ``EinsumDense`` kernel: its equation names every dimension. A kernel dimension that is
  contracted with the input is an input feature, one that appears in the output an output
  feature. Where two or more dimensions of the kernel sit on one side (``btd,ndh->btnh``: ``n``
  and ``h`` both go to the output), that side is attention's heads: the last of them in the
  activation (``h``) is the size of one head, the others count heads. The kernel is split along
  its heads (each device holds whole heads, Megatron's split) where the model axis divides their
  count; otherwise (one key/value head on a 4-way axis, keras-hub#1613) along a feature dimension
  the axis divides (the hidden size); otherwise kept whole. A head's own dimension is never split.
- an ``Embedding``'s table (and a ``ReversibleEmbedding``'s reverse): along the vocabulary.
- anything else of 2 or more dimensions (a ``Dense`` kernel, a convolution, a mixture of experts'
  stacked kernels): along its largest dimension the axis divides. A feed-forward's up and gate
  kernels ``[hidden, intermediate]`` and its down kernel ``[intermediate, hidden]`` are then both
  split along the intermediate size: Megatron's column then row split.

Vectors (biases, norms) stay whole. Imports no framework: :mod:`tpurun.runtime.mesh` reads the
layer (:func:`tpurun.runtime.mesh.weight_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

Axes = tuple[str | None, ...]


@dataclass(frozen=True)
class Weight:
    """What the layer holding a weight says about its dimensions, beyond the shape."""

    layer: str  # the layer's class name
    equation: str | None = None  # an EinsumDense kernel's: "btd,ndh->btnh"
    vocabulary: int | None = None  # an embedding's input_dim


def einsum_roles(equation: str, rank: int) -> list[str] | None:
    """Each kernel dimension's role in ``equation``: ``"heads"`` (a head count), ``"head"`` (the
    size of one head) or ``"features"``; None where the equation is not ``input,kernel->output``
    with one letter per kernel dimension."""
    left, arrow, output = equation.replace(" ", "").partition("->")
    operands = left.split(",")
    if not arrow or len(operands) != 2 or "." in operands[1] or len(operands[1]) != rank:
        return None
    source, kernel = operands
    sides: dict[str, list[str]] = {"input": [], "output": []}
    for letter in kernel:
        if letter in source and letter not in output:
            sides["input"].append(letter)
        elif letter in output and letter not in source:
            sides["output"].append(letter)
    roles = dict.fromkeys(kernel, "features")
    for side, letters in sides.items():
        if len(letters) >= 2:  # attention's heads: [..., heads, head] in the activation
            order = source if side == "input" else output
            letters = sorted(letters, key=order.index)
            roles.update(dict.fromkeys(letters[:-1], "heads"))
            roles[letters[-1]] = "head"
    return [roles[letter] for letter in kernel]


def _split(shape: Sequence[int], dim: int | None) -> Axes:
    return tuple("model" if i == dim else None for i in range(len(shape)))


def _largest(shape: Sequence[int], model: int, dims: Sequence[int]) -> int | None:
    divisible = [i for i in dims if shape[i] % model == 0]
    return max(divisible, key=lambda i: (shape[i], i)) if divisible else None


def _einsum(shape: Sequence[int], model: int, roles: list[str]) -> tuple[Axes, str]:
    heads = [i for i, role in enumerate(roles) if role == "heads"]
    features = [i for i, role in enumerate(roles) if role == "features"]
    split = next((i for i in heads if shape[i] % model == 0), None)
    if split is not None:
        return _split(shape, split), "attention heads"
    split = _largest(shape, model, features)
    counts = ", ".join(str(shape[i]) for i in heads)
    if split is not None:
        why = f"features (head count {counts} not divisible by {model})" if heads else "features"
        return _split(shape, split), why
    whole = f"head count {counts} and features" if heads else "no feature dimension"
    return _split(shape, None), f"whole ({whole} not divisible by {model})"


def auto_rule(shape: Sequence[int], model: int, weight: Weight | None = None) -> tuple[Axes, str]:
    """tpurun's ``auto`` rule for a weight of ``shape`` on a model axis of ``model`` devices: the
    axes per dimension, and why, in a few words (the placement listing's)."""
    shape = tuple(int(n) for n in shape)
    if len(shape) < 2:
        return _split(shape, None), "whole (a vector)"
    if model <= 1:
        return _split(shape, None), "whole (no model axis)"
    roles = einsum_roles(weight.equation, len(shape)) if weight and weight.equation else None
    if roles is not None:
        return _einsum(shape, model, roles)
    if weight is not None and weight.vocabulary and weight.vocabulary % model == 0:
        if weight.vocabulary in shape:
            return _split(shape, shape.index(weight.vocabulary)), "vocabulary"
    split = _largest(shape, model, range(len(shape)))
    if split is None:
        return _split(shape, None), f"whole (no dimension divisible by {model})"
    return _split(shape, split), "largest divisible dimension"
