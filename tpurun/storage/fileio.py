"""File operations for local paths and remote ones (``gs://``, ``ram://``), in one place.

Everything tpurun reads or writes in a run directory, a data folder or a cache goes through here, so
that a path on a bucket works wherever a local one does. Local paths use the OS directly; remote
paths use fsspec: ``gs://`` through gcsfs, ``ram://`` in this process's memory
(:mod:`tpurun.storage.remote`). Neither imports TensorFlow, installed or not: its own GCS client
serves only ``tf.data``, when a run reads gs:// data with the ``tf_data`` reader.

Object stores cannot append or rename: an atomic write of a remote file is a local write, then one
upload (an object appears whole or not at all), and :func:`rename` is a copy plus a delete.

A remote operation that fails raises :class:`StorageError`, which says which bucket, why (not
reachable, no permission, no such bucket) and what to do; a missing file still raises
``FileNotFoundError`` for the reads that expect one. How long a request is retried before it gives
up is bounded by :data:`tpurun.frameworks.GCS_DEFAULTS` (see :mod:`tpurun.storage.remote`).
"""

from __future__ import annotations

import contextlib
import glob as globlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from tpurun.storage import remote, space
from tpurun.storage.remote import (  # noqa: F401 (fileio is where the rest of tpurun finds them)
    StorageError,
    as_storage_error,
    bucket_of,
    recently_unreachable,
    short_detail,
    storage_error,
    training_stopped,
)


def user_cache() -> str:
    """The folder tpurun keeps things in between runs, for this user: ``$TPURUN_CACHE_DIR``, else
    ``~/.cache/tpurun`` (record counts, JAX's compiled programs)."""
    return os.environ.get("TPURUN_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tpurun"
    )


def is_remote(path: str) -> bool:
    return "://" in str(path)


@contextlib.contextmanager
def _remote(path: str, doing: str, *, missing_is_error: bool = False) -> Iterator[None]:
    """Turn a failed remote operation on ``path`` into :class:`StorageError`; a missing file
    (``FileNotFoundError``) passes through unless ``missing_is_error`` (writes: only a missing
    bucket makes one), and so does ``FileExistsError`` (a create-only write's answer)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as exc:
        kind = remote.error_kind(exc)
        if kind in (None, "exists") or (kind == "missing" and not missing_is_error):
            raise
        raise storage_error(path, doing, exc) from None


def _store(path: str) -> tuple[remote.Store, str]:
    """The store of a remote path, and the path as its file system takes it."""
    with _remote(path, "opening its store"):
        found = remote.store(path)
    return found, found.inner(path)


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
    if not is_remote(path):
        return os.path.exists(path)
    found, inner = _store(path)
    with _remote(path, "checking whether it exists"):
        return bool(found.fs.exists(inner))


def isdir(path: str) -> bool:
    """Whether ``path`` is a folder; in a store, a prefix that objects are named under."""
    if not is_remote(path):
        return os.path.isdir(path)
    found, inner = _store(path)
    with _remote(path, "checking whether it is a folder"):
        try:  # (gcsfs's own isdir answers False for any failure, an outage included)
            return found.fs.info(inner)["type"] == "directory"
        except FileNotFoundError:
            return False


def makedirs(path: str) -> None:
    """Make a folder and its parents. A bucket has no folders: there, check that the bucket
    exists (one listing), so that a run into a missing bucket fails before it starts."""
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)
        return
    found, inner = _store(path)
    with _remote(path, "creating it", missing_is_error=True):
        if found.scheme == "gs":
            bucket, _, key = inner.partition("/")
            found.fs.call("GET", "b/{}/o", bucket, prefix=key, maxResults=1, json_out=True)
        else:
            found.fs.makedirs(inner, exist_ok=True)


def glob(pattern: str, files_only: bool = False) -> list[str]:
    """Sorted matches of a glob (remote globs are expanded by the store: one listing);
    ``files_only`` leaves folders out (told apart by the same listing)."""
    if not is_remote(pattern):
        matched = sorted(globlib.glob(pattern))
        return [m for m in matched if not os.path.isdir(m)] if files_only else matched
    found, inner = _store(pattern)
    with _remote(pattern, "listing it", missing_is_error=True):
        listed = found.fs.glob(inner, detail=True)
    return sorted(
        found.outer(name)
        for name, info in listed.items()
        if not (files_only and info["type"] == "directory")
    )


def escape(path: str) -> str:
    """A path with its glob characters escaped, to glob beneath it."""
    return globlib.escape(str(path))


def _info(path: str) -> dict[str, Any]:
    found, inner = _store(path)
    with _remote(path, "reading its metadata"):
        return found.fs.info(inner)


def mtime(path: str) -> float:
    if not is_remote(path):
        return os.path.getmtime(path)
    return remote.modified(_info(path))


def size(path: str) -> int:
    if not is_remote(path):
        return os.path.getsize(path)
    return int(_info(path)["size"])


def remove(path: str, missing_ok: bool = True) -> None:
    try:
        if is_remote(path):
            found, inner = _store(path)
            with _remote(path, "deleting it"):
                found.fs.rm_file(inner)
        else:
            os.remove(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


def remove_tree(path: str) -> None:
    """Remove a folder and everything in it (nothing happens when it is gone already)."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    found, inner = _store(path)
    with contextlib.suppress(FileNotFoundError), _remote(path, "deleting it"):
        found.fs.rm(inner, recursive=True)


