"""A file that is not TFRecords, given where TFRecords are expected (train's data.train and
data.validation, evaluate and predict --data, data inspect and bench), exits 2 saying what it is
(told by its content), the `tpurun data write` command that makes TFRecords of it, and the
options the run's training data was written with; a run whose label was text prints its class
names from predict. One tiny run, trained once for the module on a CSV written with --label and
--pack."""

from __future__ import annotations

import csv
import gzip
import json
import shlex
from pathlib import Path

import numpy as np
import pytest
from helpers import write_config
from typer.testing import CliRunner

from tpurun.cli.app import app
from tpurun.data import sniff

runner = CliRunner()
SPECIES = ["adelie", "chinstrap", "gentoo"]
WRITTEN = "--label species --pack x=bill,flipper,mass"


def _table(path: Path, rows: int, seed: int, label: bool = True) -> Path:
    rng = np.random.default_rng(seed)
    lines = [["bill", "flipper", "mass", *(["species"] if label else [])]]
    for i in range(rows):
        k = i % 3
        lines.append([f"{v:.3f}" for v in rng.normal(k, 0.3, 3)] + ([SPECIES[k]] if label else []))
    path.write_text("".join(",".join(line) + "\n" for line in lines))
    return path


def _cli(*args: str) -> object:
    return runner.invoke(app, [str(a) for a in args])


