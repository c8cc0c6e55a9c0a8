"""``tpurun predict`` on a run fine-tuned on chat records: each prompt rendered in the chat format
the run trained with, and the assistant's answer, up to its end-of-turn marker.

The format is the one ``data write`` recorded in the training data's schema file (its
``tokenized.chat`` entry: the family's turns, or a template by hand), which ``train`` keeps in the
run's ``config.yaml`` (``derived.chat``) so that a moved data folder changes nothing; a run from
before that reads the schema file. ``--data`` is a JSONL file of
conversations, ``{"messages": [...]}`` a line whose last turn is the user's (an id beside it for
``--id-feature``), or plain prompts (a text file of one a line, or JSONL ``{"prompt": "..."}``),
each taken as one user turn. A conversation is laid out token for token as ``data write`` lays it
out (:class:`tpurun.hub.chat.ChatTokenizing`), followed by what opens an assistant turn
(``<start_of_turn>model\\n``), and KerasHub's ``generate`` continues it on token ids (the
preprocessor taken off, as it would tokenise the markers' text differently), stopping at the
format's end-of-turn marker (``<end_of_turn>``, ``<|eot_id|>``, ``<|im_end|>``, the template's)
where the vocabulary holds it as one token, or at the end token. The completion is the answer's
text: no marker, cut at the end-of-turn marker's text where the vocabulary lacks it.

The rows are ``id``, ``prompt`` (the last user turn's text) and ``completion``, as for any causal
LM (:mod:`tpurun.infer.generate`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from typing import Any

from tpurun.data.sources import chat as chat_source
from tpurun.errors import DataError
from tpurun.hub import batches, chat
from tpurun.infer import generate, preset_task, prompts, trained_run

_EXAMPLE = '{"messages": [{"role": "user", "content": "What eats a fox?"}]}'


@dataclass(frozen=True)
class Prompt:
    """One prompt to answer: its row id (None: numbered), its turns, the text shown for it."""

    id: Any
    turns: list[dict[str, str]]
    shown: str


def trained_format(schema: dict | None) -> chat.ChatFormat | None:
    """The chat format a run trained with, from its training data's schema file; None where it
    did not train on chat records."""
    entry = ((schema or {}).get("tokenized") or {}).get("chat")
    if not entry:
        return None
    return chat.ChatFormat(entry["format"], entry["user"], entry["assistant"], entry.get("system"))


def is_conversations(found: prompts.PromptFiles | None) -> bool:
    """Whether prompt files are conversations: JSONL whose first object has ``messages``."""
    if found is None or found.kind.family != "jsonl":
        return False
    for _, line in prompts.lines(found.files[0], found.kind):
        try:
            first = json.loads(line)
        except ValueError:
            return False
        return isinstance(first, dict) and "messages" in first
    return False


def check(run_path: str, form: chat.ChatFormat | None, found: prompts.PromptFiles | None) -> None:
    """``--data`` fits the run: conversations only for a run trained on chat records, and a
    chat run's prompts as a file.

    Raises:
        DataError: naming the file and what to give instead.
    """
    if form is None and is_conversations(found):
        raise DataError(
            f'--data: {found.files[0]} holds conversations ("messages"), and {run_path} did not '
            "train on chat records, so it knows no chat format to render them in. Give its "
            "prompts as it trained (a text file of one prompt a line, or JSONL of its input "
            "feature), or fine-tune on the conversations first: `tpurun data write CHAT.jsonl "
            "OUT --tokenize PRESET`, then train on OUT."
        )
    if form is not None and found is None:
        raise DataError(
            f"--data: {run_path} fine-tuned a causal LM on chat records, and it answers "
            f"prompts given as a file: JSONL conversations ({_EXAMPLE} a line, the last turn the "
            "user's), or plain prompts (a text file of one a line), each one user turn."
        )


def read(found: prompts.PromptFiles, id_feature: str | None) -> list[Prompt]:
    """Every prompt of ``found`` in file order: conversations, or plain prompts as one user turn.

    Raises:
        DataError: a line that is not a conversation ending with a user turn, naming file:line.
    """
    if not is_conversations(found):
        rows = prompts.records(found, "prompt", id_feature)
        return [Prompt(row.get(id_feature) if id_feature else None,
                       [{"role": "user", "content": row["prompt"]}], row["prompt"])
                for row in rows]  # fmt: skip
    out = []
    for path in found.files:
        for number, line in prompts.lines(path, found.kind):
            turns, row = _conversation(f"{path}:{number}", line)
            ident = None
            if id_feature:
                ident = row.get(id_feature)
                if not isinstance(ident, (str, int)) or isinstance(ident, bool):
                    raise DataError(
                        f"--id-feature {id_feature}: {path}:{number} holds no "
                        f'"{id_feature}" string or whole number.'
                    )
            out.append(Prompt(ident, turns, turns[-1]["content"]))
    return out


def _conversation(where: str, line: str) -> tuple[list[dict[str, str]], dict]:
    """One line's turns (checked) and the line's object."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise DataError(
            f"--data: {where}: not valid JSON ({exc.msg}); each line of a "
            f"conversations file is one, such as {_EXAMPLE}."
        ) from None
    turns = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(turns, list) or not turns:
        raise DataError(
            f'--data: {where}: no "messages" list of turns; each line of a '
            f"conversations file is one, such as {_EXAMPLE}."
        )
    wrong = chat_source.problem([*turns, {"role": "assistant", "content": ""}])
    if wrong is None and turns[-1]["role"] != "user":
        wrong = f"the last turn is the {turns[-1]['role']}'s, where the model answers a user's"
    if wrong:
        raise DataError(
            f'--data: {where}: {wrong}. Each turn is {{"role": "system" | "user" | "assistant", '
            '"content": "..."}, the last one the user\'s: the model writes the next assistant '
            "turn."
        )
    return turns, row


