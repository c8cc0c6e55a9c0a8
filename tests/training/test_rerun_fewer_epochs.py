"""Rerunning a run with fewer epochs than it has trained says so, and trains nothing."""

from __future__ import annotations

from conftest import toy_config

import tpurun


def test_fewer_epochs_than_done_trains_nothing_and_says_why(toy_data, tmp_path, capsys):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 2})
    first = tpurun.train(config, verbose=False)
    (tmp_path / "runs" / "toy" / "model.keras").unlink()  # as if the last session stopped early
    config["train"]["epochs"] = 1
    again = tpurun.train(config)
    out = capsys.readouterr().out
    assert "has already trained 2 epoch(s) (more than train.epochs: 1)" in out
    assert "training -" not in out and "epoch 1/1" not in out
    assert again["epochs_completed"] == 2 and again["status"] == first["status"] == "completed"
