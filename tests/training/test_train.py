"""Real fits on real TFRecords: in this process on JAX (8 simulated devices available)."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
from helpers import FACTORIES, HAS_TENSORFLOW, logged_epochs, read_latest, read_log, toy_config

import tpurun
from tpurun.errors import DataError, ModelError, TpurunError


def test_fit_on_8_simulated_devices_writes_the_run_directory(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", runtime={"cpu_devices": 8},
                        train={"per_core_batch_size": 8, "epochs": 3, "steps_per_execution": 2,
                               "learning_rate": {"base": 0.02, "base_batch_size": 32}})  # fmt: skip
    summary = tpurun.train(config, verbose=False)
    run_dir = tmp_path / "runs" / "toy"

    assert summary["status"] == "completed" and summary["epochs_completed"] == 3
    assert (summary["backend"], summary["replicas"], summary["global_batch_size"]) == ("jax", 8, 64)
    assert summary["learning_rate"] == pytest.approx(0.04)  # 0.02 x 64 / 32
    assert summary["steps_per_epoch"] == 8 and summary["steps_per_execution"] == 2
    rows = read_log(run_dir)
    losses = [float(r["val_loss"]) for r in rows]
    best = min(range(3), key=losses.__getitem__)
    assert summary["best"] == {"monitor": "val_loss", "value": pytest.approx(losses[best]),
                               "epoch": best + 1}  # fmt: skip
    # Measured times, so not known in advance; what they must agree with is. The session holds
    # its epochs; an epoch's rate is its 512 examples over its training time (validation left
    # out, so at least 512 / the epoch's seconds), averaged over the epochs after the first.
    epochs = summary["epoch_seconds"]
    assert len(epochs) == 3 and summary["seconds"] >= sum(epochs) > 0
    slowest = sum(512 / s for s in epochs[1:]) / 2
    assert summary["examples_per_sec"] >= round(slowest, 1) * 0.999, summary
    assert json.loads((run_dir / "summary.json").read_text()) == summary

    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert {"loss", "accuracy", "val_loss", "val_accuracy"} <= set(rows[0])
    assert float(rows[-1]["val_accuracy"]) > 0.8  # the toy data is separable

    resolved = tpurun.load_config(run_dir / "config.yaml")  # loads back, derived section ignored
    assert resolved.train.epochs == 3
    derived = __import__("yaml").safe_load((run_dir / "config.yaml").read_text())["derived"]
    assert derived["replicas"] == 8 and derived["global_batch_size"] == 64
    assert derived["train_records"] == 512 and derived["steps_per_epoch"] == 8

    ckpts = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert {"best.keras", "best.json", "latest-e0003-s0000000.weights.h5", "latest.json"} <= ckpts
    model = keras.saving.load_model(run_dir / "model.keras")
    assert model.predict(np.zeros((2, 8), np.float32), verbose=0).shape == (2, 1)


def test_rerun_resumes_restores_the_optimizer_and_keeps_one_csv_row_per_epoch(
    trained_toy_run, tmp_path
):
    """The session's toy run (1 epoch of 8 steps, on 8 replicas), rerun from its own config.yaml:
    finished, nothing to do; one epoch more resumes (the optimizer's step count carries on);
    --restart starts over and moves the old run aside."""
    run_dir = trained_toy_run.copy(tmp_path)
    config = str(run_dir / "config.yaml")  # loads back: the derived section is ignored
    again = tpurun.train(config, output=str(tmp_path), verbose=False)
    assert again["epochs_completed"] == 1 and again["status"] == "completed"

    resumed = tpurun.train(config, ["train.epochs=2"], output=str(tmp_path), verbose=False)
    assert resumed["epochs_completed"] == 2 and resumed["resumes"][-1]["epoch"] == 1
    assert logged_epochs(run_dir) == ["0", "1"]
    assert read_latest(run_dir)["epoch"] == 2
    model = keras.saving.load_model(run_dir / "model.keras")
    assert int(model.optimizer.iterations.numpy()) == 2 * 8  # both epochs' Adam updates

    restarted = tpurun.train(config, ["train.epochs=2"], output=str(tmp_path), restart=True,
                             verbose=False)  # fmt: skip
    assert restarted["resumes"] == [] and restarted["epochs_completed"] == 2
    assert len(list(tmp_path.glob("toy-*"))) == 1  # the old run, moved aside


def test_a_final_model_that_cannot_be_saved_leaves_the_run_failed_and_a_rerun_saves_it(
    toy_data, tmp_path
):
    """The save's own error is raised, and summary.json says failed (not running, which the next
    session would take for a killed one); once the way is clear, the rerun trains nothing and
    saves the final model."""
    run_dir = tmp_path / "runs" / "blocked"
    block = {"name": f"{FACTORIES}:BlockFinalModel", "run_dir": str(run_dir)}
    config = toy_config(toy_data, tmp_path / "runs", name="blocked", train={"epochs": 1},
                        callbacks={"extra": [block]})  # fmt: skip
    with pytest.raises(IsADirectoryError, match="model.keras"):
        tpurun.train(config, verbose=False)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["epochs_completed"]) == ("failed", 1)

    (run_dir / "model.keras" / "in-the-way").rmdir()
    (run_dir / "model.keras").rmdir()
    config["callbacks"] = {}
    again = tpurun.train(config, verbose=False)
    assert (again["status"], again["epochs_completed"]) == ("completed", 1)
    assert logged_epochs(run_dir) == ["0"]  # no epoch trained again
    assert keras.saving.load_model(run_dir / "model.keras").count_params() == 161  # the toy MLP


def test_warmup_and_cosine_schedule_end_to_end(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", train={
        "epochs": 2, "learning_rate": {"base": 0.01, "warmup_epochs": 1, "schedule": "cosine"}})  # fmt: skip
    tpurun.train(config, verbose=False)
    model = keras.saving.load_model(tmp_path / "runs" / "toy" / "model.keras")
    schedule = model.optimizer._learning_rate
    assert isinstance(schedule, keras.optimizers.schedules.CosineDecay)
    assert float(schedule(16)) == pytest.approx(0.01)  # the peak, after one epoch of warmup
    assert float(schedule(8)) == pytest.approx(0.01 * 8 / 16 + 0.01 / 16 * (1 - 8 / 16), rel=1e-3)
    assert float(schedule(32)) == pytest.approx(0.0, abs=1e-6)  # cosine to zero at the end


def test_checkpoint_filename_pattern_and_every_epoch(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 2}, callbacks={
        "checkpoint": {"monitor": "loss", "save_best_only": False,
                       "filename": "ep{epoch:03d}_loss{loss:.4f}.weights.h5"}})  # fmt: skip
    tpurun.train(config, verbose=False)
    folder = tmp_path / "runs" / "toy" / "checkpoints"
    names = sorted(p.name for p in folder.glob("ep*.weights.h5"))
    assert [n[:6] for n in names] == ["ep001_", "ep002_"]
    # Each has its resume state beside it, naming it: --resume can start from any of them.
    states = [json.loads((folder / n.replace(".weights.h5", ".json")).read_text()) for n in names]
    assert [(s["epoch"], s["step"], s["weights"]) for s in states] == [
        (1, 0, names[0]),
        (2, 0, names[1]),
    ]


def test_plateau_early_stopping_and_user_callbacks(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 6, "learning_rate": {"base": 0.01}},
                        callbacks={"reduce_lr_on_plateau": {"monitor": "loss", "factor": 0.5, "patience": 0, "min_delta": 10},
                                   "early_stopping": {"monitor": "loss", "patience": 2, "min_delta": 10},
                                   "extra": [{"name": "keras.callbacks:History"}]})  # fmt: skip
    summary = tpurun.train(config, verbose=False)
    # no epoch improves the loss by 10: early stopping after 1 + 2 epochs, the LR halved after epoch 2
    assert summary["status"] == "stopped_early" and summary["epochs_completed"] == 3
    rows = read_log(tmp_path / "runs" / "toy")
    assert [float(r["learning_rate"]) for r in rows] == pytest.approx([0.01, 0.01, 0.005])


def test_two_model_inputs_from_a_feature_map(toy_data, tmp_path):
    config = toy_config(
        toy_data,
        tmp_path / "runs",
        model={"factory": f"{FACTORIES}:two_inputs", "loss": "binary_crossentropy"},
    )
    config["data"]["features"]["y2"] = {"type": "int64", "key": "y", "cast": "float32"}
    config["data"]["inputs"] = {"a": "x", "b": "y2"}
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed"


@pytest.mark.parametrize(
    ("model", "error", "match"),
    [
        ({"factory": f"{FACTORIES}:nope"}, ModelError, "has no 'nope'"),
        ({"factory": f"{FACTORIES}:not_a_model"}, ModelError, "returned str, not a Keras model"),
        (
            {"factory": f"{FACTORIES}:raises"},
            ModelError,
            r"raised RuntimeError: the factory broke on purpose \(at .*factories.py:\d+\)",
        ),
        (
            {"factory": f"{FACTORIES}:uses_tensorflow_ops"},
            ModelError,
            "runs on the JAX backend.*runtime.backend: tensorflow",
        ),
        (
            {"factory": f"{FACTORIES}:mlp", "kwargs": {"width": 3}},
            ModelError,
            "model.kwargs do not fit",
        ),
        ({"factory": "no/such/file.py:build"}, ModelError, "no such file"),
        ({"factory": "no_such_module:build"}, ModelError, "no module named 'no_such_module'"),
        ({"optimizer": "adamm"}, ModelError, "model.optimizer: unknown name 'adamm'; did you mean"),
        (
            {"optimizer": {"name": "adam", "learning_rate": 0.1}},
            ModelError,
            "set the learning rate in train.learning_rate.base",
        ),
        ({"loss": "binary_crossentropyy"}, ModelError, "did you mean 'binary_crossentropy'"),
        (
            {"loss": {"name": "binary_crossentropy", "from_logitz": True}},
            ModelError,
            "unexpected keyword argument 'from_logitz'",
        ),
        ({"metrics": ["acuracy"]}, ModelError, "model.metrics: unknown name 'acuracy'"),
    ],
)
def test_model_problems_are_clear_errors(toy_data, tmp_path, model, error, match):
    config = toy_config(toy_data, tmp_path / "runs", model=model)
    with pytest.raises(error, match=match):
        tpurun.train(config, verbose=False)


def test_data_that_does_not_match_the_features(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs")
    config["data"]["features"]["x"]["shape"] = [9]
    with pytest.raises(
        DataError,
        match="feature 'x' is declared raw float32 of shape \\[9\\], which is 36 bytes, but the record holds 32 bytes",
    ):
        tpurun.train(config, verbose=False)
    assert not (tmp_path / "runs").exists()  # nothing was written before the data was checked


def test_model_that_does_not_fit_the_targets(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs")
    config["data"]["features"]["y"] = {"type": "int64", "key": "y", "cast": "float32"}
    config["data"]["features"]["wide"] = {
        "type": "raw",
        "dtype": "float32",
        "shape": [2, 4],
        "key": "x",
    }
    config["data"]["targets"] = "wide"
    with pytest.raises(ModelError, match="does not fit the data"):
        tpurun.train(config, verbose=False)


def test_nan_loss_stops_with_a_clear_message(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 3, "learning_rate": {"base": 1e30}},
                        model={"loss": "mse"})  # fmt: skip
    with pytest.raises(
        TpurunError, match="the loss became NaN or Inf.*learning rate too high"
    ) as info:
        tpurun.train(config, verbose=False)
    run_dir = tmp_path / "runs" / "toy"
    summary = json.loads((run_dir / "summary.json").read_text())
    # An LR of 1e30 diverges within the first epoch: nothing good was ever saved, and the message
    # does not claim a checkpoint.
    assert summary["status"] == "nan" and summary["epochs_completed"] == 0
    assert "training stopped at epoch 1, step" in str(info.value)
    assert "No epoch finished, so there is no checkpoint" in str(info.value)
    assert not (run_dir / "model.keras").exists()  # a NaN model is not saved as the result
    assert list((run_dir / "checkpoints").iterdir()) == []
    assert not (run_dir / "log.csv").exists()  # rows are written at epoch ends, and none ended


def test_truncated_shard_is_named(toy_data, tmp_path):
    shard = sorted(toy_data.glob("train-*"))[-1]
    shard.write_bytes(shard.read_bytes()[:-7])
    config = toy_config(toy_data, tmp_path / "runs")
    with pytest.raises(DataError, match=f"{shard}: cannot read it as TFRecords"):
        tpurun.train(config, verbose=False)


@pytest.mark.skipif(not HAS_TENSORFLOW, reason="the TensorFlow backend")
def test_a_kernel_that_imported_keras_with_another_backend_is_told_so(toy_data, tmp_path):
    # This test process imported Keras on JAX, as a notebook kernel might have.
    config = toy_config(toy_data, tmp_path / "runs", runtime={"backend": "tensorflow"})
    with pytest.raises(
        TpurunError, match="Keras was already imported in this Python process with the jax backend"
    ):
        tpurun.train(config, verbose=False)


def test_plain_progress_lines_from_the_python_api(toy_data, tmp_path, capsys):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 1})
    tpurun.train(config)
    out = capsys.readouterr().out
    assert (
        "[tpurun] CPU via jax" in out
        and "[tpurun] epoch 1/1" in out
        and "[tpurun] completed" in out
    )


@pytest.mark.slow  # it trains for 2 s, however many steps that is here (3,776 on a fast core)
def test_time_limit_stops_cleanly_and_a_rerun_continues(toy_data, tmp_path):
    from tpurun.errors import Interrupted

    config = toy_config(
        toy_data,
        tmp_path / "runs",
        train={"epochs": 500, "per_core_batch_size": 8, "time_limit": "2s"},
    )
    with pytest.raises(
        Interrupted, match=r"train.time_limit: stopped at .*Run the same command again"
    ):
        tpurun.train(config, verbose=False)
    run_dir = tmp_path / "runs" / "toy"
    summary = json.loads((run_dir / "summary.json").read_text())
    state = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    # It stopped at an execution's end (however many fit in 2 s on this machine; mid-epoch or at
    # an epoch's end), saved there, and the summary agrees with the checkpoint.
    assert summary["status"] == "interrupted"
    position = (state["epoch"], state["step"])
    assert position > (0, 0) and summary["epochs_completed"] == state["epoch"] < 500
    config["train"].update(epochs=state["epoch"] + 1, time_limit=None)
    resumed = tpurun.train(config, verbose=False)
    assert resumed["epochs_completed"] == state["epoch"] + 1
    assert (resumed["resumes"][-1]["epoch"], resumed["resumes"][-1]["step"]) == position
    assert [r["epoch"] for r in read_log(run_dir)] == [str(i) for i in range(state["epoch"] + 1)]


def test_checkpoint_keep_prunes_the_oldest_pattern_files(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 3}, callbacks={
        "checkpoint": {"monitor": "loss", "save_best_only": False, "keep": 2,
                       "filename": "ep{epoch:03d}.weights.h5"}})  # fmt: skip
    tpurun.train(config, verbose=False)
    folder = tmp_path / "runs" / "toy" / "checkpoints"
    assert sorted(p.name for p in folder.glob("ep*")) == [
        "ep002.json", "ep002.weights.h5", "ep003.json", "ep003.weights.h5"
    ]  # fmt: skip
    assert (folder / "best.keras").exists() and (folder / "latest.json").exists()


def test_seed_zero_trains_given_as_an_override(toy_data, tmp_path):
    """TF compares (global seed, op seed) with (0, 0): seed 0 once failed inside tf.data. Given
    through the Python API's overrides, which apply over a dict config as --set does."""
    config = toy_config(toy_data, tmp_path / "runs")  # seed 7, 2 epochs
    summary = tpurun.train(config, overrides=["seed=0", "train.epochs=1"], verbose=False)
    assert summary["status"] == "completed" and summary["epochs_completed"] == 1
    written = tpurun.load_config(tmp_path / "runs" / "toy" / "config.yaml")
    assert (written.seed, written.train.epochs) == (0, 1)
