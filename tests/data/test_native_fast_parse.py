"""The native parser's fast paths: a batch whose records share one layout is parsed at once, as
columns of its records' bytes where they have one length (tpurun.data.native.layout), else walked
all together with numpy (tpurun.data.native.varying: token ids of varying byte lengths). Either
gives exactly what the per-record parser gives; any other batch falls back to that parser, with its
results and its errors.

Each case runs one BatchParser with the fast paths and one without on the same batches, compares
them array by array (dtype, shape, bytes, writability), and counts the batches each path took, so
a test proves which path ran. Where TensorFlow is installed, tf.data's parse_example (and the
tf.data pipeline) is the third party to agree."""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest
from pydantic import TypeAdapter

from tpurun.config.features import Feature
from tpurun.data import decode
from tpurun.data.native import example, layout
from tpurun.data.native.decode import BatchParser, RecordMismatch, numpy_dtype
from tpurun.errors import DataError

HAS_TF = importlib.util.find_spec("tensorflow") is not None
needs_tf = pytest.mark.skipif(not HAS_TF, reason="compares with TensorFlow's parse_example")

TABULAR = {
    "features": {"type": "float", "shape": [12]},
    "label": {"type": "int64"},
    "small": {"type": "int64", "shape": [3], "cast": "int32"},
    "weight": {"type": "float", "cast": "bfloat16"},
    "flag": {"type": "int64", "key": "label", "cast": "bool"},
}
NAIC = {
    "x": {"type": "raw", "dtype": "float32", "shape": [32, 32]},
    "y": {"type": "raw", "dtype": "float32", "shape": [1]},
    "half": {"type": "raw", "dtype": "bfloat16", "shape": [4], "cast": "float32"},
    "u16": {"type": "raw", "dtype": "uint16", "shape": [2, 3]},
}


def features(specs: dict) -> dict:
    adapter = TypeAdapter(Feature)
    return {name: adapter.validate_python(spec) for name, spec in specs.items()}


def varint(value: int) -> bytes:
    value &= 2**64 - 1  # a negative int64 as protobuf stores it: ten bytes
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def entry(key: bytes, feature: bytes) -> bytes:
    """A map entry of Features, written by hand: key, then the Feature's bytes."""
    body = b"\x0a" + varint(len(key)) + key + b"\x12" + varint(len(feature)) + feature
    return b"\x0a" + varint(len(body)) + body


def record(*entries: bytes) -> bytes:
    features = b"".join(entries)
    return b"\x0a" + varint(len(features)) + features


def int64s(*runs: bytes) -> bytes:
    """An int64_list Feature of the given packed runs (each its varints' bytes)."""
    lists = b"".join(b"\x0a" + varint(len(run)) + run for run in runs)
    return b"\x1a" + varint(len(lists)) + lists


def tabular_records(n: int, seed: int = 0, **extra) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [
        example.serialize({
            "features": rng.standard_normal(12).astype(np.float32),
            "label": int(rng.integers(0, 128)), "small": rng.integers(0, 128, 3),
            "weight": float(rng.random()), **{k: v(i) for k, v in extra.items()},
        })
        for i in range(n)
    ]  # fmt: skip


