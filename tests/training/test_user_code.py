"""The user's own code in a run: custom losses and the final model file, callbacks that need a
package this machine lacks."""

from __future__ import annotations

import json
import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import FACTORIES, toy_config

import tpurun
from tpurun.errors import TpurunError

_LOSSES = """
import keras

def focal(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - keras.ops.squeeze(y_pred, -1)))
"""


@pytest.mark.slow
def test_a_model_trained_with_a_custom_loss_loads_with_plain_load_model(toy_data, tmp_path, capsys):
    (tmp_path / "losses.py").write_text(_LOSSES)
    config = toy_config(toy_data, tmp_path / "runs", model={"loss": f"{tmp_path / 'losses.py'}:focal"},
                        train={"epochs": 1})  # fmt: skip
    tpurun.train(config)
    assert (
        "model.keras is saved without its training setup (focal: your code)"
        in capsys.readouterr().out
    )
    model_file = tmp_path / "runs" / "toy" / "model.keras"
    # A fresh process that has never seen losses.py: plain Keras, as on a GPU notebook.
    code = (
        "import os, sys; os.environ['KERAS_BACKEND'] = 'jax'\n"
        "import keras, numpy as np\n"
        f"m = keras.saving.load_model({str(model_file)!r})\n"
        "print(m.predict(np.ones((2, 8), 'float32'), verbose=0).shape)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("(2, 1)")
    # The checkpoints keep the whole training setup: the run resumes with its custom loss.
    config["train"]["epochs"] = 2
    assert tpurun.train(config, verbose=False)["epochs_completed"] == 2


def test_a_model_with_keras_losses_keeps_its_training_setup(toy_data, tmp_path):
    tpurun.train(toy_config(toy_data, tmp_path / "runs", train={"epochs": 1}), verbose=False)
    model = keras.saving.load_model(tmp_path / "runs" / "toy" / "model.keras")
    assert model.compiled and model.loss.fn.__name__ == "binary_crossentropy"
    model.evaluate(np.ones((4, 8), "float32"), np.ones((4,), "float32"), verbose=0)


def test_a_callback_that_needs_a_missing_package_is_a_clear_error(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs",
                        callbacks={"extra": [f"{FACTORIES}:NeedsAMissingPackage"]})  # fmt: skip
    with pytest.raises(TpurunError, match=r"a package is not installed: No module named "
                       r"'tpurun_test_package_that_does_not_exist' \(callbacks.extra: "):  # fmt: skip
        tpurun.train(config, verbose=False)
    summary = json.loads((tmp_path / "runs" / "toy" / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert not (tmp_path / "runs" / "toy" / "error.log").exists()  # a user error, not a crash


def _factory_config(toy_data, tmp_path, **model):
    config = toy_config(
        toy_data, tmp_path / "runs", train={"epochs": 1, "learning_rate": {"base": 0.01}}
    )
    config["model"] = {"factory": f"{FACTORIES}:compiled_sgd_mse", **model}
    return config


def test_a_factory_compile_is_kept_where_the_config_leaves_it_out(toy_data, tmp_path, capsys):
    summary = tpurun.train(_factory_config(toy_data, tmp_path))
    out = capsys.readouterr().out
    assert (
        "the factory compiled its model (SGD, loss mse): the factory's optimizer/loss/metrics kept"
        in out
    )
    assert {"loss", "mae", "val_mae"} <= set(summary["final_metrics"])
    model = keras.saving.load_model(tmp_path / "runs" / "toy" / "model.keras")
    assert model.optimizer.__class__.__name__ == "SGD"
    assert model.optimizer.get_config()["momentum"] == pytest.approx(0.9)  # the factory's setting
    assert float(model.optimizer.learning_rate) == pytest.approx(0.01)  # tpurun's learning rate
    # evaluate reloads the run's config.yaml, which writes `metrics: []`: the factory's stay
    scores = tpurun.evaluate(str(tmp_path / "runs" / "toy"))
    assert "mae" in scores["metrics"], scores


def test_what_the_config_sets_replaces_the_factory_compile(toy_data, tmp_path, capsys):
    config = _factory_config(toy_data, tmp_path, loss="binary_crossentropy", metrics=["accuracy"],
                             optimizer={"name": "adam"})  # fmt: skip
    summary = tpurun.train(config)
    out = capsys.readouterr().out
    assert "the config's model.optimizer/loss/metrics replace(s) the factory's" in out
    assert "accuracy" in summary["final_metrics"] and "mae" not in summary["final_metrics"]


def test_no_loss_anywhere_is_a_clear_error(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs")
    del config["model"]["loss"]
    with pytest.raises(
        TpurunError,
        match="model.loss is not set, and the factory returned a model it did not compile",
    ):
        tpurun.train(config, verbose=False)


def test_a_factory_that_fails_leaves_no_stream_reading(toy_data, tmp_path, monkeypatch):
    """The training stream starts reading before the model is built (tpurun.training.fit): a
    factory that raises ends the session with its error, and the stream's reading with it."""
    from tpurun.data.native import keras_input

    started = []
    read_ahead = keras_input.KerasBatches.read_ahead

    def recorded(self):
        read_ahead(self)
        started.append((self, self._iterator.thread))

    monkeypatch.setattr(keras_input.KerasBatches, "read_ahead", recorded)
    config = toy_config(toy_data, tmp_path / "runs")
    config["model"]["factory"] = f"{FACTORIES}:raises"
    config["data"]["reader"] = "native"
    with pytest.raises(TpurunError, match="the factory broke on purpose"):
        tpurun.train(config, verbose=False)
    [(stream, thread)] = started
    assert stream._iterator is None  # closed
    thread.join(5)  # it ends after the batch in hand
    assert not thread.is_alive()
