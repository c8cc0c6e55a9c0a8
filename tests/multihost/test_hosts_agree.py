"""The processes of a multi-host run agree, before the first step, on the config, the resume point
and the record counts; two started otherwise exit 2 on every process, naming the difference, and
train nothing. Processes are started by hand as `tpurun launch` starts them (its environment
variables), so that each can be given its own command line."""

from __future__ import annotations

import subprocess

import pytest
from helpers import ROOT, TPURUN, cli_env, toy_config, write_config, write_toy_data

from tpurun.multihost.launch import free_port

pytestmark = pytest.mark.slow


def _start(args: list[str], process: int, port: int) -> subprocess.Popen:
    env = cli_env(KERAS_DISTRIBUTION_JOB_ADDRESSES=f"127.0.0.1:{port}",
                  KERAS_DISTRIBUTION_NUM_PROCESSES="2",
                  KERAS_DISTRIBUTION_PROCESS_ID=str(process),
                  TPURUN_LOST_AFTER_SECONDS="8")  # fmt: skip
    return subprocess.Popen([TPURUN, "train", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def _both(args0: list[str], args1: list[str]) -> list[tuple[int, str]]:
    port = free_port()
    procs = [_start(args0, 0, port), _start(args1, 1, port)]
    return [(p.wait(timeout=300), p.communicate()[1]) for p in procs]


@pytest.fixture
def configs(tmp_path):
    data = write_toy_data(tmp_path / "data", n_train=256, n_val=64)
    base = toy_config(data, tmp_path / "runs", name="pair", runtime={"cpu_devices": 2},
                      train={"epochs": 2, "per_core_batch_size": 8})  # fmt: skip
    other = toy_config(data, tmp_path / "runs", name="pair", runtime={"cpu_devices": 2},
                       train={"epochs": 3, "per_core_batch_size": 8})  # fmt: skip
    return write_config(tmp_path / "a.yaml", base), write_config(tmp_path / "b.yaml", other)


def test_processes_with_different_configs_exit_2_on_every_process(configs, tmp_path):
    a, b = configs
    results = _both([str(a)], [str(b)])
    for process, (code, err) in enumerate(results):
        assert code == 2, err
        assert "Traceback" not in err
        assert "error: the 2 processes of this run disagree before the first step: the config's " \
               "train (process 1 against process 0)." in err  # fmt: skip
        assert f"On process {process}: the config's train: " in err
        epochs = 2 if process == 0 else 3
        assert f'"epochs": {epochs}' in err
    assert not (tmp_path / "runs" / "pair" / "log.csv").exists()  # nothing trained


def test_a_resume_given_to_one_process_only_is_refused_on_both(configs, tmp_path):
    a, _ = configs
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text(a.read_text().replace("name: pair", "name: first"))
    first = subprocess.run([TPURUN, "train", str(elsewhere)], cwd=ROOT, env=cli_env(),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert first.returncode == 0, first.stderr
    latest = tmp_path / "runs" / "first" / "checkpoints" / "latest.json"
    results = _both([str(a), "--resume", str(latest)], [str(a)])
    for code, err in results:
        assert code == 2, err
        assert (
            "disagree before the first step: the resume point (process 1 against process 0)" in err
        )
    assert f"On process 0: the resume point: {latest}, epoch 3." in results[0][1]
    assert "On process 1: the resume point: none (a fresh start)." in results[1][1]
    assert not (tmp_path / "runs" / "pair" / "log.csv").exists()
