"""Prompts as users keep them: ``tpurun predict RUN --data prompts.txt`` or ``prompts.jsonl``.

A run whose model takes one text (a causal LM's prompt or whole text, a text classifier's text)
reads its test set from a text file, one prompt a line (blank lines skipped), or a JSONL file, one
object a line holding the text under the key of the run's input feature (``prompt`` for a
prompt/response run, ``text`` for a whole-text run or a classifier; a run trained on a JSONL's
``review`` key reads ``review``). Told by content, not name (:mod:`tpurun.data.sniff`). Their
prompts are written as TFRecords into a temporary folder, the feature named as the run's, and
predicted from there: the rows are those the same prompts written by ``tpurun data write`` give.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpurun.config import DataConfig
from tpurun.data import files as datafiles
from tpurun.data import sniff
from tpurun.data.decode import record_key
from tpurun.data.native import framing
from tpurun.data.native.example import serialize
from tpurun.errors import DataError
from tpurun.storage import fileio

FAMILIES = ("text", "jsonl")


@dataclass(frozen=True)
class PromptFiles:
    """Prompt files found where ``--data`` names records."""

    files: list[str]
    kind: sniff.Kind


def find(patterns: str | Sequence[str]) -> PromptFiles | None:
    """The files ``patterns`` names, when the first is a text or JSONL file; None otherwise
    (TFRecords, which the usual checks then read, or another kind they refuse).

    Raises:
        DataError: no file matches.
    """
    files = sorted(datafiles.expand(patterns, None, "--data"))
    with fileio.open_binary(files[0]) as f:
        head = f.read(sniff.HEAD)
    kind = sniff.kind_of(head, files[0])
    return PromptFiles(files, kind) if kind is not None and kind.family in FAMILIES else None


def lines(path: str, kind: sniff.Kind) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a file, decompressed where it is gzip, without line ends."""
    with fileio.open_binary(path) as raw:
        stream = gzip.GzipFile(fileobj=raw) if kind.gzip else raw
        for number, line in enumerate(stream, 1):
            text = line.decode("utf-8", "replace").rstrip("\r\n").removeprefix("\ufeff")
            if text.strip():
                yield number, text


def _record(path: str, number: int, line: str, key: str, id_feature: str | None) -> dict:
    """One JSONL line as a record: its text, and its id where ``--id-feature`` names one."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise DataError(
            f"--data: {path}, line {number}: not a JSON object ({exc.msg}); a JSONL "
            "file of prompts holds one object a line."
        ) from None
    if not isinstance(row, dict) or not isinstance(row.get(key), str):
        found = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
        raise DataError(
            f'--data: {path}, line {number}: no "{key}" text, which this run reads (its '
            f"input feature); the line holds: {found or 'nothing'}. Write each prompt as "
            f'{{"{key}": "..."}}, or give a text file of one prompt a line.'
        )
    record: dict[str, Any] = {key: row[key]}
    if id_feature:
        value = row.get(id_feature)
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise DataError(
                f'--id-feature {id_feature}: {path}, line {number} holds no "'
                f'{id_feature}" string or whole number.'
            )
        record[id_feature] = value
    return record


def records(found: PromptFiles, key: str, id_feature: str | None) -> Iterator[dict]:
    """Each prompt as a record ``{key: text}`` (and its id), in file order.

    Raises:
        DataError: a JSONL line without the text, or --id-feature with a text file.
    """
    if id_feature and found.kind.family == "text":
        raise DataError(
            f"--id-feature {id_feature}: a text file of prompts holds only the "
            "prompts (the rows are numbered from 0); give a JSONL file with an "
            f'"{id_feature}" key beside each prompt for ids of your own.'
        )
    for path in found.files:
        for number, line in lines(path, found.kind):
            if found.kind.family == "text":
                yield {key: line}
            else:
                yield _record(path, number, line, key, id_feature)


@contextlib.contextmanager
def as_records(found: PromptFiles, key: str, id_feature: str | None) -> Iterator[str]:
    """The prompts written as TFRecords in a temporary folder, for as long as the ``with``
    lasts; yields their path.

    Raises:
        DataError: as :func:`records`, or files that hold no prompt.
    """
    folder = tempfile.mkdtemp(prefix="tpurun-prompts-")
    try:
        path = f"{folder}/prompts.tfrecord"
        written = framing.write_records(
            path, (serialize(r) for r in records(found, key, id_feature))
        )
        if not written:
            raise DataError(
                f"--data: {', '.join(found.files)} holds no prompt (every line is blank)."
            )
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def text_key(features: Mapping[str, Any], inputs: Any) -> str | None:
    """The record key of the run's one text input, or None where its inputs are not one text."""
    names = DataConfig.names(inputs)
    if len(names) != 1 or features[names[0]].type != "text":
        return None
    return record_key(names[0], features[names[0]])
