"""Feature statistics: what ``tpurun data write`` records of the values it wrote, and the numbers a
``normalize: true`` feature is standardized with.

While the shards are written, every numeric feature's values are accumulated per element (a
packed vector per column), over the **train split only** when the records are split: statistics
that had seen the validation records would leak them into the model. The schema file keeps, for
each such feature, ``count``, ``mean``, ``variance`` (the population variance, as scikit-learn's
``StandardScaler`` and Keras' ``Normalization.adapt`` compute it), ``min`` and ``max``.

Which features: ``float`` and ``int64`` features (a CSV's numeric columns and packed vectors,
scalar arrays) and ``raw`` features of a float dtype (arrays), of up to :data:`MAX_ELEMENTS`
values per record; others (text, images, wider arrays) get none. The sums run in float64 over the
values as written (float32 for floats), merged chunk by chunk (Chan et al.'s pairwise update), so
the result is exact to float64 rounding whatever the chunk size.

``text`` features get their lengths in characters instead (``statistics.text`` in the schema
file: ``count``, ``min_chars``, ``mean_chars``, ``max_chars``), which ``tpurun data inspect``
shows, to choose a sequence length by, and their **vocabulary** (``statistics.vocabulary``, see
:class:`Vocabulary`), which a ``type: category`` feature maps its values to ids with. Tokenised
records (``--tokenize``) get their lengths in tokens (``statistics.tokens``) and no statistics of
their token ids.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tpurun.config import DataConfig
from tpurun.data import schema_file
from tpurun.errors import ConfigError, DataError

#: The most values per record a feature may have and still get statistics: each is five numbers
#: in the schema file (a 64 x 64 image has 4,096).
MAX_ELEMENTS = 4096
_RAW_FLOATS = ("float16", "float32", "float64")
_REWRITE = "Write the data again with `tpurun data write` (it records them)"


class Moments:
    """One feature's running count, mean, sum of squared deviations, minimum and maximum."""

    def __init__(self, shape: Sequence[int]):
        self.shape = tuple(shape)
        self.count = 0
        self.mean = np.zeros(self.shape)
        self.m2 = np.zeros(self.shape)
        self.min = np.full(self.shape, np.inf)
        self.max = np.full(self.shape, -np.inf)

    def update(self, values: np.ndarray) -> None:
        """Add a batch of records, ``values`` of shape ``(records, *shape)``."""
        n = len(values)
        if not n:
            return
        values = values.astype(np.float64, copy=False)
        batch_mean = values.mean(axis=0)
        batch_m2 = np.square(values - batch_mean).sum(axis=0)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.m2 = self.m2 + batch_m2 + np.square(delta) * (self.count * n / total)
        self.count = total
        self.min = np.minimum(self.min, values.min(axis=0))
        self.max = np.maximum(self.max, values.max(axis=0))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: numbers for a scalar feature, nested lists of the feature's shape else."""
        return {
            "count": self.count,
            "mean": self.mean.tolist(),
            "variance": (self.m2 / max(1, self.count)).tolist(),
            "min": self.min.tolist(),
            "max": self.max.tolist(),
        }


def _reader(spec: Mapping[str, Any]) -> str | None:
    """The dtype a feature's written values are read back as, or None: no statistics for it."""
    shape = spec.get("shape") or []
    if math.prod(shape) > MAX_ELEMENTS:
        return None
    kind = spec.get("type")
    if kind == "raw" and spec.get("dtype") in _RAW_FLOATS:
        return spec["dtype"]
    return {"float": "float32", "int64": "int64"}.get(kind)


