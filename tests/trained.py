"""A trained toy run and a test set, for the tests of evaluate, predict and export.

The run trains in the test process (JAX, 8 simulated CPU devices, 8 records per core: a global
batch of 64). The test set is 1,003 records written round-robin into 3 files, so its file order
(each file's records in turn) is not its write order; :func:`in_file_order` reads it back file by
file with TensorFlow alone, as the reference the commands are checked against.
"""

from __future__ import annotations

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
