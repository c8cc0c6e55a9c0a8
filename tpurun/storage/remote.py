"""The stores behind remote paths, and what their failures mean: ``gs://`` through gcsfs, ``ram://``
through fsspec's in-memory file system; no TensorFlow in either.

:mod:`tpurun.storage.fileio` asks :func:`store` for a path's file system and turns what fails into
a :class:`StorageError` with :func:`storage_error`, which says which bucket, why (not reachable, no
permission, no such bucket) and what to do.

gcsfs is used as its core ``GCSFileSystem``, changed in two ways:

- **Retries bounded as TensorFlow's client is** (:data:`tpurun.frameworks.GCS_DEFAULTS`: the same
  variables, so that one setting governs both clients, read once per process at its first
  ``gs://`` use). gcsfs's own try a refused connection 6 times, 1 to 16 s apart: about 33 s
  before an error, and fixed when the class is defined.
- **Not the class ``gcsfs.GCSFileSystem`` names by default** (``ExtendedGcsFileSystem``), which first
  asks the Storage Control gRPC API for each bucket's layout, with 60 s of retries of its own: a
  minute before the first request against a store that does not answer. The core class reads and
  writes hierarchical-namespace buckets through the JSON API as it does flat ones.

``ram://`` is one process's memory, as TensorFlow's ``ram://`` was: the tests use it as a store
without a server. TensorFlow's own ``ram://`` is another file system: the ``tf_data`` reader does
not see what tpurun wrote there.
"""

from __future__ import annotations

import datetime
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from tpurun.errors import TpurunError
from tpurun.frameworks import GCS_DEFAULTS


class StorageError(TpurunError):
    """A bucket could not be read or written: unreachable, no permission, or no such bucket.

    ``kind`` is :func:`error_kind`'s word for the cause, ``detail`` the cause in one short line.
    """

    def __init__(self, message: str, kind: str = "other", detail: str = ""):
        super().__init__(message)
        self.kind, self.detail = kind, detail


#: How long after storage was last found unreachable (its retries exhausted) the writes that are
#: only worth a try (a failed run's last summary, releasing its lock) are skipped: each would
#: spend the whole retry time again, and a run stopped by an outage should end promptly.
UNREACHABLE_MEMORY_SECONDS = 30.0
_unreachable_at: float | None = None

#: Bytes a remote file reads ahead, or gathers before it uploads a part (a multiple of 256 KiB,
#: as resumable uploads require): one request per 8 MiB of a streamed file.
BLOCK_SIZE = 8 << 20


def recently_unreachable() -> bool:
    """Whether a remote request of this process gave up on an unreachable store just now."""
    return _unreachable_at is not None and time.monotonic() - _unreachable_at < (
        UNREACHABLE_MEMORY_SECONDS
    )


#: The settings gcsfs is given, as TensorFlow's client names them: tpurun's, and TF's own idle
#: limit (a request that receives nothing for that long is tried again).
SETTINGS = {**GCS_DEFAULTS, "GCS_REQUEST_IDLE_TIMEOUT_SECS": "60"}


def _setting(name: str) -> float:
    """A GCS setting from the environment, or :data:`SETTINGS` (also for a value that is not a
    number)."""
    try:
        return float(os.environ.get(name, SETTINGS[name]))
    except ValueError:
        return float(SETTINGS[name])


@dataclass(frozen=True)
class Retries:
    """How a request that failed for a passing reason is tried again."""

    count: int  # tries after the first
    first_delay: float  # seconds, doubled each time
    longest_delay: float

    @classmethod
    def from_environment(cls) -> Retries:
        return cls(
            int(_setting("GCS_RETRY_CONFIG_MAX_RETRIES")),
            _setting("GCS_RETRY_CONFIG_INIT_DELAY_TIME_US") / 1e6,
            _setting("GCS_RETRY_CONFIG_MAX_DELAY_TIME_US") / 1e6,
        )

    def delay(self, attempt: int) -> float:
        return min(self.first_delay * 2**attempt, self.longest_delay)


