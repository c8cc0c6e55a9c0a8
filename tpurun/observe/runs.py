"""``tpurun runs``: the runs under a folder, newest first, from their ``summary.json`` alone.

Reads one small file per run (and, for a run recorded as running, whether anyone holds its lock,
and its CSV log: the summary of a running run is the one it started with): no checkpoint, no
framework, so a folder of hundreds of runs lists at once.
"""

from __future__ import annotations

import datetime
from typing import Any

from tpurun.errors import TpurunError
from tpurun.storage import fileio
from tpurun.storage.rundir import ERROR_LOG, LOCK, SUMMARY, RunDir

#: How a summary's status reads in the listing: a signal or the time limit "stopped" the run.
SHOWN_STATUS = {"interrupted": "stopped", "stopped_early": "early-stopped"}


def _updated(text: str | None) -> datetime.datetime | None:
    try:
        when = datetime.datetime.fromisoformat(text) if text else None
    except ValueError:
        return None
    return when.astimezone() if when is not None and when.tzinfo is None else when


def _mtime(path: str) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromtimestamp(fileio.mtime(path)).astimezone()
    except (OSError, fileio.StorageError):
        return None


def _best_logged(rows: list[dict[str, str]], monitor: str | None) -> dict[str, Any] | None:
    """The best value of a loss-like monitor in a log; None for another monitor (a metric's
    direction is known only to its compiled model, and checkpoints are not read)."""
    if not monitor or not monitor.endswith("loss"):
        return None
    values = []
    for epoch, row in enumerate(rows, start=1):
        try:
            values.append((float(row[monitor]), epoch))
        except (KeyError, TypeError, ValueError):
            continue
    if not values:
        return None
    value, epoch = min(values)
    return {"monitor": monitor, "value": value, "epoch": epoch}


def _row(path: str) -> dict[str, Any]:
    run = RunDir(path, writer=False)
    summary, wrong = run.summary_state()
    if wrong is not None:  # named, not taken for a run that never started
        status, summary = "summary damaged", {}
    elif summary is None:
        # No summary yet: starting (checking data, compiling); failed before its first write
        # (only an unexpected failure leaves its error.log behind: a user error leaves no folder);
        # or killed while starting.
        if run.is_locked():
            status = "starting"
        elif fileio.exists(run.file(ERROR_LOG)):
            status = "failed"
        else:
            status = "not started"
        summary = {}
    else:
        status = run.status(summary)
    best = summary.get("best") or {}
    epochs_done = summary.get("epochs_completed")
    updated = [_updated(summary.get("updated")) or _mtime(run.file(LOCK))]
    if status in ("running", "died", "starting", "summary damaged"):
        # Its summary was written when it started: each finished epoch is a row of its log.
        log = run.log_name()
        rows = run.read_log(log) if log else []
        if rows:
            updated.append(_mtime(run.file(log)))
            # The summary is rewritten after each epoch's log row: a log with more rows is the
            # newer of the two, and its epochs and best are shown together (from the rows, where
            # the monitor is a loss; else the summary's, which agree with each other).
            logged = _best_logged(rows, best.get("monitor"))
            if len(rows) > (epochs_done or 0) and (logged is not None or not best.get("monitor")):
                epochs_done, best = len(rows), logged or best
    when = max((u for u in updated if u is not None), default=None)
    return {
        "name": fileio.basename(path.rstrip("/")),
        "path": path,
        "status": SHOWN_STATUS.get(status, status),
        "epochs_completed": epochs_done,
        "epochs": summary.get("epochs"),
        "best_monitor": best.get("monitor"),
        "best_value": best.get("value"),
        "best_epoch": best.get("epoch"),
        "backend": summary.get("backend"),
        "replicas": summary.get("replicas"),
        "examples_per_sec": summary.get("examples_per_sec"),
        "input_wait": summary.get("input_wait"),
        "updated": when.strftime("%Y-%m-%dT%H:%M:%S%z") if when else None,
    }


def list_runs(folder: str = "runs") -> list[dict[str, Any]]:
    """Every run directory directly under ``folder`` (one with a ``summary.json``, or a lock
    held by a run still starting), newest update first.

    Status is the summary's, ``interrupted`` shown as ``stopped`` and ``stopped_early`` as
    ``early-stopped``; a run recorded as running whose lock nobody holds is ``died``.

    Raises:
        TpurunError: ``folder`` is not a folder.
    """
    if not fileio.isdir(folder):
        raise TpurunError(
            f"{folder}: no such folder. Give the folder your runs are in (a config's output.dir, "
            "`runs` by default): tpurun runs DIR."
        )
    pattern = fileio.join(fileio.escape(folder), "*")
    paths = {fileio.dirname(p) for p in fileio.glob(fileio.join(pattern, SUMMARY))}
    paths |= {fileio.dirname(p) for p in fileio.glob(fileio.join(pattern, LOCK))}
    rows = [_row(path) for path in sorted(paths)]
    epoch = datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)
    rows.sort(key=lambda r: _updated(r["updated"]) or epoch, reverse=True)
    return rows
