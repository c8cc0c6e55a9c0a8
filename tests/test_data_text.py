"""Text data: the ``text`` feature type, JSONL and CSV text columns through ``tpurun data write``,
read back by the real pipeline, ``data inspect`` and ``data bench`` on them."""

from __future__ import annotations

import pytest
import tensorflow as tf

from tpurun.config import DataConfig, load_config
from tpurun.data import decode, pipeline
from tpurun.data.write import write_shards
from tpurun.errors import ConfigError, DataError

# Strings a writer or a reader could get wrong: unicode, the CSV's own delimiters and quotes,
# line breaks, an empty string, surrounding spaces, JSON's escapes.
AWKWARD = [
    "héllo wörld, 日本語 🙂",
    'she said "hi", then left',
    "line one\nline two\r\nline three",
    "",
    "  padded  ",
    'a\\b \t tab {"json": [1, 2]}',
    "12",
    "x" * 300,
]


def text_data(**features) -> DataConfig:
    features = features or {"text": {"type": "text"}, "label": {"type": "int64"}}
    names = list(features)
    return DataConfig.model_validate(
        {"train": "unused", "features": features, "inputs": names[0], "targets": names[-1]}
    )


# ---------------------------------------------------------------------------- the feature type
def test_text_records_decode_to_one_string_per_example(tmp_path):
    records = [{"text": s, "label": i} for i, s in enumerate(AWKWARD)]
    files = write_shards(str(tmp_path / "t"), records, 1)
    texts, labels = next(iter(pipeline.make_dataset(files, text_data(), 8, training=False)))
    assert texts.dtype == tf.string and texts.shape == (8,)
    assert [t.decode("utf-8") for t in texts.numpy()] == AWKWARD
    assert labels.numpy().tolist() == list(range(8))
    assert decode.decoded_dtype(text_data().features["text"]) == "string"


def test_a_record_key_other_than_the_name(tmp_path):
    files = write_shards(str(tmp_path / "t"), [{"doc/body": "abc", "y": 1}] * 2, 1)
    data = text_data(body={"type": "text", "key": "doc/body"}, y={"type": "int64"})
    texts, _ = next(iter(pipeline.make_dataset(files, data, 2, training=False)))
    assert texts.numpy().tolist() == [b"abc", b"abc"]


def test_normalize_on_text_is_a_config_error(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "model: {factory: m.py:build}\n"
        "data:\n"
        "  train: t.tfrecord\n"
        "  features:\n"
        "    text: {type: text, normalize: true}\n"
        "    label: {type: int64}\n"
        "  inputs: text\n"
        "  targets: label\n"
    )
    with pytest.raises(ConfigError, match=r"c.yaml:5: data.features.text: normalize standardizes"):
        load_config(config)


def test_the_first_record_is_checked_against_a_text_feature(tmp_path):
    files = write_shards(str(tmp_path / "t"), [{"n": 3, "blob": b"\xff\xfe", "s": "ok"}], 1)
    serialized = next(iter(tf.data.TFRecordDataset(files))).numpy()
    decode.check_record(serialized, text_data(s={"type": "text"}).features, files[0])
    with pytest.raises(DataError, match=r"'n' is declared text .* holds 1 int64 value"):
        decode.check_record(serialized, text_data(n={"type": "text"}).features, files[0])
    with pytest.raises(DataError, match=r"'blob' .* not UTF-8 text \(byte 0\); declare it bytes"):
        decode.check_record(serialized, text_data(blob={"type": "text"}).features, files[0])
