"""Text data: the ``text`` feature type, JSONL and CSV text columns through ``tpurun data write``,
read back by the real pipeline, ``data inspect`` and ``data bench`` on them."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from helpers import toy_config, write_config

from tpurun.config import DataConfig, load_config
from tpurun.data import decode, pipeline
from tpurun.data import schema_file as schema
from tpurun.data.resolve import resolve
from tpurun.data.sources import open_source
from tpurun.data.sources.base import MappedSource
from tpurun.data.sources.columns import table_options
from tpurun.data.write import write_dataset, write_shards
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


# ------------------------------------------------------------------------------- data write
def cli(*args):
    """``tpurun ARGS`` through the CLI's app, in this process."""
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def write_jsonl(path: Path, rows: list) -> Path:
    """One JSON value per line (objects, or a raw line given as a str)."""
    lines = [row if isinstance(row, str) else json.dumps(row, ensure_ascii=False) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_back(prefix: Path) -> tuple[dict, dict[str, dict[str, list]]]:
    """The schema file, and each split's records through the real pipeline, as
    ``{split: {feature: [values]}}`` (strings decoded from UTF-8)."""
    written = schema.read(f"{prefix}.schema.json")
    features = written["features"]
    data = DataConfig.model_validate(
        {
            "train": "unused",
            "features": features,
            "inputs": {n: n for n in features},
            "targets": next(iter(features)),
        }  # fmt: skip
    )
    splits = {}
    for split, info in written["splits"].items():
        files = [str(prefix.parent / name) for name in info["shards"]]
        inputs, _ = next(iter(pipeline.make_dataset(files, data, info["records"], training=False)))
        splits[split] = {
            name: [v.decode("utf-8") if isinstance(v, bytes) else v for v in t.numpy().tolist()]
            for name, t in inputs.items()
        }
    return written, splits


def rows_of(columns: dict[str, list], *names: str) -> list[tuple]:
    return sorted(zip(*(columns[n] for n in names), strict=True))


CHAT = [{"prompt": p, "response": r} for p, r in zip(AWKWARD, reversed(AWKWARD), strict=True)]


def test_jsonl_prompt_response_round_trip_with_a_validation_split(tmp_path):
    source = write_jsonl(tmp_path / "chat.jsonl", CHAT * 5)  # 40 lines
    result = cli("data", "write", source, tmp_path / "out" / "chat", "--validation-fraction",
                 "0.25", "--plain")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "prompt (text), response (text)" in result.output

    written, splits = read_back(tmp_path / "out" / "chat")
    assert written["features"] == {"prompt": {"type": "text"}, "response": {"type": "text"}}
    assert written["source"] == str(source) and written["class_names"] is None
    assert {s: written["splits"][s]["records"] for s in splits} == {"train": 30, "validation": 10}
    read = [pair for columns in splits.values() for pair in rows_of(columns, "prompt", "response")]
    assert sorted(read) == sorted((row["prompt"], row["response"]) for row in CHAT * 5)


def test_jsonl_with_one_text_key_a_class_label_and_numbers(tmp_path):
    rows = [{"text": t, "label": ["neg", "pos"][i % 2], "score": i / 2, "n": i, "ok": i % 3 == 0}
            for i, t in enumerate(AWKWARD)]  # fmt: skip
    source = write_jsonl(tmp_path / "reviews.jsonl", rows)
    result = cli("data", "write", source, tmp_path / "r", "--label", "label", "--plain")
    assert result.exit_code == 0, result.output
    written, splits = read_back(tmp_path / "r")
    assert written["features"] == {
        "text": {"type": "text"},
        "label": {"type": "int64", "shape": []},
        "score": {"type": "float", "shape": []},  # 0 and 0.5: integers and fractions
        "n": {"type": "int64", "shape": []},
        "ok": {"type": "int64", "shape": []},  # true/false as 1/0
    }
    assert written["class_names"] == ["neg", "pos"] and written["label"] == "label"
    got = splits["all"]
    assert rows_of(got, "n", "text", "label", "score", "ok") == [
        (i, t, i % 2, i / 2, int(i % 3 == 0)) for i, t in enumerate(AWKWARD)
    ]


def test_csv_text_columns_and_a_text_label(tmp_path):
    source = tmp_path / "reviews.csv"
    with open(source, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "text", "zip", "label"])
        for i, text in enumerate(AWKWARD):
            writer.writerow([i, text, f"{i:03d}", ["neg", "pos", "mixed"][i % 3]])
    result = cli("data", "write", source, tmp_path / "r", "--label", "label", "--text", "zip",
                 "--plain")  # fmt: skip
    assert result.exit_code == 0, result.output
    written, splits = read_back(tmp_path / "r")
    assert written["features"] == {
        "id": {"type": "int64", "shape": []},
        "text": {"type": "text"},  # not all numbers: text
        "zip": {"type": "text"},  # all numbers, but --text: "007" keeps its zeros
        "label": {"type": "int64", "shape": []},
    }
    assert written["class_names"] == ["mixed", "neg", "pos"]
    got = splits["all"]
    assert rows_of(got, "id", "text", "zip", "label") == [
        (i, t, f"{i:03d}", [1, 2, 0][i % 3]) for i, t in enumerate(AWKWARD)
    ]