def naic_records(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    found = []
    for _ in range(n):
        x = rng.standard_normal(1024, dtype=np.float32)
        found.append(example.serialize({
            "x": x.tobytes(), "y": np.float32([x[0] > 0]).tobytes(),
            "half": rng.standard_normal(4).astype(ml_dtypes.bfloat16).tobytes(),
            "u16": rng.integers(0, 65536, 6).astype("<u2").tobytes(),
        }))  # fmt: skip
    return found


def outcome(parser: BatchParser, batch: list[bytes]) -> dict | tuple:
    """The parsed batch, or the error's type, message and record index."""
    try:
        return parser(batch)
    except DataError as exc:
        return type(exc), str(exc), getattr(exc, "index", None)


def assert_identical(fast: dict | tuple, slow: dict | tuple) -> None:
    assert type(fast) is type(slow)
    if isinstance(slow, tuple):
        assert fast == slow
        return
    assert list(fast) == list(slow)
    for name in slow:
        a, b = fast[name], slow[name]
        assert (a.dtype, a.shape, a.flags.writeable) == (b.dtype, b.shape, b.flags.writeable), name
        if b.dtype == object:  # strings: compared as values, not pointers
            assert a.tolist() == b.tolist(), name
        else:
            assert a.tobytes() == b.tobytes(), name


def flat(batch) -> list[np.ndarray]:
    """A batch's arrays in a fixed order (dicts by key), as numpy."""
    if isinstance(batch, dict):
        return [a for key in sorted(batch) for a in flat(batch[key])]
    if isinstance(batch, (tuple, list)):
        return [a for value in batch for a in flat(value)]
    return [batch.numpy() if hasattr(batch, "numpy") else np.asarray(batch)]


def both(specs: dict) -> tuple[BatchParser, BatchParser]:
    used = features(specs)
    return BatchParser(used), BatchParser(used, fast_path=False)


def check(specs: dict, batches: list[list[bytes]], columns: int = 0, walked: int = 0) -> list:
    """Parse each batch both ways, assert them identical, and how many batches took each path."""
    fast, slow = both(specs)
    results = []
    for batch in batches:
        results.append(outcome(fast, batch))
        assert_identical(results[-1], outcome(slow, batch))
    by_record = len(batches) - columns - walked
    assert fast.batches_by_path == {"columns": columns, "walked": walked, "records": by_record}
    assert slow.batches_by_path == {"columns": 0, "walked": 0, "records": len(batches)}
    return results


def path_of(parser: BatchParser, batch: list[bytes]) -> tuple[str, dict | tuple]:
    """The path ``batch`` took through ``parser`` (columns, walked, records), and its outcome."""
    before = parser.batches_by_path
    got = outcome(parser, batch)
    after = parser.batches_by_path
    return next(path for path in after if after[path] > before[path]), got


# ------------------------------------------------------------------------------- the fast path
def test_tabular_packed_floats_and_small_ints_are_parsed_a_batch_at_once():
    records = tabular_records(96)
    got = check(TABULAR, [records[:32], records[32:64], records[64:]], columns=3)
    assert {name: (a.dtype.name, a.shape) for name, a in got[0].items()} == {
        "features": ("float32", (32, 12)), "label": ("int64", (32,)),
        "small": ("int32", (32, 3)), "weight": ("bfloat16", (32,)), "flag": ("bool", (32,)),
    }  # fmt: skip
    first = example.parse(records[40]).features.feature
    assert got[1]["features"][8].tolist() == list(first["features"].float_list.value)
    assert got[1]["small"][8].tolist() == list(first["small"].int64_list.value)
    assert got[1]["flag"][8] == bool(first["label"].int64_list.value[0])


def test_naic_like_raw_records_are_parsed_a_batch_at_once():
    records = naic_records(80)  # 80 x 4.2 kB: the batch goes through the kept buffer
    got = check(NAIC, [records[:64], records[64:], records[:64]], columns=3)
    assert (
        got[0]["x"][5].tobytes()
        == example.parse(records[5]).features.feature["x"].bytes_list.value[0]
    )
    assert got[1]["x"].flags.c_contiguous and got[1]["x"].flags.aligned
    assert got[2]["x"].tobytes() == got[0]["x"].tobytes()  # the kept buffer leaks nothing


def test_unused_features_ride_along_as_columns_or_walked_when_their_length_varies():
    same = tabular_records(
        16, note=lambda i: f"row {i:04d}", raw=lambda i: bytes([i]) * 9, vocab=lambda i: 32000
    )  # an unused int64 of several bytes rides along where it stays the same
    other = tabular_records(400, note=lambda i: "x" * (i % 3), raw=lambda i: b"", vocab=int)
    # A small batch of records of varying length costs more to walk than to parse one by one.
    check(TABULAR, [same, other, other[:16], same[:5] + other[5:16], same], columns=2, walked=1)


# ----------------------------------------------------------------------------- fall backs
def test_a_batch_mixing_layouts_falls_back_then_the_next_batch_learns_its_own():
    plain = tabular_records(16)
    extra = tabular_records(16, seed=1, tag=lambda i: i % 100)  # one more key, same sizes
    garbled = [*plain[:8], plain[8].replace(b"weight", b"weighs"), *plain[9:]]  # same length
    check(TABULAR, [plain, plain[:8] + extra[:8], extra, garbled, plain], columns=3)


@pytest.mark.parametrize("label", [127, 128, 200, 5000, -1])
def test_an_int64_over_127_or_negative_falls_back(label):
    records = tabular_records(8)
    odd = example.serialize({
        "features": np.zeros(12, np.float32), "label": label, "small": [1, 2, 3], "weight": 0.5,
    })  # fmt: skip
    fast = 3 if label == 127 else 1
    check(TABULAR, [records, records[:3] + [odd] + records[4:], [odd] + records[1:]], fast)


def test_a_varint_of_two_bytes_is_not_read_as_two_values():
    # [200] is two payload bytes, as [5, 6] is: same length, same bytes outside the payload.
    specs = {"pair": {"type": "int64", "shape": [2]}}
    good = [example.serialize({"pair": [5, 6], "unused": [7, 8]}) for _ in range(4)]
    long_pair = example.serialize({"pair": [200], "unused": [7, 8]})
    long_unused = example.serialize({"pair": [5, 6], "unused": [300]})
    assert len({len(r) for r in (*good, long_pair, long_unused)}) == 1
    fast, slow = both(specs)
    with pytest.raises(RecordMismatch, match="record 2 of the batch holds 1 int64 value"):
        fast([*good[:2], long_pair, good[3]])
    assert fast([*good[:2], long_unused])["pair"].tolist() == [[5, 6]] * 3
    check(specs, [good, [*good[:2], long_pair], [*good[:2], long_unused], good], columns=2)


def test_corrupted_bytes_fall_back_to_the_per_record_parsers_result_or_error():
    # Every byte of a record changed in turn, to 0x80, 0x00, 0x7F and its complement: the fast
    # path takes none that the per-record parser would not take as the same values.
    batch = tabular_records(4, note=lambda i: "abc")
    fast, slow = both(TABULAR)
    length = len(batch[2])
    seen = set()
    for at in range(length):
        for value in {0x80, 0x00, 0x7F, batch[2][at] ^ 0xFF}:
            changed = bytearray(batch[2])
            changed[at] = value
            trial = [*batch[:2], bytes(changed), batch[3]]
            path, got = path_of(fast, trial)
            assert_identical(got, outcome(slow, trial))
            seen.add(path + (" error" if isinstance(got, tuple) else ""))
    assert seen == {"columns", "records", "records error"}


def test_a_damaged_key_names_the_missing_feature_as_without_the_fast_path():
    batch = tabular_records(6)
    batch[4] = batch[4].replace(b"\x0a\x05label", b"\x0a\x05lbbel")
    fast, _ = both(TABULAR)
    with pytest.raises(RecordMismatch, match=r"feature 'label' \(record key 'label'\) is not in "
                       r"record 4 of the batch; it holds: features, lbbel, small, weight"):  # fmt: skip
        fast(batch)
    check(TABULAR, [batch], columns=0)


def test_a_record_cut_short_is_the_same_decode_error():
    batch = tabular_records(3)
    batch[1] = batch[1][:-1]
    check(TABULAR, [batch], columns=0)
    with pytest.raises(DataError, match=r"record 1 of the batch is not a tf\.train\.Example"):
        both(TABULAR)[0](batch)


@pytest.mark.parametrize("path", ["columns", "walked"])
def test_what_the_walker_does_not_read_goes_record_by_record(path):
    # walked: 200 records, each with a bytes feature of its own length (0-2 bytes)
    specs = {"f": {"type": "float", "shape": [2]}, "y": {"type": "int64"}}
    floats = np.float32([1.5, -2]).tobytes()
    packed_f = b"\x12\x0a\x0a\x08" + floats
    split_f = b"\x12\x0c\x0a\x04" + floats[:4] + b"\x0a\x04" + floats[4:]  # read as one list
    unpacked_f = b"\x12\x0a" + b"\x0d" + floats[:4] + b"\x0d" + floats[4:]
    f, y = entry(b"f", packed_f), entry(b"y", int64s(b"\x07"))
    cases = {  # name: (a record's entries, whether a batch at once takes it)
        "plain": ((f, y), True),
        "an unused list in split runs": ((f, y, entry(b"g", split_f)), True),
        "a list read in split runs": ((entry(b"f", split_f), y), False),
        "unpacked floats": ((entry(b"f", unpacked_f), y), False),
        "a key twice (the last wins)": ((entry(b"y", int64s(b"\x09")), f, y), False),
    }  # fmt: skip
    n = 3 if path == "columns" else 200
    for name, (entries, fast) in cases.items():
        batch = [record(*entries, entry(b"pad", b"\x0a" + varint(i % 3 + 2) + b"\x0a"
                                       + varint(i % 3) + b"p" * (i % 3))) for i in range(n)]  # fmt: skip
        if path == "columns":
            batch = [record(*entries)] * n
        parsed = check(specs, [batch], **{path: int(fast)})[0]
        assert parsed["f"].tolist() == [[1.5, -2.0]] * n, name
        assert parsed["y"].tolist() == [7] * n, name
    merged = [record(f, entry(b"y", int64s(varint(v)))) + record(y) for v in range(n)]
    assert check(specs, [merged])[0]["y"].tolist() == [7] * n  # a second Example merged in


def test_each_layout_learnt_is_checked_against_protobufs_own_parse():
    from tpurun.data.native.layout import Wanted, agrees_with_protobuf

    one = tabular_records(1)[0]
    stored = example.parse(one).features.feature
    wanted = [Wanted("features", "float_list", 48, np.dtype("<f4"), (12,)),
              Wanted("small", "int64_list", 3, np.dtype(np.uint8), (3,), np.dtype(np.int32))]  # fmt: skip
    values = [np.float32([stored["features"].float_list.value]),
              np.int32([stored["small"].int64_list.value])]  # fmt: skip
    assert agrees_with_protobuf(one, values, wanted)
    assert not agrees_with_protobuf(one, [values[0], values[1] + 1], wanted)
    assert not agrees_with_protobuf(one[:-1], values, wanted)  # protobuf refuses it


def test_records_written_anywhere_hold_their_keys_in_one_order():
    # protobuf's map order changes from process to process; sorted keys make every writer's
    # records share one layout.
    values = {f"k{i:02d}": i for i in reversed(range(24))}
    assert list(layout.features(example.serialize(values))) == sorted(values)


def test_a_parser_reading_text_or_images_never_takes_the_fast_path():
    specs = {**TABULAR, "note": {"type": "text"}}
    batch = tabular_records(8, note=lambda i: "same")
    check(specs, [batch, batch], columns=0)


def test_threads_sharing_a_parser_each_get_their_own_batches():
    from concurrent.futures import ThreadPoolExecutor

    batches = [naic_records(40, seed) for seed in range(8)]
    fast, slow = both(NAIC)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(fast, batches * 3))
    for batch, parsed in zip(batches * 3, got, strict=True):
        assert_identical(parsed, slow(batch))
    assert fast.batches_by_path == {"columns": 24, "walked": 0, "records": 0}


