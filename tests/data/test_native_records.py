"""TFRecords without TensorFlow (tpurun.data.native): the framing and its CRCs, tf.train.Example
defined from the public schema, the batch parser, images, and damage named with file and record.

Each is checked against TensorFlow's own reader, parser and image ops where TensorFlow is
installed; the tests that need it skip without it, and the rest pin the same facts by hand (a
masked CRC32C from its definition, bytes laid out as the format says)."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydantic import TypeAdapter

from tpurun.config.features import Feature
from tpurun.data import decode, records
from tpurun.data.native import example, framing, images
from tpurun.data.native.decode import BatchParser, RecordMismatch
from tpurun.data.write import write_dataset

HAS_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAS_TF, reason="compares with TensorFlow's own ops")
HAS_SIMPLEJPEG = importlib.util.find_spec("simplejpeg") is not None


def tf():
    from tpurun import frameworks

    return frameworks.tensorflow()


def features(specs: dict) -> dict:
    adapter = TypeAdapter(Feature)
    return {name: adapter.validate_python(spec) for name, spec in specs.items()}


def tf_batch(serialized: list[bytes], used: dict) -> dict[str, np.ndarray]:
    """What the tf.data path decodes: ``decode_batch(parse_example(...))``, as numpy."""
    t = tf()
    parsed = t.io.parse_example(t.constant(serialized), decode.parse_spec(used))
    return {name: value.numpy() for name, value in decode.decode_batch(parsed, used).items()}


def assert_same_batch(ours: dict, theirs: dict) -> None:
    assert list(ours) == list(theirs)
    for name in theirs:
        a, b = ours[name], theirs[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert a.tolist() == b.tolist(), name  # element by element, exactly


def some_records(n: int = 40, seed: int = 0) -> list[bytes]:
    """Records of lengths 0 to ~3 kB, and one larger than a read block (1 MiB)."""
    rng = np.random.default_rng(seed)
    found = [rng.bytes(int(size)) for size in rng.integers(0, 3000, n)]
    return [b"", *found, rng.bytes(framing._BLOCK + 12345)]


def record_starts(raw: bytes) -> list[int]:
    """Where each record of uncompressed TFRecord bytes starts, then where the last one ends."""
    starts = [0]
    while starts[-1] + 16 <= len(raw):
        (length,) = struct.unpack("<Q", raw[starts[-1] : starts[-1] + 8])
        starts.append(starts[-1] + 16 + length)
    return starts


# ---------------------------------------------------------------------------------- framing
def test_masked_crc_is_tfrecords_definition():
    # CRC-32C of "123456789" is 0xE3069283 (RFC 3720's check value); TFRecord masks it.
    crc = 0xE3069283
    masked = (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
    assert framing.masked_crc(b"123456789") == masked


def test_frame_lays_out_length_its_crc_data_and_its_crc():
    framed = framing.frame(b"hello")
    length = struct.pack("<Q", 5)
    assert framed == (
        length + struct.pack("<I", framing.masked_crc(length)) + b"hello"
        + struct.pack("<I", framing.masked_crc(b"hello"))
    )  # fmt: skip


@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_written_records_read_back_the_same(tmp_path, compression):
    written = some_records()
    path = str(tmp_path / "a.tfrecord")
    assert framing.write_records(path, written, compression) == len(written)
    assert list(framing.iter_records(path, compression)) == written
    assert framing.scan(path, compression) == (len(written), sum(map(len, written)))
    raw = Path(path).read_bytes()
    expected = b"".join(map(framing.frame, written))
    assert (gzip.decompress(raw) if compression == "gzip" else raw) == expected


def test_concatenated_gzip_members_read_as_one_stream(tmp_path):
    written = some_records(10)
    framed = [framing.frame(r) for r in written]
    path = tmp_path / "multi.tfrecord"
    path.write_bytes(gzip.compress(b"".join(framed[:4])) + gzip.compress(b"".join(framed[4:])))
    assert list(framing.iter_records(str(path), "gzip")) == written


@needs_tf
@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_tensorflow_reads_what_the_native_writer_wrote(tmp_path, compression):
    written = some_records()
    path = str(tmp_path / "native.tfrecord")
    framing.write_records(path, written, compression)
    dataset = tf().data.TFRecordDataset(path, "GZIP" if compression == "gzip" else "")
    assert [r.numpy() for r in dataset] == written


@needs_tf
@pytest.mark.parametrize("compression", ["none", "gzip"])
def test_the_native_reader_reads_what_tensorflow_wrote(tmp_path, compression):
    t = tf()
    written = some_records()
    path = str(tmp_path / "tf.tfrecord")
    options = t.io.TFRecordOptions(compression_type="GZIP" if compression == "gzip" else "")
    with t.io.TFRecordWriter(path, options) as writer:
        for record in written:
            writer.write(record)
    assert list(framing.iter_records(path, compression)) == written


# ----------------------------------------------------------------------------------- damage
def write_plain(
    tmp_path: Path, n: int = 12, size: int | None = None
) -> tuple[Path, list[bytes], list[int]]:
    """Records of 50 bytes and more (``size``: each of that size)."""
    written = [bytes([i]) * (size or 50 + i) for i in range(n)]
    path = tmp_path / "d.tfrecord"
    framing.write_records(str(path), written)
    return path, written, record_starts(path.read_bytes())


def damage_of(path: Path, compression: str = "none") -> tuple[framing.DamagedRecord, list]:
    """The damage the reader raises, and the records it yielded before it."""
    read = []
    with pytest.raises(framing.DamagedRecord) as info:
        for record in framing.iter_records(str(path), compression):
            read.append(record)
    return info.value, read


def test_a_truncated_file_names_the_record_cut_short(tmp_path):
    path, written, starts = write_plain(tmp_path)
    path.write_bytes(path.read_bytes()[: starts[7] + 30])
    damage, read = damage_of(path)
    assert read == written[:7]
    assert (damage.path, damage.index, damage.offset, damage.reason) == (
        str(path), 7, starts[7], "truncated record",
    )  # fmt: skip
    assert str(damage) == (
        f"{path}: cannot read it as TFRecords: truncated record at byte {starts[7]}, after 7 "
        "good records. Re-copy or re-write the file."
    )
    assert framing.scan(str(path)).index == 7  # returned, not raised


def test_a_cut_inside_a_record_header_is_damage_not_an_end(tmp_path):
    # TensorFlow's reader ends the file there without a word; records would go missing unseen.
    path, written, starts = write_plain(tmp_path)
    path.write_bytes(path.read_bytes()[: starts[9] + 5])
    damage, read = damage_of(path)
    assert read == written[:9]
    assert (damage.index, damage.offset, damage.reason) == (9, starts[9], "truncated record")


@pytest.mark.parametrize("where", ["length", "length crc", "data", "data crc"])
@pytest.mark.parametrize("size", [None, 64])
def test_a_flipped_byte_is_a_checksum_mismatch_at_its_record(tmp_path, where, size):
    """Also among records of one size (``64``), which share their header's check (the reader
    checks a length's CRC once): a later record's flipped length or length CRC is its damage."""
    path, written, starts = write_plain(tmp_path, size=size)
    raw = bytearray(path.read_bytes())
    data_crc = 12 + len(written[5]) + 2
    offset = {"length": 0, "length crc": 9, "data": 12 + 20, "data crc": data_crc}[where]
    raw[starts[5] + offset] ^= 0x10
    path.write_bytes(bytes(raw))
    damage, read = damage_of(path)
    assert read == written[:5]
    assert (damage.index, damage.offset, damage.reason) == (
        5, starts[5], "corrupted record (checksum mismatch)",
    )  # fmt: skip


def whole_file_reading(raw: bytes) -> tuple[list[bytes], tuple | None]:
    """The records of uncompressed TFRecord bytes held whole, and the damage that ends them
    (``(index, offset, reason)``) or None: the framing's rules, with no blocks to straddle."""
    records, pos = [], 0
    while pos < len(raw):
        index = len(records)
        if len(raw) - pos < 12:
            return records, (index, pos, framing.NOT_TFRECORD if not index else framing.TRUNCATED)
        length, length_crc = struct.unpack_from("<QI", raw, pos)
        if framing.masked_crc(raw[pos : pos + 8]) != length_crc:
            return records, (index, pos, framing.CORRUPTED)
        end = pos + 12 + length + 4
        if end > len(raw):
            return records, (index, pos, framing.TRUNCATED)
        data = raw[pos + 12 : end - 4]
        if framing.masked_crc(data) != struct.unpack_from("<I", raw, end - 4)[0]:
            return records, (index, pos, framing.CORRUPTED)
        records.append(data)
        pos = end
    return records, None


