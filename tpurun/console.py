"""What a run looks like: a Rich live view in a terminal, plain lines in notebooks, CI and logs.

A notebook's ``!tpurun`` runs on a pseudo-terminal: ``isatty()`` is True and ``TERM=xterm-color``,
yet the cell cannot redraw a live display (cursor moves and bare ``\\r`` become garbage). So the
choice looks at the environment too: ``JPY_PARENT_PID`` (Jupyter, Kaggle, Colab), CI, ``TERM=dumb``,
and ``--plain`` / ``TPURUN_PLAIN=1`` to force it.
"""

from __future__ import annotations

import os
import sys
import time
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


def format_metrics(logs: Mapping[str, Any] | None, keys: list[str] | None = None) -> str:
    if not logs:
        return ""
    parts = []
    for key in keys or list(logs):
        if key in logs and key != "learning_rate":
            parts.append(f"{key} {_num(logs[key])}")
    if "learning_rate" in logs:
        parts.append(f"lr {_num(logs['learning_rate'])}")
    return "  ".join(parts)


def _num(value: Any) -> str:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return str(value)
    return f"{value:.4g}" if abs(value) < 1e-3 and value else f"{value:.4f}"


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Reporter:
    """Receives a run's events. The base class stays silent (the Python API's default)."""

    started = False  # set by start(): training has begun

    def message(self, text: str, level: str = "info") -> None:
        """A one-line notice: level is info, warn or note."""

    def start(self, plan: Any, run_dir: str, epochs: int, initial_epoch: int) -> None:
        """Training is about to start."""

    def epoch_begin(self, epoch: int, steps: int) -> None:
        """``epoch`` counts from 1."""

    def progress(
        self, epoch: int, step: int, steps: int, rate: float, eta: float, logs: Mapping | None
    ) -> None:
        """Called at a bounded rate during an epoch; ``logs`` may be None when nothing new is known."""

    def epoch_end(self, epoch: int, logs: Mapping[str, Any], seconds: float, rate: float) -> None:
        """An epoch has finished, with its metrics."""

    def finish(self, summary: Mapping[str, Any]) -> None:
        """The run has ended (in any way)."""

    @property
    def progress_interval(self) -> float:
        return PLAIN_PROGRESS_SECONDS


class PlainReporter(Reporter):
    """Line-buffered lines, no ANSI escapes, no carriage returns: safe in a notebook cell or a log."""

    def __init__(self, stream: TextIO | None = None, interval: float | None = None):
        self.stream = stream or sys.stdout
        self._interval = float(
            os.environ.get("TPURUN_PROGRESS_SECONDS", interval or PLAIN_PROGRESS_SECONDS)
        )
        self.epochs = 0

    @property
    def progress_interval(self) -> float:
        return self._interval

    def _line(self, text: str) -> None:
        self.stream.write(f"[tpurun] {text}\n")
        self.stream.flush()

    def message(self, text: str, level: str = "info") -> None:
        prefix = {"warn": "warning: ", "note": ""}.get(level, "")
        self._line(prefix + text)

    def start(self, plan: Any, run_dir: str, epochs: int, initial_epoch: int) -> None:
        self.started = True
        self.epochs = epochs
        self._line(
            f"training {epochs - initial_epoch} epoch(s) x {plan.steps_per_epoch} steps, global batch "
            f"{plan.global_batch_size} ({plan.per_core_batch_size} x {plan.replicas}), lr "
            f"{plan.learning_rate:.4g}, steps_per_execution {plan.steps_per_execution} -> {run_dir}"
        )

    def progress(self, epoch, step, steps, rate, eta, logs) -> None:
        pct = 100 * step / steps if steps else 0
        metrics = format_metrics(logs)
        self._line(
            f"epoch {epoch}/{self.epochs}  step {step}/{steps} ({pct:.0f}%)  {rate:,.0f} ex/s  "
            f"eta {format_duration(eta)}" + (f"  {metrics}" if metrics else "")
        )

    def epoch_end(self, epoch, logs, seconds, rate) -> None:
        self._line(
            f"epoch {epoch}/{self.epochs}  {format_metrics(logs)}  {format_duration(seconds)}  "
            f"{rate:,.0f} ex/s"
        )

    def finish(self, summary) -> None:
        best = summary.get("best") or {}
        best_text = ""
        if best.get("value") is not None:
            best_text = f", best {best['monitor']} {_num(best['value'])} at epoch {best['epoch']}"
        self._line(
            f"{summary['status']}: {summary['epochs_completed']} epoch(s) in "
            f"{format_duration(summary.get('seconds'))}{best_text} -> {summary.get('run_dir')}"
        )


