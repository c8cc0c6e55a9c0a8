"""Conversations to token ids by a preset's chat format, for ``tpurun data write --tokenize``.

KerasHub 0.32 presets carry no chat template (its vLLM tokenizer's ``apply_chat_template`` says
so), so the formats are here, chosen by the preset's tokenizer class:

- ``gemma`` (Gemma, Gemma 3): ``<start_of_turn>user\\n...<end_of_turn>\\n`` and
  ``<start_of_turn>model\\n...<end_of_turn>\\n``; Gemma has no system role, so a system turn's
  text goes before the first user turn's, a blank line between (as Gemma 3's own template does);
- ``llama3`` (Llama 3): ``<|start_header_id|>ROLE<|end_header_id|>\\n\\n...<|eot_id|>``;
- ``chatml`` (Qwen, Qwen 3, Qwen 3.5, their MoEs): ``<|im_start|>ROLE\\n...<|im_end|>\\n``.

Another family takes a template by hand (:mod:`tpurun.config.chat_config`). A marker of the
template (``<...>``, ``<|...|>``) is the vocabulary's one token for it where the vocabulary has one,
else ordinary text (the write says so); a turn's content is always ordinary text. Text pieces are
tokenised one by one, as Hugging Face's tokenizers split text at special tokens.

A record is laid out as a prompt/response record (:mod:`tpurun.hub.tokenize`): ``token_ids``,
``padding_mask`` and ``weights`` of ``N + 1`` positions; the start token where the preprocessor adds
one; no end token (each assistant turn ends with its own end marker, which the loss counts).
``weights`` is 1 on an assistant turn's content and the rest of its template (the end marker),
0 elsewhere: the loss is the per-token mean over the assistant's tokens alone.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from tpurun.data.schema_file import TOKENIZED
from tpurun.data.sources.base import OVERHEAD_PER_FEATURE, MappedSource, Source
from tpurun.errors import ModelError

CONTENT = "{content}"
#: Markers a template may hold: ``<start_of_turn>``, ``<|im_start|>``.
_MARKER = re.compile(r"(<\|[^<>|\s]+\|>|<[A-Za-z_][^<>\s]*>)")


@dataclass(frozen=True)
class ChatFormat:
    """A family's turns, each with one ``{content}``; ``system`` None: no system role."""

    name: str
    user: str
    assistant: str
    system: str | None = None


FORMATS = {
    "gemma": ChatFormat("gemma", "<start_of_turn>user\n{content}<end_of_turn>\n",
                        "<start_of_turn>model\n{content}<end_of_turn>\n"),
    "llama3": ChatFormat(
        "llama3", "<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
        "<|start_header_id|>assistant<|end_header_id|>\n\n{content}<|eot_id|>",
        "<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>"),
    "chatml": ChatFormat("chatml", "<|im_start|>user\n{content}<|im_end|>\n",
                         "<|im_start|>assistant\n{content}<|im_end|>\n",
                         "<|im_start|>system\n{content}<|im_end|>\n"),
}  # fmt: skip
#: The format of each tokenizer class (the preset's family).
FAMILIES = {
    "GemmaTokenizer": "gemma", "Gemma3Tokenizer": "gemma", "Llama3Tokenizer": "llama3",
    "QwenTokenizer": "chatml", "QwenMoeTokenizer": "chatml", "Qwen3Tokenizer": "chatml",
    "Qwen3MoeTokenizer": "chatml", "Qwen3_5Tokenizer": "chatml", "Qwen3_5MoeTokenizer": "chatml",
}  # fmt: skip


def chat_format(tokenizer: Any, template: Any = None, preset: str = "PRESET") -> ChatFormat:
    """The format to write with: ``template`` (a :class:`ChatTemplate`) where given, else the
    tokenizer's family's.

    Raises:
        ModelError: a family without a format and no template, naming the option to give.
    """
    if template is not None:
        return ChatFormat("template", template.user, template.assistant, template.system)
    family = FAMILIES.get(type(tokenizer).__name__)
    if family is None:
        known = ", ".join(sorted({f"{cls} ({name})" for cls, name in FAMILIES.items()}))
        raise ModelError(
            f"--tokenize {preset}: its tokenizer, {type(tokenizer).__name__}, has no chat format "
            f"in tpurun (they are: {known}). Give one with `--chat-template TEMPLATE.yaml` "
            "(user, assistant and optionally system, each with one {content}; see the docs' "
            "Chat data)."
        )
    return FORMATS[family]


def markers(tokenizer: Any, form: ChatFormat) -> tuple[dict[str, int], list[str]]:
    """The format's markers that are one token of the vocabulary (``{marker: id}``), and those
    that are not (written as text)."""
    found, missing = {}, []
    texts = [t for t in (form.user, form.assistant, form.system) if t]
    for marker in dict.fromkeys(m for t in texts for m in _MARKER.findall(t)):
        try:
            token = tokenizer.token_to_id(marker)
            same = tokenizer.id_to_token(token) == marker
        except (KeyError, ValueError, IndexError):
            same = False
        if same:
            found[marker] = int(token)
        else:
            missing.append(marker)
    return found, missing


def end_marker(form: ChatFormat) -> str | None:
    """What ends an assistant turn: the first marker after its ``{content}`` (``<end_of_turn>``),
    else that text stripped; None where nothing follows it."""
    after = form.assistant.split(CONTENT)[1]
    found = _MARKER.findall(after)
    return found[0] if found else (after.strip() or None)


