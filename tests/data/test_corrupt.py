"""Corrupt and truncated TFRecord shards: named precisely by default, skipped with
data.skip_corrupt, caught cheaply through a schema file's sizes, and found after a failed fit."""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path

import pytest
import yaml
from helpers import (
    make_records,
    run_cli,
    schema_config,
    toy_config,
    write_config,
    write_toy_data,
    write_with_schema,
)

from tpurun.config import load_config
from tpurun.data import records, resolve
from tpurun.data.write import write_shards
from tpurun.errors import DataError

TO_DO = "Re-copy or re-write the file, or set data.skip_corrupt: true to skip it."


def record_starts(raw: bytes) -> list[int]:
    """Where each complete record of TFRecord bytes starts, then where the last one ends."""
    starts = [0]
    while starts[-1] + 16 <= len(raw):
        (length,) = struct.unpack("<Q", raw[starts[-1] : starts[-1] + 8])
        if starts[-1] + 16 + length > len(raw):
            break
        starts.append(starts[-1] + 16 + length)
    return starts


def cut_inside_record(shard: Path, record: int, into: int = 20) -> int:
    """Truncate an uncompressed shard ``into`` bytes into a record; return where it starts."""
    raw = shard.read_bytes()
    start = record_starts(raw)[record]
    shard.write_bytes(raw[: start + into])
    return start


def flip_byte_in_record(shard: Path, record: int) -> int:
    """Flip one data byte of a record (size and framing unchanged); return where it starts."""
    raw = bytearray(shard.read_bytes())
    start = record_starts(bytes(raw))[record]
    raw[start + 12 + 5] ^= 0xFF
    shard.write_bytes(bytes(raw))
    return start


def toy(tmp_path: Path, compression: str = "none", train: int = 128, shards: int = 4) -> Path:
    folder = tmp_path / "data"
    if compression == "none":
        return write_toy_data(folder, n_train=train, n_val=32, shards=shards)
    folder.mkdir(parents=True)
    write_shards(str(folder / "train"), make_records(train, 0), shards, compression)
    write_shards(str(folder / "val"), make_records(32, 1), 2, compression)
    return folder


def message(shard, problem: str) -> str:
    return f"{shard}: cannot read it as TFRecords: {problem}. {TO_DO}"


# ------------------------------------------------------------------------ finding the damage
def test_truncated_mid_record_names_the_offset_and_the_good_records(tmp_path):
    shard = toy(tmp_path) / "train-00001-of-00004.tfrecord"
    start = cut_inside_record(shard, 10)
    with pytest.raises(DataError) as info:
        records.count_records([str(shard)])
    assert str(info.value) == message(
        shard, f"truncated record at byte {start}, after 10 good records"
    )


def test_a_cut_inside_a_record_header_is_caught(tmp_path):
    # TF's reader takes a header cut short by the end of file for a clean end: 10 records, no error.
    shard = toy(tmp_path) / "train-00001-of-00004.tfrecord"
    start = cut_inside_record(shard, 10, into=5)
    [found] = records.find_corrupt([str(shard)], "none")
    assert (found.offset, found.good_records, found.reason) == (start, 10, "truncated record")


def test_flipped_byte_in_a_middle_record(tmp_path):
    shard = toy(tmp_path) / "train-00002-of-00004.tfrecord"
    start = flip_byte_in_record(shard, 16)
    with pytest.raises(DataError) as info:
        records.count_records([str(shard)], "none")
    problem = f"corrupted record (checksum mismatch) at byte {start}, after 16 good records"
    assert str(info.value) == message(shard, problem)