@pytest.mark.parametrize("block", [1, 5, 12, 13, 17, 64, 1000])
def test_records_across_read_blocks_of_every_size_read_as_a_whole_file_would(
    tmp_path, monkeypatch, block
):
    """Read blocks of 1 byte to 1,000 (headers and records straddling them in every way): random
    files, whole, cut at a random byte or with a random byte flipped after the first record, read
    plain and gzip-compressed, give the records and the damage that reading the file whole gives."""
    monkeypatch.setattr(framing, "_BLOCK", block)
    rng = np.random.default_rng(block)
    path = tmp_path / "f.tfrecord"
    for case in range(40):
        sizes = rng.choice([0, 1, 3, 11, 12, 40, 300, 2 * block + 7], int(rng.integers(1, 9)))
        raw = bytearray(b"".join(framing.frame(rng.bytes(int(n))) for n in sizes))
        first_end = 16 + int(sizes[0])
        if case % 3 == 1 and len(raw) > first_end:
            raw[int(rng.integers(first_end, len(raw)))] ^= 1 << int(rng.integers(8))
        elif case % 3 == 2 and len(raw) > first_end:
            del raw[int(rng.integers(first_end, len(raw))) :]
        expected, damage = whole_file_reading(bytes(raw))
        for compression in ("none", "gzip"):
            path.write_bytes(gzip.compress(bytes(raw)) if compression == "gzip" else bytes(raw))
            read, found = [], None
            try:
                for record in framing.iter_records(str(path), compression):
                    read.append(record)
            except framing.DamagedRecord as exc:
                found = (exc.index, exc.offset, exc.reason)
            assert (read, found) == (expected, damage), (case, compression, list(sizes))