# ---------------------------------------------------------------------- walked: token ids
TOKENS = {
    "token_ids": {"type": "int64", "shape": [128], "cast": "int32"},
    "padding_mask": {"type": "int64", "shape": [128], "cast": "bool"},
    "weights": {"type": "int64", "shape": [128]},
}


def token_records(n: int, seed: int = 0, high: int = 32000, low: int = 0, **extra) -> list[bytes]:
    """Tokenised texts of 8 to 128 ids in [low, high), padded with 0 (data write --tokenize's
    layout): varints of one to several bytes, so the records' lengths vary."""
    rng = np.random.default_rng(seed)
    found = []
    for i in range(n):
        length = int(rng.integers(8, 129))
        ids = np.zeros(128, np.int64)
        ids[:length] = rng.integers(low, high, length, dtype=np.int64)
        mask = (np.arange(128) < length).astype(np.int64)
        found.append(example.serialize({
            "token_ids": ids, "padding_mask": mask, "weights": mask,
            **{key: value(i) for key, value in extra.items()},
        }))  # fmt: skip
    return found


@pytest.mark.parametrize("high", [256, 32000, 2**21, 2**40, 2**63 - 1])
def test_token_ids_of_varying_byte_lengths_are_walked_a_batch_at_once(high):
    records = token_records(192, high=high)
    assert len({len(r) for r in records}) > 1
    got = check(TOKENS, [records[:64], records[64:]], walked=2)
    stored = example.parse(records[70]).features.feature["token_ids"].int64_list.value
    assert got[1]["token_ids"][6].tolist() == np.array(stored).astype(np.int32).tolist()
    assert (got[1]["token_ids"].dtype, got[1]["padding_mask"].dtype) == (np.int32, bool)


