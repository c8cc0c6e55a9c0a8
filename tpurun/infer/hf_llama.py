"""The Hugging Face form of the Llama-shaped families: Llama 3 (``Llama3Backbone`` ->
``LlamaForCausalLM``), Qwen 2 (``QwenBackbone`` -> ``Qwen2ForCausalLM``: biases on query, key
and value) and Mistral (``MistralBackbone`` -> ``MistralForCausalLM``).

KerasHub builds the three alike: ``transformer_layer_<i>`` blocks whose ``_self_attention_layer``
holds per-head ``EinsumDense`` kernels (query ``(hidden, heads, head_dim)``, key and value
``(hidden, kv_heads, head_dim)``, output ``(heads, head_dim, hidden)``), RMS norms before
attention and before the SwiGLU feed-forward, and a final ``sequence_output_layernorm``; rotary
embeddings in the same half-split layout as transformers (keras-hub's converters copy q and k
without permuting them). keras-hub 0.32's exporters for these read ``.kernel`` (LoRA merged) but
take the head size as ``hidden // heads``, which a ``MistralBackbone(head_dim=...)`` contradicts;
here every shape is read from the kernels themselves.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: Backbone class -> (transformers' architecture, model_type).
ARCHITECTURES = {
    "Llama3Backbone": ("LlamaForCausalLM", "llama"),
    "QwenBackbone": ("Qwen2ForCausalLM", "qwen2"),
    "MistralBackbone": ("MistralForCausalLM", "mistral"),
}

#: Settings transformers' model for the family does not have (or tpurun does not map), with the
#: value each must have: a backbone with another is refused by name.
UNMAPPED = {
    "Llama3Backbone": {"rope_position_scaling_factor": 1.0},
    "QwenBackbone": {"rope_scaling_factor": 1.0, "use_sliding_window_attention": False},
    "MistralBackbone": {"rope_scaling_factor": 1.0},
}


def hf_config(backbone: Any, tokenizer: Any, dtype: str) -> dict[str, Any]:
    """``config.json`` for the family's transformers model, every value read from the backbone
    and the tokenizer (transformers' defaults are not relied on)."""
    cls = type(backbone).__name__
    architecture, model_type = ARCHITECTURES[cls]
    attention = backbone.get_layer("transformer_layer_0")._self_attention_layer
    hidden, _, head_dim = attention._query_dense.kernel.shape
    tied = bool(backbone.token_embedding.tie_weights)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": backbone.vocabulary_size,
        "hidden_size": hidden,
        "intermediate_size": backbone.intermediate_dim,
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_query_heads,
        "num_key_value_heads": backbone.num_key_value_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": backbone.layer_norm_epsilon,
        "rope_theta": float(backbone.rope_max_wavelength),
        "attention_dropout": 0.0,
        "tie_word_embeddings": tied,
        "dtype": dtype,
        **_token_ids(tokenizer, cls),
    }
    if cls == "Llama3Backbone":
        config.update(attention_bias=False, mlp_bias=False, max_position_embeddings=8192)
        if backbone.rope_frequency_adjustment_factor is not None:  # Llama 3.1+'s scaled RoPE
            config["max_position_embeddings"] = 131072
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": backbone.rope_frequency_adjustment_factor,
                "low_freq_factor": backbone.rope_low_freq_factor,
                "high_freq_factor": backbone.rope_high_freq_factor,
                "original_max_position_embeddings": backbone.rope_pretraining_sequence_length,
            }
    elif cls == "QwenBackbone":
        config.update(use_sliding_window=False, max_position_embeddings=32768)
    else:  # Mistral: its sliding window masks as transformers' does
        config.update(sliding_window=backbone.sliding_window, max_position_embeddings=32768)
    return config


def _token_ids(tokenizer: Any, cls: str) -> dict[str, int | None]:
    """bos, eos and pad ids as the families' own configs give them: the tokenizer's start and end
    tokens (Qwen has no start token), padding with the end token for Qwen (its
    ``<|endoftext|>``), none for Llama 3 and Mistral."""
    end = tokenizer.end_token_id
    return {
        "bos_token_id": tokenizer.start_token_id,
        "eos_token_id": end,
        "pad_token_id": end if cls == "QwenBackbone" else None,
    }


def weights(backbone: Any, array: Any) -> dict[str, Any]:
    """Every weight under transformers' names, as numpy arrays in the backbone's dtype.

    Args:
        array: the float array of a variable (:func:`tpurun.infer.hf_families._array`).
    """
    out = {"model.embed_tokens.weight": array(backbone.token_embedding.embeddings)}
    for i in range(backbone.num_layers):
        block = backbone.get_layer(f"transformer_layer_{i}")
        attention, prefix = block._self_attention_layer, f"model.layers.{i}."
        out[prefix + "input_layernorm.weight"] = array(block._self_attention_layernorm.scale)
        for name, layer in (
            ("q", attention._query_dense),
            ("k", attention._key_dense),
            ("v", attention._value_dense),
        ):
            kernel = array(layer.kernel)  # merged with its adapter, all heads
            out[prefix + f"self_attn.{name}_proj.weight"] = kernel.reshape(kernel.shape[0], -1).T
            if layer.bias is not None:  # Qwen 2's, per head: (heads, head_dim)
                out[prefix + f"self_attn.{name}_proj.bias"] = array(layer.bias).reshape(-1)
        kernel = array(attention._output_dense.kernel)
        out[prefix + "self_attn.o_proj.weight"] = kernel.reshape(-1, kernel.shape[-1]).T
        out[prefix + "post_attention_layernorm.weight"] = array(block._feedforward_layernorm.scale)
        out[prefix + "mlp.gate_proj.weight"] = array(block._feedforward_gate_dense.kernel).T
        out[prefix + "mlp.up_proj.weight"] = array(block._feedforward_intermediate_dense.kernel).T
        out[prefix + "mlp.down_proj.weight"] = array(block._feedforward_output_dense.kernel).T
    out["model.norm.weight"] = array(backbone.get_layer("sequence_output_layernorm").scale)
    if not backbone.token_embedding.tie_weights:
        out["lm_head.weight"] = array(backbone.token_embedding.reverse_embeddings).T
    return out


def fix_tokenizer(tokenizer: Any, folder: str) -> None:
    """Mend what keras-hub 0.32's ``export_to_transformers`` writes for a Llama 3 tokenizer.

    Its ``tokenizer.json`` has no post-processor, and transformers 5 ignores the
    ``add_bos_token`` of ``tokenizer_config.json`` for a fast tokenizer: served from the folder,
    every prompt would reach the model without ``<|begin_of_text|>``, which the fine-tune always
    saw first (checked with transformers 5.24). Llama 3's own ``tokenizer.json`` adds it with a
    template, as written here.
    """
    if type(tokenizer).__name__ != "Llama3Tokenizer":
        return
    path = os.path.join(folder, "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    bos, bos_id = tokenizer.start_token, tokenizer.start_token_id
    first = {"SpecialToken": {"id": bos, "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [first, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [first, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
    }  # fmt: skip
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=2, ensure_ascii=False)