def test_features_left_out_of_a_config_come_from_the_schema_as_text(tmp_path):
    write_jsonl(tmp_path / "t.jsonl", [{"text": t, "label": i % 2} for i, t in enumerate(AWKWARD)])
    assert cli("data", "write", tmp_path / "t.jsonl", tmp_path / "d" / "t").exit_code == 0
    config = toy_config(tmp_path, tmp_path / "runs")
    config["data"] = {"train": str(tmp_path / "d" / "t-*.tfrecord"), "inputs": "text",
                      "targets": "label"}  # fmt: skip
    resolved = resolve(load_config(config))
    assert resolved.counts_from == "schema" and resolved.train_records == len(AWKWARD)
    assert resolved.data.features["text"].type == "text"
    assert resolved.data.features["label"].type == "int64"


GOOD_LINE = {"prompt": "a", "response": "b"}


@pytest.mark.parametrize(
    ("lines", "args", "where", "message"),
    [
        (
            [GOOD_LINE, GOOD_LINE, '{"prompt": "a", "response": }'],
            [],
            ":3:",
            "not valid JSON (Expecting value at column 29); each line of a JSONL file is one JSON",
        ),
        (
            [GOOD_LINE, {"prompt": "a"}],
            [],
            ":2:",
            "no 'response' key, where every line has the keys of the first",
        ),
        ([GOOD_LINE, {**GOOD_LINE, "extra": 1}], [], ":2:", "a key 'extra', where every line"),
        (
            [GOOD_LINE, "", {"prompt": 5, "response": "b"}],
            [],
            ":3:",
            "'prompt' is 5 (a number), but it holds text (strings) from the first line",
        ),
        (
            [{"prompt": 5, "response": "b"}],
            ["--text", "prompt"],
            ":1:",
            "'prompt' is 5 (a number), and --text prompt needs a string on every line",
        ),
        ([{"n": 1}, {"n": "one"}], [], ":2:", "'n' is \"one\" (a string), but it holds numbers"),
        (
            [GOOD_LINE, {"prompt": "a", "response": None}],
            [],
            ":2:",
            "'response' is null; each value is a string (text) or a number (write \"\" for an empty",
        ),
        ([GOOD_LINE, {"prompt": ["a"], "response": "b"}], [], ":2:", "'prompt' is a list;"),
        (['["a", "b"]'], [], ":1:", "a list, where a JSONL line is one JSON object"),
        ([{}], [], ":1:", "an empty object, where a JSONL line is one JSON object"),
        (
            [GOOD_LINE],
            ["--label", "respons"],
            ":1:",
            "--label names key 'respons', which the first line lacks; did you mean 'response'?",
        ),
    ],
)
def test_bad_jsonl_names_the_file_and_line(tmp_path, lines, args, where, message):
    source = write_jsonl(tmp_path / "chat.jsonl", lines)
    result = cli("data", "write", source, tmp_path / "out" / "d", *args, "--plain")
    assert result.exit_code == 2, result.output
    assert f"{source}{where} {message}" in " ".join(result.output.split())
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()  # nothing written


