"""A run that fails before its first write leaves no run directory behind (a mistake is not a
run in `tpurun runs`); one that existed before is left as it was; an unexpected failure keeps
its traceback and lists as failed."""

from __future__ import annotations

import pytest
from conftest import FACTORIES, toy_config

import tpurun
from tpurun.errors import TpurunError
from tpurun.observe.runs import list_runs
from tpurun.storage.rundir import ERROR_LOG, RunDir


def test_a_config_mistake_leaves_no_run_directory(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", data={"targets": "no_such_feature"})
    with pytest.raises(TpurunError):
        tpurun.train(config, verbose=False)
    assert not (tmp_path / "runs" / "toy").exists()


def test_a_model_mistake_leaves_no_run_directory(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", model={"factory": f"{FACTORIES}:nope"})
    with pytest.raises(TpurunError, match="nope"):
        tpurun.train(config, verbose=False)
    assert not (tmp_path / "runs" / "toy").exists()


def test_an_earlier_run_is_kept_whole_when_a_rerun_fails(toy_data, tmp_path):
    run_dir = tmp_path / "runs" / "toy"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "log.csv").write_text("epoch,loss\n0,0.5\n")
    config = toy_config(toy_data, tmp_path / "runs", model={"factory": f"{FACTORIES}:nope"})
    with pytest.raises(TpurunError):
        tpurun.train(config, verbose=False)
    assert {p.name for p in run_dir.iterdir()} >= {"checkpoints", "log.csv"}
    assert (run_dir / "log.csv").read_text() == "epoch,loss\n0,0.5\n"


def test_a_folder_with_only_an_error_log_lists_as_failed(tmp_path):
    run = RunDir(str(tmp_path / "runs" / "crashed"))
    run.create()
    run.write_error("Traceback ...\nRuntimeError: boom\n")
    run.unlock()  # never began: the folder stays for its error.log
    assert (tmp_path / "runs" / "crashed" / ERROR_LOG).exists()
    killed = tmp_path / "runs" / "killed-while-starting"
    (killed / "checkpoints").mkdir(parents=True)
    (killed / "run.lock").write_text("{}")  # its holder is gone
    rows = {row["name"]: row["status"] for row in list_runs(str(tmp_path / "runs"))}
    assert rows == {"crashed": "failed", "killed-while-starting": "not started"}
