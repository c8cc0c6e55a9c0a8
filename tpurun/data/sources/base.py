"""What every source of ``tpurun data write`` is: its size and features up front, then its
records a chunk at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

#: What `tpurun data write` takes, for messages about a source it cannot read.
ACCEPTED = (
    "a .npz file, a .npy file, a folder of .npy files, CSV files with a header row or JSONL files "
    "of one JSON object per line (a path or a glob), or a folder of images with one subfolder per "
    "class"
)
# A tf.train.Example spends a few bytes per feature on the key and the list headers.
OVERHEAD_PER_FEATURE = 12


class Source:
    """A dataset to write: its size and features up front, then its records a chunk at a time.

    Attributes:
        path: the source as the user named it (recorded in the schema file).
        records: how many records ``chunks`` yields in total.
        features: ``{name: feature spec}`` in the config's form, e.g. ``{"type": "float"}``.
        nbytes: the estimated size of all records once serialized, to size the shards.
        class_names: the class of each label value (image folders, a CSV's text label).
        layout: what the schema file should also say of how records were made from the source
            (a CSV's label, packed columns and fills); ``{}`` for most sources.
        warnings: what the user should know of how it was read (a packed column that looks like
            a row id); written out by ``tpurun data write``.
    """

    path: str
    records: int
    features: dict[str, dict[str, Any]]
    nbytes: int
    class_names: list[str] | None = None
    layout: dict[str, Any] = {}  # read only here; a source that fills it sets its own
    warnings: list[str] = []  # what the user should know of how it was read (the same rule)

    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        """Yield ``{feature: column}`` dicts of at most ``size`` records each, in order."""
        raise NotImplementedError

    def use_split(self, is_validation: Any) -> Any:
        """Learn which records go to validation (a bool per record; None: no split) before
        ``chunks``: what the source derives from its values (a CSV's mean fill) then comes from
        the train split only. Most sources derive nothing and return None; a source that yields
        other records than the mask was drawn over (packing several examples into one) sets
        ``records`` anew and returns the split of the records it yields."""


class MappedSource(Source):
    """Another source's records, each chunk passed through ``fn`` before it is written.

    Where a per-record transform goes: a ``--tokenize PRESET`` would map a chunk's text columns
    (lists of UTF-8 bytes) to token ids (int64 arrays of ``[records, sequence_length]``), a chunk
    at a time so the tokenizer works on batches, and declare the features it yields.

    Args:
        source: the opened source.
        fn: ``{feature: column}`` -> ``{feature: column}``, the same number of records.
        features: the features ``fn`` yields, in the config's form; the source's when None.
        nbytes: the estimated size of the records ``fn`` yields; the source's when None.
        layout: entries added to the source's layout (the schema file's top level), such as
            what the records were tokenised with.
    """

    def __init__(
        self,
        source: Source,
        fn: Callable[[dict[str, Any]], dict[str, Any]],
        features: dict[str, dict[str, Any]] | None = None,
        nbytes: int | None = None,
        layout: dict[str, Any] | None = None,
    ):
        self._source, self._fn = source, fn
        self.path, self.records = source.path, source.records
        self.features = dict(source.features if features is None else features)
        self.nbytes = source.nbytes if nbytes is None else nbytes
        self.class_names, self.layout = source.class_names, {**source.layout, **(layout or {})}
        self.warnings = list(source.warnings)

    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        for chunk in self._source.chunks(size):
            yield self._fn(chunk)

    def use_split(self, is_validation: Any) -> Any:
        return self._source.use_split(is_validation)
