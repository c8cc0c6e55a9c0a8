"""`tpurun data inspect` (library side): counts, inferred features and advice, on real files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml
from helpers import encode_image

from tpurun.config import DataConfig
from tpurun.data import pipeline
from tpurun.data import schema_file as schema
from tpurun.data.advice import advise
from tpurun.data.feature_inference import FeatureInfo
from tpurun.data.inspect import FileInfo, inspect
from tpurun.data.write import example_bytes, write_shards
from tpurun.errors import DataError

N = 12


def every_kind(n: int = N) -> list[dict]:
    rng = np.random.default_rng(0)
    png = encode_image(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8), "png")
    jpeg = encode_image(rng.integers(0, 256, (12, 10, 1), dtype=np.uint8), "jpeg")
    return [
        {
            "f32": rng.normal(size=16).astype(np.float32).tobytes(),
            "f64": rng.normal(size=16).tobytes(),
            "whole64": np.arange(i, i + 4, dtype=np.float64).tobytes(),  # low words are zero
            "u8": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8).tobytes(),
            "label": i % 3,
            "vec": [i, 2 * i, 3 * i],
            "f": [0.5 * i, 1.0],
            "id": f"id{i:02d}",  # same length in every record, but text
            "name": "x" * (i + 1),
            "tags": ["a", "b"],
            "png": png,
            "jpeg": jpeg,
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return write_shards(str(tmp_path_factory.mktemp("kinds") / "d"), every_kind(), 3)


def specs(report) -> dict:
    return {f.name: f.spec for f in report.features}


#: What inspect infers for :func:`every_kind`'s features.
EVERY_KIND = {
    "f32": {"type": "raw", "dtype": "float32", "shape": [16]},
    "f64": {"type": "raw", "dtype": "float64", "shape": [16]},
    "whole64": {"type": "raw", "dtype": "float64", "shape": [4]},
    "u8": {"type": "raw", "dtype": "uint8", "shape": [192]},
    "label": {"type": "int64", "shape": []},
    "vec": {"type": "int64", "shape": [3]},
    "f": {"type": "float", "shape": [2]},
    "id": {"type": "text"},
    "name": {"type": "text"},
    "tags": {"type": "bytes", "shape": [2]},
    "png": {"type": "image", "shape": [20, 30, 3]},
    "jpeg": {"type": "image", "shape": [12, 10, 1]},
}


def test_infers_every_kind(shards):
    report = inspect(shards[0].replace("00000", "*"))
    assert specs(report) == EVERY_KIND
    notes = {f.name: " ".join(f.notes) for f in report.features}
    assert "are guesses" in notes["f32"] and "are guesses" in notes["u8"]
    assert notes["label"] == notes["png"] == ""
    assert report.sampled_records == N  # fewer than 16 in the first file: the next ones follow
    assert {f.stored for f in report.features if f.name in ("vec", "label")} == {"int64_list"}


def test_yaml_block_validates_and_decodes_the_data(shards):
    report = inspect(shards)
    assert "  f32: {type: raw, dtype: float32, shape: [16]}\n" in report.features_yaml
    features = yaml.safe_load(report.features_yaml)["features"]
    names = [name for name in features if name != "label"]
    data = DataConfig.model_validate(
        {"train": "unused", "features": features, "inputs": names, "targets": "label"}
    )
    inputs, label = next(iter(pipeline.make_dataset(shards[:1], data, 4, training=False)))
    got = dict(zip(names, inputs, strict=True))
    written = every_kind()[0:12:3]  # round-robin: shard 0 holds records 0, 3, 6, 9
    assert label.numpy().tolist() == [r["label"] for r in written]
    for name, dtype in (("f32", np.float32), ("f64", np.float64), ("u8", np.uint8)):
        want = [np.frombuffer(r[name], dtype).ravel() for r in written]
        np.testing.assert_array_equal(got[name].numpy(), want)
    assert got["png"].shape == (4, 20, 30, 3) and got["jpeg"].shape == (4, 12, 10, 1)
    assert got["tags"].numpy()[0].tolist() == [b"a", b"b"]


def test_variable_length_mixed_and_missing_keys_are_left_out(tmp_path):
    records = [{"y": i, "var": list(range(i + 1)), "mixed": i if i % 2 else "s"} for i in range(4)]
    records[1]["sometimes"] = 1.0
    files = write_shards(str(tmp_path / "d"), records, 1)
    report = inspect(files)
    by_name = {f.name: f for f in report.features}
    assert by_name["var"].spec is None and "variable length (1 to 4" in by_name["var"].notes[0]
    assert by_name["mixed"].stored == "mixed" and by_name["mixed"].spec is None
    assert (
        by_name["sometimes"].spec is None and "missing in 3 of 4" in by_name["sometimes"].notes[0]
    )
    assert yaml.safe_load(report.features_yaml) == {
        "features": {"y": {"type": "int64", "shape": []}}
    }


def test_counts_every_file_and_reports_progress(shards):
    calls = []
    report = inspect(shards, progress=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert report.counts_from == "counted" and report.total_records == N
    assert [f.records for f in report.files] == [4, 4, 4]
    assert [f.bytes for f in report.files] == [Path(p).stat().st_size for p in shards]
    assert report.total_bytes == sum(f.bytes for f in report.files)
    assert report.class_names is None and report.schema_path is None


def test_counts_and_features_from_a_schema_file(tmp_path):
    rng = np.random.default_rng(1)
    records = [{"x": rng.normal(size=(4, 4)).astype(np.float32).tobytes(), "y": 1}] * 4
    files = write_shards(str(tmp_path / "d"), records, 2)
    declared = {"pixels": {"type": "raw", "dtype": "float32", "shape": [4, 4], "key": "x"}}
    # Counts no reader would find: they can only have come from the schema.
    listed = {Path(files[0]).name: 100, Path(files[1]).name: 200}
    path = schema.schema_path(str(tmp_path / "d"))
    schema.write(path, schema.make(declared, {"train": listed}, class_names=["cat", "dog"]))
    calls = []
    report = inspect(str(tmp_path / "d-*.tfrecord"), progress=lambda *a: calls.append(a))
    assert report.counts_from == "schema" and report.total_records == 300 and calls == []
    assert report.class_names == ["cat", "dog"] and report.schema_path == path
    pixels = next(f for f in report.features if f.key == "x")
    assert (pixels.name, pixels.source, pixels.notes) == ("pixels", "schema", [])
    assert "pixels: {type: raw, dtype: float32, shape: [4, 4], key: x}" in report.features_yaml

    # A schema that lists only some of the files: every file is counted instead.
    write_shards(str(tmp_path / "e"), records, 1)
    report = inspect([str(tmp_path / "d-*.tfrecord"), str(tmp_path / "e-*.tfrecord")])
    assert report.counts_from == "counted" and report.total_records == 8


def test_gzip_is_detected_and_read(tmp_path):
    files = write_shards(str(tmp_path / "d"), every_kind(4), 2, compression="gzip")
    assert Path(files[0]).read_bytes()[:2] == b"\x1f\x8b"
    report = inspect(files)
    assert report.compression == "gzip" and report.total_records == 4
    assert specs(report)["png"] == {"type": "image", "shape": [20, 30, 3]}
    assert any(line.startswith("the files are GZIP-compressed") for line in report.advice)


def test_advice_on_few_shards_float64_and_uint8_images(shards):
    advice = inspect(shards).advice
    assert any(a.startswith("3 files: use a multiple of 8 shards") for a in advice)
    assert any("'f64' is stored as raw float64" in a for a in advice)
    assert any("'whole64' is stored as raw float64" in a for a in advice)
    assert any("'u8' (raw uint8) may be an image of shape [8, 8, 3]" in a for a in advice)
    assert not any("'f32'" in a for a in advice)


MB, GB = 10**6, 10**9


@pytest.mark.parametrize(
    ("sizes", "records", "largest", "expected"),
    [
        ([150 * MB] * 8, 1000, 0, []),
        ([100] * 16, 10, 0, ["16 files average 100 B: too many small files"]),
        ([150 * MB] * 12, 1000, 0, ["12 files is not a multiple of 8", "into 16 shards"]),
        ([3 * GB] * 8, 1000, 0, ["files average 3.0 GB: too few and too large", "into 160"]),
        ([150 * MB] * 8, 1000, 3 * GB, ["records reach 3.0 GB", "Unable to parse tensor proto"]),
        ([3 * GB] * 8, 1, 0, ["records reach 3.0 GB"]),  # estimated from file size / records
        ([0] * 8, 0, 0, ["the files hold no records"]),
    ],
)
def test_advice_on_shard_sizes_and_record_sizes(sizes, records, largest, expected):
    files = [FileInfo(f"f{i}", size, records) for i, size in enumerate(sizes)]
    advice = " | ".join(advise(files, "none", [], largest))
    assert all(part in advice for part in expected), advice
    assert bool(advice) == bool(expected)


def test_raw_uint8_with_a_cast_needs_no_advice():
    feature = FeatureInfo("x", "x", "bytes_list", {"type": "raw", "dtype": "uint8", "shape": [784]})
    files = [FileInfo(f"f{i}", 150 * MB, 100) for i in range(8)]
    assert "[28, 28, 1]" in advise(files, "none", [feature])[0]
    feature.spec["cast"] = "float32"
    assert advise(files, "none", [feature]) == []


def test_json_round_trip(shards):
    data = inspect(shards).to_dict()
    assert data["version"] == 1 and json.loads(json.dumps(data)) == data
    assert {"files", "total_bytes", "total_records", "counts_from", "compression", "features",
            "features_yaml", "advice", "class_names"} <= set(data)  # fmt: skip
    assert data["files"][0] == {"path": shards[0], "bytes": data["files"][0]["bytes"], "records": 4}
    assert {f["name"]: f["spec"] for f in data["features"]} == EVERY_KIND


def test_errors_name_the_glob_or_the_file(tmp_path):
    with pytest.raises(DataError, match=r"nothing-\*\.tfrecord: no file matches"):
        inspect(str(tmp_path / "nothing-*.tfrecord"))
    text = tmp_path / "notes.csv"
    text.write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match=r"notes\.csv is a CSV file, not TFRecords"):
        inspect(str(text))
    with tf.io.TFRecordWriter(str(tmp_path / "t.tfrecord")) as writer:
        writer.write(b"\x00\x01not an example")
    with pytest.raises(DataError, match=r"t\.tfrecord: the records are not tf.train.Example"):
        inspect(str(tmp_path / "t.tfrecord"))
    # One good file and one bad one: counting names the bad one.
    write_shards(str(tmp_path / "a"), [{"y": 1}], 1)
    (tmp_path / "b-00000-of-00001.tfrecord").write_bytes(b"garbage that is long enough")
    with pytest.raises(DataError, match=r"b-00000-of-00001\.tfrecord"):
        inspect(str(tmp_path / "[ab]-*.tfrecord"))
    with pytest.raises(ValueError, match="sample=0"):
        inspect(str(tmp_path / "a-*.tfrecord"), sample=0)


def test_sample_limits_the_records_read(tmp_path):
    files = write_shards(str(tmp_path / "d"), [{"y": i} for i in range(10)], 1)
    report = inspect(files, sample=3)
    assert report.sampled_records == 3 and report.total_records == 10
    assert report.largest_sampled_record == len(example_bytes({"y": 0}))
