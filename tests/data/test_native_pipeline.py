"""The native input pipeline (tpurun/data/native/pipeline.py) and the choice of reader
(tpurun/data/reader.py), on real TFRecord files in tmp_path.

Unshuffled, the native reader must make ``tf.data``'s batches element for element (checked against
the tf.data pipeline itself where TensorFlow is installed); shuffled, each pass holds every record
once, the stream is a function of the seed, and a resume at any record continues it exactly. Real
fits on the JAX backend read through it, a SIGKILL mid-epoch included.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    cli_env,
    read_log,
    read_summary,
    run_cli,
    signal_at,
    toy_config,
    write_config,
    write_with_schema,
)

from tpurun.config import DataConfig
from tpurun.data import reader as readers
from tpurun.data.native import pipeline as native
from tpurun.data.native import streams
from tpurun.data.native.framing import DamagedRecord, iter_records
from tpurun.data.write import write_shards
from tpurun.errors import DataError, EnvironmentSetupError

ROOT = Path(__file__).resolve().parents[2]
JAX_VENV = ROOT / ".venv-jax" / "bin"
TF = importlib.util.find_spec("tensorflow") is not None


def data_config(features: dict, inputs, targets, **kw) -> DataConfig:
    return DataConfig.model_validate(
        {"train": "unused", "features": features, "inputs": inputs, "targets": targets, **kw}
    )


def flat(batch) -> list[np.ndarray]:
    """A batch's arrays in a fixed order (dicts by key), as numpy."""
    if isinstance(batch, dict):
        return [a for key in sorted(batch) for a in flat(batch[key])]
    if isinstance(batch, (tuple, list)):
        return [a for value in batch for a in flat(value)]
    return [batch.numpy() if hasattr(batch, "numpy") else np.asarray(batch)]


def assert_same_batches(tf_dataset, native_batches, atol: float = 0.0) -> int:
    """Both pipelines' batches, element by element: dtypes, shapes and values. Returns the count."""
    theirs = [flat(b) for b in tf_dataset]
    ours = [flat(b) for b in native_batches]
    assert len(ours) == len(theirs) > 0
    for i, (mine, want) in enumerate(zip(ours, theirs, strict=True)):
        assert len(mine) == len(want)
        for a, b in zip(mine, want, strict=True):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), f"batch {i}"
            if a.dtype == object:
                assert a.tolist() == b.tolist(), f"batch {i}"
            elif atol:
                np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=f"batch {i}")
            else:
                np.testing.assert_array_equal(a, b, err_msg=f"batch {i}")
    return len(ours)


def both(files, data, batch, **kw):
    """The tf.data pipeline's and the native pipeline's datasets for the same arguments."""
    pytest.importorskip("tensorflow")
    from tpurun.data import pipeline

    return (pipeline.make_dataset(files, data, batch, **kw),
            native.make_dataset(files, data, batch, **kw))  # fmt: skip


# ------------------------------------------------------------------------- the same batches
def uneven_shards(tmp_path: Path, records: list[dict], lengths: list[int]) -> list[str]:
    """Shards of the given lengths (an empty one among them): interleave order depends on them."""
    files, start = [], 0
    for i, n in enumerate(lengths):
        files += write_shards(str(tmp_path / f"d{i:02d}"), records[start : start + n], 1)
        start += n
    return files


MIXED = {
    "x": {"type": "raw", "dtype": "float32", "shape": [2, 3], "cast": "bfloat16"},
    "label": {"type": "int64", "cast": "int32"},
    "vec": {"type": "int64", "shape": [3]},
    "f": {"type": "float", "shape": [2]},
    "id": {"type": "bytes"},
    "text": {"type": "text"},
}


