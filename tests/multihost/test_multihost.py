"""Several processes training together on JAX's distributed runtime, on 127.0.0.1: `tpurun launch`,
processes started by hand (config keys, environment variables), one writer, shares of the data,
stops every process agrees on (a signal to one process, the time limit), a lost process, a
worker's error named by its process number, and a run directory not every process can see."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import (
    ROOT,
    TPURUN,
    cli_env,
    logged_epochs,
    read_latest,
    read_log,
    read_summary,
    toy_config,
    wait_for_epoch,
    wait_until,
    write_config,
    write_toy_data,
)

import tpurun
from tpurun.multihost.shares import shares

pytestmark = pytest.mark.slow


def _env(**extra) -> dict:
    return cli_env(TPURUN_LOST_AFTER_SECONDS="8", **extra)


def _config(tmp_path, devices=4, epochs=2, n_train=512, **sections) -> Path:
    data = write_toy_data(tmp_path / "data", n_train=n_train, n_val=100, shards=4)
    train = {"epochs": epochs, "per_core_batch_size": 32 // devices, "steps_per_execution": 2,
             **sections.pop("train", {})}  # fmt: skip
    config = toy_config(data, tmp_path / "runs", runtime={"cpu_devices": devices}, train=train,
                        **sections)  # fmt: skip
    return write_config(tmp_path / "toy.yaml", config)


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
    done = subprocess.run([TPURUN, "launch", "-n", str(processes), "train", str(path)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = tmp_path / "runs" / "toy"
    summary = read_summary(run_dir)
    assert summary["processes"] == processes and summary["status"] == "completed"
    assert (summary["global_batch_size"], summary["replicas"], summary["steps_per_epoch"]) == (
        32,
        4,
        16,
    )
    holder = json.loads((run_dir / "run.lock").read_text())
    assert holder["pid"] == summary["pid"]  # the one writer held the lock and wrote the summary
    assert [r["epoch"] for r in read_log(run_dir)] == ["0", "1"]
    assert sorted(os.listdir(run_dir)) == ["checkpoints", "config.yaml", "curves.png", "log.csv",
                                           "model.keras", "run.lock", "summary.json", "train",
                                           "validation"]  # fmt: skip
    assert f"process 0 of {processes}" in done.stdout  # the chief's lines only
    assert done.stdout.count("completed:") == 1
    if processes == 2:
        # The same config on one process: the same plan, and a final validation loss within 10%
        # (the processes shuffle their own shares, so the batches differ; measured 4% apart).
        one = subprocess.run([TPURUN, "train", str(path), "--output", str(tmp_path / "one")], cwd=ROOT,
                             env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
        assert one.returncode == 0, one.stderr
        single = read_summary(tmp_path / "one" / "toy")
        for key in ("global_batch_size", "learning_rate", "steps_per_epoch", "validation_steps"):
            assert single[key] == summary[key], key
        last, last_one = read_log(run_dir)[-1], read_log(tmp_path / "one" / "toy")[-1]
        assert float(last["val_loss"]) == pytest.approx(float(last_one["val_loss"]), rel=0.10)


def _start(path, i, n, port, **env):
    return subprocess.Popen([TPURUN, "train", str(path)], cwd=ROOT, env=_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def test_processes_started_by_hand_with_config_keys_or_environment_variables(tmp_path):
    from tpurun.multihost.launch import free_port

    path = _config(tmp_path)
    port = free_port()
    by_keys = subprocess.Popen(
        [TPURUN, "train", str(path), "--set", "runtime.num_processes=2", "--set", "runtime.process_id=0",
         "--set", f"runtime.coordinator=127.0.0.1:{port}"],
        cwd=ROOT, env=_env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    by_env = _start(path, 1, 2, port, KERAS_DISTRIBUTION_JOB_ADDRESSES=f"127.0.0.1:{port}",
                    KERAS_DISTRIBUTION_NUM_PROCESSES="2", KERAS_DISTRIBUTION_PROCESS_ID="1")  # fmt: skip
    out0, err0 = by_keys.communicate(timeout=600)
    out1, err1 = by_env.communicate(timeout=600)
    assert (by_keys.returncode, by_env.returncode) == (0, 0), err0 + err1
    assert read_summary(tmp_path / "runs" / "toy")["processes"] == 2


_LAUNCHED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _no_launch_outlives_its_test():
    """A failed assertion leaves no launcher (nor its processes) training on."""
    yield
    while _LAUNCHED:
        launcher = _LAUNCHED.pop()
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)  # its own session: it and its processes
            launcher.wait()


def _launch(tmp_path: Path, path: Path, session: str, *options: str) -> subprocess.Popen:
    """``tpurun launch -n 2 train PATH OPTIONS``, its output in ``<session>.out`` and ``.err``."""
    out = open(tmp_path / f"{session}.out", "w")  # noqa: SIM115 - the child writes them
    err = open(tmp_path / f"{session}.err", "w")  # noqa: SIM115
    with out, err:
        launcher = subprocess.Popen([TPURUN, "launch", "-n", "2", "train", str(path), *options],
                                    cwd=ROOT, env=_env(), stdout=out, stderr=err, text=True,
                                    start_new_session=True)  # fmt: skip
    _LAUNCHED.append(launcher)
    return launcher


def _output(tmp_path: Path, session: str) -> tuple[str, str]:
    return (tmp_path / f"{session}.out").read_text(), (tmp_path / f"{session}.err").read_text()


def _process(launcher: subprocess.Popen, number: int) -> int:
    """The pid of the launcher's process ``number`` (its KERAS_DISTRIBUTION_PROCESS_ID)."""
    out = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True)
    for pid in map(int, out.stdout.split()):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"KERAS_DISTRIBUTION_PROCESS_ID={number}".encode() in environ:
            return pid
    raise AssertionError(f"no process {number} under the launcher ({out.stdout.split()})")


