"""Writing ``tf.train.Example`` records: used by the example data generators and the tests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def example_bytes(record: Mapping[str, Any]) -> bytes:
    """Serialize one record.

    ``bytes``/``str`` (or lists of them) become a bytes_list; integer values or arrays become an
    int64_list; float values or arrays become a float_list. Encode a ``raw`` feature yourself with
    ``array.astype(dtype).tobytes()``.
    """
    import numpy as np
    import tensorflow as tf

    feature = {}
    for key, value in record.items():
        if isinstance(value, str):
            value = value.encode()
        if isinstance(value, bytes):
            feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
            continue
        array = np.asarray(value)
        if array.dtype.kind in "SUO":
            items = [v.encode() if isinstance(v, str) else bytes(v) for v in array.ravel().tolist()]
            feature[key] = tf.train.Feature(bytes_list=tf.train.BytesList(value=items))
        elif array.dtype.kind in "iub":
            ints = array.astype(np.int64).ravel()
            feature[key] = tf.train.Feature(int64_list=tf.train.Int64List(value=ints))
        elif array.dtype.kind == "f":
            floats = array.astype(np.float32).ravel()
            feature[key] = tf.train.Feature(float_list=tf.train.FloatList(value=floats))
        else:
            raise TypeError(f"record key {key!r}: cannot store a value of dtype {array.dtype}")
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def write_shards(
    prefix: str, records: Iterable[Mapping[str, Any]], num_shards: int, compression: str = "none"
) -> list[str]:
    """Write records round-robin into ``<prefix>-00000-of-0000N.tfrecord`` shards.

    Returns:
        The shard paths, in order.
    """
    import tensorflow as tf

    paths = [f"{prefix}-{i:05d}-of-{num_shards:05d}.tfrecord" for i in range(num_shards)]
    options = tf.io.TFRecordOptions(compression_type="GZIP" if compression == "gzip" else "")
    writers = [tf.io.TFRecordWriter(p, options) for p in paths]
    try:
        for i, record in enumerate(records):
            writers[i % num_shards].write(example_bytes(record))
    finally:
        for w in writers:
            w.close()
    return paths
