"""``normalize: true``: the statistics ``tpurun data write`` records (exact against NumPy, of the
train split only), the numbers drawn from them (a constant column, the errors), the Normalization
layer in front of the factory's model (inputs and outputs by name, integer inputs refused), the
numbers inside a loaded and an exported model and kept by a resumed run, and a table whose scales
differ by orders of magnitude trained with and without it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app
from tpurun.config import DataConfig
from tpurun.data.statistics import MAX_ELEMENTS, normalization
from tpurun.data.write import split_mask, write_dataset
from tpurun.errors import ConfigError, DataError, ModelError

COLUMNS = ["id", "age", "income", "visits", "tenure", "const", "note", "label"]
MLP = """\
import keras


def build(width=5, units=16):
    x = keras.Input(shape=(width,), name="x")
    hidden = keras.layers.Dense(units, activation="relu")(x)
    return keras.Model(x, keras.layers.Dense(2, activation="softmax")(hidden))
"""


def write_table(path: Path, rows: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """A customer table whose columns differ in scale by orders of magnitude; ``label`` is 1
    when a score of the standardized columns is positive. Returns the numeric values (float64,
    the text column left out) in CSV order."""
    rng = np.random.default_rng(seed)
    age = rng.integers(18, 80, rows).astype(float)
    income = (rng.lognormal(10.8, 0.5, rows) * scale).round(2)
    visits = rng.poisson(6, rows).astype(float)
    tenure = (rng.uniform(0, 0.01, rows) * scale).round(6)
    values = np.column_stack([age, income, visits, tenure])
    z = (values - values.mean(0)) / values.std(0)
    label = (z @ [-0.8, 1.0, 1.5, -1.2] + rng.normal(0, 0.3, rows) > 0).astype(int)
    with open(path, "w") as f:
        f.write(",".join(COLUMNS) + "\n")
        for i in range(rows):
            f.write(f"{1000 + i},{age[i]:g},{float(income[i])!r},{visits[i]:g},"
                    f"{float(tenure[i])!r},7.25,n{i},{label[i]}\n")  # fmt: skip
    return np.column_stack([np.arange(1000, 1000 + rows), values, np.full(rows, 7.25), label])


def write(csv: Path, prefix: Path, fraction: float = 0.25, **options):
    return write_dataset(str(csv), str(prefix), label="label", pack=["x=age:const"],
                         validation_fraction=fraction, seed=3, **options)  # fmt: skip


def expected(values: np.ndarray) -> dict:
    """What the schema should say of these rows (float64 arithmetic, as NumPy does it)."""
    return {"count": len(values), "mean": values.mean(0), "variance": values.var(0),
            "min": values.min(0), "max": values.max(0)}  # fmt: skip


def assert_statistics(found: dict, want: dict) -> None:
    assert found["count"] == want["count"]
    for key in ("mean", "variance"):
        np.testing.assert_allclose(found[key], want[key], rtol=1e-12, atol=1e-300, err_msg=key)
    for key in ("min", "max"):
        np.testing.assert_array_equal(found[key], want[key], err_msg=key)


# ------------------------------------------------------------------------- the schema's statistics
@pytest.mark.parametrize("chunk", [7, 4096])
def test_statistics_are_the_train_splits_exactly(tmp_path, chunk):
    """Per element of the packed vector, per scalar column, over the train split only: the same
    whether the rows come in chunks of 7 or all at once."""
    values = write_table(tmp_path / "t.csv", rows=83)
    report = write(tmp_path / "t.csv", tmp_path / "d" / "t", chunk_records=chunk)
    schema = json.loads(Path(report.schema_path).read_text())
    stats = schema["statistics"]
    assert stats["split"] == "train"
    assert list(stats["features"]) == ["id", "x", "label"]  # numeric features; the text has none
    train = ~split_mask(83, 0.25, 3)
    packed = values[train, 1:6].astype(np.float32).astype(np.float64)  # floats as written
    assert_statistics(stats["features"]["x"], expected(packed))
    assert_statistics(stats["features"]["id"], expected(values[train, 0]))
    assert_statistics(stats["features"]["label"], expected(values[train, 6]))
    assert stats["features"]["x"]["variance"][4] == 0.0  # the constant column
    whole = expected(values[:, 1:6].astype(np.float32).astype(np.float64))
    assert not np.allclose(stats["features"]["x"]["mean"], whole["mean"], rtol=1e-9)


def test_without_a_split_the_statistics_are_of_every_record(tmp_path):
    values = write_table(tmp_path / "t.csv", rows=40)
    report = write(tmp_path / "t.csv", tmp_path / "t", fraction=0.0)
    stats = json.loads(Path(report.schema_path).read_text())["statistics"]
    assert stats["split"] == "all"
    assert_statistics(stats["features"]["x"],
                      expected(values[:, 1:6].astype(np.float32).astype(np.float64)))  # fmt: skip


def test_array_sources_get_statistics_of_float_arrays(tmp_path):
    """Float arrays (raw, per element, any shape), scalars; not images (uint8) nor arrays wider
    than MAX_ELEMENTS values per record."""
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(50, 3, 2)) * [1, 1000]).astype(np.float32)
    np.savez(tmp_path / "a.npz", x=x, w=rng.normal(size=50), y=rng.integers(0, 3, 50),
             image=rng.integers(0, 255, (50, 4, 4), dtype=np.uint8),
             wide=np.zeros((50, MAX_ELEMENTS + 1), np.float32))  # fmt: skip
    report = write_dataset(str(tmp_path / "a.npz"), str(tmp_path / "a"), validation_fraction=0.2,
                           seed=5, chunk_records=16)  # fmt: skip
    stats = json.loads(Path(report.schema_path).read_text())["statistics"]
    assert sorted(stats["features"]) == ["w", "x", "y"]
    train = ~split_mask(50, 0.2, 5)
    found = stats["features"]["x"]
    assert np.shape(found["mean"]) == (3, 2)
    assert_statistics(found, expected(x[train].astype(np.float64)))


# ------------------------------------------------------------------------- the numbers from them
def _data(tmp_path: Path, features: dict, inputs="x", targets="label") -> DataConfig:
    return DataConfig.model_validate(
        {"train": "x", "features": features, "inputs": inputs, "targets": targets}
    )


def test_normalization_takes_the_schemas_numbers_and_centres_a_constant_column(tmp_path):
    write_table(tmp_path / "t.csv", rows=60)
    report = write(tmp_path / "t.csv", tmp_path / "t")
    files = sorted(str(p) for p in tmp_path.glob("t-train-*.tfrecord"))
    data = _data(tmp_path, {"x": {"type": "float", "shape": [5], "normalize": True}})
    numbers, warnings = normalization(data, files)
    stats = json.loads(Path(report.schema_path).read_text())["statistics"]["features"]["x"]
    assert numbers["x"]["mean"] == stats["mean"] and numbers["x"]["count"] == stats["count"]
    assert numbers["x"]["variance"] == [*stats["variance"][:4], 1.0]  # constant: centred only
    assert numbers["x"]["schema"] == report.schema_path and numbers["x"]["split"] == "train"
    assert len(warnings) == 1 and "(const)" in warnings[0] and "data.features.x" in warnings[0]
    assert normalization(_data(tmp_path, {"x": {"type": "float", "shape": [5]}}), files) == ({}, [])


def test_normalize_without_statistics_names_the_feature_the_schema_and_the_fix(tmp_path):
    write_table(tmp_path / "t.csv", rows=30)
    report = write(tmp_path / "t.csv", tmp_path / "t")
    schema = json.loads(Path(report.schema_path).read_text())
    del schema["statistics"]  # as a schema file written before tpurun recorded them
    Path(report.schema_path).write_text(json.dumps(schema))
    files = sorted(str(p) for p in tmp_path.glob("t-train-*.tfrecord"))
    data = _data(tmp_path, {"x": {"type": "float", "shape": [5], "normalize": True}})
    with pytest.raises(DataError, match=r"data.features.x.normalize: .*t.schema.json has no "
                       r"statistics of 'x'.*tpurun data write"):  # fmt: skip
        normalization(data, files)
    target = _data(tmp_path, {"label": {"type": "int64", "normalize": True}})
    with pytest.raises(ConfigError, match="'label' is not a model input"):
        normalization(target, files)


def test_tpurun_config_shows_the_numbers_and_exits_2_without_them(tmp_path):
    write_table(tmp_path / "t.csv", rows=40)
    report = write(tmp_path / "t.csv", tmp_path / "d" / "t")
    (tmp_path / "mlp.py").write_text(MLP)
    config = _config(tmp_path, normalize=True)
    shown = CliRunner().invoke(app, ["config", str(config), "--json"])
    assert shown.exit_code == 0, shown.output
    derived = json.loads(shown.output)["derived"]
    assert derived["normalization"]["x"]["count"] == 30
    schema = json.loads(Path(report.schema_path).read_text())
    del schema["statistics"]
    Path(report.schema_path).write_text(json.dumps(schema))
    result = CliRunner().invoke(app, ["config", str(config)])
    assert result.exit_code == 2, result.output
    assert "data.features.x.normalize" in result.output and "t.schema.json" in result.output
    assert "tpurun data write" in result.output and "Traceback" not in result.output


# --------------------------------------------------------------------------------- the layer
def _wrap(model, features: dict, inputs, numbers):
    from tpurun.config import load_config
    from tpurun.training.normalize import wrap

    config = load_config({"model": {"factory": "m.py:build"},
                          "data": {"train": "x", "features": features, "inputs": inputs,
                                   "targets": "y"}})  # fmt: skip
    return wrap(model, config, numbers)


def test_the_layer_keeps_input_and_output_names_and_normalizes_only_what_asks():
    import keras

    a = keras.Input(shape=(3,), name="a")
    b = keras.Input(shape=(), name="b")
    hidden = keras.layers.Concatenate()([a, keras.ops.expand_dims(b, -1)])
    model = keras.Model({"a": a, "b": b}, [keras.layers.Dense(1, name="first")(hidden),
                                           keras.layers.Dense(2, name="second")(hidden)])  # fmt: skip
    numbers = {"fa": {"mean": [1.0, 10.0, 100.0], "variance": [4.0, 1.0, 0.25]}}
    features = {"fa": {"type": "float", "shape": [3], "normalize": True}, "fb": {"type": "float"},
                "y": {"type": "float"}}  # fmt: skip
    wrapped = _wrap(model, features, {"a": "fa", "b": "fb"}, numbers)
    assert sorted(t.name for t in wrapped.inputs) == ["a", "b"]
    assert wrapped.output_names == ["first", "second"]
    assert "a_normalization" in [layer.name for layer in wrapped.layers]
    xa = np.array([[3.0, 10.0, 99.5]], np.float32)
    xb = np.array([5.0], np.float32)
    got = wrapped.predict({"a": xa, "b": xb}, verbose=0)
    want = model.predict({"a": (xa - [1, 10, 100]) / [2, 1, 0.5], "b": xb}, verbose=0)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6)


def test_an_integer_input_or_missing_numbers_are_refused():
    import keras

    x = keras.Input(shape=(2,), dtype="int32", name="x")
    model = keras.Model(x, keras.layers.Dense(1)(keras.ops.cast(x, "float32")))
    features = {"x": {"type": "int64", "shape": [2], "normalize": True}, "y": {"type": "float"}}
    with pytest.raises(ModelError, match="input 'x' is int32.*dtype='float32'"):
        _wrap(model, features, "x", {"x": {"mean": [0.0, 0.0], "variance": [1.0, 1.0]}})
    with pytest.raises(ModelError, match="no numbers for 'x' under derived.normalization"):
        _wrap(model, features, "x", {})
    wide = keras.Input(shape=(3,), name="x")
    floats = {**features, "x": {"type": "float", "shape": [3], "normalize": True}}
    with pytest.raises(ModelError, match=r"takes \[3\] values per record.*have shape \[2\]"):
        _wrap(keras.Model(wide, keras.layers.Dense(1)(wide)), floats, "x",
              {"x": {"mean": [0.0, 0.0], "variance": [1.0, 1.0]}})  # fmt: skip


def test_a_model_without_declared_inputs_gets_them_from_the_feature():
    """A Sequential with no Input (or a subclassed model): the input is the feature's shape."""
    import keras

    model = keras.Sequential([keras.layers.Dense(1, kernel_initializer="ones")])
    features = {"x": {"type": "float", "shape": [2], "normalize": True}, "y": {"type": "float"}}
    wrapped = _wrap(model, features, "x", {"x": {"mean": [1.0, 2.0], "variance": [4.0, 9.0]}})
    assert [t.name for t in wrapped.inputs] == ["x"] and tuple(wrapped.inputs[0].shape) == (None, 2)
    got = wrapped.predict(np.array([[3.0, 8.0]], np.float32), verbose=0)
    np.testing.assert_allclose(got, [[(3 - 1) / 2 + (8 - 2) / 3]], rtol=1e-6)


