"""The run directory: file names, the summary, the CSV log, one writer, the lock, truthful status."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    ROOT,
    logged_epochs,
    read_summary,
    run_cli,
    start_cli,
    toy_config,
    wait_for_checkpoint,
    write_config,
)

from tpurun.errors import TpurunError
from tpurun.storage.rundir import RunDir, run_path
from tpurun.storage.summary import Summary


def test_summary_round_trips_and_ignores_keys_it_does_not_know():
    summary = Summary(status="completed", epochs_completed=3, epochs=3, best={"monitor": "loss"})
    data = summary.to_dict()
    assert data["version"] == 1 and data["status"] == "completed"
    assert Summary.from_dict({**data, "from_a_newer_tpurun": 1}) == summary


def test_run_path_keeps_a_bucket_prefix():
    assert run_path("gs://bucket/runs/", "exp") == "gs://bucket/runs/exp"
    assert run_path("runs", "exp") == os.path.abspath(
        os.path.join("runs", "exp")
    )  # printed absolute


def test_the_log_is_written_as_keras_csvlogger_writes_it_and_trimmed_on_resume(tmp_path):
    run = RunDir(str(tmp_path / "r"))
    run.create()
    run.append_log("log.csv", 0, {"loss": 0.5, "accuracy": 0.75})
    run.append_log(
        "log.csv", 1, {"loss": 0.25, "val_x": 1.0, "accuracy": 0.8}
    )  # a key not in row 1
    text = (tmp_path / "r" / "log.csv").read_text()
    assert text == "epoch,accuracy,loss\n0,0.75,0.5\n1,0.8,0.25\n"
    run.trim_log("log.csv", 1)  # one epoch checkpointed: the second row is redone
    assert (tmp_path / "r" / "log.csv").read_text() == "epoch,accuracy,loss\n0,0.75,0.5\n"
    assert run.read_log("log.csv") == [{"epoch": "0", "accuracy": "0.75", "loss": "0.5"}]
    run.unlock()


def test_a_process_that_does_not_write_writes_nothing(tmp_path):
    run = RunDir(str(tmp_path / "r"), writer=False)
    run.create()
    run.begin({"name": "x"}, Summary())
    run.append_log("log.csv", 0, {"loss": 1.0})
    run.save_checkpoint("w.weights.h5", lambda p: Path(p).write_text("w"))
    run.save_model(lambda p: Path(p).write_text("m"))
    assert run.write_error("trace") is None
    assert not (tmp_path / "r").exists()


_HOLD = """
import sys, time
from tpurun.storage.rundir import RunDir
run = RunDir(sys.argv[1])
run.create()
print("held", flush=True)
time.sleep(120)
"""


@pytest.mark.slow
def test_a_second_run_is_refused_while_one_holds_the_directory_and_a_dead_one_blocks_nothing(
    tmp_path,
):
    folder = str(tmp_path / "runs" / "toy")
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, folder], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        run = RunDir(folder)
        assert run.is_locked()
        with pytest.raises(TpurunError) as info:
            run.create()
        message = str(info.value)
        assert f"pid {holder.pid} on {socket.gethostname()}" in message
        assert "since 20" in message and "--output" in message
        # A summary left at "running" by a live process reads as running.
        (Path(folder) / "summary.json").write_text(json.dumps({"status": "running"}))
        assert run.status() == "running"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The kernel dropped the dead holder's lock: the directory is free, and the run reads as died.
    assert not run.is_locked() and run.status() == "died"
    run.create()
    assert run.is_locked()
    run.unlock()


@pytest.mark.slow
def test_two_real_train_commands_on_one_directory_then_a_sigkill_then_a_resume(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 400})
    path = write_config(tmp_path / "toy.yaml", config)
    run_dir = tmp_path / "runs" / "toy"
    first = start_cli("train", str(path), "--plain", stdout=subprocess.DEVNULL,
                      stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for_checkpoint(run_dir, first)  # an epoch is done
        second = run_cli("train", str(path), "--plain", timeout=300)
        assert second.returncode == 2, second.stderr
        assert f"in use by another tpurun run (pid {first.pid} on " in second.stderr
        assert "Traceback" not in second.stderr
        assert RunDir(str(run_dir)).status() == "running"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert RunDir(str(run_dir)).status() == "died"  # not "running" forever

    config["train"]["epochs"] = len(logged_epochs(run_dir)) + 1  # one more than the killed run
    write_config(path, config)
    third = run_cli("train", str(path), "--plain", timeout=300)
    assert third.returncode == 0, third.stderr
    assert "ended without a word" in third.stdout
    assert read_summary(run_dir)["status"] == "completed"
