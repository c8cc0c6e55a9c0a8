"""File operations for local paths and remote ones (``gs://``, ``ram://``), in one place.

Everything tpurun reads or writes in a run directory, a data folder or a cache goes through here, so
that a path on a bucket works wherever a local one does. Local paths use the OS directly (fast, and
no TensorFlow import on the paths that must answer instantly); remote paths use ``tf.io.gfile``,
TensorFlow's own GCS client, which the input pipeline uses anyway.

Object stores cannot append or rename: an atomic write of a remote file is a local write, then one
upload (an object appears whole or not at all), and :func:`rename` is a copy plus a delete.

A remote operation that fails raises :class:`StorageError`, which says which bucket, why (not
reachable, no permission, no such bucket) and what to do; a missing file still raises
``NotFoundError`` for the reads that expect one. How long TF's GCS client retries before it gives
up is bounded by :data:`tpurun.frameworks.GCS_DEFAULTS`, set with TensorFlow's import.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from tpurun import frameworks
from tpurun.errors import TpurunError
from tpurun.storage import space


class StorageError(TpurunError):
    """A bucket could not be read or written: unreachable, no permission, or no such bucket."""


#: How long after storage was last found unreachable (TF's retries exhausted) the writes that are
#: only worth a try (a failed run's last summary, releasing its lock) are skipped: each would
#: spend the whole retry time again, and a run stopped by an outage should end promptly.
UNREACHABLE_MEMORY_SECONDS = 30.0
_unreachable_at: float | None = None


def recently_unreachable() -> bool:
    """Whether a gs:// request of this process gave up on an unreachable store just now."""
    return _unreachable_at is not None and time.monotonic() - _unreachable_at < (
        UNREACHABLE_MEMORY_SECONDS
    )


def is_remote(path: str) -> bool:
    return "://" in str(path)


def bucket_of(path: str) -> str:
    """``gs://bucket/a/b`` -> ``gs://bucket``."""
    scheme, _, rest = str(path).partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def storage_error(path: str, doing: str, exc: BaseException) -> StorageError:
    """A clear error for a failed remote operation on ``path`` (``doing``: "writing it", ...).

    TF's GCS client reports a refused or unreachable endpoint as ``AbortedError`` ("All N retry
    attempts failed") or ``UnavailableError``, HTTP 401/403 as ``PermissionDeniedError``, and a
    write into a bucket that does not exist as ``NotFoundError``.
    """
    global _unreachable_at
    name = type(exc).__name__
    first = short_detail(getattr(exc, "message", None) or str(exc)) or name
    bucket = bucket_of(path)
    if name in ("PermissionDeniedError", "UnauthenticatedError"):
        return StorageError(
            f"{path}: permission denied while {doing} ({first}). The credentials in use cannot "
            f"do this in {bucket}: grant them access (roles/storage.objectViewer to read data, "
            "roles/storage.objectAdmin to write run directories), or set "
            "GOOGLE_APPLICATION_CREDENTIALS to an account that has it. `tpurun doctor CONFIG` "
            "checks the buckets a config uses."
        )
    if name == "NotFoundError":
        return StorageError(
            f"{path}: the bucket {bucket} does not exist (or this account may not see it), so "
            f"{doing} failed. Create it (gcloud storage buckets create {bucket}) or fix the path."
        )
    if name in ("AbortedError", "UnavailableError", "DeadlineExceededError",
                "FailedPreconditionError") or "HTTP request" in first:  # fmt: skip
        retries = os.environ.get("GCS_RETRY_CONFIG_MAX_RETRIES", "10")
        _unreachable_at = time.monotonic()
        return StorageError(
            f"{path}: Google Cloud Storage did not answer while {doing} ({first}); tpurun gave "
            f"up after {retries} retries. Check the network (and HTTPS_PROXY, if one is needed), "
            "then run the same command again; to wait longer for storage, set "
            "GCS_RETRY_CONFIG_MAX_RETRIES (see docs/gcs.md, 'When storage fails')."
        )
    return StorageError(f"{path}: {doing} failed: {name}: {first}")


def short_detail(text: str) -> str:
    """TF's error text in one short line: without its ``{{function_node ...}}`` prefix and
    ``[Op:...]`` suffix, and for an HTTP error, the code and the server's own message rather than
    the whole response body."""
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text).strip()
    first = (text.splitlines() or [""])[0].split(" [Op:")[0]
    code = re.search(r"HTTP response code (\d+)", first)
    if code:
        message = re.search(r'"message":\s*"((?:[^"\\]|\\.)*)"', text)
        first = f"HTTP {code[1]}" + (f": {message[1]}" if message else "")
    return first[:240]


def as_storage_error(exc: BaseException, doing: str) -> StorageError | None:
    """The :class:`StorageError` behind a TensorFlow error raised while reading or writing a
    bucket (say, by ``tf.data`` mid-training), or None when ``exc`` is not one."""
    tf = sys.modules.get("tensorflow")
    if tf is None or not isinstance(exc, tf.errors.OpError):
        return None
    text = getattr(exc, "message", None) or str(exc)
    start = text.find("gs://")
    if start < 0 and "HTTP request" not in text:
        return None
    path = text[start:].split()[0].rstrip(".,:;'\"") if start >= 0 else "gs://"
    return storage_error(path, doing, exc)


