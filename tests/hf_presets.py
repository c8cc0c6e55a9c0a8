"""Tiny causal-LM presets of the families ``tpurun export --format huggingface`` claims beside
Gemma, built offline in a few seconds each: 2 layers, 4 query and 2 key/value heads (grouped-query
attention, the case users meet), each with a tokenizer of its family's kind made here.

* ``llama3``: ``Llama3Backbone`` with a byte-level BPE vocabulary (trained with the ``tokenizers``
  library on tests/hub_presets.py's text) and Llama 3's special tokens.
* ``mistral``: ``MistralBackbone`` with a SentencePiece vocabulary trained with Llama's and
  Mistral's settings (BPE, byte fallback, a dummy prefix), as transformers' ``LlamaTokenizer``
  reads ``tokenizer.model``.
* ``qwen``: ``QwenBackbone`` (Qwen 2: biases on query, key and value) with the same kind of
  vocabulary and Qwen's ``<|endoftext|>``.
* ``gemma3``: ``Gemma3Backbone``, text only, with Gemma 3's own settings and tests/hub_presets.py's
  Gemma vocabulary.
* ``gemma4``: ``Gemma4Backbone``, text only and dense, with what Gemma 4 adds over Gemma 3
  (per-layer embeddings, key/value sharing, keys as values, partial rotary) and the same vocabulary.
* ``gpt2``: ``GPT2Backbone`` (4 heads, no grouping: GPT-2 has none) with a byte-level BPE
  vocabulary and ``<|endoftext|>``.

Each is written with ``save_to_preset``, as Kaggle serves one; Keras must be importable (the
process set up, as tests/conftest.py does).
"""

from __future__ import annotations

import json
from pathlib import Path

from hub_presets import corpus

BPE_VOCABULARY = 320  # the 256 bytes and 64 merges less the special tokens; a multiple of 8
SEQUENCE_LENGTH = 32
SENTENCEPIECE_VOCABULARY = 384  # the 256 byte pieces of byte fallback and 128 more
SIZES = {"num_layers": 2, "num_query_heads": 4, "num_key_value_heads": 2, "hidden_dim": 64,
         "intermediate_dim": 96}  # fmt: skip
LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>")  # fmt: skip
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def byte_level_bpe(special: tuple[str, ...]) -> tuple[dict[str, int], list[str]]:
    """A byte-level BPE vocabulary (GPT-2's byte alphabet, as Llama 3's and Qwen's) and its
    merges, trained on the tiny presets' text, ``special`` last in the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCABULARY - len(special), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(corpus(), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocabulary = dict(model["vocab"])
    for token in special:
        vocabulary[token] = len(vocabulary)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return vocabulary, merges


def llama3(folder: Path) -> Path:
    """A tiny ``Llama3CausalLM`` at ``folder`` (untied embeddings, as Llama 3 8B)."""
    from tpurun import frameworks

    keras_hub = frameworks.keras_hub()
    frameworks.keras().utils.set_random_seed(0)
    tokenizer = keras_hub.models.Llama3Tokenizer(*byte_level_bpe(LLAMA3_SPECIAL))
    preprocessor = keras_hub.models.Llama3CausalLMPreprocessor(
        tokenizer, sequence_length=SEQUENCE_LENGTH
    )
    # Llama 3.1's scaled rotary embeddings, as Llama 3.1 and 3.2 have them (config.json's
    # rope_scaling); over the tiny prompts' few positions they move the logits little.
    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), rope_max_wavelength=500000.0,
        rope_frequency_adjustment_factor=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_pretraining_sequence_length=8192, **SIZES,
    )  # fmt: skip
    keras_hub.models.Llama3CausalLM(backbone, preprocessor).save_to_preset(str(folder))
    return folder


def qwen(folder: Path) -> Path:
    """A tiny ``QwenCausalLM`` (Qwen 2) at ``folder`` (tied embeddings, as Qwen 2 0.5B)."""
    from tpurun import frameworks

    keras_hub = frameworks.keras_hub()
    frameworks.keras().utils.set_random_seed(0)
    tokenizer = keras_hub.models.QwenTokenizer(*byte_level_bpe(QWEN_SPECIAL))
    preprocessor = keras_hub.models.QwenCausalLMPreprocessor(
        tokenizer, sequence_length=SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.QwenBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), rope_max_wavelength=1000000.0, **SIZES
    )
    keras_hub.models.QwenCausalLM(backbone, preprocessor).save_to_preset(str(folder))
    return folder


def mistral_proto() -> bytes:
    """A SentencePiece vocabulary with Mistral 7B's settings and ids (``<unk>`` 0, ``<s>`` 1,
    ``</s>`` 2, no padding piece)."""
    import io

    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus()), model_writer=buffer, vocab_size=SENTENCEPIECE_VOCABULARY,
        model_type="bpe", byte_fallback=True, add_dummy_prefix=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, split_digits=True,
        allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        character_coverage=1.0, hard_vocab_limit=True, minloglevel=2,
    )  # fmt: skip
    return buffer.getvalue()


def mistral(folder: Path) -> Path:
    """A tiny ``MistralCausalLM`` at ``folder``, its head size set apart from hidden / heads (as
    Mistral Nemo's is), which keras-hub 0.32's own exporter gets wrong."""
    from tpurun import frameworks

    keras_hub = frameworks.keras_hub()
    frameworks.keras().utils.set_random_seed(0)
    tokenizer = keras_hub.models.MistralTokenizer(proto=mistral_proto())
    preprocessor = keras_hub.models.MistralCausalLMPreprocessor(
        tokenizer, sequence_length=SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.MistralBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), head_dim=24, sliding_window=16, **SIZES
    )
    keras_hub.models.MistralCausalLM(backbone, preprocessor).save_to_preset(str(folder))
    return folder


def gemma3(folder: Path) -> Path:
    """A tiny text-only ``Gemma3CausalLM`` at ``folder`` with Gemma 3's settings: norms after
    attention and feed-forward, query/key norms, five sliding-window layers (a window of 4 keys,
    shorter than the test prompts) then a global one whose rotary positions are scaled by 8 (as
    Gemma 3 4B's and up), and ``query_head_dim_normalize=False`` with a head size apart from
    hidden / heads (as Gemma 3 27B's)."""
    from hub_presets import GEMMA_SEQUENCE_LENGTH, _sentencepiece_proto

    from tpurun import frameworks

    keras_hub = frameworks.keras_hub()
    frameworks.keras().utils.set_random_seed(0)
    tokenizer = keras_hub.models.Gemma3Tokenizer(
        proto=_sentencepiece_proto(corpus()), has_vision_tokens=False
    )
    preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(
        tokenizer, sequence_length=GEMMA_SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), image_size=None, num_layers=6,
        num_query_heads=4, num_key_value_heads=2, hidden_dim=64, intermediate_dim=96, head_dim=24,
        query_head_dim_normalize=False, use_post_ffw_norm=True, use_post_attention_norm=True,
        use_sliding_window_attention=True, sliding_window_size=4, global_rope_scaling_factor=8.0,
    )  # fmt: skip
    task = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=preprocessor)
    task.save_to_preset(str(folder))
    return folder


#: The tiny Gemma 4's decoder layers: sliding-window ones with a global one after every two, the
#: last global (transformers makes it so); the last two share the key/value of layers 3 and 2.
GEMMA4_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention"] * 2


def gemma4(folder: Path) -> Path:
    """A tiny text-only ``Gemma4CausalLM`` at ``folder`` with what Gemma 4 adds over Gemma 3:
    per-layer embeddings and key/value sharing in the last layers with double-wide feed-forwards
    there (as E2B), global layers with a larger head size, a quarter of it rotated (partial
    rotary), one key/value head and keys as values (as 31B), value norms, each layer's output
    scalar (set apart from 1 here, as a checkpoint's are), a window of 4 keys (shorter than the
    test prompts) and a final logit soft cap of 2 (Gemma 4's 30 barely bends the tiny model's
    logits; this one moves them). Head sizes of 24 and 48 and feed-forwards of 48 and 96: the
    tiny Gemma 3's shapes, whose compiled operations the test process reuses (3 CPU-seconds)."""
    from hub_presets import GEMMA_SEQUENCE_LENGTH, _sentencepiece_proto

    from tpurun import frameworks

    keras_hub = frameworks.keras_hub()
    frameworks.keras().utils.set_random_seed(0)
    tokenizer = keras_hub.models.Gemma4Tokenizer(
        proto=_sentencepiece_proto(corpus()), has_vision_tokens=False, has_video_tokens=False
    )
    preprocessor = keras_hub.models.Gemma4CausalLMPreprocessor(
        tokenizer, sequence_length=GEMMA_SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.Gemma4Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), image_size=None, num_layers=6,
        num_query_heads=4, num_key_value_heads=2, hidden_dim=64, intermediate_dim=48, head_dim=24,
        global_head_dim=48, layer_types=GEMMA4_LAYER_TYPES, sliding_window_size=4,
        global_rope_partial_rotary_factor=0.25, final_logit_soft_cap=2.0,
        num_kv_shared_layers=2, use_double_wide_mlp=True, num_global_key_value_heads=1,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=tokenizer.vocabulary_size(),
    )  # fmt: skip
    _scales_apart_from_one(backbone)
    task = keras_hub.models.Gemma4CausalLM(backbone=backbone, preprocessor=preprocessor)
    task.save_to_preset(str(folder))
    return folder


def _scales_apart_from_one(backbone) -> None:
    """Every norm's scale and each layer's output scalar set apart from 1 (a checkpoint's are), so
    a norm or scalar written under another's name moves the logits.

    A random tiny Gemma 4 is sensitive to float32 rounding, and the values keep it within the
    1e-5 tolerance: with unit query/key norm scales its unscaled attention is near one-hot, and
    scalars below 1 shrink the residual stream that every later norm then magnifies. With both
    (unit query/key scales, scalars 0.5 to 1.5), transformers' own float32 logits for the test
    prompts are 2.2e-5 from its float64 ones; with query/key scales in [0.35, 0.6], tpurun's
    (XLA's) are 5.3e-5 from them; with these (query/key scales in [0.2, 0.4], scalars 1.1 to
    1.6), both are within 3.2e-6 of them."""
    import numpy as np

    rng = np.random.default_rng(0)
    for weight in backbone.weights:
        if weight.path.endswith("/scale"):
            attention = weight.path.split("/")[-2] in ("query_norm", "key_norm")
            low, high = (0.2, 0.4) if attention else (0.6, 1.4)
            weight.assign(rng.uniform(low, high, weight.shape).astype("float32"))
    for i in range(backbone.num_layers):
        backbone.get_layer(f"decoder_block_{i}").layer_scalar.assign(1.1 + 0.1 * i)


def gpt2(folder: Path) -> Path:
    """A tiny ``GPT2CausalLM`` at ``folder`` (position embeddings for 64 tokens)."""
    from tpurun import frameworks

    keras_hub = frameworks.keras_hub()
    frameworks.keras().utils.set_random_seed(0)
    tokenizer = keras_hub.models.GPT2Tokenizer(*byte_level_bpe(("<|endoftext|>",)))
    preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
        tokenizer, sequence_length=SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_heads=4, hidden_dim=64,
        intermediate_dim=96, max_sequence_length=64,
    )  # fmt: skip
    task = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocessor)
    task.save_to_preset(str(folder))
    return folder
