"""Categorical features (``type: category``): a string per record mapped to an id by a vocabulary.

Ids follow Keras' ``StringLookup``: 0 for a value out of the vocabulary, 1 to K for its K values
in order. ``encode: index`` feeds the id (int32: what JAX, without x64, and an ONNX export of its
model take), ``encode: one_hot`` its one-hot vector of K + 1 float32 values. The mapping runs in
the input pipeline, the same on both readers (numpy here for the native one, a ``tf.lookup`` table
for ``tf.data``), so a model (and every export of it) takes ids or vectors, never strings: the JAX
backend has no string tensors.

The vocabulary a config leaves out comes from the schema file (``statistics.vocabulary``, counted
by ``tpurun data write`` over the train split, most frequent first), is written into the run's
``config.yaml`` with the rest of the effective features, and is read from there by evaluate,
predict and export. This module also merges a feature entry without ``type`` (``x: {normalize:
true}``) with the schema file's entry, and says what a model fed a text feature should do instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from pydantic import TypeAdapter, ValidationError

from tpurun import frameworks
from tpurun.config import BytesFeature, CategoryFeature, DataConfig, Feature, TextFeature
from tpurun.errors import ConfigError, DataError

#: The feature types a config may declare (``options``: an entry without type, not a type).
_TYPES = ("raw", "int64", "float", "bytes", "text", "image", "category")
_FEATURE = TypeAdapter(Feature)


def vocabulary_of(schema: Mapping[str, Any] | None, key: str) -> dict[str, Any] | None:
    """The schema file's vocabulary entry of record key ``key`` (see
    :class:`tpurun.data.statistics.Vocabulary`), or None."""
    return (((schema or {}).get("statistics") or {}).get("vocabulary") or {}).get(key)


def completed(
    declared: Mapping[str, dict],
    schema: Mapping[str, Any] | None,
    schema_path: str | None,
    first_file: str,
) -> dict[str, dict]:
    """The declared features, each entry without ``type`` merged over the schema file's entry of
    that name, each ``category`` given the schema file's vocabulary where it lists none.

    Raises:
        ConfigError: an entry without type that no schema file describes, or whose options do not
            fit the type the schema file gives it.
        DataError: a category with no vocabulary listed and none in the schema file.
    """
    known = (schema or {}).get("features") or {}
    where = schema_path or f"no schema file beside {first_file}"
    features = {}
    for name, spec in declared.items():
        spec = {key: value for key, value in spec.items() if value is not None}
        if "type" not in spec:
            if name not in known:
                raise ConfigError(
                    [
                        f"data.features.{name}: no type, and {where} describes no feature '{name}' to "
                        f"take it from. Give its type ({', '.join(_TYPES)}) and the rest of it."
                    ]
                )
            spec = {**known[name], **spec}
            _check(name, spec, where)
        if spec["type"] == "category" and not spec.get("vocabulary"):
            spec["vocabulary"] = _schema_vocabulary(name, spec, schema, where)
        features[name] = spec
    return features


def _check(name: str, spec: dict, where: str) -> None:
    try:
        _FEATURE.validate_python(spec)
    except ValidationError as exc:
        said = "; ".join(
            f"{'.'.join(map(str, e['loc'][1:])) or 'it'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise ConfigError(
            [
                f"data.features.{name}: its options, over the {spec['type']} feature that {where} "
                f"describes, do not fit: {said}. Declare the whole feature (its type too) instead."
            ]
        ) from None


def _schema_vocabulary(name: str, spec: dict, schema: Any, where: str) -> list[str]:
    key = spec.get("key") or name
    entry = vocabulary_of(schema, key)
    if entry is None or not entry.get("values"):
        raise DataError(
            f"data.features.{name}: a category maps values to ids by its vocabulary, and {where} "
            f"has none for '{key}' (written before tpurun recorded vocabularies, or not a text "
            "column of at most 10,000 distinct values of up to 100 characters). Write the data "
            "again with `tpurun data write ... --overwrite` (a numeric column with --text "
            f"COLUMN), or list the values: data.features.{name}.vocabulary: [A, B, ...]."
        )
    return list(entry["values"])


def warnings(data: DataConfig, schema: Mapping[str, Any] | None) -> list[str]:
    """What the start line says of values that will get id 0: training values past the
    vocabulary (a capped or a listed one), validation values the training records lack."""
    said = []
    for name, feature in data.features.items():
        entry = vocabulary_of(schema, feature.key or name)
        if not isinstance(feature, CategoryFeature) or entry is None:
            continue
        kept = set(feature.vocabulary or ())
        left = {v: n for v, n in entry["values"].items() if v not in kept}
        beyond = entry.get("distinct", 0) - len(entry["values"])
        if left or beyond > 0:
            shown = ", ".join(f"'{v}'" for v in list(left)[:5])
            shown += ", ..." if len(left) > 5 or beyond > 0 else ""
            said.append(
                f"data.features.{name}: {len(left) + max(0, beyond):,} of the "
                f"{entry['distinct']:,} values of the training records are not in its vocabulary "
                f"({shown}): their records get id 0, out of vocabulary."
            )
        unseen = entry.get("unseen") or {}
        if unseen.get("records") and kept == set(entry["values"]):
            values = ", ".join(f"'{v}'" for v in unseen["values"])
            said.append(
                f"data.features.{name}: {unseen['records']:,} validation record(s) hold values "
                f"the training records lack ({values}): they get id 0, out of vocabulary."
            )
    return said


# --------------------------------------------------------------------------------- encoding
def encode_numpy(values: Any, feature: CategoryFeature) -> np.ndarray:
    """A batch of strings (bytes, as the native reader decodes them) -> ids or one-hot vectors."""
    index = {value.encode("utf-8"): i for i, value in enumerate(feature.vocabulary or (), 1)}
    ids = np.fromiter((index.get(v, 0) for v in values), np.int32, len(values))
    if feature.encode == "index":
        return ids
    return np.eye(feature.size, dtype=np.float32)[ids]


def tf_tables(features: Mapping[str, Any]) -> dict[str, Any]:
    """A ``tf.lookup`` table per category feature, made outside any ``tf.data`` function (a
    dataset function cannot create resources, only capture them)."""
    tables = {}
    for name, feature in features.items():
        if isinstance(feature, CategoryFeature):
            tf = frameworks.tensorflow()
            initializer = tf.lookup.KeyValueTensorInitializer(
                tf.constant(feature.vocabulary, tf.string),
                tf.range(1, feature.size, dtype=tf.int64),
            )
            tables[name] = tf.lookup.StaticHashTable(initializer, default_value=0)
    return tables


def encode_tf(values: Any, feature: CategoryFeature, table: Any) -> Any:
    """A batch of ``tf.string`` -> ids or one-hot vectors, as :func:`encode_numpy`."""
    tf = frameworks.tensorflow()
    ids = tf.cast(table.lookup(values), tf.int32)
    return ids if feature.encode == "index" else tf.one_hot(ids, feature.size, dtype=tf.float32)


# ------------------------------------------------------------------------ a text feature as input
def string_feature_problem(data: DataConfig, name: str, role: str) -> str | None:
    """What to do when a text (or bytes) feature feeds a model that takes numbers; None when the
    feature is not one.

    Args:
        role: ``inputs`` or ``targets``: which of ``data``'s references names it.
    """
    feature = data.features.get(name)
    if not isinstance(feature, (TextFeature, BytesFeature)):
        return None
    key = feature.key or name
    if role == "targets":
        return (
            f"data.targets '{name}' is a {feature.type} feature (strings), and the model learns "
            f"numbers. For class labels, write the data with `tpurun data write SOURCE "
            f"OUT_PREFIX --label {key} ...`: its values become class ids 0..K-1, their names kept "
            "for predict."
        )
    return (
        f"data.inputs: '{name}' is a {feature.type} feature (strings), and the model's input "
        f"takes numbers. For a column of a few values (a category), declare it "
        f"data.features.{name}: {{type: category}} (a one-hot vector; `encode: index` for an id, "
        "for an Embedding), its vocabulary taken from the schema file; for free text, use a "
        "model.preset, whose preprocessor tokenizes it."
    )
