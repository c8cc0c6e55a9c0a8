"""JSONL sources for ``tpurun data write``: one JSON object per line, each key a feature.

The first line's keys are the features, in their order, and every line must have the same keys.
A key's values set its type, as a CSV column's do (:mod:`.columns`): strings are ``text`` (one
UTF-8 string a record, exactly as decoded from the JSON: unicode, quotes, line breaks and empty
strings kept), integers and ``true``/``false`` are ``int64``, numbers with a fraction ``float``. A
key holds one kind on every line: a number among strings is an error, not a silent conversion.
With ``label`` (``--label``), a label of strings becomes class indices with their names, as for a
CSV; ``text`` (``--text``) columns must hold a string on every line.

Two passes over the files, neither holding more than one chunk of lines: the first checks every
line and counts them, the second yields the records. Every problem names the file and line.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from tpurun.data.sources.base import Source
from tpurun.data.sources.columns import ClassValues, TableOptions
from tpurun.errors import DataError

SUFFIXES = (".jsonl", ".ndjson")
_EXAMPLE = '{"prompt": "Translate: bonjour", "response": "hello"}'
_INT64 = 2**63 - 1
_TYPES = {"text": {"type": "text"}, "int": {"type": "int64", "shape": []},
          "float": {"type": "float", "shape": []}}  # fmt: skip


def _kind(value: Any) -> str | None:
    """``text``, ``int`` or ``float``; None for what a feature cannot hold (null, lists, ...)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, bool) or (isinstance(value, int) and abs(value) <= _INT64):
        return "int"
    if isinstance(value, float) and math.isfinite(value):
        return "float"
    return None


