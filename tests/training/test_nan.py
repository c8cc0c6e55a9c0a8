"""A NaN or Inf loss, checked after every execution: ``callbacks.on_nan`` stop (exit 2, the last
good checkpoint kept, nothing after it written), ignore (trains on), restore (the rate's cut kept
for later sessions). Real fits of the toy model, its first kernel turned NaN mid-epoch."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import FACTORIES, logged_epochs, read_latest, read_log, read_summary, toy_config

import tpurun
from tpurun.errors import TpurunError


def config_for(toy_data, tmp_path, name, **train) -> dict:
    train = {"epochs": 3, "steps_per_execution": 2, **train}
    return toy_config(toy_data, tmp_path / "runs", name=name, train=train)


POISON = (
    Path(__file__).resolve().parents[1] / "hub" / "test_hub_checkpoints.py"
)  # its PoisonAt callback


def poisoned(toy_data, tmp_path, name: str, **callbacks) -> dict:
    """16 steps an epoch, 2 an execution, a save every 4 steps; after step 6 of epoch 2 the first
    kernel turns NaN, so the loss of the execution ending at step 8 is the first NaN."""
    config = config_for(toy_data, tmp_path, name)
    poison = {"name": f"{POISON}:PoisonAt", "epoch": 2, "step": 6,
              "marker": str(tmp_path / f"{name}-poisoned"), "variable": "kernel"}  # fmt: skip
    config["callbacks"] = {"checkpoint": {"every_steps": 4}, "extra": [poison], **callbacks}
    return config


def test_a_nan_stops_at_its_execution_and_keeps_the_last_good_checkpoint(toy_data, tmp_path):
    """on_nan: stop (the default): exit 2 naming the execution's last step; the steps since the
    last save (step 4 of epoch 2), where the NaN came, are not written as a checkpoint (a
    signal's stop, by contrast, saves at its step), nor is the cut-short epoch a row of the log."""
    with pytest.raises(TpurunError) as info:
        tpurun.train(poisoned(toy_data, tmp_path, "nan-stop"), verbose=False)
    assert info.value.exit_code == 2
    run_dir = tmp_path / "runs" / "nan-stop"
    assert str(info.value).startswith("training stopped at epoch 2, step 8: the loss became NaN")
    assert f"The last good checkpoint (epoch 2, step 4) is in {run_dir / 'checkpoints'}" in str(
        info.value
    )
    state = read_latest(run_dir)
    assert (state["epoch"], state["step"], state["reason"]) == (1, 4, "every_steps")
    assert logged_epochs(run_dir) == ["0"]
    assert read_summary(run_dir)["status"] == "nan"


def test_on_nan_ignore_trains_on(toy_data, tmp_path):
    summary = tpurun.train(poisoned(toy_data, tmp_path, "nan-on", on_nan="ignore"), verbose=False)
    assert (summary["status"], summary["epochs_completed"], summary["nan_restores"]) == (
        "completed", 3, [])  # fmt: skip
    losses = [float(r["loss"]) for r in read_log(tmp_path / "runs" / "nan-on")]
    assert [math.isnan(loss) for loss in losses] == [False, True, True]


def test_a_nan_restores_learning_rate_cut_is_kept_for_later_sessions(toy_data, tmp_path):
    """Restored once with the rate halved; a later session (one epoch more) starts at the cut
    rate, not the config's."""
    seen = tmp_path / "lr.txt"
    record = {"name": f"{FACTORIES}:RecordLearningRate", "out": str(seen)}
    config = poisoned(toy_data, tmp_path, "nan-cut", on_nan="restore", nan_lr_factor=0.5,
                      max_nan_restores=1)  # fmt: skip
    config["callbacks"]["extra"].append(record)
    config["train"]["epochs"] = 2
    summary = tpurun.train(config, verbose=False)
    assert [(r["restored_to"], r["lr_scale"]) for r in summary["nan_restores"]] == [([1, 4], 0.5)]
    config["train"]["epochs"] = 3
    assert tpurun.train(config, verbose=False)["resumes"][-1]["epoch"] == 2
    # The fits' first rates: the first session's, after the restore, then the next session's.
    assert seen.read_text().split() == ["0.01", "0.005", "0.005"]
