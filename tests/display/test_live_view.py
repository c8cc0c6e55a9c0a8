"""The live view as a person sees it: what it says while one long call runs, the epoch's own numbers
at its end, validation, columns that stay put, and messages on lines of their own on a real
terminal (a pty read through a small terminal model)."""

from __future__ import annotations

import io
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from helpers import ROOT, TPURUN, FakeTTY, cli_env, toy_config, write_config
from test_console import plan

from tpurun.display.lines import PlainReporter
from tpurun.display.live import LiveReporter
from tpurun.display.reporter import Reporter


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def live():
    """A live view whose clock the test moves; closed at the end."""
    reporter = LiveReporter(FakeTTY(), clock=Clock())
    reporter.console.force_terminal = True
    yield reporter
    reporter.close()


def run_epoch(view: LiveReporter, epoch: int, seconds: float, logs: dict, val_seconds: float = 0.5):
    """One epoch of 11 steps run as one execution (steps_per_execution 11, the quickstart's)."""
    view.epoch_begin(epoch, 11)
    view.execution_begin(epoch, 1, 11)
    view.clock.now += seconds
    if epoch == 1:
        view.compiled(seconds, 11)
    view.progress(epoch, 11, 11, 0.0, 0.0, logs)
    view.validation_begin(epoch, 3)
    view.clock.now += val_seconds
    view.validation_end(epoch, val_seconds)
    view.epoch_end(epoch, {**logs, "val_loss": 0.2}, seconds + val_seconds, 1000.0)


def test_the_first_execution_says_compiling_and_its_clock_moves(live):
    live.message("CPU via jax", "note")
    live.clock.now += 3
    assert live.lines(80) == ["starting up: frameworks, data, model... 0:03"]
    live.start(plan(), "runs/quickstart", 30, 0)
    live.epoch_begin(1, 11)
    live.execution_begin(1, 1, 11)
    live.clock.now += 4
    first = live.lines(80)
    assert first[0].startswith("epoch  1/30 ━") and " 0/11 " in first[0]
    assert first[1] == "compiling the training step... 0:04"
    live.clock.now += 5
    assert live.lines(80)[1] == "compiling the training step... 0:09"  # it moves
    live.compiled(9.0, 11)
    out = live.stream.getvalue()
    assert "compiled: the first 11 steps took 9.0s, compiling included" in out


def test_an_epoch_run_as_one_execution_shows_its_clock_rate_and_eta(live):
    """11 of 11 steps per execution: the count cannot move mid-epoch, everything else can."""
    live.start(plan(), "runs/quickstart", 30, 0)
    run_epoch(live, 1, 9.0, {"loss": 2.2})
    run_epoch(live, 2, 1.1, {"loss": 1.5})  # 0.1 s a step: 1,280 examples/s at 128 a batch
    live.epoch_begin(3, 11)
    live.execution_begin(3, 1, 11)
    live.clock.now += 0.4
    bar, status = live.lines(80)
    assert " 0/11 " in bar and "1,280 ex/s" in bar
    assert "eta 0:01" in bar  # 0.7 s of steps + 0.5 s of validation
    assert "run 0:44" in bar  # 1.2 s now + 27 epochs x 1.6 s
    assert status == "running steps 1-11... 0:00"
    live.clock.now += 1.0
    assert live.lines(80)[1] == "running steps 1-11... 0:01"


def test_the_count_moves_with_each_execution(live):
    live.start(plan(steps_per_execution=4), "runs/q", 3, 0)
    live.epoch_begin(1, 11)
    for first, last in ((1, 4), (5, 8)):
        live.execution_begin(1, first, last)
        live.clock.now += 1
        if first == 1:
            live.compiled(1.0, 4)
        live.progress(1, last, 11, 0, 0, {"loss": 1.0})
    live.execution_begin(1, 9, 11)
    bar, status, *_ = live.lines(80)
    assert " 8/11 " in bar and "512 ex/s" in bar and status.startswith("running steps 9-11...")


def test_at_the_epoch_end_the_view_shows_the_epoch_numbers(live):
    live.start(plan(), "runs/q", 30, 0)
    live.epoch_begin(1, 11)
    live.execution_begin(1, 1, 11)
    live.progress(1, 8, 11, 0, 0, {"loss": 0.1079, "accuracy": 0.97})  # a report before the end
    live.epoch_end(1, {"loss": 0.1083, "accuracy": 0.9702, "val_loss": 0.07}, 1.0, 1400.0)
    view = "\n".join(live.lines(160))
    assert "11/11" in view and "loss 0.1083" in view and "0.1079" not in view
    assert "epoch  1/30  loss 0.1083  accuracy 0.9702  val_loss 0.0700" in live.stream.getvalue()


