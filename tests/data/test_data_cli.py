"""`tpurun data ...` through the CLI."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml
from helpers import make_image_folder, read_log, run_cli, toy_config, write_config
from typer.testing import CliRunner

from tpurun.config import load_config
from tpurun.doctor import config_checks as cc
from tpurun.runtime.machine import Machine

_QUOTED = re.compile(r"`(tpurun [^`]*)`")


def suggested_commands(text: str) -> list[str]:
    """Every ``tpurun ...`` command a message suggests, each parsed by the real Typer app.

    A command must be in backticks (so that it can be found), and must parse: its subcommands
    exist, its options exist and its values convert. Placeholders such as SOURCE are arguments.
    """
    from typer.main import get_command

    from tpurun.cli.app import app

    root = get_command(app)
    mentioned = re.findall(rf"\btpurun (?:{'|'.join(root.commands)})\b", text)
    commands = _QUOTED.findall(text)
    assert len(commands) == len(mentioned), f"a tpurun command outside backticks in: {text}"
    for command in commands:
        args, cmd, name = shlex.split(command)[1:], root, "tpurun"
        while hasattr(cmd, "commands"):
            name = args.pop(0)
            assert name in cmd.commands, f"{command}: no command {name!r}"
            cmd = cmd.commands[name]
        cmd.make_context(name, args)  # a usage error for an unknown option or a bad value
    return commands


def cli(*args: str):
    """``tpurun ARGS`` through the CLI's app, in this process."""
    from tpurun.cli.app import app

    return CliRunner().invoke(app, list(args))


def test_bench_json_and_plain_listing_and_a_bad_config(tmp_path, toy_data):
    path = write_config(
        tmp_path, toy_config(toy_data, tmp_path / "runs", runtime={"cpu_devices": 2})
    )
    result = cli("data", "bench", str(path), "--steps", "20", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["examples_per_sec"] > 0 and data["global_batch_size"] == 64
    assert data["steps"] == 20 and data["cpu_cores"] >= 1
    assert data["bytes_per_record"] > 32  # 8 float32 values plus the Example framing
    result = cli("data", "bench", str(path), "--steps", "5")
    assert result.exit_code == 0, result.output
    assert "examples/s" in result.stdout and "\x1b[" not in result.stdout
    assert not (tmp_path / "runs").exists()  # benchmarking writes no run
    result = cli("data", "bench", str(path), "--set", "data.train=missing/*.tfrecord")
    assert result.exit_code == 2 and "no file matches this glob" in result.output


@pytest.mark.slow
def test_inspect_prints_a_features_block_that_trains(tmp_path, toy_data):
    result = run_cli("data", "inspect", str(toy_data / "train-*.tfrecord"))
    assert result.returncode == 0, result.stderr
    assert "512 records (counted)" in result.stdout
    block = result.stdout.split("paste into data: in the config\n", 1)[1].split("\n\n", 1)[0]
    features = yaml.safe_load(block)["features"]
    assert features["x"] == {"type": "raw", "dtype": "float32", "shape": [8]}
    assert features["y"] == {"type": "int64", "shape": []}
    assert "oneDNN" not in result.stderr  # TensorFlow's start-up notices stay out (a fresh process)

    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 1})
    config["data"]["features"] = {**features, "y": {**features["y"], "cast": "float32"}}
    train = cli("train", str(write_config(tmp_path, config)))
    assert train.exit_code == 0, train.output


