"""Monitors: checked against the compiled model's metrics before the first step, and their
direction taken from the metric objects (as Keras' MonitorCallback does), not from their names."""

from __future__ import annotations

import json

import keras
import pytest
from helpers import FACTORIES, read_log, run_cli, toy_config, write_config

import tpurun
from tpurun.errors import ConfigError
from tpurun.training.monitored import logged_metrics, monitor_mode


def _compiled(metrics: list) -> keras.Model:
    inputs = keras.Input(shape=(8,))
    model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="adam", loss="mse", metrics=metrics)
    x = keras.ops.zeros((4, 8))
    model._symbolic_build(data_batch=(x, keras.ops.zeros((4, 1))))  # what fit does first
    return model


# Each of these was minimised by the old name-based guess (none contains "acc", "auc"...).
@pytest.mark.parametrize(
    "metric, name, mode",
    [
        ("r2_score", "r2_score", "max"),
        (keras.metrics.PearsonCorrelation(), "pearson_correlation", "max"),
        (keras.metrics.CosineSimilarity(), "cosine_similarity", "max"),
        (keras.metrics.FBetaScore(), "fbeta_score", "max"),
        (keras.metrics.ConcordanceCorrelation(), "concordance_correlation", "max"),
        ("mae", "mae", "min"),
        (keras.metrics.LogCoshError(), "logcosh", "min"),
        ("accuracy", "accuracy", "max"),
    ],
)
def test_auto_mode_comes_from_the_metric_object(metric, name, mode):
    metrics = logged_metrics(_compiled([metric]))
    assert name in metrics
    assert monitor_mode(metrics, name, "auto") == mode
    assert monitor_mode(metrics, f"val_{name}", "auto") == mode
    assert monitor_mode(metrics, "val_loss", "auto") == "min"
    assert monitor_mode(metrics, name, "min") == "min"  # an explicit mode wins


def test_a_metric_that_does_not_say_its_direction_gives_none():
    def custom(y_true, y_pred):
        return keras.ops.mean(y_pred)

    assert monitor_mode(logged_metrics(_compiled([custom])), "custom", "auto") is None


def _regression(toy_data, tmp_path, **callbacks):
    return toy_config(
        toy_data, tmp_path / "runs",
        model={"factory": f"{FACTORIES}:mlp", "loss": "mse", "metrics": ["r2_score"]},
        data={"features": {"x": {"type": "raw", "dtype": "float32", "shape": [8]},
                           "y": {"type": "int64", "shape": [1], "cast": "float32"}}},
        train={"epochs": 4, "learning_rate": {"base": 0.02}},
        callbacks=callbacks,
    )  # fmt: skip


def test_best_checkpoint_maximises_r2_score(toy_data, tmp_path):
    config = _regression(toy_data, tmp_path, checkpoint={"monitor": "val_r2_score"})
    summary = tpurun.train(config, verbose=False)
    rows = read_log(tmp_path / "runs" / "toy")
    scores = [float(r["val_r2_score"]) for r in rows]
    assert len(set(scores)) > 1  # the choice is not trivial
    best = max(range(len(scores)), key=scores.__getitem__)
    assert summary["best"]["epoch"] == best + 1
    assert summary["best"]["value"] == pytest.approx(scores[best])
    state = json.loads((tmp_path / "runs" / "toy" / "checkpoints" / "best.json").read_text())
    assert state["epoch"] == best + 1


@pytest.mark.parametrize(
    "callbacks, message",
    [
        ({"checkpoint": {"monitor": "val_acuracy"}},
         r"callbacks.checkpoint.monitor: 'val_acuracy' is not a metric this model logs; did you "
         r"mean 'val_accuracy'\?"),
        ({"reduce_lr_on_plateau": {"monitor": "val_acc"}},
         r"callbacks.reduce_lr_on_plateau.monitor: 'val_acc' is not a metric this model logs; "
         r"did you mean 'val_accuracy'\?"),
        ({"early_stopping": {"monitor": "val_precision"}},
         r"callbacks.early_stopping.monitor: 'val_precision' is not a metric this model logs"),
    ],
)  # fmt: skip
def test_a_monitor_the_model_never_logs_fails_before_the_first_step(
    toy_data, tmp_path, callbacks, message
):
    config = toy_config(toy_data, tmp_path / "runs", callbacks=callbacks)
    with pytest.raises(ConfigError, match=message):
        tpurun.train(config, verbose=False)
    # Before its first write: the folder it made is removed (a mistake is not a run).
    assert not (tmp_path / "runs" / "toy").exists()


def test_a_val_monitor_without_a_validation_set_names_it(toy_data, tmp_path):
    config = toy_config(
        toy_data, tmp_path / "runs", callbacks={"early_stopping": {"monitor": "val_loss"}}
    )
    del config["data"]["validation"]
    with pytest.raises(ConfigError, match=r"'val_loss' needs a validation set.*data.validation"):
        tpurun.train(config, verbose=False)


def test_an_unknown_direction_asks_for_mode(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs",
                        model={"metrics": [f"{FACTORIES}:mean_prediction"]},
                        callbacks={"checkpoint": {"monitor": "val_mean_prediction"}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"callbacks.checkpoint.mode: auto cannot tell.*set mode"):
        tpurun.train(config, verbose=False)
    config["callbacks"]["checkpoint"]["mode"] = "max"
    assert tpurun.train(config, verbose=False)["status"] == "completed"


@pytest.mark.slow
def test_doctor_reports_a_monitor_typo_before_any_training(toy_data, tmp_path):
    config = toy_config(
        toy_data, tmp_path / "runs", callbacks={"checkpoint": {"monitor": "val_acuracy"}}
    )
    path = write_config(tmp_path / "toy.yaml", config)
    done = run_cli("doctor", str(path), "--json", timeout=300)
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["model"]["status"] == "fail", checks["model"]
    assert "did you mean 'val_accuracy'?" in checks["model"]["finding"]
    assert done.returncode == 1
