"""Files of a run directory that are present but unreadable: told apart from absent ones.

A run directory's own files (``summary.json``, ``log.csv``) are rewritten whole and atomically,
so a kill never leaves half of one; what damages them is a bad copy, a full disk on another
tool's write, a bit flip or a hand edit. Such a file is never read as "no file": it is named,
a copy is kept beside it (``<name>.damaged``), and what can be saved from it is saved.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from tpurun.storage import fileio

SUFFIX = ".damaged"


def read_json(path: str) -> tuple[dict | None, str | None]:
    """A JSON object file's data (None when the file does not exist), and what is wrong with it
    when it is there but unreadable (then the data is None too)."""
    try:
        text = fileio.read_text_or_none(path)
    except UnicodeDecodeError:
        return None, "not text (binary garbage)"
    if text is None:
        return None, None
    try:
        data = json.loads(text)
    except ValueError:
        return None, "not valid JSON (truncated, or edited)"
    if not isinstance(data, dict):
        return None, "not a JSON object"
    return data, None


def log_rows(path: str) -> tuple[list[list[str]], str | None]:
    """A CSV log's rows (the header first), and what is wrong with it: the rows up to the first
    damaged one are returned. A log is a header starting with ``epoch``, then one row per epoch
    from 0, each as long as the header."""
    try:
        text = fileio.read_text_or_none(path) or ""
    except UnicodeDecodeError:
        return [], "not text (binary garbage)"
    try:
        rows = [row for row in csv.reader(io.StringIO(text)) if row]
    except csv.Error as exc:
        return [], f"not CSV ({exc})"
    if not rows:
        return [], None
    header = rows[0]
    if header[0] != "epoch":
        return [], f"its first row is not a header starting with 'epoch' ({_short(header)})"
    for i, row in enumerate(rows[1:]):
        if len(row) != len(header) or row[0] != str(i):
            return rows[: i + 1], f"row {i + 2} is damaged ({_short(row)})"
    return rows, None


def salvage_json(path: str, keep: bool = True) -> tuple[dict | None, str | None]:
    """A JSON object file's data, or, when it is damaged, None and one line saying so (``keep``:
    a copy of it is kept first)."""
    data, wrong = read_json(path)
    if wrong is None:
        return data, None
    copied = f"; it is copied to {keep_copy(path)}" if keep else ""
    return None, f"{path} is damaged: {wrong}{copied}."


def salvage_log(path: str, keep: bool = True) -> tuple[list[list[str]], str | None]:
    """A CSV log's good rows, and, when it is damaged, one line saying so (``keep``: a copy of
    the whole file is kept first)."""
    rows, wrong = log_rows(path)
    if wrong is None:
        return rows, None
    copied = f"; the whole file is copied to {keep_copy(path)}" if keep else ""
    return rows, (
        f"{path} is damaged: {wrong}. Its {max(0, len(rows) - 1)} good row(s) are kept and the "
        f"log goes on from them{copied}."
    )


def keep_copy(path: str) -> str:
    """Copy a damaged file to ``<path>.damaged`` (replacing an older copy); returns the copy."""
    copy = path + SUFFIX
    fileio.copy(path, copy)
    return copy


def _short(row: Any) -> str:
    text = ",".join(row)
    return text if len(text) <= 40 else text[:37] + "..."
