"""The Hugging Face form of Gemma 3, text only: ``Gemma3Backbone`` -> ``Gemma3ForCausalLM``
(``model_type`` ``gemma3_text``).

KerasHub's Gemma 3 decoder block is Gemma's with RMS norms on the query and key heads, norms after
attention and after the feed-forward besides those before, feed-forward kernels of the whole
intermediate size (``gate_dim_reduction`` 1, where Gemma's halve it), and layers that alternate five sliding-window ones (rotary base 10 000)
with one global (base 1 000 000, its own linear scaling factor). Every value of ``config.json`` is
read from the layers that compute it:

- ``layer_types``: each block's ``use_sliding_window_attention``; ``sliding_window``: its window
  (KerasHub's mask keeps the ``window`` keys up to the query, as transformers' does);
- ``rope_parameters``: each layer type's rotary base and scaling factor (``linear``, as
  transformers' Gemma 3 4B and up have it);
- ``query_pre_attn_scalar``: the head size the attention layer scales its queries by. keras-hub
  0.32's own exporter writes ``hidden_dim // num_query_heads`` for a backbone with
  ``query_head_dim_normalize=False`` (Gemma 3 27B's), but its decoder block builds the attention
  with ``query_head_dim_normalize=True`` whatever the backbone says, so the fine-tune computed with
  the head size; the export writes what computed (tests/infer/test_hf_export.py's tiny Gemma 3 has
  a head size apart from ``hidden_dim // heads`` and ``query_head_dim_normalize=False``).

The exporter's other fault, reading ``weights[0]`` (a LoRA layer's frozen kernel), is avoided as
for Gemma: every kernel is read as ``layer.kernel``, the adapter merged in.
"""

from __future__ import annotations

from typing import Any

from tpurun.infer import hf_gemma_blocks

#: Settings Gemma 3's transformers model does not have (or tpurun does not map), with the value
#: each must have. KerasHub's decoder blocks take no epsilon from the backbone: theirs is 1e-6.
UNMAPPED = {
    "Gemma3Backbone": {
        "vision_encoder": None,
        "use_query_key_norm": True,
        "use_post_attention_norm": True,
        "use_post_ffw_norm": True,
        "attention_logit_soft_cap": None,
        "final_logit_soft_cap": None,
        "use_bidirectional_attention": False,
        "is_embedding_model": False,
        "layer_norm_epsilon": 1e-6,
    }
}


def hf_config(backbone: Any, tokenizer: Any, dtype: str) -> dict[str, Any]:
    """``config.json`` for ``Gemma3ForCausalLM``, every value read from the backbone's layers
    and the tokenizer."""
    blocks = [backbone.get_layer(f"decoder_block_{i}") for i in range(backbone.num_layers)]
    kinds = ["sliding_attention" if b.attention.use_sliding_window_attention else "full_attention"
             for b in blocks]  # fmt: skip
    rope = {}
    for kind, block in zip(kinds, blocks, strict=True):
        attention = block.attention
        factor = float(attention.rope_scaling_factor)
        found = {"rope_type": "default" if factor == 1.0 else "linear",
                 "rope_theta": float(attention.rope_wavelength)}  # fmt: skip
        if factor != 1.0:
            found["factor"] = factor
        rope.setdefault(kind, found)  # the backbone gives each layer type one
    attention = blocks[0].attention
    scalar = attention.head_dim if attention.query_head_dim_normalize else (
        backbone.hidden_dim // backbone.num_query_heads)  # fmt: skip
    ids = {name: tokenizer.token_to_id(piece) for name, piece in
           (("pad_token_id", "<pad>"), ("bos_token_id", "<bos>"), ("eos_token_id", "<eos>"))}  # fmt: skip
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": backbone.vocabulary_size,
        "hidden_size": backbone.hidden_dim,
        "intermediate_size": int(blocks[0].gating_ffw.kernel.shape[-1]),
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_query_heads,
        "num_key_value_heads": backbone.num_key_value_heads,
        "head_dim": backbone.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",  # gelu(approximate=True)
        "rms_norm_eps": blocks[0].pre_attention_norm.epsilon,
        "query_pre_attn_scalar": scalar,
        "sliding_window": backbone.sliding_window_size,
        "layer_types": kinds,
        "rope_parameters": rope,
        "max_position_embeddings": 131072,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "tie_word_embeddings": bool(backbone.token_embedding.tie_weights),
        "dtype": dtype,
        **ids,
    }


def weights(backbone: Any, array: Any) -> dict[str, Any]:
    """Every weight under transformers' names, as numpy arrays in the backbone's dtype.

    KerasHub's attention kernels are per head, query ``(heads, hidden, head_dim)``, key and value
    ``(kv_heads, hidden, head_dim)``, output ``(heads, head_dim, hidden)``, as Gemma's.

    Args:
        array: the float array of a variable (:func:`tpurun.infer.hf_families._array`).
    """
    out = {"model.embed_tokens.weight": array(backbone.token_embedding.embeddings)}
    for i in range(backbone.num_layers):
        block = backbone.get_layer(f"decoder_block_{i}")
        attention, prefix = block.attention, f"model.layers.{i}."
        out.update(hf_gemma_blocks.attention(attention, prefix, array))
        out[prefix + "self_attn.q_norm.weight"] = array(attention.query_norm.scale)
        out[prefix + "self_attn.k_norm.weight"] = array(attention.key_norm.scale)
        out.update(hf_gemma_blocks.four_norms(block, prefix, array))
        out.update(hf_gemma_blocks.feed_forward(block, prefix, array))
    out["model.norm.weight"] = array(backbone.get_layer("final_normalization").scale)
    if not backbone.token_embedding.tie_weights:
        out["lm_head.weight"] = array(backbone.token_embedding.reverse_embeddings).T
    return out