@pytest.mark.parametrize(
    "cast", ["float16", "bfloat16", "float32", "float64", "int32", "int64", "uint8", "bool"]
)
def test_int64_lists_cast_straight_from_their_bytes_as_from_int64(cast):
    tokens = {name: {**spec, "cast": cast} for name, spec in TOKENS.items()}
    got = check(tokens, [token_records(64, high=2**21)], walked=1)[0]  # up to three bytes
    assert {array.dtype for array in got.values()} == {numpy_dtype(cast)}
    small = {"small": {"type": "int64", "shape": [3], "cast": cast}}
    check(small, [tabular_records(16)], columns=1)


def test_runs_wider_than_sixteen_bit_columns_are_walked_as_narrow_ones():
    # 24,000 ids of three bytes: runs of ~72 kB, past the uint16 columns the walker compares in.
    rng = np.random.default_rng(3)
    specs = {"ids": {"type": "int64", "shape": [24000]}}
    records = [
        example.serialize({"ids": rng.integers(2**14, 2**21, 24000, dtype=np.int64)})
        for _ in range(4)
    ]
    assert min(len(r) for r in records) > 1 << 16
    got = check(specs, [records], walked=1)[0]
    stored = example.parse(records[2]).features.feature["ids"].int64_list.value
    assert got["ids"][2].tolist() == list(stored)