def test_validation_is_shown_and_its_first_pass_compiles(live):
    live.start(plan(), "runs/q", 30, 0)
    live.epoch_begin(1, 11)
    live.execution_begin(1, 1, 11)
    live.compiled(5.0, 11)
    live.progress(1, 11, 11, 0, 0, {"loss": 2.2})
    live.validation_begin(1, 3)
    live.clock.now += 2
    assert live.lines(80)[1] == "validating 0/3, compiling... 0:02  loss 2.2000"
    live.validation_progress(1, 2, 3)
    assert live.lines(80)[1].startswith("validating 2/3, compiling...")
    live.validation_end(1, 2.0)
    live.epoch_end(1, {"loss": 2.2}, 7.0, 200.0)
    live.epoch_begin(2, 11)
    live.execution_begin(2, 1, 11)
    live.progress(2, 11, 11, 0, 0, {"loss": 1.2})
    live.validation_begin(2, 3)
    assert live.lines(80)[1] == "validating 0/3... 0:00  loss 1.2000"


def test_columns_stay_put_past_epoch_9(live):
    live.start(plan(), "runs/q", 30, 0)
    bars, lines = [], []
    for epoch in (9, 10):
        run_epoch(live, epoch, 1.0, {"loss": 0.1, "accuracy": 0.9})
        live.epoch_begin(epoch, 11)
        bars.append(live.lines(80)[0])
    assert bars[0].index("/11") == bars[1].index("/11")
    assert bars[0].index("ex/s") == bars[1].index("ex/s")
    out = io.StringIO()
    plain = PlainReporter(out)
    plain.start(plan(), "runs/q", 30, 0)
    for epoch in (9, 10):
        plain.epoch_end(epoch, {"loss": 0.1, "accuracy": 0.9}, 1.0, 1000.0)
    lines = [line for line in out.getvalue().splitlines() if "loss" in line]
    assert lines[0].index("loss") == lines[1].index("loss")
    assert lines[0].startswith("[tpurun] epoch  9/30  loss")


def test_epoch_lines_wrap_between_metrics_never_inside_one(live):
    live.console.width = 80
    live.start(plan(), "runs/q", 30, 0)
    logs = {"loss": 2.2302, "accuracy": 0.2109, "val_loss": 2.0346, "val_accuracy": 0.625}
    live.epoch_end(1, logs, 7.0, 188.0)
    live.close()
    screen = Screen(80)
    screen.feed(live.stream.getvalue())
    assert [line for line in screen.lines() if line][-2:] == [
        "epoch  1/30  loss 2.2302  accuracy 0.2109  val_loss 2.0346  val_accuracy 0.6250",
        "             7.0s  188 ex/s",
    ]


def test_plain_lines_say_compiling_and_how_long_it_took():
    out = io.StringIO()
    reporter = PlainReporter(out)
    reporter.start(plan(), "runs/q", 30, 0)
    reporter.compiled(6.4, 11)
    reporter.progress(1, 11, 11, 0.0, 0.0, {"loss": 1.0})  # the last step: the epoch line follows
    assert out.getvalue().splitlines()[1:] == [
        "[tpurun] compiling the training step (the first step waits for it)...",
        "[tpurun] compiled: the first 11 steps took 6.4s, compiling included",
    ]


def test_base_reporter_methods_are_silent_no_ops(capsys):
    reporter = Reporter()
    calls = [
        reporter.message("hello", "warn"),
        reporter.start(plan(), "runs/q", 3, 0),
        reporter.epoch_begin(1, 4),
        reporter.execution_begin(1, 1, 4),
        reporter.progress(1, 4, 4, 10.0, 0.0, {"loss": 1.0}),
        reporter.compiled(1.0, 4),
        reporter.validation_begin(1, 2),
        reporter.validation_progress(1, 1, 2),
        reporter.validation_end(1, 0.5),
        reporter.epoch_end(1, {"loss": 1.0}, 1.0, 10.0),
        reporter.finish({"status": "completed"}),
        reporter.close(),
    ]
    assert calls == [None] * len(calls)
    assert capsys.readouterr() == ("", "")
    assert reporter.started is False


# ------------------------------------------------------------------ what Progress tells the view
class Recorder(Reporter):
    def __init__(self):
        self.events: list[tuple] = []

    def __getattribute__(self, name):
        if name in {"start", "epoch_begin", "execution_begin", "progress", "compiled",
                    "validation_begin", "validation_end", "epoch_end"}:  # fmt: skip
            return lambda *args: self.events.append((name, *args))
        return super().__getattribute__(name)