def _described(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        shown = value if len(value) <= 30 else value[:30] + "..."
        return f"{json.dumps(shown, ensure_ascii=False)} (a string)"
    if isinstance(value, (list, dict)):
        return "a list" if isinstance(value, list) else "an object"
    if isinstance(value, int) and not isinstance(value, bool):
        return (
            f"{value} (an integer beyond int64)" if abs(value) > _INT64 else f"{value} (a number)"
        )
    return f"{json.dumps(value)} (a number)"


class JsonlSource(Source):
    """JSONL files (``.jsonl``, ``.ndjson``): one JSON object per line, blank lines skipped."""

    def __init__(self, path: str, files: list[str], options: TableOptions | None = None):
        self.path, self._files = path, files
        self._options = options = options or TableOptions()
        if options.pack or options.fill_missing is not None:
            raise DataError(
                f"{path}: --pack and --fill-missing apply to CSV files; a JSONL file's keys are "
                "written as they are. Leave them out."
            )
        self.nbytes = sum(os.path.getsize(f) for f in files)
        self.warnings = []
        self._keys: list[str] = []
        self._kinds: dict[str, str] = {}
        self._first = ""  # file:line of the first object, which sets the keys
        self._labels = ClassValues()
        self._scan()
        self._classes: dict[str, int] | None = None
        if options.label and self._kinds[options.label] == "text":
            self._classes = self._labels.classes(path, options.label)
        self.class_names = list(self._classes) if self._classes else None
        self.features = {
            key: dict(_TYPES["int" if self._classes and key == options.label else kind])
            for key, kind in self._kinds.items()
        }
        self.layout = {"label": options.label} if options.label else {}

    def _objects(self) -> Iterator[tuple[str, int, dict[str, Any]]]:
        """Each line's object, with its file and line number."""
        for file in self._files:
            with open(file, "rb") as f:
                for number, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
                    except UnicodeDecodeError as exc:
                        raise DataError(
                            f"{file}:{number}: not UTF-8 text (byte {exc.start + 1} of the line); "
                            "save the file as UTF-8."
                        ) from None
                    if not line.strip():
                        continue
                    try:
                        value = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise DataError(
                            f"{file}:{number}: not valid JSON ({exc.msg} at column {exc.colno}); "
                            f"each line of a JSONL file is one JSON object, such as {_EXAMPLE}."
                        ) from None
                    if not isinstance(value, dict) or not value:
                        found = "an empty object" if value == {} else _described(value)
                        raise DataError(
                            f"{file}:{number}: {found}, where a JSONL line is one JSON object of "
                            f"named values, such as {_EXAMPLE}."
                        )
                    yield file, number, value

    # ---------------------------------------------------------------------------- first pass
    def _scan(self) -> None:
        self.records = 0
        for file, number, obj in self._objects():
            if not self._keys:
                self._keys, self._first = list(obj), f"{file}:{number}"
                for name, option in (
                    (self._options.label, "--label"),
                    *((t, "--text") for t in self._options.text),
                ):
                    if name is not None:
                        self._find(name, option)
            self._check_keys(file, number, obj)
            for key, value in obj.items():
                self._see(f"{file}:{number}", key, value)
            self.records += 1
        if not self.records:
            raise DataError(
                f"{self.path}: no JSON object in it (the file is empty); expected one JSON object "
                f"per line, such as {_EXAMPLE}."
            )

    def _find(self, name: str, option: str) -> None:
        if name not in self._keys:
            close = difflib.get_close_matches(name, self._keys, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"its keys are {self._keys}."
            raise DataError(
                f"{self._first}: {option} names key '{name}', which the first line lacks; {hint}"
            )

    def _check_keys(self, file: str, number: int, obj: dict[str, Any]) -> None:
        missing = [key for key in self._keys if key not in obj]
        extra = [key for key in obj if key not in self._keys]
        if missing or extra:
            found = f"no '{missing[0]}' key" if missing else f"a key '{extra[0]}'"
            raise DataError(
                f"{file}:{number}: {found}, where every line has the keys of the first "
                f"({self._first}): {', '.join(self._keys)}. Give each line the same keys."
            )

    def _see(self, where: str, key: str, value: Any) -> None:
        kind = _kind(value)
        if kind is None:
            empty = ' (write "" for an empty text)' if self._kinds.get(key) == "text" else ""
            raise DataError(
                f"{where}: '{key}' is {_described(value)}; each value is a string (text) or a "
                f"number{empty}."
            )
        if kind != "text" and key in self._options.text:
            raise DataError(
                f"{where}: '{key}' is {_described(value)}, and --text {key} needs a string on "
                f'every line; quote it ("{value}").'
            )
        seen = self._kinds.setdefault(key, kind)
        if seen != kind and "text" in (seen, kind):
            which = "text (strings)" if seen == "text" else "numbers"
            raise DataError(
                f"{where}: '{key}' is {_described(value)}, but it holds {which} from the first "
                f"line ({self._first}); a key holds one kind on every line. Quote numbers meant "
                "as text."
            )
        if seen != kind:
            self._kinds[key] = "float"  # integers and fractions together are floats
        if kind == "text":
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(
                    f"{where}: '{key}' holds an unpaired surrogate escape (such as \\ud800), "
                    "which is not a character UTF-8 can store; fix the string."
                ) from None
            if key == self._options.label:
                self._labels.add(value)

    # ------------------------------------------------------------------------------ records
    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for file, number, obj in self._objects():
            if set(obj) != set(self._keys):
                raise DataError(
                    f"{file}:{number}: its keys differ from the first pass's; did the file change "
                    "during the write? Write it again."
                )
            rows.append(obj)
            if len(rows) == size:
                yield self._convert(rows)
                rows = []
        if rows:
            yield self._convert(rows)

    def _convert(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        chunk: dict[str, Any] = {}
        for key, kind in self._kinds.items():
            values = [row[key] for row in rows]
            if self._classes is not None and key == self._options.label:
                chunk[key] = np.array([self._classes[v] for v in values], np.int64)
            elif kind == "text":
                chunk[key] = [v.encode("utf-8") for v in values]
            else:
                chunk[key] = np.array(values, np.int64 if kind == "int" else np.float64)
        return chunk
