"""From a config's data section to files, features, compression and counts: schema files,
GZIP detection, Kaggle datasets, caching."""

from __future__ import annotations

import sys
import types

import pytest
import tensorflow as tf
import yaml
from helpers import make_records, schema_config, toy_config, write_with_schema

import tpurun
from tpurun.config import load_config
from tpurun.data import pipeline, records, resolve
from tpurun.data.write import write_shards
from tpurun.errors import ConfigError, DataError


def test_schema_fills_features_and_counts_without_reading(tmp_path, monkeypatch):
    folder = write_with_schema(tmp_path / "d")
    config = load_config(schema_config(folder, tmp_path / "runs"))
    monkeypatch.setattr(records, "_count_one", lambda *a: pytest.fail("counted despite the schema"))
    resolved = resolve.resolve(config)
    assert (resolved.train_records, resolved.validation_records, resolved.counts_from) == (
        256,
        64,
        "schema",
    )
    assert resolved.data.features["x"].shape == [8] and resolved.data.compression == "none"
    assert resolved.schema_files == [str(folder / "toy.schema.json")]


def test_train_uses_the_schema_and_records_the_effective_features(tmp_path):
    folder = write_with_schema(tmp_path / "d")
    config = schema_config(folder, tmp_path / "runs")
    config["model"]["loss"] = "binary_crossentropy"
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed"
    written = load_config(tmp_path / "runs" / "toy" / "config.yaml")
    assert written.data.features["x"].shape == [8]  # the run directory's config stands alone


def test_left_out_features_without_a_schema(tmp_path, toy_data):
    config = load_config(
        schema_config(
            toy_data, tmp_path / "runs", train=str(toy_data / "train-*.tfrecord"), validation=None
        )
    )
    with pytest.raises(ConfigError, match="data.features is left out, and no schema file beside"):
        resolve.resolve(config)


def test_references_are_checked_against_schema_features(tmp_path):
    folder = write_with_schema(tmp_path / "d")
    config = load_config(schema_config(folder, tmp_path / "runs", targets="label"))
    with pytest.raises(
        ConfigError, match="data.targets: 'label' is not a declared feature; declared: x, y"
    ):
        resolve.resolve(config)


def test_partial_schema_listing_falls_back_to_counting(tmp_path):
    folder = write_with_schema(tmp_path / "d")
    write_shards(str(folder / "toy-train-extra"), make_records(10, 5), 1)  # not in the schema
    config = load_config(schema_config(folder, tmp_path / "runs"))
    resolved = resolve.resolve(config)
    assert resolved.train_records == 266 and resolved.counts_from == "counted"