def _retriable(exc: BaseException) -> bool:
    from gcsfs.retry import is_retriable

    return isinstance(exc, TimeoutError) or is_retriable(exc)


def _gcs_class() -> type:
    """gcsfs's core ``GCSFileSystem`` with :class:`Retries` in place of its own (see the module
    docstring); imported here, at the first gs:// use (about 0.7 s)."""
    import asyncio

    from gcsfs.core import GCSFileSystem

    # gcsfs's retry decorator keeps the undecorated request (decorator's __wrapped__): one try.
    request_once = getattr(GCSFileSystem._request, "__wrapped__", GCSFileSystem._request)

    class BoundedGCSFileSystem(GCSFileSystem):
        retry = Retries(4, 0.25, 2.0)

        async def _request(self, method, path, *args, **kwargs):
            for attempt in range(self.retry.count + 1):
                try:
                    return await request_once(self, method, path, *args, **kwargs)
                except Exception as exc:
                    if attempt == self.retry.count or not _retriable(exc):
                        raise
                await asyncio.sleep(self.retry.delay(attempt))
            raise AssertionError("unreachable")  # the loop returns or raises

    return BoundedGCSFileSystem


def _gcs() -> Any:
    import aiohttp
    import fsspec

    options: dict[str, Any] = {
        # Other processes write the same run directory (a lock's holder, a resumed run): every
        # question goes to the store, as TensorFlow's client with GCS_STAT_CACHE_MAX_AGE=0.
        "use_listings_cache": False,
        "requests_timeout": aiohttp.ClientTimeout(
            total=None,
            sock_connect=_setting("GCS_REQUEST_CONNECTION_TIMEOUT_SECS"),
            sock_read=_setting("GCS_REQUEST_IDLE_TIMEOUT_SECS"),
        ),
        "session_kwargs": {"trust_env": True},  # HTTPS_PROXY and NO_PROXY, as TF's client
        **fsspec.config.conf.get("gs", {}),  # the user's FSSPEC_GS_* settings win
    }
    options.setdefault("token", credentials())
    fs = _gcs_class()(skip_instance_cache=True, **options)
    fs.retry = Retries.from_environment()
    return fs


#: The name of a Google Cloud VM's metadata server (its credentials), resolvable only there.
METADATA_HOST = "metadata.google.internal"
_anonymous = False  # no credentials were found: requests go without (see credentials())


def credentials() -> str | None:
    """How gcsfs gets credentials: None, its own search (Application Default Credentials: the
    ``GOOGLE_APPLICATION_CREDENTIALS`` file, ``gcloud auth application-default login``'s, or the
    VM's metadata server), or ``"anon"`` (none: an emulator, as Google's own clients do; or a
    machine that has none of the three). The search asks the metadata server even where there is
    none, about 17 s of timeouts before it goes on without credentials: its name, which resolves
    only on Google Cloud, is looked up first."""
    global _anonymous
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return "anon"
    gcloud = os.environ.get("CLOUDSDK_CONFIG") or os.path.join(
        os.environ.get("APPDATA") or os.path.expanduser("~/.config"), "gcloud"
    )
    if (
        os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
        or os.path.exists(os.path.join(gcloud, "application_default_credentials.json"))
        or os.environ.get("GCE_METADATA_HOST")
        or os.environ.get("GCE_METADATA_IP")
        or _resolves(METADATA_HOST)
    ):
        return None
    _anonymous = True
    return "anon"


def _resolves(host: str, seconds: float = 1.0) -> bool:
    """Whether ``host`` resolves within ``seconds`` (a broken resolver counts as no)."""
    import socket

    answer: list[bool] = []

    def resolve() -> None:
        try:
            answer.append(bool(socket.getaddrinfo(host, 80)))
        except OSError:
            answer.append(False)

    thread = threading.Thread(target=resolve, name="tpurun-resolve", daemon=True)
    thread.start()
    thread.join(seconds)
    return bool(answer and answer[0])


