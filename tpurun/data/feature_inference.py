"""What the sampled records of ``tpurun data inspect`` hold, key by key: :class:`FeatureInfo`.

How a key is stored (list kind, number of values) is a fact; a raw tensor's dtype and shape are
guesses from its byte length and values, and say so. Keys the schema describes take its entry, since
the writer knew the dtype, and its order (the source's columns); without a schema, numbered keys
come in number order (f2 before f10). Text features get their first value and lengths, tokenised
records their first token ids.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tpurun.data import schema_file
from tpurun.data.decode import image_format
from tpurun.data.native import images

_ITEMSIZE = {"float32": 4, "float64": 8, "uint8": 1}
_NUMBER_LISTS = {"int64": "int64_list", "float": "float_list"}  # other types are one bytes_list


@dataclass
class FeatureInfo:
    """One record key: how it is stored, and the ``features:`` entry that reads it."""

    name: str  # in the block: the record key, unless the schema names the feature
    key: str  # in the records
    stored: str  # bytes_list, int64_list, float_list, mixed or empty
    spec: dict[str, Any] | None  # None: tpurun cannot read the key as stored (see notes)
    source: str = "inferred"  # or "schema"
    notes: list[str] = field(default_factory=list)  # what to check, one sentence each
    # A text feature's first sampled value (escaped, cut at 60 characters) and its lengths in
    # characters: {"sample", "sample_chars", "min_chars", "mean_chars", "max_chars", "over"}.
    text: dict[str, Any] | None = None
    # Tokenised records' token ids: the first sampled record's first ids and its length in tokens
    # (its padding mask's ones) of the positions: {"first", "length", "positions"}.
    tokens: dict[str, Any] | None = None


def infer(examples: Sequence[Any]) -> list[FeatureInfo]:
    infos = []
    keys = {key for example in examples for key in example.features.feature}
    for key in sorted(keys, key=_natural):
        present = [ex.features.feature[key] for ex in examples if key in ex.features.feature]
        kinds = sorted({f.WhichOneof("kind") for f in present} - {None})
        if len(kinds) == 1:
            stored = kinds[0]
            # A Feature with no list set is an empty list: a varying length, as parsing sees it.
            values = [
                list(getattr(f, stored).value) if f.WhichOneof("kind") else [] for f in present
            ]
            spec, notes = _infer_key(stored, values)
        elif kinds:
            stored, spec = "mixed", None
            notes = [f"stored as {' and '.join(kinds)} in different records; tpurun needs one kind"]
        else:
            stored, spec, notes = "empty", None, ["no values in the sampled records; left out"]
        if len(present) < len(examples) and spec is not None:
            spec = None
            notes.append(
                f"missing in {len(examples) - len(present)} of {len(examples)} sampled records; "
                "tpurun reads only features every record holds, so it is left out"
            )
        infos.append(FeatureInfo(key, key, stored, spec, notes=notes))
    return infos


def _natural(key: str) -> list:
    """Sort key reading digit runs as numbers: f2 before f10, as columns are numbered."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", key)]


def _infer_key(kind: str, values: list[list[Any]]) -> tuple[dict | None, list[str]]:
    """The features entry for one key, and notes, from its values in the sampled records."""
    lengths = sorted({len(v) for v in values})
    if len(lengths) > 1:
        return None, [
            f"variable length ({lengths[0]} to {lengths[-1]} values in the sampled records); "
            "tpurun reads fixed-length features only, so it is left out"
        ]
    n = lengths[0]
    if n == 0:
        return None, ["empty in every sampled record; left out"]
    shape = [] if n == 1 else [n]
    if kind != "bytes_list":
        return {"type": "int64" if kind == "int64_list" else "float", "shape": shape}, []
    if n > 1:
        return {"type": "bytes", "shape": shape}, []
    blobs = [v[0] for v in values]
    notes: list[str] = []
    if image_format(blobs[0]):
        shape, notes = _image_shape(blobs)
        if shape:
            return {"type": "image", "shape": shape}, notes
    if _is_text(blobs):
        return {"type": "text"}, notes
    lengths = sorted({len(b) for b in blobs})
    if len(lengths) > 1:
        return {"type": "bytes", "shape": []}, notes
    dtype = _guess_dtype(blobs)
    count = lengths[0] // _ITEMSIZE[dtype]
    notes.append(
        f"{lengths[0]} bytes in every sampled record: raw dtype {dtype} and shape [{count}] are "
        "guesses from the length and the values; check them (and reshape) against the writer"
    )
    if len(blobs) == 1:
        notes.append("only one record was sampled, so the length may vary")
    return {"type": "raw", "dtype": dtype, "shape": [count]}, notes


def _image_shape(blobs: list[bytes]) -> tuple[list[int] | None, list[str]]:
    shapes = []
    for blob in blobs:
        if not image_format(blob):
            return None, ["some values are JPEG/PNG images, others are not"]
        try:
            shapes.append(list(images.shape_of(blob)))
        except images.ImageError:
            return None, ["starts like a JPEG/PNG image but does not decode"]
    height, width, _ = shapes[0]
    # Gray and color images mixed: decoding to the most channels keeps the color.
    channels = max(s[2] for s in shapes)
    channels = 1 if channels == 2 else channels  # gray + alpha: the gray is the picture
    notes = []
    if any(s[:2] != [height, width] for s in shapes):
        sizes = sorted({f"{h}x{w}" for h, w, _ in shapes})
        notes.append(
            f"image sizes vary ({', '.join(sizes[:4])}); shape is the first one's, and tpurun "
            "resizes every image to shape, so set the size the model wants"
        )
    return [height, width, channels], notes


