"""A whole batch of ``tf.train.Example`` records parsed at once, where its records share one layout.

Most datasets hold records that differ only in their values: the same keys in the same order,
each list of the same length. Where every value the model reads has a fixed size in bytes (raw
bytes of a fixed dtype and shape; a float list, packed float32; an int64 list whose every value is
0-127, one byte each), such records also have the same length and the same bytes everywhere but in
the values. :class:`FixedLayout` finds that layout in one record, with a small walker over the
protobuf wire format::

    Example   1: Features (the one field, the whole record)
    Features  1: map entry, repeated      entry: 1 key (string), 2 Feature
    Feature   1 bytes_list | 2 float_list | 3 int64_list   each: 1 value (float, int64: packed)

and then checks a batch against it with numpy, as a ``(records, bytes)`` array: each record of the
template's length, the same bytes outside the values, and one-byte varints (every byte < 0x80)
where the template has int64 values. Such records parse, by protobuf as by TensorFlow, to the
template's structure with their own values, so each feature is a column of that array, viewed as
its dtype (little-endian, as on the wire).

Anything else is not a layout here: another length or structure, a multi-byte varint (values
over 127, negative ones), a feature that is not fixed in size (text, images, bytes), unpacked
lists, repeated or unknown fields. Such a batch goes on to :mod:`tpurun.data.native.varying`
(records of one structure, of varying lengths), or else to the per-record parser. A batch is
either taken whole or not at all, so the per-record parser gives every result and every error it
gives today.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf.message import DecodeError

from tpurun.data.native import example
from tpurun.data.native.recycle import BatchArrays

_KINDS = {0x0A: "bytes_list", 0x12: "float_list", 0x1A: "int64_list"}  # Feature's tags
_LEN_1 = 0x0A  # field 1, length-delimited: Example.features, a map entry, its key, a list's value
_LEN_2 = 0x12  # field 2, length-delimited: the map entry's Feature
_JOIN_BYTES = 1 << 16  # batches up to this size are joined into a new bytes object


@dataclass(frozen=True)
class Wanted:
    """A feature the model reads, as its layout must hold it.

    Attributes:
        key: the record key.
        kind: ``bytes_list`` (one value: raw bytes), ``float_list`` or ``int64_list``.
        nbytes: the value's size in bytes (an int64 list: its count, one byte each).
        dtype: what its bytes are (``uint8`` for an int64 list: each byte is the value).
        shape: one record's shape.
        cast: the dtype the values end in (None: as parsed), which an int64 list may be cast to
            straight from its small values, as it would be from int64.
    """

    key: str
    kind: str
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    cast: np.dtype | None = None

    def ints(self, values: np.ndarray, arrays: BatchArrays | None = None) -> np.ndarray:
        """Int64 values (held in any integer dtype that holds them), as int64 or as cast: a
        copy, in ``arrays``' when given."""
        dtype = self.cast or np.int64
        with np.errstate(all="ignore"):  # as the cast from int64 (decode._cast)
            return values.astype(dtype) if arrays is None else arrays.cast(values, dtype)


def agrees_with_protobuf(
    record: bytes, values: Sequence[np.ndarray], wanted: Sequence[Wanted]
) -> bool:
    """Whether a layout's ``values`` of one record are what protobuf parses from it (a check
    on each layout a parser learns: where they disagree, protobuf decides)."""
    try:
        stored = example.parse(record).features.feature
    except DecodeError:
        return False
    for want, found in zip(wanted, values, strict=True):
        kept = getattr(stored[want.key], want.kind).value
        if want.kind == "bytes_list":
            kept = bytes(kept[0])
        elif want.kind == "float_list":
            kept = np.asarray(kept, np.float32).tobytes()
        else:
            kept = want.ints(np.asarray(kept, np.int64)).tobytes()
        if found.tobytes() != kept:
            return False
    return True


class NotALayout(Exception):
    """The record is not laid out as this module reads layouts."""


@dataclass(frozen=True)
class _Template:
    """One record's layout: its length, the bytes every record must share, where the values are."""

    length: int
    fixed_at: np.ndarray  # positions of the bytes outside the values
    fixed: np.ndarray  # their values
    small_at: np.ndarray  # positions of int64 values' bytes (each must be < 0x80)
    offsets: tuple[int, ...]  # each wanted feature's value, in the order wanted


class FixedLayout:
    """Parses a batch at once when its records share the layout of the last one that did.

    Args:
        wanted: the features to return, in order.
    """

    def __init__(self, wanted: Sequence[Wanted], arrays: BatchArrays | None = None):
        self.wanted = tuple(wanted)
        self.arrays = arrays or BatchArrays()  # the batches' arrays
        self._template: _Template | None = None
        self._scratch = threading.local()  # per thread: parse workers share the parser

    def parse(self, records: Sequence[bytes]) -> list[np.ndarray] | None:
        """Each wanted feature of every record, as an array ``(len(records), *shape)``, or None
        where the batch does not share one layout (parse it record by record then)."""
        stacked = None
        if records and len(set(map(len, records))) == 1:
            template = self._template
            stacked = self._stacked(records, template) if template is not None else None
            if stacked is None:  # a first batch, or the layout changed (new keys, new sizes)
                template = self._learn(records[0])
                stacked = self._stacked(records, template) if template is not None else None
        if stacked is None:
            return None
        self._template = template
        return _columns(stacked, template, self.wanted, self.arrays)

    def _learn(self, record: bytes) -> _Template | None:
        """The template of ``record``, checked against protobuf's own parse of it."""
        try:
            template = _template(record, self.wanted)
        except NotALayout:
            return None
        one = _columns(
            np.frombuffer(record, np.uint8).reshape(1, -1), template, self.wanted, self.arrays
        )
        return template if agrees_with_protobuf(record, one, self.wanted) else None

    def _stacked(self, records: Sequence[bytes], template: _Template) -> np.ndarray | None:
        """The records as rows of one ``uint8`` array, or None where one leaves the template."""
        length = template.length
        if len(records[0]) != length:
            return None
        size = len(records) * length
        if size <= _JOIN_BYTES:
            data: bytes | bytearray = b"".join(records)
        else:
            # A large batch goes into a buffer kept from batch to batch: a fresh one each time
            # costs the system's page faults, several times the copy itself.
            data = getattr(self._scratch, "buffer", b"")
            if len(data) < size:
                data = self._scratch.buffer = bytearray(size)
            view, pos = memoryview(data), 0
            for record in records:
                view[pos : pos + length] = record
                pos += length
        stacked = np.frombuffer(data, np.uint8, size).reshape(len(records), length)
        return stacked if _fits(stacked, template) else None


