"""Categorical columns: the vocabulary ``tpurun data write`` records (with counts, of the train
split), ``type: category`` on both readers (ids and one-hot vectors, 0 out of vocabulary), the
vocabulary in ``config.yaml`` for predict and export, ``vocabulary_sizes`` for a factory, a text
feature fed to a model of numbers, a feature entry that takes its type from the schema file, and
``--fill-missing mean`` of the train split only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

import tpurun
from tpurun.config import load_config
from tpurun.data.write import split_mask, write_dataset
from tpurun.errors import ConfigError, DataError, ModelError

ISLANDS = ["Biscoe", "Dream", "Torgersen"]
#: Biscoe most often, then Dream, then Torgersen: the vocabulary's order (most frequent first).
WEIGHTS = [0.5, 0.3, 0.2]
FACTORY = """\
import keras


def build(vocabulary_sizes, units=8):
    x = keras.Input(shape=(2,), name="x")
    island = keras.Input(shape=(), dtype="int32", name="island")
    sex = keras.Input(shape=(vocabulary_sizes["sex"],), name="sex")
    embedded = keras.layers.Embedding(vocabulary_sizes["island"], 3)(island)
    joined = keras.layers.Concatenate()([x, embedded, sex])
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.Dense(units)(joined))
    return keras.Model({"x": x, "island": island, "sex": sex}, out)
"""


def write_table(path: Path, rows: int, seed: int = 0, islands=ISLANDS) -> list[list[str]]:
    """A penguin-like table: two numbers, an island, a sex (with an empty cell), a species."""
    rng = np.random.default_rng(seed)
    out = [["bill", "mass", "island", "sex", "species"]]
    for i in range(rows):
        island = islands[rng.choice(len(islands), p=WEIGHTS[: len(islands)])]
        species = ["Adelie", "Gentoo", "Chinstrap"][islands.index(island)]
        out.append([f"{rng.normal(40, 5):.1f}", f"{rng.normal(4000, 500):.0f}", island,
                    "" if i == 3 else ["male", "female"][i % 2], species])  # fmt: skip
    path.write_text("\n".join(",".join(row) for row in out) + "\n")
    return out[1:]


def ids(values: list[str], vocabulary: list[str]) -> list[int]:
    """Keras' StringLookup's ids: 1..K in the vocabulary's order, 0 for any other value."""
    return [vocabulary.index(v) + 1 if v in vocabulary else 0 for v in values]


def write(csv: Path, prefix: Path, **options):
    return write_dataset(str(csv), str(prefix), label="species", pack=["x=bill:mass"],
                         validation_fraction=0.25, seed=3, **options)  # fmt: skip


def config(tmp_path: Path, **data) -> Path:
    body = {
        "name": "cat",
        "model": {"factory": "model.py:build", "loss": "sparse_categorical_crossentropy",
                  "metrics": ["accuracy"]},
        "data": {"train": "d/t-train-*.tfrecord", "validation": "d/t-validation-*.tfrecord",
                 "features": {"x": {"normalize": True}, "island": {"type": "category",
                              "encode": "index"}, "sex": {"type": "category"}},
                 "inputs": {"x": "x", "island": "island", "sex": "sex"}, "targets": "species",
                 **data},
        "train": {"epochs": 2, "per_core_batch_size": 8},
        "runtime": {"cpu_devices": 1},
        "output": {"dir": str(tmp_path / "runs")},
    }  # fmt: skip
    path = tmp_path / "cat.yaml"
    path.write_text(yaml.safe_dump(body, sort_keys=False))
    return path


