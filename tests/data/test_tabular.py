"""CSV to TFRecords through ``tpurun data write``: packed vectors, column order, missing values,
class names of a text label, and refusing to overwrite. Real CSVs in tmp_path, the real CLI, and
the records read back with TensorFlow's own parser."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml
from typer.testing import CliRunner

from tpurun.cli.app import app
from tpurun.data.write import write_dataset
from tpurun.errors import DataError

SPECIES = ["setosa", "virginica", "versicolor"]


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    path.write_text("\n".join(",".join(str(v) for v in row) for row in [header, *rows]) + "\n")
    return path


def numeric_csv(path: Path, rows: int = 30, columns: int = 20, seed: int = 0):
    """``id, f0..f{columns-1}, species``: the values, and the CSV."""
    rng = np.random.default_rng(seed)
    values = rng.normal(size=(rows, columns)).round(4)
    header = ["id", *(f"f{i}" for i in range(columns)), "species"]
    body = [[r, *values[r], SPECIES[r % 3]] for r in range(rows)]
    return values, write_csv(path, header, body)


def cli(*args) -> object:
    return CliRunner().invoke(app, [str(a) for a in args])


def write(*args):
    result = cli("data", "write", *args, "--plain")
    return result


def read_records(prefix: Path) -> tuple[dict, list[dict]]:
    """The schema file, and every record as ``{key: [values]}``, in ``id`` order when there is one."""
    schema = json.loads(Path(f"{prefix}.schema.json").read_text())
    rows = []
    for file in sorted(prefix.parent.glob(f"{prefix.name}-*.tfrecord")):
        for raw in tf.data.TFRecordDataset(str(file)):
            example = tf.train.Example.FromString(raw.numpy())
            rows.append(
                {
                    key: list(getattr(feature, feature.WhichOneof("kind")).value)
                    for key, feature in example.features.feature.items()
                }
            )
    if rows and "id" in rows[0]:
        rows.sort(key=lambda row: row["id"][0])
    return schema, rows


def features_block(inspect_output: str) -> dict:
    block = inspect_output.split("paste into data: in the config\n", 1)[1].split("\n\n", 1)[0]
    return yaml.safe_load(block)["features"]


# ------------------------------------------------------------------------------------- packing
def test_twenty_columns_become_one_vector_and_a_text_label_gets_class_names(tmp_path):
    values, csv = numeric_csv(tmp_path / "train.csv")
    out = tmp_path / "ds" / "tab"
    result = write(csv, out, "--label", "species", "--pack", "x=f0:f19")
    assert result.exit_code == 0, result.output

    schema, rows = read_records(out)
    assert list(schema["features"]) == ["id", "x", "species"]  # the CSV's order
    assert schema["features"]["x"] == {"type": "float", "shape": [20]}
    assert schema["features"]["species"] == {"type": "int64", "shape": []}
    assert schema["class_names"] == sorted(SPECIES)
    assert schema["packed"] == {"x": [f"f{i}" for i in range(20)]}
    assert schema["label"] == "species"
    assert len(rows) == 30 and [row["id"][0] for row in rows] == list(range(30))
    for r, row in enumerate(rows):
        assert row["x"] == values[r].astype(np.float32).tolist()  # f0..f19, in order
        assert schema["class_names"][row["species"][0]] == SPECIES[r % 3]

    inspected = cli("data", "inspect", f"{out}-*.tfrecord", "--plain")
    assert inspected.exit_code == 0, inspected.output
    assert list(features_block(inspected.output)) == ["id", "x", "species"]
    assert "setosa, versicolor, virginica" in inspected.output


def test_pack_alone_takes_every_numeric_column_but_the_label(tmp_path):
    rng = np.random.default_rng(1)
    values = rng.integers(-5, 5, size=(12, 10))
    header = [*(f"f{i}" for i in range(10)), "note", "target"]
    csv = write_csv(tmp_path / "t.csv", header, [[*v, "n", i % 2] for i, v in enumerate(values)])
    out = tmp_path / "p"
    result = write(csv, out, "--label", "target", "--pack", "x")
    assert result.exit_code == 0, result.output

    schema, rows = read_records(out)
    assert list(schema["features"]) == ["x", "note", "target"]  # text stays its own feature
    assert schema["features"]["x"]["shape"] == [10] and schema["class_names"] is None
    assert schema["features"]["target"] == {"type": "int64", "shape": []}  # numbers: no classes
    got = sorted((row["target"][0], row["x"]) for row in rows)
    want = sorted((i % 2, v.astype(np.float32).tolist()) for i, v in enumerate(values))
    assert got == want


def test_packs_keep_the_order_given_and_take_their_first_columns_place(tmp_path):
    csv = write_csv(
        tmp_path / "t.csv", ["id", "a", "b", "c", "y"], [[0, 1, 2, 3, 1], [1, 4, 5, 6, 0]]
    )
    out = tmp_path / "o"
    result = write(csv, out, "--pack", "bc=c,b", "--pack", "a1=a")
    assert result.exit_code == 0, result.output
    schema, rows = read_records(out)
    assert list(schema["features"]) == ["id", "a1", "bc", "y"]
    assert [row["bc"] for row in rows] == [[3.0, 2.0], [6.0, 5.0]]
    assert [row["a1"] for row in rows] == [[1.0], [4.0]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pack", "x=f0:f99"], "--pack x names column 'f99', which the header lacks"),
        (["--pack", "x=f0,spieces"], "did you mean 'species'?"),
        (["--label", "specie"], "did you mean 'species'?"),
        (["--pack", "x=f0,species"], "column 'species' holds text such as 'setosa'"),
        (["--label", "f1", "--pack", "x=f0:f3"], "the label column 'f1' is also packed"),
        (["--pack", "x=f3:f1"], "write the range as FIRST:LAST"),
        (["--pack", "x=f0:f2", "--pack", "y=f2"], "column(s) ['f2'] more than once"),
        (["--pack", "id=f0:f2"], "a column of that name is written as its own feature"),
        (["--pack", "x", "--pack", "y"], "only one pack can take 'every other numeric column'"),
        (["--pack", "2x=f0"], "'2x' is not a feature name"),
        (["--fill-missing", "zero"], "Expected a number (e.g. 0) or 'mean'"),
    ],
)
def test_csv_options_that_cannot_work_are_named(tmp_path, args, message):
    _, csv = numeric_csv(tmp_path / "t.csv", rows=4, columns=4)
    result = write(csv, tmp_path / "o" / "d", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_csv_options_on_another_source_are_refused(tmp_path):
    np.savez(tmp_path / "a.npz", x=np.zeros((4, 3)), y=np.arange(4))
    result = write(tmp_path / "a.npz", tmp_path / "o", "--label", "y")
    assert result.exit_code == 2 and "apply to CSV files" in result.output


# ------------------------------------------------------------------------------- column order
def test_column_order_is_kept_in_the_schema_and_by_inspect(tmp_path):
    header = [*(f"f{i}" for i in range(12)), "label"]
    csv = write_csv(tmp_path / "t.csv", header, [[*range(12), 1], [*range(12, 24), 0]])
    out = tmp_path / "o"
    assert write(csv, out).exit_code == 0
    schema, _ = read_records(out)
    assert list(schema["features"]) == header

    inspected = cli("data", "inspect", f"{out}-*.tfrecord", "--plain")
    assert list(features_block(inspected.output)) == header
    listed = [
        line.split()[0] for line in inspected.output.split("features (from")[1].splitlines()[1:14]
    ]
    assert listed == header

    # Without the schema file, the records alone: numbered keys in number order, not as text.
    Path(f"{out}.schema.json").unlink()
    inspected = cli("data", "inspect", f"{out}-*.tfrecord", "--plain")
    assert inspected.exit_code == 0, inspected.output
    assert list(features_block(inspected.output)) == header  # f0, f1, f2, ..., f10, f11, label


# ----------------------------------------------------------------------------- missing values
def gappy_csv(path: Path) -> Path:
    """f1 is empty in 3 rows, f2 is nan in 1; f0 (integers) and the label are complete."""
    rows = [
        [0, 1.5, 2, "a"],
        [1, "", 4, "b"],
        [2, "", "nan", "a"],
        [3, 4.5, 8, "b"],
        [4, "", 10, "a"],
    ]
    return write_csv(path, ["f0", "f1", "f2", "y"], rows)


def test_missing_values_are_an_error_naming_each_column_and_its_rows(tmp_path):
    result = write(gappy_csv(tmp_path / "g.csv"), tmp_path / "o" / "d")
    assert result.exit_code == 2, result.output
    assert "missing values (empty or nan cells) in 2 column(s): 'f1' (3 rows), 'f2' (1 row)" in (
        result.output
    )
    assert "--fill-missing" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o").exists()


def test_fill_missing_with_a_number_or_the_column_mean(tmp_path):
    csv = gappy_csv(tmp_path / "g.csv")
    assert write(csv, tmp_path / "zero", "--fill-missing", "0").exit_code == 0
    schema, rows = read_records(tmp_path / "zero")
    assert schema["features"]["f2"] == {"type": "int64", "shape": []}  # integers stay integers
    assert schema["fill_missing"] == {"f1": 0.0, "f2": 0}
    by_f0 = sorted(rows, key=lambda row: row["f0"][0])
    assert [row["f1"][0] for row in by_f0] == [1.5, 0.0, 0.0, 4.5, 0.0]
    assert [row["f2"][0] for row in by_f0] == [2, 4, 0, 8, 10]

    result = write(csv, tmp_path / "mean", "--fill-missing", "mean", "--pack", "x=f1,f2")
    assert result.exit_code == 0, result.output
    schema, rows = read_records(tmp_path / "mean")
    assert schema["fill_missing"] == {"f1": 3.0, "f2": 6.0}  # (1.5 + 4.5) / 2, (2+4+8+10) / 4
    by_f0 = sorted(rows, key=lambda row: row["f0"][0])
    assert [row["x"] for row in by_f0] == [[1.5, 2], [3, 4], [3, 6], [4.5, 8], [3, 10]]
    assert schema["class_names"] is None  # y is text, but not named as the label


def test_a_label_with_missing_values_is_an_error_even_with_a_fill(tmp_path):
    csv = write_csv(tmp_path / "g.csv", ["x", "y"], [[1, "cat"], [2, ""], [3, "dog"]])
    result = write(csv, tmp_path / "o", "--label", "y", "--fill-missing", "0")
    assert result.exit_code == 2
    assert "the label column 'y' is empty in 1 row of 3; remove those rows" in result.output


# --------------------------------------------------------------------------------- overwriting
def test_an_existing_dataset_is_replaced_only_with_overwrite(tmp_path):
    _, csv = numeric_csv(tmp_path / "t.csv", rows=16, columns=3)
    out = tmp_path / "ds" / "tab"
    assert write(csv, out, "--label", "species").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.parent.iterdir()}

    again = write(csv, out, "--label", "species", "--validation-fraction", "0.25")
    assert again.exit_code == 2, again.output
    assert (
        f"{out}: a dataset is already written there (9 file(s): {out}-00000-of-00008.tfrecord"
        in (again.output)
    )
    assert "--overwrite" in again.output
    assert {p.name: p.read_bytes() for p in out.parent.iterdir()} == before

    # A schema file alone (shards deleted by hand) is a dataset too.
    for shard in out.parent.glob("*.tfrecord"):
        shard.unlink()
    alone = write(csv, out)
    assert alone.exit_code == 2 and f"{out}.schema.json" in alone.output

    replaced = write(csv, out, "--validation-fraction", "0.25", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert set(json.loads(Path(f"{out}.schema.json").read_text())["splits"]) == {
        "train",
        "validation",
    }


def test_the_python_api_refuses_too(tmp_path):
    _, csv = numeric_csv(tmp_path / "t.csv", rows=4, columns=2)
    write_dataset(str(csv), str(tmp_path / "d"), label="species", pack={"x": ["f0", "f1"]})
    with pytest.raises(DataError, match="Pass --overwrite to replace it"):
        write_dataset(str(csv), str(tmp_path / "d"))
    for pack in (["x=f0:f1"], "x=f0:f1", {"x": "f0,f1"}):
        report = write_dataset(str(csv), str(tmp_path / "d"), pack=pack, overwrite=True)
        assert report.layout == {"packed": {"x": ["f0", "f1"]}}


# ------------------------------------------------------------------------------------ training
@pytest.mark.slow
def test_a_packed_csv_trains_a_one_input_model_from_the_schema_alone(tmp_path):
    from helpers import run_cli, write_config

    _, csv = numeric_csv(tmp_path / "train.csv", rows=64)
    assert (
        write(csv, tmp_path / "ds" / "tab", "--label", "species", "--pack", "x=f0:f19").exit_code
        == 0
    )
    (tmp_path / "model.py").write_text(
        "import keras\n\n\ndef tabular():\n"
        "    inputs = keras.Input(shape=(20,), name='x')\n"
        "    return keras.Model(inputs, keras.layers.Dense(3, activation='softmax')(inputs))\n"
    )
    config = {
        "name": "tab",
        "model": {"factory": "model.py:tabular", "loss": "sparse_categorical_crossentropy"},
        "data": {"train": "ds/tab-*.tfrecord", "inputs": "x", "targets": "species"},
        "train": {"epochs": 1, "per_core_batch_size": 8},
        "runtime": {"cpu_devices": 1},
        "output": {"dir": str(tmp_path / "runs")},
    }
    write_config(tmp_path / "tab.yaml", config)
    result = run_cli("train", str(tmp_path / "tab.yaml"))
    assert result.returncode == 0, result.stderr
    assert "1 epoch(s) x 8 steps" in result.stderr + result.stdout
