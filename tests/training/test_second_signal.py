"""A second Ctrl-C during the stop's own save: the process stops at once (KeyboardInterrupt, exit
130 from the command line), the save it cut short is never committed, and the previous resume
point stays whole, so the rerun ends where the unbroken run does."""

from __future__ import annotations

import os
import signal
import time

import pytest
from helpers import read_log, read_summary, signal_at, toy_config

import tpurun
from tpurun.storage.rundir import RunDir
from tpurun.training.checkpoints import resume

pytestmark = pytest.mark.slow


def _config(toy_data, tmp_path, name: str) -> dict:
    return toy_config(toy_data, tmp_path / "runs", name=name,
                      train={"epochs": 3, "steps_per_execution": 2})  # fmt: skip


@pytest.mark.parametrize("when", ["after_the_weights", "before_the_weights"])
def test_a_second_ctrl_c_during_the_stops_save_keeps_the_previous_point(
    toy_data, tmp_path, monkeypatch, when
):
    unbroken = tpurun.train(_config(toy_data, tmp_path, "unbroken"), verbose=False)
    config = _config(toy_data, tmp_path, "twice")
    config["callbacks"] = {"extra": [signal_at(tmp_path / "fired", 2, 4, "SIGINT")]}
    real = RunDir.save_checkpoint
    seen = []

    def save(run, name, write):
        """The stop's save (epoch 2, step 4): the second Ctrl-C arrives while it writes, with
        the weights complete under their temporary name, or before a byte of them."""
        if not name.startswith("latest-e0001-s0000004"):
            return real(run, name, write)

        def interrupted(path):
            seen.append(path)
            if when == "after_the_weights":
                write(path)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # the handler raises KeyboardInterrupt here

        return real(run, name, interrupted)

    monkeypatch.setattr(RunDir, "save_checkpoint", save)
    with pytest.raises(KeyboardInterrupt):
        tpurun.train(config, verbose=False)
    monkeypatch.setattr(RunDir, "save_checkpoint", real)
    run_dir = tmp_path / "runs" / "twice"
    assert len(seen) == 1  # the stop's save began
    assert not list(run_dir.rglob(".tmp-*"))  # its temporary file is gone
    assert not list(run_dir.rglob("latest-e0001-s0000004*"))  # never committed
    point = resume.latest(RunDir(str(run_dir)))
    assert point.position == (1, 0) and point.damaged == []  # epoch 1's end, whole
    assert read_summary(run_dir)["status"] == "interrupted"

    resumed = tpurun.train(_config(toy_data, tmp_path, "twice"), verbose=False)
    assert resumed["resumes"][-1]["epoch"] == 1 and resumed["resumes"][-1]["step"] == 0
    assert read_log(run_dir) == read_log(tmp_path / "runs" / "unbroken")
    assert resumed["final_metrics"] == unbroken["final_metrics"]
