"""The native parser's fast path (tpurun.data.native.layout): a batch whose records share one
layout is parsed at once, as columns of its records' bytes, and gives exactly what the per-record
parser gives; any other batch falls back to it, with its results and its errors.

Each case runs one BatchParser with the fast path and one without on the same batches, compares
them array by array (dtype, shape, bytes, writability), and counts the batches that took the fast
path, so a test proves which path ran. Where TensorFlow is installed, tf.data's parse_example is
the third party to agree."""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest
from pydantic import TypeAdapter

from tpurun.config.features import Feature
from tpurun.data import decode
from tpurun.data.native import example
from tpurun.data.native.decode import BatchParser, RecordMismatch
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


def both(specs: dict) -> tuple[BatchParser, BatchParser]:
    used = features(specs)
    return BatchParser(used), BatchParser(used, fast_path=False)


def check(specs: dict, batches: list[list[bytes]], fast_batches: int) -> list:
    """Parse each batch both ways, assert them identical, and that ``fast_batches`` were fast."""
    fast, slow = both(specs)
    results = []
    for batch in batches:
        results.append(outcome(fast, batch))
        assert_identical(results[-1], outcome(slow, batch))
    assert (fast.fast_batches, slow.fast_batches) == (fast_batches, 0)
    return results


# ------------------------------------------------------------------------------- the fast path
def test_tabular_packed_floats_and_small_ints_are_parsed_a_batch_at_once():
    records = tabular_records(96)
    got = check(TABULAR, [records[:32], records[32:64], records[64:]], fast_batches=3)
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
    got = check(NAIC, [records[:64], records[64:], records[:64]], fast_batches=3)
    assert (
        got[0]["x"][5].tobytes()
        == example.parse(records[5]).features.feature["x"].bytes_list.value[0]
    )
    assert got[1]["x"].flags.c_contiguous and got[1]["x"].flags.aligned
    assert got[2]["x"].tobytes() == got[0]["x"].tobytes()  # the kept buffer leaks nothing


def test_unused_features_of_constant_length_ride_along_and_of_another_length_fall_back():
    same = tabular_records(
        16, note=lambda i: f"row {i:04d}", raw=lambda i: bytes([i]) * 9, vocab=lambda i: 32000
    )  # an unused int64 of several bytes rides along where it stays the same
    other = tabular_records(16, note=lambda i: "x" * (i % 3), raw=lambda i: b"")
    check(TABULAR, [same, other, same[:5] + other[5:], same], fast_batches=2)


# ----------------------------------------------------------------------------- fall backs
def test_a_batch_mixing_layouts_falls_back_then_the_next_batch_learns_its_own():
    plain = tabular_records(16)
    extra = tabular_records(16, seed=1, tag=lambda i: i % 100)  # one more key, same sizes
    garbled = [*plain[:8], plain[8].replace(b"weight", b"weighs"), *plain[9:]]  # same length
    check(TABULAR, [plain, plain[:8] + extra[:8], extra, garbled, plain], fast_batches=3)


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
    check(specs, [good, [*good[:2], long_pair], [*good[:2], long_unused], good], fast_batches=2)


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
            before = fast.fast_batches
            got = outcome(fast, trial)
            assert_identical(got, outcome(slow, trial))
            seen.add(
                ("fast" if fast.fast_batches > before else "slow")
                + (" error" if isinstance(got, tuple) else "")
            )  # fmt: skip
    assert seen == {"fast", "slow", "slow error"}


def test_a_damaged_key_names_the_missing_feature_as_without_the_fast_path():
    batch = tabular_records(6)
    batch[4] = batch[4].replace(b"\x0a\x05label", b"\x0a\x05lbbel")
    fast, _ = both(TABULAR)
    with pytest.raises(RecordMismatch, match=r"feature 'label' \(record key 'label'\) is not in "
                       r"record 4 of the batch; it holds: features, lbbel, small, weight"):  # fmt: skip
        fast(batch)
    check(TABULAR, [batch], fast_batches=0)