# ----------------------------------------------------------------------- a run, loaded and resumed
def _config(folder: Path, normalize: bool, name: str = "t", epochs: int = 1, **train) -> Path:
    x = {"type": "float", "shape": [5], **({"normalize": True} if normalize else {})}
    config = {
        "name": name,
        "seed": 3,
        "runtime": {"cpu_devices": 1},
        "model": {"factory": "mlp.py:build", "loss": "sparse_categorical_crossentropy",
                  "metrics": ["accuracy"]},
        "data": {"train": "d/t-train-*.tfrecord", "validation": "d/t-validation-*.tfrecord",
                 "features": {"x": x}, "inputs": "x", "targets": "label"},
        "train": {"per_core_batch_size": 16, "epochs": epochs, **train},
        "callbacks": {"tensorboard": None},
        "output": {"dir": str(folder / "runs")},
    }  # fmt: skip
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _train(config: Path) -> list[tuple[str, str]]:
    """Train in this process; the messages the run gave, as ``(level, text)``."""
    from tpurun.config import load_config
    from tpurun.display.reporter import Reporter
    from tpurun.training import session

    said: list[tuple[str, str]] = []

    class Messages(Reporter):
        def message(self, text: str, level: str = "info") -> None:
            said.append((level, text))

    session.run(load_config(str(config)), reporter=Messages())
    return said


