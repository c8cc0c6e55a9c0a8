"""Feature specs: how each record key is parsed (a whole batch at a time) and decoded.

The config's feature types map onto ``tf.train.Example`` as the Kaggle TPU recipes and Kaggle's public TFRecord
datasets lay them out:

==========  =====================  ====================================================
type        stored as              decoded to
==========  =====================  ====================================================
raw         one bytes value        ``decode_raw(dtype)`` reshaped to ``shape``, then ``cast``
int64       int64_list             ``shape`` (``[]`` for a scalar), then ``cast``
float       float_list             ``shape``, then ``cast``
bytes       bytes_list             strings of ``shape``
text        one UTF-8 bytes value  a scalar string (``(batch,)`` batched), for a tokenizer
image       one JPEG/PNG value     ``[H, W, C]`` resized, scaled to [0, 1] unless ``scale: false``
category    one UTF-8 bytes value  its id (int32) or one-hot vector (float32): :mod:`.categories`
==========  =====================  ====================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tpurun import frameworks
from tpurun.config import (
    BytesFeature,
    CategoryFeature,
    DataConfig,
    FeatureOptions,
    FloatFeature,
    ImageFeature,
    Int64Feature,
    RawFeature,
    TextFeature,
)
from tpurun.data import categories
from tpurun.errors import DataError

_ITEMSIZE = {
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8,
    "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2,
}  # fmt: skip


def image_format(data: bytes) -> str | None:
    """``jpeg`` or ``png`` by their magic bytes (what ``data write`` stores and ``inspect`` finds)."""
    if data[:2] == b"\xff\xd8":
        return "jpeg"
    if data[:4] == b"\x89PNG":
        return "png"
    return None


def record_key(name: str, feature: Any) -> str:
    return feature.key or name


def parse_spec(features: Mapping[str, Any]) -> dict[str, Any]:
    """The ``tf.io.parse_example`` spec, keyed by record key."""
    tf = frameworks.tensorflow()
    spec = {}
    for name, f in features.items():
        if isinstance(f, (RawFeature, ImageFeature, TextFeature, CategoryFeature)):
            spec[record_key(name, f)] = tf.io.FixedLenFeature([], tf.string)
        elif isinstance(f, Int64Feature):
            spec[record_key(name, f)] = tf.io.FixedLenFeature(f.shape, tf.int64)
        elif isinstance(f, FloatFeature):
            spec[record_key(name, f)] = tf.io.FixedLenFeature(f.shape, tf.float32)
        elif isinstance(f, BytesFeature):
            spec[record_key(name, f)] = tf.io.FixedLenFeature(f.shape, tf.string)
    return spec


def _decode_image(encoded, f: ImageFeature):
    tf = frameworks.tensorflow()
    height, width, channels = f.shape
    image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
    image.set_shape([None, None, channels])
    image = tf.image.resize(image, [height, width])  # float32; a no-op copy when already sized
    return image / 255.0 if f.scale else image


def decode_batch(
    parsed: Mapping[str, Any], features: Mapping[str, Any], tables: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Turn a parsed batch (keyed by record key) into decoded tensors keyed by feature name.

    Args:
        tables: each category feature's lookup table (:func:`categories.tf_tables`, made outside
            the ``tf.data`` function that calls this); made here when None.
    """
    tf = frameworks.tensorflow()
    if tables is None:
        tables = categories.tf_tables(features)
    out = {}
    for name, f in features.items():
        value = parsed[record_key(name, f)]
        if isinstance(f, CategoryFeature):
            value = categories.encode_tf(value, f, tables[name])
        elif isinstance(f, RawFeature):
            value = tf.io.decode_raw(value, tf.dtypes.as_dtype(f.dtype))
            value = tf.reshape(value, [-1, *f.shape])
        elif isinstance(f, ImageFeature):
            value = tf.map_fn(
                lambda e, f=f: _decode_image(e, f),
                value,
                fn_output_signature=tf.TensorSpec(f.shape, tf.float32),
                parallel_iterations=16,
            )
        cast = getattr(f, "cast", None)
        if cast is not None:
            value = tf.cast(value, tf.dtypes.as_dtype(cast))
        out[name] = value
    return out


def select(decoded: Mapping[str, Any], ref: Any) -> Any:
    """Pick the model's inputs or targets out of the decoded features (see ``data.inputs``)."""
    if isinstance(ref, str):
        return decoded[ref]
    if isinstance(ref, dict):
        return {key: decoded[name] for key, name in ref.items()}
    return tuple(decoded[name] for name in ref)


