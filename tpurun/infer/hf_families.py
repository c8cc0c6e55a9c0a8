"""The Hugging Face layout of each family ``tpurun export --format huggingface`` claims: which
backbones, their ``config.json`` and their weights under transformers' names.

The mapping is tpurun's own, not keras-hub 0.32's ``export_to_transformers``, which got two things
wrong here (checked with transformers 5.24): it reads each attention layer's ``weights[0]``, the
frozen kernel of a LoRA layer, dropping the adapter; and it reads Gemma's key and value kernels as
``weights[0][0]``, their first head only, which is right for Gemma 2B's single key/value head and
wrong for any Gemma with more (transformers refuses the shapes). Here every kernel is read whole, as
``layer.kernel`` (the adapter merged in, where LoRA is on), and reshaped head by head.

Claimed: Gemma (v1, ``GemmaBackbone``), mapped here; Llama 3, Qwen 2 and Mistral
(:mod:`tpurun.infer.hf_llama`); Gemma 3, text only (:mod:`tpurun.infer.hf_gemma3`); Gemma 4, text
only and dense (:mod:`tpurun.infer.hf_gemma4`); GPT-2 (:mod:`tpurun.infer.hf_gpt2`). Each is a
family tests/infer/test_hf_export.py checks with transformers (Gemma with one and with several
key/value heads, the others with grouped-query attention, GPT-2 with multi-head).
KerasHub builds Gemma 2 with the same backbone class and other settings (post-norms, soft caps,
sliding windows), which transformers' ``gemma`` does not have: such a backbone is refused, naming
the settings; so is a claimed family's backbone with a setting tpurun does not map.
"""

from __future__ import annotations

from typing import Any

from tpurun.errors import ModelError
from tpurun.infer import hf_gemma3, hf_gemma4, hf_gemma_blocks, hf_gpt2, hf_llama

#: Backbone class -> the family name users know, for each family mapped here or in
#: :mod:`tpurun.infer.hf_llama`, :mod:`tpurun.infer.hf_gemma3`, :mod:`tpurun.infer.hf_gemma4`,
#: :mod:`tpurun.infer.hf_gpt2`.
FAMILIES = {
    "GemmaBackbone": "Gemma",
    "Llama3Backbone": "Llama 3",
    "QwenBackbone": "Qwen 2",
    "MistralBackbone": "Mistral",
    "Gemma3Backbone": "Gemma 3",
    "Gemma4Backbone": "Gemma 4",
    "GPT2Backbone": "GPT-2",
}
#: Backbone class -> the module that maps it (Gemma's is this one).
_MODULES = {
    **dict.fromkeys(hf_llama.ARCHITECTURES, hf_llama),
    "Gemma3Backbone": hf_gemma3,
    "Gemma4Backbone": hf_gemma4,
    "GPT2Backbone": hf_gpt2,
}
#: The settings each family's transformers model must have, by backbone class (Gemma's below).
_UNMAPPED = {**hf_llama.UNMAPPED, **hf_gemma3.UNMAPPED, **hf_gemma4.UNMAPPED, **hf_gpt2.UNMAPPED}

#: GemmaBackbone's settings as Gemma (v1) has them; KerasHub's Gemma 2 differs in these.
_GEMMA_V1 = {
    "use_post_ffw_norm": False,
    "use_post_attention_norm": False,
    "final_logit_soft_cap": None,
    "attention_logit_soft_cap": None,
    "use_sliding_window_attention": False,
    "query_head_dim_normalize": True,
}


def claimed() -> str:
    """The families tpurun exports, as a message names them."""
    return ", ".join(f"{name} ({cls})" for cls, name in FAMILIES.items())


def check_backbone(backbone: str | None, backbone_config: dict[str, Any], where: str) -> str:
    """The family of a backbone tpurun can export, from the preset's config.json alone.

    Raises:
        ModelError: a backbone of another family, or a Gemma backbone with Gemma 2's settings.
    """
    if backbone not in FAMILIES:
        raise ModelError(
            f"--format huggingface: {where} is a {backbone or 'backbone of unknown class'}, and "
            f"tpurun exports only {claimed()} to Hugging Face, each checked with transformers. "
            "Export --format keras (the merged task) or lora (the adapter) instead."
        )
    if backbone in _UNMAPPED:
        _check_unmapped(backbone, backbone_config, where)
        return FAMILIES[backbone]
    differ = {k: backbone_config[k] for k, v in _GEMMA_V1.items()
              if k in backbone_config and backbone_config[k] != v}  # fmt: skip
    if differ:
        said = ", ".join(f"{k}={v}" for k, v in differ.items())
        raise ModelError(
            f"--format huggingface: {where} is a GemmaBackbone with Gemma 2's settings ({said}); "
            "tpurun exports Gemma (v1) only, whose transformers model has none of them. Export "
            "--format keras (the merged task) or lora (the adapter) instead."
        )
    return FAMILIES[backbone]