def mixed_records(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    raw = rng.normal(size=(n, 2, 3)).astype(np.float32)
    return [{"x": raw[i].tobytes(), "label": i, "vec": [i, 2 * i, -i], "f": [0.5 * i, 1.0],
             "id": f"id{i}", "text": f"record {i} é"} for i in range(n)]  # fmt: skip


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"take_batches": 5},
        {"score_records": 131},
        {"score_records": 60, "take_batches": 9},
        {"shard": (3, 1), "score_records": 44},
        {"cache": ""},
    ],
    ids=["in-order", "take", "exact", "exact-take", "shard", "memory-cache"],
)
def test_unshuffled_the_two_readers_make_the_same_batches(tmp_path, kw):
    # 20 files of uneven length (one empty): more than the 16 read at once, so files take over
    # the slots of those that end, in tf.data's order.
    lengths = [3, 11, 0, 7, 1, 9, 2, 5, 13, 4, 6, 8, 1, 10, 12, 3, 7, 9, 14, 6]
    files = uneven_shards(tmp_path, mixed_records(sum(lengths)), lengths)
    data = data_config(MIXED, {"pixels": "x", "vec": "vec", "f": "f", "id": "id", "text": "text"},
                       ["label", "f"])  # fmt: skip
    theirs, ours = both(files, data, 8, training=False, **kw)
    count = assert_same_batches(theirs, ours)
    assert count == (ours.num_batches or 131 // 8)


def round_robin(lengths: list[int], cycle: int) -> list[tuple[int, int]]:
    """TensorFlow's deterministic interleave, one slot at a time: (file, record) in the order
    read. A file that ends yields nothing that turn; its slot takes the next file on its turn."""
    pending, slots, order, index = iter(range(len(lengths))), [None] * cycle, [], 0
    while any(slot is not None for slot in slots) or pending is not None:
        if slots[index] is None and pending is not None:
            slots[index] = next(pending, None)
            if slots[index] is None:
                pending = None
            else:
                slots[index] = [slots[index], 0]
            continue
        if slots[index] is not None:
            file, read = slots[index]
            if read < lengths[file]:
                order.append((file, read))
                slots[index][1] += 1
            else:
                slots[index] = None
        index = (index + 1) % cycle
    return order


def test_the_interleave_reads_files_in_tensorflows_turns_whatever_their_lengths():
    # Files ending one or several in a turn, empty ones, more files than slots or fewer.
    rng = np.random.default_rng(0)
    for case in range(300):
        cycle = int(rng.integers(1, 18))
        lengths = rng.integers(0, 9, int(rng.integers(0, 41))).tolist()
        if case % 3 == 0:
            lengths = [5] * len(lengths)  # several files ending in the same turn
        files = {str(f): [(f, i) for i in range(n)] for f, n in enumerate(lengths)}
        got = list(streams.interleaved(list(files), lambda name, f=files: iter(f[name]), cycle))
        assert got == round_robin(lengths, cycle), (cycle, lengths)


def test_exact_validation_weighs_every_record_once_and_the_padding_zero(tmp_path):
    files = write_shards(str(tmp_path / "v"), [{"i": i} for i in range(21)], 3)
    data = data_config({"i": {"type": "int64"}}, "i", "i")
    batches = list(native.make_dataset(files, data, 8, training=False, score_records=21))
    ids = np.concatenate([x for x, _, _ in batches])
    weights = np.concatenate([w for _, _, w in batches])
    assert ids.shape == (24,) and weights.dtype == np.float32
    assert sorted(ids[:21].tolist()) == list(range(21)) and weights[:21].tolist() == [1.0] * 21
    assert weights[21:].tolist() == [0.0] * 3 and ids[21:].tolist() == [ids[0]] * 3
    theirs, ours = both(files, data, 8, training=False, score_records=21)
    assert_same_batches(theirs, ours)


def test_repeated_validation_gives_the_same_batches_again(tmp_path):
    files = write_shards(str(tmp_path / "v"), [{"i": i} for i in range(10)], 1)
    data = data_config({"i": {"type": "int64"}}, "i", "i")
    repeated = native.make_dataset(files, data, 4, training=False, take_batches=2,
                                   repeat_eval=True)  # fmt: skip
    iterator = iter(repeated)
    firsts = [next(iterator)[0].tolist()[0] for _ in range(5)]
    iterator.close()
    assert firsts == [0, 4, 0, 4, 0] and repeated.num_batches is None


def test_tabular_packed_and_normalised_features_are_the_same(tmp_path):
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    rng = np.random.default_rng(1)
    rows = [[r, *rng.normal(size=6).round(4), ["a", "b", "c"][r % 3]] for r in range(50)]
    csv = tmp_path / "t.csv"
    csv.write_text("\n".join(",".join(map(str, row)) for row in
                             [["id", *(f"f{i}" for i in range(6)), "kind"], *rows]) + "\n")  # fmt: skip
    result = CliRunner().invoke(app, ["data", "write", str(csv), str(tmp_path / "tab"), "--label",
                                      "kind", "--pack", "x=f0:f5", "--plain"])  # fmt: skip
    assert result.exit_code == 0, result.output
    schema = json.loads((tmp_path / "tab.schema.json").read_text())
    features = {**schema["features"], "x": {**schema["features"]["x"], "normalize": True}}
    files = sorted(str(p) for p in tmp_path.glob("tab-*.tfrecord"))
    data = data_config(features, {"x": "x", "id": "id"}, "kind")
    theirs, ours = both(files, data, 16, training=False, score_records=50)
    assert_same_batches(theirs, ours)
    x = np.concatenate([b[0]["x"] for b in ours])[:50]
    want = np.array([row[1:7] for row in rows], np.float32)  # normalised in the model, not here
    np.testing.assert_array_equal(x[np.argsort(np.concatenate([b[0]["id"] for b in ours])[:50])],
                                  want)  # fmt: skip


def encoded(pixels: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_images_decode_resize_and_scale_as_tf_data_does(tmp_path, fmt):
    rng = np.random.default_rng(2)
    sizes = [(20, 30), (6, 5), (12, 12)]  # down, up and unchanged for a 12x12 feature
    records = [{"image": encoded(rng.integers(0, 256, (*sizes[i % 3], 3), np.uint8), fmt),
                "class": i} for i in range(16)]  # fmt: skip
    files = write_shards(str(tmp_path / "im"), records, 2)
    for shape, scale in (([12, 12, 3], True), ([12, 12, 1], False)):
        features = {"image": {"type": "image", "shape": shape, "scale": scale},
                    "class": {"type": "int64"}}  # fmt: skip
        # Batches of 8: the parser's two decoding threads take 4 images each.
        theirs, ours = both(files, data_config(features, "image", "class"), 8, training=False)
        # The same decoders' pixels, resized in float32: equal up to rounding (0..255 unscaled).
        assert_same_batches(theirs, ours, atol=1e-4 if scale else 3e-2)


TOKENS = {
    name: {"type": "int64", "shape": [9]} for name in ("token_ids", "padding_mask", "weights")
}


def token_records(n: int) -> list[dict]:
    """Records as ``tpurun data write --tokenize`` lays out a causal LM's: N + 1 token ids, the
    padding mask and the loss weights, int64."""
    rng = np.random.default_rng(3)
    out = []
    for _ in range(n):
        length = int(rng.integers(3, 10))
        mask = (np.arange(9) < length).astype(np.int64)
        out.append({"token_ids": (rng.integers(1, 500, 9) * mask).tolist(),
                    "padding_mask": mask.tolist(), "weights": mask.tolist()})  # fmt: skip
    return out


def test_tokenised_text_is_the_same(tmp_path):
    files = write_shards(str(tmp_path / "tok"), token_records(40), 4)
    data = data_config(TOKENS, {"token_ids": "token_ids", "padding_mask": "padding_mask"},
                       {"weights": "weights"})  # fmt: skip
    theirs, ours = both(files, data, 8, training=False, score_records=40)
    assert_same_batches(theirs, ours)
    x, y, w = next(iter(ours))
    assert x["token_ids"].dtype == np.int64 and x["token_ids"].shape == (8, 9)


def test_in_file_order_for_predict_is_the_same_and_padded(tmp_path):
    pytest.importorskip("tensorflow")
    from tpurun.data import pipeline

    files = uneven_shards(tmp_path, mixed_records(23), [9, 0, 14])
    features = {name: data_config(MIXED, "x", "id").features[name] for name in ("x", "id")}
    kw = {"records": 23, "features": features, "inputs": "x", "extra": ["id"]}
    ours = native.make_ordered_dataset(files, "auto", 8, **kw)
    assert_same_batches(pipeline.make_ordered_dataset(files, "auto", 8, **kw), ours)
    ids = np.concatenate([extra["id"] for _, extra in ours.as_numpy_iterator()])
    assert ids.tolist() == [f"id{i}".encode() for i in range(23)] + [b"id0"]


def test_gzip_records_are_the_same(tmp_path):
    files = write_shards(str(tmp_path / "gz"), mixed_records(30), 3, "gzip")
    data = data_config(MIXED, "x", "label", compression="gzip")
    theirs, ours = both(files, data, 8, training=False, score_records=30)
    assert_same_batches(theirs, ours)


# --------------------------------------------------------------------------------- shuffling
def int_stream(files, data, batch, batches, **kw) -> np.ndarray:
    ds = native.make_dataset(files, data, batch, training=True, records_per_pass=100, **kw)
    iterator = iter(ds)
    try:
        return np.concatenate([next(iterator)[0] for _ in range(batches)])
    finally:
        iterator.close()


@pytest.mark.parametrize("cache", [None, ""], ids=["files", "memory-cache"])
def test_each_pass_holds_every_record_once_and_the_seed_alone_decides(tmp_path, cache):
    files = write_shards(str(tmp_path / "s"), [{"i": i} for i in range(100)], 4)
    data = data_config({"i": {"type": "int64"}}, "i", "i", shuffle_buffer=30)
    # 10 batches of 10 are one pass, so one epoch: each a permutation of the 100 records.
    whole = int_stream(files, data, 10, 40, seed=3, cache=cache)
    passes = [whole[p * 100 : (p + 1) * 100].tolist() for p in range(4)]
    for records in passes:
        assert sorted(records) == list(range(100))
    assert passes[0] != list(range(100)) and len({tuple(p) for p in passes}) == 4
    assert int_stream(files, data, 10, 40, seed=3, cache=cache).tolist() == whole.tolist()
    assert int_stream(files, data, 10, 10, seed=4, cache=cache).tolist() != whole[:100].tolist()


@pytest.mark.parametrize("start", [1, 37, 99, 100, 216, 250])
def test_a_resume_at_any_record_continues_the_same_stream(tmp_path, start):
    files = write_shards(str(tmp_path / "s"), [{"i": i} for i in range(100)], 4)
    data = data_config({"i": {"type": "int64"}}, "i", "i", shuffle_buffer=50)
    whole = int_stream(files, data, 1, 300, seed=5)
    rest = int_stream(files, data, 1, 300 - start, seed=5, start_record=start)
    assert rest.tolist() == whole[start:].tolist()


def test_the_shuffle_buffer_is_a_permutation_of_its_input():
    rng = streams.pass_rng(-7, 2)  # any seed, negative too
    out = list(streams.shuffled(range(1000), 64, rng))
    assert sorted(out) == list(range(1000)) and out != list(range(1000))
    # A record leaves the buffer only after it entered it: at most 63 places early.
    assert all(out.index(i) >= i - 63 for i in range(1000))
    assert list(streams.shuffled(range(5), 1, rng)) == [0, 1, 2, 3, 4]


def test_a_file_cache_is_written_once_and_read_back_without_the_files(tmp_path):
    files = write_shards(str(tmp_path / "s"), [{"i": i} for i in range(40)], 2)
    data = data_config({"i": {"type": "int64"}}, "i", "i", shuffle_buffer=0)
    prefix = tmp_path / "cache" / "c-train"
    prefix.parent.mkdir()
    ds = native.make_dataset(files, data, 10, training=True, cache=str(prefix))
    iterator = iter(ds)
    first = np.concatenate([next(iterator)[0] for _ in range(4)])  # the whole first pass
    next(iterator)  # the second pass starts: the cache is complete
    for f in files:
        os.remove(f)
    second = np.concatenate([next(iterator)[0] for _ in range(3)])
    iterator.close()
    assert sorted(first.tolist()) == list(range(40))
    assert second.tolist() == first[10:40].tolist()  # one file order, unshuffled here
    cached = sorted(str(p.name) for p in prefix.parent.iterdir())
    assert cached == ["c-train.tfrecord"]
    assert len(list(iter_records(f"{prefix}.tfrecord"))) == 40


def test_a_shard_keeps_every_nth_record(tmp_path):
    files = write_shards(str(tmp_path / "s"), [{"i": i} for i in range(30)], 1)
    data = data_config({"i": {"type": "int64"}}, "i", "i")
    shares = [np.concatenate([x for x, _ in native.make_dataset(files, data, 5, training=False,
                                                                shard=(3, k))]).tolist()
              for k in range(3)]  # fmt: skip
    assert shares == [list(range(k, 30, 3)) for k in range(3)]


def test_a_damaged_record_is_raised_by_the_next_batch_naming_file_and_record(tmp_path):
    [path] = write_shards(str(tmp_path / "s"), [{"i": i} for i in range(30)], 1)
    raw = bytearray(Path(path).read_bytes())
    raw[-3] ^= 0xFF  # the last record's data CRC
    Path(path).write_bytes(bytes(raw))
    data = data_config({"i": {"type": "int64"}}, "i", "i")
    iterator = iter(native.make_dataset([path], data, 10, training=False))
    assert next(iterator)[0].tolist() == list(range(10))
    next(iterator)
    with pytest.raises(DamagedRecord) as info:
        next(iterator)
    assert (info.value.path, info.value.index) == (path, 29)
    assert readers.damaged_record(info.value)


# -------------------------------------------------------------------------------- the choice
@pytest.mark.parametrize(
    ("setting", "backend", "tensorflow", "preprocessing", "measured", "name", "reason"),
    [
        ("auto", "jax", False, None, False, "native", "TensorFlow is not installed"),
        ("auto", "jax", False, None, True, "native", "TensorFlow is not installed"),
        ("auto", "jax", True, None, True, "native", readers.NATIVE_MEASURED),
        ("auto", "jax", True, None, False, "tf_data", readers.TF_DATA_MEASURED),
        ("native", "jax", True, None, False, "native", "asked for in data.reader"),
        ("tf_data", "jax", True, None, True, "tf_data", "asked for in data.reader"),
        ("auto", "tensorflow", True, None, True, "tf_data",
         "the TensorFlow backend reads through tf.data"),
        ("auto", "jax", True, "text", False, "tf_data", "the preset's tokenizer runs in tf.data"),
        ("auto", "jax", True, "images", True, "tf_data",
         "the preset's image converter runs in tf.data"),
    ],
)  # fmt: skip
def test_one_function_chooses_the_reader(setting, backend, tensorflow, preprocessing, measured,
                                         name, reason):  # fmt: skip
    chosen = readers.choose(setting, backend, tensorflow, preprocessing, measured)
    assert (chosen.name, chosen.reason) == (name, reason)
    assert chosen.summary == f"reader: {name} ({reason})"


def test_auto_reads_natively_the_kinds_of_records_measured_as_fast():
    """Images, raw bytes, floats and short int64 lists (labels): native; token ids (a long int64
    list) and strings: tf.data, where TensorFlow is installed (benchmarks/input_pipeline.py)."""
    data = data_config({"image": {"type": "image", "shape": [8, 8, 3]},
                        "x": {"type": "raw", "dtype": "float32", "shape": [4]},
                        "f": {"type": "float", "shape": [3]}, "y": {"type": "int64"},
                        "pair": {"type": "int64", "shape": [readers.SHORT_INT64]},
                        "ids": {"type": "int64", "shape": [readers.SHORT_INT64 + 1]},
                        "s": {"type": "bytes"}}, ["image", "x", "f", "pair"], "y")  # fmt: skip
    assert readers.measured_native(data.features) is False  # ids and s among them
    native = {n: data.features[n] for n in ("image", "x", "f", "y", "pair")}
    assert readers.measured_native(native) is True
    for slower in ("ids", "s"):
        assert readers.measured_native({**native, slower: data.features[slower]}) is False, slower


@pytest.mark.parametrize(
    ("setting", "backend", "tensorflow", "preprocessing", "message"),
    [
        ("tf_data", "jax", False, None, r"^data.reader: tf_data reads through tf.data, and "
         r"TensorFlow is not installed here. Set data.reader: auto .* pip install tensorflow-cpu"),
        ("native", "tensorflow", True, None, r"^data.reader: native feeds the JAX backend only"),
        ("auto", "jax", False, "text", r"^model.preset: the preset's tokenizer runs inside the "
         r"input pipeline and needs tensorflow-text, and TensorFlow is not installed. Install the "
         r"extra \(pip install 'tpurun\[hub\]'\), or tokenise the records once \(where "
         r"TensorFlow is installed, if not here\): tpurun data write SOURCE OUT_PREFIX --tokenize "
         r"PRESET; token ids train without it.$"),
        ("native", "jax", True, "text", r"which data.reader: native does not run \(set "
         r"data.reader: auto\). Install the extra .* --tokenize PRESET"),
    ],
)  # fmt: skip
def test_a_reader_that_cannot_run_here_says_why_and_the_way_out(setting, backend, tensorflow,
                                                                preprocessing, message):  # fmt: skip
    with pytest.raises(EnvironmentSetupError, match=message) as info:
        readers.choose(setting, backend, tensorflow, preprocessing)
    assert info.value.exit_code == 2 and "\n" not in info.value.message


def test_the_start_line_says_the_reader_and_why():
    from types import SimpleNamespace

    from tpurun.display.lines import PlainReporter

    plan = SimpleNamespace(replicas=1, per_core_batch_size=8, global_batch_size=8,
                           learning_rate=1e-3, steps_per_epoch=4, steps_per_execution=1,
                           reader="native", reader_reason="TensorFlow is not installed")  # fmt: skip
    out = io.StringIO()
    PlainReporter(out).start(plan, "runs/x", 2, 0)
    assert (
        out.getvalue()
        .splitlines()[0]
        .endswith("steps_per_execution 1, reader: native (TensorFlow is not installed) -> runs/x")
    )


def test_tf_data_without_tensorflow_exits_2_naming_the_key(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tpurun.cli.app import app
    from tpurun.runtime import machine
    from tpurun.training import session

    folder = write_with_schema(tmp_path / "data", 64, 32)
    config = toy_config(folder, tmp_path / "runs")
    config["data"] = {"train": str(folder / "toy-train-*.tfrecord"), "inputs": "x",
                      "targets": "y", "reader": "tf_data"}  # fmt: skip
    no_tf = machine.Machine(jax="0.10.2", keras="3.15.1")  # what probe() finds without TF
    monkeypatch.setattr(session, "probe", lambda: no_tf)
    result = CliRunner().invoke(app, ["train", str(write_config(tmp_path, config)), "--plain"])
    assert result.exit_code == 2, result.output
    assert "error: data.reader: tf_data reads through tf.data, and TensorFlow is not installed" in (
        result.output
    )
    assert not (tmp_path / "runs" / "toy" / "summary.json").exists()


# ------------------------------------------------------------------------------- real fits
def native_config(folder: Path, out: Path, **train) -> dict:
    config = toy_config(folder, out, train={"epochs": 2, "steps_per_execution": 1, **train})
    config["data"]["reader"] = "native"
    return config


def test_a_fit_on_the_native_reader_trains_validates_and_records_the_reader(toy_data, tmp_path):
    import yaml

    import tpurun

    summary = tpurun.train(native_config(toy_data, tmp_path / "runs"), verbose=False)
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2
    run_dir = tmp_path / "runs" / "toy"
    rows = read_log(run_dir)
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert float(rows[1]["val_accuracy"]) > 0.6 and float(rows[1]["loss"]) < float(rows[0]["loss"])
    derived = yaml.safe_load((run_dir / "config.yaml").read_text())["derived"]
    assert (derived["reader"], derived["reader_reason"]) == ("native", "asked for in data.reader")
    # The input wait is measured on the native reader's batches too.
    assert len(summary["epoch_input_wait"]) == 2


def test_the_validation_loss_is_the_same_on_either_reader(toy_data, tmp_path):
    """Exact validation: every record once, padding weighted 0, in the same order. Four files of
    equal length and no record shuffle: each training batch holds the same records (in another
    order) on either reader, so both train the same weights and score them alike."""
    pytest.importorskip("tensorflow")
    import tpurun

    logs = {}
    for name in ("native", "tf_data"):
        config = native_config(toy_data, tmp_path / "runs", epochs=1)
        config["data"].update(reader=name, shuffle_buffer=0)
        config["name"] = name
        tpurun.train(config, verbose=False)
        [logs[name]] = read_log(tmp_path / "runs" / name)
    assert float(logs["native"]["val_loss"]) == pytest.approx(float(logs["tf_data"]["val_loss"]),
                                                              rel=1e-6)  # fmt: skip
    assert logs["native"]["val_accuracy"] == logs["tf_data"]["val_accuracy"]


def test_damage_met_mid_fit_by_the_native_reader_is_named(tmp_path):
    import tpurun

    folder = write_with_schema(tmp_path / "data", n_train=96, n_val=32, train_shards=1)
    config = native_config(folder, tmp_path / "runs", per_core_batch_size=8)
    config["data"] = {"train": str(folder / "toy-train-*.tfrecord"), "inputs": "x", "targets": "y",
                      "shuffle_buffer": 0, "reader": "native"}  # fmt: skip
    shard = folder / "toy-train-00000-of-00001.tfrecord"
    raw = bytearray(shard.read_bytes())
    starts = [0]
    while starts[-1] < len(raw):
        starts.append(starts[-1] + 16 + int.from_bytes(raw[starts[-1] : starts[-1] + 8], "little"))
    raw[starts[70] + 12 + 5] ^= 0xFF  # record 70: after the first batch, in the first epoch
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError) as info:
        tpurun.train(config, verbose=False)
    assert str(info.value).startswith(
        f"{shard}: cannot read it as TFRecords: corrupted record (checksum mismatch) at byte "
        f"{starts[70]}, after 70 good records."
    )
    assert read_summary(tmp_path / "runs" / "toy")["status"] == "failed"


@pytest.mark.slow
def test_sigkill_mid_epoch_then_rerun_is_exact_on_the_native_reader(toy_data, tmp_path):
    def config(name: str, kill: bool) -> dict:
        config = native_config(toy_data, tmp_path / "runs", epochs=3)
        extra = [signal_at(tmp_path / "fired", 2, 7, "SIGKILL")] if kill else []
        config["callbacks"] = {"checkpoint": {"every_steps": 4}, "extra": extra}
        return config

    unbroken = run_cli("train", str(write_config(tmp_path, config("unbroken", False), "unbroken")))
    assert unbroken.returncode == 0, unbroken.stderr
    assert "reader: native (asked for in data.reader)" in unbroken.stdout
    path = write_config(tmp_path, config("killed", True), "killed")
    killed = run_cli("train", str(path))
    assert killed.returncode == -9, killed.stderr
    run_dir = tmp_path / "runs" / "killed"
    state = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert (state["epoch"], state["step"]) == (1, 4)
    done = run_cli("train", str(path))
    assert done.returncode == 0, done.stderr
    assert read_summary(run_dir)["resumes"][-1]["step"] == 4
    # Nothing repeated, nothing skipped: every figure of every epoch is the unbroken run's.
    assert read_log(run_dir) == read_log(tmp_path / "runs" / "unbroken")


@pytest.mark.slow
@pytest.mark.skipif(not (JAX_VENV / "tpurun").exists(), reason="no .venv-jax (without TensorFlow)")
def test_without_tensorflow_installed_train_reads_natively_and_tf_data_exits_2(toy_data, tmp_path):
    import subprocess

    env = cli_env()
    env["PATH"] = f"{JAX_VENV}{os.pathsep}{env.get('PATH', '')}"
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 1})
    path = write_config(tmp_path, config)
    done = subprocess.run([str(JAX_VENV / "tpurun"), "train", str(path)], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "reader: native (TensorFlow is not installed)" in done.stdout
    run_dir = tmp_path / "runs" / "toy"
    for command in (["evaluate", str(run_dir)],
                    ["predict", str(run_dir), "--data", str(toy_data / "val-*.tfrecord"),
                     "--output", str(tmp_path / "p.csv"), "--id-feature", "id"]):  # fmt: skip
        after = subprocess.run([str(JAX_VENV / "tpurun"), *command], capture_output=True,
                               text=True, env=env, timeout=600)  # fmt: skip
        assert after.returncode == 0, after.stdout + after.stderr
    scored = json.loads((run_dir / "eval-validation.json").read_text())
    assert scored["records"] == 128 and scored["metrics"]["loss"] == pytest.approx(
        float(read_log(run_dir)[-1]["val_loss"]), rel=1e-5
    )
    rows = (tmp_path / "p.csv").read_text().splitlines()
    assert rows[0] == "id,y" and [r.split(",")[0] for r in rows[1:4]] == ["r0", "r2", "r4"]
    assert len(rows) == 129
    refused = subprocess.run(
        [str(JAX_VENV / "tpurun"), "train", str(path), "--set", "data.reader=tf_data"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "error: data.reader: tf_data reads through tf.data, and TensorFlow is not installed" in (
        refused.stderr + refused.stdout
    )


# ------------------------------------------------------------------- a preset's token records
@pytest.mark.skipif(importlib.util.find_spec("keras_hub") is None, reason="needs keras-hub")
def test_a_presets_tokenised_records_make_the_same_batches_on_either_reader(tiny_presets, tmp_path):
    """Records written with ``--tokenize``: the preset's transform (shift, weights times the
    padding's 0) runs on the native reader's numpy batches as in tf.data."""
    pytest.importorskip("tensorflow")  # tf.data, and --tokenize (tensorflow-text)
    from test_hub_tokenize import LENGTH, chat_rows, preset_config, write

    import tpurun
    from tpurun import frameworks
    from tpurun.hub import batches
    from tpurun.hub.task_model import build_preprocessor
    from tpurun.plan.prepare import prepare_here

    write(tmp_path, chat_rows(30), "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", str(LENGTH))  # fmt: skip
    config = tpurun.load_config(preset_config(tmp_path, tiny_presets.gemma, "tok",
                                              sequence_length=LENGTH))  # fmt: skip
    prepared = prepare_here(config)
    assert prepared.reader.name == "tf_data"  # auto, with TensorFlow installed
    frameworks.tensorflow().random.set_seed(1)  # before the tokenizer exists (test_hub_tokenize)
    transform = batches.transform(build_preprocessor(config), prepared.config.data,
                                  prepared.data.tokenized)  # fmt: skip
    files, records = prepared.data.validation_files, prepared.data.validation_records
    size = 5 if records % 5 else 3  # a last batch with padding
    theirs, ours = both(files, prepared.config.data, size, training=False, score_records=records,
                        transform=transform)  # fmt: skip
    assert_same_batches(theirs, ours)
    x, y, weights = list(ours)[-1]
    assert x["token_ids"].shape == y.shape == weights.shape == (size, LENGTH)
    padding = size * ours.num_batches - records
    assert padding > 0 and not weights[size - padding :].any()  # padding records weigh nothing
    assert weights[: size - padding].any()


def test_data_bench_times_the_reader_training_would_use(toy_data, tmp_path):
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    rng = np.random.default_rng(4)
    images = [{"image": encoded(rng.integers(0, 256, (10, 10, 3), np.uint8), "PNG"), "class": i % 3}
              for i in range(64)]  # fmt: skip
    (tmp_path / "im").mkdir()
    write_shards(str(tmp_path / "im" / "train"), images, 2)
    config = toy_config(tmp_path / "im", tmp_path / "runs", train={"per_core_batch_size": 8})
    config["data"] = {"train": str(tmp_path / "im" / "train-*.tfrecord"),
                      "features": {"image": {"type": "image", "shape": [8, 8, 3]},
                                   "class": {"type": "int64"}},
                      "inputs": "image", "targets": "class"}  # fmt: skip
    cases = {"images": (config, "native"),
             "raw": (toy_config(toy_data, tmp_path / "runs"), "native")}  # fmt: skip
    for name, (cfg, expected) in cases.items():
        path = write_config(tmp_path, cfg, name)
        result = CliRunner().invoke(app, ["data", "bench", str(path), "--steps", "3", "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.output)
        assert report["reader"] == expected, name
        assert report["examples_per_sec"] > 0 and report["steps"] == 3


# ------------------------------------------------------------------------------ several hosts
def test_each_processs_share_reads_every_record_once(tmp_path):
    from tpurun.multihost.shares import shares

    records = [{"i": i} for i in range(37)]
    data = data_config({"i": {"type": "int64"}}, "i", "i")
    for files_n, processes in ((5, 2), (8, 4), (2, 4), (1, 3)):
        files = sorted(write_shards(str(tmp_path / f"d{files_n}-{processes}"), records, files_n))
        counts = [len(records) // files_n + (k < len(records) % files_n) for k in range(files_n)]
        seen = []
        for share in shares(files, counts, processes):
            ds = native.make_dataset(share.files, data, 1, training=False, shard=share.shard)
            ids = [int(x[0]) for x, _ in ds]
            assert len(ids) == share.records
            seen += ids
        assert sorted(seen) == list(range(37)), (files_n, processes)


@pytest.mark.slow
def test_two_processes_train_on_the_native_reader(toy_data, tmp_path):
    import subprocess

    from helpers import TPURUN

    config = native_config(toy_data, tmp_path / "runs", per_core_batch_size=8)
    config["runtime"] = {"cpu_devices": 4}
    path = write_config(tmp_path, config)
    done = subprocess.run([TPURUN, "launch", "-n", "2", "train", str(path)], cwd=ROOT,
                          env=cli_env(TPURUN_LOST_AFTER_SECONDS="8"), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = read_summary(tmp_path / "runs" / "toy")
    assert (summary["processes"], summary["status"], summary["steps_per_epoch"]) == (
        2,
        "completed",
        16,
    )
    assert [r["epoch"] for r in read_log(tmp_path / "runs" / "toy")] == ["0", "1"]
    assert "reader: native (asked for in data.reader)" in done.stdout


# --------------------------------------------------------------------------- Keras' batches
def test_keras_gets_each_batch_on_the_devices_as_its_distribution_splits_it(tmp_path):
    """Under a distribution the batches reach Keras already placed (by the pipeline's background
    thread) as its data layout splits them, and its own placing returns them as they are; strings
    stay numpy; without a distribution, or with several processes, Keras places numpy batches."""
    import threading

    import jax
    import keras

    from tpurun.data.native import keras_input

    files = write_shards(str(tmp_path / "m"), mixed_records(40), 2)
    data = data_config(MIXED, {"pixels": "x", "vec": "vec", "id": "id"}, "label")
    expected = next(iter(native.make_dataset(files, data, 16, training=False)))
    distribution = keras.distribution.DataParallel(devices=keras.distribution.list_devices())
    keras.distribution.set_distribution(distribution)
    placing_threads = []
    device_put = jax.device_put

    def recorded(*args, **kwargs):
        placing_threads.append(threading.current_thread().name)
        return device_put(*args, **kwargs)

    try:
        batches = keras_input.for_keras(native.make_dataset(files, data, 16, training=False))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(jax, "device_put", recorded)
            (x, y), _ = batches[0], batches[1]  # the two batches of 16 in 40 records
    finally:
        keras.distribution.set_distribution(None)
    # Pixels, vec and label of each batch, placed in the pipeline's thread, not the training one.
    assert placing_threads == ["tpurun-input"] * 6
    for placed, want in ((x["pixels"], expected[0]["pixels"]), (x["vec"], expected[0]["vec"]),
                         (y, expected[1])):  # fmt: skip
        sharding = distribution.get_data_layout(placed.shape).backend_layout
        assert isinstance(placed, jax.Array) and placed.sharding == sharding
        assert len(placed.sharding.device_set) == 8
        assert placed.dtype == jax.dtypes.canonicalize_dtype(want.dtype)  # int64: int32, as Keras'
        np.testing.assert_array_equal(np.asarray(placed), want)
        assert jax.make_array_from_process_local_data(sharding, placed) is placed  # Keras' call
    assert isinstance(x["id"], np.ndarray) and x["id"].tolist() == expected[0]["id"].tolist()
    unplaced = keras_input.for_keras(native.make_dataset(files, data, 16, training=False))
    assert isinstance(unplaced[0][0]["pixels"], np.ndarray)
    assert keras_input._placer(distribution) is not None  # one process here
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(jax, "process_count", lambda: 2)
        assert keras_input._placer(distribution) is None


def test_the_threads_placing_batches_are_stopped_before_jax_takes_its_devices_down(tmp_path):
    """At exit JAX's handler clears its backends; the exit handler of the Keras batches runs first
    (registered later) and ends every placing thread, each after the batch in hand."""
    import keras

    from tpurun.data.native import keras_input

    files = write_shards(str(tmp_path / "m"), mixed_records(40), 2)
    data = data_config(MIXED, {"pixels": "x", "vec": "vec"}, "label")
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=keras.distribution.list_devices())
    )
    try:
        endless = keras_input.for_keras(native.make_dataset(files, data, 8, training=True))
        endless[0]  # its thread now places the next batches, then waits for room
        thread = endless._iterator.thread
        closed = keras_input.for_keras(native.make_dataset(files, data, 8, training=True))
        closed[0]
        closing = closed._iterator.thread
        closed.close()  # as the fit's end closes its training stream: the thread may go on a while
    finally:
        keras.distribution.set_distribution(None)
    unplaced = keras_input.for_keras(native.make_dataset(files, data, 8, training=True))
    unplaced[0]
    assert thread.is_alive() and endless in keras_input._PLACING
    assert unplaced not in keras_input._PLACING  # its thread makes numpy batches only
    assert unplaced._iterator.thread not in keras_input._PLACING_THREADS
    keras_input._stop_placing()  # what the exit runs
    assert not thread.is_alive() and not closing.is_alive() and endless._iterator is None
    unplaced.close()


def test_batch_0_asked_for_again_right_after_it_is_that_batch_and_the_stream_reads_on(tmp_path):
    """Keras' first fit takes batch 0 to build the metrics symbolically, then starts over: the
    second request gets batch 0 as it was served, from the same iteration (not the stream read
    afresh, its shuffle buffer filled again), and batch 1 follows it. Asked for later, batch 0
    starts a fresh iteration, with the same batches (validation passes, Keras' evaluate)."""
    from tpurun.data.native import keras_input

    files = write_shards(str(tmp_path / "m"), mixed_records(40), 2)
    data = data_config(MIXED, {"vec": "vec", "f": "f"}, "label", shuffle_buffer=16)
    fresh = native.make_dataset(files, data, 8, training=True, seed=3).iterate()
    want = [flat(next(fresh)) for _ in range(3)]
    fresh.close()
    batches = keras_input.for_keras(native.make_dataset(files, data, 8, training=True, seed=3))
    first = batches[0]
    reading = batches._iterator
    assert batches[0] is first and batches._iterator is reading
    got = [first, batches[1], batches[2]]
    assert batches._iterator is reading  # one iteration served all three
    for mine, theirs in zip(got, want, strict=True):
        for a, b in zip(flat(mine), theirs, strict=True):
            np.testing.assert_array_equal(a, b)
    again = batches[0]  # after batch 2: afresh
    assert batches._iterator is not reading
    reading.thread.join(5)  # closed: it ends after the batch in hand
    assert not reading.thread.is_alive()
    for a, b in zip(flat(again), want[0], strict=True):
        np.testing.assert_array_equal(a, b)
    batches.close()


def test_a_stream_read_ahead_serves_keras_first_request_from_that_reading(tmp_path):
    """``read_ahead`` starts the background reading before Keras asks (the training stream fills
    its shuffle buffer while the model is built); Keras' first request takes that iteration's
    first batch; asked again, nothing new starts."""
    from tpurun.data.native import keras_input

    files = write_shards(str(tmp_path / "m"), mixed_records(40), 2)
    data = data_config(MIXED, {"vec": "vec"}, "label", shuffle_buffer=16)
    want = flat(next(iter(native.make_dataset(files, data, 8, training=True, seed=3))))
    batches = keras_input.for_keras(native.make_dataset(files, data, 8, training=True, seed=3))
    assert batches._iterator is None  # Keras' own first request would start it
    readers.read_ahead(batches)
    reading = batches._iterator
    assert reading is not None and reading.thread.is_alive()
    readers.read_ahead(batches)
    assert batches._iterator is reading
    for a, b in zip(flat(batches[0]), want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert batches._iterator is reading
    readers.close(batches)
    reading.thread.join(5)
    assert not reading.thread.is_alive()


# ------------------------------------------------------------------------ evaluate, predict
def test_evaluate_and_predict_give_the_same_answers_on_either_reader(toy_data, tmp_path):
    """A run's config.yaml says its reader; evaluate and predict read with it. The same
    checkpoint scores the same metrics and writes the same rows, whichever reader."""
    pytest.importorskip("tensorflow")
    import shutil

    import yaml

    import tpurun

    tpurun.train(native_config(toy_data, tmp_path / "runs", epochs=1), verbose=False)
    native_run = tmp_path / "runs" / "toy"
    tf_run = tmp_path / "runs" / "toy-tf"
    shutil.copytree(native_run, tf_run)
    config = yaml.safe_load((tf_run / "config.yaml").read_text())
    assert config["data"]["reader"] == "native"
    config["data"]["reader"] = "tf_data"
    (tf_run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    scores, rows = {}, {}
    for name, run in (("native", native_run), ("tf_data", tf_run)):
        scores[name] = tpurun.evaluate(str(run))
        out = tmp_path / f"{name}.csv"
        tpurun.predict(str(run), str(toy_data / "val-*.tfrecord"), str(out), id_feature="id")
        rows[name] = out.read_text()
    assert scores["native"]["metrics"] == scores["tf_data"]["metrics"]
    assert scores["native"]["records"] == 128 and scores["native"]["padding_records"] == 0
    assert rows["native"] == rows["tf_data"] and rows["native"].count("\n") == 129  # + header


TOKEN_MODEL = """
import keras


def build(vocabulary: int = 500):
    ids = keras.Input((9,), dtype="int32", name="token_ids")
    mask = keras.Input((9,), dtype="float32", name="padding_mask")
    vectors = keras.layers.Embedding(vocabulary, 8)(ids)
    pooled = keras.layers.Dot(axes=1)([vectors, mask]) / keras.ops.sum(mask, axis=1, keepdims=True)
    out = keras.layers.Dense(1, activation="sigmoid")(pooled)
    return keras.Model({"token_ids": ids, "padding_mask": mask}, out)
"""


def test_token_ids_train_on_the_native_reader(tmp_path):
    """Token ids as ``data write --tokenize`` stores them (int64 ids and padding mask), read
    without TensorFlow, feed a factory's model; the label: whether any id is below 100."""
    import tpurun

    records = token_records(256)
    for record in records:
        ids = [t for t, m in zip(record["token_ids"], record["padding_mask"], strict=True) if m]
        record["label"] = int(min(ids) < 100)
    (tmp_path / "data").mkdir()
    write_shards(str(tmp_path / "data" / "train"), records[:192], 3)
    write_shards(str(tmp_path / "data" / "val"), records[192:], 1)
    (tmp_path / "tokens.py").write_text(TOKEN_MODEL)
    config = native_config(tmp_path / "data", tmp_path / "runs", epochs=3, per_core_batch_size=16)
    config["model"] = {"factory": f"{tmp_path / 'tokens.py'}:build", "loss": "binary_crossentropy",
                       "metrics": ["accuracy"], "optimizer": {"name": "adam"}}  # fmt: skip
    config["data"].update(
        features={**{k: {"type": "int64", "shape": [9], "cast": "int32"} for k in TOKENS},
                  "padding_mask": {"type": "int64", "shape": [9], "cast": "float32"},
                  "label": {"type": "int64", "cast": "float32"}},
        inputs={"token_ids": "token_ids", "padding_mask": "padding_mask"}, targets="label",
    )  # fmt: skip
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and summary["epochs_completed"] == 3
    rows = read_log(tmp_path / "runs" / "toy")
    assert [r["epoch"] for r in rows] == ["0", "1", "2"]
    assert float(rows[-1]["loss"]) < float(rows[0]["loss"])


def test_doctor_says_the_reader_and_why():
    from tpurun.doctor.config_checks import check_reader

    check = check_reader(readers.choose("auto", "jax", False))
    assert (check.name, check.status, check.finding) == (
        "reader", "ok", "native (TensorFlow is not installed)",
    )  # fmt: skip
    assert check.data == {"reader": "native", "reason": "TensorFlow is not installed"}
