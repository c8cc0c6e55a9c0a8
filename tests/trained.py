"""A trained toy run and a test set, for the tests of evaluate, predict and export; the tiny
Gemma's chat LoRA fine-tune, for the KerasHub tests.

The run trains in the test process (JAX, 8 simulated CPU devices, 8 records per core: a global
batch of 64). The test set is 1,003 records written round-robin into 3 files, so its file order
(each file's records in turn) is not its write order; :func:`in_file_order` reads it back file by
file with TensorFlow alone, as the reference the commands are checked against.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import make_records, toy_config, write_toy_data

import tpurun

TEST_RECORDS = 1003


def train_toy(folder: Path, **sections) -> Path:
    """Train the toy model for one epoch on 8 replicas; returns its run directory."""
    data = write_toy_data(folder / "data")
    sections = {"runtime": {"cpu_devices": 8},
                "train": {"epochs": 1, "per_core_batch_size": 8}, **sections}  # fmt: skip
    config = toy_config(data, folder / "runs", **sections)
    with pytest.MonkeyPatch.context() as patch:  # a cache of its own, as conftest gives each test
        patch.setenv("TPURUN_CACHE_DIR", str(folder / "cache"))
        tpurun.train(config, verbose=False)
    return folder / "runs" / config["name"]


def write_test_set(folder: Path, targets: bool = True) -> str:
    """1,003 records in 3 files (with or without the target ``y``); returns their glob."""
    from tpurun.data.write import write_shards

    folder.mkdir(parents=True, exist_ok=True)
    records = make_records(TEST_RECORDS, seed=2)
    if not targets:
        records = [{k: v for k, v in r.items() if k != "y"} for r in records]
    write_shards(str(folder / "test"), records, 3)
    return str(folder / "test-*.tfrecord")


def in_file_order(glob: str) -> tuple[list[str], np.ndarray, np.ndarray | None]:
    """``(ids, x, y)`` of every record: sorted file names, then each file from start to end."""
    import glob as globbing

    import tensorflow as tf

    ids, xs, ys = [], [], []
    for path in sorted(globbing.glob(glob)):
        for serialized in tf.data.TFRecordDataset(path).as_numpy_iterator():
            feature = tf.train.Example.FromString(serialized).features.feature
            ids.append(feature["id"].bytes_list.value[0].decode())
            xs.append(np.frombuffer(feature["x"].bytes_list.value[0], dtype=np.float32))
            if "y" in feature:
                ys.append(feature["y"].int64_list.value[0])
    return ids, np.stack(xs), np.array(ys, dtype=np.float32) if ys else None


# ------------------------------------------------------------------- the tiny Gemma's chat LoRA
FACTORIES = Path(__file__).resolve().parent / "factories.py"


@dataclass(frozen=True)
class ChatLora:
    """The tiny Gemma's LoRA fine-tune (rank 4, alpha 8) on the chat records: 4 epochs of 9 steps
    (72 records, a global batch of 8 on 2 devices), a pattern checkpoint each epoch (``e{epoch}``,
    the last kept)."""

    run_dir: Path
    data: Path  # the records' folder
    preset: Path
    config: dict  # as trained
    weights: Path  # KeepWeights' pickle: every weight at the end (dtype, trainable, value)
    output: str  # what `tpurun train` printed

    def glob(self, split: str) -> str:
        return str(self.data / f"chat-{split}-*")

    def copy(self, folder: Path) -> tuple[Path, dict]:
        """A copy of the run under ``folder/runs``, and its config pointing there (without the
        callback that wrote :attr:`weights`), for a test that writes into the run."""
        target = folder / "runs" / self.run_dir.name
        shutil.copytree(self.run_dir, target)
        config = json.loads(json.dumps(self.config))
        config["output"]["dir"] = str(folder / "runs")
        config["callbacks"]["extra"] = []
        return target, config


def train_chat_lora(folder: Path, preset: Path, data: Path) -> ChatLora:
    from helpers import write_config
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    config = {
        "name": "lm",
        "model": {"preset": str(preset), "lora": {"rank": 4, "alpha": 8.0},
                  "sequence_length": 24},
        "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")},
        "train": {"per_core_batch_size": 4, "epochs": 4, "steps_per_execution": 1,
                  "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 2},
        "callbacks": {
            "extra": [{"name": f"{FACTORIES}:KeepWeights", "out": str(folder / "weights.pkl")}],
            "checkpoint": {"filename": "e{epoch}.keras", "keep": 1, "save_best_only": False},
        },
        "output": {"dir": str(folder / "runs")},
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:  # a cache of its own, as conftest gives each test
        patch.setenv("TPURUN_CACHE_DIR", str(folder / "cache"))
        result = CliRunner().invoke(app, ["train", str(write_config(folder, config, "lm"))])
    assert result.exit_code == 0, result.output
    return ChatLora(folder / "runs" / "lm", data, preset, config, folder / "weights.pkl",
                    result.output)  # fmt: skip
