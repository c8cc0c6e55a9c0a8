"""``runtime.precision: bfloat16``: Keras' global ``bfloat16`` policy, weights and optimizer state
in bfloat16 (no float32 master copy, unlike ``mixed_bfloat16``). A real fit trains with bfloat16
variables, the loss (float32: Keras' losses and metrics compute in ``floatx``) falls, validation is
exact, checkpoints hold the bfloat16 bits and a resume continues on them exactly, and a NaN
restore works."""

from __future__ import annotations

import json

import h5py
import keras
import ml_dtypes
import numpy as np
import pytest
from helpers import read_latest, read_log, signal_at, toy_config, write_config

import tpurun
from tpurun.errors import Interrupted


def bf16_config(toy_data, tmp_path, name: str, **train) -> dict:
    train = {"epochs": 3, "steps_per_execution": 2, "learning_rate": {"base": 0.01}, **train}
    return toy_config(toy_data, tmp_path / "runs", name=name, train=train,
                      runtime={"precision": "bfloat16"})  # fmt: skip


def test_a_bfloat16_fit_trains_bfloat16_variables_and_its_loss_falls(toy_data, tmp_path):
    summary = tpurun.train(bf16_config(toy_data, tmp_path, "bf16"), verbose=False)
    assert summary["status"] == "completed" and summary["precision"] == "bfloat16"
    run_dir = tmp_path / "runs" / "bf16"
    rows = read_log(run_dir)
    losses = [float(r["loss"]) for r in rows]
    assert losses[-1] < losses[0] - 0.05 and float(rows[-1]["val_loss"]) < float(
        rows[0]["val_loss"]
    )

    model = keras.saving.load_model(run_dir / "model.keras")
    hidden, output = model.layers[1:]
    # The hidden layer follows the policy; the factory's output layer asks for float32 itself.
    assert [v.dtype for v in hidden.weights] == ["bfloat16", "bfloat16"]
    assert [v.dtype for v in output.weights] == ["float32", "float32"]
    slots = {v.path.split("/")[-1]: v.dtype for v in model.optimizer.variables}
    for moment in ("momentum", "velocity"):  # Adam's
        assert slots[f"{hidden.name}_kernel_{moment}"] == "bfloat16"
        assert slots[f"{output.name}_kernel_{moment}"] == "float32"

    # The checkpoint holds the very bfloat16 bits (2-byte values, not a float32 copy).
    state = read_latest(run_dir)
    with h5py.File(run_dir / "checkpoints" / state["weights"]) as f:
        kernel = np.asarray(f["layers/dense/vars/0"])  # by class, not name: the first Dense
    assert kernel.dtype.itemsize == 2
    np.testing.assert_array_equal(kernel.view(ml_dtypes.bfloat16), hidden.kernel.numpy())

    # Exact validation: evaluate scores every record once, as training's last validation did.
    result = tpurun.evaluate(str(run_dir))
    assert result["metrics"]["loss"] == pytest.approx(float(rows[-1]["val_loss"]), rel=1e-6)


def test_a_mid_epoch_resume_continues_on_the_bfloat16_weights_exactly(toy_data, tmp_path):
    unbroken = tpurun.train(bf16_config(toy_data, tmp_path, "a"), verbose=False)
    config = bf16_config(toy_data, tmp_path, "b")
    config["callbacks"] = {"extra": [signal_at(tmp_path / "fired", 2, 4)]}
    with pytest.raises(Interrupted, match="stopped at epoch 2, step 4"):
        tpurun.train(config, verbose=False)
    resumed = tpurun.train(config, verbose=False)
    assert resumed["resumes"][-1]["step"] == 4
    assert read_log(tmp_path / "runs" / "b") == read_log(tmp_path / "runs" / "a")
    assert resumed["final_metrics"] == unbroken["final_metrics"]
    weights = [keras.saving.load_model(tmp_path / "runs" / r / "model.keras").get_weights()
               for r in ("a", "b")]  # fmt: skip
    for mine, theirs in zip(*weights, strict=True):
        assert mine.dtype == theirs.dtype
        np.testing.assert_array_equal(mine, theirs)


def test_a_nan_restore_works_on_bfloat16_weights(toy_data, tmp_path):
    config = bf16_config(toy_data, tmp_path, "nan", epochs=2, learning_rate={"base": 3e38})
    config["model"]["loss"] = "mse"
    config["callbacks"] = {"on_nan": "restore", "nan_lr_factor": 1e-32, "max_nan_restores": 2}
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and len(summary["nan_restores"]) == 1
    assert all(np.isfinite(float(r["loss"])) for r in read_log(tmp_path / "runs" / "nan"))


def test_tpurun_config_shows_bfloat16(toy_data, tmp_path):
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    path = write_config(tmp_path, bf16_config(toy_data, tmp_path, "shown"), "shown")
    result = CliRunner().invoke(app, ["config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["runtime"]["precision"] == data["derived"]["precision"] == "bfloat16"