def test_gzip_truncated_mid_stream(tmp_path):
    shard = toy(tmp_path, "gzip") / "train-00000-of-00004.tfrecord"
    compressed = shard.read_bytes()[: shard.stat().st_size // 2]
    shard.write_bytes(compressed)
    # What survives, by Python's own zlib: the records complete in the decompressed prefix.
    starts = record_starts(zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(compressed))
    good, offset = len(starts) - 1, starts[-1]
    assert 0 < good < 32
    [found] = records.find_corrupt([str(shard)], "auto")
    assert (found.offset, found.good_records, found.compression) == (offset, good, "gzip")
    with pytest.raises(DataError) as info:
        records.count_records([str(shard)], "gzip")
    assert str(info.value) == message(
        shard,
        f"truncated record at byte {offset} of the decompressed data, after {good} good records",
    )


def test_gzip_flipped_byte(tmp_path):
    shard = toy(tmp_path, "gzip") / "train-00003-of-00004.tfrecord"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    shard.write_bytes(bytes(raw))
    [found] = records.find_corrupt([str(shard)], "gzip")
    # zlib inflates this small file in one read, so its check fails before any record is out.
    assert (found.reason, found.offset, found.good_records) == (
        "GZIP data error (incorrect data check)", None, 0,
    )  # fmt: skip
    with pytest.raises(DataError, match=r"train-00003-of-00004\.tfrecord: cannot read it as "
                       r"TFRecords: GZIP data error \(incorrect data check\)\. Re-copy"):  # fmt: skip
        records.count_records([str(shard)], "gzip")


def test_a_gzip_file_missing_only_its_trailer_keeps_every_record(tmp_path):
    # TF's reader does not check the gzip trailer; no record is lost, so the file is not damaged.
    shard = toy(tmp_path, "gzip") / "train-00000-of-00004.tfrecord"
    shard.write_bytes(shard.read_bytes()[:-8])
    assert records.find_corrupt([str(shard)], "gzip") == []
    assert records.count_records([str(shard)], "gzip") == 32


def test_several_damaged_files_are_named_in_one_error(tmp_path):
    data = toy(tmp_path)
    shards = [data / f"train-0000{i}-of-00004.tfrecord" for i in (1, 3)]
    start = cut_inside_record(shards[0], 4)
    flip_byte_in_record(shards[1], 0)
    with pytest.raises(DataError) as info:
        records.count_records(sorted(str(p) for p in data.glob("train-*")))
    assert str(info.value) == (
        f"{shards[0]}: cannot read it as TFRecords: truncated record at byte {start}, after 4 "
        f"good records. 1 more file cannot be read either: {shards[1]}. Re-copy or re-write the "
        "files, or set data.skip_corrupt: true to skip them."
    )


def test_find_corrupt_rereads_files_the_cache_calls_good(tmp_path):
    data = toy(tmp_path)
    files = sorted(str(p) for p in data.glob("train-*"))
    assert records.count_records(files) == 128  # now cached as good
    shard = Path(files[2])
    stat = shard.stat()
    start = flip_byte_in_record(shard, 7)  # damaged in place: same size, same mtime
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert records.count_records(files) == 128  # the cache cannot tell
    [found] = records.find_corrupt(files, "none")
    assert (found.path, found.offset, found.good_records) == (str(shard), start, 7)
    with pytest.raises(DataError, match=f"{shard}: cannot read it as TFRecords: corrupted"):
        records.count_records(files)  # find_corrupt's verdict replaced the cached count


# ---------------------------------------------------------------------------- default: stop
def test_resolve_stops_naming_the_file(tmp_path):
    data = toy(tmp_path)
    shard = data / "train-00002-of-00004.tfrecord"
    start = cut_inside_record(shard, 10)
    with pytest.raises(DataError) as info:
        resolve.resolve(load_config(toy_config(data, tmp_path / "runs")))
    assert str(info.value) == message(
        shard, f"truncated record at byte {start}, after 10 good records"
    )


def test_damaged_first_record_of_the_first_file(tmp_path):
    data = toy(tmp_path)
    shard = data / "train-00000-of-00004.tfrecord"
    flip_byte_in_record(shard, 0)
    with pytest.raises(DataError) as info:
        resolve.resolve(load_config(toy_config(data, tmp_path / "runs")))
    assert str(info.value) == message(
        shard, "corrupted record (checksum mismatch) at byte 0 (the first record)"
    )


@pytest.mark.slow
def test_train_exits_2_with_one_paragraph_and_no_traceback(tmp_path):
    data = toy(tmp_path)
    shard = data / "val-00001-of-00002.tfrecord"
    start = cut_inside_record(shard, 3)
    config = write_config(tmp_path, toy_config(data, tmp_path / "runs", train={"epochs": 1}))
    result = run_cli("train", str(config))
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert (
        f"{shard}: cannot read it as TFRecords: truncated record at byte {start}, after 3 good records. {TO_DO}"
        in result.stderr
    )
    assert "Traceback" not in output
    assert not (tmp_path / "runs").exists()  # stopped before anything was written


# ---------------------------------------------------------------------- data.skip_corrupt
def test_skip_corrupt_drops_the_files_and_their_records(tmp_path, monkeypatch):
    data = toy(tmp_path)
    train_shard = data / "train-00001-of-00004.tfrecord"
    val_shard = data / "val-00000-of-00002.tfrecord"
    train_start = cut_inside_record(train_shard, 10)
    val_start = flip_byte_in_record(val_shard, 5)
    config = load_config(toy_config(data, tmp_path / "runs", data={"skip_corrupt": True}))
    resolved = resolve.resolve(config)

    assert str(train_shard) not in resolved.train_files and len(resolved.train_files) == 3
    assert resolved.validation_files == [str(data / "val-00001-of-00002.tfrecord")]
    assert (resolved.train_records, resolved.validation_records) == (96, 16)
    assert [(s.path, s.split, s.offset, s.good_records, s.records) for s in resolved.skipped] == [
        (str(train_shard), "train", train_start, 10, 11),
        (str(val_shard), "validation", val_start, 5, 6),
    ]
    assert resolved.skipped[0].describe() == (
        f"skipped corrupt train shard {train_shard}: truncated record at byte {train_start}, "
        "after 10 good records; 11 records left out."
    )
    assert json.loads(json.dumps(resolved.skipped[1].to_dict()))["split"] == "validation"

    # The verdicts are cached by path, size and mtime: a rerun reads no file again.
    monkeypatch.setattr(records, "_count_one", lambda *a: pytest.fail("read again"))
    again = resolve.resolve(config)
    assert again.skipped == resolved.skipped and again.train_records == 96


def test_skip_corrupt_with_every_file_of_a_split_damaged(tmp_path):
    data = toy(tmp_path)
    for shard in data.glob("val-*"):
        cut_inside_record(shard, 2)
    config = load_config(toy_config(data, tmp_path / "runs", data={"skip_corrupt": True}))
    with pytest.raises(
        DataError,
        match=r"data\.validation: all 2 files are corrupt or truncated, so data\.skip_corrupt "
        r"leaves nothing to read; the first, .*val-00000-of-00002\.tfrecord: truncated record at "
        r"byte \d+, after 2 good records\. Re-copy or re-write the files\.",
    ):
        resolve.resolve(config)


def test_skip_corrupt_with_clean_data_changes_nothing(tmp_path):
    data = toy(tmp_path, "gzip")
    config = load_config(toy_config(data, tmp_path / "runs", data={"skip_corrupt": True}))
    resolved = resolve.resolve(config)
    assert resolved.skipped == [] and (resolved.train_records, resolved.validation_records) == (
        128,
        32,
    )
    assert len(resolved.train_files) == 4 and resolved.data.compression == "gzip"


# --------------------------------------------------------------------- schema-counted data
def with_schema(tmp_path: Path) -> tuple[Path, dict]:
    """128 toy records as ``tpurun data write`` leaves them: 96 train in 4 shards (24 each), 32
    validation in 4 (8 each), and the schema file with each shard's records and size."""
    folder = write_with_schema(tmp_path / "data", n_train=96, n_val=32, val_shards=4)
    return folder, schema_config(folder, tmp_path / "runs")


def spy_reads(monkeypatch) -> list[str]:
    read, count_one = [], records._count_one

    def spy(path, compression):
        read.append(path)
        return count_one(path, compression)

    monkeypatch.setattr(records, "_count_one", spy)
    return read


def test_schema_sizes_catch_a_truncated_shard_without_reading_the_others(tmp_path, monkeypatch):
    folder, config = with_schema(tmp_path)
    schema = json.loads((folder / "toy.schema.json").read_text())
    shard = folder / "toy-train-00002-of-00004.tfrecord"
    assert schema["splits"]["train"]["shard_bytes"][shard.name] == shard.stat().st_size
    start = cut_inside_record(shard, 9)
    read = spy_reads(monkeypatch)
    with pytest.raises(DataError) as info:
        resolve.resolve(load_config(config))
    assert str(info.value) == message(
        shard, f"truncated record at byte {start}, after 9 good records"
    )
    assert read == [str(shard)]


def test_schema_catches_a_cut_at_a_record_boundary(tmp_path):
    folder, config = with_schema(tmp_path)
    shard = folder / "toy-train-00000-of-00004.tfrecord"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: record_starts(raw)[20]])  # every record left is whole
    with pytest.raises(DataError) as info:
        resolve.resolve(load_config(config))
    assert str(info.value) == message(
        shard, "the file ends early (toy.schema.json lists 24 records), after 20 good records"
    )