def test_the_largest_int64_is_walked_and_a_negative_one_read_falls_back():
    largest = token_records(64, low=2**62, high=2**63 - 1)  # nine bytes each
    assert check(TOKENS, [largest], walked=1)[0]["weights"].max() == 1
    negative = token_records(64, low=-5, high=5)  # ten bytes each
    check(TOKENS, [negative, largest, largest[:32] + negative[32:]], walked=1)


def test_records_of_another_structure_fall_back_to_their_results_and_errors():
    records = token_records(64, label=lambda i: i)

    def one(**extra) -> bytes:
        return token_records(1, seed=5, **extra)[0]

    stored = example.parse(one(label=int)).features.feature  # its keys, written in sorted order
    reordered = record(*(entry(key.encode(), stored[key].SerializeToString())
                         for key in ("token_ids", "padding_mask", "weights", "label")))  # fmt: skip
    assert sorted(layout.features(reordered)) != list(layout.features(reordered))
    cases = [
        records,  # walked
        [*records[:10], one(), *records[11:]],  # one key fewer
        [*records[:10], one(label=lambda i: 1.5), *records[11:]],  # a label of another kind
        [*records[:10], reordered, *records[11:]],  # the same keys in another order
        [*records[:10], one(label=int).replace(b"\x0a\x80\x01", b"\x0a\x7f"), *records[11:]],
    ]
    assert cases[-1][10] != one(label=int)
    got = check(TOKENS, cases, walked=1)
    assert got[-1][0] is DataError


MASK = b"\x01" * 128


def hand_made(i: int, *, unused: bytes = b"", score: bytes = b"", note: bytes = b"",
              ids: bytes | None = None, last: bytes = b"") -> bytes:  # fmt: skip
    """A tokenised record written by hand: unused int64s, an unused float and bytes list, the
    three lists read, then ``last`` (more entries)."""
    return record(
        unused or entry(b"unused", int64s(b"\x05" * (i % 3 + 1))),
        score or entry(b"score", b"\x12\x06\x0a\x04" + np.float32([i]).tobytes()),
        note or entry(b"note", b"\x0a\x03\x0a\x01" + bytes([i % 128])),
        entry(b"token_ids", int64s(varint(300 + i) * 128)) if ids is None else ids,
        entry(b"padding_mask", int64s(MASK)),
        entry(b"weights", int64s(MASK)),
        last,
    )


def claiming(run: int) -> bytes:
    """An unused int64 entry whose lengths all claim a run of ``run`` bytes; it holds 2."""
    listed = 1 + len(varint(run)) + run
    feature = 1 + len(varint(listed)) + listed
    head = b"\x0a\x06unused\x12" + varint(feature)
    body = head + b"\x1a" + varint(listed) + b"\x0a" + varint(run) + b"\x05\x05"
    return b"\x0a" + varint(len(head) + feature) + body