# ---------------------------------------------------------------------------- the schema file
def test_data_write_records_each_text_columns_vocabulary_of_the_train_split(tmp_path):
    rows = write_table(tmp_path / "t.csv", 60)
    # One validation row holds an island the train split never has.
    rows[int(np.flatnonzero(split_mask(60, 0.25, 3))[0])][2] = "Atlantis"
    (tmp_path / "t.csv").write_text(
        "bill,mass,island,sex,species\n" + "\n".join(",".join(r) for r in rows) + "\n"
    )
    report = write(tmp_path / "t.csv", tmp_path / "d" / "t")
    vocabulary = json.loads(Path(report.schema_path).read_text())["statistics"]["vocabulary"]
    train = ~split_mask(60, 0.25, 3)
    islands = [row[2] for row, kept in zip(rows, train, strict=True) if kept]
    counts = {name: islands.count(name) for name in ISLANDS}
    assert vocabulary["island"] == {
        "count": 45,
        "distinct": 3,
        "values": dict(sorted(counts.items(), key=lambda item: -item[1])),
        "unseen": {"records": 1, "values": {"Atlantis": 1}},
    }
    assert list(vocabulary["island"]["values"]) == ISLANDS  # most frequent first
    assert set(vocabulary["sex"]["values"]) <= {"male", "female", ""}  # an empty cell is a value
    assert sorted(vocabulary) == ["island", "sex"]  # the label and numbers get none