def _is_text(blobs: list[bytes]) -> bool:
    """UTF-8 without control characters but whitespace (emoji joiners and marks are text)."""
    try:
        texts = [b.decode("utf-8") for b in blobs]
    except UnicodeDecodeError:
        return False
    return not any(
        unicodedata.category(ch) == "Cc" and not ch.isspace() for text in texts for ch in text
    )


def preview(text: str, width: int = 60) -> str:
    """``text`` quoted as JSON would (line breaks, tabs and quotes escaped; unicode as it is),
    cut at ``width`` characters with an ellipsis."""
    shown = json.dumps(text[:width], ensure_ascii=False)
    return shown[:-1] + '..."' if len(text) > width else shown


def describe_texts(features: list[FeatureInfo], examples: Sequence[Any], schema: Any) -> None:
    """Give each text feature its first sampled value and its lengths: over the split the schema
    file counted (every record written), else over the sampled records."""
    counted = ((schema or {}).get("statistics") or {}).get("text") or {}
    split = ((schema or {}).get("statistics") or {}).get("split", "all")
    for info in features:
        if (info.spec or {}).get("type") != "text":
            continue
        texts = [
            ex.features.feature[info.key].bytes_list.value[0].decode("utf-8", "replace")
            for ex in examples
            if info.key in ex.features.feature
        ]
        if info.source == "schema" and info.key in counted:
            lengths = dict(counted[info.key])
            over = f"{lengths.pop('count'):,} {'' if split == 'all' else split + ' '}records"
        else:
            chars = [len(t) for t in texts]
            lengths = {"min_chars": min(chars), "mean_chars": sum(chars) / len(chars),
                       "max_chars": max(chars)}  # fmt: skip
            over = f"{len(texts)} sampled records"
        info.text = {"sample": preview(texts[0]), "sample_chars": len(texts[0]), **lengths,
                     "over": over}  # fmt: skip


def describe_tokens(features: list[FeatureInfo], first: Any, schema: Any) -> dict | None:
    """For records written with ``--tokenize``: what they were tokenised with and their lengths
    in tokens (the schema's), and the first sampled record's ids on its token ids feature."""
    entry = (schema or {}).get(schema_file.TOKENIZED)
    if not entry:
        return None
    stored = first.features.feature
    mask = list(stored[entry["mask"]].int64_list.value) if entry.get("mask") in stored else []
    for info in features:
        if info.key == "token_ids" and info.key in stored:
            ids = list(stored[info.key].int64_list.value)
            info.tokens = {"first": ids[:16], "length": sum(mask) if mask else len(ids),
                           "positions": len(ids)}  # fmt: skip
    statistics = schema.get("statistics") or {}
    lengths = statistics.get("tokens")
    split = statistics.get("split", "all")
    return {**entry, "lengths": {**lengths, "split": split} if lengths else None}


def _guess_dtype(blobs: list[bytes]) -> str:
    import numpy as np

    data = b"".join(blobs)  # every blob has the same length, so one view reads them all
    size = len(blobs[0])
    if size % 4 == 0:
        words = np.frombuffer(data, "<u4")
        # float64 values that are round numbers leave their low 32-bit word zero, and the high
        # words read as sane float32 values: without this check they would pass as float32.
        halves_zero = size % 8 == 0 and not words[0::2].any() and words[1::2].any()
        if not halves_zero and _plausible_floats(words.view("<f4")):
            return "float32"
    if size % 8 == 0 and _plausible_floats(np.frombuffer(data, "<f8")):
        return "float64"
    return "uint8"


def _plausible_floats(values: Any) -> bool:
    import numpy as np

    with np.errstate(all="ignore"):
        if not np.isfinite(values).all():
            return False
        magnitude = np.abs(values)
        if magnitude.max() >= 1e10:
            return False
        nonzero = magnitude[magnitude > 0]
        # Bytes of another dtype read as floats mostly land below 1e-20 (small integers become
        # denormals, dark pixels tiny exponents) or above 1e10; real data rarely does either.
        return nonzero.size == 0 or float(np.mean(nonzero < 1e-20)) < 0.1


def apply_schema(
    features: list[FeatureInfo], declared: dict[str, dict[str, Any]]
) -> list[FeatureInfo]:
    """Let the schema's entries replace the guesses for the keys it describes, in its order.

    A record does not keep the order of its keys (``tf.train.Example`` holds them in a map), but
    the schema keeps the source's column order; keys it does not describe follow.
    """
    by_key = {spec.get("key") or name: (name, spec) for name, spec in declared.items()}
    order = {key: i for i, key in enumerate(by_key)}
    features = sorted(features, key=lambda info: order.get(info.key, len(order)))
    for info in features:
        if info.spec is None or info.key not in by_key:
            continue  # tpurun cannot read what the records hold, whatever the schema says
        name, spec = by_key[info.key]
        if _NUMBER_LISTS.get(spec.get("type"), "bytes_list") != info.stored:  # a stale schema
            info.notes.append(f"the schema declares {spec}, but the records hold {info.stored}")
            continue
        if info.spec["type"] != "image":  # image size notes still hold; raw guesses do not
            info.notes = []
        info.name, info.spec, info.source = name, dict(spec), "schema"
    return features