def test_gzip_is_detected(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    write_shards(str(folder / "train"), make_records(64), 2, compression="gzip")
    config = load_config(toy_config(folder, tmp_path / "runs", data={"validation": None}))
    resolved = resolve.resolve(config)
    assert resolved.data.compression == "gzip" and resolved.train_records == 64


def test_kaggle_dataset_paths(tmp_path, toy_data, monkeypatch):
    config = toy_config(toy_data, tmp_path / "runs")
    config["data"].update(
        kaggle_dataset="naic-dataset", train="train-*.tfrecord", validation="val-*.tfrecord"
    )
    with pytest.raises(
        DataError,
        match="'naic-dataset' needs the kaggle_datasets module, which only Kaggle notebooks have",
    ):
        resolve.resolve(load_config(config))

    class KaggleDatasets:
        def get_gcs_path(self, name):
            assert name == "naic-dataset"
            return str(toy_data)  # on a TPU VM: /kaggle/input/naic-dataset

    monkeypatch.setitem(
        sys.modules, "kaggle_datasets", types.SimpleNamespace(KaggleDatasets=KaggleDatasets)
    )
    resolved = resolve.resolve(load_config(config))
    assert resolved.train_records == 512 and all(
        f.startswith(str(toy_data)) for f in resolved.train_files
    )


def test_doctor_reads_the_kaggle_dataset_train_reads(tmp_path, toy_data, monkeypatch):
    from tpurun.doctor import config_checks as cc
    from tpurun.runtime.machine import Machine

    config = toy_config(toy_data, tmp_path / "runs")
    config["data"].update(
        kaggle_dataset="naic-dataset", train="train-*.tfrecord", validation="val-*.tfrecord"
    )
    outside = cc.data_checks(load_config(config), Machine(), 1)
    assert [c.status for c in outside] == ["fail", "fail"]
    assert "needs the kaggle_datasets module" in outside[0].finding

    class KaggleDatasets:
        def get_gcs_path(self, name):
            return str(toy_data)

    monkeypatch.setitem(
        sys.modules, "kaggle_datasets", types.SimpleNamespace(KaggleDatasets=KaggleDatasets)
    )
    train, validation = cc.data_checks(load_config(config), Machine(), 1)
    assert (train.status, validation.status) == ("ok", "ok"), (train.finding, validation.finding)
    assert train.data["globs"] == [f"{toy_data}/train-*.tfrecord"] and train.data["files"] == 4
    assert validation.data["files"] == 2


@pytest.mark.parametrize("cache", ["memory", "file"])
def test_cached_pipeline_gives_every_record_each_pass(tmp_path, cache):
    files = write_shards(str(tmp_path / "d"), [{"i": i} for i in range(40)], 4)
    data = load_config(toy_config(tmp_path, tmp_path / "runs")).data.model_validate(
        {
            "train": "x",
            "features": {"i": {"type": "int64"}},
            "inputs": "i",
            "targets": "i",
            "shuffle_buffer": 8,
        }
    )
    prefix = "" if cache == "memory" else str(tmp_path / "cache" / "c")
    (tmp_path / "cache").mkdir()
    ds = pipeline.make_dataset(files, data, 10, training=True, seed=0, cache=prefix)
    values = [int(v) for x, _ in ds.take(12) for v in x.numpy()]  # three passes of 40
    counts = {v: values.count(v) for v in set(values)}
    assert sorted(counts) == list(range(40))
    # the shuffle buffer (8) blurs pass boundaries a little; nothing is lost or repeated more
    assert all(2 <= c <= 4 for c in counts.values()) and sum(counts.values()) == 120
    if cache == "file":
        assert tf.io.gfile.glob(str(tmp_path / "cache" / "c*.index"))


def test_cache_end_to_end(tmp_path, toy_data):
    config = toy_config(toy_data, tmp_path / "runs", data={"cache": "memory"}, train={"epochs": 2})
    assert tpurun.train(config, verbose=False)["status"] == "completed"


def test_a_file_cache_left_half_written_by_a_killed_run_is_cleared(tmp_path, toy_data):
    prefix = tmp_path / "cache" / "toy"
    prefix.parent.mkdir()
    # What TF leaves when the process dies while writing the cache (measured with SIGKILL).
    (prefix.parent / "toy-train_0.lockfile").write_text("Created at: 1795336182")
    (prefix.parent / "toy-train_0.data-00000-of-00001.tempstate1563045044").write_bytes(b"xx")
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 2},
                        data={"cache": str(prefix), "reader": "tf_data"})  # fmt: skip
    assert tpurun.train(config, verbose=False)["status"] == "completed"
    assert (prefix.parent / "toy-train.index").exists()  # written whole this time


def test_a_partial_features_block_merges_with_the_schema(tmp_path):
    folder = write_with_schema(tmp_path / "d")
    # Only the label is declared (cast to float, as a Kaggle user would for a sigmoid output);
    # x comes from the schema, in its order.
    config = load_config(schema_config(folder, tmp_path / "runs",
                                       features={"y": {"type": "int64", "cast": "float32"}}))  # fmt: skip
    resolved = resolve.resolve(config)
    assert list(resolved.data.features) == ["x", "y"]
    assert resolved.data.features["x"].shape == [8]  # from the schema
    assert resolved.data.features["y"].cast == "float32"  # declared: it wins


def test_inputs_and_targets_must_name_features_declared_or_in_the_schema(tmp_path):
    folder = write_with_schema(tmp_path / "d")
    config = load_config(
        schema_config(folder, tmp_path / "runs", inputs=["x", "xx"], targets={"out": "z"})
    )
    with pytest.raises(ConfigError) as info:
        resolve.resolve(config)
    joined = "\n".join(info.value.problems)
    assert "data.inputs: 'xx' is not a declared feature; did you mean 'x'?" in joined
    assert "data.targets: 'z' is not a declared feature; declared: x, y" in joined


def test_class_names_from_the_schema_reach_the_run_directory(tmp_path):
    folder = write_with_schema(tmp_path / "d", n_train=128, n_val=0, train_shards=2,
                               class_names=["neg", "pos"])  # fmt: skip
    config = schema_config(folder, tmp_path / "runs",
                           features={"y": {"type": "int64", "cast": "float32"}})  # fmt: skip
    config["train"]["epochs"] = 1
    tpurun.train(config, verbose=False)
    written = yaml.safe_load((tmp_path / "runs" / "toy" / "config.yaml").read_text())
    assert written["derived"]["class_names"] == ["neg", "pos"]