def test_a_file_that_is_not_tfrecords(tmp_path):
    """Bytes of a known kind of file are said to be that (tpurun.data.sniff); bytes of no kind
    that do not frame are a damaged TFRecord file."""
    from tpurun.data.sniff import NotTFRecords

    table = tmp_path / "notes.tfrecord"  # the name says nothing: the content does
    table.write_text("a,b,c\n1,2,3\n4,5,6\n")
    with pytest.raises(NotTFRecords, match="notes.tfrecord is a CSV file, not TFRecords"):
        framing.scan(str(table))
    garbage = tmp_path / "garbage.tfrecord"
    garbage.write_bytes(bytes(range(7, 200)))
    damage, read = damage_of(garbage)
    assert read == []
    assert (damage.index, damage.offset, damage.reason) == (
        0, 0, "corrupted record (checksum mismatch)",
    )  # fmt: skip
    assert "at byte 0 (the first record)" in str(damage)
    short = tmp_path / "short.tfrecord"
    short.write_bytes(b"\x05\x00\x00")
    damage, _ = damage_of(short)
    assert (damage.index, damage.offset, damage.reason) == (
        0, 0, "not a TFRecord file, or one truncated in its header",
    )  # fmt: skip
    empty = tmp_path / "empty.tfrecord"
    empty.write_bytes(b"")
    assert framing.scan(str(empty)) == (0, 0)


def write_gzip(tmp_path: Path, n: int = 200) -> tuple[Path, list[bytes], bytes]:
    rng = np.random.default_rng(3)
    written = [rng.bytes(int(size)) for size in rng.integers(100, 400, n)]
    path = tmp_path / "z.tfrecord"
    framing.write_records(str(path), written, "gzip")
    return path, written, b"".join(map(framing.frame, written))


def test_a_gzip_stream_cut_mid_record(tmp_path):
    path, written, plain = write_gzip(tmp_path)
    compressed = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(compressed)
    survived = len(zlib.decompressobj(31).decompress(compressed))  # by Python's own zlib
    starts = record_starts(plain)
    good = sum(1 for end in starts[1:] if end <= survived)  # the records whole in what survived
    assert 0 < good < len(written)
    damage, read = damage_of(path, "gzip")
    assert read == written[:good]
    assert (damage.index, damage.offset, damage.reason) == (good, starts[good], "truncated record")
    assert f"at byte {starts[good]} of the decompressed data, after {good} good" in str(damage)


def test_a_gzip_stream_cut_at_a_record_boundary_is_still_damage(tmp_path):
    # Its records all read whole, but the stream has no end: what followed is lost.
    path, written, plain = write_gzip(tmp_path)
    starts = record_starts(plain)
    deflate = zlib.compressobj(6, zlib.DEFLATED, 31)
    cut = deflate.compress(plain[: starts[50]]) + deflate.flush(zlib.Z_SYNC_FLUSH)
    path.write_bytes(cut)
    damage, read = damage_of(path, "gzip")
    assert read == written[:50]
    assert (damage.index, damage.offset, damage.reason) == (50, starts[50], "truncated record")


def test_a_gzip_file_missing_only_its_trailer_keeps_every_record(tmp_path):
    path, written, _ = write_gzip(tmp_path)
    path.write_bytes(path.read_bytes()[:-8])  # the CRC-32 and length of the gzip trailer
    assert list(framing.iter_records(str(path), "gzip")) == written