class Answering:
    """Prompts -> the ids the model continues; generated ids -> the answer's text."""

    def __init__(self, preprocessor: Any, form: chat.ChatFormat):
        self.tokenizing = chat.ChatTokenizing(preprocessor, form)
        self.tokenizer = preprocessor.tokenizer
        self.end_marker = chat.end_marker(form)
        single = self.tokenizing.single.get(self.end_marker)
        ends = [single, getattr(self.tokenizer, "end_token_id", None)]
        #: What generation stops at: the end-of-turn marker's token, then the end token.
        self.stop_ids = tuple(dict.fromkeys(int(i) for i in ends if i is not None))
        self.cut_text = self.end_marker if single is None else None
        self.special = set(getattr(self.tokenizer, "special_token_ids", None) or [])

    def prompt_ids(self, batch: list[Prompt]) -> list[list[int]]:
        """Each prompt's ids: its turns as ``data write`` writes them, then the answer's opener."""
        return [ids for ids, _ in self.tokenizing.encode([p.turns for p in batch], True)]

    def text(self, ids: Any) -> str:
        """Generated ids (the prompt stripped) -> the answer: up to the first stop id, without
        special tokens, cut at the end marker's text where it is not one token."""
        import numpy as np

        kept = []
        for token in (int(i) for i in ids):
            if token in self.stop_ids:
                break
            if token not in self.special:
                kept.append(token)
        out = self.tokenizer.detokenize(np.asarray(kept, "int32")) if kept else ""
        if not isinstance(out, str):
            out = generate.text_of(np.asarray(out).item())
        return out.split(self.cut_text)[0] if self.cut_text else out