def _agreed_stops(err: str, reason: str) -> list[str]:
    """Where each process said it stopped (process 0's line, then process 1's, relayed)."""
    return re.findall(rf"^(?:\[process 1\] )?stopped: {reason}: stopped at ([^;]+);", err, re.M)


def _where(state: dict) -> str:
    """A resume point as tpurun names it ("epoch 3, step 21"; "the end of epoch 2")."""
    if state["step"]:
        return f"epoch {state['epoch'] + 1}, step {state['step']}"
    return f"the end of epoch {state['epoch']}"


def _resuming(state: dict) -> str:
    at = f"epoch {state['epoch'] + 1}" + (f", step {state['step']}" if state["step"] else "")
    return f"resuming at {at} from"


def test_stops_and_a_lost_process_on_two_processes_each_resumed_where_it_left_off(tmp_path):
    """One run directory, four sessions of `tpurun launch -n 2`: one that runs out of
    --time-limit, a resume stopped by SIGTERM to process 1 alone (a preemption notice), a resume
    that loses process 1 to SIGKILL, and a resume to the end. The SIGTERM lands inside an epoch
    (64 steps of one step per execution, a save every 8); every stop is one step both processes
    agree on, and each rerun starts exactly where the last one saved."""
    path = _config(tmp_path, epochs=40, n_train=2048, train={"steps_per_execution": 1},
                   callbacks={"checkpoint": {"every_steps": 8}})  # fmt: skip
    run_dir = tmp_path / "runs" / "toy"

    # 1. Out of time: a stop both processes agree on (their clocks differ; any one suffices).
    first = _launch(tmp_path, path, "time-limit", "--time-limit", "8s")
    assert first.wait(timeout=600) == 3, _output(tmp_path, "time-limit")
    out, err = _output(tmp_path, "time-limit")
    limited = read_latest(run_dir)
    assert (limited["epoch"], limited["step"]) > (0, 0), limited
    assert _agreed_stops(err, "train.time_limit") == [_where(limited)] * 2, err
    assert read_summary(run_dir)["status"] == "interrupted"

    # 2. The rerun resumes there. Once it saves inside a whole epoch of its own (past the rest of
    # the epoch it resumed in), SIGTERM to process 1.
    second = _launch(tmp_path, path, "sigterm")
    whole = limited["epoch"] + (1 if limited["step"] else 0)  # its first whole epoch

    def saved_inside_a_whole_epoch() -> bool:
        state = read_latest(run_dir)
        return state["epoch"] >= whole and state["step"] > 0

    wait_until(saved_inside_a_whole_epoch, second, "a save inside a whole epoch")
    os.kill(_process(second, 1), signal.SIGTERM)
    assert second.wait(timeout=300) == 3, _output(tmp_path, "sigterm")
    out, err = _output(tmp_path, "sigterm")
    assert _resuming(limited) in out, out
    stopped = read_latest(run_dir)
    assert stopped["reason"] == "SIGTERM" and 0 < stopped["step"] < 64, stopped
    assert stopped["epoch"] >= whole
    assert _agreed_stops(err, "SIGTERM") == [_where(stopped)] * 2, err  # both, at that step

    # 3. The rerun resumes at that step; process 1 is killed after its next save.
    third = _launch(tmp_path, path, "sigkill")
    wait_until(lambda: read_latest(run_dir) != stopped, third, "a save after the resume")
    os.kill(_process(third, 1), signal.SIGKILL)
    assert third.wait(timeout=300) != 0
    out, err = _output(tmp_path, "sigkill")
    assert _resuming(stopped) in out, out
    assert "tpurun launch: process 1 was killed by SIGKILL;" in err, err
    killed = read_latest(run_dir)  # the last save before the kill, whole
    assert (killed["epoch"], killed["step"]) > (stopped["epoch"], stopped["step"])

    # 4. To the end of the next epoch: each epoch logged once, every resume where it stopped.
    epochs = killed["epoch"] + 1
    path.write_text(path.read_text().replace("epochs: 40", f"epochs: {epochs}"))
    last = _launch(tmp_path, path, "finish")
    assert last.wait(timeout=600) == 0, _output(tmp_path, "finish")
    assert _resuming(killed) in _output(tmp_path, "finish")[0]
    assert logged_epochs(run_dir) == [str(i) for i in range(epochs)]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["processes"] == 2
    assert [(r["epoch"], r["step"]) for r in summary["resumes"]] == [
        (s["epoch"], s["step"]) for s in (limited, stopped, killed)
    ]