def test_a_damaged_gzip_stream_is_a_gzip_data_error(tmp_path):
    path, written, _ = write_gzip(tmp_path, 20)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x55  # in the trailer's length (its last 4 bytes), zlib's check of the stream
    path.write_bytes(bytes(raw))
    damage, read = damage_of(path, "gzip")
    assert read == []  # this small file inflates in one block, checked before it is used
    assert (damage.index, damage.offset, damage.reason) == (
        0, None, "GZIP data error (incorrect length check)",
    )  # fmt: skip
    assert str(damage) == (
        f"{path}: cannot read it as TFRecords: GZIP data error (incorrect length check). "
        "Re-copy or re-write the file."
    )
    notgzip = tmp_path / "plain.tfrecord"
    framing.write_records(str(notgzip), written)
    damage, _ = damage_of(notgzip, "gzip")
    assert damage.reason == "GZIP data error (incorrect header check)"


@needs_tf
@pytest.mark.parametrize("damage", ["truncated", "length crc", "data", "garbage", "gzip"])
def test_damage_is_named_where_tensorflow_names_it(tmp_path, damage):
    """TensorFlow says "truncated record at N" or "corrupted record at N" (N: where the record
    starts; where its data starts for a data CRC) or "inflate() failed with error -3: <zlib's
    words>": the native reader names the same record, by where it starts."""
    compression = "gzip" if damage == "gzip" else "none"
    path = tmp_path / "x.tfrecord"
    framing.write_records(str(path), [bytes([i]) * 300 for i in range(30)], compression)
    raw = bytearray(path.read_bytes())
    start = record_starts(bytes(raw))[11] if compression == "none" else None
    if damage == "truncated":
        raw = raw[: start + 100]
    elif damage == "length crc":
        raw[start + 9] ^= 1
    elif damage == "data":
        raw[start + 40] ^= 1
    elif damage == "garbage":
        raw, start = bytearray(bytes(range(1, 101)) * 3), 0  # text would be told apart (sniff)
    else:
        raw[len(raw) // 2] ^= 0x55
    path.write_bytes(bytes(raw))
    dataset = tf().data.TFRecordDataset(str(path), "GZIP" if compression == "gzip" else "")
    with pytest.raises(tf().errors.DataLossError) as theirs:
        list(dataset)
    said = theirs.value.message
    ours = framing.scan(str(path), compression)
    assert isinstance(ours, framing.DamagedRecord)
    if compression == "gzip":
        zlib_words = re.search(r"inflate\(\) failed with error -?\d+: ([\w ]+)", said)[1].strip()
        assert (ours.reason, ours.offset) == (f"GZIP data error ({zlib_words})", None)
    else:
        kind = "truncated" if damage == "truncated" else "corrupted"
        assert f"{kind} record at {start + 12 if damage == 'data' else start}" in said
        assert (ours.index, ours.offset) == (0 if damage == "garbage" else 11, start)


def test_a_damaged_shard_is_named_by_records_with_file_and_record(tmp_path):
    path, _, starts = write_plain(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[starts[3] + 20] ^= 1
    path.write_bytes(bytes(raw))
    [found] = records.find_corrupt([str(path)], "none")
    assert (found.path, found.good_records, found.offset, found.records) == (
        str(path),
        3,
        starts[3],
        4,
    )


# ---------------------------------------------------------------------------------- Example
def test_example_bytes_lay_out_the_public_schema():
    # Example{features=1: Features{feature=1: map<string, Feature>}}, Feature{int64_list=3:
    # Int64List{value=1 packed}}, written by hand.
    serialized = example.serialize({"a": np.array([1, 300])})
    entry = b"\x0a\x01a" + b"\x12\x07" + b"\x1a\x05\x0a\x03\x01\xac\x02"
    features = b"\x0a" + bytes([len(entry)]) + entry
    assert serialized == b"\x0a" + bytes([len(features)]) + features
    parsed = example.parse(serialized)
    assert list(parsed.features.feature["a"].int64_list.value) == [1, 300]


def test_serialize_stores_each_kind_as_data_write_does():
    parsed = example.parse(
        example.serialize(
            {
                "s": "héllo",
                "b": b"\x00\xff",
                "i": np.int32(7),
                "flag": True,
                "f": np.array([0.5, 1.25]),
                "names": ["x", b"y"],
            }
        )  # fmt: skip
    )
    stored = parsed.features.feature
    assert stored["s"].bytes_list.value == ["héllo".encode()]
    assert stored["b"].bytes_list.value == [b"\x00\xff"]
    assert stored["i"].int64_list.value == [7]
    assert stored["flag"].int64_list.value == [1]
    assert stored["f"].float_list.value == [0.5, 1.25]
    assert stored["names"].bytes_list.value == [b"x", b"y"]
    with pytest.raises(TypeError, match="record key 'bad': cannot store a value of dtype complex"):
        example.serialize({"bad": np.array([1j])})


@needs_tf
def test_tensorflow_parses_serialized_examples_identically():
    values = {"ids": np.array([0, -1, 2**62, -(2**63)]), "x": np.float32([1.5, -0.0, 3e38]),
              "text": "tpurun ✓", "blobs": [b"", b"\x00" * 3]}  # fmt: skip
    ours = example.serialize(values)
    theirs = tf().train.Example.FromString(ours)
    assert theirs.SerializeToString(deterministic=True) == example.parse(ours).SerializeToString(
        deterministic=True
    )
    assert theirs.features.feature["ids"].int64_list.value == values["ids"].tolist()
    # ... and the native parser reads what TensorFlow serializes
    assert example.parse(theirs.SerializeToString()) == example.parse(ours)


# ----------------------------------------------------------------------------- BatchParser
ALL_TYPES = {
    "x": {"type": "raw", "dtype": "float32", "shape": [2, 3]},
    "half": {"type": "raw", "dtype": "bfloat16", "shape": [4], "cast": "float32"},
    "u16": {"type": "raw", "dtype": "uint16", "shape": [4]},
    "y": {"type": "int64", "shape": []},
    "grid": {"type": "int64", "shape": [2, 2], "cast": "int32"},
    "f": {"type": "float", "shape": [3]},
    "f1": {"type": "float", "shape": [], "cast": "bfloat16"},
    "pair": {"type": "bytes", "shape": [2]},
    "one": {"type": "bytes", "shape": []},
    "t": {"type": "text"},
    "img": {"type": "image", "shape": [10, 12, 3]},
    "gray": {"type": "image", "shape": [5, 7, 1], "scale": False, "key": "img"},
    "flag": {"type": "int64", "shape": [], "cast": "bool", "key": "y"},
}


def encoded(pixels: np.ndarray, fmt: str) -> bytes:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def all_types_records(n: int = 9) -> list[bytes]:
    import ml_dtypes

    rng = np.random.default_rng(0)
    found = []
    for i in range(n):
        pixels = rng.integers(0, 256, (int(rng.integers(3, 30)), int(rng.integers(3, 30)), 3))
        found.append(example.serialize({
            "x": rng.normal(size=6).astype(np.float32).tobytes(),
            "half": rng.normal(size=4).astype(ml_dtypes.bfloat16).tobytes(),
            "u16": rng.integers(0, 65535, 4).astype("<u2").tobytes(),
            "y": int(rng.integers(-5, 5)), "grid": rng.integers(-(2**40), 2**40, 4),
            "f": rng.normal(size=3), "f1": float(rng.normal()),
            "pair": [b"a%d" % i, b"\x00\xff"], "one": b"z" * i, "t": f"héllo {i}",
            "img": encoded(pixels.astype(np.uint8), "PNG" if i % 2 else "JPEG"),
        }))  # fmt: skip
    return found


def test_batch_parser_decodes_every_type():
    used = features(ALL_TYPES)
    batch = all_types_records()
    got = BatchParser(used, threads=2)(batch)
    assert {name: (got[name].dtype.name, got[name].shape) for name in got} == {
        "x": ("float32", (9, 2, 3)), "half": ("float32", (9, 4)), "u16": ("uint16", (9, 4)),
        "y": ("int64", (9,)), "grid": ("int32", (9, 2, 2)), "f": ("float32", (9, 3)),
        "f1": ("bfloat16", (9,)), "pair": ("object", (9, 2)), "one": ("object", (9,)),
        "t": ("object", (9,)), "img": ("float32", (9, 10, 12, 3)),
        "gray": ("float32", (9, 5, 7, 1)), "flag": ("bool", (9,)),
    }  # fmt: skip
    first = example.parse(batch[0]).features.feature
    assert (
        got["x"][0].tolist()
        == np.frombuffer(first["x"].bytes_list.value[0], "<f4").reshape(2, 3).tolist()
    )
    assert (
        got["grid"][0].tolist() == np.int32(first["grid"].int64_list.value).reshape(2, 2).tolist()
    )
    assert got["t"][3] == "héllo 3".encode() and got["pair"][4].tolist() == [b"a4", b"\x00\xff"]
    assert got["flag"].tolist() == [bool(v) for v in got["y"]]
    assert 0 <= got["img"].min() and got["img"].max() <= 1 and got["gray"].max() > 1


@needs_tf
def test_batch_parser_returns_what_the_tf_path_returns():
    used = features(ALL_TYPES)
    batch = all_types_records()
    if not HAS_SIMPLEJPEG:  # Pillow's JPEG decoder differs from TF's by a few levels
        used = {k: v for k, v in used.items() if k not in ("img", "gray")}
    assert_same_batch(BatchParser(used)(batch), tf_batch(batch, used))


@needs_tf
@pytest.mark.parametrize(
    "layout",
    [
        (
            {"x": {"type": "raw", "dtype": "float32", "shape": [4]}},
            {"x": bytes(12)},
            "which is 16 bytes, but record 1 of the batch holds 12 bytes",
        ),
        ({"y": {"type": "int64", "shape": [3]}}, {"y": np.arange(2)}, "holds 2 int64 values"),
        ({"y": {"type": "int64", "shape": []}}, {"y": np.float32([1.0])}, "holds 1 float value"),
        (
            {"y": {"type": "int64", "shape": []}},
            {"z": 1},
            "is not in record 1 of the batch; it holds: z",
        ),
    ],
    ids=["raw-size", "length", "kind", "missing"],
)
def test_a_record_that_does_not_match_fails_as_tensorflow_fails(layout):
    specs, bad, says = layout
    used = features(specs)
    good = {name: np.zeros(spec.get("shape", [4])[0] if spec.get("shape") else 1, np.int64)
            if spec["type"] == "int64" else np.zeros(4, np.float32).tobytes()
            for name, spec in specs.items()}  # fmt: skip
    batch = [example.serialize(good), example.serialize(bad)]
    with pytest.raises(RecordMismatch, match=says) as info:
        BatchParser(used)(batch)
    assert (info.value.index, info.value.name) == (1, next(iter(specs)))
    with pytest.raises(tf().errors.InvalidArgumentError):
        tf_batch(batch, used)


def test_a_record_that_is_not_an_example():
    with pytest.raises(Exception, match=r"record 0 of the batch is not a tf\.train\.Example"):
        BatchParser(features({"y": {"type": "int64"}}))([b"\xff\xff\xff"])


@pytest.mark.parametrize("threads", [1, 2])
def test_an_image_that_does_not_decode_names_its_feature_and_record(threads):
    good = encoded(np.zeros((4, 4, 3), np.uint8), "PNG")
    batch = [example.serialize({"img": good}) for _ in range(9)]  # 2 threads: 4 or more each
    batch[3] = example.serialize({"img": good[:40]})  # cut short
    parser = BatchParser(features({"pic": {"type": "image", "shape": [2, 2, 3], "key": "img"}}),
                         threads=threads)  # fmt: skip
    with pytest.raises(images.ImageError, match=r"^feature 'pic' \(record key 'img'\), record 3 "
                       r"of the batch: cannot decode the image"):  # fmt: skip
        parser(batch)
    parser.close()


# ------------------------------------------------------------------------ data write output
def data_write_outputs(tmp_path: Path) -> list[tuple[str, list[str], dict]]:
    """(prefix, files, features) of data write's sources: packed CSV, raw arrays, an image
    folder of PNGs and JPEGs, JSONL text."""
    csv = tmp_path / "table.csv"
    csv.write_text("a,b,c,label\n" + "".join(f"{i},{i * 0.5},{-i},{i % 2}\n" for i in range(30)))
    np.savez(tmp_path / "arrays.npz", x=np.arange(120, dtype=np.float32).reshape(30, 4),
             y=np.arange(30) % 3)  # fmt: skip
    for name, fmt, size, level in (("cat", "PNG", (8, 6), 20), ("dog", "JPEG", (10, 12), 230)):
        (tmp_path / "pets" / name).mkdir(parents=True)
        for i in range(3):
            pixels = np.full((*size, 3), level, np.uint8)
            (tmp_path / "pets" / name / f"{i}.{fmt.lower()}").write_bytes(encoded(pixels, fmt))
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"q{i} ✓", "n": i}) + "\n" for i in range(12)))
    sources = [(csv, {"label": "label", "pack": ["features"]}), (tmp_path / "arrays.npz", {}),
               (tmp_path / "pets", {}), (jsonl, {})]  # fmt: skip
    out = []
    for source, options in sources:
        report = write_dataset(str(source), str(tmp_path / "out" / source.stem), shard_multiple=2,
                               **options)  # fmt: skip
        files = [path for written in report.splits.values() for path, _, _ in written]
        out.append((source.stem, files, features(report.features)))
    return out


