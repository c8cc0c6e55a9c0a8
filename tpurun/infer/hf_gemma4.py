"""The Hugging Face form of Gemma 4, text only and dense: ``Gemma4Backbone`` ->
``Gemma4ForCausalLM`` (``model_type`` ``gemma4_text``).

KerasHub's Gemma 4 decoder block is Gemma 3's with the four norms and the query/key norms always
on, a value norm without a scale, attention unscaled (the norms stand in for ``1/sqrt(head)``), and
an output scalar per layer. Over Gemma 3 the backbone adds, each read here from the layers that
compute it:

- ``layer_types`` and ``sliding_window``: each block's attention kind and window (KerasHub's mask
  keeps the ``window`` keys up to the query, as transformers' does);
- ``global_head_dim`` and ``rope_parameters``: the global layers' head size and their
  ``proportional`` rotary embedding, only ``partial_rotary_factor`` of each head rotated (the
  rotated pairs are the same on both sides: the first of each half);
- ``attention_k_eq_v`` with ``num_global_key_value_heads``: KerasHub builds the global layers with
  keys as values and that many heads whenever ``num_global_key_value_heads`` is set;
- ``num_kv_shared_layers`` and ``use_double_wide_mlp``: the last layers reuse the keys and values
  of the last earlier layer of their kind (both sides pick the same one), with feed-forwards twice
  as wide; they own no key or value weights, and none are written;
- ``hidden_size_per_layer_input``: per-layer embeddings (a second embedding table, a projection of
  the scaled embeddings, its norm, and in each layer a gate, a projection and a norm);
- ``final_logit_softcapping``: the backbone's ``final_logit_soft_cap``, which KerasHub applies in
  the reversed embedding.

keras-hub 0.32's own exporter gets several of these wrong for transformers 5.24 (checked on
tests/hf_presets.py's tiny Gemma 4): it names ``Gemma4TextModel`` (``Gemma4TextForCausalLM``
with the head, a class transformers does not have; its causal LM is ``Gemma4ForCausalLM``), leaves
out ``attention_k_eq_v`` (transformers then expects value projections and as many key heads as
the sliding layers', and refuses the folder), and writes no ``rope_type``, which transformers
reads as ``default``: whole heads rotated.

Refused (:data:`UNMAPPED`): the vision and audio encoders, the mixture of experts, an attention
soft cap (transformers' Gemma 4 has none), rotary scaling factors (no Gemma 4 checkpoint has them
and they are not checked here), layers without sliding windows, and the bidirectional and
embedding variants; at write time, a task-level logit cap (:func:`check_task`).
"""

from __future__ import annotations

from typing import Any

from tpurun.errors import ModelError
from tpurun.infer import hf_gemma_blocks

#: Settings Gemma 4's transformers causal LM does not have (or tpurun does not map), with the
#: value each must have.
UNMAPPED = {
    "Gemma4Backbone": {
        "vision_encoder": None,
        "audio_encoder": None,
        "enable_moe_block": False,
        "attention_logit_soft_cap": None,
        "local_rope_scaling_factor": 1.0,
        "global_rope_scaling_factor": 1.0,
        "use_sliding_window_attention": True,
        "use_bidirectional_attention": False,
        "is_embedding_model": False,
    }
}


def check_task(task: Any) -> None:
    """A task-level logit cap (``Gemma4CausalLM(final_logit_cap=...)``) is applied over the
    backbone's: transformers has one cap only.

    Raises:
        ModelError: the task has its own cap.
    """
    cap = getattr(task, "final_logit_cap", None)
    if cap is not None:
        raise ModelError(
            f"--format huggingface: the Gemma4CausalLM has its own final_logit_cap={cap} over the "
            "backbone's final_logit_soft_cap, and transformers' Gemma 4 applies one cap only. "
            "Export --format keras (the merged task) or lora (the adapter) instead."
        )