def test_a_run_loaded_again_computes_with_the_numbers_config_yaml_recorded(tmp_path):
    write_table(tmp_path / "t.csv", rows=96)
    report = write(tmp_path / "t.csv", tmp_path / "d" / "t")
    (tmp_path / "mlp.py").write_text(MLP)
    said = _train(_config(tmp_path, normalize=True))
    assert any("(const)" in text for level, text in said if level == "warn")
    run = tmp_path / "runs" / "t"
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    numbers = recorded["derived"]["normalization"]["x"]
    stats = json.loads(Path(report.schema_path).read_text())["statistics"]["features"]["x"]
    assert numbers["mean"] == stats["mean"] and numbers["variance"][:4] == stats["variance"][:4]
    assert recorded["data"]["features"]["x"]["normalize"] is True

    model, spec = tpurun.load(str(run))
    assert [t.name for t in model.inputs] == ["x"] and spec["inputs"] == "x"
    layer = model.get_layer("x_normalization")
    assert layer.get_config()["mean"] == numbers["mean"]
    assert layer.get_config()["variance"] == numbers["variance"]
    raw = write_table(tmp_path / "other.csv", rows=8, seed=9)[:, 1:6].astype(np.float32)
    inner = model.get_layer(model.layers[2].name)  # the factory's own model, behind the layer
    standardized = (raw - numbers["mean"]) / np.sqrt(numbers["variance"])
    np.testing.assert_allclose(model.predict(raw, verbose=0),
                               inner.predict(standardized.astype(np.float32), verbose=0),
                               rtol=1e-5, atol=1e-6)  # fmt: skip


