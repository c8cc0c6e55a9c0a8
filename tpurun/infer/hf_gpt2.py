"""The Hugging Face form of GPT-2: ``GPT2Backbone`` -> ``GPT2LMHeadModel``.

KerasHub's GPT-2 is a stack of pre-norm ``TransformerDecoder`` layers (LayerNorm with bias,
attention and feed-forward ``Dense`` kernels with biases, ``gelu`` approximated by tanh) over
token and learned position embeddings, the output tied to the token embedding. transformers keeps
GPT-2's ``Conv1D`` layers, whose weights are ``(in, out)`` as a Keras kernel is (not ``(out, in)``
as a ``Linear``'s): they are written untransposed, the query, key and value kernels and biases
fused into ``c_attn`` in that order. keras-hub 0.32's exporter does the same but writes
``bos_token_id`` and ``eos_token_id`` as 50256 whatever the vocabulary, and a tokenizer config
without ``add_bos_token``: GPT-2's ``tokenizer_config.json`` here has it, as KerasHub's
preprocessor starts every sequence with ``<|endoftext|>`` and the fine-tune always saw it first.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: GPT2Backbone has no setting transformers' GPT-2 lacks.
UNMAPPED: dict[str, dict[str, Any]] = {"GPT2Backbone": {}}


def hf_config(backbone: Any, tokenizer: Any, dtype: str) -> dict[str, Any]:
    """``config.json`` for ``GPT2LMHeadModel``, every value read from the backbone and the
    tokenizer."""
    block = backbone.get_layer("transformer_layer_0")
    end = tokenizer.end_token_id  # <|endoftext|>, GPT-2's start, end and padding
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": backbone.vocabulary_size,
        "n_positions": backbone.max_sequence_length,
        "n_embd": backbone.hidden_dim,
        "n_layer": backbone.num_layers,
        "n_head": backbone.num_heads,
        "n_inner": backbone.intermediate_dim,
        "activation_function": "gelu_new",  # gelu(approximate=True)
        "layer_norm_epsilon": block._self_attention_layer_norm.epsilon,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(backbone.token_embedding.tie_weights),
        "bos_token_id": end,
        "eos_token_id": end,
        "pad_token_id": None,
        "dtype": dtype,
    }


def weights(backbone: Any, array: Any) -> dict[str, Any]:
    """Every weight under transformers' names, as numpy arrays in the backbone's dtype.

    Keras' attention kernels are per head: query, key and value ``(hidden, heads, head_dim)``
    with biases ``(heads, head_dim)``, output ``(heads, head_dim, hidden)``.

    Args:
        array: the float array of a variable (:func:`tpurun.infer.hf_families._array`).
    """
    import numpy as np

    out = {
        "transformer.wte.weight": array(backbone.token_embedding.embeddings),
        "transformer.wpe.weight": array(
            backbone.get_layer("position_embedding").position_embeddings
        ),
    }
    for i in range(backbone.num_layers):
        block = backbone.get_layer(f"transformer_layer_{i}")
        attention, prefix = block._self_attention_layer, f"transformer.h.{i}."
        dense = (attention._query_dense, attention._key_dense, attention._value_dense)
        kernels = [array(layer.kernel) for layer in dense]  # merged with its adapter
        out[prefix + "attn.c_attn.weight"] = np.concatenate(
            [k.reshape(k.shape[0], -1) for k in kernels], axis=-1
        )
        out[prefix + "attn.c_attn.bias"] = np.concatenate(
            [array(layer.bias).reshape(-1) for layer in dense]
        )
        kernel = array(attention._output_dense.kernel)
        out[prefix + "attn.c_proj.weight"] = kernel.reshape(-1, kernel.shape[-1])
        out[prefix + "attn.c_proj.bias"] = array(attention._output_dense.bias)
        for name, norm in (("ln_1", block._self_attention_layer_norm),
                           ("ln_2", block._feedforward_layer_norm)):  # fmt: skip
            out[prefix + f"{name}.weight"] = array(norm.gamma)
            out[prefix + f"{name}.bias"] = array(norm.beta)
        for name, layer in (("c_fc", block._feedforward_intermediate_dense),
                            ("c_proj", block._feedforward_output_dense)):  # fmt: skip
            out[prefix + f"mlp.{name}.weight"] = array(layer.kernel)
            out[prefix + f"mlp.{name}.bias"] = array(layer.bias)
    final = backbone.get_layer("layer_norm")
    out["transformer.ln_f.weight"] = array(final.gamma)
    out["transformer.ln_f.bias"] = array(final.beta)
    if not backbone.token_embedding.tie_weights:
        out["lm_head.weight"] = array(backbone.token_embedding.reverse_embeddings).T
    return out


def fix_tokenizer(tokenizer: Any, folder: str) -> None:
    """GPT-2's ``tokenizer_config.json`` in place of keras-hub 0.32's: the class,
    ``<|endoftext|>`` as its start, end and unknown token, and ``add_bos_token`` (transformers'
    GPT-2 tokenizer adds none by default; KerasHub's preprocessor starts every sequence with it)."""
    if type(tokenizer).__name__ != "GPT2Tokenizer":
        return
    end = tokenizer.end_token
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": end,
        "eos_token": end,
        "unk_token": end,
        "add_bos_token": True,
        "add_prefix_space": False,
    }
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