def test_data_write_output_reads_back_natively(tmp_path):
    got = {}
    for name, files, used in data_write_outputs(tmp_path):
        got[name] = BatchParser(used)([r for f in files for r in framing.iter_records(f)])
    # Written in the source's order, shard after shard.
    assert got["arrays"]["x"].tolist() == np.arange(120, dtype=np.float32).reshape(30, 4).tolist()
    assert got["arrays"]["y"].tolist() == (np.arange(30) % 3).tolist()
    assert got["table"]["features"][:, 1].tolist() == [i * 0.5 for i in range(30)]
    assert got["table"]["label"].tolist() == [i % 2 for i in range(30)]
    assert got["chat"]["prompt"].tolist() == [f"q{i} ✓".encode() for i in range(12)]
    pets = got["pets"]  # cat: dark PNGs (label 0); dog: bright JPEGs, resized to the first size
    assert pets["image"].shape == (6, 8, 6, 3)
    brightness = pets["image"].mean(axis=(1, 2, 3))
    assert sorted(zip(pets["label"].tolist(), (brightness > 0.5).tolist(), strict=True)) == (
        [(0, False)] * 3 + [(1, True)] * 3
    )


@needs_tf
def test_data_write_output_parses_the_same_with_tensorflow(tmp_path):
    for name, files, used in data_write_outputs(tmp_path):
        batch = [r.numpy() for r in tf().data.TFRecordDataset(files)]
        assert batch == [r for f in files for r in framing.iter_records(f)], name
        if not HAS_SIMPLEJPEG and name == "pets":
            used = {k: v for k, v in used.items() if k != "image"}  # JPEG: see images' tests
        assert_same_batch(BatchParser(used)(batch), tf_batch(batch, used))