def rename(src: str, dst: str) -> None:
    """Move a file or folder; remote paths are copied, then deleted, object by object (what a
    store's rename is: a folder's move is not atomic)."""
    if not (is_remote(src) or is_remote(dst)):
        os.replace(src, dst)
        return
    if not (is_remote(src) and is_remote(dst)):
        copy(src, dst)
        (remove if is_remote(src) else os.remove)(src)
        return
    found, inner = _store(src)
    with _remote(src, f"moving it to {dst}"):
        if found.fs.info(inner)["type"] == "directory":
            # (A folder marker, "name/", that TensorFlow's client made stays: gcsfs cannot name
            # it, and it holds nothing.)
            moves = [(found.outer(f), join(dst, found.outer(f)[len(src.rstrip("/")) + 1 :]))
                     for f in found.fs.find(inner) if not f.endswith("/")]  # fmt: skip
        else:
            moves = [(src, dst)]
    for one, other in moves:
        copy(one, other)
        remove(one)


def copy(src: str, dst: str) -> None:
    """Copy a file: within a store, by the store (no download); else streamed."""
    if not (is_remote(src) or is_remote(dst)):
        shutil.copyfile(src, dst)
        return
    where, writing = (dst, not is_remote(src)) if is_remote(dst) else (src, False)
    with _remote(where, f"copying {src} to {dst}", missing_is_error=writing):
        if is_remote(src) and is_remote(dst) and remote.store(src) is remote.store(dst):
            found = remote.store(src)
            found.fs.cp_file(found.inner(src), found.inner(dst))
        elif not is_remote(src):
            found = remote.store(dst)
            found.fs.put_file(src, found.inner(dst))
        else:
            with open_binary(src) as source, open_binary(dst, "wb") as target:
                shutil.copyfileobj(source, target, remote.BLOCK_SIZE)


class _RemoteFile:
    """A store's file object whose failures, when it reads, writes or closes, are
    :class:`StorageError` (a missing file's stays ``FileNotFoundError``)."""

    def __init__(self, file: Any, path: str, writing: bool):
        self._file, self.path, self._writing = file, path, writing
        self._doing = "writing it" if writing else "reading it"

    def read(self, size: int = -1) -> bytes:
        with _remote(self.path, self._doing):
            return self._file.read(size)

    def readinto(self, buffer: Any) -> int:
        with _remote(self.path, self._doing):
            return self._file.readinto(buffer)

    def write(self, data: Any) -> int:
        with _remote(self.path, self._doing, missing_is_error=True):
            return self._file.write(data)

    def flush(self) -> None:
        with _remote(self.path, self._doing, missing_is_error=self._writing):
            self._file.flush()

    def close(self) -> None:
        with _remote(self.path, self._doing, missing_is_error=self._writing):
            self._file.close()

    def __enter__(self) -> _RemoteFile:
        return self

    def __exit__(self, failed: type[BaseException] | None, *exc_info: Any) -> None:
        if failed is not None and self._writing and hasattr(self._file, "discard"):
            # A write that failed leaves no object, as a kill would: the upload is cancelled
            # and the file marked closed, so that closing it uploads nothing.
            with contextlib.suppress(Exception):
                self._file.discard()
            with contextlib.suppress(AttributeError):  # (a memory file cannot be marked)
                self._file.closed = True
            return
        self.close()

    def __getattr__(self, name: str) -> Any:  # seek, tell, closed, readable, ...
        return getattr(self._file, name)