def training_stopped(exc: BaseException, checkpoints: str) -> StorageError | None:
    """What to say when a bucket failed mid-training (a checkpoint write, or ``tf.data`` reading
    the data): the storage problem, and that the last committed checkpoint is kept. None when
    ``exc`` is not a storage failure."""
    storage = exc if isinstance(exc, StorageError) else as_storage_error(exc, "reading it")
    if storage is None:
        return None
    return StorageError(
        f"training stopped: {storage.message} The last checkpoint committed is kept in "
        f"{checkpoints}; once storage answers, run the same command to continue."
    )


@contextlib.contextmanager
def _remote(path: str, doing: str, *, missing_is_error: bool = False) -> Iterator[None]:
    """Turn TensorFlow's errors about ``path`` into :class:`StorageError`; a NotFoundError passes
    through unless ``missing_is_error`` (writes: only a missing bucket makes one)."""
    tf = sys.modules.get("tensorflow")
    try:
        yield
    except Exception as exc:
        if tf is None or not isinstance(exc, tf.errors.OpError):
            raise
        if isinstance(exc, tf.errors.NotFoundError) and not missing_is_error:
            raise
        raise storage_error(path, doing, exc) from None


def _gfile():
    return frameworks.tensorflow().io.gfile


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
    gfile = _gfile()
    with _remote(path, "checking whether it exists"):
        return gfile.exists(path)


def isdir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(path)
    gfile = _gfile()
    with _remote(path, "checking whether it is a folder"):
        return gfile.isdir(path)


def makedirs(path: str) -> None:
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)
        return
    gfile = _gfile()
    with _remote(path, "creating it", missing_is_error=True):
        gfile.makedirs(path)


def glob(pattern: str) -> list[str]:
    """Sorted matches of a glob (remote globs are expanded by the store)."""
    if not is_remote(pattern):
        return sorted(globlib.glob(pattern))
    gfile = _gfile()
    with _remote(pattern, "listing it", missing_is_error=True):
        return sorted(gfile.glob(pattern))


def escape(path: str) -> str:
    """A path with its glob characters escaped, to glob beneath it."""
    return globlib.escape(str(path))


def mtime(path: str) -> float:
    if not is_remote(path):
        return os.path.getmtime(path)
    gfile = _gfile()
    with _remote(path, "reading its metadata"):
        return gfile.stat(path).mtime_nsec / 1e9


def size(path: str) -> int:
    if not is_remote(path):
        return os.path.getsize(path)
    gfile = _gfile()
    with _remote(path, "reading its metadata"):
        return gfile.stat(path).length


def remove(path: str, missing_ok: bool = True) -> None:
    try:
        if is_remote(path):
            gfile = _gfile()
            with _remote(path, "deleting it"):
                gfile.remove(path)
        else:
            os.remove(path)
    except (FileNotFoundError, _not_found()):
        if not missing_ok:
            raise


def remove_tree(path: str) -> None:
    """Remove a folder and everything in it (nothing happens when it is gone already)."""
    if not is_remote(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    gfile = _gfile()
    with contextlib.suppress(_not_found()), _remote(path, "deleting it"):
        gfile.rmtree(path)


def _not_found() -> type[BaseException]:
    """The exception a missing remote file raises (TF's NotFoundError), without importing TF for
    local paths."""
    tf = sys.modules.get("tensorflow")
    return tf.errors.NotFoundError if tf is not None else FileNotFoundError


def rename(src: str, dst: str) -> None:
    """Move a file or folder; remote paths are copied, then deleted (what a store's rename is:
    a folder moves object by object, so it is not atomic)."""
    if is_remote(src) or is_remote(dst):
        gfile = _gfile()
        with _remote(src, f"moving it to {dst}"):
            gfile.rename(src, dst, overwrite=True)
    else:
        os.replace(src, dst)


def copy(src: str, dst: str) -> None:
    if is_remote(src) or is_remote(dst):
        gfile = _gfile()
        where, writing = (dst, not is_remote(src)) if is_remote(dst) else (src, False)
        with _remote(where, f"copying {src} to {dst}", missing_is_error=writing):
            gfile.copy(src, dst, overwrite=True)
    else:
        shutil.copyfile(src, dst)


def open_binary(path: str, mode: str = "rb"):
    """A binary file object for streaming reads (``rb``) or writes (``wb``), local or remote."""
    if is_remote(path):
        gfile = _gfile()
        with _remote(path, "reading it" if "r" in mode else "writing it"):
            return gfile.GFile(path, mode)
    return open(path, mode)  # noqa: SIM115 (the caller closes it)


def read_bytes(path: str) -> bytes:
    if is_remote(path):
        gfile = _gfile()
        with _remote(path, "reading it"), gfile.GFile(path, "rb") as f:
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
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object.

    Raises:
        StorageError: a remote ``path`` cannot be read (not reachable, no permission).
    """
    try:
        data = json.loads(read_text_or_none(path) or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
        gfile = _gfile()
        with tempfile.TemporaryDirectory(prefix="tpurun-") as tmp:
            local = os.path.join(tmp, name)
            write(local)
            with _remote(path, "uploading it", missing_is_error=True):
                if path.startswith("ram://") and gfile.exists(path):
                    gfile.remove(path)  # TF's ram:// writes over an old file without truncating it
                gfile.copy(local, path, overwrite=True)
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
