"""Signals during start-up, on the one signal route (tpurun.training.signals.SIGNALS). One in the
command line's first moments, while Typer builds the commands: ``train`` stops with exit 3 and its
one line, as it does later in start-up; it is not lost when the process started with SIGINT
ignored (a background job of a script), and other commands still read it as Ctrl-C. And one whose
exception a framework's C++ code turned into another error, or swallowed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import typer
import yaml
from conftest import ROOT, _cli_env, toy_config

from tpurun.cli.boundary import exit_codes
from tpurun.errors import TpurunError
from tpurun.training.signals import SIGNALS, Signalled, Stop


def run_signalled(args: list[str], sig: str = "SIGINT", ignored: bool = False):
    """The real entry point, ``tpurun.cli.app.main``, sent ``sig`` by itself as Typer starts to build
    the commands: before any command's code runs."""
    driver = (
        "import os, signal, sys\n"
        "import tpurun.cli.app as cli\n"
        "real = cli.app\n"
        "def app():\n"
        f"    os.kill(os.getpid(), signal.{sig})\n"
        "    real()\n"
        "cli.app = app\n"
        f"sys.argv = ['tpurun', *{args!r}]\n"
        "cli.main()\n"
    )
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None
    return subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                          env=_cli_env(None), cwd=ROOT, timeout=600, preexec_fn=ignore)  # fmt: skip


@pytest.fixture
def config(tmp_path, toy_data):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(toy_config(toy_data, tmp_path / "runs", train={"epochs": 3})))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(
    "ignored", [False, True], ids=["sigint-default", "sigint-inherited-ignored"]
)
def test_train_signalled_while_typer_starts_exits_3_in_one_line(config, ignored):
    result = run_signalled(["train", str(config)], ignored=ignored)
    assert result.returncode == 3, (result.returncode, result.stdout[-500:], result.stderr[-1500:])
    assert result.stderr == (
        "stopped: SIGINT before training started: no step ran, nothing is lost. Run the same "
        "command again to train.\n"
    )
    assert "epoch" not in result.stdout


@pytest.mark.slow
def test_sigterm_while_typer_starts_stops_train_the_same_way(config):
    result = run_signalled(["train", str(config)], sig="SIGTERM")
    assert result.returncode == 3, result.stderr[-1500:]
    assert result.stderr.startswith("stopped: SIGTERM before training started")


@pytest.mark.slow
def test_other_commands_read_it_as_ctrl_c_or_not_at_all_when_ignored(config):
    interrupted = run_signalled(["config", str(config), "--check"])
    assert (interrupted.returncode, interrupted.stderr) == (130, "interrupted\n")
    ignored = run_signalled(["config", str(config), "--check"], ignored=True)
    assert ignored.returncode == 0 and ignored.stdout.startswith(f"{config}: valid\n"), (
        ignored.stderr
    )
    terminated = run_signalled(["config", str(config), "--check"], sig="SIGTERM")
    assert terminated.returncode == -signal.SIGTERM


# ---------------------------------------------- a signal's exception that a framework mishandles
def _signal_lost_in_a_framework() -> None:
    """SIGINT whose exception is caught where it lands, as TensorFlow's C++ ``nest.flatten`` does
    (it prints a SystemError and raises a bare TypeError instead; exit 1, 'unexpected failure')."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
    except Signalled:
        return
    raise AssertionError("the handler did not raise")


def test_a_signal_a_framework_turned_into_another_error_still_exits_3(capsys):
    with pytest.raises(typer.Exit) as info, exit_codes(train=True):
        _signal_lost_in_a_framework()
        raise TypeError  # a fresh error, not chained to the signal's
    assert info.value.exit_code == 3
    assert capsys.readouterr().err.startswith("stopped: SIGINT before training started")


def test_a_signal_a_framework_swallowed_is_handed_to_training():
    stop = Stop()
    with SIGNALS.command(train=True):
        _signal_lost_in_a_framework()  # start-up goes on, as if nothing came
        with SIGNALS.training(stop):
            assert stop.reason == "SIGINT"  # training stops at its first step (exit 3)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_user_errors_after_a_lost_signal_stay_user_errors(capsys):
    with pytest.raises(typer.Exit) as info, exit_codes(train=True):
        _signal_lost_in_a_framework()
        raise TpurunError("data.train: no file matches")
    assert info.value.exit_code == 2