def test_broken_records_in_a_walked_batch_are_the_per_record_decode_error():
    batch = [hand_made(i) for i in range(64)]
    check(TOKENS, [batch], walked=1)
    broken = {
        "a float list of 3 bytes": hand_made(9, score=entry(b"score", b"\x12\x05\x0a\x03abc")),
        "lengths past the record's end": hand_made(9, unused=claiming(2**24)),
        "lengths past the batch's end": hand_made(9, unused=claiming(2**34)),
        "a broken entry after the last": hand_made(9, last=b"\x0a\x03\x0a\x05x"),  # key 5 in 3
    }
    for name, bad in broken.items():
        got = check(TOKENS, [batch, [*batch[:9], bad, *batch[10:]]], walked=1)[1]
        assert got[:2] == (DataError, "record 9 of the batch is not a tf.train.Example (protobuf "
                           f"cannot parse its {len(bad)} bytes)."), name  # fmt: skip


def test_an_entry_hidden_in_a_bytes_value_is_not_read_as_that_entry():
    batch = [hand_made(i) for i in range(64)]
    # Record 9's note holds a second value framed as the token_ids entry is, and the record no
    # token_ids of its own: protobuf finds none there.
    values = b"\x0a\x01n" + entry(b"token_ids", int64s(varint(300) * 128))
    note = entry(b"note", b"\x0a" + varint(len(values)) + values)
    bad = hand_made(9, note=note, ids=b"")
    got = check(TOKENS, [batch, [*batch[:9], bad, *batch[10:]]], walked=1)[1]
    assert got[:3:2] == (RecordMismatch, 9)
    assert "feature 'token_ids' (record key 'token_ids') is not in record 9" in got[1]


def test_a_list_of_another_count_is_the_per_record_error():
    records = token_records(64)

    def ids(count: int) -> bytes:
        mask = np.ones(128, np.int64)
        return example.serialize({"token_ids": np.arange(300, 300 + count),
                                  "padding_mask": mask, "weights": mask})  # fmt: skip

    fewer = [*records[:9], ids(127), *records[10:]]
    one_more_one_fewer = [*records[:9], ids(129), ids(127), *records[11:]]  # as many in all
    check(TOKENS, [records, fewer, one_more_one_fewer], walked=1)
    with pytest.raises(RecordMismatch, match="record 9 of the batch holds 127 int64 values"):
        both(TOKENS)[0](fewer)
    with pytest.raises(RecordMismatch, match="record 9 of the batch holds 129 int64 values"):
        both(TOKENS)[0](one_more_one_fewer)


def test_every_byte_of_a_walked_record_corrupted_gives_the_per_record_outcome():
    batch = token_records(48, high=1000, note=lambda i: "n" * (i % 4), unused=lambda i: [-1, i])
    fast, slow = both(TOKENS)
    assert path_of(fast, batch)[0] == "walked"
    seen = set()
    target = batch[5]
    for at in range(len(target)):
        for value in {0x80, 0x00, target[at] ^ 0xFF}:
            changed = bytearray(target)
            changed[at] = value
            trial = [*batch[:5], bytes(changed), *batch[6:]]
            path, got = path_of(fast, trial)
            assert_identical(got, outcome(slow, trial))
            seen.add(path + (" error" if isinstance(got, tuple) else ""))
    assert seen == {"walked", "records", "records error"}


def test_an_unread_varint_of_ten_bytes_rides_along_and_of_eleven_is_the_decode_error():
    ids, mask = varint(300) * 128, b"\x01" * 128

    def one(i: int, unused: bytes) -> bytes:
        return record(entry(b"token_ids", int64s(ids)), entry(b"padding_mask", int64s(mask)),
                      entry(b"weights", int64s(mask)), entry(b"pad", int64s(b"\x05" * (i % 3))),
                      entry(b"unused", int64s(unused)))  # fmt: skip

    ten = varint(-1)
    assert len(ten) == 10
    batch = [one(i, ten) for i in range(64)]
    check(TOKENS, [batch], walked=1)
    bad = [*batch[:7], one(7, b"\xff" * 10 + b"\x01"), *batch[8:]]  # eleven bytes
    got = check(TOKENS, [bad])[0]
    assert got[:2] == (DataError, "record 7 of the batch is not a tf.train.Example (protobuf "
                       f"cannot parse its {len(bad[7])} bytes).")  # fmt: skip


