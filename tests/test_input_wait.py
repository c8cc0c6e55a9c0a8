"""Input wait: a slow input (large JPEGs, a tiny model) reads input-bound, a heavy model on raw
features compute-bound; the measure never reaches the CSV log."""

from __future__ import annotations

import csv
import textwrap

import numpy as np
import pytest
from conftest import toy_config

import tpurun
from tpurun.observe.input_wait import verdict

MODELS = textwrap.dedent("""
    import keras

    def tiny_image():
        inputs = keras.Input(shape=(32, 32, 3), name="image")
        pooled = keras.layers.GlobalAveragePooling2D()(inputs)
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(pooled))

    def heavy_mlp(units=1536, layers=3):
        inputs = keras.Input(shape=(8,), name="x")
        hidden = inputs
        for _ in range(layers):
            hidden = keras.layers.Dense(units, activation="relu")(hidden)
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
""")


@pytest.fixture
def models(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    return path


def write_jpegs(folder, count: int, side: int) -> None:
    """Noise images (they compress badly, so each decode costs what a large photo does)."""
    import tensorflow as tf

    from tpurun.data.write import write_shards

    rng = np.random.default_rng(0)
    records = []
    for i in range(count):
        pixels = rng.integers(0, 256, size=(side, side, 3), dtype=np.uint8)
        jpeg = tf.io.encode_jpeg(pixels, quality=95).numpy()
        records.append({"image": jpeg, "label": i % 2})
    folder.mkdir()
    write_shards(str(folder / "train"), records, 4)


def test_large_jpegs_and_a_tiny_model_read_input_bound(tmp_path, models, capsys):
    write_jpegs(tmp_path / "jpeg", 96, 640)
    config = toy_config(tmp_path, tmp_path / "runs", name="jpeg",
                        train={"per_core_batch_size": 8, "steps_per_epoch": 32, "epochs": 3})  # fmt: skip
    config["model"] = {"factory": f"{models}:tiny_image", "loss": "binary_crossentropy"}
    config["data"] = {
        "train": str(tmp_path / "jpeg" / "train-*.tfrecord"),
        "features": {"image": {"type": "image", "shape": [32, 32, 3]},
                     "label": {"type": "int64", "cast": "float32"}},
        "inputs": "image", "targets": "label", "shuffle_buffer": 32,
    }  # fmt: skip
    summary = tpurun.train(config)
    out = capsys.readouterr().out
    assert summary["input_wait"] >= 0.4, summary["epoch_input_wait"]
    assert len(summary["epoch_input_wait"]) == 3
    assert "warning: input-bound: " in out
    assert f"tpurun data bench {tmp_path / 'runs' / 'jpeg' / 'config.yaml'}" in out
    assert "input_wait 0." in out  # each epoch's progress line


def test_a_heavy_model_on_raw_features_reads_compute_bound(toy_data, tmp_path, models, capsys):
    config = toy_config(toy_data, tmp_path / "runs", name="heavy",
                        train={"per_core_batch_size": 64, "epochs": 4})  # fmt: skip
    config["model"]["factory"] = f"{models}:heavy_mlp"
    summary = tpurun.train(config)
    out = capsys.readouterr().out
    assert summary["input_wait"] < 0.15, summary["epoch_input_wait"]
    assert "compute-bound: " in out and "input-bound" not in out
    with open(tmp_path / "runs" / "heavy" / "log.csv", newline="") as f:
        header = next(csv.reader(f))
    assert "input_wait" not in header  # shown, then taken out of the logs
    assert "input_wait" not in summary["final_metrics"]


def test_the_verdict_needs_a_second_of_training_and_names_the_bench_command():
    slow = [(9.0, 10.0), (3.0, 5.0), (3.2, 5.0)]  # the first epoch (compiling) is left out
    text, level = verdict(slow, "runs/x/config.yaml")
    assert level == "warn" and text.startswith("input-bound: 62% of the training loop's time")
    assert "`tpurun data bench runs/x/config.yaml`" in text
    assert verdict([(0.0, 1.0), (0.1, 2.0)], "c.yaml")[0].startswith("compute-bound: 5%")
    assert verdict([(0.0, 1.0), (0.5, 2.0)], "c.yaml")[0].startswith("partly input-bound: 25%")
    assert verdict([(0.4, 0.5), (0.4, 0.5)], "c.yaml") is None  # half a second: too short
    assert verdict([], "c.yaml") is None  # not measured
