"""The features against the model's inputs, checked before compiling (tpurun/training/input_check.py).

The rows of tests/cli/test_bad_inputs.py cover the toy data's mismatches through the CLI (a vector of
another length or rank, fewer features than inputs, a mapping naming an input the model lacks);
these cover images as the records hold them and the cases Keras itself accepts.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from helpers import FACTORIES, encode_image

import tpurun
from tpurun.config import DataConfig
from tpurun.data.native import example, framing
from tpurun.errors import ModelError
from tpurun.training.input_check import check_inputs_fit


def _image_data(folder, n: int = 32) -> None:
    """8x8 gray PNG digits-like images and a 0/1 label, in one train and one validation file."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        records = [
            example.serialize({
                "x": encode_image(rng.integers(0, 255, (8, 8, 1))), "y": [int(i % 2)],
            })
            for i in range(n)
        ]  # fmt: skip
        framing.write_records(str(folder / f"{split}-00000-of-00001.tfrecord"), records)


@pytest.mark.parametrize("reader", ["native", "tf_data"])
def test_an_image_shape_that_is_not_the_models_names_the_key_the_records_and_the_model(
    tmp_path, reader
):
    _image_data(tmp_path / "data")
    config = {
        "name": "images",
        "runtime": {"backend": "auto", "cpu_devices": 1},
        "model": {"factory": f"{FACTORIES}:image_input", "loss": "binary_crossentropy"},
        "data": {
            "train": str(tmp_path / "data" / "train-*.tfrecord"),
            "validation": str(tmp_path / "data" / "val-*.tfrecord"),
            "features": {"x": {"type": "image", "shape": [28, 28, 1]},
                         "y": {"type": "int64", "cast": "float32"}},
            "inputs": "x", "targets": "y", "reader": reader,
        },
        "train": {"per_core_batch_size": 8, "epochs": 1},
        "output": {"dir": str(tmp_path / "runs")},
    }  # fmt: skip
    with pytest.raises(ModelError) as info:
        tpurun.train(config, verbose=False)
    assert str(info.value) == (
        "data.features.x.shape is [28, 28, 1], and the model's input 'x' takes (8, 8, 1) per "
        "record; the records hold 8x8 images with 1 channel(s), resized to data.features.x.shape "
        "as they are read. Set data.features.x.shape: [8, 8, 1], or build the model on "
        "keras.Input(shape=(28, 28, 1))."
    )


def _data(features: dict, inputs) -> DataConfig:
    return DataConfig.model_validate(
        {"train": "t-*.tfrecord", "features": {**features, "y": {"type": "int64"}},
         "inputs": inputs, "targets": "y"}
    )  # fmt: skip


def _model(*inputs):
    """A model of these inputs (its outputs do not matter here: they are its inputs)."""
    return keras.Model(list(inputs), list(inputs))


def test_what_keras_accepts_passes_a_trailing_axis_of_one_added_or_dropped_and_free_sizes():
    scalar = keras.Input(shape=(1,), name="s")  # fed a scalar: Keras adds the axis
    column = keras.Input(shape=(8,), name="c")  # fed [8, 1]: Keras drops it
    free = keras.Input(shape=(None, 3), name="f")  # any length
    data = _data(
        {"a": {"type": "float", "shape": []}, "b": {"type": "float", "shape": [8, 1]},
         "d": {"type": "float", "shape": [5, 3]}},
        {"s": "a", "c": "b", "f": "d"},
    )  # fmt: skip
    check_inputs_fit(_model(scalar, column, free), data)
    # The same inputs as a list, matched in order.
    check_inputs_fit(
        _model(scalar, column, free), data.model_copy(update={"inputs": ["a", "b", "d"]})
    )


def test_a_reshape_that_keeps_the_values_is_suggested_as_the_features_shape():
    data = _data({"a": {"type": "float", "shape": [8]}}, "a")
    with pytest.raises(ModelError) as info:
        check_inputs_fit(_model(keras.Input(shape=(2, 4), name="grid")), data)
    assert str(info.value) == (
        "data.features.a.shape is [8], and the model's input 'grid' takes (2, 4) per record. "
        "Set data.features.a.shape: [2, 4] (the same values, reshaped)."
    )


def test_numbers_fed_to_a_string_input_name_the_feature():
    text = keras.Input(shape=(), dtype="string", name="words")
    model = keras.Model(text, text)
    data = _data({"a": {"type": "float", "shape": []}}, {"words": "a"})
    with pytest.raises(ModelError, match=r"the model's input 'words' takes strings, and "
                       r"data.features.a is float32 numbers\."):  # fmt: skip
        check_inputs_fit(model, data)


def test_a_model_without_declared_inputs_is_left_to_keras():
    data = _data({"a": {"type": "float", "shape": [8]}}, "a")
    check_inputs_fit(keras.Sequential([keras.layers.Dense(1)]), data)