class TextLengths:
    """One text feature's record count and lengths in characters (not bytes, not tokens)."""

    def __init__(self) -> None:
        self.count = self.total = 0
        self.min: int | None = None
        self.max: int | None = None

    def update(self, values: Sequence[bytes]) -> None:
        lengths = [len(value.decode("utf-8")) for value in values]
        if lengths:
            self.count += len(lengths)
            self.total += sum(lengths)
            self.min = min(lengths) if self.min is None else min(self.min, *lengths)
            self.max = max(lengths) if self.max is None else max(self.max, *lengths)

    def to_dict(self) -> dict[str, Any]:
        mean = self.total / self.count if self.count else None
        return {"count": self.count, "min_chars": self.min, "mean_chars": mean,
                "max_chars": self.max}  # fmt: skip


#: A text feature gets a vocabulary while its train split holds at most this many distinct values,
#: none longer than :data:`MAX_VALUE_CHARS` characters (past either, it is free text, not a
#: category); the schema file keeps the :data:`MAX_VOCABULARY` most frequent of them.
MAX_DISTINCT = 10_000
MAX_VALUE_CHARS = 100
MAX_VOCABULARY = 1_000
#: The most values of the validation split unseen in the train split the schema file names.
MAX_UNSEEN_SHOWN = 10


def _capped(counts: Counter, limit: int) -> dict[str, int]:
    """The ``limit`` most frequent values, most frequent first, ties by value (stable order)."""
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:limit])


class Vocabulary:
    """One text feature's distinct values and their counts, over the train split, and the values
    of the other split (validation) that the train split lacks.

    In the schema file (``statistics.vocabulary.NAME``): ``count`` (records), ``distinct`` (values
    in the train split), ``values`` (``{value: records}``, the :data:`MAX_VOCABULARY` most frequent,
    most frequent first) and, for split records, ``unseen``: the validation records whose value is
    not among ``values`` (``records``, and ``values``, the most frequent of them). A feature of
    free text (too many distinct values, or long ones) gets none.
    """

    def __init__(self) -> None:
        self.counts: Counter | None = Counter()
        self.held_out: Counter = Counter()
        self.count = 0
        self.split = False

    def update(self, kept: Sequence[bytes], held_out: Sequence[bytes] = ()) -> None:
        if self.counts is None:
            return
        self.count += len(kept)
        self.split = self.split or bool(held_out)
        for counter, values in ((self.counts, kept), (self.held_out, held_out)):
            for value in values:
                text = value.decode("utf-8") if isinstance(value, bytes) else str(value)
                if len(text) > MAX_VALUE_CHARS:
                    self.counts = None  # free text: no vocabulary
                    return
                counter[text] += 1
            if len(counter) > MAX_DISTINCT:
                self.counts = None
                return

    def to_dict(self) -> dict[str, Any] | None:
        if self.counts is None:
            return None
        values = _capped(self.counts, MAX_VOCABULARY)
        made: dict[str, Any] = {"count": self.count, "distinct": len(self.counts), "values": values}
        if self.split:
            unseen = Counter({v: n for v, n in self.held_out.items() if v not in values})
            made["unseen"] = {"records": sum(unseen.values()),
                              "values": _capped(unseen, MAX_UNSEEN_SHOWN)}  # fmt: skip
        return made


class TokenLengths:
    """Tokenised records' lengths in tokens (a padding mask's ones), of ``positions`` each."""

    def __init__(self, positions: int):
        self.positions = positions
        self.count = self.total = self.full = 0
        self.min: int | None = None
        self.max: int | None = None

    def update(self, mask: np.ndarray) -> None:
        lengths = np.asarray(mask).reshape(len(mask), -1).sum(axis=1)
        if lengths.size:
            self.count += int(lengths.size)
            self.total += int(lengths.sum())
            self.full += int((lengths == self.positions).sum())
            low, high = int(lengths.min()), int(lengths.max())
            self.min = low if self.min is None else min(self.min, low)
            self.max = high if self.max is None else max(self.max, high)

    def to_dict(self) -> dict[str, Any]:
        mean = self.total / self.count if self.count else None
        return {"count": self.count, "positions": self.positions, "min_tokens": self.min,
                "mean_tokens": mean, "max_tokens": self.max, "full": self.full}  # fmt: skip


