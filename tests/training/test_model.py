"""Optimizer, loss and metric names as users write them (Keras' own lower-case names included)."""

from __future__ import annotations

import keras
import pytest
import yaml
from helpers import toy_config

import tpurun
from tpurun.config import NamedObject
from tpurun.errors import ModelError
from tpurun.training.keras_objects import keras_object
from tpurun.training.metrics import build_metrics


def model_config(tmp_path, **model):
    return tpurun.load_config(toy_config(tmp_path / "data", tmp_path / "runs", model=model))


@pytest.mark.parametrize(
    ("name", "expected"),
    [("adam", "Adam"), ("sgd", "SGD"), ("rmsprop", "RMSprop"), ("adamw", "AdamW"), ("SGD", "SGD")],
)
def test_optimizer_names_in_any_case(tmp_path, name, expected):
    config = model_config(tmp_path, optimizer=name)
    optimizer = keras_object(
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
        keras_object(NamedObject(name=name), module, f"model.{what}", config)


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


# A factory module that does not import: the message points at the user's own file and line, never
# at Python's import machinery ("<frozen importlib._bootstrap>").
BROKEN_FACTORIES = [
    pytest.param("def build(:\n    pass\n", "SyntaxError: invalid syntax (at $FILE:2, `def build(:`)",
                 id="syntax-error"),
    pytest.param("    x = 1\n", "IndentationError: unexpected indent (at $FILE:2, `x = 1`)",
                 id="indentation-error"),
    pytest.param("x = undefined_name\n", "NameError: name 'undefined_name' is not defined (at $FILE:2)",
                 id="name-error-at-import"),
    pytest.param("import no_such_package_xyz\n",
                 "ModuleNotFoundError: No module named 'no_such_package_xyz' (at $FILE:2)",
                 id="missing-package"),
]  # fmt: skip


@pytest.mark.parametrize("as_module", [False, True], ids=["file", "module"])
@pytest.mark.parametrize(("body", "expected"), BROKEN_FACTORIES)
def test_a_factory_that_does_not_import_names_the_users_file_and_line(
    tmp_path, body, expected, as_module
):
    from helpers import write_toy_data
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    module = f"broken_{tmp_path.name}"  # its own name in each test: sys.modules keeps modules
    source = tmp_path / f"{module}.py"
    source.write_text("import keras\n" + body)
    spec = f"{module}:build" if as_module else f"{source.name}:build"
    config = toy_config(write_toy_data(tmp_path / "data", 64, 32, 1), tmp_path / "runs",
                        model={"factory": spec})  # fmt: skip
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["train", str(path)])
    assert result.exit_code == 2, result.output
    imported = module if as_module else str(source)
    assert f"error: model.factory '{spec}': importing {imported} failed: " in result.output
    assert result.output.rstrip().endswith(expected.replace("$FILE", str(source))), result.output
    assert "<frozen" not in result.output and "Traceback" not in result.output