def test_an_empty_or_undecodable_jsonl_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    result = cli("data", "write", empty, tmp_path / "o")
    assert result.exit_code == 2
    assert f"{empty}: no JSON object in it (the file is empty)" in result.output
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"t": "ok"}\n{"t": "caf\xe9"}\n')
    result = cli("data", "write", latin, tmp_path / "o")
    assert result.exit_code == 2
    assert f"{latin}:2: not UTF-8 text (byte 11 of the line); save the file as UTF-8" in (
        " ".join(result.output.split())
    )
    latin_csv = tmp_path / "latin.csv"
    latin_csv.write_bytes(b"a,t\n1,caf\xe9\n")
    result = cli("data", "write", latin_csv, tmp_path / "o")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"{latin_csv}: not UTF-8 text: a byte at or after line 1 does not decode" in (
        " ".join(result.output.split())
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pack", "x=n"], "--pack and --fill-missing apply to CSV files"),
        (["--label", "t", "--text", "t"], "Invalid options --label t and --text t"),
    ],
)
def test_options_that_do_not_apply_to_a_jsonl_file(tmp_path, args, message):
    source = write_jsonl(tmp_path / "t.jsonl", [{"t": "a", "n": 1}])
    result = cli("data", "write", source, tmp_path / "o", *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_csv_text_options_that_cannot_work(tmp_path):
    source = tmp_path / "t.csv"
    source.write_text("a,b,t\n1,2,x\n3,4,y\n")
    result = cli("data", "write", source, tmp_path / "o", "--text", "a", "--pack", "v=a:b")
    assert result.exit_code == 2
    assert "column(s) ['a'] are both --text and packed" in " ".join(result.output.split())
    result = cli("data", "write", source, tmp_path / "o", "--text", "tt")
    assert result.exit_code == 2
    assert "--text names column 'tt', which the header lacks; did you mean 't'?" in result.output
    mixed = tmp_path / "m.jsonl"
    mixed.write_text('{"a": 1}\n')
    result = cli("data", "write", tmp_path / "*", tmp_path / "o")
    assert result.exit_code == 2
    assert "matches both .csv and .jsonl files" in result.output


# ------------------------------------------------------------------------------ data inspect
def test_inspect_shows_text_readably_with_lengths_over_the_train_split(tmp_path):
    rows = [{"prompt": "Q: " + t, "response": t} for t in AWKWARD] * 2
    source = write_jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "d" / "chat"
    assert cli("data", "write", source, out, "--validation-fraction", "0.25").exit_code == 0

    result = cli("data", "inspect", f"{out}-*.tfrecord", "--plain")
    assert result.exit_code == 0, result.output
    lines = result.output.split("features (from")[1].splitlines()
    at = next(i for i, line in enumerate(lines) if line.split()[:2] == ["response", "text"])
    sample, lengths = lines[at + 1].strip(), lines[at + 2].strip()
    written, splits = read_back(out)
    train = [len(t) for t in splits["train"]["response"]]  # the train split's only
    assert written["statistics"]["split"] == "train"
    assert written["statistics"]["text"]["response"] == {
        "count": 12, "min_chars": min(train), "mean_chars": sum(train) / 12,
        "max_chars": max(train),
    }  # fmt: skip
    assert lengths == (
        f"length {min(train)} to {max(train)} characters, mean {sum(train) / 12:.1f} "
        "(12 train records)"
    )
    assert sample.endswith(" chars)") and sample.startswith('"')
    assert "  response: {type: text}\n" in result.output  # the block to paste

    report = json.loads(cli("data", "inspect", f"{out}-*.tfrecord", "--json").stdout)
    texts = {f["name"]: f["text"] for f in report["features"]}
    shown = {json.loads(t["sample"].replace('..."', '"')) for t in texts.values()}
    assert shown <= {r[k][:60] for r in rows for k in ("prompt", "response")}


def test_inspect_escapes_cuts_and_counts_sampled_records_without_a_schema(tmp_path):
    long = "first line\nsecond\t" + "é" * 100
    files = write_shards(str(tmp_path / "t"), [{"body": long}, {"body": ""}, {"body": "ab"}], 1)
    result = cli("data", "inspect", files[0], "--plain")
    assert result.exit_code == 0, result.output
    expected = json.dumps(long[:60], ensure_ascii=False)[:-1] + '..."'
    assert expected.startswith('"first line\\nsecond\\t')
    assert f"{expected}  (118 chars)" in result.output
    assert "length 0 to 118 characters, mean 40.0 (3 sampled records)" in result.output
    assert "  body: {type: text}\n" in result.output
    # Bytes that are not UTF-8 text stay bytes, with no text line.
    files = write_shards(str(tmp_path / "b"), [{"blob": b"\xff\x00"}, {"blob": b"\xfe"}], 1)
    result = cli("data", "inspect", files[0], "--plain")
    assert "  blob: {type: bytes, shape: []}\n" in result.output and "chars" not in result.output


# -------------------------------------------------------------------------------- data bench
def test_bench_reads_text_records(tmp_path):
    rows = [{"text": t, "label": i % 2} for i, t in enumerate(AWKWARD * 8)]
    write_jsonl(tmp_path / "t.jsonl", rows)
    assert cli("data", "write", tmp_path / "t.jsonl", tmp_path / "d" / "t").exit_code == 0
    config = toy_config(tmp_path, tmp_path / "runs", train={"per_core_batch_size": 8})
    config["data"] = {"train": str(tmp_path / "d" / "t-*.tfrecord"), "inputs": "text",
                      "targets": "label"}  # fmt: skip
    result = cli("data", "bench", write_config(tmp_path, config), "--steps", "10", "--json")
    assert result.exit_code == 0, result.output
    measured = json.loads(result.stdout)
    assert measured["train_records"] == 64 and measured["global_batch_size"] == 8
    assert measured["examples_per_sec"] > 0 and measured["steps"] == 10


# ------------------------------------------------------------------- a transform before writing
def test_a_mapped_source_writes_what_its_function_makes(tmp_path):
    """Where ``--tokenize`` would go: a chunk's text columns to fixed-length ids (here the first 8
    UTF-8 bytes, 0-padded, a stand-in for a tokenizer), the label's classes kept."""
    rows = [{"text": t, "label": ["neg", "pos"][i % 2]} for i, t in enumerate(AWKWARD)]
    source = open_source(str(write_jsonl(tmp_path / "t.jsonl", rows)), table=table_options("label"))

    def ids(chunk):
        codes = [list(t[:8]) + [0] * (8 - len(t[:8])) for t in chunk["text"]]
        return {"token_ids": np.array(codes, np.int64), "label": chunk["label"]}

    features = {
        "token_ids": {"type": "int64", "shape": [8]},
        "label": {"type": "int64", "shape": []},
    }
    mapped = MappedSource(source, ids, features)
    report = write_dataset(mapped, str(tmp_path / "d" / "ids"), chunk_records=3)
    assert report.features == features and report.class_names == ["neg", "pos"]
    written, splits = read_back(tmp_path / "d" / "ids")
    assert written["label"] == "label"  # the source's layout, kept
    got = sorted(zip(map(tuple, splits["all"]["token_ids"]), splits["all"]["label"], strict=True))
    want = sorted(
        (tuple((list(t.encode()[:8]) + [0] * 8)[:8]), i % 2) for i, t in enumerate(AWKWARD)
    )
    assert got == want


def test_a_glob_of_jsonl_files_is_one_source_with_the_first_lines_keys(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", CHAT[:3])
    write_jsonl(tmp_path / "b.ndjson", CHAT[3:])
    result = cli("data", "write", tmp_path / "*", tmp_path / "out" / "d")
    assert result.exit_code == 0, result.output
    _, splits = read_back(tmp_path / "out" / "d")
    assert rows_of(splits["all"], "prompt", "response") == sorted(
        (row["prompt"], row["response"]) for row in CHAT
    )
    write_jsonl(tmp_path / "b.ndjson", [GOOD_LINE, {"response": "r", "prompt": "p", "x": 0}])
    result = cli("data", "write", tmp_path / "*", tmp_path / "out" / "e")
    assert result.exit_code == 2
    assert (
        f"{tmp_path / 'b.ndjson'}:2: a key 'x', where every line has the keys of the first "
        f"({tmp_path / 'a.jsonl'}:1): prompt, response."
    ) in " ".join(result.output.split())
