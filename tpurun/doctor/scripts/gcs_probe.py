"""Reach Google Cloud Storage; read the first file of each data glob, write and delete a test
object where the run writes (doctor's ``gcs.reachable`` check).

Run by :class:`tpurun.doctor.gcs.GcsProbe` as ``python -m tpurun.doctor.scripts.gcs_probe
'{"endpoint": [host, port], "connect": seconds, "targets": [[kind, path], ...]}'``, in a child
whose environment lowers TensorFlow's GCS retries (TF reads them once, at its first gs:// use), and
which the parent kills at its timeout: storage that does not answer never holds doctor up.

First a plain TCP connection to ``endpoint`` (the HTTPS proxy, or storage.googleapis.com:443): a
closed network fails there in ``connect`` seconds, before TensorFlow is imported. Then each target
through ``tf.io.gfile``: ``read`` a glob's first file (16 bytes), ``write`` and delete a test
object in a folder, or ask whether a ``url`` exists.

Answer: ``{"reachable": bool, "stage": "connect" | "gfile", "error"?, "results"?: [{"kind",
"path", "ok", "detail" | "error_type" and "error", "seconds"}], "seconds"}``.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from tpurun.doctor.child import payload, reply

# TensorFlow's errors when the store cannot be reached at all (its retries spent).
UNREACHABLE = ("AbortedError", "UnavailableError", "DeadlineExceededError",
               "FailedPreconditionError")  # fmt: skip
TEST_OBJECT = ".tpurun-doctor-"  # the test object's name starts so; a random suffix follows


def error_text(exc: BaseException) -> str:
    """TensorFlow's message for an error (its ``message``), else ``str``; at most 2000 chars."""
    return (getattr(exc, "message", None) or str(exc)).strip()[:2000] or type(exc).__name__


def actions(gfile: Any) -> dict[str, Callable[[str], str]]:
    """What each kind of target does, through ``gfile`` (``tf.io.gfile`` or a stand-in); each
    returns a short detail, or raises."""

    def url(path: str) -> str:
        return f"exists: {bool(gfile.exists(path))}"

    def read(path: str) -> str:
        files = [f for f in gfile.glob(path) if not f.endswith("/")]
        if not files:
            raise LookupError(f"no file matches {path}")
        with gfile.GFile(files[0], "rb") as f:
            f.read(16)
        return f"{len(files)} file(s), the first one read"

    def write(folder: str) -> str:
        probe = folder.rstrip("/") + "/" + TEST_OBJECT + uuid.uuid4().hex[:12]
        with gfile.GFile(probe, "w") as f:
            f.write("written by tpurun doctor to test access; safe to delete\n")
        gfile.remove(probe)
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
            result = {"kind": kind, "path": path, "ok": False, "error_type": type(exc).__name__,
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
        and all(r["error_type"] in UNREACHABLE for r in failed)
    ):
        return {
            "reachable": False,
            "stage": "gfile",
            "error": failed[0]["error"],
            "results": results,
        }
    return {"reachable": True, "stage": "gfile", "results": results}


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
    from tpurun import frameworks

    gfile = frameworks.tensorflow().io.gfile
    return verdict(run_targets([tuple(t) for t in asked["targets"]], actions(gfile)))


def main() -> None:
    started = time.perf_counter()
    result = probe(payload())
    result["seconds"] = round(time.perf_counter() - started, 3)
    reply(result)


if __name__ == "__main__":
    main()