class Statistics:
    """The statistics of every numeric feature of a source, and the lengths of its text features,
    accumulated a chunk at a time.

    Args:
        features: the source's features.
        tokenized: the schema file's ``tokenized`` entry of records written with ``--tokenize``:
            its token features get no per-element statistics (the mean id at position 17 means
            nothing), and the records' lengths in tokens are counted from its ``mask`` instead.
    """

    def __init__(
        self, features: Mapping[str, Mapping[str, Any]], tokenized: Mapping[str, Any] | None = None
    ):
        self._features: dict[str, tuple[str, Moments]] = {}
        self._texts = {
            n: TextLengths() for n, spec in features.items() if spec.get("type") == "text"
        }
        self._vocabularies = {n: Vocabulary() for n in self._texts}
        skip = set((tokenized or {}).get("features") or ())
        for name, spec in features.items():
            dtype = _reader(spec)
            if dtype is not None and name not in skip:
                self._features[name] = (dtype, Moments(spec.get("shape") or []))
        self._mask = (tokenized or {}).get("mask")
        self._tokens = None
        if self._mask in features:
            self._tokens = TokenLengths(int(features[self._mask]["shape"][-1]))

    def update(self, chunk: Mapping[str, Any], keep: np.ndarray | None = None) -> None:
        """Add a chunk of records (``{feature: column}``, as a source yields them); ``keep``, a
        bool per record, picks the ones to count (the train split's)."""
        for name, (dtype, moments) in self._features.items():
            column = chunk[name]
            if dtype in _RAW_FLOATS and not isinstance(column, np.ndarray):
                values = np.frombuffer(b"".join(column), np.dtype(dtype).newbyteorder("<"))
            else:  # floats are written as float32: count what the records hold
                values = np.asarray(column).astype(dtype, copy=False)
            values = values.reshape(-1, *moments.shape)
            moments.update(values if keep is None else values[keep])
        for name, lengths in self._texts.items():
            column = chunk[name]
            kept = column if keep is None else [v for v, k in zip(column, keep, strict=True) if k]
            held_out = (
                [] if keep is None else [v for v, k in zip(column, keep, strict=True) if not k]
            )
            lengths.update(kept)
            self._vocabularies[name].update(kept, held_out)
        if self._tokens is not None:
            mask = np.asarray(chunk[self._mask])
            self._tokens.update(mask if keep is None else mask[keep])

    def to_schema(self, split: str) -> dict[str, Any] | None:
        """The schema file's ``statistics``: the split they describe, each numeric feature's, and
        each text feature's lengths (``text``, when there is one) and vocabulary (``vocabulary``,
        for those that have one: see :class:`Vocabulary`); None when no feature has any."""
        if not self._features and not self._texts and self._tokens is None:
            return None
        features = {name: moments.to_dict() for name, (_, moments) in self._features.items()}
        texts = {name: lengths.to_dict() for name, lengths in self._texts.items()}
        tokens = {"tokens": self._tokens.to_dict()} if self._tokens is not None else {}
        vocabularies = {name: made for name, vocabulary in self._vocabularies.items()
                        if (made := vocabulary.to_dict()) is not None}  # fmt: skip
        return {"split": split, "features": features, **({"text": texts} if texts else {}),
                **({"vocabulary": vocabularies} if vocabularies else {}), **tokens}  # fmt: skip


# ------------------------------------------------------------------------------ normalization
def is_constant(mean: np.ndarray, variance: np.ndarray, count: int) -> np.ndarray:
    """Which values are constant: a variance within float64 rounding of 0 (scikit-learn's bound
    in ``StandardScaler``), so that a column of one value is found whatever its magnitude."""
    eps = np.finfo(np.float64).eps
    return variance <= count * eps * variance + np.square(count * mean * eps)