def test_a_resumed_run_keeps_its_numbers_when_the_data_is_written_again(tmp_path):
    write_table(tmp_path / "t.csv", rows=64)
    write(tmp_path / "t.csv", tmp_path / "d" / "t")
    (tmp_path / "mlp.py").write_text(MLP)
    _train(_config(tmp_path, normalize=True))
    before = yaml.safe_load((tmp_path / "runs/t/config.yaml").read_text())["derived"]
    write_table(tmp_path / "t.csv", rows=64, seed=1, scale=3.0)
    write(tmp_path / "t.csv", tmp_path / "d" / "t", overwrite=True)
    said = _train(_config(tmp_path, normalize=True, epochs=2))
    assert any("changed since this run began" in text for level, text in said if level == "warn")
    after = yaml.safe_load((tmp_path / "runs/t/config.yaml").read_text())["derived"]
    assert after["normalization"] == before["normalization"]
    assert json.loads((tmp_path / "runs/t/summary.json").read_text())["epochs_completed"] == 2
    model, _ = tpurun.load(str(tmp_path / "runs/t"))
    assert (
        model.get_layer("x_normalization").get_config()["mean"]
        == (before["normalization"]["x"]["mean"])
    )


# ------------------------------------------------------------------------------------ slow
@pytest.mark.slow
def test_normalize_trains_a_table_of_mixed_scales_that_raw_inputs_do_not(tmp_path):
    """Columns from 1e-3 to 1e5: the same MLP, the same epochs, with and without normalize."""
    write_table(tmp_path / "t.csv", rows=1200, scale=10.0)
    write(tmp_path / "t.csv", tmp_path / "d" / "t", fraction=0.25)
    (tmp_path / "mlp.py").write_text(MLP)
    accuracy = {}
    for normalize in (True, False):
        name = f"n{int(normalize)}"
        _train(_config(tmp_path, normalize=normalize, name=name, epochs=12))
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        accuracy[normalize] = summary["final_metrics"]["val_accuracy"]
    assert accuracy[True] >= 0.9, accuracy
    assert accuracy[True] >= accuracy[False] + 0.15, accuracy


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["keras", "saved_model"])
def test_an_export_carries_the_numbers(tmp_path, fmt):
    """The artifact, loaded here without tpurun's help, computes on raw values what the factory's
    model computes on values standardized by hand with config.yaml's numbers."""
    write_table(tmp_path / "t.csv", rows=96)
    write(tmp_path / "t.csv", tmp_path / "d" / "t")
    (tmp_path / "mlp.py").write_text(MLP)
    _train(_config(tmp_path, normalize=True))
    run = tmp_path / "runs" / "t"
    numbers = yaml.safe_load((run / "config.yaml").read_text())["derived"]["normalization"]["x"]
    out = tmp_path / "export" / ("m.keras" if fmt == "keras" else "m")
    tpurun.export(str(run), fmt, str(out))
    raw = write_table(tmp_path / "other.csv", rows=8, seed=9)[:, 1:6].astype(np.float32)
    model, _ = tpurun.load(str(run))
    inner = model.get_layer(model.layers[2].name)
    standardized = ((raw - numbers["mean"]) / np.sqrt(numbers["variance"])).astype(np.float32)
    want = inner.predict(standardized, verbose=0)
    if fmt == "keras":
        import keras

        artifact = keras.saving.load_model(str(out), compile=False)
        assert artifact.get_layer("x_normalization").get_config()["mean"] == numbers["mean"]
        got = artifact.predict(raw, verbose=0)
    else:
        import tensorflow as tf

        loaded = tf.saved_model.load(str(out))  # kept: its functions need its variables
        got = loaded.serve(raw).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