def test_skip_corrupt_with_schema_counts(tmp_path):
    folder, config = with_schema(tmp_path)
    shard = folder / "toy-validation-00003-of-00004.tfrecord"
    flip_byte_in_record(shard, 3)  # same size: only a full read finds it
    config["data"]["skip_corrupt"] = True
    resolved = resolve.resolve(load_config(config))
    assert resolved.counts_from == "schema"
    assert (resolved.train_records, resolved.validation_records) == (96, 24)
    [skipped] = resolved.skipped
    assert (skipped.path, skipped.split, skipped.good_records, skipped.records) == (
        str(shard), "validation", 3, 8,  # the schema's count: every record of the file is lost
    )  # fmt: skip


def test_an_old_schema_without_sizes_is_trusted_until_find_corrupt(tmp_path, monkeypatch):
    folder, config = with_schema(tmp_path)
    path = folder / "toy.schema.json"
    schema = json.loads(path.read_text())
    for split in schema["splits"].values():
        del split["shard_bytes"]  # as written before sizes were recorded
    path.write_text(json.dumps(schema))
    shard = folder / "toy-train-00003-of-00004.tfrecord"
    start = cut_inside_record(shard, 12)

    read = spy_reads(monkeypatch)
    resolved = resolve.resolve(load_config(config))
    assert (resolved.train_records, resolved.counts_from, read) == (96, "schema", [])
    # Training would fail mid-epoch with TF's DataLossError; the runner then asks which file.
    [found] = records.find_corrupt(resolved.train_files + resolved.validation_files, "none")
    assert (found.path, found.offset, found.good_records) == (str(shard), start, 12)