@dataclass(frozen=True)
class Store:
    """A remote path's file system (fsspec), and how its paths map to tpurun's."""

    fs: Any
    scheme: str  # as tpurun writes it: gs, ram, ...

    def inner(self, path: str) -> str:
        """``gs://b/k`` -> what ``fs`` takes (``b/k``)."""
        rest = str(path).split("://", 1)[1]
        return f"memory://{rest}" if self.scheme == "ram" else self.fs._strip_protocol(path)

    def outer(self, inner: str) -> str:
        """What ``fs`` answers (``b/k``) -> ``gs://b/k``."""
        return f"{self.scheme}://{inner.lstrip('/') if self.scheme == 'ram' else inner}"


_stores: dict[tuple[str, int], Store] = {}
_stores_lock = threading.Lock()


def store(path: str) -> Store:
    """The file system of a remote path, made once per process (and scheme).

    Raises:
        StorageError: no file system is known for the path's scheme.
    """
    scheme = str(path).split("://", 1)[0].lower()
    key = (scheme, os.getpid())  # a forked child makes its own: a session cannot cross a fork
    with _stores_lock:
        if key not in _stores:
            _stores[key] = Store(_make(scheme, path), scheme)
        return _stores[key]


def _make(scheme: str, path: str) -> Any:
    import fsspec

    if scheme in ("gs", "gcs"):
        return _gcs()
    try:
        return fsspec.filesystem("memory" if scheme == "ram" else scheme)
    except (ImportError, ValueError) as exc:
        raise StorageError(
            f"{path}: tpurun reads and writes local paths, gs:// and ram://; {scheme}:// is "
            f"not one of them ({exc})."
        ) from None


def modified(info: dict[str, Any]) -> float:
    """The modification time (seconds since the epoch) in a file's fsspec ``info``."""
    value = info.get("mtime") or info.get("updated") or info.get("created") or 0.0
    if isinstance(value, str):
        value = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return value.timestamp() if isinstance(value, datetime.datetime) else float(value)


# ------------------------------------------------------------------------------------ errors
# TensorFlow's names (the tf_data reader's errors) and what they mean.
_TF_KINDS = {"PermissionDeniedError": "permission", "UnauthenticatedError": "permission",
             "NotFoundError": "missing", "AbortedError": "unreachable",
             "UnavailableError": "unreachable", "DeadlineExceededError": "unreachable",
             "FailedPreconditionError": "unreachable"}  # fmt: skip
_CLIENT_MODULES = ("aiohttp", "gcsfs", "google.auth", "requests", "fsspec", "tensorflow")


def _from_client(exc: BaseException) -> bool:
    return any(c.__module__.startswith(_CLIENT_MODULES) for c in type(exc).__mro__)


def error_kind(exc: BaseException) -> str | None:
    """What a failed remote operation means: ``missing`` (no such object or bucket), ``exists``,
    ``permission``, ``unreachable`` (the store did not answer), ``other``; None for an exception
    that is not a storage failure (a bug), which is left as it is."""
    name = type(exc).__name__
    if name in _TF_KINDS and _from_client(exc):
        return _TF_KINDS[name]
    if isinstance(exc, FileNotFoundError):
        return "missing"
    if isinstance(exc, FileExistsError):
        return "exists"  # a create-only write found the object (HTTP 412)
    code = getattr(exc, "code", None)
    text = str(exc)
    if isinstance(exc, PermissionError) or text.startswith("Forbidden") or code in (401, 403):
        return "permission"
    if name in ("RefreshError", "DefaultCredentialsError"):
        return "permission"  # no credentials, or ones the server refused
    if "HTTP request" in text or _retriable_kind(exc):
        return "unreachable"
    if isinstance(exc, OSError) or _from_client(exc):
        return "other"
    return None


def _retriable_kind(exc: BaseException) -> bool:
    """A connection that failed (refused, reset, DNS, timed out), or a server error that lasted
    through the retries."""
    if isinstance(exc, (ConnectionError, TimeoutError)) or type(exc).__name__ == "TransportError":
        return True
    if type(exc).__module__.startswith("aiohttp"):
        return True
    code = getattr(exc, "code", None)
    return isinstance(code, int) and (code >= 500 or code in (408, 429))


