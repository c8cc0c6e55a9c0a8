"""What Gemma, Gemma 3 and Gemma 4 decoder blocks share in their Hugging Face form: per-head
attention kernels and the gated feed-forward, under transformers' names.

KerasHub's attention kernels are per head, query ``(heads, hidden, head_dim)``, key and value
``(kv_heads, hidden, head_dim)``, output ``(heads, head_dim, hidden)``; transformers' are ``Linear``
weights ``(out, in)`` with the heads concatenated along ``out`` (``in`` for o_proj). Every kernel
is read as ``layer.kernel``, the LoRA adapter merged in (keras-hub 0.32's exporter reads
``weights[0]``, a LoRA layer's frozen kernel).
"""

from __future__ import annotations

from typing import Any


def attention(
    layer: Any, prefix: str, array: Any, projections: tuple[str, ...] = ("q", "k", "v")
) -> dict[str, Any]:
    """``self_attn.{q,k,v}_proj`` (those of ``projections``) and ``self_attn.o_proj``.

    Args:
        layer: the block's attention layer (``query_dense``, ``key_dense``, ...).
        array: the float array of a variable (:func:`tpurun.infer.hf_families._array`).
    """
    out = {}
    for name in projections:
        dense = getattr(layer, {"q": "query_dense", "k": "key_dense", "v": "value_dense"}[name])
        kernel = array(dense.kernel)  # merged with its adapter, all heads
        heads, hidden, head_dim = kernel.shape
        out[prefix + f"self_attn.{name}_proj.weight"] = kernel.transpose(0, 2, 1).reshape(
            heads * head_dim, hidden
        )
    kernel = array(layer.output_dense.kernel)
    out[prefix + "self_attn.o_proj.weight"] = kernel.reshape(-1, kernel.shape[-1]).T
    return out


def feed_forward(block: Any, prefix: str, array: Any) -> dict[str, Any]:
    """``mlp.{gate,up,down}_proj``: KerasHub's ``gating_ffw``, ``gating_ffw_2``, ``ffw_linear``."""
    return {
        prefix + "mlp.gate_proj.weight": array(block.gating_ffw.kernel).T,
        prefix + "mlp.up_proj.weight": array(block.gating_ffw_2.kernel).T,
        prefix + "mlp.down_proj.weight": array(block.ffw_linear.kernel).T,
    }


def four_norms(block: Any, prefix: str, array: Any) -> dict[str, Any]:
    """Gemma 3's and 4's norms before and after attention and the feed-forward."""
    return {
        prefix + f"{name}.weight": array(norm.scale)
        for name, norm in (
            ("input_layernorm", block.pre_attention_norm),
            ("post_attention_layernorm", block.post_attention_norm),
            ("pre_feedforward_layernorm", block.pre_ffw_norm),
            ("post_feedforward_layernorm", block.post_ffw_norm),
        )
    }