def test_a_workers_error_is_shown_with_its_process_number(tmp_path):
    """A model factory that fails on process 1 only: the launcher relays process 1's message
    under ``[process 1]``, names it with its own exit code (it leaves at once, without waiting
    for process 0 in JAX's shutdown), stops process 0 and exits 2."""
    factory = tmp_path / "one_fails.py"
    factory.write_text(
        "import os\n\nimport keras\n\n\n"
        "def model():\n"
        "    if os.environ['KERAS_DISTRIBUTION_PROCESS_ID'] == '1':\n"
        "        raise RuntimeError('process 1 cannot build this model')\n"
        "    inputs = keras.Input(shape=(8,), name='x')\n"
        "    return keras.Model(inputs, keras.layers.Dense(1, activation='sigmoid')(inputs))\n"
    )
    path = _config(tmp_path, model={"factory": f"{factory}:model"})
    launcher = _launch(tmp_path, path, "worker-error")
    assert launcher.wait(timeout=300) == 2, _output(tmp_path, "worker-error")
    out, err = _output(tmp_path, "worker-error")
    assert re.search(r"^\[process 1\] error: model.factory '.*one_fails.py:model' raised "
                     r"RuntimeError: process 1 cannot build this model", err, re.M), err  # fmt: skip
    assert "tpurun launch: process 1 exited with code 2; stopping the others" in err, err
    assert "stopped answering" not in err and "Check failure stack trace" not in err
    assert "process 0 of 2" in out  # process 0's own lines, passed through