def _fits(stacked: np.ndarray, template: _Template) -> bool:
    """Whether every row has the template's bytes outside its values, and one-byte varints."""
    if not (stacked[:, template.fixed_at] == template.fixed).all():
        return False
    return not (template.small_at.size and stacked[:, template.small_at].max() >= 0x80)


def _columns(
    stacked: np.ndarray, template: _Template, wanted: Sequence[Wanted], arrays: BatchArrays
) -> list:
    """Each wanted feature, a slice of the stacked records copied out as its values, into
    ``arrays``' arrays."""
    n, out = len(stacked), []
    for offset, want in zip(template.offsets, wanted, strict=True):
        values = stacked[:, offset : offset + want.nbytes]
        if want.kind == "int64_list":
            array = want.ints(values, arrays)
        else:
            array = arrays.empty((n, want.nbytes), np.uint8)  # aligned and writable, as TF's are
            array[:] = values
            array = array.view(want.dtype)
            if want.kind == "float_list":  # float32 as the per-record parser makes it
                array = array.astype(np.float32, copy=False)
        out.append(array.reshape(n, *want.shape))
    return out


# ---------------------------------------------------------------------------- the wire walker
def _length(record: bytes, pos: int, end: int) -> tuple[int, int]:
    """A length varint at ``pos``: (the length, where what it measures starts); it must fit."""
    length = shift = 0
    while True:
        if pos >= end or shift > 28:
            raise NotALayout
        byte = record[pos]
        length |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            break
    if pos + length > end:
        raise NotALayout
    return length, pos


def _field(record: bytes, pos: int, end: int, tag: int) -> tuple[int, int]:
    """The length-delimited field ``tag`` at ``pos``: (where its contents start, where they end)."""
    if pos >= end or record[pos] != tag:
        raise NotALayout
    length, start = _length(record, pos + 1, end)
    return start, start + length


def _values(record: bytes, pos: int, end: int) -> list[tuple[int, int]]:
    """A list's values, as ``(start, end)`` spans: each value of a bytes list; each packed run of
    a float or int64 list (one, as writers write them; several are read one after another)."""
    spans = []
    while pos < end:
        start, stop = _field(record, pos, end, _LEN_1)
        spans.append((start, stop))
        pos = stop
    return spans  # a float run of broken floats: protobuf refuses the record (FixedLayout._learn)


def features(record: bytes) -> dict[str, tuple[str | None, list[tuple[int, int]]]]:
    """Every feature of the record: its kind (None: a Feature with none) and its value spans."""
    start, end = _field(record, 0, len(record), _LEN_1)
    if end != len(record):
        raise NotALayout
    found: dict[str, tuple[str | None, list[tuple[int, int]]]] = {}
    pos = start
    while pos < end:
        entry, entry_end = _field(record, pos, end, _LEN_1)
        key_start, key_end = _field(record, entry, entry_end, _LEN_1)
        feature, feature_end = _field(record, key_end, entry_end, _LEN_2)
        try:
            key = record[key_start:key_end].decode("utf-8")
        except UnicodeDecodeError:
            raise NotALayout from None
        if feature_end != entry_end or key in found:
            raise NotALayout
        kind = None
        spans: list[tuple[int, int]] = []
        if feature < feature_end:
            kind = _KINDS.get(record[feature])
            if kind is None:
                raise NotALayout
            lists, lists_end = _field(record, feature, feature_end, record[feature])
            if lists_end != feature_end:
                raise NotALayout
            spans = _values(record, lists, lists_end)
        found[key] = (kind, spans)
        pos = entry_end
    return found


def _template(record: bytes, wanted: Sequence[Wanted]) -> _Template:
    """The layout of ``record``, where it holds every wanted feature in a fixed size.

    Raises:
        NotALayout: it does not (the per-record parser then says what is wrong, if anything).
    """
    found = features(record)
    raw = np.frombuffer(record, np.uint8)
    offsets = []
    for want in wanted:
        kind, spans = found.get(want.key, (None, []))
        sizes = [stop - start for start, stop in spans]
        if kind != want.kind or sizes != [want.nbytes]:
            raise NotALayout
        start = spans[0][0]
        if kind == "int64_list" and raw[start : start + want.nbytes].max() >= 0x80:
            raise NotALayout  # a value over 127 or negative: several bytes, other lengths
        offsets.append(start)
    fixed = np.ones(len(record), bool)
    small = np.zeros(len(record), bool)
    for kind, spans in found.values():
        for start, stop in spans:
            if kind == "int64_list" and raw[start:stop].max(initial=0) >= 0x80:
                continue  # multi-byte varints of a feature not read: kept as they are
            fixed[start:stop] = False
            small[start:stop] = kind == "int64_list"
    return _Template(
        len(record), np.flatnonzero(fixed), raw[fixed].copy(), np.flatnonzero(small), tuple(offsets)
    )