class LiveReporter(PlainReporter):
    """A Rich live view for a real terminal: epoch/step bar, examples/s, ETA, latest metrics."""

    def __init__(self, stream: TextIO | None = None):
        from rich.console import Console

        super().__init__(stream)
        self.console = Console(file=self.stream, highlight=False)
        self._progress = None
        self._task = None

    @property
    def progress_interval(self) -> float:
        return LIVE_REFRESH_SECONDS

    def _line(self, text: str) -> None:
        self.console.print(text, markup=False)

    def message(self, text: str, level: str = "info") -> None:
        style = {"warn": "yellow", "note": "dim"}.get(level, "")
        label = "warning: " if level == "warn" else ""
        self.console.print(f"{label}{text}", style=style or None, markup=False)

    def start(self, plan, run_dir, epochs, initial_epoch) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        super().start(plan, run_dir, epochs, initial_epoch)
        self._progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}/{task.fields[epochs]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} ex/s"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=self.console,
            transient=True,
        )
        self._progress.start()

    def epoch_begin(self, epoch, steps) -> None:
        if self._progress is None:
            return
        if self._task is not None:
            self._progress.remove_task(self._task)
        self._task = self._progress.add_task(
            "train", total=steps, epoch=epoch, epochs=self.epochs, rate="-", metrics=""
        )

    def progress(self, epoch, step, steps, rate, eta, logs) -> None:
        if self._progress is None or self._task is None:
            return
        fields = {"rate": f"{rate:,.0f}"}
        if logs:
            fields["metrics"] = format_metrics(logs)
        self._progress.update(self._task, completed=step, **fields)

    def epoch_end(self, epoch, logs, seconds, rate) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=self._progress.tasks[0].total)
        super().epoch_end(epoch, logs, seconds, rate)

    def finish(self, summary) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        super().finish(summary)


def make_reporter(plain: bool = False) -> Reporter:
    return PlainReporter() if want_plain(plain) else LiveReporter()


class TaskProgress:
    """A progress bar for a long step (counting, writing): Rich on a terminal, plain lines elsewhere.

    Use as a context manager and call it with ``(done, total)``. Plain mode writes a line at most
    every ``PLAIN_PROGRESS_SECONDS`` and one at the end.
    """

    def __init__(self, label: str, unit: str, plain: bool, stream: TextIO | None = None):
        self.label, self.unit, self.plain = label, unit, plain
        self.stream = stream or sys.stderr
        self._bar = None
        self._task = None
        self._start = self._last = time.monotonic()
        self._done = self._total = 0

    def __enter__(self) -> TaskProgress:
        if not self.plain:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(
                TextColumn(self.label),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=None, rate="")
        return self

    def __call__(self, done: int, total: int) -> None:
        self._done, self._total = done, total
        elapsed = time.monotonic() - self._start
        rate = f"{done / elapsed:,.0f} {self.unit}/s" if elapsed > 0 else ""
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total, rate=rate)
        elif time.monotonic() - self._last >= PLAIN_PROGRESS_SECONDS:
            self._last = time.monotonic()
            self.stream.write(f"[tpurun] {self.label}: {done:,}/{total:,} {self.unit}  {rate}\n")
            self.stream.flush()

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self._done and exc[0] is None:
            elapsed = time.monotonic() - self._start
            self.stream.write(
                f"[tpurun] {self.label}: {self._done:,} {self.unit} in {format_duration(elapsed)}\n"
            )
            self.stream.flush()