def test_raw_and_float_features_beside_text_of_varying_length_are_walked():
    rng = np.random.default_rng(3)
    records = []
    for i, naic in enumerate(naic_records(40)):
        stored = example.parse(naic).features.feature
        values = {key: stored[key].bytes_list.value[0] for key in NAIC}
        records.append(example.serialize({**values, "f": rng.standard_normal(3),
                                          "note": "é" * (i % 5)}))  # fmt: skip
    specs = {**NAIC, "f": {"type": "float", "shape": [3]}}
    stored = example.parse(records[25]).features.feature
    short = example.serialize({**{key: stored[key].bytes_list.value[0] for key in NAIC},
                               "x": bytes(4092), "f": [0.0] * 3, "note": ""})  # fmt: skip
    got = check(specs, [records[:20], records[20:], [*records[20:39], short]], walked=2)
    assert (got[0]["f"].dtype, got[1]["x"].shape) == (np.float32, (20, 32, 32))
    assert got[2][:3:2] == (RecordMismatch, 19)


# ------------------------------------------------------------------------------- tf.data
@needs_tf
@pytest.mark.parametrize("kind", ["tabular", "naic", "mixed", "tokens"])
def test_the_fast_path_returns_what_tf_datas_parse_example_returns(kind):
    from tpurun import frameworks

    tf = frameworks.tensorflow()
    specs, batch = {
        "tabular": (TABULAR, tabular_records(40)),
        "naic": (NAIC, naic_records(40)),
        "mixed": (TABULAR, tabular_records(40, note=lambda i: "n" * (i % 2))),
        "tokens": (TOKENS, token_records(64, high=2**40)),
    }[kind]
    used = features(specs)
    parser = BatchParser(used)
    ours = parser(batch)
    parsed = tf.io.parse_example(tf.constant(batch), decode.parse_spec(used))
    theirs = {name: value.numpy() for name, value in decode.decode_batch(parsed, used).items()}
    assert parser.batches_by_path["records"] == (1 if kind == "mixed" else 0)
    assert list(ours) == list(theirs)
    for name in theirs:
        a, b = ours[name], theirs[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert a.tobytes() == b.tobytes(), name


@needs_tf
@pytest.mark.parametrize("kind", ["naic", "tabular", "tokens"])
def test_the_native_pipeline_makes_tf_datas_batches_through_the_fast_paths(
    tmp_path, monkeypatch, kind
):
    from tpurun.config import DataConfig
    from tpurun.data import pipeline
    from tpurun.data.native import framing
    from tpurun.data.native import pipeline as native

    made = []

    class Spy(BatchParser):
        """The pipeline's own parser, kept to read which path its batches took."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(native, "BatchParser", Spy)
    specs, records, inputs, targets, path = {
        "naic": (NAIC, naic_records(256), ["x", "half", "u16"], "y", "columns"),
        "tabular": (TABULAR, tabular_records(256), "features", ["label", "small", "weight", "flag"],
                    "columns"),
        "tokens": (TOKENS, token_records(256), {"ids": "token_ids", "mask": "padding_mask"},
                   "weights", "walked"),
    }[kind]  # fmt: skip
    files = [str(tmp_path / f"{kind}-{i}.tfrecord") for i in range(3)]
    for i, file in enumerate(files):
        framing.write_records(file, records[i::3])
    data = DataConfig.model_validate(
        {"train": files, "features": specs, "inputs": inputs, "targets": targets}
    )
    theirs = list(pipeline.make_dataset(files, data, 64, training=False))
    ours = list(native.make_dataset(files, data, 64, training=False))
    assert len(ours) == len(theirs) == 4
    for mine, want in zip(ours, theirs, strict=True):
        mine, want = flat(mine), flat(want)
        assert [(a.dtype, a.shape) for a in mine] == [(b.dtype, b.shape) for b in want]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(mine, want, strict=True))
    assert made[-1].batches_by_path[path] == 4