def complete(
    model: Any,
    form: chat.ChatFormat,
    asked: list[Prompt],
    output: str,
    kind: str,
    sampling: generate.Sampling,
    id_feature: str | None,
    batch: int,
    seed: int,
) -> dict[str, Any]:
    """Answer every prompt ``asked`` in batches of ``batch`` (the last filled up with copies of
    its first prompt, whose rows are dropped) and write the rows to ``output``.

    Raises:
        DataError: a prompt that leaves no room to answer in the sequence's length.
    """
    if sampling.sampler == "top_k" and sampling.seed is None:
        sampling = replace(sampling, seed=seed)
    model.compile(sampler=generate.sampler_for(sampling))
    answering = Answering(model.preprocessor, form)
    length = sampling.max_length or model.preprocessor.sequence_length
    preprocessor = batches.detach(model)  # generate on ids: the markers are tokens already
    try:
        with generate.Completions(output, kind) as writer:
            for start in range(0, len(asked), batch):
                part = asked[start : start + batch]
                texts = _answer(model, answering, part, batch, length)
                ids = [p.id if id_feature else writer.written + i for i, p in enumerate(part)]
                writer.write(ids, [p.shown for p in part], texts)
    finally:
        batches.attach(model, preprocessor)
    return {
        "rows": writer.written,
        "columns": generate.COLUMNS,
        "format": kind.lstrip("."),
        "chat_format": form.name,
        "stop_token_ids": list(answering.stop_ids),
        "sampling": {**asdict(sampling), "max_length": length},
    }


def _answer(
    model: Any, answering: Answering, part: list[Prompt], batch: int, length: int
) -> list[str]:
    """One batch's answers (``part``, filled up to ``batch`` rows)."""
    import numpy as np

    rows = answering.prompt_ids(part)
    for prompt, ids in zip(part, rows, strict=True):
        if len(ids) >= length:
            raise DataError(
                f'--data: the prompt "{prompt.shown[:40]}" is {len(ids)} '
                f"tokens in the chat format, which leaves no room to answer in {length}; give "
                f"--max-length above {len(ids)} (the whole sequence, prompt included)."
            )
    rows += [rows[0]] * (batch - len(rows))
    token_ids = np.full((batch, length), answering.tokenizing.pad, "int32")
    mask = np.zeros((batch, length), bool)
    for row, ids in enumerate(rows):
        token_ids[row, : len(ids)], mask[row, : len(ids)] = ids, True
    out = model.generate(
        {"token_ids": token_ids, "padding_mask": mask},
        stop_token_ids=answering.stop_ids,
        strip_prompt=True,
    )
    generated, kept = np.asarray(out["token_ids"]), np.asarray(out["padding_mask"])
    return [answering.text(generated[i][kept[i]]) for i in range(len(part))]


def for_run(trained: Any, found: prompts.PromptFiles | None) -> chat.ChatFormat | None:
    """The chat format ``trained`` answers in (None: it did not train on chat records), with
    ``--data`` checked against it (:func:`check`)."""
    form = None
    if preset_task.is_causal_tokens(trained.config):
        recorded = trained.derived.get("chat")  # config.yaml's, where the run recorded it
        schema = {"tokenized": {"chat": recorded}} if recorded else None
        form = trained_format(schema or trained_run.training_schema(trained.config))
    check(trained.run.path, form, found)
    return form


def answer_run(
    trained: Any,
    checkpoint: Any,
    runtime: Any,
    form: chat.ChatFormat,
    found: prompts.PromptFiles,
    output: str,
    kind: str,
    id_feature: str | None,
    sampling: generate.Sampling,
) -> dict[str, Any]:
    """:func:`complete` on the run's model, in batches of the global batch it trained with."""
    asked = read(found, id_feature)  # every line checked before the model is built
    if not asked:
        raise DataError(f"--data: {', '.join(found.files)} holds no prompt (every line is blank).")
    batch = trained_run.global_batch(trained.config, runtime.replicas)
    model = trained_run.build(trained, checkpoint, runtime)
    written = complete(
        model, form, asked, output, kind, sampling, id_feature, batch, trained.config.seed
    )
    return {**written, "global_batch_size": batch}
