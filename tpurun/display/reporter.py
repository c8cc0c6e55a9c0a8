"""The reporter interface a run talks to, and whether a stream gets plain lines or a live view.

A notebook's ``!tpurun`` runs on a pseudo-terminal: ``isatty()`` is True and ``TERM=xterm-color``,
yet the cell cannot redraw a live display (cursor moves and bare ``\\r`` become garbage). So the
choice looks at the environment too: ``JPY_PARENT_PID`` (Jupyter, Kaggle, Colab), CI, ``TERM=dumb``,
and ``--plain`` / ``TPURUN_PLAIN=1`` to force it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

_NOTEBOOK_SIGNALS = ("JPY_PARENT_PID", "COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE")
PLAIN_PROGRESS_SECONDS = 30.0  # a plain progress line at most this often
LIVE_REFRESH_SECONDS = 0.5


def want_plain(
    force: bool = False, stream: TextIO | None = None, env: Mapping[str, str] | None = None
) -> bool:
    env = os.environ if env is None else env
    stream = sys.stdout if stream is None else stream
    if force or env.get("TPURUN_PLAIN", "").lower() in ("1", "true", "yes"):
        return True
    if any(env.get(name) for name in _NOTEBOOK_SIGNALS):
        return True
    if env.get("CI") or env.get("TERM", "") == "dumb":
        return True
    try:
        return not stream.isatty()
    except (AttributeError, ValueError):
        return True


class Reporter:
    """Receives a run's events; this base class stays silent (the Python API's default).

    One epoch: ``epoch_begin(epoch, steps)`` (epochs count from 1); per execution (the
    ``steps_per_execution`` steps run as one call) ``execution_begin`` with its first and last step
    (from 1), and at a bounded rate, and at the epoch's last step, ``progress`` (``logs`` None when
    nothing new is known); ``compiled`` once the run's first execution is done (its steps, and its
    seconds, compiling included, and how many programs JAX loaded from its compilation cache);
    ``validation_begin``, ``validation_progress`` (bounded rate),
    ``validation_end``; then ``epoch_end``. ``message`` is a notice (level info, warn or note) on
    lines of its own; ``finish`` says how the run ended; ``close`` ends the output however it ended
    (a live display gives the terminal back; idempotent).
    """

    started = False  # set by start(): training has begun

    def message(self, text: str, level: str = "info") -> None: ...
    def start(self, plan: Any, run_dir: str, epochs: int, initial_epoch: int) -> None: ...
    def epoch_begin(self, epoch: int, steps: int) -> None: ...
    def execution_begin(self, epoch: int, first: int, last: int) -> None: ...
    def progress(
        self, epoch: int, step: int, steps: int, rate: float, eta: float, logs: Mapping | None
    ) -> None: ...
    def compiled(self, seconds: float, steps: int, loaded: int = 0) -> None: ...
    def validation_begin(self, epoch: int, steps: int) -> None: ...
    def validation_progress(self, epoch: int, step: int, steps: int) -> None: ...
    def validation_end(self, epoch: int, seconds: float) -> None: ...
    def epoch_end(
        self, epoch: int, logs: Mapping[str, Any], seconds: float, rate: float
    ) -> None: ...
    def finish(self, summary: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...

    @property
    def progress_interval(self) -> float:
        return PLAIN_PROGRESS_SECONDS