def _refused(*args: str) -> str:
    result = _cli(*args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "unexpected failure" not in result.output
    return " ".join(result.output.split())


@pytest.fixture(scope="module")
def tabular(tmp_path_factory):
    """``(folder, config path, run dir)``: 48 rows of a CSV with a text label, written with
    --label and --pack, trained for 1 epoch of a Dense softmax."""
    folder = tmp_path_factory.mktemp("not-tfrecords")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TPURUN_CACHE_DIR", str(folder / "cache"))
        source = _table(folder / "penguins.csv", 48, seed=0)
        written = _cli("data", "write", source, folder / "ds" / "pen", *WRITTEN.split())
        assert written.exit_code == 0, written.output
        (folder / "model.py").write_text(
            "import keras\n\n\ndef dense():\n"
            "    inputs = keras.Input(shape=(3,), name='x')\n"
            "    return keras.Model(inputs, keras.layers.Dense(3, activation='softmax')(inputs))\n"
        )
        config = {
            "name": "pen",
            "model": {"factory": "model.py:dense", "loss": "sparse_categorical_crossentropy"},
            "data": {"train": "ds/pen-*.tfrecord", "inputs": "x", "targets": "species"},
            "train": {"epochs": 1, "per_core_batch_size": 16},
            "runtime": {"cpu_devices": 1},
            "output": {"dir": str(folder / "runs")},
        }  # fmt: skip
        path = write_config(folder / "pen.yaml", config)
        trained = _cli("train", path)
        assert trained.exit_code == 0, trained.output
    return folder, path, folder / "runs" / "pen"


def test_predict_and_evaluate_name_a_csv_and_the_options_it_needs(tabular, tmp_path):
    folder, _, run = tabular
    test = _table(tmp_path / "test.csv", 9, seed=1)
    out = str(tmp_path / "p.csv")
    expected = (f"--data: {test} is a CSV file, not TFRecords (the tf.train.Example records tpurun "
                "reads). Write it as TFRecords as the run's training data was: `tpurun data write "
                f"{test} OUT_PREFIX {WRITTEN}`, then give OUT_PREFIX-*.tfrecord in its place.")  # fmt: skip
    assert _refused("predict", run, "--data", test, "--output", out) == f"error: {expected}"
    assert _refused("evaluate", run, "--data", test) == f"error: {expected}"
    # The command it gives works (OUT_PREFIX filled in), and predict reads what it wrote.
    command = expected.split("`")[1].replace("OUT_PREFIX", str(tmp_path / "test"))
    assert command.startswith("tpurun data write ")
    made = _cli(*shlex.split(command)[1:])
    assert made.exit_code == 0, made.output
    result = _cli("predict", run, "--data", tmp_path / "test-*.tfrecord", "--output", out)
    assert result.exit_code == 0, result.output
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["row", "class", *SPECIES] and len(rows) == 9
    assert "classes adelie, chinstrap, gentoo" in " ".join(result.output.split())


@pytest.mark.parametrize("reader", ["native", "tf_data"])
def test_train_names_a_validation_file_that_is_not_tfrecords(tabular, tmp_path, reader):
    """Found where the records are first checked, before either reader opens them; gzip is
    looked inside."""
    _, config, _ = tabular
    packed = tmp_path / "val.csv.gz"
    packed.write_bytes(gzip.compress(_table(tmp_path / "val.csv", 6, seed=2).read_bytes()))
    shown = _refused("train", config, "--set", f"data.validation={packed}",
                     "--set", f"data.reader={reader}", "--set", f"output.dir={tmp_path}")  # fmt: skip
    assert shown.endswith(
        f"error: data.validation: {packed} is a gzip-compressed CSV file, not TFRecords (the "
        "tf.train.Example records tpurun reads). Write it as TFRecords as the run's training "
        "data was (data write knows a .csv file by its name): `gunzip -c "
        f"{packed} > val.csv && tpurun data write val.csv OUT_PREFIX {WRITTEN}`, then give "
        "OUT_PREFIX-*.tfrecord in its place."
    )
    assert not (tmp_path / "pen").exists()


def test_data_train_a_csv_is_named_before_its_missing_schema(tabular, tmp_path):
    """A CSV as data.train has no schema file either: what it is comes first; data bench and
    data inspect say the same."""
    _, config, _ = tabular
    table = _table(tmp_path / "train.csv", 6, seed=3)
    said = f"{table} is a CSV file, not TFRecords"
    shown = _refused("train", config, "--set", f"data.train={table}")
    assert f"error: data.train: {said}" in shown and f"data write {table} OUT_PREFIX`" in shown
    shown = _refused("data", "bench", config, "--set", f"data.train={table}")
    assert f"error: data.train: {said}" in shown
    assert _refused("data", "inspect", table).startswith(f"error: {said}")


@pytest.mark.parametrize(
    ("name", "content", "said", "advice"),
    [
        (
            "rows.jsonl.gz",
            gzip.compress(b'{"a": 1}\n', mtime=0),
            "a gzip-compressed JSONL file",
            "`gunzip -c {path} > rows.jsonl && tpurun data write rows.jsonl OUT_PREFIX`",
        ),
        (
            "notes.tfrecord",
            b"hello there\nsecond line\n",
            "a plain text file",
            "Write it as JSONL first",
        ),
        (
            "img.tfrecord",
            b"\x89PNG\r\n\x1a\n" + bytes(40),
            "a PNG image",
            "`tpurun data write IMAGE_FOLDER OUT_PREFIX`",
        ),
        (
            "t.parquet",
            b"PAR1" + bytes(40) + b"PAR1",
            "a Parquet file",
            "pd.read_parquet(PATH).to_csv('data.csv', index=False)",
        ),
        (
            "a.npy",
            b"\x93NUMPY\x01\x00" + bytes(40),
            "a NumPy .npy array",
            "`tpurun data write {path} OUT_PREFIX`",
        ),
        ("rows.json", b'[{"a": 1}]', "a JSON file", "Write it as JSONL first"),
        ("t.tsv", b"a\tb\n1\t2\n", "a tab-separated file", "Save it as CSV first"),
    ],
    # Named by file: ids made of the bytes would differ between xdist workers wherever the bytes
    # do (a gzip header holds the time it was made), and the workers must collect the same tests.
    ids=["jsonl.gz", "text", "png", "parquet", "npy", "json", "tsv"],
)
def test_each_kind_is_told_by_its_content(tmp_path, name, content, said, advice):
    path = tmp_path / name
    path.write_bytes(content)
    message = _refused("data", "inspect", path)
    assert f"{path} is {said}, not TFRecords" in message
    assert advice.format(path=path) in message


def test_a_damaged_tfrecord_is_still_damaged(tmp_path):
    from tpurun.data.write import write_shards

    [shard] = write_shards(str(tmp_path / "d"), [{"y": i} for i in range(4)], 1)
    raw = bytearray(Path(shard).read_bytes())
    raw[2] ^= 0xFF  # the first record's length: its CRC no longer matches
    Path(shard).write_bytes(bytes(raw))
    assert sniff.kind_of(bytes(raw)) is None
    message = _refused("data", "inspect", shard)
    assert "corrupted record (checksum mismatch) at byte 0 (the first record)" in message


def test_written_flags_say_how_a_schema_was_written():
    schema = json.loads(json.dumps({"label": "y", "packed": {"x": ["a", "b"]},
                                    "fill_missing": {"a": 0.5, "b": 1.25},
                                    "tokenized": {"preset": "p", "sequence_length": 64}}))  # fmt: skip
    assert sniff.written_flags(schema) == ["--label", "y", "--pack", "x=a,b", "--fill-missing",
                                           "mean", "--tokenize", "p", "--sequence-length", "64"]  # fmt: skip
    assert sniff.written_flags({"fill_missing": {"a": 0.0}}) == ["--fill-missing", "0"]
    assert sniff.written_flags(None) == []
