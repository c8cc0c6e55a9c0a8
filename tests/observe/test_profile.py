"""Profiles: ``train.profile`` / ``--profile`` write a trace into the run directory, and training
goes on normally after it; on the TensorFlow backend (one subprocess) also the TensorBoard events
and the input wait measured through Keras' eager path."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
from helpers import run_cli, toy_config, write_config
from test_tensorboard import read_events

import tpurun


def traces(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "plugins" / "profile").glob("*/*.xplane.pb"))


def test_a_profile_of_some_steps_on_jax_and_training_goes_on(toy_data, tmp_path, capsys):
    config = toy_config(toy_data, tmp_path / "runs",
                        train={"epochs": 2, "steps_per_execution": 2,
                               "profile": {"start_step": 3, "steps": 4}})  # fmt: skip
    summary = tpurun.train(config)
    run_dir = tmp_path / "runs" / "toy"
    (trace,) = traces(run_dir)
    # JAX writes the same trace as Chrome trace events beside the XPlane: it holds the steps.
    with gzip.open(next(trace.parent.glob("*.trace.json.gz"))) as f:
        names = {event.get("name", "") for event in json.load(f)["traceEvents"]}
    assert any("train_step" in name for name in names), sorted(names)[:50]
    out = capsys.readouterr().out
    assert f"profile: steps 3-6 of this session traced into {trace.parent}" in out
    assert "tensorboard-plugin-profile" in out
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
    assert len((run_dir / "log.csv").read_text().splitlines()) == 3  # header and both epochs


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="the TensorFlow backend")
def test_tensorflow_backend_profile_tensorboard_and_input_wait(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", name="tf",
                        runtime={"backend": "tensorflow"},
                        train={"epochs": 2, "steps_per_execution": 1})  # fmt: skip
    path = write_config(tmp_path, config, "tf")
    done = run_cli("train", str(path), "--profile", "2:3")
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "runs" / "tf"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "tensorflow" and summary["status"] == "completed"
    assert (summary["replicas"], summary["distribution"]) == (1, "default")
    # plain output: epoch lines, no ANSI escapes, no carriage-return redraws
    assert "[tpurun] epoch 2/2" in done.stdout
    assert "\x1b[" not in done.stdout and "\r" not in done.stdout
    assert len(traces(run_dir)) == 1
    assert "profile: steps 2-4 of this session traced into" in done.stdout
    assert 0 <= summary["input_wait"] <= 1 and len(summary["epoch_input_wait"]) == 2
    assert summary["final_metrics"]["val_accuracy"] > 0.8  # Keras' eager path trains as well
    events = read_events(run_dir)
    assert [s for s, _ in events["validation/epoch_loss"]] == [16, 32]
    assert {"train/epoch_loss", "train/learning_rate", "train/input_wait"} <= set(events)
    assert (run_dir / "curves.png").exists()

    bad = run_cli("train", str(path), "--profile", "0:3")
    assert bad.returncode == 2 and "--profile 0:3: expected START:STEPS" in bad.stderr
