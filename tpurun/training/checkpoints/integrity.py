"""Whether a checkpoint is still the one that was written.

The state file that commits a checkpoint (``latest.json``, ``previous.json``, ``best.json``...)
records its fingerprint under ``"check"``: for a file, its size and CRC32C; for a sharded
checkpoint's folder (``.orbax``), every file in it with its size. Before a resume trusts a
checkpoint, :func:`problem` compares what is on disk with it: a truncated copy, a flipped bit, a
hand edit or a shard gone missing is named, never loaded as if it were whole, and never taken for
"no checkpoint".

In a bucket only the sizes are recorded: reading a multi-gigabyte object back to checksum it
would double each save's traffic, and the store checks each upload's own CRC32C already. State
files from before this check carry no fingerprint: only their weights' presence is checked.
"""

from __future__ import annotations

import os
from typing import Any

import google_crc32c

from tpurun.storage import fileio

_CHUNK = 1 << 22  # bytes read at a time for the checksum


def _crc32c(path: str) -> str:
    checksum = google_crc32c.Checksum()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            checksum.update(chunk)
    return checksum.hexdigest().decode()


def _files(folder: str) -> dict[str, int]:
    """Every file under a local folder, by its path relative to it, with its size."""
    found = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder)] = os.path.getsize(path)
    return found


def fingerprint(path: str) -> dict[str, Any]:
    """What to record of the checkpoint just written at ``path`` (a file or a sharded folder)."""
    if fileio.is_remote(path):
        return {} if fileio.isdir(path) else {"bytes": fileio.size(path)}
    if os.path.isdir(path):
        return {"files": _files(path)}
    return {"bytes": os.path.getsize(path), "crc32c": _crc32c(path)}


def problem(path: str, recorded: dict[str, Any] | None) -> str | None:
    """What is wrong with the checkpoint at ``path`` against its recorded fingerprint, in a few
    words (``"missing"``, ``"4,096 bytes, 131,072 when written"``), or None when it is whole."""
    if not fileio.exists(path):
        return "missing"
    recorded = recorded or {}
    if "files" in recorded and not fileio.is_remote(path):
        now = _files(path)
        gone = sorted(set(recorded["files"]) - set(now))
        if gone:
            more = f" and {len(gone) - 1} more" if len(gone) > 1 else ""
            return f"incomplete: {gone[0]}{more} missing"
        changed = sorted(k for k, size in recorded["files"].items() if now[k] != size)
        if changed:
            return f"incomplete: {changed[0]} is {now[changed[0]]:,} bytes, {recorded['files'][changed[0]]:,} when written"
        return None
    if "bytes" in recorded:
        size = fileio.size(path)
        if size != recorded["bytes"]:
            return f"{size:,} bytes, {recorded['bytes']:,} when written"
    if "crc32c" in recorded and not fileio.is_remote(path):
        if _crc32c(path) != recorded["crc32c"]:
            return "its contents changed since it was written (CRC32C mismatch)"
    return None
