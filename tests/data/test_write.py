"""``write_dataset``: every source kind written to real shards, read back by tpurun's pipeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf
from helpers import make_image_folder

from tpurun.config import DataConfig
from tpurun.data import pipeline, records, write
from tpurun.data import schema_file as schema
from tpurun.data.sources import Source
from tpurun.data.write import balanced_sizes, shard_count, write_dataset
from tpurun.errors import DataError, TpurunError


def read_back(report, split: str = "all") -> dict[str, np.ndarray]:
    """Every record of a split, decoded with the features from the schema file."""
    written = schema.read(report.schema_path)
    files = [path for path, _, _ in report.splits[split]]
    features = written["features"]
    data = DataConfig.model_validate(
        {
            "train": "unused",
            "features": features,
            "inputs": {name: name for name in features},
            "targets": next(iter(features)),
            "compression": written["compression"],
        }
    )
    total = records.count_records(files, written["compression"])
    assert total == written["splits"][split]["records"]
    x, _ = next(iter(pipeline.make_dataset(files, data, total, training=False)))
    return {name: value.numpy() for name, value in x.items()}


def by_id(columns: dict[str, np.ndarray], key: str = "id") -> dict[str, np.ndarray]:
    """Records in the order of their ``key`` (the pipeline interleaves the shards)."""
    order = np.argsort(columns[key], kind="stable")
    return {name: value[order] for name, value in columns.items()}


def tfrecords(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tfrecord"))


# -------------------------------------------------------------------------------------- sources
@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_npz_round_trip(tmp_path, save):
    n = 20
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 2, 3)).astype(np.float32)
    mask = rng.integers(0, 2, size=(n, 4)).astype(bool)
    names = np.array([f"rec{i}" for i in range(n)])
    weight = rng.uniform(size=n)  # float64 scalars: stored as float (float32)
    columns = np.asfortranarray(x.reshape(n, 6))  # saved column by column: read whole
    save(tmp_path / "d.npz", x=x, mask=mask, id=np.arange(n), name=names, weight=weight, f=columns)

    report = write_dataset(str(tmp_path / "d.npz"), str(tmp_path / "out" / "d"), chunk_records=6)

    assert report.features == {
        "x": {"type": "raw", "dtype": "float32", "shape": [2, 3]},
        "mask": {"type": "raw", "dtype": "uint8", "shape": [4]},
        "id": {"type": "int64", "shape": []},
        "name": {"type": "bytes", "shape": []},
        "weight": {"type": "float", "shape": []},
        "f": {"type": "raw", "dtype": "float32", "shape": [6]},
    }
    got = by_id(read_back(report))
    np.testing.assert_array_equal(got["f"], columns)
    np.testing.assert_array_equal(got["x"], x)
    np.testing.assert_array_equal(got["mask"], mask.astype(np.uint8))
    assert got["id"].tolist() == list(range(n))
    assert got["name"].tolist() == [s.encode() for s in names]
    np.testing.assert_allclose(got["weight"], weight, rtol=1e-6)


def test_npy_folder_and_single_npy(tmp_path):
    n = 16
    (tmp_path / "arrays").mkdir()
    pixels = np.arange(n * 4, dtype=np.uint8).reshape(n, 4)
    big_endian = np.arange(n * 2, dtype=">i4").reshape(n, 2)  # decode_raw reads little-endian
    np.save(tmp_path / "arrays" / "pixels.npy", pixels)
    np.save(tmp_path / "arrays" / "counts.npy", big_endian)
    np.save(tmp_path / "arrays" / "id.npy", np.arange(n))

    done = []
    report = write_dataset(
        str(tmp_path / "arrays"),
        str(tmp_path / "a"),
        chunk_records=5,
        progress=lambda records, total: done.append(records),
    )
    assert done == [5, 10, 15, 16]  # the memory-mapped arrays are read 5 records at a time
    assert report.features["counts"] == {"type": "raw", "dtype": "int32", "shape": [2]}
    got = by_id(read_back(report))
    np.testing.assert_array_equal(got["pixels"], pixels)
    np.testing.assert_array_equal(got["counts"], big_endian.astype("<i4"))

    np.save(tmp_path / "embedding.npy", np.ones((n, 8), np.float16))
    single = write_dataset(str(tmp_path / "embedding.npy"), str(tmp_path / "e"))
    assert single.features == {"embedding": {"type": "raw", "dtype": "float16", "shape": [8]}}
    assert read_back(single)["embedding"].shape == (n, 8)


def test_csv_glob_infers_int_float_and_string_columns(tmp_path):
    header = "id,score,city,ratio\n"
    (tmp_path / "a.csv").write_text(header + "0,1.5,Oslo,3\n1,-2,Lima,\n2,3e2,Rome,4\n")
    (tmp_path / "b.csv").write_text(header + '3,0.25,"Kyiv, UA",5\n\n4,7,10,6\n')

    with pytest.raises(DataError, match=r"missing values .* in 1 column\(s\): 'ratio' \(1 row\)"):
        write_dataset(str(tmp_path / "*.csv"), str(tmp_path / "out" / "c"))
    report = write_dataset(
        str(tmp_path / "*.csv"), str(tmp_path / "out" / "c"), chunk_records=2, fill_missing=-1
    )

    assert report.features == {
        "id": {"type": "int64", "shape": []},
        "score": {"type": "float", "shape": []},
        "city": {"type": "text"},
        "ratio": {"type": "int64", "shape": []},  # an integer fill keeps integers
    }
    got = by_id(read_back(report))
    assert got["id"].tolist() == [0, 1, 2, 3, 4]
    assert got["score"].tolist() == [1.5, -2.0, 300.0, 0.25, 7.0]
    assert got["city"].tolist() == [b"Oslo", b"Lima", b"Rome", b"Kyiv, UA", b"10"]
    assert got["ratio"].tolist() == [3, -1, 4, 5, 6]


def test_image_folder_kept_as_is(tmp_path):
    make_image_folder(tmp_path / "pets")
    report = write_dataset(str(tmp_path / "pets"), str(tmp_path / "p"), chunk_records=4)

    assert report.class_names == ["cat", "dog"]
    assert report.features == {
        "image": {"type": "image", "shape": [8, 6, 3]},  # the first image's size
        "label": {"type": "int64", "shape": []},
    }
    assert schema.read(report.schema_path)["class_names"] == ["cat", "dog"]
    got = read_back(report)
    assert got["image"].shape == (6, 8, 6, 3)
    brightness = got["image"].mean(axis=(1, 2, 3))
    assert sorted(got["label"].tolist()) == [0, 0, 0, 1, 1, 1]
    assert ((brightness > 0.5) == (got["label"] == 1)).all()
    # The JPEG bytes are the files' own, not re-encoded.
    files = [path for path, _, _ in report.splits["all"]]
    stored = {
        tf.train.Example.FromString(r.numpy()).features.feature["image"].bytes_list.value[0]
        for r in tf.data.TFRecordDataset(files)
    }
    assert (tmp_path / "pets" / "dog" / "0.jpg").read_bytes() in stored


def test_image_folder_resized(tmp_path):
    make_image_folder(tmp_path / "pets")
    report = write_dataset(str(tmp_path / "pets"), str(tmp_path / "p"), image_size=(4, 5))

    assert report.features["image"] == {"type": "image", "shape": [4, 5, 3]}
    files = [path for path, _, _ in report.splits["all"]]
    formats = []
    for record in tf.data.TFRecordDataset(files):
        feature = tf.train.Example.FromString(record.numpy()).features.feature
        encoded = feature["image"].bytes_list.value[0]
        assert tf.io.decode_image(encoded).shape == (4, 5, 3)
        formats.append((encoded[:2] == b"\xff\xd8", feature["label"].int64_list.value[0]))
    assert sorted(formats) == [(False, 0)] * 3 + [(True, 1)] * 3  # PNGs stay PNG, JPEGs JPEG
    assert read_back(report)["image"].shape == (6, 4, 5, 3)


BAD_SOURCES = {
    "missing.npz": "no such file or folder; expected a .npz file",
    "notes.txt": "not a kind of source tpurun can write",
    "empty": "the folder holds no .npy file and no subfolder",
    "no-images": r"no \.jpg, \.jpeg or \.png file in its subfolders \(cat\)",
    "scalar.npy": "a single value, not an array of records",
    "ragged.npz": r"different numbers of records \(a: 3, b: 4\)",
    "complex.npy": "arrays of dtype complex128 cannot be written",
    "header-only.csv": "the CSV holds a header but no row",
    "ragged.csv": r"ragged\.csv:3: 3 values, but the header has 2 columns",
    "*.tsv": "no file matches this path",
    "gs://bucket/x.npz": "sources are read from local files",
}


def make_bad_source(folder, name: str) -> str:
    path = folder / name
    if name == "notes.txt":
        path.write_text("hello")
    elif name == "empty":
        path.mkdir()
    elif name == "no-images":
        (path / "cat").mkdir(parents=True)
        (path / "cat" / "notes.txt").write_text("hello")
    elif name == "scalar.npy":
        np.save(path, np.float32(1))
    elif name == "ragged.npz":
        np.savez(path, a=np.zeros(3), b=np.zeros(4))
    elif name == "complex.npy":
        np.save(path, np.zeros((3, 2), complex))
    elif name.endswith(".csv"):
        path.write_text("a,b\n" if name == "header-only.csv" else "a,b\n1,2\n1,2,3\n")
    return name if "://" in name else str(path)


@pytest.mark.parametrize("name", list(BAD_SOURCES))
def test_sources_that_cannot_be_written_are_named(tmp_path, name):
    path = make_bad_source(tmp_path, name)
    with pytest.raises(DataError, match=BAD_SOURCES[name]) as info:
        write_dataset(path, str(tmp_path / "out"))
    assert str(info.value).startswith(path)
    assert not list(tmp_path.glob("out*"))


def test_image_size_is_only_for_image_folders(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((4, 2)))
    with pytest.raises(DataError, match=r"image_size=\(8, 8\) resizes images"):
        write_dataset(str(tmp_path / "x.npy"), str(tmp_path / "o"), image_size=(8, 8))


# ------------------------------------------------------------------------------- shards, splits
def test_shard_count_and_sizes():
    assert shard_count(10_000, 100 * 10**6, 150, 8) == 8  # small data: still 8 shards
    assert shard_count(10_000, 2000 * 10**6, 150, 8) == 16  # 14 wanted, rounded up to 16
    assert shard_count(12, 10**12, 150, 8) == 8  # never more shards than records allow
    assert shard_count(5, 100, 150, 8) == 1  # fewer records than the multiple: one shard
    assert shard_count(100, 10**9, 150, 1) == 7
    sizes = balanced_sizes(21, 8)
    assert sum(sizes) == 21 and sorted(set(sizes)) == [2, 3]


def test_shards_are_a_multiple_of_8_and_balanced(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((203, 250), np.float32))  # 0.2 MB of records
    default = write_dataset(str(tmp_path / "x.npy"), str(tmp_path / "a"))
    tiny = write_dataset(str(tmp_path / "x.npy"), str(tmp_path / "b"), shard_mb=0.01)

    assert len(default.splits["all"]) == 8
    assert len(tiny.splits["all"]) == 24  # 21 wanted
    for report in (default, tiny):
        counts = [n for _, n, _ in report.splits["all"]]
        assert sum(counts) == 203 and max(counts) - min(counts) <= 1
    assert tfrecords(tmp_path)[-1] == "b-00023-of-00024.tfrecord"
    assert all(size > 0 for _, _, size in tiny.splits["all"])


def test_chunks_hold_at_most_chunk_bytes(tmp_path, monkeypatch):
    np.save(tmp_path / "x.npy", np.zeros((10, 250), np.float32))  # 1012 bytes a record
    monkeypatch.setattr(write, "CHUNK_BYTES", 4000)
    done = []
    write_dataset(
        str(tmp_path / "x.npy"), str(tmp_path / "x"), progress=lambda d, _: done.append(d)
    )
    assert done == [3, 6, 9, 10]


def test_a_prefix_without_folder_writes_in_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save("id.npy", np.arange(16))
    write_dataset("id.npy", "d", shard_multiple=16)
    report = write_dataset("id.npy", "d", overwrite=True)
    assert [path for path, _, _ in report.splits["all"]][:1] == ["d-00000-of-00008.tfrecord"]
    assert tfrecords(tmp_path) == [f"d-{i:05d}-of-00008.tfrecord" for i in range(8)]
    assert by_id(read_back(report))["id"].tolist() == list(range(16))


def test_validation_split_is_seeded_disjoint_and_complete(tmp_path):
    np.save(tmp_path / "id.npy", np.arange(100))

    def split(prefix, seed, fraction=0.2):
        report = write_dataset(
            str(tmp_path / "id.npy"),
            str(tmp_path / prefix),
            validation_fraction=fraction,
            seed=seed,
        )
        return {s: set(read_back(report, s)["id"].tolist()) for s in ("train", "validation")}

    first = split("a", seed=1)
    assert len(first["validation"]) == 20 and len(first["train"]) == 80
    assert first["train"] | first["validation"] == set(range(100))
    assert split("b", seed=1) == first
    assert split("c", seed=2)["validation"] != first["validation"]
    assert len(split("d", seed=0, fraction=0.001)["validation"]) == 1  # at least one
    assert tfrecords(tmp_path)[0] == "a-train-00000-of-00008.tfrecord"
    assert "a-validation-00007-of-00008.tfrecord" in tfrecords(tmp_path)
    with pytest.raises(DataError, match="leaves no training record"):
        write_dataset(str(tmp_path / "id.npy"), str(tmp_path / "e"), validation_fraction=0.999)


def test_gzip_and_the_schema_file(tmp_path):
    np.savez(tmp_path / "d.npz", id=np.arange(30), x=np.ones((30, 3), np.float32))
    calls = []
    report = write_dataset(
        str(tmp_path / "d.npz"),
        str(tmp_path / "g"),
        compression="gzip",
        validation_fraction=0.1,
        chunk_records=8,
        progress=lambda done, total: calls.append((done, total)),
    )

    assert calls == [(8, 30), (16, 30), (24, 30), (30, 30)]
    written = json.loads((tmp_path / "g.schema.json").read_text())
    assert written["compression"] == "gzip" and written["source"] == str(tmp_path / "d.npz")
    assert written["features"] == report.features and written["class_names"] is None
    validation_shard = tmp_path / "g-validation-00000-of-00001.tfrecord"
    assert written["splits"]["validation"] == {
        "records": 3,
        "shards": {validation_shard.name: 3},
        "shard_bytes": {validation_shard.name: validation_shard.stat().st_size},
    }
    assert written["splits"]["train"]["records"] == 27
    assert sorted(written["splits"]["train"]["shards"].values()) == [3, 3, 3, 3, 3, 4, 4, 4]
    with open(report.splits["train"][0][0], "rb") as f:
        assert f.read(2) == b"\x1f\x8b"  # gzip's magic bytes
    ids = [*read_back(report, "train")["id"], *read_back(report, "validation")["id"]]
    assert sorted(ids) == list(range(30))
    # tpurun train finds the counts through the schema file.
    shard = report.splits["train"][0][0]
    assert schema.record_count(schema.find_for([shard])[shard][1], shard) == 3
    assert json.loads(json.dumps(report.to_dict()))["splits"]["validation"][0]["records"] == 3


def test_remote_ram_output(tmp_path):
    np.save(tmp_path / "id.npy", np.arange(40))
    prefix = f"ram://tpurun-write-{tmp_path.name}/sub/d"
    write_dataset(str(tmp_path / "id.npy"), prefix)  # the second write replaces the first
    report = write_dataset(
        str(tmp_path / "id.npy"), prefix, validation_fraction=0.25, overwrite=True
    )

    # ram:// is this process's memory (fsspec's), which TensorFlow's gfile and tf.data do not see:
    # listed and read back through tpurun's own file operations and TFRecord reader.
    from tpurun.data.native.example import parse
    from tpurun.data.native.framing import iter_records
    from tpurun.storage import fileio

    listed = [fileio.basename(p) for p in fileio.glob(f"ram://tpurun-write-{tmp_path.name}/sub/*")]
    assert sorted(listed) == [
        *(f"d-train-{i:05d}-of-00008.tfrecord" for i in range(8)),
        *(f"d-validation-{i:05d}-of-00008.tfrecord" for i in range(8)),
        "d.schema.json",
    ]
    compression = schema.read(report.schema_path)["compression"]
    ids = [
        parse(record).features.feature["id"].int64_list.value[0]
        for split in ("train", "validation")
        for path, _, _ in report.splits[split]
        for record in iter_records(path, compression)
    ]
    assert sorted(ids) == list(range(40))


# ------------------------------------------------------------------------------------ atomicity
class FailingSource(Source):
    """Yields one chunk, then fails as a broken disk or a bad file would."""

    path, records, nbytes = "failing", 40, 400
    features = {"id": {"type": "int64", "shape": []}}

    def chunks(self, size):
        yield {"id": np.arange(size)}
        raise RuntimeError("the disk went away")


class ChangingSource(Source):
    """Counts 10 records, then yields ``yields`` of them, as a file edited meanwhile would."""

    path, records, nbytes = "changing.csv", 10, 100
    features = {"id": {"type": "int64", "shape": []}}

    def __init__(self, yields: int):
        self.yields = yields

    def chunks(self, size):
        yield {"id": np.arange(self.yields)}


@pytest.mark.parametrize(
    ("yields", "message"), [(4, "4 records, not the 10 counted"), (12, "more than the 10")]
)
def test_a_source_that_changes_during_the_write_is_an_error(tmp_path, yields, message):
    with pytest.raises(DataError, match=f"changing.csv: {message}.*did the source change"):
        write_dataset(ChangingSource(yields), str(tmp_path / "d"))
    assert list(tmp_path.iterdir()) == []


def interrupt_after_first_chunk(done, total):
    raise KeyboardInterrupt


@pytest.mark.parametrize("how", ["source error", "Ctrl-C"])
def test_an_interrupted_write_leaves_the_previous_dataset_intact(tmp_path, how):
    np.save(tmp_path / "id.npy", np.arange(40))
    out = tmp_path / "out"
    write_dataset(str(tmp_path / "id.npy"), str(out / "d"), shard_multiple=4)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(before) == 5  # 4 shards and the schema

    with pytest.raises(RuntimeError if how == "source error" else KeyboardInterrupt):
        if how == "source error":
            write_dataset(FailingSource(), str(out / "d"), chunk_records=10, overwrite=True)
        else:
            write_dataset(
                str(tmp_path / "id.npy"),
                str(out / "d"),
                validation_fraction=0.5,
                chunk_records=10,
                progress=interrupt_after_first_chunk,
                overwrite=True,
            )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no partial file either

    with pytest.raises(KeyboardInterrupt):  # with no earlier dataset: nothing at all
        write_dataset(
            str(tmp_path / "id.npy"),
            str(tmp_path / "new" / "d"),
            chunk_records=10,
            progress=interrupt_after_first_chunk,
        )
    assert list((tmp_path / "new").iterdir()) == []


def test_a_new_write_replaces_old_shards_and_stale_partial_files(tmp_path):
    np.save(tmp_path / "id.npy", np.arange(64))
    out = tmp_path / "out"
    write_dataset(str(tmp_path / "id.npy"), str(out / "d"), shard_multiple=16)
    (out / ".d-00003-of-00008.tfrecord.partial").write_bytes(b"left by a killed write")
    (out / "d2-00000-of-00001.tfrecord").write_bytes(b"another prefix: kept")

    report = write_dataset(
        str(tmp_path / "id.npy"), str(out / "d"), validation_fraction=0.25, overwrite=True
    )

    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        [f"d-train-{i:05d}-of-00008.tfrecord" for i in range(8)]
        + [f"d-validation-{i:05d}-of-00008.tfrecord" for i in range(8)]
        + ["d.schema.json", "d2-00000-of-00001.tfrecord"]
    )
    assert set(schema.read(report.schema_path)["splits"]) == {"train", "validation"}


def test_options_out_of_range_are_named(tmp_path):
    np.save(tmp_path / "id.npy", np.arange(4))
    for option, value in [
        ("shard_mb", 0),
        ("shard_multiple", 0),
        ("compression", "zip"),
        ("validation_fraction", 1.0),
        ("chunk_records", 0),
        ("image_size", (0, 4)),
    ]:
        with pytest.raises(TpurunError, match=f"Invalid option {option}="):
            write_dataset(str(tmp_path / "id.npy"), str(tmp_path / "o"), **{option: value})
    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(DataError, match="file/d: cannot write the shards there"):
        write_dataset(str(tmp_path / "id.npy"), str(tmp_path / "file" / "d"))