# ----------------------------------------------------------------------------------- images
def sample_images() -> list[tuple[str, bytes]]:
    """Real photographs and drawings where the environment has them (sklearn's and
    matplotlib's sample data), and made ones in every format and mode."""
    found = []
    for package, names in (("sklearn", ["datasets/images/china.jpg", "datasets/images/flower.jpg"]),
                           ("matplotlib", ["mpl-data/sample_data/grace_hopper.jpg",
                                           "mpl-data/sample_data/logo2.png"])):  # fmt: skip
        spec = importlib.util.find_spec(package)
        for name in names if spec else []:
            path = Path(spec.origin).parent / name
            if path.exists():
                found.append((path.name, path.read_bytes()))
    rng = np.random.default_rng(4)
    yy, xx = np.mgrid[0:61, 0:83]
    smooth = np.stack([(xx * 3) % 256, (yy * 4) % 256, (xx + yy) % 256], -1)
    pixels = np.clip(smooth + rng.integers(-20, 20, smooth.shape), 0, 255).astype(np.uint8)
    rgba = np.dstack([pixels, rng.integers(0, 256, pixels.shape[:2], dtype=np.uint8)])
    for fmt in ("PNG", "JPEG", "GIF", "BMP"):
        found.append((f"rgb.{fmt}", encoded(pixels, fmt)))
    found += [("gray.PNG", encoded(pixels[..., 0], "PNG")), ("gray.JPEG", encoded(pixels[..., 0], "JPEG")),
              ("rgba.PNG", encoded(rgba, "PNG")), ("la.PNG", encoded(rgba[..., 2:], "PNG"))]  # fmt: skip
    for colors in (2, 16, 200):  # 1-, 4- and 8-bit palettes
        out = io.BytesIO()
        Image.fromarray(pixels).quantize(colors).save(out, format="PNG")
        found.append((f"palette{colors}.PNG", out.getvalue()))
    return [*found, ("bilevel.PNG", encoded(pixels[..., 0] > 128, "PNG"))]