# ------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_train_with_skip_corrupt_runs_on_the_good_shards(tmp_path):
    data = toy(tmp_path)
    shard = data / "train-00003-of-00004.tfrecord"
    start = cut_inside_record(shard, 10)
    config = toy_config(data, tmp_path / "runs", data={"skip_corrupt": True}, train={"epochs": 1})
    result = run_cli("train", str(write_config(tmp_path, config)))
    assert result.returncode == 0, result.stdout + result.stderr
    derived = yaml.safe_load((tmp_path / "runs" / "toy" / "config.yaml").read_text())["derived"]
    assert (derived["train_files"], derived["train_records"], derived["steps_per_epoch"]) == (
        3,
        96,
        3,
    )
    summary = json.loads((tmp_path / "runs" / "toy" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["epochs_completed"] == 1
    # warned about, and recorded in summary.json (as the README promises)
    assert (
        f"warning: skipped corrupt train shard {shard}: truncated record at byte {start}"
        in result.stdout
    )
    [skipped] = summary["skipped_shards"]
    assert (skipped["path"], skipped["offset"], skipped["good_records"]) == (str(shard), start, 10)


def test_damage_found_only_while_training_is_named_and_nothing_is_lost(tmp_path):
    """A schema vouches for the shards (no read before training); one was damaged in place, so
    TF fails mid-fit without naming it: the run finds the file and says what to do."""
    import tpurun

    folder, config = with_schema(tmp_path)
    config["train"] = {"epochs": 2, "per_core_batch_size": 8, "steps_per_execution": 1}
    shard = folder / "toy-train-00001-of-00004.tfrecord"
    start = flip_byte_in_record(shard, 5)
    with pytest.raises(DataError) as info:
        tpurun.train(config, verbose=False)
    assert str(info.value) == message(
        shard, f"corrupted record (checksum mismatch) at byte {start}, after 5 good records"
    )
    # The shuffle buffer met the damage before the first step, so the run never began: nothing
    # was written (a later failure would leave summary.json with status "failed").
    assert not (tmp_path / "runs" / "toy" / "summary.json").exists()

    # With skip_corrupt, the rerun leaves the file out (its verdict is remembered) and trains.
    config["data"]["skip_corrupt"] = True
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and summary["skipped_records"] == 24
    assert [s["path"] for s in summary["skipped_shards"]] == [str(shard)]
