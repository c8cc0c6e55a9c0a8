"""Small file helpers: atomic writes that work for local paths and remote ones (gs://, ram://)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def is_remote(path: str) -> bool:
    return "://" in path


def save_atomically(path: str, write: Callable[[str], Any]) -> None:
    """Call ``write(tmp_path)`` and move the result to ``path`` only once it is complete.

    A kill at any instant leaves either the old file or the new one, never half of one. Remote
    paths are written locally first, then copied (object stores have no rename).
    """
    name = os.path.basename(path)
    if is_remote(path):
        import tensorflow as tf

        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, name)
            write(local)
            tf.io.gfile.copy(local, path, overwrite=True)
        return
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")  # same suffix: Keras checks it
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path: str | Path, data: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")

    save_atomically(str(path), write)


def read_json(path: str | Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