def open_binary(path: str, mode: str = "rb"):
    """A binary file object for streaming reads (``rb``) or writes (``wb``), local or remote.

    A remote file reads ahead and uploads in blocks of :data:`tpurun.storage.remote.BLOCK_SIZE`;
    a file written to a store appears there whole, when it is closed.
    """
    if not is_remote(path):
        return open(path, mode)  # noqa: SIM115 (the caller closes it)
    writing = "r" not in mode
    found, inner = _store(path)
    with _remote(path, "writing it" if writing else "reading it", missing_is_error=writing):
        file = found.fs.open(inner, mode, block_size=remote.BLOCK_SIZE)
    return _RemoteFile(file, path, writing)


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local path to read ``path`` from, for a library that opens files by name (Keras' loads,
    h5py): ``path`` itself when it is local, else a copy under its own name in a private temporary
    folder, removed after.

    Raises:
        StorageError: a remote ``path`` cannot be read (a missing file: ``FileNotFoundError``).
    """
    if not is_remote(path):
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="tpurun-") as tmp:
        local = os.path.join(tmp, basename(path))
        copy(path, local)
        yield local


def read_bytes(path: str) -> bytes:
    if is_remote(path):
        found, inner = _store(path)
        with _remote(path, "reading it"):
            return found.fs.cat_file(inner)
    with open(path, "rb") as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode("utf-8")


def read_text_or_none(path: str) -> str | None:
    """The file's text, or None when it does not exist (a path under a file does not either)."""
    try:
        return read_text(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_json(path: str) -> dict | None:
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object.

    Raises:
        StorageError: a remote ``path`` cannot be read (not reachable, no permission).
    """
    try:
        data = json.loads(read_text_or_none(path) or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def create_exclusively(path: str, data: bytes) -> None:
    """Write a new file, only if there is none: in a bucket, in one request with the create-only
    precondition (``ifGenerationMatch=0``), so that of two writers, exactly one succeeds.

    Raises:
        FileExistsError: the file exists (another writer made it first).
    """
    if not is_remote(path):
        with open(path, "xb") as f:
            f.write(data)
        return
    found, inner = _store(path)
    with _remote(path, "creating it", missing_is_error=True):
        found.fs.pipe_file(inner, data, mode="create")


def save_atomically(path: str, write: Callable[[str], Any]) -> None:
    """Call ``write(tmp_path)`` and move the result to ``path`` only once it is complete.

    A kill at any instant leaves either the old file or the new one, never half of one. A remote
    file is staged in a private folder of the system's temporary directory (``tempfile``), then
    uploaded in one request: the store makes the object visible only once the upload is complete,
    and a store has no rename to commit with. The staging folder is removed right after (a
    SIGKILL between the two leaves it for the OS's temp cleaning).
    """
    name = basename(path)
    if is_remote(path):
        found, inner = _store(path)
        with tempfile.TemporaryDirectory(prefix="tpurun-") as tmp:
            local = os.path.join(tmp, name)
            write(local)
            with _remote(path, "uploading it", missing_is_error=True):
                found.fs.put_file(local, inner)
        return
    folder = os.path.dirname(path) or "."
    tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")  # same suffix: Keras checks it
    space.check_room(path)  # h5py crashes the process when the disk fills under it
    try:
        write(tmp)
        os.replace(tmp, path)
    except Exception as exc:
        if not space.is_disk_full(exc):
            raise
        partial = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        raise space.disk_full(path, partial) from None
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
