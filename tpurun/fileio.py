"""File operations for local paths and remote ones (``gs://``, ``ram://``), in one place.

Everything tpurun reads or writes in a run directory, a data folder or a cache goes through here, so
that a path on a bucket works wherever a local one does. Local paths use the OS directly (fast, and
no TensorFlow import on the paths that must answer instantly); remote paths use ``tf.io.gfile``,
TensorFlow's own GCS client, which the input pipeline uses anyway.

Object stores cannot append or rename: an atomic write of a remote file is a local write, then one
upload (an object appears whole or not at all), and :func:`rename` is a copy plus a delete.
"""

from __future__ import annotations

import glob as globlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any


def is_remote(path: str) -> bool:
    return "://" in str(path)


def _gfile():
    from tpurun.process import import_tensorflow

    return import_tensorflow().io.gfile


def join(folder: str, *names: str) -> str:
    """``os.path.join`` that keeps ``gs://`` prefixes intact (they use ``/`` on every OS)."""
    if is_remote(folder):
        return "/".join([str(folder).rstrip("/"), *names])
    return os.path.join(str(folder), *names)


def basename(path: str) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1] if is_remote(path) else os.path.basename(path)


def dirname(path: str) -> str:
    return str(path).rsplit("/", 1)[0] if is_remote(path) else os.path.dirname(str(path))


def exists(path: str) -> bool:
    return _gfile().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return _gfile().isdir(path) if is_remote(path) else os.path.isdir(path)


def makedirs(path: str) -> None:
    if is_remote(path):
        _gfile().makedirs(path)
    else:
        os.makedirs(path, exist_ok=True)


def glob(pattern: str) -> list[str]:
    """Sorted matches of a glob (remote globs are expanded by the store)."""
    return sorted(_gfile().glob(pattern) if is_remote(pattern) else globlib.glob(pattern))


def escape(path: str) -> str:
    """A path with its glob characters escaped, to glob beneath it."""
    return globlib.escape(str(path))


def mtime(path: str) -> float:
    if is_remote(path):
        return _gfile().stat(path).mtime_nsec / 1e9
    return os.path.getmtime(path)


def size(path: str) -> int:
    return _gfile().stat(path).length if is_remote(path) else os.path.getsize(path)


def remove(path: str, missing_ok: bool = True) -> None:
    try:
        if is_remote(path):
            _gfile().remove(path)
        else:
            os.remove(path)
    except (FileNotFoundError, _not_found()):
        if not missing_ok:
            raise


def _not_found() -> type[BaseException]:
    """The exception a missing remote file raises (TF's NotFoundError), without importing TF for
    local paths."""
    import sys

    tf = sys.modules.get("tensorflow")
    return tf.errors.NotFoundError if tf is not None else FileNotFoundError


def rename(src: str, dst: str) -> None:
    """Move a file or folder; remote paths are copied, then deleted (what a store's rename is)."""
    if is_remote(src) or is_remote(dst):
        _gfile().rename(src, dst, overwrite=True)
    else:
        os.replace(src, dst)


def copy(src: str, dst: str) -> None:
    if is_remote(src) or is_remote(dst):
        _gfile().copy(src, dst, overwrite=True)
    else:
        shutil.copyfile(src, dst)


def read_bytes(path: str) -> bytes:
    if is_remote(path):
        with _gfile().GFile(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def read_text_or_none(path: str) -> str | None:
    """The file's text, or None when it does not exist."""
    try:
        return read_text(path)
    except (FileNotFoundError, _not_found()):
        return None


def read_json(path: str) -> dict | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(read_text_or_none(path) or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def save_atomically(path: str, write: Callable[[str], Any]) -> None:
    """Call ``write(tmp_path)`` and move the result to ``path`` only once it is complete.

    A kill at any instant leaves either the old file or the new one, never half of one. A remote
    file is written to a local temporary folder, then uploaded in one request: the store makes it
    visible only once the upload is complete.
    """
    name = basename(path)
    if is_remote(path):
        with tempfile.TemporaryDirectory(prefix="tpurun-") as tmp:
            local = os.path.join(tmp, name)
            write(local)
            _gfile().copy(local, path, overwrite=True)
        return
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")  # same suffix: Keras checks it
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    save_atomically(path, write)


def write_json(path: str, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, default=str) + "\n")


def clear_tf_cache_leftovers(prefix: str) -> None:
    """Make the folder of a ``tf.data`` file cache, and clear what a killed run left in it.

    A run killed while TF was writing the cache leaves a lockfile, and TF then refuses the cache
    ("a concurrent caching iterator running"); the cache belongs to one run at a time.
    """
    makedirs(dirname(prefix) or ".")
    for leftover in glob(f"{escape(prefix)}_*.lockfile") + glob(f"{escape(prefix)}*.tempstate*"):
        remove(leftover)