def test_resize_is_bilinear_with_half_pixel_centres():
    image = np.array([[0, 10], [20, 30]], np.uint8)[..., None]
    got = images.resize(image, 4, 4)[..., 0]
    # Output pixel i samples input (i + 0.5) / 2 - 0.5: -0.25, 0.25, 0.75, 1.25, clamped.
    assert got[0].tolist() == [0.0, 2.5, 7.5, 10.0]
    assert got[:, 0].tolist() == [0.0, 5.0, 15.0, 20.0]
    assert images.resize(image, 1, 1)[0, 0, 0] == 15.0
    assert images.resize(image, 2, 2).tolist() == image.astype(np.float32).tolist()


def test_decode_refuses_what_tensorflow_refuses():
    pixels = np.zeros((4, 4, 3), np.uint8)
    with pytest.raises(images.ImageError, match="a JPEG image cannot be decoded to 4 channels"):
        images.decode(encoded(pixels, "JPEG"), 4)
    with pytest.raises(images.ImageError, match="a GIF image cannot be decoded to 1 channels"):
        images.decode(encoded(pixels, "GIF"), 1)
    with pytest.raises(images.ImageError, match="cannot decode the image"):
        images.decode(b"\x89PNG\r\n\x1a\nnot really", 3)


def _pillow_decode(data: bytes, channels: int) -> np.ndarray:
    saved = images._HAS_SIMPLEJPEG
    images._HAS_SIMPLEJPEG = False
    try:
        return images.decode(data, channels)
    finally:
        images._HAS_SIMPLEJPEG = saved


