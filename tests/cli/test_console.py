"""Output: plain lines for notebooks, CI and pipes; a live view only on a real terminal."""

from __future__ import annotations

import io
import re
from types import SimpleNamespace

import pytest
from helpers import FakeTTY

from tpurun.display.lines import PlainReporter, format_duration
from tpurun.display.live import LiveReporter
from tpurun.display.reporter import want_plain


@pytest.mark.parametrize(
    ("env", "plain"),
    [
        ({"TERM": "xterm-256color"}, False),  # a real terminal
        (
            {"TERM": "xterm-color", "JPY_PARENT_PID": "123"},
            True,
        ),  # `!tpurun` in Jupyter/Kaggle: a pty
        ({"TERM": "xterm", "COLAB_RELEASE_TAG": "release"}, True),
        ({"TERM": "xterm", "KAGGLE_KERNEL_RUN_TYPE": "Batch"}, True),
        ({"TERM": "xterm", "CI": "true"}, True),
        ({"TERM": "dumb"}, True),
        ({"TERM": "xterm", "TPURUN_PLAIN": "1"}, True),
    ],
)
def test_plain_detection_does_not_trust_isatty_alone(env, plain):
    assert want_plain(stream=FakeTTY(), env=env) is plain


def test_pipes_and_the_flag_are_plain():
    assert want_plain(stream=io.StringIO(), env={"TERM": "xterm"}) is True
    assert want_plain(force=True, stream=FakeTTY(), env={"TERM": "xterm"}) is True


def plan(**kw):
    """What the reporters read of a Plan (its constructor belongs to tpurun.plan.plan)."""
    fields = dict(replicas=8, per_core_batch_size=16, global_batch_size=128, learning_rate=2e-3,
                  steps_per_epoch=11, validation_steps=2, steps_per_execution=11)  # fmt: skip
    return SimpleNamespace(**{**fields, **kw})


def drive(reporter):
    reporter.message("CPU via jax", "note")
    reporter.message("per-core batch size 4 is below 8", "warn")
    reporter.start(plan(), "runs/quickstart", 2, 0)
    for epoch in (1, 2):
        reporter.epoch_begin(epoch, 11)
        reporter.progress(epoch, 5, 11, 1234.5, 3.2, {"loss": 0.5, "accuracy": 0.9})
        reporter.epoch_end(
            epoch, {"loss": 0.25, "accuracy": 0.95, "learning_rate": 0.002}, 1.5, 939.0
        )
    reporter.finish({"status": "completed", "epochs_completed": 2, "seconds": 3.1,
                     "best": {"monitor": "val_accuracy", "value": 0.97, "epoch": 2}, "run_dir": "runs/quickstart"})  # fmt: skip


def test_plain_lines_have_no_escapes_and_one_line_per_epoch():
    out = io.StringIO()
    drive(PlainReporter(out))
    text = out.getvalue()
    assert "\x1b" not in text and "\r" not in text
    lines = text.splitlines()
    assert all(line.startswith("[tpurun] ") for line in lines)
    assert "[tpurun] warning: per-core batch size 4 is below 8" in lines
    epoch_lines = [line for line in lines if re.match(r"\[tpurun\] epoch \d/2  loss", line)]
    assert len(epoch_lines) == 2 and "lr 0.0020" in epoch_lines[0] and "939 ex/s" in epoch_lines[0]
    assert any("step 5/11 (45%)" in line and "eta 3s" in line for line in lines)
    assert (
        lines[-1]
        == "[tpurun] completed: 2 epoch(s) in 3s, best val_accuracy 0.9700 at epoch 2 -> runs/quickstart"
    )


def test_live_view_renders_progress_on_a_terminal():
    out = FakeTTY()
    reporter = LiveReporter(out)
    reporter.console.force_terminal = True
    drive(reporter)
    text = out.getvalue()
    assert "epoch 2/2" in text and "loss 0.2500" in text
    # Styled and redrawn for a terminal: Rich hides the cursor while it draws, and moves up over
    # the lines it drew to draw them again.
    assert "\x1b[?25l" in text and "\x1b[2K" in text


def test_durations():
    assert format_duration(5.4) == "5s"
    assert format_duration(65) == "1m05s"
    assert format_duration(3725) == "1h02m05s"
    assert format_duration(None) == "?"


def test_the_start_line_says_the_effective_batch_under_gradient_accumulation():
    out = io.StringIO()
    PlainReporter(out).start(
        plan(gradient_accumulation_steps=4, effective_global_batch_size=512), "runs/x", 2, 0
    )
    assert ", 4 accumulated: 512 an update, lr " in out.getvalue().splitlines()[0]
    out = io.StringIO()
    PlainReporter(out).start(plan(), "runs/x", 2, 0)
    assert "accumulated" not in out.getvalue()


@pytest.mark.parametrize(
    ("resumes", "expected"),
    [
        ([], "completed: 40 epoch(s) in 24s"),
        ([{"epoch": 4, "step": 0, "time": "2026-05-01T10:00:01+0000"}],
         "completed: 36 epoch(s) in 24s (epochs 5-40); 40 epoch(s) in all"),
        ([{"epoch": 4, "step": 30, "time": "2026-05-01T10:00:00+0000"}],
         "completed: 36 epoch(s) in 24s (epoch 5 from step 31 to 40); 40 epoch(s) in all"),
        # An earlier session's resume (before this one started): this session began at epoch 1.
        ([{"epoch": 4, "step": 0, "time": "2026-04-30T09:00:00+0000"}],
         "completed: 40 epoch(s) in 24s"),
    ],
    ids=["fresh", "resumed", "resumed-mid-epoch", "resumed-in-an-earlier-session"],
)  # fmt: skip
def test_the_last_line_says_what_this_session_trained_and_the_runs_total(resumes, expected):
    out = io.StringIO()
    PlainReporter(out).finish({"status": "completed", "epochs_completed": 40, "seconds": 24.2,
                               "started": "2026-05-01T10:00:00+0000", "resumes": resumes,
                               "run_dir": "runs/penguins"})  # fmt: skip
    assert out.getvalue() == f"[tpurun] {expected} -> runs/penguins\n"
