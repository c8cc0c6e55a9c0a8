"""Tiny KerasHub presets, built offline in a few seconds: the models the hub tests fine-tune.

* ``gemma``: a SentencePiece vocabulary trained on generated text with Gemma's settings, a 2-layer
  Gemma backbone (hidden size 64, one key/value head as Gemma 2B has) and ``GemmaCausalLM`` with
  its preprocessor.
* ``gemma_mesh``: the same vocabulary and sizes with 8 query and 4 key/value heads, for a device
  mesh: a model axis of 2 or 4 divides every head count (Gemma's own layout shards heads), one of
  8 does not divide the 4 key/value heads (the grouped-query case users hit); ``gemma``'s single
  key/value head is indivisible by any model axis above 1.
* ``bert``: a WordPiece vocabulary of the same text's words and a 2-layer ``BertTextClassifier``
  (2 classes, position embeddings for 32 tokens).
* ``resnet``: a one-block ``ResNetImageClassifier`` on 32x32 images: a task whose backbone has no
  attention layer LoRA could target.

Each is written with ``save_to_preset``, so it is a folder as Kaggle serves one. The session
fixture ``tiny_presets`` (tests/conftest.py) builds them once in the test process, which conftest
has already set up for Keras; a benchmark or a shell builds them with
``python tests/hub_presets.py OUT_DIR`` (on the CPU, JAX backend).
"""

from __future__ import annotations

import io
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

SUBJECTS = ["the cat", "a dog", "my friend", "the robot", "our teacher", "the small bird",
            "a farmer", "the old man", "the child", "a fox"]  # fmt: skip
VERBS = ["eats", "sees", "likes", "finds", "builds", "paints", "reads", "carries", "wants",
         "moves"]  # fmt: skip
OBJECTS = ["an apple", "the red ball", "a book", "the green house", "some bread",
           "a long river", "the blue sky", "a tiny stone", "the big tree", "a warm coat"]  # fmt: skip
ENDS = ["today", "at night", "in the morning", "every day", "with joy", "slowly", "again",
        "near the sea", "in the park", "quietly"]  # fmt: skip

GEMMA_VOCABULARY = 256  # a multiple of 8, so the embedding splits over a model axis
GEMMA_SEQUENCE_LENGTH = 32
BERT_SEQUENCE_LENGTH = 16
BERT_MAX_SEQUENCE_LENGTH = 32  # the backbone's position embeddings: a longer sequence is refused
IMAGE_SIZE = 32


@dataclass(frozen=True)
class TinyPresets:
    """The folders :func:`build` wrote."""

    gemma: Path  # GemmaCausalLM
    gemma_mesh: Path  # GemmaCausalLM, 8 query and 4 key/value heads
    bert: Path  # BertTextClassifier, 2 classes
    resnet: Path  # ResNetImageClassifier, 2 classes


def sentences(n: int = 400, seed: int = 0) -> list[str]:
    """Plain sentences from a small grammar."""
    rng = random.Random(seed)
    return [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
            f"{rng.choice(ENDS)}." for _ in range(n)]  # fmt: skip