def used_features(data: DataConfig) -> dict[str, Any]:
    """Only the features the model consumes are parsed; others in the record cost nothing."""
    wanted = set(DataConfig.names(data.inputs)) | set(DataConfig.names(data.targets))
    return {name: f for name, f in data.features.items() if name in wanted}


# ------------------------------------------------------------------ checking a record against specs
def check_record(serialized: bytes, features: Mapping[str, Any], filename: str) -> None:
    """Compare one serialized ``tf.train.Example`` with the declared features.

    Raises:
        DataError: naming the feature, the file, what was declared and what the record holds.
    """
    from tpurun.data.native import example as examples  # lazy: protobuf, to the first check

    try:
        example = examples.parse(serialized)
    except Exception:  # protobuf raises its own DecodeError type
        raise DataError(
            f"{filename}: the first record is not a tf.train.Example; tpurun reads Examples "
            "(SequenceExample and raw tensors are not supported)."
        ) from None
    stored = example.features.feature
    for name, f in features.items():
        key = record_key(name, f)
        if key not in stored:
            present = ", ".join(sorted(stored)) or "(none)"
            raise DataError(
                f"{filename}: feature '{name}' (record key '{key}') is not in the records; "
                f"they hold: {present}."
            )
        if isinstance(f, FeatureOptions):
            continue  # options without a type (resolved against the schema file later)
        kind = stored[key].WhichOneof("kind")
        values = getattr(stored[key], kind).value if kind else []
        problem = _mismatch(f, kind, values)
        if problem:
            raise DataError(f"{filename}: feature '{name}' is declared {_declared(f)}, {problem}.")


def _declared(f: Any) -> str:
    if isinstance(f, RawFeature):
        return f"raw {f.dtype} of shape {f.shape}"
    if isinstance(f, TextFeature):
        return "text (one UTF-8 string)"
    if isinstance(f, CategoryFeature):
        return "category (one UTF-8 string)"
    return f"{f.type} of shape {f.shape}"


_KIND_TO_TYPE = {"bytes_list": "bytes", "int64_list": "int64", "float_list": "float"}


def _mismatch(f: Any, kind: str | None, values: Any) -> str | None:
    found = _KIND_TO_TYPE.get(kind or "", "empty")
    if isinstance(f, (TextFeature, CategoryFeature)):
        if found != "bytes" or len(values) != 1:
            text = (
                " (a numeric column becomes one with `tpurun data write ... --text COLUMN`)"
                if isinstance(f, CategoryFeature) and found != "bytes"
                else ""
            )
            return f"but the record holds {len(values)} {found} value(s); expected one string{text}"
        try:
            values[0].decode("utf-8")
        except UnicodeDecodeError as exc:
            return f"but its bytes are not UTF-8 text (byte {exc.start}); declare it bytes"
        return None
    if isinstance(f, (RawFeature, ImageFeature)):
        if found != "bytes" or len(values) != 1:
            return f"but the record holds {len(values)} {found} value(s); expected one bytes value"
        if isinstance(f, RawFeature):
            size = _ITEMSIZE[f.dtype] * math.prod(f.shape)
            if len(values[0]) != size:
                return (
                    f"which is {size} bytes, but the record holds {len(values[0])} bytes "
                    f"({len(values[0]) / _ITEMSIZE[f.dtype]:g} {f.dtype} values)"
                )
        elif image_format(values[0]) is None and values[0][:3] != b"GIF" and values[0][:2] != b"BM":
            return "but the bytes are not a JPEG, PNG, GIF or BMP image"
        return None
    if found != f.type:
        return f"but the record holds {found} values"
    expected = math.prod(f.shape)
    if len(values) != expected:
        return f"but the record holds {len(values)} values (the shape needs {expected})"
    return None


def decoded_dtype(feature: Any) -> str:
    """The dtype a feature has once decoded, as the model receives it."""
    cast = getattr(feature, "cast", None)
    if cast:
        return cast
    if isinstance(feature, CategoryFeature):
        return "int32" if feature.encode == "index" else "float32"
    return {
        "raw": getattr(feature, "dtype", "float32"),
        "int64": "int64",
        "float": "float32",
        "bytes": "string",
        "text": "string",
        "image": "float32",
    }[feature.type]
