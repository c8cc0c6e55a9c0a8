"""The live view of a run on a real terminal (:func:`tpurun.display.make_reporter` picks it there;
notebooks, CI and pipes get :class:`~tpurun.display.lines.PlainReporter`'s lines)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO

from tpurun.display.lines import PlainReporter, epoch_label, metric_parts, wrap_parts
from tpurun.display.reporter import LIVE_REFRESH_SECONDS

RATE_SECONDS = 5.0  # the rate shown follows the executions of about the last 5 seconds


def _clock(seconds: float | None) -> str:
    """``m:ss`` or ``h:mm:ss``, as a clock reads; ``-:--`` when unknown."""
    if seconds is None:
        return "-:--"
    m, s = divmod(int(max(seconds, 0)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class LiveReporter(PlainReporter):
    """A Rich live view for a real terminal, below the lines the run prints.

    Two lines, redrawn four times a second from what is known, so they stay true while one long
    call runs (starting up, compiling, an execution of many steps, validation)::

        epoch  7/30 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━   0/11   1,945 ex/s  eta 0:01, run 0:31
        running steps 1-11... 0:00  loss 0.1806  accuracy 0.9432

    The step count moves at each execution's end; the rate and the ETAs come from executions that
    did not compile, and read ``-`` until one has run. That rate counts training steps alone; an
    epoch line's is the whole epoch's, validation and saving included, hence lower. Every line
    printed (messages, epochs) goes above the view, whole, wrapped between metrics, never inside
    one.
    """

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        # clock: seconds as time.monotonic counts them; a test passes one it moves by hand.
        from rich.console import Console

        super().__init__(stream)
        self.clock = clock
        self.console = Console(file=self.stream, highlight=False)
        self._live: Any = None
        self._closed = False
        self._batch = self._epoch = self._steps = self._step = self._val_steps = self._val_step = 0
        self._phase, self._since = "starting up: frameworks, data, model", self.clock()
        self._running: tuple[int, int, float, bool] | None = None  # first, last, since, compiling
        self._compiling = self._val_compiling = True
        self._step_seconds: float | None = None  # per training step, from executions that ran
        self._val_seconds: float | None = None
        self._metrics: list[str] = []

    @property
    def progress_interval(self) -> float:
        return LIVE_REFRESH_SECONDS

    # ------------------------------------------------------------------ printing above the view
    def _print(self, text: str, style: str | None = None) -> None:
        self._ensure_live()
        self.console.print(text, style=style, markup=False)

    def _line(self, text: str) -> None:
        self._print(text)

    def message(self, text: str, level: str = "info") -> None:
        label = "warning: " if level == "warn" else ""
        self._print(f"{label}{text}", {"warn": "yellow", "note": "dim"}.get(level))

    def _ensure_live(self) -> None:
        if self._live is None and not self._closed:
            from rich.live import Live

            self._live = Live(self, console=self.console, transient=True, refresh_per_second=4)
            self._live.start()

    def close(self) -> None:
        self._closed = True
        if self._live is not None:
            self._live.stop()
            self._live = None

    # ------------------------------------------------------------------------------- events
    def _set_phase(self, phase: str) -> None:
        self._phase, self._since = phase, self.clock()

    def start(self, plan, run_dir, epochs, initial_epoch) -> None:
        self._batch, self._steps = plan.global_batch_size, plan.steps_per_epoch
        self._epoch = initial_epoch + 1
        self._set_phase("compiling the training step")
        super().start(plan, run_dir, epochs, initial_epoch)

    def _compiling_note(self) -> None:
        """The view says it, with its clock."""

    def epoch_begin(self, epoch, steps) -> None:
        self._epoch, self._steps, self._step, self._metrics = epoch, steps, 0, []
        self._running = None

    def execution_begin(self, epoch, first, last) -> None:
        self._end_execution()
        self._step = max(self._step, first - 1)
        self._running = (first, last, self.clock(), self._compiling)
        if not self._compiling:
            steps = f"steps {first}-{last}" if last > first else f"step {first}"
            self._set_phase(f"running {steps}")

    def _end_execution(self) -> None:
        if self._running is not None:
            first, last, since, compiling = self._running
            if not compiling:  # a moving average over about RATE_SECONDS of executions
                took, old = self.clock() - since, self._step_seconds
                new = took / (last - first + 1)
                self._step_seconds = (
                    new if old is None else old + min(took / RATE_SECONDS, 1) * (new - old)
                )
            self._step = max(self._step, last)
        self._running = None

    def progress(self, epoch, step, steps, rate, eta, logs) -> None:
        self._step = step
        if logs:
            self._metrics = metric_parts(logs)

    def compiled(self, seconds, steps, loaded=0) -> None:
        self._compiling = False
        self._set_phase("training")
        super().compiled(seconds, steps, loaded)

    def validation_begin(self, epoch, steps) -> None:
        self._end_execution()
        self._val_steps, self._val_step = steps, 0
        self._set_phase("validating")

    def validation_progress(self, epoch, step, steps) -> None:
        self._val_step = step

    def validation_end(self, epoch, seconds) -> None:
        self._val_compiling, self._val_seconds = False, seconds

    def epoch_end(self, epoch, logs, seconds, rate) -> None:
        self._end_execution()
        self._step, self._metrics = self._steps, metric_parts(logs)  # the epoch's own numbers
        self._set_phase("saving")  # the CSV row and the checkpoint are written next
        for line in wrap_parts(
            epoch_label(epoch, self.epochs),
            self._epoch_parts(logs, seconds, rate),
            self.console.width,
        ):
            self._print(line)

    # ----------------------------------------------------------------------------- the view
    def _etas(self, now: float) -> tuple[float | None, float | None]:
        """Seconds left in this epoch and in the run, from executions and validations that ran."""
        per_step, val = self._step_seconds, self._val_seconds or 0.0
        if per_step is None or not self._steps:
            return None, None
        if self._phase == "validating":
            left = max(val - (now - self._since), 0.0)
        elif self._phase == "saving":
            left = 0.0
        else:
            first, since = self._running[::2] if self._running else (self._step + 1, now)
            left = max((self._steps - first + 1) * per_step - (now - since), 0.0) + val
        return left, left + (self.epochs - self._epoch) * (self._steps * per_step + val)

    def lines(self, width: int, now: float | None = None) -> list[str]:
        """The view as text, for a terminal ``width`` columns wide."""
        return [text.plain for text in self._texts(width, self.clock() if now is None else now)]

    def _texts(self, width: int, now: float) -> list[Any]:
        from rich.text import Text

        status = f"{self._phase}... {_clock(now - self._since)}"
        if not self.started:
            return [Text(status, no_wrap=True, overflow="ellipsis")]
        if self._phase == "validating":
            compiling = ", compiling" if self._val_compiling else ""
            status = f"validating {self._val_step}/{self._val_steps}{compiling}... {_clock(now - self._since)}"
        epoch_eta, run_eta = self._etas(now)
        head = epoch_label(self._epoch, self.epochs) + " "
        count = f" {self._step:>{len(str(self._steps))}}/{self._steps}"
        rate = f"{self._batch / self._step_seconds:,.0f}" if self._step_seconds else "-"
        tail = f"  {rate:>7} ex/s  eta {_clock(epoch_eta)}"
        if self._epoch < self.epochs:
            tail += f", run {_clock(run_eta)}"
        room = width - len(head) - len(count) - len("  100,000 ex/s  eta 0:00:00, run 0:00:00")
        bar_width = max(min(room, 40), 8)  # as wide all run long: the columns stay put
        done = bar_width * self._step // max(self._steps, 1)
        style = "bar.finished" if done == bar_width else "bar.complete"
        first = Text.assemble(
            (head, "bold"),
            ("━" * done, style),
            ("━" * (bar_width - done), "bar.back"),
            count,
            tail,
            no_wrap=True,
            overflow="ellipsis",
        )
        texts = [first]
        for line in wrap_parts(status, self._metrics, width, indent="  "):
            texts.append(Text(line, no_wrap=True, overflow="ellipsis"))
        return texts

    def __rich_console__(self, console: Any, options: Any):
        yield from self._texts(options.max_width, self.clock())