def test_without_the_launcher_a_lost_process_is_named_by_the_watchdog(tmp_path):
    """The worker is frozen (SIGSTOP, as a machine that stopped): its connections stay open, so no
    collective fails, and the chief would wait in one for ever. Its heartbeat stops, and the
    chief's watchdog names it and ends the chief, after TPURUN_LOST_AFTER_SECONDS (8 here)."""
    from tpurun.multihost.launch import free_port

    path = _config(tmp_path, epochs=40)
    port = free_port()
    env = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
    }
    chief = _start(path, 0, 2, port, **env, KERAS_DISTRIBUTION_PROCESS_ID="0")
    worker = _start(path, 1, 2, port, **env, KERAS_DISTRIBUTION_PROCESS_ID="1")
    wait_for_epoch(tmp_path / "runs" / "toy", chief)
    worker.send_signal(signal.SIGSTOP)
    try:
        out, err = chief.communicate(timeout=300)  # a hang guard: the watchdog ends it
    finally:
        worker.kill()
        worker.communicate()
    assert chief.returncode == 2, err
    lost = re.findall(r"^error: process 0: (.*)$", err, re.M)
    assert len(lost) == 1, err
    assert re.fullmatch(
        r"process 1 of 2 stopped answering \d+ s ago: killed, out of memory, or its machine "
        r"stopped\. This process stops too, since the others cannot go on without it\. Rerun the "
        r"same command on every host to resume from the last checkpoint\.",
        lost[0],
    ), lost
    assert read_summary(tmp_path / "runs" / "toy")["status"] == "failed"


def test_a_run_directory_not_every_process_sees_is_refused(tmp_path):
    from tpurun.multihost.launch import free_port

    path = _config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["output"]["dir"] = "runs"  # relative to each process's working directory
    write_config(path, config)
    port = free_port()
    env = {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
    }
    procs = []
    for i in range(2):
        (tmp_path / f"host{i}").mkdir()
        procs.append(subprocess.Popen([TPURUN, "train", str(path)], cwd=tmp_path / f"host{i}",
                                      env=_env(**env, KERAS_DISTRIBUTION_PROCESS_ID=str(i)),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))  # fmt: skip
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err
        assert "is not shared: process(es) 1 of 2 cannot see what process 0 writes there" in err
        assert "gs://" in err and "Traceback" not in err


def test_a_2x4_mesh_over_two_processes_stops_together_and_resumes(
    tmp_path, tiny_presets, chat_records
):
    """`tpurun launch -n 2` with 8 CPU devices and a 2 x 4 mesh (each process holds one row: its
    4 devices split every weight; Gemma's layout splits the embedding over the data axis too, so
    no process holds it whole): a full fine-tune whose checkpoints are sharded. SIGTERM to
    process 1 mid-epoch stops both at one step; the rerun resumes there and finishes, and the
    final model.keras (gathered to the host) loads."""

    data = chat_records(96)
    config = {
        "name": "mesh",
        "model": {"preset": str(tiny_presets.gemma_mesh), "sequence_length": 16},
        "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")},
        "train": {"per_core_batch_size": 1, "epochs": 2, "steps_per_execution": 1,
                  "learning_rate": {"base": 1e-3}},
        "runtime": {"cpu_devices": 8, "mesh": {"data": 2, "model": 4}},
        "callbacks": {"checkpoint": {"every_steps": 2}},
        "output": {"dir": str(tmp_path / "runs")},
    }  # fmt: skip
    path = write_config(tmp_path / "mesh.yaml", config)
    run_dir = tmp_path / "runs" / "mesh"

    first = _launch(tmp_path, path, "sigterm")
    wait_until(lambda: read_latest(run_dir)["step"] > 0, first, "a mid-epoch save")
    os.kill(_process(first, 1), signal.SIGTERM)
    assert first.wait(timeout=300) == 3, _output(tmp_path, "sigterm")
    stopped = read_latest(run_dir)
    assert stopped["reason"] == "SIGTERM" and stopped["weights"].endswith(".orbax"), stopped
    _, err = _output(tmp_path, "sigterm")
    assert _agreed_stops(err, "SIGTERM") == [_where(stopped)] * 2, err

    last = _launch(tmp_path, path, "finish")
    assert last.wait(timeout=600) == 0, _output(tmp_path, "finish")
    assert _resuming(stopped) in _output(tmp_path, "finish")[0]
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["processes"] == 2
    assert logged_epochs(run_dir) == [str(i) for i in range(2)]
    import keras
    import numpy as np

    # Gathered from both processes' shards: the weights the last sharded checkpoint holds (read
    # back in this one process by tpurun.load, which restores onto its own devices).
    model = keras.saving.load_model(run_dir / "model.keras", compile=False)
    restored, _ = tpurun.load(str(run_dir), "latest")
    assert len(model.weights) == len(restored.weights)
    for saved, held in zip(model.weights, restored.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(saved.value), np.asarray(held.value),
                                      err_msg=saved.path)  # fmt: skip