def prompt_response_pairs(n: int = 256, seed: int = 1) -> list[tuple[str, str]]:
    """Question/answer pairs whose answer follows from the question (a causal LM can learn it)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s, v, o = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)
        out.append((f"question: what {v} {s}?", f"answer: {s} {v} {o}."))
    return out


def conversations(n: int = 32, seed: int = 3, most_turns: int = 3) -> list[list[dict]]:
    """Chat conversations (``messages`` lists) of 1 to ``most_turns`` question/answer exchanges,
    a quarter with a system turn first: examples of mixed lengths."""
    rng = random.Random(seed)
    pairs = prompt_response_pairs(n * most_turns, seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "answer in one sentence."}] if i % 4 == 0 else []
        for prompt, response in pairs[i * most_turns : i * most_turns + rng.randint(1, most_turns)]:
            turns += [{"role": "user", "content": prompt},
                      {"role": "assistant", "content": response}]  # fmt: skip
        out.append(turns)
    return out


def made_up_sentences(n: int = 300, seed: int = 2) -> list[str]:
    """Sentences of made-up words: SentencePiece needs this much variety to fill 256 pieces."""
    rng = random.Random(seed)
    consonants, vowels = "bcdfghjklmnprstvwz", "aeiou"

    def word() -> str:
        return "".join(
            rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 4))
        )

    return [f"the word {word()} means {word()} and {word()}." for _ in range(n)]


def corpus() -> list[str]:
    """The text both vocabularies are made from."""
    pairs = [f"{p} {r}" for p, r in prompt_response_pairs(200)]
    return sentences() + made_up_sentences() + pairs


def _sentencepiece_proto(text: list[str], symbols: tuple[str, ...] = ()) -> bytes:
    import sentencepiece as spm

    buffer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text),
        model_writer=buffer,
        vocab_size=GEMMA_VOCABULARY,
        # Gemma's own settings (BPE, no normalisation, no dummy prefix, whitespace kept): Hugging
        # Face's GemmaTokenizer reads tokenizer.model so, and a vocabulary trained otherwise splits
        # text differently there (tests/infer/test_hf_export.py compares the ids).
        model_type="bpe", add_dummy_prefix=False, normalization_rule_name="identity",
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        # Gemma's own ids; GemmaTokenizer checks that the pieces <bos>, <eos> and <pad> exist.
        pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>",
        character_coverage=1.0,
        hard_vocab_limit=True,
        minloglevel=2,
        **({"user_defined_symbols": list(symbols)} if symbols else {}),
    )  # fmt: skip
    return buffer.getvalue()


#: The tiny Gemma's sizes; :func:`gemma` takes others (a benchmark's larger model).
GEMMA_SIZES = {"num_layers": 2, "num_query_heads": 4, "num_key_value_heads": 1,
               "hidden_dim": 64, "intermediate_dim": 128, "head_dim": 16}  # fmt: skip


def _gemma(keras_hub, proto: bytes, folder: Path, **sizes: int) -> None:
    tokenizer = keras_hub.models.GemmaTokenizer(proto=proto)
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor(
        tokenizer, sequence_length=GEMMA_SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), **{**GEMMA_SIZES, **sizes}
    )
    keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=preprocessor).save_to_preset(
        str(folder)
    )


def _bert(keras_hub, text: list[str], folder: Path) -> None:
    words = sorted({w.strip(".?:") for line in text for w in line.split()} - {""})
    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", ":", *words]
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary, lowercase=True)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer, sequence_length=BERT_SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=BERT_MAX_SEQUENCE_LENGTH,
    )  # fmt: skip
    classifier = keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=preprocessor
    )
    classifier.save_to_preset(str(folder))


def _resnet(keras_hub, folder: Path) -> None:
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64],
        stackwise_num_blocks=[1], stackwise_num_strides=[1], block_type="basic_block",
        image_shape=(IMAGE_SIZE, IMAGE_SIZE, 3),
    )  # fmt: skip
    converter = keras_hub.layers.ResNetImageConverter(
        image_size=(IMAGE_SIZE, IMAGE_SIZE), scale=1 / 255
    )
    preprocessor = keras_hub.models.ResNetImageClassifierPreprocessor(converter)
    classifier = keras_hub.models.ResNetImageClassifier(
        backbone, num_classes=2, preprocessor=preprocessor
    )
    classifier.save_to_preset(str(folder))


def gemma(folder: Path, **sizes: int) -> Path:
    """A Gemma preset of the tiny vocabulary with other sizes (``GEMMA_SIZES``' keys) at
    ``folder``, its weights random (seeded). Keras must be importable (the process set up)."""
    from tpurun import frameworks

    frameworks.keras().utils.set_random_seed(0)
    _gemma(frameworks.keras_hub(), _sentencepiece_proto(corpus()), folder, **sizes)
    return folder


#: Gemma's turn markers, one piece each in a real Gemma vocabulary.
TURN_MARKERS = ("<start_of_turn>", "<end_of_turn>")


def chat_gemma(folder: Path) -> Path:
    """The tiny Gemma with :data:`TURN_MARKERS` as pieces of its vocabulary (user-defined
    symbols, as Gemma's own vocabulary holds them), for chat data; the shared ``gemma`` lacks
    them. Keras must be importable (the process set up)."""
    from tpurun import frameworks

    frameworks.keras().utils.set_random_seed(0)
    # A line break is a piece of Gemma's vocabulary too (the tiny one's text has none).
    _gemma(frameworks.keras_hub(), _sentencepiece_proto(corpus(), (*TURN_MARKERS, "\n")), folder)
    return folder


def build(folder: Path) -> TinyPresets:
    """Write the tiny presets under ``folder``. Keras must be importable (the process set up)."""
    from tpurun import frameworks

    keras = frameworks.keras()
    keras_hub = frameworks.keras_hub()
    keras.utils.set_random_seed(0)
    presets = TinyPresets(folder / "tiny_gemma", folder / "tiny_gemma_mesh", folder / "tiny_bert",
                          folder / "tiny_resnet")  # fmt: skip
    text = corpus()
    proto = _sentencepiece_proto(text)
    _gemma(keras_hub, proto, presets.gemma)
    _gemma(keras_hub, proto, presets.gemma_mesh, num_query_heads=8, num_key_value_heads=4)
    _bert(keras_hub, text, presets.bert)
    _resnet(keras_hub, presets.resnet)
    return presets


if __name__ == "__main__":
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tpurun import frameworks

    frameworks.activated(os.environ["KERAS_BACKEND"])
    built = build(Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-presets"))
    print("\n".join(str(p) for p in (built.gemma, built.gemma_mesh, built.bert, built.resnet)))
