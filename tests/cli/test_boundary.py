"""The command line's boundary: signals outside the training loop, and errors behind interrupts."""

from __future__ import annotations

import signal
import sys
import time

import pytest
import yaml
from conftest import FACTORIES, start_cli, toy_config

from tpurun.cli.boundary import _broken_framework
from tpurun.training.signals import SIGNALS, Signalled, interrupt_in


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_before_training_starts_exits_3_in_one_line(tmp_path, toy_data, sig):
    """Ctrl-C (or a session ending) during start-up is the README's exit 3, without log noise.
    The model factory sends the signal: start-up is under way, and no step has run."""
    path = tmp_path / "exp.yaml"
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 50})
    config["model"] = {**config["model"], "factory": f"{FACTORIES}:mlp_after_a_signal",
                       "kwargs": {"signal": sig}}  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    proc = start_cli("train", str(path))
    out, err = proc.communicate(timeout=120)
    assert out.startswith("[tpurun] CPU via "), out
    assert proc.returncode == 3, err
    assert err == (
        f"stopped: {sig} before training started: no step ran, nothing is lost. Run the same "
        "command again to train.\n"
    )
    assert "training" not in out
    assert not list((tmp_path / "runs").glob("toy/checkpoints/*"))


def test_a_signal_during_an_import_waits_for_the_import_to_finish(tmp_path, monkeypatch):
    """An extension module interrupted mid-initialisation would print a traceback and report a
    broken install; the signal is raised once the import is done instead."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(0.3)  # the handler runs in here, inside the import\n"
        "FINISHED = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(Signalled) as info, SIGNALS.command(train=True):
        import slow_module  # noqa: F401

        time.sleep(5)  # the deferred signal arrives within 0.05 s of the import's end
    assert sys.modules["slow_module"].FINISHED
    assert str(info.value).startswith("SIGINT before training started")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back


def test_an_interrupt_inside_an_import_is_not_a_broken_install():
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as exc:
            raise ImportError("Encountered an error while initializing the extension.") from exc
    except ImportError as exc:
        assert isinstance(interrupt_in(exc), KeyboardInterrupt)
    assert interrupt_in(ValueError("x")) is None
    missing = ModuleNotFoundError("No module named 'tensorflow'", name="tensorflow")
    said = str(_broken_framework(missing))
    assert said.startswith("TensorFlow is not installed here (ModuleNotFoundError: ")
    assert "pip install 'tpurun[tensorflow]'" in said
