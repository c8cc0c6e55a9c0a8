"""`tpurun data ...` through the CLI."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import yaml
from conftest import run_cli, toy_config

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


def write_config(tmp_path, config):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.mark.slow
def test_bench_json_reports_examples_per_sec(tmp_path, toy_data):
    path = write_config(
        tmp_path, toy_config(toy_data, tmp_path / "runs", runtime={"cpu_devices": 2})
    )
    result = run_cli("data", "bench", str(path), "--steps", "20", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["examples_per_sec"] > 0 and data["global_batch_size"] == 64
    assert data["steps"] == 20 and data["cpu_cores"] >= 1
    assert data["bytes_per_record"] > 32  # 8 float32 values plus the Example framing
    assert not (tmp_path / "runs").exists()  # benchmarking writes no run


@pytest.mark.slow
def test_bench_plain_listing_and_bad_config(tmp_path, toy_data):
    path = write_config(tmp_path, toy_config(toy_data, tmp_path / "runs"))
    result = run_cli("data", "bench", str(path), "--steps", "5")
    assert result.returncode == 0, result.stderr
    assert "examples/s" in result.stdout and "\x1b[" not in result.stdout
    result = run_cli("data", "bench", str(path), "--set", "data.train=missing/*.tfrecord")
    assert result.returncode == 2 and "no file matches this glob" in result.stderr


@pytest.mark.slow
def test_inspect_prints_a_features_block_that_trains(tmp_path, toy_data):
    result = run_cli("data", "inspect", str(toy_data / "train-*.tfrecord"))
    assert result.returncode == 0, result.stderr
    assert "512 records (counted)" in result.stdout
    block = result.stdout.split("paste into data: in the config\n", 1)[1].split("\n\n", 1)[0]
    features = yaml.safe_load(block)["features"]
    assert features["x"] == {"type": "raw", "dtype": "float32", "shape": [8]}
    assert features["y"] == {"type": "int64", "shape": []}
    assert "oneDNN" not in result.stderr  # TensorFlow's start-up notices stay out

    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 1})
    config["data"]["features"] = {**features, "y": {**features["y"], "cast": "float32"}}
    train = run_cli("train", str(write_config(tmp_path, config)))
    assert train.returncode == 0, train.stderr


@pytest.mark.slow
def test_inspect_json_and_missing_glob(tmp_path, toy_data):
    result = run_cli("data", "inspect", str(toy_data / "val-*.tfrecord"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["version"] == 1 and report["total_records"] == 128 and len(report["files"]) == 2
    result = run_cli("data", "inspect", str(tmp_path / "none-*.tfrecord"))
    assert result.returncode == 2 and "no file matches this glob" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_write_then_train_from_the_schema_alone(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1200, 8)).astype(np.float32)
    np.savez(tmp_path / "arrays.npz", x=x, y=(x.sum(axis=1) > 0).astype(np.float32))
    result = run_cli("data", "write", str(tmp_path / "arrays.npz"), str(tmp_path / "ds" / "toy"),
                     "--validation-fraction", "0.2", "--shard-mb", "0.01", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["records"] == 1200 and len(report["splits"]["train"]) % 8 == 0
    assert sum(s["records"] for s in report["splits"]["validation"]) == 240

    config = toy_config(tmp_path / "ds", tmp_path / "runs", train={"epochs": 2})
    config["data"] = {"train": str(tmp_path / "ds" / "toy-train-*.tfrecord"),
                      "validation": str(tmp_path / "ds" / "toy-validation-*.tfrecord"),
                      "inputs": "x", "targets": "y"}  # fmt: skip
    train = run_cli("train", str(write_config(tmp_path, config)))
    assert train.returncode == 0, train.stderr
    derived = yaml.safe_load((tmp_path / "runs" / "toy" / "config.yaml").read_text())["derived"]
    assert derived["record_counts_from"] == "schema" and derived["train_records"] == 960


@pytest.mark.slow
def test_write_bad_source_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = run_cli("data", "write", str(tmp_path / "notes.txt"), str(tmp_path / "out" / "x"))
    assert result.returncode == 2 and str(tmp_path / "notes.txt") in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


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
