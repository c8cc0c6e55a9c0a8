"""Plain lines: what a run prints in notebooks, CI and logs (no ANSI escapes, no carriage
returns), the formatting the live view shares, and a progress bar for the data commands."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from tpurun.display.reporter import PLAIN_PROGRESS_SECONDS, Reporter

INPUT_WAIT = "input_wait"  # the key tpurun.observe puts into an epoch's logs for this line
#: The key of the epoch's throughput figures (``tokens_per_second`` or ``examples_per_second``,
#: ``tflops_per_device``, ``mfu``) in the logs the reporter gets (not the CSV's, nor Keras').
THROUGHPUT = "throughput"


def metric_parts(logs: Mapping[str, Any] | None) -> list[str]:
    """``name value`` for each metric: the loss first, then the training metrics, then the
    validation ones in the same order, the learning rate last."""
    if not logs:
        return []

    keys = sorted(  # stable: otherwise in the logs' order
        (k for k in logs if k not in ("learning_rate", INPUT_WAIT, THROUGHPUT)),
        key=lambda k: (k.startswith("val_"), k.removeprefix("val_") != "loss"),
    )
    parts = [f"{key} {_num(logs[key])}" for key in keys]
    if "learning_rate" in logs:
        parts.append(f"lr {_num(logs['learning_rate'])}")
    return parts


def flop_rate(tflops: float) -> str:
    """A FLOP rate in the unit that reads: ``78.1 TFLOP/s`` on a TPU, ``2.9 MFLOP/s`` for a toy
    model on a CPU (not ``2.91e-06 TFLOP/s``)."""
    for prefix, scale in (("P", 1e3), ("T", 1.0), ("G", 1e-3), ("M", 1e-6)):
        if tflops >= scale:
            return f"{tflops / scale:.3g} {prefix}FLOP/s"
    return f"{tflops * 1e9:.3g} kFLOP/s"


def format_metrics(logs: Mapping[str, Any] | None) -> str:
    return "  ".join(metric_parts(logs))


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


def took(seconds: float) -> str:
    """A duration as a person reads it, a tenth of a second finer under a minute."""
    return f"{seconds:.1f}s" if seconds < 60 else format_duration(seconds)


def epoch_label(epoch: int, epochs: int) -> str:
    """``epoch  7/30``: as wide at epoch 7 as at epoch 30, so the columns after it stay put."""
    return f"epoch {epoch:>{len(str(epochs))}}/{epochs}"


def wrap_parts(
    head: str, parts: list[str], width: int, sep: str = "  ", indent: str | None = None
) -> list[str]:
    """``head`` and ``parts`` joined by ``sep`` in lines of at most ``width``, broken between parts
    only (never inside ``loss 0.1``); the lines after the first start with ``indent`` (by default,
    as many spaces as put the first part of each under the first part of the first line)."""
    lines, line = [], head
    indent = " " * (len(head) + len(sep)) if indent is None else indent
    for part in parts:
        if line.strip() and len(line) + len(sep) + len(part) > width:
            lines.append(line)
            line = indent + part
        else:
            line = f"{line}{sep if line.strip() else ''}{part}"
    return [*lines, line]


def _first_steps(steps: int) -> str:
    return "the first step" if steps == 1 else f"the first {steps} steps"


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
            f"{plan.global_batch_size} ({plan.per_core_batch_size} x {plan.replicas}){_accumulated(plan)}, lr "
            f"{plan.learning_rate:.4g}, steps_per_execution {plan.steps_per_execution}{_reader(plan)} "
            f"-> {run_dir}"
        )
        self._compiling_note()

    def _compiling_note(self) -> None:
        self._line("compiling the training step (the first step waits for it)...")

    def compiled(self, seconds, steps, loaded=0) -> None:
        # Programs JAX loaded from its compilation cache instead of compiling (a rerun, a resume).
        cache = f" ({loaded} program(s) loaded from the compilation cache)" if loaded else ""
        self._line(
            f"compiled: {_first_steps(steps)} took {took(seconds)}, compiling included{cache}"
        )

    def progress(self, epoch, step, steps, rate, eta, logs) -> None:
        if step >= steps:
            return  # the epoch's line follows
        pct = 100 * step / steps if steps else 0
        metrics = format_metrics(logs)
        self._line(
            f"{epoch_label(epoch, self.epochs)}  step {step}/{steps} ({pct:.0f}%)  {rate:,.0f} ex/s  "
            f"eta {format_duration(eta)}" + (f"  {metrics}" if metrics else "")
        )

    def validation_progress(self, epoch, step, steps) -> None:
        self._line(f"{epoch_label(epoch, self.epochs)}  validating {step}/{steps}")

    def _epoch_parts(self, logs, seconds, rate) -> list[str]:
        parts = [*metric_parts(logs), f"{took(seconds)}  {rate:,.0f} ex/s"]
        figures = (logs or {}).get(THROUGHPUT) or {}
        if figures.get("tokens_per_second") is not None:  # what language-model users compare
            parts[-1] = f"{took(seconds)}  {figures['tokens_per_second']:,.0f} tok/s"
        if figures.get("tflops_per_device") is not None:
            parts.append(f"{flop_rate(figures['tflops_per_device'])}/device")
        if figures.get("mfu") is not None:  # absent where the device's peak is unknown (a CPU)
            parts.append(f"MFU {figures['mfu']:.1%}")
        wait = (logs or {}).get(INPUT_WAIT)
        if wait is not None:  # a share of the epoch's time, not a metric: said as one
            parts.append(f"input wait {float(wait):.0%}")
        return parts

    def epoch_end(self, epoch, logs, seconds, rate) -> None:
        self._line(
            "  ".join([epoch_label(epoch, self.epochs), *self._epoch_parts(logs, seconds, rate)])
        )

    def finish(self, summary) -> None:
        self.close()
        best = summary.get("best") or {}
        best_text = ""
        if best.get("value") is not None:
            best_text = f", best {best['monitor']} {_num(best['value'])} at epoch {best['epoch']}"
        self._line(
            f"{summary['status']}: {done_text(summary)}{best_text} -> {summary.get('run_dir')}"
        )


def done_text(summary: Mapping[str, Any]) -> str:
    """What this session trained, in its time, and on a resumed run the run's total: "36 epoch(s)
    in 24s (epochs 5-40); 40 epoch(s) in all". The summary's ``resumes`` say where a session began
    (one from before this session's ``started`` is an earlier session's)."""
    done, took = summary["epochs_completed"], format_duration(summary.get("seconds"))
    resumes, started = summary.get("resumes") or [], summary.get("started")
    resumed = (
        resumes[-1] if resumes and started and resumes[-1].get("time", "") >= started else None
    )
    if resumed is None:
        return f"{done} epoch(s) in {took}"
    first, step = resumed["epoch"], resumed.get("step", 0)
    ran = done - first
    if ran <= 0:
        return f"nothing to train in {took}; {done} epoch(s) in all"
    where = (
        f"epoch {first + 1} from step {step + 1} to {done}"
        if step
        else f"epochs {first + 1}-{done}"
    )
    return f"{ran} epoch(s) in {took} ({where}); {done} epoch(s) in all"


class TaskProgress:
    """A progress bar for a long step (counting, writing): Rich on a terminal, plain lines elsewhere.

    Use as a context manager and call it with ``(done, total)``. Plain mode writes a line at most
    every ``PLAIN_PROGRESS_SECONDS`` and one at the end.
    """

    def __init__(
        self, label: str, unit: str, plain: bool, stream: TextIO | None = None, closing: bool = True
    ):
        # closing: a plain last line with the count and the time (leave it to a report that
        # says them, so that one piece of work is not given two times).
        self.label, self.unit, self.plain, self.closing = label, unit, plain, closing
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
        elif self._done and exc[0] is None and self.closing:
            elapsed = time.monotonic() - self._start
            self.stream.write(
                f"[tpurun] {self.label}: {self._done:,} {self.unit} in {format_duration(elapsed)}\n"
            )
            self.stream.flush()


def _reader(plan: Any) -> str:
    """``, reader: native (TensorFlow is not installed)``: what reads the records, and why."""
    name = getattr(plan, "reader", "")
    return f", reader: {name} ({plan.reader_reason})" if name else ""


def _accumulated(plan: Any) -> str:
    """``, 4 accumulated: 512 an update`` under gradient accumulation; nothing without it."""
    n = getattr(plan, "gradient_accumulation_steps", 1)
    return f", {n} accumulated: {plan.effective_global_batch_size} an update" if n > 1 else ""