def hf_config(backbone: Any, tokenizer: Any, dtype: str) -> dict[str, Any]:
    """``config.json`` for ``Gemma4ForCausalLM``, every value read from the backbone's layers
    and the tokenizer."""
    blocks = [backbone.get_layer(f"decoder_block_{i}") for i in range(backbone.num_layers)]
    kinds = ["full_attention" if b.is_global_attention else "sliding_attention" for b in blocks]
    rope, heads = {}, {}  # each layer type's rotary embedding and attention, as its first layer's
    for kind, block in zip(kinds, blocks, strict=True):
        attention = heads.setdefault(kind, block.attention)
        found = {"rope_type": "default", "rope_theta": float(attention.rope_wavelength)}
        if kind == "full_attention":
            found["rope_type"] = "proportional"
            found["partial_rotary_factor"] = float(attention.rope_partial_rotary_factor)
        rope.setdefault(kind, found)
    full = heads.get("full_attention", heads.get("sliding_attention"))
    k_eq_v = bool(full.attention_k_eq_v)
    ids = {name: tokenizer.token_to_id(piece) for name, piece in
           (("pad_token_id", "<pad>"), ("bos_token_id", "<bos>"), ("eos_token_id", "<eos>"))}  # fmt: skip
    per_layer = int(backbone.hidden_size_per_layer_input)
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": backbone.vocabulary_size,
        "hidden_size": backbone.hidden_dim,
        "intermediate_size": int(blocks[0].intermediate_dim),
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_query_heads,
        "num_key_value_heads": backbone.num_key_value_heads,
        "head_dim": int(backbone.head_dim),
        "global_head_dim": int(full.head_dim),
        "attention_k_eq_v": k_eq_v,
        "num_global_key_value_heads": int(full.effective_num_kv_heads) if k_eq_v else None,
        "hidden_activation": "gelu_pytorch_tanh",  # gelu(approximate=True)
        "rms_norm_eps": blocks[0].pre_attention_norm.epsilon,
        "sliding_window": int(backbone.sliding_window_size),
        "layer_types": kinds,
        "rope_parameters": rope,
        "num_kv_shared_layers": int(backbone.num_kv_shared_layers),
        "use_double_wide_mlp": bool(backbone.use_double_wide_mlp),
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": (
            int(backbone.per_layer_token_embedding.input_dim) if per_layer else None
        ),
        "final_logit_softcapping": backbone.token_embedding.logit_soft_cap,
        "use_bidirectional_attention": (
            "vision" if backbone.use_vision_bidirectional_attention else None
        ),  # vision tokens only: none in a text-only model
        "enable_moe_block": False,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(backbone.token_embedding.tie_weights),
        "dtype": dtype,
        **ids,
    }


def weights(backbone: Any, array: Any) -> dict[str, Any]:
    """Every weight under transformers' names, as numpy arrays in the backbone's dtype.

    KerasHub's attention kernels are per head, query ``(heads, hidden, head_dim)``, key and value
    ``(kv_heads, hidden, head_dim)``, output ``(heads, head_dim, hidden)``, as Gemma's; a layer
    that shares keys and values has none, one with keys as values has no value kernel.

    Args:
        array: the float array of a variable (:func:`tpurun.infer.hf_families._array`).
    """
    out = {"model.embed_tokens.weight": array(backbone.token_embedding.embeddings)}
    if backbone.hidden_size_per_layer_input:
        out["model.embed_tokens_per_layer.weight"] = array(
            backbone.per_layer_token_embedding.embeddings
        )
        out["model.per_layer_model_projection.weight"] = array(
            backbone.per_layer_model_projection.kernel
        ).T
        out["model.per_layer_projection_norm.weight"] = array(
            backbone.per_layer_projection_norm.scale
        )
    for i in range(backbone.num_layers):
        out.update(_block(backbone.get_layer(f"decoder_block_{i}"), f"model.layers.{i}.", array))
    out["model.norm.weight"] = array(backbone.get_layer("final_normalization").scale)
    if not backbone.token_embedding.tie_weights:
        out["lm_head.weight"] = array(backbone.token_embedding.reverse_embeddings).T
    return out


def _block(block: Any, prefix: str, array: Any) -> dict[str, Any]:
    """One decoder block's weights under transformers' names."""
    import numpy as np

    attention, out = block.attention, {}
    projections = ("q",)
    if not attention.is_kv_shared_layer:
        # value_dense None: keys are the values
        projections = ("q", "k") if attention.value_dense is None else ("q", "k", "v")
        out[prefix + "self_attn.k_norm.weight"] = array(attention.key_norm.scale)
    out.update(hf_gemma_blocks.attention(attention, prefix, array, projections))
    out[prefix + "self_attn.q_norm.weight"] = array(attention.query_norm.scale)
    out.update(hf_gemma_blocks.four_norms(block, prefix, array))
    out.update(hf_gemma_blocks.feed_forward(block, prefix, array))
    if block.hidden_size_per_layer_input:
        out[prefix + "per_layer_input_gate.weight"] = array(block.per_layer_input_gate.kernel).T
        out[prefix + "per_layer_projection.weight"] = array(block.per_layer_up_proj.kernel).T
        out[prefix + "post_per_layer_input_norm.weight"] = array(
            block.post_per_layer_input_norm.scale
        )
    scalar = array(block.layer_scalar)  # () here, (1,) in transformers
    out[prefix + "layer_scalar"] = np.reshape(scalar, (1,))
    if block.enable_moe_block:  # refused from the config before; never written half
        raise ModelError(f"--format huggingface: {block.name} is a mixture of experts.")
    return out
