"""A doctor's finding (:class:`Check`), how a check is run (:func:`timed`), and the report.

Every other doctor module builds on this one and it imports none of them, so the checks, the
probes and the package's entry points can all use it without importing each other.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tpurun._version import __version__

STATUSES = ("ok", "warn", "fail", "skip")
REPORT_VERSION = 1


@dataclass
class Check:
    """One finding.

    Attributes:
        name: a short stable id (``platform``, ``libtpu_lock``, ``data.train``, ...).
        status: ``ok``, ``warn``, ``fail`` or ``skip``.
        finding: one line saying what was found.
        fix: one line saying what to do; None when the check is ok.
        data: the details, as JSON-ready values.
        seconds: how long the check took.
    """

    name: str
    status: str
    finding: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Check.status: {self.status!r}; expected one of {STATUSES}")


def timed(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    """Run one check, timing it; an unexpected exception becomes a ``fail``, not a crash."""
    started = time.monotonic()
    try:
        result = fn()
    except Exception as exc:  # a doctor that crashes on a broken machine helps nobody
        result = Check(
            name,
            "fail",
            f"the check itself failed: {type(exc).__name__}: {exc}",
            "report this as a tpurun bug, with the output of `tpurun doctor --json`",
        )
    checks = result if isinstance(result, list) else [result]
    elapsed = round(time.monotonic() - started, 3)
    for check in checks:
        check.seconds = check.seconds or elapsed
    return checks


def exit_code(checks: Sequence[Check]) -> int:
    """0 when nothing fails, 1 when a check fails; warnings do not fail."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def report(checks: Sequence[Check]) -> dict[str, Any]:
    """The checks as JSON-ready data (``tpurun doctor --json``)."""
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    return {
        "version": REPORT_VERSION,
        "tpurun_version": __version__,
        "status": "fail" if counts["fail"] else ("warn" if counts["warn"] else "ok"),
        "exit_code": exit_code(checks),
        "counts": counts,
        "seconds": round(sum(c.seconds for c in checks), 3),
        "checks": [asdict(c) for c in checks],
    }


__all__ = ["REPORT_VERSION", "STATUSES", "Check", "exit_code", "report", "timed"]