@needs_tf
def test_images_decode_and_resize_as_tensorflow_does():
    """PNG, GIF, BMP and (with simplejpeg) JPEG: the same pixels and, resized up and down, the
    same float32 values as tf.io.decode_image + tf.image.resize; Pillow's JPEG decoder (the
    fallback without simplejpeg) is measured apart."""
    t = tf()
    worst = {}
    for name, data in sample_images():
        height, width, _ = images.shape_of(data)
        for channels in (1, 3, 4):
            try:
                theirs = t.io.decode_image(data, channels=channels, expand_animations=False)
            except t.errors.InvalidArgumentError:
                with pytest.raises(images.ImageError, match="cannot be decoded to"):
                    images.decode(data, channels)
                continue
            exact = not name.endswith(("jpg", "JPEG")) or HAS_SIMPLEJPEG
            ours = images.decode(data, channels)
            assert ours.shape == tuple(theirs.shape), (name, channels)
            if exact:
                assert ours.tolist() == theirs.numpy().tolist(), (name, channels)
            for size in (
                (height // 3, width // 3),
                (224, 224),
                (2 * height + 1, width + 7),
                (1, 1),
            ):
                expected = (t.image.resize(theirs, size) / 255.0).numpy()
                got = images.load(data, (*size, channels), True)
                worst[name] = max(worst.get(name, 0.0), float(np.abs(got - expected).max()))
    assert {name: error for name, error in worst.items() if error > 0} == (
        {}
        if HAS_SIMPLEJPEG
        else {n: e for n, e in worst.items() if n.endswith(("jpg", "JPEG")) and e > 0}
    )


@needs_tf
def test_pillows_jpeg_decoder_differs_from_tensorflows_by_a_few_levels():
    # TF decodes with libjpeg-turbo's fast integer DCT; Pillow with the accurate one. Without
    # simplejpeg this is the difference the native reader's JPEG pixels carry (measured on
    # sklearn's china.jpg: at most 18 of 255, 1.3 on average).
    t = tf()
    for name, data in sample_images():
        if name.endswith(("jpg", "JPEG")) and not name.startswith("gray"):
            theirs = t.io.decode_image(data, channels=3).numpy().astype(int)
            ours = _pillow_decode(data, 3).astype(int)
            assert 0 < np.abs(ours - theirs).max() <= 24, name


# ------------------------------------------------------------------------------ no TensorFlow
@pytest.mark.slow
def test_data_write_and_inspect_leave_tensorflow_unimported(tmp_path):
    """Where TensorFlow is installed too, neither command pays for its import (4-5 s)."""
    import subprocess
    import sys

    np.savez(tmp_path / "arrays.npz", x=np.zeros((20, 3), np.float32), y=np.arange(20))
    (tmp_path / "pets" / "cat").mkdir(parents=True)
    (tmp_path / "pets" / "cat" / "0.png").write_bytes(encoded(np.zeros((4, 4, 3), np.uint8), "PNG"))
    commands = [
        ["data", "write", str(tmp_path / "arrays.npz"), str(tmp_path / "a"), "--plain"],
        ["data", "write", str(tmp_path / "pets"), str(tmp_path / "p"), "--image-size", "2", "2"],
        ["data", "inspect", str(tmp_path / "a-*.tfrecord"), "--plain"],
    ]
    for command in commands:
        code = (
            "import runpy, sys\n"
            f"sys.argv, code = ['tpurun', *{command!r}], 0\n"
            "try:\n    runpy.run_module('tpurun', run_name='__main__')\n"
            "except SystemExit as exit:\n    code = exit.code\n"
            "print('exit', code, 'tensorflow' in sys.modules)\n"
        )
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        assert result.stdout.splitlines()[-1] == "exit 0 False", result.stdout + result.stderr