def short_detail(text: str) -> str:
    """An error's text in one short line: for TensorFlow's, without its ``{{function_node ...}}``
    prefix and ``[Op:...]`` suffix; for an HTTP error, the code and the server's own message
    rather than the whole response body."""
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(text)).strip()
    first = (text.splitlines() or [""])[0].split(" [Op:")[0]
    code = re.search(r"HTTP response code (\d+)", first)
    if code:
        message = re.search(r'"message":\s*"((?:[^"\\]|\\.)*)"', text)
        first = f"HTTP {code[1]}" + (f": {message[1]}" if message else "")
    return first[:240]


def detail(exc: BaseException) -> str:
    """A failed remote operation's cause in one short line (``HTTP 403: ...``, ``Cannot connect
    to host ...``)."""
    text = str(getattr(exc, "message", None) or exc).strip()
    if text.startswith("Forbidden") and "\n" in text:  # gcsfs: "Forbidden: URL\nmessage"
        return f"HTTP 403: {text.split(chr(10), 1)[1].strip()}"[:240]
    code = getattr(exc, "code", None)
    if isinstance(code, int):  # gcsfs's HttpError: "message, code"
        return f"HTTP {code}: {text.removesuffix(f', {code}')}"[:240]
    return short_detail(text) or type(exc).__name__


def bucket_of(path: str) -> str:
    """``gs://bucket/a/b`` -> ``gs://bucket``."""
    scheme, _, rest = str(path).partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}"


def storage_error(path: str, doing: str, exc: BaseException) -> StorageError:
    """A clear error for a failed remote operation on ``path`` (``doing``: "writing it", ...)."""
    global _unreachable_at
    kind, first, bucket = error_kind(exc) or "other", detail(exc), bucket_of(path)
    if kind == "permission" and _anonymous:
        message = (
            f"{path}: permission denied while {doing} ({first}). This machine has no Google "
            "Cloud credentials (no GOOGLE_APPLICATION_CREDENTIALS, no `gcloud auth "
            "application-default login`, no metadata server), so tpurun asked without any: "
            f"give it an account that may use {bucket} (gcloud auth application-default login, "
            "or GOOGLE_APPLICATION_CREDENTIALS=KEY.json)."
        )
    elif kind == "permission":
        message = (
            f"{path}: permission denied while {doing} ({first}). The credentials in use cannot "
            f"do this in {bucket}: grant them access (roles/storage.objectViewer to read data, "
            "roles/storage.objectAdmin to write run directories), or set "
            "GOOGLE_APPLICATION_CREDENTIALS to an account that has it. `tpurun doctor CONFIG` "
            "checks the buckets a config uses."
        )
    elif kind == "missing":
        message = (
            f"{path}: the bucket {bucket} does not exist (or this account may not see it), so "
            f"{doing} failed. Create it (gcloud storage buckets create {bucket}) or fix the path."
        )
    elif kind == "unreachable":
        _unreachable_at = time.monotonic()
        retries = int(_setting("GCS_RETRY_CONFIG_MAX_RETRIES"))
        message = (
            f"{path}: Google Cloud Storage did not answer while {doing} ({first}); tpurun gave "
            f"up after {retries} retries. Check the network (and HTTPS_PROXY, if one is needed), "
            "then run the same command again; to wait longer for storage, set "
            "GCS_RETRY_CONFIG_MAX_RETRIES (see docs/gcs.md, 'When storage fails')."
        )
    else:
        message = f"{path}: {doing} failed: {type(exc).__name__}: {first}"
    return StorageError(message, kind, first)


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
    """What to say when a bucket failed mid-training (a checkpoint write, or the data read): the
    storage problem, and that the last committed checkpoint is kept. None when ``exc`` is not a
    storage failure."""
    storage = exc if isinstance(exc, StorageError) else as_storage_error(exc, "reading it")
    if storage is None:
        return None
    return StorageError(
        f"training stopped: {storage.message} The last checkpoint committed is kept in "
        f"{checkpoints}; once storage answers, run the same command to continue.",
        storage.kind,
        storage.detail,
    )
