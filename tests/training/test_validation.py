"""Validation scores every record exactly once per epoch, the last partial batch included, on any
replica count and backend: its val_ metrics equal Keras' own evaluate over all the records."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import (
    FACTORIES,
    make_records,
    read_log,
    run_cli,
    toy_config,
    write_config,
    write_toy_data,
)

import tpurun


def _keras_evaluate(model_path, n_val: int) -> dict:
    records = make_records(n_val, 1)  # the validation records write_toy_data wrote
    x = np.stack([np.frombuffer(r["x"], dtype=np.float32) for r in records])
    y = np.array([r["y"] for r in records], dtype=np.float32)
    model = keras.saving.load_model(model_path)
    return model.evaluate(x, y, batch_size=n_val, verbose=0, return_dict=True)


def _last_row(run_dir) -> dict:
    return read_log(run_dir)[-1]


@pytest.mark.parametrize(
    "replicas, n_val, factory",
    [
        (8, 61, "mlp_l2"),  # 61 = 1 x 32 + 29: neither the batch nor the 8 replicas divide it
        (8, 20, "mlp"),  # fewer records than one global batch of 32
        (1, 45, "mlp"),
    ],
)
def test_val_metrics_equal_keras_evaluate_over_every_record(tmp_path, replicas, n_val, factory):
    data = write_toy_data(tmp_path / "data", n_train=256, n_val=n_val)
    config = toy_config(
        data, tmp_path / "runs", runtime={"cpu_devices": replicas},
        model={"factory": f"{FACTORIES}:{factory}"},
        train={"epochs": 2, "per_core_batch_size": 32 // replicas, "steps_per_execution": 2},
    )  # fmt: skip
    summary = tpurun.train(config, verbose=False)
    assert summary["validation_steps"] == -(-n_val // 32)
    row = _last_row(tmp_path / "runs" / "toy")
    expected = _keras_evaluate(tmp_path / "runs" / "toy" / "model.keras", n_val)
    assert float(row["val_accuracy"]) == pytest.approx(expected["accuracy"], abs=1e-6)
    assert float(row["val_loss"]) == pytest.approx(expected["loss"], rel=1e-5)
    # The accuracy is a count of right answers over n_val records, not over a padded batch.
    assert round(float(row["val_accuracy"]) * n_val, 3) == round(float(row["val_accuracy"]) * n_val)


def test_a_loss_of_another_reduction_is_warned_of_and_the_metrics_stay_exact(tmp_path, capsys):
    """A loss summed over the batch includes the padding records' zero-weighted terms in a way
    tpurun cannot take back out: one warning says so; the val_ metrics are still exact."""
    data = write_toy_data(tmp_path / "data", n_train=256, n_val=45)
    config = toy_config(data, tmp_path / "runs", train={"epochs": 1})
    config["model"] = {"factory": f"{FACTORIES}:compiled_sum_loss"}  # its own loss and metrics
    tpurun.train(config)
    out = capsys.readouterr().out
    assert out.count("val_loss: a loss with a reduction other than Keras' default") == 1, out
    assert ("averaged over 64 validation records, 19 of them padding weighted 0; the val_ "
            "metrics are exact") in out  # fmt: skip
    row = _last_row(tmp_path / "runs" / "toy")
    expected = _keras_evaluate(tmp_path / "runs" / "toy" / "model.keras", 45)
    assert float(row["val_accuracy"]) == pytest.approx(expected["accuracy"], abs=1e-6)


@pytest.mark.slow
def test_val_metrics_are_exact_on_tensorflow_mirrored_strategy(tmp_path):
    data = write_toy_data(tmp_path / "data", n_train=256, n_val=37)
    config = toy_config(
        data, tmp_path / "runs",
        runtime={"backend": "tensorflow", "cpu_devices": 2},
        train={"epochs": 1, "per_core_batch_size": 8, "steps_per_execution": 1},
    )  # fmt: skip
    path = write_config(tmp_path / "toy.yaml", config)
    done = run_cli("train", str(path))
    assert done.returncode == 0, done.stderr
    row = _last_row(tmp_path / "runs" / "toy")
    expected = _keras_evaluate(tmp_path / "runs" / "toy" / "model.keras", 37)
    assert float(row["val_accuracy"]) == pytest.approx(expected["accuracy"], abs=1e-6)
    assert float(row["val_loss"]) == pytest.approx(expected["loss"], rel=1e-4)