def test_progress_reports_executions_compiling_validation_and_the_epoch_numbers(toy_data, tmp_path):
    """A real fit: 16 steps of 4 per execution, 4 validation batches, 2 epochs."""
    from tpurun.config import load_config
    from tpurun.training import session

    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 2, "steps_per_execution": 4})
    recorder = Recorder()
    session.run(load_config(config), reporter=recorder)
    names = [event[0] for event in recorder.events]
    assert (
        names.count("compiled") == 1
        and names.index("compiled") == names.index("execution_begin") + 1
    )
    executions = [event[2:] for event in recorder.events if event[0] == "execution_begin"]
    assert executions == [(1, 4), (5, 8), (9, 12), (13, 16)] * 2
    ends = [i for i, name in enumerate(names) if name == "epoch_end"]
    for end in ends:
        last_progress = max(i for i in range(end) if names[i] == "progress")
        assert names[last_progress + 1 : end] == ["validation_begin", "validation_end"]
        step, steps, logs = recorder.events[last_progress][2], recorder.events[last_progress][3], recorder.events[last_progress][6]  # fmt: skip
        epoch_logs = recorder.events[end][2]
        assert step == steps == 16
        assert logs["loss"] == pytest.approx(epoch_logs["loss"])  # the view ends on the epoch's
    assert recorder.events[ends[0] - 2][1:3] == (1, 4)  # validation_begin(epoch 1, 4 batches)


# -------------------------------------------------------------------- a real terminal, via a pty
class Screen:
    """Just enough of a terminal for Rich's live display: text, \\r, \\n, cursor up/down/column,
    erase in line, cursor visibility; colours are ignored. Rows are never scrolled away."""

    CSI = re.compile(r"\x1b\[([?0-9;]*)([A-Za-z])")

    def __init__(self, width: int):
        self.width, self.rows, self.row, self.col, self.cursor_visible = width, [[]], 0, 0, True

    def feed(self, data: str) -> None:
        i = 0
        while i < len(data):
            match = self.CSI.match(data, i)
            if match:
                self._csi(match.group(1), match.group(2))
                i = match.end()
                continue
            char, i = data[i], i + 1
            if char == "\r":
                self.col = 0
            elif char == "\n":  # as a pty passes it on (onlcr): a new line, at its start
                self._move(self.row + 1)
                self.col = 0
            elif char >= " ":
                if self.col >= self.width:  # autowrap
                    self._move(self.row + 1)
                    self.col = 0
                line = self.rows[self.row]
                line.extend(" " * (self.col + 1 - len(line)))
                line[self.col] = char
                self.col += 1

    def _move(self, row: int) -> None:
        self.row = max(row, 0)
        while len(self.rows) <= self.row:
            self.rows.append([])

    def _csi(self, params: str, command: str) -> None:
        n = int(params) if params.isdigit() else 1
        if command == "A":
            self._move(self.row - n)
        elif command == "B":
            self._move(self.row + n)
        elif command == "G":
            self.col = n - 1
        elif command == "K":
            line = self.rows[self.row]
            del line[0 if params == "2" else self.col :]
            if params == "2":
                line.extend(" " * self.col)
        elif command in "hl" and params == "?25":
            self.cursor_visible = command == "h"

    def lines(self) -> list[str]:
        return ["".join(row).rstrip() for row in self.rows]


@pytest.mark.slow
def test_a_stop_message_gets_lines_of_its_own_on_a_terminal(toy_data, tmp_path):
    """Ctrl-C mid-training in an 80-column terminal: the live view is gone, the message starts a
    line, and the cursor is visible again."""
    import fcntl
    import pty
    import struct
    import termios

    runs = Path(tempfile.mkdtemp(prefix="lv"))  # short: the checkpoint path fits in 80 columns
    path = write_config(tmp_path, toy_config(toy_data, runs, train={"epochs": 400}))
    env = cli_env(plain=False, TERM="xterm-256color", COLUMNS="80", LINES="30")
    controller, worker = pty.openpty()
    fcntl.ioctl(worker, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 80, 0, 0))
    proc = subprocess.Popen([TPURUN, "train", str(path)], stdin=worker, stdout=worker,
                            stderr=worker, env=env, cwd=ROOT, close_fds=True)  # fmt: skip
    os.close(worker)
    raw, sent, deadline = b"", False, time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 0.2)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the worker side closed: the process is gone
                break
            if not chunk:
                break
            raw += chunk
        if not sent and re.search(rb"epoch +2/400", raw):  # training is under way
            proc.send_signal(signal.SIGINT)
            sent = True
        if proc.poll() is not None and not ready:
            break
    os.close(controller)
    assert proc.wait(timeout=60) == 3, raw.decode(errors="replace")[-2000:]
    screen = Screen(80)
    screen.feed(raw.decode("utf-8", errors="replace"))
    lines = [line for line in screen.lines() if line]
    stopped = [i for i, line in enumerate(lines) if "stopped: SIGINT" in line]
    assert stopped and lines[stopped[0]].startswith("stopped: SIGINT: stopped at "), lines[-6:]
    message = " ".join(lines[stopped[0] :])
    assert f"{runs}/toy/checkpoints." in message.split()  # wrapped between words, never in a path
    assert all(len(line) <= 80 for line in lines[stopped[0] :])
    shutil.rmtree(runs, ignore_errors=True)
    assert not any("━" in line or "... " in line for line in lines), lines[-6:]  # the view is gone
    assert screen.cursor_visible