def _check_unmapped(backbone: str, backbone_config: dict[str, Any], where: str) -> None:
    differ = {k: backbone_config[k] for k, v in _UNMAPPED[backbone].items()
              if backbone_config.get(k, v) != v}  # fmt: skip
    if differ:
        said = ", ".join(f"{k}={_said(v)}" for k, v in differ.items())
        wanted = ", ".join(f"{k}={v}" for k, v in _UNMAPPED[backbone].items())
        raise ModelError(
            f"--format huggingface: {where} is a {backbone} with {said}; tpurun exports "
            f"{FAMILIES[backbone]} with {wanted} only, the settings it checks with transformers. "
            "Export --format keras (the merged task) or lora (the adapter) instead."
        )


def _said(value: Any) -> str:
    """A setting's value in a message: a nested layer's config (a vision encoder) by its class."""
    if isinstance(value, dict):
        return f"a {value.get('class_name', 'layer')}"
    return str(value)


def check_task(task: Any) -> None:
    """Refuse a task setting the family's transformers model lacks (Gemma 4's own logit cap:
    :func:`tpurun.infer.hf_gemma4.check_task`).

    Raises:
        ModelError: such a setting.
    """
    module = _MODULES.get(type(task.backbone).__name__)
    if hasattr(module, "check_task"):
        module.check_task(task)


def hf_config(backbone: Any, tokenizer: Any, dtype: str) -> dict[str, Any]:
    """``config.json`` for the backbone's transformers model, every value read from the
    backbone (transformers' defaults are not relied on)."""
    if type(backbone).__name__ in _MODULES:
        return _MODULES[type(backbone).__name__].hf_config(backbone, tokenizer, dtype)
    ids = {name: tokenizer.token_to_id(piece) for name, piece in
           (("pad_token_id", "<pad>"), ("bos_token_id", "<bos>"), ("eos_token_id", "<eos>"))}  # fmt: skip
    return {
        "architectures": ["GemmaForCausalLM"],
        "model_type": "gemma",
        "vocab_size": backbone.vocabulary_size,
        "hidden_size": backbone.hidden_dim,
        "intermediate_size": backbone.intermediate_dim // 2,  # KerasHub's counts both gates
        "num_hidden_layers": backbone.num_layers,
        "num_attention_heads": backbone.num_query_heads,
        "num_key_value_heads": backbone.num_key_value_heads,
        "head_dim": backbone.head_dim,
        "hidden_act": "gelu_pytorch_tanh",  # KerasHub's Gemma: gelu(approximate=True)
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": backbone.layer_norm_epsilon,
        "rope_theta": 10000.0,  # CachedGemmaAttention's RotaryEmbedding max_wavelength
        "max_position_embeddings": 8192,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": bool(backbone.token_embedding.tie_weights),
        "dtype": dtype,
        **ids,
    }


def weights(backbone: Any) -> dict[str, Any]:
    """Every weight under transformers' names, as numpy arrays in the backbone's dtype: Gemma's
    here, the other families' in their modules (:data:`_MODULES`).

    KerasHub's attention kernels are per head: query ``(heads, hidden, head_dim)``, key and value
    ``(kv_heads, hidden, head_dim)``, output ``(heads, head_dim, hidden)``; transformers' are
    ``Linear`` weights ``(out, in)`` with the heads concatenated along ``out`` (``in`` for o_proj).

    Raises:
        ModelError: a kernel that is not floating point (a quantized layer).
    """
    if type(backbone).__name__ in _MODULES:
        return _MODULES[type(backbone).__name__].weights(backbone, _array)
    out = {"model.embed_tokens.weight": _array(backbone.token_embedding.embeddings)}
    for i in range(backbone.num_layers):
        block = backbone.get_layer(f"decoder_block_{i}")
        attention, prefix = block.attention, f"model.layers.{i}."
        out[prefix + "input_layernorm.weight"] = _array(block.pre_attention_norm.scale)
        out.update(hf_gemma_blocks.attention(attention, prefix, _array))
        out[prefix + "post_attention_layernorm.weight"] = _array(block.pre_ffw_norm.scale)
        out.update(hf_gemma_blocks.feed_forward(block, prefix, _array))
    out["model.norm.weight"] = _array(backbone.get_layer("final_normalization").scale)
    if not backbone.token_embedding.tie_weights:
        out["lm_head.weight"] = _array(backbone.token_embedding.reverse_embeddings).T
    return out


def _array(variable: Any) -> Any:
    import numpy as np

    value = np.asarray(variable)  # gathers a weight split over devices to the host
    if value.dtype.kind != "f" and "bfloat16" not in str(value.dtype):
        raise ModelError(
            f"--format huggingface: {getattr(variable, 'path', 'a weight')} is {value.dtype}, "
            "not a float: the merged model still holds a quantized layer. Export --format lora "
            "(the adapter) and merge it into the preset's float weights."
        )
    return value
