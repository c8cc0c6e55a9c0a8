"""``tpurun predict`` on a causal LM: the completion of every prompt of a test set, in file order, to
a CSV or JSONL file (``id``, ``prompt``, ``completion``).

The prompts are the run's ``data.inputs`` text feature (the prompt of prompt/response records, or
the one text of a whole-text run, which the completion then continues). They go to KerasHub's
``CausalLM.generate`` a batch at a time, the last batch filled up with copies of the first prompt
(static shapes: one compiled generate step) whose rows are dropped.

``--max-length`` is what ``generate(max_length=...)`` means: the whole sequence in tokens, the
start token and the prompt included (a longer prompt is cut to it); the completion stops there or
at the end token. By default the run's ``model.sequence_length``.
"""

from __future__ import annotations

import csv
import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from tpurun import frameworks
from tpurun.data import decode as feat
from tpurun.data.native import example
from tpurun.errors import DataError, ModelError, TpurunError

OUTPUTS = (".csv", ".jsonl")
SAMPLERS = ("greedy", "top_k")
COLUMNS = ["id", "prompt", "completion"]


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen (``--sampler``), and how long a sequence grows."""

    sampler: str = "greedy"
    top_k: int | None = None
    seed: int | None = None
    max_length: int | None = None


def check_sampling(
    sampler: str = "greedy",
    top_k: int | None = None,
    seed: int | None = None,
    max_length: int | None = None,
) -> Sampling:
    """The options checked against each other, before any work is done.

    Raises:
        TpurunError: an unknown sampler, top_k without ``--top-k`` (or the other way round), a
            seed for greedy decoding, a length under 2.
    """
    if sampler not in SAMPLERS:
        raise TpurunError(
            f"--sampler {sampler}: expected greedy (the likeliest token each step, "
            "the default) or top_k (drawn from the K likeliest, with --top-k K)."
        )
    if sampler == "top_k" and top_k is None:
        raise TpurunError(
            "--sampler top_k needs --top-k K: how many of the likeliest tokens each step draws "
            "from (e.g. --top-k 40); --seed S makes the draws repeatable."
        )
    if sampler == "greedy" and (top_k is not None or seed is not None):
        given = "--top-k" if top_k is not None else "--seed"
        raise TpurunError(
            f"{given} applies to --sampler top_k; greedy decoding (the default) "
            "draws nothing. Add --sampler top_k, or leave it out."
        )
    if top_k is not None and top_k < 1:
        raise TpurunError(f"--top-k {top_k}: expected a number of tokens, 1 or more.")
    if max_length is not None and max_length < 2:
        raise TpurunError(
            f"--max-length {max_length}: the whole sequence in tokens (start token and prompt "
            "included), so at least 2."
        )
    return Sampling(sampler, top_k, seed, max_length)


def suffix_of(path: str, kinds: tuple[str, ...], what: str) -> str:
    """The one of ``kinds`` that ``path`` ends with.

    Raises:
        TpurunError: none: ``--output PATH: what``.
    """
    for kind in kinds:
        if str(path).lower().endswith(kind):
            return kind
    raise TpurunError(f"--output {path}: {what}")


def output_kind(path: str) -> str:
    """``.csv`` or ``.jsonl``, from the output's name."""
    return suffix_of(
        path,
        OUTPUTS,
        "a causal LM's completions go to a .csv or a .jsonl file "
        "(one row per prompt: id, prompt, completion).",
    )


def check_prompts(first: bytes, filename: str, features: Any) -> None:
    """The first record (``first``, of ``filename``) holds the prompt feature (``features``:
    the run's one text input, by name).

    Raises:
        DataError: naming the file, the feature and what to write instead.
    """
    [(name, feature)] = features.items()
    key = feat.record_key(name, feature)
    stored = example.parse(first).features.feature
    if key not in stored:
        raise DataError(
            f"--data: {filename} holds no '{key}' feature, the prompt a completion continues "
            f"(the run's data.inputs), only: {', '.join(sorted(stored)) or 'nothing'}. Give the "
            f'prompts as a text file (one a line) or a JSONL file of {{"{key}": "..."}} lines, '
            f"or write them as the training data was: `tpurun data write PROMPTS.jsonl "
            f'OUT_PREFIX` from JSONL lines with a "{key}" key (a response is not needed).'
        )


def sampler_for(sampling: Sampling) -> Any:
    keras_hub = frameworks.keras_hub()
    if sampling.sampler == "greedy":
        return keras_hub.samplers.GreedySampler()
    return keras_hub.samplers.TopKSampler(k=sampling.top_k, seed=sampling.seed)


class Completions:
    """Rows in, a complete file out: written beside the output and renamed over it at the end,
    so a failed run leaves no half-written file."""

    def __init__(self, path: str, kind: str):
        self.path, self.kind, self.written = path, kind, 0
        folder, name = os.path.split(path)
        self.tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")

    def __enter__(self) -> Completions:
        self.file = open(self.tmp, "w", newline="", encoding="utf-8")
        if self.kind == ".csv":
            self.csv = csv.writer(self.file)
            self.csv.writerow(COLUMNS)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        self.file.close()
        if kind is None:
            os.replace(self.tmp, self.path)
        elif os.path.exists(self.tmp):
            os.remove(self.tmp)

    def write(self, ids: list, prompts: list[str], completions: list[str]) -> None:
        for row in zip(ids, prompts, completions, strict=True):
            if self.kind == ".csv":
                self.csv.writerow(row)
            else:
                self.file.write(
                    json.dumps(dict(zip(COLUMNS, row, strict=True)), ensure_ascii=False) + "\n"
                )
        self.written += len(ids)


def text_of(value: Any) -> str:
    """A decoded string, from the bytes tf.data or a detokenizer gives (or any value)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def complete(
    model: Any,
    dataset: Any,
    records: int,
    output: str,
    kind: str,
    sampling: Sampling,
    id_feature: str | None,
    seed: int,
) -> dict[str, Any]:
    """Generate a completion for every prompt of ``dataset`` (``(prompts, extra)`` batches in
    file order, the last padded) and write the rows to ``output``. ``seed``: top-k's where
    ``--seed`` is not given (the run's)."""
    import numpy as np

    if not isinstance(model, frameworks.keras_hub().models.CausalLM):
        raise ModelError(
            f"{type(model).__name__} is not a causal LM (a KerasHub CausalLM): it "
            "does not generate text. Leave the generation options out."
        )
    if sampling.sampler == "top_k" and sampling.seed is None:
        sampling = replace(sampling, seed=seed)
    model.compile(sampler=sampler_for(sampling))
    max_length = sampling.max_length or model.preprocessor.sequence_length
    remaining = records
    with Completions(output, kind) as writer:
        for prompts, extra in dataset.as_numpy_iterator():
            keep = min(remaining, len(prompts))
            texts = model.generate(prompts, max_length=max_length, strip_prompt=True)
            prompt_texts = [text_of(p) for p in np.asarray(prompts)[:keep]]
            if id_feature:
                ids = [text_of(v) if isinstance(v, bytes) else v.item()
                       for v in np.asarray(extra[id_feature]).reshape(-1)[:keep]]  # fmt: skip
            else:
                ids = list(range(writer.written, writer.written + keep))
            writer.write(ids, prompt_texts, [text_of(t) for t in list(texts)[:keep]])
            remaining -= keep
    return {
        "rows": writer.written,
        "columns": COLUMNS,
        "format": kind.lstrip("."),
        "sampling": {**asdict(sampling), "max_length": max_length},
    }
