"""Data on gs:// against the GCS test server: ``data write`` commits shards into a bucket,
``data inspect`` and ``data bench`` read them (``data bench`` with each reader: READERS), and the
record-count cache notices an object that was rewritten in place (same name, same size) and gives
``data.skip_corrupt`` its new verdict."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gcs_server import _readers
from helpers import make_records, toy_config, write_config

from tpurun.data.write import write_shards

pytestmark = [pytest.mark.gcs, pytest.mark.slow]
READERS = _readers()


def bench_config(tmp_path: Path, train: str, **data) -> Path:
    config = toy_config(tmp_path, tmp_path / "runs")
    config["data"].update({"train": train, "validation": None, **data})
    return write_config(tmp_path / "bench.yaml", config)


@pytest.mark.parametrize("reader", READERS)
def test_data_write_inspect_and_bench_on_gcs(gcs, tmp_path, reader):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1200, 8)).astype(np.float32)
    np.savez(tmp_path / "arrays.npz", x=x, y=(x.sum(axis=1) > 0).astype(np.float32))
    prefix = f"{gcs.bucket}/ds/toy"
    done = gcs.tpurun("data", "write", str(tmp_path / "arrays.npz"), prefix, "--json",
                      "--validation-fraction", "0.2", "--shard-mb", "0.01", "--shard-multiple",
                      "4", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    shards = [s["path"] for split in report["splits"].values() for s in split]
    assert len(report["splits"]["train"]) % 4 == 0 and all(s.startswith(prefix) for s in shards)
    # Committed: the shards and the schema file, and no partial file left behind.
    objects = [p for p in gcs.list(f"{gcs.bucket}/ds/") if not p.endswith("/")]  # not markers
    assert objects == sorted([*shards, f"{prefix}.schema.json"])

    done = gcs.tpurun("data", "inspect", f"{prefix}-train-*.tfrecord", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    inspected = json.loads(done.stdout)
    assert (inspected["total_records"], inspected["counts_from"]) == (960, "schema")
    assert inspected["schema_path"] == f"{prefix}.schema.json"

    config = bench_config(tmp_path, f"{prefix}-train-*.tfrecord", features={}, reader=reader)
    done = gcs.tpurun("data", "bench", str(config), "--steps", "10", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    bench = json.loads(done.stdout)
    assert bench["examples_per_sec"] > 0 and bench["train_records"] == 960
    assert bench["reader"] == reader


def test_the_count_cache_notices_a_rewritten_shard(gcs, tmp_path):
    (tmp_path / "raw").mkdir()
    paths = write_shards(str(tmp_path / "raw" / "part"), make_records(512), 4)
    gcs.upload(tmp_path / "raw", f"{gcs.bucket}/raw")
    glob = f"{gcs.bucket}/raw/part-*.tfrecord"
    first = f"{gcs.bucket}/raw/{Path(paths[0]).name}"
    cache = tmp_path / "cache"
    env = {"cwd": tmp_path, "TPURUN_CACHE_DIR": str(cache)}

    done = gcs.tpurun("data", "inspect", glob, "--json", **env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["total_records"] == 512
    counts = json.loads((cache / "record_counts.json").read_text())
    assert sum(key.startswith(first + "|") for key in counts) == 1

    # Rewritten in place with one byte changed: same name, same size, a new object generation.
    data = bytearray(Path(paths[0]).read_bytes())
    data[-5] ^= 0xFF  # the last record's last byte: its checksum no longer matches
    gcs.put(first, bytes(data))
    done = gcs.tpurun("data", "inspect", glob, **env)
    assert done.returncode == 2
    assert f"{first}: cannot read it as TFRecords: corrupted record" in done.stderr

    config = bench_config(tmp_path, glob, skip_corrupt=True)
    done = gcs.tpurun("data", "bench", str(config), "--steps", "5", "--json", **env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["train_records"] == 384  # the damaged shard left out
