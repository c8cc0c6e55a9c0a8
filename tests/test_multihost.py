"""Several processes training together on JAX's distributed runtime, on 127.0.0.1: `tpurun launch`,
processes started by hand (config keys, environment variables), one writer, shares of the data,
stops every process agrees on, a lost process, and a run directory not every process can see."""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, toy_config, write_toy_data
from conftest import _cli_env as cli_env

from tpurun.multihost.shares import shares

pytestmark = pytest.mark.slow
EXE = str(Path(sys.executable).parent / "tpurun")


def _env(**extra) -> dict:
    return cli_env({"TPURUN_LOST_AFTER_SECONDS": "8", **extra})


def _config(tmp_path, devices=4, epochs=2, **train) -> Path:
    data = write_toy_data(tmp_path / "data", n_train=512, n_val=100, shards=4)
    config = toy_config(data, tmp_path / "runs", runtime={"cpu_devices": devices},
                        train={"epochs": epochs, "per_core_batch_size": 32 // devices,
                               "steps_per_execution": 2, **train})  # fmt: skip
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _log(run_dir: Path) -> list[dict]:
    with open(run_dir / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_shares_read_every_record_once_with_more_or_fewer_files_than_processes(tmp_path):
    from tpurun.config import DataConfig
    from tpurun.data import pipeline
    from tpurun.data.write import write_shards

    records = [{"i": i} for i in range(37)]
    data = DataConfig.model_validate(
        {"train": "x", "features": {"i": {"type": "int64"}}, "inputs": "i", "targets": "i"}
    )
    for files_n, processes in ((5, 2), (8, 4), (2, 4), (1, 3)):
        files = sorted(write_shards(str(tmp_path / f"d{files_n}-{processes}"), records, files_n))
        counts = [len(records) // files_n + (k < len(records) % files_n) for k in range(files_n)]
        seen = []
        for share in shares(files, counts, processes):
            ds = pipeline.make_dataset(share.files, data, 1, training=False, shard=share.shard)
            ids = [int(x.numpy()[0]) for x, _ in ds]
            assert len(ids) == share.records
            seen += ids
        assert sorted(seen) == list(range(37)), (files_n, processes)  # each record once


@pytest.mark.parametrize("processes", [2, 4])
def test_launch_trains_with_one_writer_and_the_plan_of_one_process(tmp_path, processes):
    path = _config(tmp_path)
    done = subprocess.run([EXE, "launch", "-n", str(processes), "train", str(path)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "runs" / "toy"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["processes"] == processes and summary["status"] == "completed"
    assert (summary["global_batch_size"], summary["replicas"], summary["steps_per_epoch"]) == (
        32,
        4,
        16,
    )
    holder = json.loads((run_dir / "run.lock").read_text())
    assert holder["pid"] == summary["pid"]  # the one writer held the lock and wrote the summary
    assert [r["epoch"] for r in _log(run_dir)] == ["0", "1"]
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "config.yaml", "curves.png", "log.csv",
                                           "model.keras", "run.lock", "summary.json",
                                           "tensorboard"]  # fmt: skip
    assert f"process 0 of {processes}" in done.stdout  # the chief's lines only
    assert done.stdout.count("completed:") == 1
    if processes == 2:
        # The same config on one process: the same plan, and a final validation loss within 10%
        # (the processes shuffle their own shares, so the batches differ; measured 4% apart).
        one = subprocess.run([EXE, "train", str(path), "--output", str(tmp_path / "one")], cwd=ROOT,
                             env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
        assert one.returncode == 0, one.stderr
        single = json.loads((tmp_path / "one" / "toy" / "summary.json").read_text())
        for key in ("global_batch_size", "learning_rate", "steps_per_epoch", "validation_steps"):
            assert single[key] == summary[key], key
        last, last_one = _log(run_dir)[-1], _log(tmp_path / "one" / "toy")[-1]
        assert float(last["val_loss"]) == pytest.approx(float(last_one["val_loss"]), rel=0.10)


def _start(path, i, n, port, **env):
    return subprocess.Popen([EXE, "train", str(path)], cwd=ROOT, env=_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def test_processes_started_by_hand_with_config_keys_or_environment_variables(tmp_path):
    from tpurun.multihost.launch import free_port

    path = _config(tmp_path)
    port = free_port()
    by_keys = subprocess.Popen(
        [EXE, "train", str(path), "--set", "runtime.num_processes=2", "--set", "runtime.process_id=0",
         "--set", f"runtime.coordinator=127.0.0.1:{port}"],
        cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    by_env = _start(path, 1, 2, port, KERAS_DISTRIBUTION_JOB_ADDRESSES=f"127.0.0.1:{port}",
                    KERAS_DISTRIBUTION_NUM_PROCESSES="2", KERAS_DISTRIBUTION_PROCESS_ID="1")  # fmt: skip
    out0, err0 = by_keys.communicate(timeout=600)
    out1, err1 = by_env.communicate(timeout=600)
    assert (by_keys.returncode, by_env.returncode) == (0, 0), err0 + err1
    assert json.loads((tmp_path / "runs" / "toy" / "summary.json").read_text())["processes"] == 2


def _launch_until_training(path):
    proc = subprocess.Popen([EXE, "launch", "-n", "2", "train", str(path)], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    return proc


def _children(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _wait_for_epoch(run_dir: Path, proc, epochs: int = 1):
    deadline = time.monotonic() + 300
    while not (run_dir / "log.csv").exists() or len(_log(run_dir)) < epochs:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)


def test_sigterm_to_one_process_stops_all_at_the_same_step_and_a_rerun_continues(tmp_path):
    path = _config(tmp_path, epochs=40)
    run_dir = tmp_path / "runs" / "toy"
    proc = _launch_until_training(path)
    _wait_for_epoch(run_dir, proc)
    workers = _children(proc.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGTERM)  # process 1 only, as a preemption notice would
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, out + err
    state = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert state["reason"] in ("SIGTERM", "epoch")  # mid-epoch, or at the epoch end it landed on
    # Both processes stopped (exit 3) at the same place, the one saved.
    where = re.findall(r"^(\[process 1\] )?stopped: SIGTERM: stopped at ([^;]+);", err, re.M)
    assert len(where) == 2 and where[0][1] == where[1][1], err
    path.write_text(path.read_text().replace("epochs: 40", f"epochs: {state['epoch'] + 2}"))
    done = subprocess.run([EXE, "launch", "-n", "2", "train", str(path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"resuming at epoch {state['epoch'] + 1}" in done.stdout
    epochs = [r["epoch"] for r in _log(run_dir)]
    assert epochs == [str(i) for i in range(state["epoch"] + 2)]  # each epoch once


def test_a_killed_process_ends_the_others_and_a_rerun_resumes(tmp_path):
    path = _config(tmp_path, epochs=40)
    run_dir = tmp_path / "runs" / "toy"
    proc = _launch_until_training(path)
    _wait_for_epoch(run_dir, proc)
    os.kill(_children(proc.pid)[1], signal.SIGKILL)
    started = time.monotonic()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.monotonic() - started < 60
    assert "tpurun launch: process 1 was killed by SIGKILL;" in err
    done_epochs = len(_log(run_dir))
    path.write_text(path.read_text().replace("epochs: 40", f"epochs: {done_epochs + 1}"))
    done = subprocess.run([EXE, "launch", "-n", "2", "train", str(path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert [r["epoch"] for r in _log(run_dir)] == [str(i) for i in range(done_epochs + 1)]


def test_without_the_launcher_a_lost_process_is_named_by_the_watchdog(tmp_path):
    from tpurun.multihost.launch import free_port

    path = _config(tmp_path, epochs=40)
    port = free_port()
    env = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
    }
    chief = _start(path, 0, 2, port, **env, KERAS_DISTRIBUTION_PROCESS_ID="0")
    worker = _start(path, 1, 2, port, **env, KERAS_DISTRIBUTION_PROCESS_ID="1")
    _wait_for_epoch(tmp_path / "runs" / "toy", chief)
    worker.kill()
    started = time.monotonic()
    out, err = chief.communicate(timeout=120)
    assert chief.returncode == 2 and time.monotonic() - started < 60, err
    assert "process 1 of 2 stopped answering" in err or "another process is gone" in err
    assert (
        json.loads((tmp_path / "runs" / "toy" / "summary.json").read_text())["status"] == "failed"
    )
    worker.communicate()


def test_a_run_directory_not_every_process_sees_is_refused(tmp_path):
    from tpurun.multihost.launch import free_port

    path = _config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["output"]["dir"] = "runs"  # relative to each process's working directory
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
    }
    procs = []
    for i in range(2):
        (tmp_path / f"host{i}").mkdir()
        procs.append(subprocess.Popen([EXE, "train", str(path)], cwd=tmp_path / f"host{i}",
                                      env=_env(**env, KERAS_DISTRIBUTION_PROCESS_ID=str(i)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err
        assert "is not shared: process(es) 1 of 2 cannot see what process 0 writes there" in err
        assert "gs://" in err and "Traceback" not in err
