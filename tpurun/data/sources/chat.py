"""Conversations for ``tpurun data write``: JSONL lines of ``{"messages": [{"role", "content"}]}``.

A JSONL file whose first object has the one key ``messages`` is chat data. Each line is checked
as it is read (roles ``system``, ``user``, ``assistant``; ``content`` a string; at least one
assistant turn, the one thing the loss counts; a system turn only first) and every problem names
the file and line. The records hold one text feature, ``messages``: the turns as compact JSON.
Only a preset's chat format makes tokens of them, so chat data is written with ``--tokenize
PRESET`` (:mod:`tpurun.hub.chat`); the write refuses it without.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from tpurun.data.sources.base import Source
from tpurun.errors import DataError

ROLES = ("system", "user", "assistant")
#: The schema file's layout entry that marks chat records.
CHAT = "chat"
_EXAMPLE = (
    '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}'
)


def first_object(files: list[str]) -> Any:
    """The first non-blank line's JSON value (None where it is not JSON: the JSONL source then
    says what is wrong with it)."""
    for file in files:
        with open(file, "rb") as f:
            for raw in f:
                if raw.strip():
                    try:
                        return json.loads(raw.decode("utf-8-sig"))
                    except (UnicodeDecodeError, json.JSONDecodeError):
                        return None
    return None


def is_chat(files: list[str]) -> bool:
    """Whether JSONL ``files`` are chat data: a first object of the one key ``messages``."""
    found = first_object(files)
    return isinstance(found, dict) and list(found) == ["messages"]


def problem(turns: Any) -> str | None:
    """What is wrong with one line's ``messages`` value, in a phrase; None when it is a
    conversation to learn from."""
    if not isinstance(turns, list) or not turns:
        return "'messages' is not a list of turns" if turns != [] else "'messages' is empty"
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, dict) or set(turn) != {"role", "content"}:
            keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            return f"turn {i} is {keys}, not an object of 'role' and 'content'"
        role, content = turn["role"], turn["content"]
        if role not in ROLES:
            return f"turn {i} has role {json.dumps(role)}, not one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            return f"turn {i}'s content is {json.dumps(content)}, not a string"
        if role == "system" and i != 1:
            return f"turn {i} is a system turn, which only the first turn may be"
    if not any(turn["role"] == "assistant" for turn in turns):
        return "no assistant turn (the loss counts only the assistant's tokens)"
    return None


class ChatSource(Source):
    """Chat JSONL files: one conversation a line, written as the text feature ``messages``."""

    def __init__(self, path: str, files: list[str]):
        self.path, self._files = path, files
        self.nbytes = sum(os.path.getsize(f) for f in files)
        self.features = {"messages": {"type": "text"}}
        self.layout = {CHAT: True}
        self.warnings = []
        self.records = sum(1 for _ in self._conversations())
        if not self.records:
            raise DataError(f"{path}: no conversation in it; expected lines such as {_EXAMPLE}.")

    def _conversations(self) -> Iterator[list[dict[str, str]]]:
        for file in self._files:
            with open(file, "rb") as f:
                for number, raw in enumerate(f, 1):
                    if raw.strip():
                        yield _turns(f"{file}:{number}", raw, number == 1)

    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        rows: list[bytes] = []
        for turns in self._conversations():
            rows.append(json.dumps(turns, ensure_ascii=False).encode("utf-8"))
            if len(rows) == size:
                yield {"messages": rows}
                rows = []
        if rows:
            yield {"messages": rows}


def _turns(where: str, raw: bytes, first: bool) -> list[dict[str, str]]:
    """One line's turns, or a DataError naming ``where`` and what is wrong."""
    try:
        value = json.loads(raw.decode("utf-8-sig" if first else "utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{where}: not UTF-8 text; save the file as UTF-8.") from None
    except json.JSONDecodeError as exc:
        raise DataError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line of a chat file "
            f"is one conversation, such as {_EXAMPLE}."
        ) from None
    if not isinstance(value, dict) or list(value) != ["messages"]:
        found = sorted(value) if isinstance(value, dict) else type(value).__name__
        wrong = f"has the keys {found}" if isinstance(value, dict) else f"is a JSON {found}"
        raise DataError(
            f"{where}: {wrong}, where each line of a chat file (its first line has 'messages') "
            f"is one object of the key 'messages', such as {_EXAMPLE}."
        )
    wrong = problem(value["messages"])
    if wrong:
        raise DataError(
            f'{where}: {wrong}. Each turn is {{"role": "system" | "user" | "assistant", '
            f'"content": "..."}}, with at least one assistant turn; fix or remove the line.'
        )
    return value["messages"]