def test_inspect_json_and_missing_glob(tmp_path, toy_data):
    result = cli("data", "inspect", str(toy_data / "val-*.tfrecord"), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["version"] == 1 and report["total_records"] == 128 and len(report["files"]) == 2
    result = cli("data", "inspect", str(tmp_path / "none-*.tfrecord"))
    assert result.exit_code == 2 and "no file matches this glob" in result.output
    assert "Traceback" not in result.output


def test_write_then_train_from_the_schema_alone(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1200, 8)).astype(np.float32)
    np.savez(tmp_path / "arrays.npz", x=x, y=(x.sum(axis=1) > 0).astype(np.float32))
    result = cli("data", "write", str(tmp_path / "arrays.npz"), str(tmp_path / "ds" / "toy"),
                 "--validation-fraction", "0.2", "--shard-mb", "0.01", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["records"] == 1200 and len(report["splits"]["train"]) % 8 == 0
    assert sum(s["records"] for s in report["splits"]["validation"]) == 240

    config = toy_config(tmp_path / "ds", tmp_path / "runs", train={"epochs": 1})
    config["data"] = {"train": str(tmp_path / "ds" / "toy-train-*.tfrecord"),
                      "validation": str(tmp_path / "ds" / "toy-validation-*.tfrecord"),
                      "inputs": "x", "targets": "y"}  # fmt: skip
    train = cli("train", str(write_config(tmp_path, config)))
    assert train.exit_code == 0, train.output
    derived = yaml.safe_load((tmp_path / "runs" / "toy" / "config.yaml").read_text())["derived"]
    assert derived["record_counts_from"] == "schema" and derived["train_records"] == 960


IMAGE_MODEL = """
import keras


def pets():
    inputs = keras.Input(shape=(8, 8, 3), name="image")
    flat = keras.layers.Flatten()(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(flat))
"""


def test_an_image_folder_written_trained_on_and_predicted_with_its_class_names(tmp_path):
    """`tpurun data write` of a folder per class, then `tpurun train` from the schema alone,
    then `tpurun predict`: its CSV has a column per class name, and names the likelier one."""
    make_image_folder(tmp_path / "pets")  # 3 dark cats (PNG), 3 bright dogs (JPEG), one .txt
    written = cli("data", "write", str(tmp_path / "pets"), str(tmp_path / "ds" / "pets"),
                  "--image-size", "8", "8", "--shard-multiple", "2", "--json")  # fmt: skip
    assert written.exit_code == 0, written.output
    report = json.loads(written.stdout)
    assert report["records"] == 6 and report["class_names"] == ["cat", "dog"]

    (tmp_path / "pets_model.py").write_text(IMAGE_MODEL)
    config = toy_config(tmp_path / "ds", tmp_path / "runs", name="pets",
                        model={"factory": f"{tmp_path / 'pets_model.py'}:pets",
                               "loss": "sparse_categorical_crossentropy"},
                        train={"epochs": 10, "per_core_batch_size": 2,
                               "learning_rate": {"base": 0.05}})  # fmt: skip
    config["data"] = {"train": str(tmp_path / "ds" / "pets-*.tfrecord"), "inputs": "image",
                      "targets": "label"}  # fmt: skip
    trained = cli("train", str(write_config(tmp_path, config)))
    assert trained.exit_code == 0, trained.output
    run_dir = tmp_path / "runs" / "pets"
    assert len(read_log(run_dir)) == 10
    derived = yaml.safe_load((run_dir / "config.yaml").read_text())["derived"]
    assert derived["class_names"] == ["cat", "dog"] and derived["train_records"] == 6

    out = tmp_path / "pets.csv"
    predicted = cli("predict", str(run_dir), "--data", str(tmp_path / "ds" / "pets-*.tfrecord"),
                    "-o", str(out), "--id-feature", "label")  # fmt: skip
    assert predicted.exit_code == 0, predicted.output
    import csv

    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6 and list(rows[0]) == ["label", "class", "cat", "dog"]
    for row in rows:  # the likelier class, by name; and dark cats and bright dogs are learned
        assert row["class"] == max(("cat", "dog"), key=lambda name: float(row[name]))
    assert [row["class"] for row in rows] == [["cat", "dog"][int(row["label"])] for row in rows]


def test_write_bad_source_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = cli("data", "write", str(tmp_path / "notes.txt"), str(tmp_path / "out" / "x"))
    assert result.exit_code == 2 and str(tmp_path / "notes.txt") in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ commands that messages suggest
def test_suggested_commands_are_checked():
    assert suggested_commands("write shards: `tpurun data write SRC OUT --shard-mb 9`") == [
        "tpurun data write SRC OUT --shard-mb 9"
    ]
    from typer import BadParameter
    from typer.exceptions import TyperException  # what Typer raises for an unknown option

    refused = [
        # not quoted: it could not be checked
        (
            "write shards (tpurun data write SRC OUT --shard-mb 9)",
            AssertionError,
            "outside backticks",
        ),
        ("write shards: `tpurun data write SRC OUT --shards 32`", TyperException, "--shards"),
        (
            "write shards: `tpurun data write SRC OUT --shard-multiple many`",
            BadParameter,
            "a valid integer",
        ),
        ("write shards: `tpurun data rewrite SRC OUT`", AssertionError, "no command 'rewrite'"),
    ]
    for bad, error, says in refused:
        with pytest.raises(error, match=re.escape(says)):
            suggested_commands(bad)


def test_every_command_doctors_data_checks_suggest_exists(toy_data, tmp_path, monkeypatch):
    config = load_config(toy_config(toy_data, tmp_path / "runs"))
    few = cc.check_split(config, "train", Machine(), 8)  # 4 shards for 8 replicas
    assert few.status == "warn"
    assert suggested_commands(few.fix) == ["tpurun data write SOURCE OUT_PREFIX --shard-multiple 8"]
    one = load_config(
        toy_config(toy_data, tmp_path / "runs"), [f"data.train={toy_data}/val-00000-*"]
    )
    monkeypatch.setattr(cc, "_size", lambda path: 200 * 10**6)  # one 200 MB file
    large = cc.check_split(one, "train", Machine(), 1)
    assert large.status == "warn" and "one large file" in large.finding
    assert suggested_commands(large.fix)
    for check in cc.data_checks(config, Machine(), 8) + cc.data_checks(one, Machine(), 1):
        suggested_commands(f"{check.finding} {check.fix or ''}")


def test_commands_in_data_error_messages_exist(tmp_path):
    from tpurun.data.resolve import resolve
    from tpurun.data.write import write_shards
    from tpurun.errors import TpurunError

    write_shards(str(tmp_path / "bare"), [{"y": 1}] * 4, 1)  # no schema file
    config = toy_config(tmp_path, tmp_path / "runs")
    config["data"] = {"train": str(tmp_path / "bare-*.tfrecord"), "inputs": "y", "targets": "y"}
    try:
        resolve(load_config(config))
    except TpurunError as exc:
        assert len(suggested_commands(str(exc))) == 2
    else:
        raise AssertionError("features left out without a schema resolved")
