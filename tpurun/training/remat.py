"""``train.remat``: each block of the model recomputed in the backward pass instead of kept.

**The blocks** (:func:`blocks`) are the layers that hold layers of their own, found by walking
the model's layers and into every nested model (a KerasHub task's backbone): a KerasHub
backbone's transformer layers (GemmaDecoderBlock, Llama's and Qwen's decoders, BERT's
TransformerEncoder), ``keras.layers.MultiHeadAttention``, a block written as a Layer subclass.
Each one is rematerialised once, as MaxText's ``remat_policy: full`` does its decoder layers:
the backward pass keeps only the block's inputs and recomputes its inside, one block at a time.
Single operations (Dense, Conv, a norm) are left alone: what backpropagation keeps of them is
their input and output, which the next layer keeps anyway. A model without blocks (a flat
functional ResNet, an MLP) is refused rather than silently left as it was.

**Why not** ``keras.RematScope``: it marks every operation built inside it, so around
``from_preset`` it also marks the task, the backbone (each nested model recomputes the whole
forward once more under the next) and the preprocessor (whose string inputs ``jax.checkpoint``
cannot take); and Keras' ``remat`` hands every argument to ``jax.checkpoint``, which traces a
Python flag such as Llama's and Qwen's ``training=True`` and fails on ``if training``
(Keras 3.15, measured). Its other modes (``activations``, ``larger_than``) mark single
operations, which by the reasoning above save little.

**How**: each block's ``call`` is replaced, on the instance, by one that runs the original inside
``keras.remat`` (``jax.checkpoint`` on JAX, ``tf.recompute_grad`` on TensorFlow) with only the
tensors as the recomputed function's inputs (Python flags and None are closed over), the block's
variables among them, in a stateless scope of its own. What the block updates (dropout's seed
state, batch-norm statistics) comes out of the recomputed function and is assigned once,
outside: inside it the update would escape ``jax.checkpoint``'s trace on JAX, and be made twice,
with a second dropout mask, on TensorFlow. The maths is unchanged: the same loss and gradients.
Forward-only work (evaluate, predict) runs the wrapper as a plain call.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from tpurun import frameworks
from tpurun.errors import ConfigError

#: Marks a call already wrapped (a model built twice from the same layers is wrapped once).
_MARK = "_tpurun_remat"


def blocks(model: Any) -> list[Any]:
    """The layers :mod:`this module <tpurun.training.remat>` rematerialises, each once, in order."""
    keras = frameworks.keras()
    found: dict[int, Any] = {}

    def walk(parent: Any) -> None:
        for layer in getattr(parent, "layers", []):
            if isinstance(layer, keras.Model):
                walk(layer)
            elif layer._flatten_layers(include_self=False, recursive=False):
                found.setdefault(id(layer), layer)

    walk(model)
    return list(found.values())


def as_configured(model: Any, config: Any) -> Any:
    """``model``, its blocks rematerialised where ``train.remat`` asks (:func:`rematerialise`)."""
    if config.train.remat:
        rematerialise(model)
    return model


def rematerialise(model: Any) -> list[Any]:
    """Wrap each of ``model``'s :func:`blocks` so the backward pass recomputes it; returns them.

    Raises:
        ConfigError: the model has no block (``train.remat`` would change nothing).
    """
    found = blocks(model)
    if _NOTICE not in logging.getLogger("tensorflow").filters:
        logging.getLogger("tensorflow").addFilter(_NOTICE)
    if not found:
        raise ConfigError(
            [
                f"train.remat: {type(model).__name__} ({model.name}) has no block to recompute. "
                "train.remat recomputes each layer that holds layers of its own (a KerasHub "
                "backbone's transformer layers, keras.layers.MultiHeadAttention, a block written as a "
                "keras.layers.Layer subclass); this model's layers are single operations, whose "
                "outputs the backward pass keeps either way. Remove train.remat, or write the "
                "repeated part of the model as a Layer subclass."
            ]
        )
    for layer in found:
        if not getattr(layer.call, _MARK, False):
            layer.call = _rematerialised(layer, layer.call)
    return found


def _rematerialised(layer: Any, call: Any) -> Any:
    """``call`` run inside ``keras.remat``, its state updates and losses carried out of it."""
    keras = frameworks.keras()
    stateless = frameworks.keras("src.backend.common.stateless_scope")
    autocast = frameworks.keras("src.backend.common.variables").AutocastScope

    @functools.wraps(call)
    def rematerialised(*args: Any, **kwargs: Any) -> Any:
        leaves = keras.tree.flatten((args, kwargs))
        own = [*layer.trainable_variables, *layer.non_trainable_variables]
        state = layer.non_trainable_variables
        outer = stateless.get_stateless_scope()
        with autocast(None):  # the values as stored, not cast to the compute dtype
            values = [keras.ops.convert_to_tensor(v.value) for v in own]
        # The recomputed function's inputs: every tensor, integers too. A seed state closed over
        # instead gives the recomputation another dropout mask on TensorFlow (measured).
        inputs = [*values, *leaves]
        where = [i for i, x in enumerate(inputs) if keras.ops.is_tensor(x)]
        updated: list[int] = []  # which of `state` the block assigns (known once it has run)

        def forward(*flat: Any) -> tuple[Any, list, list]:
            filled = list(inputs)
            for i, tensor in zip(where, flat, strict=True):
                filled[i] = tensor
            mapping = list(zip(own, filled[: len(own)], strict=True))
            inner_args, inner_kwargs = keras.tree.pack_sequence_as(
                (args, kwargs), filled[len(own) :]
            )
            scope = keras.StatelessScope(mapping, collect_losses=True, initialize_variables=False)
            if outer is not None:  # a variable the block reads but does not own: the step's value
                scope.state_mapping = {**outer.state_mapping, **scope.state_mapping}
            before = dict(scope.state_mapping)
            with scope:
                out = call(*inner_args, **inner_kwargs)
            updated[:] = [i for i, v in enumerate(state)
                          if scope.state_mapping.get(id(v)) is not before.get(id(v))]  # fmt: skip
            return out, [scope.state_mapping[id(state[i])] for i in updated], list(scope.losses)

        out, new_values, losses = keras.remat(forward)(*(inputs[i] for i in where))
        for i, value in zip(updated, new_values, strict=True):
            state[i].assign(value)
        for loss in losses:
            layer.add_loss(loss)
        return out

    setattr(rematerialised, _MARK, True)
    return rematerialised


class _IntegerWatchNotice(logging.Filter):
    """Drops TensorFlow's warning that ``tf.recompute_grad`` watches an integer tensor (a token
    id, a mask, a seed state given to the recomputed function): it gets no gradient, as meant."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "The dtype of the watched tensor must be floating" not in record.getMessage()


_NOTICE = _IntegerWatchNotice()