def normalization(data: Any, train_files: Sequence[str]) -> tuple[dict[str, dict], list[str]]:
    """The numbers each ``normalize: true`` feature is standardized with, from the statistics
    in the schema file beside the training records, and warnings of constant values.

    A constant value (variance 0) gets variance 1: it is centred, not scaled. Keras would divide
    by its epsilon instead, turning any difference from the training value into a huge input.

    Args:
        data: the effective ``data`` section (features filled in from the schema file).
        train_files: the training files (the first one's schema file is read).

    Returns:
        ``({feature: {mean, variance, count, schema, split}}, warnings)``; ``({}, [])`` when no
        feature normalizes.

    Raises:
        ConfigError: ``normalize`` on a feature that is not a model input.
        DataError: no schema file, or one without statistics for the feature (written before
            they existed, or a feature that gets none), or statistics that are not finite.
    """
    wanted = {n: f for n, f in data.features.items() if getattr(f, "normalize", False)}
    if not wanted:
        return {}, []
    inputs = DataConfig.names(data.inputs)
    stray = [n for n in wanted if n not in inputs]
    if stray:
        raise ConfigError(
            [
                f"data.features.{name}.normalize: '{name}' is not a model input (data.inputs: "
                f"{data.inputs}); normalize standardizes inputs only. Remove it, or feed the feature "
                "to the model."
                for name in stray
            ]
        )
    path, schema = schema_file.find_for(train_files[:1]).get(train_files[0], (None, None))
    numbers, warnings = {}, []
    for name, feature in wanted.items():
        key = feature.key or name
        if schema is None:
            raise DataError(
                f"data.features.{name}.normalize: no schema file beside {train_files[0]}, so "
                f"there are no statistics of '{key}' to normalize it with. {_REWRITE} beside the "
                "shards."
            )
        stats = ((schema.get("statistics") or {}).get("features") or {}).get(key)
        if stats is None:
            raise DataError(
                f"data.features.{name}.normalize: {path} has no statistics of '{key}' (the file "
                f"was written before tpurun recorded them, or '{key}' is not numeric or has more "
                f"than {MAX_ELEMENTS:,} values per record). {_REWRITE}: "
                "`tpurun data write SOURCE OUT_PREFIX --overwrite` with the options it was written "
                "with."
            )
        numbers[name], constant = _standardization(name, feature, stats, path)
        numbers[name]["split"] = schema["statistics"].get("split", "all")
        if constant:
            columns = (schema.get("packed") or {}).get(key)
            shown = [
                columns[i] if columns and i < len(columns) else f"{key}[{i}]" for i in constant
            ]
            warnings.append(
                f"data.features.{name}.normalize: {len(constant)} value(s) are constant in the "
                f"training records ({', '.join(shown[:6])}{', ...' if len(shown) > 6 else ''}): "
                "they are centred (variance taken as 1), so they carry no information; consider "
                "leaving them out."
            )
    return numbers, warnings


def _standardization(name: str, feature: Any, stats: Mapping, path: str) -> tuple[dict, list]:
    """The mean and variance the layer uses for one feature, and its constant elements' indices."""
    mean = np.asarray(stats["mean"], dtype=np.float64)
    variance = np.asarray(stats["variance"], dtype=np.float64)
    count = int(stats["count"])
    if mean.shape != tuple(feature.shape) or variance.shape != mean.shape:
        raise DataError(
            f"data.features.{name}.normalize: {path} has statistics of shape {list(mean.shape)}, "
            f"and the feature's shape is {feature.shape}. Declare the shape the data was written "
            "with, or write the data again with `tpurun data write`."
        )
    if not (np.isfinite(mean).all() and np.isfinite(variance).all()):
        raise DataError(
            f"data.features.{name}.normalize: the statistics in {path} are not finite: the "
            "training records hold NaN or infinite values. Clean them (or use --fill-missing for a "
            "CSV) and write the data again."
        )
    constant = is_constant(mean, variance, count)
    used = np.where(constant, 1.0, variance)
    numbers = {"mean": mean.tolist(), "variance": used.tolist(), "count": count, "schema": path}
    return numbers, np.flatnonzero(constant).tolist()
