"""Stopping early and cleanly: signals (a notebook's stop button, preemption) and the time limit.

A signal handler or the deadline sets :class:`Stop`; :class:`tpurun.training.callbacks.RunControl` notices it
at the next execution, saves the resume point at that step and ends ``fit``; the runner then exits
with code 3. Imports no framework.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass


class StopNow(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by ``RunControl`` once a stop mid-epoch is saved: it ends ``fit`` at once,
    skipping the validation pass Keras would otherwise run first (a preempted VM has seconds)."""


@dataclass
class Stop:
    """Why training stopped early, shared by the callbacks and the runner."""

    reason: str | None = None  # SIGTERM, SIGINT or train.time_limit: stop at the next step
    deadline: float | None = None  # time.monotonic() at which train.time_limit runs out
    nan_at: tuple[int, int] | None = None  # (epoch, step) of a NaN or Inf loss

    def requested(self, now: float) -> bool:
        """Whether training should stop: a signal came, or the time limit has run out."""
        if self.reason is None and self.deadline is not None and now >= self.deadline:
            self.reason = "train.time_limit"
        return self.reason is not None


@contextlib.contextmanager
def stop_on_signals(stop: Stop):
    """SIGTERM or SIGINT (a notebook's stop button, Kaggle ending the session) stops training at
    the next step, with a checkpoint; a second signal stops at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return

    def handler(signum, frame):
        if stop.reason is not None:
            raise KeyboardInterrupt
        stop.reason = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    # The start-up handler it replaces (tpurun.cli.boundary.StopSignals) hands over a signal it could
    # not act on: one whose exception a framework swallowed, or one waiting for an import.
    hand_over = getattr(getattr(previous[signal.SIGINT], "__self__", None), "hand_over", None)
    held = hand_over() if callable(hand_over) else None
    if held is not None and stop.reason is None:
        stop.reason = held
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
