"""Reach Google Cloud Storage; read the first file of each data glob, write and delete a test
object where the run writes (doctor's ``gcs.reachable`` check).

Run by :class:`tpurun.doctor.gcs.GcsProbe` as ``python -m tpurun.doctor.scripts.gcs_probe
'{"endpoint": [host, port], "connect": seconds, "targets": [[kind, path], ...]}'``, in a child
whose environment lowers the GCS retries (read once, at its first gs:// use), and which the parent
kills at its timeout: storage that does not answer never holds doctor up.

First a plain TCP connection to ``endpoint`` (the emulator, the HTTPS proxy, or
storage.googleapis.com:443): a closed network fails there in ``connect`` seconds. Then each target
through :mod:`tpurun.storage.fileio` (gcsfs; no TensorFlow), as train reads and writes: ``read`` a
glob's first file (16 bytes), ``write`` and delete a test object in a folder, or ask whether a
``url`` exists.

Answer: ``{"reachable": bool, "stage": "connect" | "files", "error"?, "results"?: [{"kind",
"path", "ok", "detail" | "error_type" and "error", "seconds"}], "seconds"}``; a storage failure's
``error_type`` is its :attr:`~tpurun.storage.fileio.StorageError.kind` (``permission``,
``missing``, ``unreachable``, ``other``), any other error's its class name.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from tpurun.doctor.child import payload, reply

TEST_OBJECT = ".tpurun-doctor-"  # the test object's name starts so; a random suffix follows


def error_text(exc: BaseException) -> str:
    """A storage error's cause in one line (its ``detail``), else ``str``; at most 2000 chars."""
    return (getattr(exc, "detail", None) or str(exc)).strip()[:2000] or type(exc).__name__


def actions(files: Any) -> dict[str, Callable[[str], str]]:
    """What each kind of target does, through ``files`` (:mod:`tpurun.storage.fileio` or a
    stand-in with its ``exists``, ``glob``, ``open_binary`` and ``remove``); each returns a short
    detail, or raises."""

    def url(path: str) -> str:
        return f"exists: {bool(files.exists(path))}"

    def read(path: str) -> str:
        found = [f for f in files.glob(path) if not f.endswith("/")]
        if not found:
            raise LookupError(f"no file matches {path}")
        with files.open_binary(found[0]) as f:
            f.read(16)
        return f"{len(found)} file(s), the first one read"

    def write(folder: str) -> str:
        probe = folder.rstrip("/") + "/" + TEST_OBJECT + uuid.uuid4().hex[:12]
        with files.open_binary(probe, "wb") as f:
            f.write(b"written by tpurun doctor to test access; safe to delete\n")
        files.remove(probe)
        return "a test object written and deleted"

    return {"url": url, "read": read, "write": write}


def run_targets(
    targets: Iterable[tuple[str, str]], act: dict[str, Callable[[str], str]]
) -> list[dict[str, Any]]:
    """Each ``(kind, path)`` target tried in turn: ok with a detail, or the error's type and text."""
    results = []
    for kind, path in targets:
        started = time.perf_counter()
        try:
            result = {"kind": kind, "path": path, "ok": True, "detail": act[kind](path)}
        except Exception as exc:
            kind_of = getattr(exc, "kind", None) or type(exc).__name__  # a StorageError's cause
            result = {"kind": kind, "path": path, "ok": False, "error_type": kind_of,
                      "error": error_text(exc)}  # fmt: skip
        result["seconds"] = round(time.perf_counter() - started, 3)
        results.append(result)
    return results


def verdict(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer for the targets' results: storage is unreachable when every target failed with
    an error that says the store did not answer, reachable otherwise (each result then says how
    that target went)."""
    failed = [r for r in results if not r["ok"]]
    if (
        results
        and len(failed) == len(results)
        and all(r["error_type"] == "unreachable" for r in failed)
    ):
        return {
            "reachable": False,
            "stage": "files",
            "error": failed[0]["error"],
            "results": results,
        }
    return {"reachable": True, "stage": "files", "results": results}


def connect(endpoint: tuple[str, int], timeout: float) -> dict[str, Any] | None:
    """None when a TCP connection to ``endpoint`` opens, else the answer that says it did not."""
    try:
        socket.create_connection(endpoint, timeout=timeout).close()
    except OSError as exc:
        return {"reachable": False, "stage": "connect",
                "error": f"{endpoint[0]}:{endpoint[1]}: {exc}"}  # fmt: skip
    return None


def probe(asked: dict[str, Any]) -> dict[str, Any]:
    endpoint = (asked["endpoint"][0], int(asked["endpoint"][1]))
    refused = connect(endpoint, float(asked["connect"]))
    if refused is not None:
        return refused
    from tpurun.storage import fileio

    return verdict(run_targets([tuple(t) for t in asked["targets"]], actions(fileio)))


def main() -> None:
    started = time.perf_counter()
    result = probe(payload())
    result["seconds"] = round(time.perf_counter() - started, 3)
    reply(result)


if __name__ == "__main__":
    main()
