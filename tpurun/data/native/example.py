"""``tf.train.Example`` and its parts, defined here from the public schema, without TensorFlow.

The messages are those of TensorFlow's ``tensorflow/core/example/example.proto`` and
``feature.proto`` (proto3, package ``tensorflow``), declared field by field with the same
numbers and packing, and built at import through protobuf's descriptor API: no protoc step and no
TensorFlow generated code. They live in a descriptor pool of their own, so they never clash with
TensorFlow's when both are loaded, and their bytes are the same on the wire.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_FIELD = descriptor_pb2.FieldDescriptorProto


def _field(
    name: str,
    number: int,
    kind: int,
    *,
    repeated: bool = False,
    type_name: str = "",
    oneof: int | None = None,
    packed: bool = False,
) -> descriptor_pb2.FieldDescriptorProto:
    field = _FIELD(name=name, number=number, type=kind, json_name=name)
    field.label = _FIELD.LABEL_REPEATED if repeated else _FIELD.LABEL_OPTIONAL
    if type_name:
        field.type_name = type_name
    if oneof is not None:
        field.oneof_index = oneof
    if packed:
        field.options.packed = True
    return field


def _schema() -> descriptor_pb2.FileDescriptorProto:
    """feature.proto and example.proto in one file: the messages ``tf.train.Example`` needs."""
    schema = descriptor_pb2.FileDescriptorProto(
        name="tpurun/data/native/example.proto", package="tensorflow", syntax="proto3"
    )
    lists = (("BytesList", _FIELD.TYPE_BYTES, False), ("FloatList", _FIELD.TYPE_FLOAT, True),
             ("Int64List", _FIELD.TYPE_INT64, True))  # fmt: skip
    for name, kind, packed in lists:
        message = schema.message_type.add(name=name)
        message.field.append(_field("value", 1, kind, repeated=True, packed=packed))
    feature = schema.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, _, _) in enumerate(lists, start=1):
        list_field = name[0].lower() + name[1:-4] + "_list"  # bytes_list, float_list, int64_list
        feature.field.append(
            _field(
                list_field, number, _FIELD.TYPE_MESSAGE, type_name=f".tensorflow.{name}", oneof=0
            )
        )
    features = schema.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.append(_field("key", 1, _FIELD.TYPE_STRING))
    entry.field.append(_field("value", 2, _FIELD.TYPE_MESSAGE, type_name=".tensorflow.Feature"))
    features.field.append(
        _field(
            "feature",
            1,
            _FIELD.TYPE_MESSAGE,
            repeated=True,
            type_name=".tensorflow.Features.FeatureEntry",
        )
    )
    example = schema.message_type.add(name="Example")
    example.field.append(
        _field("features", 1, _FIELD.TYPE_MESSAGE, type_name=".tensorflow.Features")
    )
    return schema


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_schema())


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"tensorflow.{name}"))


Example = _message("Example")
Features = _message("Features")
Feature = _message("Feature")
BytesList = _message("BytesList")
FloatList = _message("FloatList")
Int64List = _message("Int64List")

#: protobuf refuses to parse a message larger than this.
MAX_MESSAGE_BYTES = 2**31 - 1


def parse(serialized: bytes) -> Any:
    """One serialized ``tf.train.Example``, parsed.

    Raises:
        google.protobuf.message.DecodeError: the bytes are not a valid message.
    """
    return Example.FromString(serialized)


def feature_of(value: Any) -> Any:
    """One ``Feature`` for a value, as ``tpurun data write`` stores it.

    ``bytes``/``str`` (or lists/arrays of them) become a bytes_list; integer or bool values or
    arrays an int64_list; float values or arrays a float_list (float32).

    Raises:
        TypeError: a value of another kind.
    """
    if isinstance(value, str):
        value = value.encode()
    if isinstance(value, bytes):
        return Feature(bytes_list=BytesList(value=[value]))
    array = np.asarray(value)
    if array.dtype.kind in "SUO":
        items = [v.encode() if isinstance(v, str) else bytes(v) for v in array.ravel().tolist()]
        return Feature(bytes_list=BytesList(value=items))
    if array.dtype.kind in "iub":
        return Feature(int64_list=Int64List(value=array.astype(np.int64).ravel().tolist()))
    if array.dtype.kind == "f":
        return Feature(float_list=FloatList(value=array.astype(np.float32).ravel().tolist()))
    raise TypeError(f"cannot store a value of dtype {array.dtype}")


def serialize(features: Mapping[str, Any]) -> bytes:
    """One ``tf.train.Example`` holding ``features`` (record key -> value; see ``feature_of``),
    its keys in sorted order: protobuf's own map order differs from process to process, and
    records of one key order are read a batch at once (:mod:`tpurun.data.native.layout`).

    Raises:
        TypeError: a value of a kind no list holds, naming its key.
    """
    example = Example()
    stored = example.features.feature
    for key, value in features.items():
        try:
            stored[key].CopyFrom(feature_of(value))
        except TypeError as exc:
            raise TypeError(f"record key {key!r}: {exc}") from None
    return example.SerializeToString(deterministic=True)
