"""The native pipeline's batch arrays used again (tpurun/data/native/recycle.py): an array comes
back only once nothing holds it, so a batch the consumer keeps is never written over, and a batch
dropped gives its memory to a later one (no fresh pages for each batch)."""

from __future__ import annotations

import io
import threading
import weakref

import numpy as np
import pytest

from tpurun.config import DataConfig
from tpurun.data.native import pipeline as native
from tpurun.data.native.recycle import KEEP, BatchArrays
from tpurun.data.write import write_shards


def test_an_array_comes_back_once_nothing_holds_it_not_before():
    arrays = BatchArrays()
    first = arrays.empty((4, 3), np.float32)
    kept = weakref.ref(first)
    view = first.reshape(12)  # a batch's feature is a view of the array
    del first
    second = arrays.empty((4, 3), np.float32)
    assert second is not kept() and not np.shares_memory(second, view)
    del view
    assert arrays.empty((4, 3), np.float32) is kept()
    # Another shape or dtype is another array.
    assert arrays.empty((4, 3), np.int32) is not kept()
    assert arrays.empty((3, 4), np.float32) is not kept()


def test_at_most_keep_arrays_of_a_kind_are_kept():
    arrays = BatchArrays(keep=2)
    held = [arrays.empty((2,), np.int64) for _ in range(3)]
    refs = [weakref.ref(a) for a in held]
    del held
    assert refs[2]() is None  # the third was not kept
    again = [arrays.empty((2,), np.int64) for _ in range(3)]
    assert again[0] is refs[0]() and again[1] is refs[1]()
    assert all(a is not r() for a in again[2:] for r in refs[:2])


def test_a_cast_is_a_copy_with_astypes_values():
    arrays = BatchArrays()
    values = np.array([[1, -2, 2**40], [7, 0, -(2**35)]], np.int64)
    same = arrays.cast(values, np.int64)
    assert same is not values and not np.shares_memory(same, values)
    np.testing.assert_array_equal(same, values)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(arrays.cast(values, np.int32), values.astype(np.int32))
        np.testing.assert_array_equal(arrays.cast(values, bool), values.astype(bool))


def test_each_thread_has_arrays_of_its_own():
    arrays = BatchArrays()
    mine = weakref.ref(arrays.empty((5,), np.uint8))  # dropped at once: free in this thread
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(arrays.empty((5,), np.uint8)))
    thread.start()
    thread.join()
    assert theirs[0] is not mine()
    assert arrays.empty((5,), np.uint8) is mine()


# ------------------------------------------------------------------------------ in the pipeline
def _pixels(rng: np.random.Generator) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (6, 6, 3), np.uint8)).save(out, "PNG")
    return out.getvalue()


def _records(kind: str, n: int) -> tuple[list[dict], dict, str, str]:
    """Records that take each path of the parser: a fixed layout (raw floats), varying lengths
    (token ids: int64 lists of several bytes, cast), and images."""
    rng = np.random.default_rng(0)
    if kind == "raw":
        records = [{"x": rng.random(8, dtype=np.float32).tobytes(), "y": i} for i in range(n)]
        features = {"x": {"type": "raw", "dtype": "float32", "shape": [8]},
                    "y": {"type": "int64", "cast": "int32"}}  # fmt: skip
        return records, features, "x", "y"
    if kind == "tokens":
        records = [{"ids": rng.integers(0, 30_000, 6).tolist(), "y": i} for i in range(n)]
        features = {"ids": {"type": "int64", "shape": [6], "cast": "int32"},
                    "y": {"type": "int64"}}  # fmt: skip
        return records, features, "ids", "y"
    records = [{"image": _pixels(rng), "y": i} for i in range(n)]
    return (
        records,
        {"image": {"type": "image", "shape": [6, 6, 3]}, "y": {"type": "int64"}},
        "image",
        "y",
    )


def _pipeline(tmp_path, kind: str) -> native.Batches:
    records, features, inputs, targets = _records(kind, 64)
    files = write_shards(str(tmp_path / kind), records, 4)
    data = DataConfig.model_validate(
        {
            "train": files,
            "features": features,
            "inputs": inputs,
            "targets": targets,
            "shuffle_buffer": 16,
        }  # fmt: skip
    )
    return native.make_dataset(files, data, 8, training=True, seed=3)


def _owner(array: np.ndarray) -> np.ndarray:
    return array if array.base is None else array.base


@pytest.mark.parametrize("kind", ["raw", "tokens", "images"])
def test_batches_kept_by_the_consumer_are_never_written_over(tmp_path, kind):
    """Three times more batches than the pipeline keeps arrays for, every one held: each still
    holds what it held when it came."""
    iterator = iter(_pipeline(tmp_path, kind))
    held, copies = [], []
    for _ in range(3 * KEEP):
        batch = next(iterator)
        held.append(batch)
        copies.append([a.copy() for a in batch])
    iterator.close()
    for batch, copy in zip(held, copies, strict=True):
        for array, was in zip(batch, copy, strict=True):
            np.testing.assert_array_equal(array, was)
    # And the held batches' features are all distinct arrays.
    owners = [id(_owner(batch[0])) for batch in held]
    assert len(set(owners)) == len(owners)


@pytest.mark.parametrize("kind", ["raw", "tokens", "images"])
def test_batches_dropped_as_read_give_their_memory_to_later_ones(tmp_path, kind):
    """40 batches read and dropped: the inputs of every one lie in at most KEEP arrays, all
    still alive (kept for use again), where fresh ones would have been freed."""
    iterator = iter(_pipeline(tmp_path, kind))
    refs = []
    for _ in range(40):
        batch = next(iterator)
        refs.append(weakref.ref(_owner(batch[0])))
        del batch
    owners = [ref() for ref in refs]
    iterator.close()
    assert all(owner is not None for owner in owners)
    distinct = {id(owner) for owner in owners}
    assert len(distinct) <= KEEP, len(distinct)
