"""Optimizer, loss and metric names as users write them (Keras' own lower-case names included)."""

from __future__ import annotations

import keras
import pytest
from helpers import toy_config

import tpurun
from tpurun.config import NamedObject
from tpurun.errors import ModelError
from tpurun.training.model import _keras_object, build_metrics


def model_config(tmp_path, **model):
    return tpurun.load_config(toy_config(tmp_path / "data", tmp_path / "runs", model=model))


@pytest.mark.parametrize(
    ("name", "expected"),
    [("adam", "Adam"), ("sgd", "SGD"), ("rmsprop", "RMSprop"), ("adamw", "AdamW"), ("SGD", "SGD")],
)
def test_optimizer_names_in_any_case(tmp_path, name, expected):
    config = model_config(tmp_path, optimizer=name)
    optimizer = _keras_object(
        config.model.optimizer, keras.optimizers, "model.optimizer", config, learning_rate=0.1
    )
    assert type(optimizer).__name__ == expected


@pytest.mark.parametrize(
    ("what", "name", "suggestion"),
    [
        ("optimizer", "adamm", "adam"),  # not 'Nadam'
        ("optimizer", "Adamm", "Adam"),
        ("optimizer", "rmsprob", "rmsprop"),
        ("metrics", "acuracy", "accuracy"),  # not the class 'Accuracy', which compares exactly
        ("loss", "binary_crossentropyy", "binary_crossentropy"),
    ],
)
def test_a_typo_is_answered_in_the_users_case(tmp_path, what, name, suggestion):
    module = {"optimizer": keras.optimizers, "metrics": keras.metrics, "loss": keras.losses}[what]
    config = model_config(tmp_path)
    with pytest.raises(ModelError, match=f"unknown name '{name}'; did you mean '{suggestion}'\\?"):
        _keras_object(NamedObject(name=name), module, f"model.{what}", config)


def test_a_metric_class_named_in_lower_case_is_built(tmp_path):
    config = model_config(tmp_path, metrics=["accuracy", "rootmeansquarederror"])
    accuracy, rmse = build_metrics(config)
    assert accuracy == "accuracy"  # left to Keras, which picks binary or sparse from the shapes
    assert isinstance(rmse, keras.metrics.RootMeanSquaredError)


def test_the_logged_learning_rate_is_the_schedules_at_the_optimizers_step():
    """LearningRateLog reads the schedule through a compiled function: the same number as the
    schedule called at the optimizer's batch count, at every epoch."""
    import keras

    from tpurun.observe.callbacks import LearningRateLog

    schedule = keras.optimizers.schedules.CosineDecay(
        1e-4, decay_steps=40, warmup_target=1e-3, warmup_steps=10
    )
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse")
    model.optimizer.build(model.trainable_variables)
    log = LearningRateLog()
    log.set_model(model)
    seen = []
    for step in (0, 5, 10, 30, 50):
        model.optimizer.iterations.assign(step)
        logs: dict = {}
        log.on_epoch_end(0, logs)
        seen.append(logs["learning_rate"])
        assert logs["learning_rate"] == pytest.approx(float(schedule(step)), rel=1e-6)
    assert len(set(seen)) == 5
