"""Where a run lives and what it remembers: config.yaml loads back from the run directory, the run
directory is printed absolute, an unfinished run beside the config is pointed out, and changed
data is announced on resume."""

from __future__ import annotations

import shutil

import pytest
from helpers import FACTORIES, run_cli, toy_config, write_config, write_toy_data

import tpurun
from tpurun.errors import Interrupted


def _work_folder(tmp_path):
    """A project folder as a user has it: config, data and model code side by side, with
    relative paths in the config."""
    work = tmp_path / "work"
    write_toy_data(work / "data")
    (work / "models").mkdir()
    shutil.copy(FACTORIES, work / "models" / "factories.py")
    config = toy_config(work / "data", "runs", model={"factory": "models/factories.py:mlp"})
    config["data"]["train"] = "data/train-*.tfrecord"
    config["data"]["validation"] = "data/val-*.tfrecord"
    path = write_config(work, config, "tab")
    return work, path


@pytest.mark.slow
def test_the_config_in_the_run_directory_loads_back_from_anywhere(tmp_path, monkeypatch):
    work, path = _work_folder(tmp_path)
    monkeypatch.chdir(work)
    tpurun.train(str(path), ["train.epochs=1"], verbose=False)
    written = work / "runs" / "tab" / "config.yaml"
    monkeypatch.chdir(tmp_path)
    config = tpurun.load_config(written)
    assert config.data.train == str(work / "data" / "train-*.tfrecord")
    assert config.model.factory == f"{work / 'models' / 'factories.py'}:mlp"
    done = run_cli("config", str(written), "--json")
    assert done.returncode == 0, done.stderr
    assert '"train_records": 512' in done.stdout


def test_a_run_started_from_another_folder_points_at_the_unfinished_one(
    tmp_path, monkeypatch, capsys
):
    work, path = _work_folder(tmp_path)
    monkeypatch.chdir(work)
    stop = f"callbacks.extra=[{{name: '{FACTORIES}:SignalAt', epoch: 1, step: 4, marker: '{tmp_path / 'fired'}'}}]"
    with pytest.raises(Interrupted):
        tpurun.train(str(path), [stop])
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)  # the same command, one folder up
    tpurun.train(str(path), ["train.epochs=1"])
    out = capsys.readouterr().out
    assert f"this config has an unfinished run in {work / 'runs' / 'tab'}" in out
    assert f"so this run is {tmp_path / 'runs' / 'tab'}" in out  # printed absolute
    assert f"--output {work / 'runs'}" in out


def test_changed_data_is_announced_on_resume(tmp_path, capsys):
    data = write_toy_data(tmp_path / "data", n_train=512)
    config = toy_config(data, tmp_path / "runs", train={"epochs": 1})
    tpurun.train(config, verbose=False)
    write_toy_data(tmp_path / "data", n_train=640)  # rewritten, with more records
    config["train"]["epochs"] = 2
    tpurun.train(config)
    out = capsys.readouterr().out
    assert (
        "the data changed since the last session: training records: 512 -> 640; steps per epoch: 16 -> 20"
        in out
    )
