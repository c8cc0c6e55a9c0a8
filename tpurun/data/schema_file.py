"""The schema file written beside TFRecord shards: ``<OUT_PREFIX>.schema.json``.

It records what ``tpurun data write`` wrote, so that ``tpurun train`` can skip counting records and
fill in the feature specs a config leaves out, and ``tpurun data inspect`` can answer at once. Its
name does not end in ``.tfrecord``, so a shard glob never matches it.

Layout (``version`` 1)::

    {
      "format": "tpurun.schema",
      "version": 1,
      "features": {"x": {"type": "raw", "dtype": "float32", "shape": [1024]},
                   "label": {"type": "int64", "shape": []},
                   "image": {"type": "image", "shape": [192, 192, 3]}},
      "compression": "none",
      "class_names": ["daisy", "rose"],          # or null
      "splits": {"train": {"records": 9000, "shards": {"x-train-00000-of-00008.tfrecord": 1125, ...},
                           "shard_bytes": {"x-train-00000-of-00008.tfrecord": 1712330, ...}},
                 "validation": {...}},           # a dataset written without a split has one "all"
      "source": "flowers/", "created": "2026-11-22T05:50:00Z",
      "label": "species",                        # CSV only, each key when it applies:
      "packed": {"x": ["f0", "f1", "f2"]},       #   the columns of each packed vector, in order
      "fill_missing": {"f1": 0.25},              #   the value written for a column's empty cells
      "statistics": {"split": "train",           # numeric features, over the train split only
                     "features": {"x": {"count": 9000, "mean": [...], "variance": [...],
                                        "min": [...], "max": [...]}},
                     "text": {"prompt": {"count": 9000, "min_chars": 3,   # text features'
                                         "mean_chars": 211.4, "max_chars": 4012}},
                     "vocabulary": {"island": {"count": 9000, "distinct": 3,  # text features
                                    "values": {"Biscoe": 4330, "Dream": 3385,  # of few values
                                               "Torgersen": 1285},
                                    "unseen": {"records": 0, "values": {}}}},
                     "tokens": {"count": 9000, "positions": 129, "min_tokens": 9,  # tokenised
                                "mean_tokens": 61.2, "max_tokens": 129, "full": 12}},
      "tokenized": {"preset": "/kaggle/input/gemma/...", "task": "GemmaCausalLM",  # --tokenize
                    "kind": "causal_lm", "preprocessor": "GemmaCausalLMPreprocessor",
                    "tokenizer": "GemmaTokenizer", "fingerprint": "sha256:...",
                    "sequence_length": 128,
                    "source": {"inputs": "prompt", "targets": "response"},
                    "features": ["token_ids", "padding_mask", "weights"], "mask": "padding_mask"}
    }

Shard names are relative to the schema file's folder. Feature entries use the config's own keys,
so they can be pasted into ``data.features`` as they are, in the source's column order.
``class_names`` come from an image folder's class folders or a CSV's text label. ``shard_bytes``
(each shard's size, a cheap check for truncated copies) is absent from schema files written before
it existed. ``statistics`` (see :mod:`tpurun.data.statistics`: per element of each numeric feature,
over the "train" split, or "all" when the records were not split) is what ``normalize: true``
standardizes with; older files lack it. ``text`` features (``{"type": "text"}``: a JSONL file's
strings, a CSV's text columns) get their lengths in characters in ``statistics.text`` instead, and
those of few distinct values their vocabulary with counts, most frequent first, in
``statistics.vocabulary`` (``unseen``: validation records whose value the train split lacks), for
a ``type: category`` feature to map to ids.
Records written with ``--tokenize`` (:mod:`tpurun.hub.tokenize` describes their features) carry
``tokenized``: the preset, its task, a fingerprint of its tokenizer and the sequence length, which
training checks against its own preprocessor; their token features get no per-element statistics,
and ``statistics.tokens`` gives the records' lengths in tokens (``full``: records that fill every
position, so may have been cut).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from typing import Any

from tpurun.errors import DataError
from tpurun.storage import fileio

#: What tokenised records were made with (``tpurun data write --tokenize``; see above).
TOKENIZED = "tokenized"
#: The features of tokenised records that feed the model (a text preprocessor's outputs).
TOKEN_INPUTS = ("token_ids", "padding_mask", "segment_ids")
FORMAT = "tpurun.schema"
VERSION = 1
SUFFIX = ".schema.json"


def is_tokenized(data: Any) -> bool:
    """Whether ``data`` (a config's data section) reads tokenised records: token ids as inputs."""
    inputs = data.inputs
    if not isinstance(inputs, dict) or "token_ids" not in inputs:
        return False
    return data.features[inputs["token_ids"]].type == "int64"


def schema_path(out_prefix: str) -> str:
    return f"{out_prefix}{SUFFIX}"


def shard_names(out_prefix: str, split: str | None, num_shards: int) -> list[str]:
    """``<prefix>[-<split>]-00000-of-00008.tfrecord``, as TFDS and Beam name shards.

    GZIP shards keep the ``.tfrecord`` name; readers detect the compression (and the schema
    records it).
    """
    stem = f"{out_prefix}-{split}" if split else out_prefix
    return [f"{stem}-{i:05d}-of-{num_shards:05d}.tfrecord" for i in range(num_shards)]


def make(
    features: Mapping[str, Mapping[str, Any]],
    splits: Mapping[str, Mapping[str, int]],
    *,
    compression: str = "none",
    class_names: list[str] | None = None,
    source: str | None = None,
    shard_bytes: Mapping[str, Mapping[str, int]] | None = None,
    layout: Mapping[str, Any] | None = None,
    statistics: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Build a schema dict.

    Args:
        splits: maps a split name to ``{shard basename: record count}``.
        shard_bytes: the same, with each shard's size in bytes, when known.
        layout: how a CSV's columns became features (``label``, ``packed``, ``fill_missing``).
        statistics: the numeric features' statistics (``statistics.Statistics.to_schema``).
    """
    made = {
        split: {"records": sum(shards.values()), "shards": dict(shards)}
        for split, shards in splits.items()
    }
    for split, sizes in (shard_bytes or {}).items():
        made[split]["shard_bytes"] = dict(sizes)
    return {
        "format": FORMAT,
        "version": VERSION,
        "features": {name: dict(spec) for name, spec in features.items()},
        "compression": compression,
        "class_names": class_names,
        "splits": made,
        "source": source,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **(layout or {}),
        **({"statistics": dict(statistics)} if statistics else {}),
    }


def write(path: str, schema: Mapping[str, Any]) -> None:
    """Write atomically (locally: temp name and rename; remote: write then copy)."""

    def dump(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(schema, f, indent=2)
            f.write("\n")

    fileio.save_atomically(path, dump)


def read(path: str) -> dict[str, Any]:
    """Read and check a schema file.

    Raises:
        DataError: the file is not a tpurun schema of a version this tpurun reads.
    """
    try:
        data = json.loads(fileio.read_text(path))
    except (OSError, ValueError, fileio.StorageError) as exc:
        raise DataError(f"{path}: cannot read the schema file: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DataError(f'{path}: not a tpurun schema file (no "format": "{FORMAT}").')
    if data.get("version") != VERSION:
        raise DataError(
            f"{path}: schema version {data.get('version')!r}; this tpurun reads version {VERSION}. "
            "Upgrade tpurun, or delete the schema file to count records instead."
        )
    return data


def find_for(files: Iterable[str]) -> dict[str, tuple[str, dict]]:
    """For each shard, the schema file (path, content) that lists it, if any.

    Looks for ``*.schema.json`` in each shard's folder once; a schema whose listed size disagrees
    is still trusted only for the shards it names.
    """
    found: dict[str, tuple[str, dict]] = {}
    folders: dict[str, list[tuple[str, dict]]] = {}
    for file in files:
        folder = file.rsplit("/", 1)[0] if "/" in file else "."
        if folder not in folders:
            schemas = []
            for path in sorted(fileio.glob(f"{folder}/*{SUFFIX}")):
                try:
                    schemas.append((path, read(path)))
                except DataError:
                    continue  # a foreign or newer file: counting still works without it
            folders[folder] = schemas
        name = PurePosixPath(file).name
        for path, schema in folders[folder]:
            if any(name in split["shards"] for split in schema["splits"].values()):
                found[file] = (path, schema)
                break
    return found


def record_count(schema: Mapping[str, Any], file: str) -> int | None:
    name = PurePosixPath(file).name
    for split in schema["splits"].values():
        if name in split["shards"]:
            return int(split["shards"][name])
    return None


def shard_bytes(schema: Mapping[str, Any], file: str) -> int | None:
    """The size the schema lists for a shard; None for schema files without sizes."""
    name = PurePosixPath(file).name
    for split in schema["splits"].values():
        if name in split.get("shard_bytes", {}):
            return int(split["shard_bytes"][name])
    return None