def test_a_record_cut_short_is_the_same_decode_error():
    batch = tabular_records(3)
    batch[1] = batch[1][:-1]
    check(TABULAR, [batch], fast_batches=0)
    with pytest.raises(DataError, match=r"record 1 of the batch is not a tf\.train\.Example"):
        both(TABULAR)[0](batch)


def test_what_the_walker_does_not_read_goes_record_by_record():
    specs = {"f": {"type": "float", "shape": [2]}, "y": {"type": "int64"}}

    def entry(key: bytes, feature: bytes) -> bytes:
        body = b"\x0a" + bytes([len(key)]) + key + b"\x12" + bytes([len(feature)]) + feature
        return b"\x0a" + bytes([len(body)]) + body

    def record(*entries: bytes) -> bytes:
        features = b"".join(entries)
        return b"\x0a" + bytes([len(features)]) + features

    def ints(value: int) -> bytes:
        return b"\x1a\x03\x0a\x01" + bytes([value])

    floats = np.float32([1.5, -2]).tobytes()
    packed_f = b"\x12\x0a\x0a\x08" + floats
    split_f = b"\x12\x0c\x0a\x04" + floats[:4] + b"\x0a\x04" + floats[4:]  # read as one list
    unpacked_f = b"\x12\x0a" + b"\x0d" + floats[:4] + b"\x0d" + floats[4:]
    f, y = entry(b"f", packed_f), entry(b"y", ints(7))
    cases = {  # name: (the batch, whether the fast path takes it)
        "plain": ([record(f, y)] * 3, True),
        "an unused list in split runs": ([record(f, y, entry(b"g", split_f))] * 3, True),
        "a list read in split runs": ([record(entry(b"f", split_f), y)] * 3, False),
        "unpacked floats": ([record(entry(b"f", unpacked_f), y)] * 3, False),
        "a key twice (the last wins)": ([record(entry(b"y", ints(9)), f, y)] * 3, False),
        "a second Example merged in": (
            [record(f, entry(b"y", ints(v))) + record(y) for v in (7, 3, 120)], False
        ),
    }  # fmt: skip
    for name, (batch, fast) in cases.items():
        parsed = check(specs, [batch], int(fast))[0]
        assert parsed["f"].tolist() == [[1.5, -2.0]] * 3, name
        assert parsed["y"].tolist() == [7] * 3, name


def test_a_parser_reading_text_or_images_never_takes_the_fast_path():
    specs = {**TABULAR, "note": {"type": "text"}}
    batch = tabular_records(8, note=lambda i: "same")
    check(specs, [batch, batch], fast_batches=0)


def test_threads_sharing_a_parser_each_get_their_own_batches():
    from concurrent.futures import ThreadPoolExecutor

    batches = [naic_records(40, seed) for seed in range(8)]
    fast, slow = both(NAIC)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(fast, batches * 3))
    for batch, parsed in zip(batches * 3, got, strict=True):
        assert_identical(parsed, slow(batch))
    assert fast.fast_batches == 24


# ------------------------------------------------------------------------------- tf.data
@needs_tf
@pytest.mark.parametrize("kind", ["tabular", "naic", "mixed"])
def test_the_fast_path_returns_what_tf_datas_parse_example_returns(kind):
    from tpurun import frameworks

    tf = frameworks.tensorflow()
    specs, batch = {
        "tabular": (TABULAR, tabular_records(40)),
        "naic": (NAIC, naic_records(40)),
        "mixed": (TABULAR, tabular_records(40, note=lambda i: "n" * (i % 2))),
    }[kind]
    used = features(specs)
    parser = BatchParser(used)
    ours = parser(batch)
    parsed = tf.io.parse_example(tf.constant(batch), decode.parse_spec(used))
    theirs = {name: value.numpy() for name, value in decode.decode_batch(parsed, used).items()}
    assert parser.fast_batches == (0 if kind == "mixed" else 1)
    assert list(ours) == list(theirs)
    for name in theirs:
        a, b = ours[name], theirs[name]
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert a.tobytes() == b.tobytes(), name
