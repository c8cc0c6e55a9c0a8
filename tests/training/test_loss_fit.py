"""The loss is checked against the model's output and the labels before training: a wrong pair
names model.loss and the loss that fits, instead of a shape error blaming the data or a run that
trains to nonsense."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import FACTORIES, toy_config

import tpurun
from tpurun.data.write import write_shards
from tpurun.errors import ModelError


def _classes(folder, classes: int, onehot: bool = False):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype(np.float32)
    y = rng.integers(0, classes, size=256)
    records = [
        {"x": x[i].tobytes(), "y": np.eye(classes)[y[i]].tolist() if onehot else int(y[i])}
        for i in range(256)
    ]
    folder.mkdir(parents=True)
    write_shards(str(folder / "train"), records, 2)
    return folder


def _config(tmp_path, data, factory, loss, y_feature=None):
    config = toy_config(
        data, tmp_path / "runs", model={"factory": f"{FACTORIES}:{factory}", "loss": loss}
    )
    del config["data"]["validation"]
    config["data"]["features"]["y"] = y_feature or {"type": "int64"}
    return config


@pytest.mark.parametrize(
    "classes, factory, loss, y_feature, message",
    [
        (3, "softmax3", "categorical_crossentropy", None,
         r"model.loss: categorical_crossentropy expects one-hot targets, 3 values per record, and "
         r"data.targets 'y' holds one class index per record. Use sparse_categorical_crossentropy"),
        (2, "mlp", "sparse_categorical_crossentropy", None,
         r"needs one output unit per class, and the model's output has 1 unit.*binary_crossentropy"),
        (5, "softmax3", "sparse_categorical_crossentropy", None,
         r"needs class indices 0..2 for the model's 3 output units, and data.targets 'y' runs from "
         r"0 to 4 in the first batch"),
        (3, "mlp", "binary_crossentropy", None,
         r"binary_crossentropy needs labels in \[0, 1\], and data.targets 'y' runs from 0 to 2.*"
         r"For 3 classes use sparse_categorical_crossentropy"),
        (3, "softmax3", "SparseCategoricalCrossentropy", {"type": "float", "shape": [3]},
         r"expects one class index per record, and data.targets 'y' holds 3 values per record "
         r"\(one-hot\?\): use categorical_crossentropy"),
    ],
)  # fmt: skip
def test_a_loss_that_does_not_fit_is_named_before_training(
    tmp_path, classes, factory, loss, y_feature, message
):
    data = _classes(tmp_path / "data", classes, onehot=y_feature is not None)
    with pytest.raises(ModelError, match=message):
        tpurun.train(_config(tmp_path, data, factory, loss, y_feature), verbose=False)
    assert not (tmp_path / "runs" / "toy" / "config.yaml").exists()


@pytest.mark.parametrize(
    "factory, loss, y_feature",
    [
        ("softmax3", "sparse_categorical_crossentropy", None),
        ("softmax3", "categorical_crossentropy", {"type": "float", "shape": [3]}),
    ],
)
def test_losses_that_fit_train(tmp_path, factory, loss, y_feature):
    data = _classes(tmp_path / "data", 3, onehot=y_feature is not None)
    summary = tpurun.train(_config(tmp_path, data, factory, loss, y_feature), verbose=False)
    assert summary["status"] == "completed"
