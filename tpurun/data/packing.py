"""Packing a causal LM's short examples into full sequences: ``tpurun data write --tokenize
PRESET --packing``.

A tokenised example fills its ``N + 1`` positions and pads the rest; with short examples a batch
is mostly padding, computed and thrown away. Packing writes several examples one after another in
each training record, placed first-fit in the source's order (each example goes into the first of
the last :data:`OPEN` records with room for it, else starts a new one): deterministic, and nearly
as full as sorting by length, without grouping examples by length.

Why when the records are written, not in the input pipeline: the records are then ordinary
tokenised records of ``N + 1`` positions, so everything a run counts stays exact (steps per epoch
from the record count, a resume at a record, each host's share of the files) and both readers
(native and ``tf.data``) feed them as they are. Packed in the pipeline, a pass's sequence count
would depend on its shuffle. The price: examples share a record in the same groups every epoch
(the records themselves are shuffled).

What a packed record holds: each example's ``token_ids``, ``padding_mask`` and ``weights`` as
written unpacked, laid end to end. An example's first position weighs 0 (its start token, or its
template's first marker), so no example learns to predict the next one's first token. KerasHub
0.32's causal LM backbones take a padding mask only (no segment ids), so an example attends to
the examples before it in its record, and positions run on across them.

The validation split is never packed: exact validation scores every example once, as it would
unpacked. The train split is held in memory while it is packed (its tokens, unpadded).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tpurun.data.sources.base import Source

#: Records still open for examples while packing: the search for room looks at these alone.
OPEN = 64
FEATURES = ("token_ids", "padding_mask", "weights")


def first_fit(lengths: list[int], capacity: int, open_records: int = OPEN) -> list[list[int]]:
    """The examples (indices into ``lengths``) of each packed record, in order.

    Each example goes into the first open record with room for it; a record closes when it is
    full or when more than ``open_records`` are open (the oldest closes).
    """
    records: list[list[int]] = []
    room: list[int] = []
    open_: list[int] = []
    for i, n in enumerate(lengths):
        chosen = next((r for r in open_ if room[r] >= n), None)
        if chosen is None:
            chosen = len(records)
            records.append([])
            room.append(capacity)
            open_.append(chosen)
            if len(open_) > open_records:
                open_.pop(0)
        records[chosen].append(i)
        room[chosen] -= n
        if room[chosen] == 0:
            open_.remove(chosen)
    return records


class PackedSource(Source):
    """A tokenised causal LM source whose train split is packed (see the module docstring)."""

    def __init__(self, source: Source):
        self._source = source
        self.path, self.records, self.nbytes = source.path, source.records, source.nbytes
        self.features, self.class_names = source.features, source.class_names
        self.layout, self.warnings = dict(source.layout), source.warnings
        self._rows: dict[str, Any] = {}

    def use_split(self, is_validation: Any) -> Any:
        import numpy as np

        self._source.use_split(is_validation)
        train: list[tuple[Any, Any]] = []
        kept: dict[str, list] = {name: [] for name in FEATURES}
        pad, done = None, 0
        for chunk in self._source.chunks(4096):
            rows = len(chunk["token_ids"])
            for i in range(rows):
                n = int(chunk["padding_mask"][i].sum())
                if pad is None and n < chunk["token_ids"].shape[1]:
                    pad = int(chunk["token_ids"][i, n])
                if is_validation is not None and is_validation[done + i]:
                    for name in FEATURES:
                        kept[name].append(chunk[name][i])
                else:
                    ids, weights = chunk["token_ids"][i, :n], chunk["weights"][i, :n]
                    train.append((ids.astype(np.int32), weights.astype(np.int8)))
            done += rows
        capacity = self._source.features["token_ids"]["shape"][0]
        lengths = [len(ids) for ids, _ in train]
        packed = first_fit(lengths, capacity)
        self._rows = _laid_out(train, packed, capacity, 0 if pad is None else pad, kept)
        validation = len(kept["token_ids"])
        self.records = len(packed) + validation
        self.nbytes = self._source.nbytes * self.records // max(1, self._source.records)
        tokens = sum(lengths)
        entry = dict(self.layout["tokenized"])
        entry["packing"] = {
            "examples": len(train),
            "records": len(packed),
            "padding": round(1 - tokens / max(1, len(packed) * capacity), 4),
            "padding_unpacked": round(1 - tokens / max(1, len(train) * capacity), 4),
        }
        self.layout["tokenized"] = entry
        if is_validation is None:
            return None
        return np.arange(self.records) >= len(packed)  # the packed train records come first

    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        for start in range(0, self.records, size):
            yield {name: rows[start : start + size] for name, rows in self._rows.items()}


def _laid_out(train, packed, capacity: int, pad: int, kept: dict[str, list]) -> dict[str, Any]:
    """The packed train records, then the validation records as they were, as int64 columns."""
    import numpy as np

    n = len(packed) + len(kept["token_ids"])
    token_ids = np.full((n, capacity), pad, np.int64)
    mask = np.zeros((n, capacity), np.int64)
    weights = np.zeros((n, capacity), np.int64)
    for row, members in enumerate(packed):
        at = 0
        for i in members:
            ids, weighted = train[i]
            token_ids[row, at : at + len(ids)] = ids
            weights[row, at : at + len(ids)] = weighted
            at += len(ids)
        mask[row, :at] = 1
    for column, name in ((token_ids, "token_ids"), (mask, "padding_mask"), (weights, "weights")):
        if kept[name]:
            column[len(packed) :] = np.stack(kept[name])
    return {"token_ids": token_ids, "padding_mask": mask, "weights": weights}