def pieces(turns: list[dict[str, str]], form: ChatFormat) -> list[tuple[str, bool, bool]]:
    """A conversation as ``(text, is_template, weighted)`` pieces in order: the template's text
    around each turn's content (split at markers later), the content itself."""
    turns = list(turns)
    if turns[0]["role"] == "system" and form.system is None:
        system = turns.pop(0)["content"]
        first = next((i for i, t in enumerate(turns) if t["role"] == "user"), None)
        if first is None:
            turns.insert(0, {"role": "user", "content": system})
        else:
            turns[first] = {"role": "user", "content": f"{system}\n\n{turns[first]['content']}"}
    out = []
    for turn in turns:
        before, after = getattr(form, turn["role"]).split(CONTENT)
        weighted = turn["role"] == "assistant"
        out += [(before, True, False), (turn["content"], False, weighted), (after, True, weighted)]
    return [piece for piece in out if piece[0]]


class ChatTokenizing:
    """Chat records (``messages``, compact JSON) -> ``token_ids``, ``padding_mask``, ``weights``."""

    def __init__(self, preprocessor: Any, form: ChatFormat):
        self.tokenizer, self.form = preprocessor.tokenizer, form
        self.length = preprocessor.sequence_length + 1  # x and y: shifted by one
        self.start = [self.tokenizer.start_token_id] if preprocessor.add_start_token else []
        self.pad = int(getattr(self.tokenizer, "pad_token_id", None) or 0)
        self.single, self.missing = markers(self.tokenizer, form)

    def _split(self, text: str, is_template: bool) -> list[str | int]:
        if not is_template:
            return [text]
        parts = _MARKER.split(text)
        return [self.single.get(p, p) for p in parts if p]

    def encode(
        self, conversations: list[list[dict[str, str]]], open_answer: bool = False
    ) -> list[tuple[list, list]]:
        """Each conversation's ``(ids, weights)``, unpadded and uncut; ``open_answer``: followed by
        what opens an assistant turn (its template before ``{content}``), where a prompt ends for
        the model to answer (``tpurun predict``)."""
        opener = self._split(self.form.assistant.split(CONTENT)[0], True) if open_answer else []
        laid = [[(part, weighted) for text, is_template, weighted in pieces(turns, self.form)
                 for part in self._split(text, is_template)] + [(p, False) for p in opener]
                for turns in conversations]  # fmt: skip
        texts = list(dict.fromkeys(p for row in laid for p, _ in row if isinstance(p, str)))
        tokens = self.tokenizer(texts) if texts else []
        if hasattr(tokens, "to_list"):  # a ragged tensor on the TensorFlow backend
            tokens = tokens.to_list()
        ids_of = {text: [int(i) for i in ids] for text, ids in zip(texts, tokens, strict=True)}
        out = []
        for row in laid:
            ids, weights = list(self.start), [0] * len(self.start)
            for part, weighted in row:
                got = [part] if isinstance(part, int) else ids_of[part]
                ids += got
                weights += [int(weighted)] * len(got)
            out.append((ids, weights))
        return out

    def columns(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """A chunk of chat records -> the tokenised columns, each ``[records, N + 1]`` int64."""
        import numpy as np

        conversations = [json.loads(raw) for raw in chunk["messages"]]
        n = len(conversations)
        token_ids = np.full((n, self.length), self.pad, np.int64)
        mask = np.zeros((n, self.length), np.int64)
        weights = np.zeros((n, self.length), np.int64)
        for row, (ids, weighted) in enumerate(self.encode(conversations)):
            kept = min(len(ids), self.length)
            token_ids[row, :kept] = ids[:kept]
            mask[row, :kept] = 1
            weights[row, :kept] = weighted[:kept]
        return {"token_ids": token_ids, "padding_mask": mask, "weights": weights}


def mapped(source: Source, preprocessor: Any, entry: dict[str, Any], template: Any) -> Source:
    """What ``--tokenize`` makes of a chat source: its conversations as causal LM token records,
    laid out as :func:`tpurun.hub.tokenize.pack_prompt_response` lays out a prompt and response.

    Raises:
        ModelError: a preset that is not a causal LM, or a family without a chat format and no
            template.
    """
    if entry["kind"] != "causal_lm":
        raise ModelError(
            f"--tokenize {entry['preset']}: chat data trains a causal LM, and this preset is a "
            f"{entry['task']}. Choose a causal LM preset (Gemma, Llama 3, Qwen)."
        )
    form = chat_format(preprocessor.tokenizer, template, entry["preset"])
    tokenizing = ChatTokenizing(preprocessor, form)
    length = tokenizing.length
    casts = {"token_ids": "int32", "padding_mask": "bool", "weights": "float32"}
    features = {name: {"type": "int64", "shape": [length], "cast": cast}
                for name, cast in casts.items()}  # fmt: skip
    vocabulary = preprocessor.tokenizer.vocabulary_size()
    id_bytes = max(1, -(-max(1, vocabulary - 1).bit_length() // 7))  # a varint's length
    per_record = length * (id_bytes + 2) + OVERHEAD_PER_FEATURE * len(features)
    chat = {"format": form.name, **{k: v for k, v in asdict(form).items() if k != "name"},
            "single_tokens": sorted(tokenizing.single), "as_text": tokenizing.missing}  # fmt: skip
    entry = {**entry, "source": {"inputs": "messages", "targets": "messages"}, "chat": chat,
             "features": list(casts), "mask": "padding_mask"}  # fmt: skip
    made = MappedSource(
        source, tokenizing.columns, features, per_record * source.records, layout={TOKENIZED: entry}
    )
    if tokenizing.missing:
        made.warnings.append(
            f"the vocabulary of {entry['preset']} has no single token for "
            f"{', '.join(tokenizing.missing)}: the {form.name} chat format's markers are written "
            "as ordinary text there (a real preset of this family has them)."
        )
    return made