def test_free_text_gets_no_vocabulary(tmp_path):
    lines = ["id,note,label"] + [f"{i},{'word ' * 30}{i},{i % 2}" for i in range(12)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    report = write_dataset(str(tmp_path / "t.csv"), str(tmp_path / "t"), label="label")
    statistics = json.loads(Path(report.schema_path).read_text())["statistics"]
    assert "vocabulary" not in statistics and statistics["text"]["note"]["count"] == 12


def test_fill_missing_mean_is_the_train_splits_mean(tmp_path):
    """A validation row's huge value must not move the fill of the train rows' empty cells."""
    mask = split_mask(20, 0.25, 3)
    values = [float(v) for v in range(20)]
    values[int(np.flatnonzero(mask)[0])] = 1e6
    empty = int(np.flatnonzero(~mask)[0])
    lines = ["a,label"] + [f"{'' if i == empty else values[i]},{i % 2}" for i in range(20)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    report = write_dataset(str(tmp_path / "t.csv"), str(tmp_path / "t"), label="label",
                           fill_missing="mean", validation_fraction=0.25, seed=3)  # fmt: skip
    train = [values[i] for i in range(20) if not mask[i] and i != empty]
    assert report.layout["fill_missing"] == {"a": pytest.approx(sum(train) / len(train))}
    schema = json.loads(Path(report.schema_path).read_text())
    assert schema["fill_missing"]["a"] == pytest.approx(sum(train) / len(train))


# ------------------------------------------------------------------------ the effective config
def test_a_feature_entry_without_type_takes_the_rest_from_the_schema(tmp_path):
    from tpurun.data.resolve import resolve

    write_table(tmp_path / "t.csv", 40)
    write(tmp_path / "t.csv", tmp_path / "d" / "t")
    data = resolve(load_config(str(config(tmp_path)))).data
    assert data.features["x"].model_dump(mode="json", exclude_none=True) == {
        "type": "float", "shape": [2], "normalize": True,
    }  # fmt: skip
    assert data.features["island"].vocabulary == ISLANDS and data.features["island"].size == 4
    assert data.features["sex"].shape == [len(data.features["sex"].vocabulary) + 1]
    bad = config(tmp_path, features={"nothing": {"normalize": True}})
    with pytest.raises(ConfigError, match="data.features.nothing: no type, and .*t.schema.json "
                       "describes no feature 'nothing'"):  # fmt: skip
        resolve(load_config(str(bad)))
    bad = config(tmp_path, features={"island": {"normalize": True}})
    with pytest.raises(ConfigError, match="data.features.island: its options, over the text "
                       "feature .* normalize standardizes numbers"):  # fmt: skip
        resolve(load_config(str(bad)))


def test_a_category_without_a_vocabulary_anywhere_names_the_fixes(tmp_path):
    from tpurun.data.resolve import resolve

    write_table(tmp_path / "t.csv", 40)
    write(tmp_path / "t.csv", tmp_path / "d" / "t")
    schema = tmp_path / "d" / "t.schema.json"
    written = json.loads(schema.read_text())
    del written["statistics"]["vocabulary"]  # as an older tpurun wrote it
    schema.write_text(json.dumps(written))
    with pytest.raises(DataError, match=r"data.features.island: .* has none for 'island' .*"
                       r"--overwrite.*data.features.island.vocabulary: \[A, B, ...\]"):  # fmt: skip
        resolve(load_config(str(config(tmp_path))))
    listed = config(tmp_path, features={"x": {"normalize": True}, "island": {
        "type": "category", "vocabulary": ["Dream", "Biscoe"]}, "sex": {"type": "category",
        "vocabulary": ["male"]}})  # fmt: skip
    resolved = resolve(load_config(str(listed)))
    assert resolved.data.features["island"].vocabulary == ["Dream", "Biscoe"]


@pytest.mark.parametrize("reader", ["native", "tf_data"])
def test_both_readers_map_values_to_the_same_ids_and_vectors(tmp_path, reader):
    """Unseen values (in validation) get id 0 on either reader, and the start line says so."""
    from tpurun.data import pipeline
    from tpurun.data.native import pipeline as native
    from tpurun.data.resolve import resolve

    write_table(tmp_path / "t.csv", 40)
    write(tmp_path / "t.csv", tmp_path / "d" / "t")
    rows = write_table(tmp_path / "v.csv", 12, seed=5, islands=[*ISLANDS[:2], "Atlantis"])
    write_dataset(str(tmp_path / "v.csv"), str(tmp_path / "v" / "v"), label="species",
                  pack=["x=bill:mass"], shard_multiple=1)  # one file: the rows' order  # fmt: skip
    resolved = resolve(load_config(str(config(tmp_path, validation="v/v-*.tfrecord"))))
    data = resolved.data.model_copy(update={"reader": reader})
    make = native.make_dataset if reader == "native" else pipeline.make_dataset
    files = sorted(str(p) for p in (tmp_path / "v").glob("*.tfrecord"))
    batches = make(files, data, 12, training=False)
    inputs, _ = next(iter(batches.as_numpy_iterator()))
    want = ids([row[2] for row in rows], ISLANDS)
    assert 0 in want  # Atlantis
    np.testing.assert_array_equal(inputs["island"], want)
    assert inputs["island"].dtype == np.int32
    sex = resolved.data.features["sex"].vocabulary
    one_hot = np.eye(len(sex) + 1)[ids([row[3] for row in rows], sex)]
    np.testing.assert_array_equal(inputs["sex"], one_hot)
    assert inputs["sex"].dtype == np.float32
    # What the start line says, from the schema file (its validation split, not v/: the records
    # a run reads are counted by data write only).
    assert resolved.warnings == [
        "data.features.sex: 1 validation record(s) hold values the training records lack (''): "
        "they get id 0, out of vocabulary."
    ]


# ------------------------------------------------------------------------------- a trained run
def _train(path: Path) -> None:
    from tpurun.display.reporter import Reporter
    from tpurun.training import session

    session.run(load_config(str(path)), reporter=Reporter())


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("categories")
    write_table(tmp_path / "t.csv", 64)
    write(tmp_path / "t.csv", tmp_path / "d" / "t")
    (tmp_path / "model.py").write_text(FACTORY)
    _train(config(tmp_path))
    return tmp_path


def encoded(rows: list[list[str]], features: dict) -> dict:
    """Model inputs encoded by hand from config.yaml's vocabularies (what the pipeline must do)."""
    islands, sexes = features["island"]["vocabulary"], features["sex"]["vocabulary"]
    sex = np.eye(len(sexes) + 1, dtype="float32")[ids([r[3] for r in rows], sexes)]
    x = np.array([[float(r[0]), float(r[1])] for r in rows], "float32")
    return {"x": x, "island": np.array(ids([r[2] for r in rows], islands), "int32"), "sex": sex}


def test_the_run_keeps_its_vocabularies_and_predict_maps_with_them(trained, tmp_path):
    """config.yaml holds each vocabulary; predict on other records (one with an island never
    seen) gives what the loaded model gives on inputs encoded by hand from those lists."""
    recorded = yaml.safe_load((trained / "runs/cat/config.yaml").read_text())
    features = recorded["data"]["features"]
    assert features["island"] == {"key": None, "type": "category", "encode": "index",
                                  "vocabulary": ISLANDS}  # fmt: skip
    rows = write_table(tmp_path / "p.csv", 10, seed=7, islands=[*ISLANDS[:2], "Atlantis"])
    write_dataset(str(tmp_path / "p.csv"), str(tmp_path / "p"), label="species",
                  pack=["x=bill:mass"], shard_multiple=1)  # fmt: skip
    out = tmp_path / "p.npy"
    tpurun.predict(str(trained / "runs/cat"), str(tmp_path / "p-*.tfrecord"), str(out))
    model, spec = tpurun.load(str(trained / "runs/cat"))
    assert spec["features"]["sex"]["vocabulary"] == features["sex"]["vocabulary"]
    want = model.predict(encoded(rows, features), verbose=0)
    np.testing.assert_allclose(np.load(out), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["keras", "onnx"])
def test_an_export_takes_ids_and_vectors_with_the_vocabulary_in_its_spec(trained, tmp_path, fmt):
    """The mapping stays in the preprocessing: the artifact takes the ids and one-hot vectors,
    and its sidecar spec carries the vocabularies to make them with."""
    run = trained / "runs/cat"
    out = tmp_path / f"m.{fmt}"
    tpurun.export(str(run), fmt, str(out))
    sidecar = json.loads(Path(f"{out}.json").read_text())
    features = yaml.safe_load((run / "config.yaml").read_text())["data"]["features"]
    assert sidecar["data"]["features"]["island"]["vocabulary"] == ISLANDS
    rows = write_table(tmp_path / "e.csv", 6, seed=9)
    inputs = encoded(rows, features)
    model, _ = tpurun.load(str(run))
    want = model.predict(inputs, verbose=0)
    if fmt == "keras":
        import keras

        got = keras.saving.load_model(str(out), compile=False).predict(inputs, verbose=0)
    else:
        import onnxruntime as ort

        session = ort.InferenceSession(str(out))
        feeds = {i["name"]: inputs[i["feature"]] for i in sidecar["inputs"]}
        got = session.run(None, feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------ text fed to numbers
TEXT_INTO_NUMBERS = """\
import keras


def build():
    x = keras.Input(shape=(2,), name="x")
    island = keras.Input(shape=(1,), name="island")
    out = keras.layers.Dense(3, activation="softmax")(keras.layers.Concatenate()([x, island]))
    return keras.Model({"x": x, "island": island}, out)
"""


def test_a_text_feature_fed_to_numbers_names_the_feature_and_the_option(tmp_path):
    from tpurun.training.model import build_model

    write_table(tmp_path / "t.csv", 40)
    write(tmp_path / "t.csv", tmp_path / "d" / "t")
    (tmp_path / "model.py").write_text(TEXT_INTO_NUMBERS)
    from tpurun.data.resolve import resolve

    path = config(tmp_path, features={}, inputs={"x": "x", "island": "island"})
    loaded = load_config(str(path))
    effective = loaded.model_copy(update={"data": resolve(loaded).data})
    for backend in ("jax", "tensorflow"):
        with pytest.raises(ModelError, match=r"data.inputs: 'island' is a text feature .* "
                           r"data.features.island: \{type: category\}"):  # fmt: skip
            build_model(effective, backend)
    (tmp_path / "model.py").write_text(
        "import keras\n\n\ndef build():\n    x = keras.Input(shape=(2,), name='x')\n"
        "    return keras.Model(x, keras.layers.Dense(3)(x))\n"
    )
    loaded = load_config(str(config(tmp_path, features={}, inputs="x", targets="sex")))
    effective = loaded.model_copy(update={"data": resolve(loaded).data})
    with pytest.raises(ModelError, match="data.targets 'sex' is a text feature .* --label sex"):
        build_model(effective, "jax")
