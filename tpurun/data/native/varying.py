"""A batch of ``tf.train.Example`` records of one structure, whose lists vary in length, parsed at
once with numpy.

Tokenised text is the case: every record holds the same keys in the same order (``token_ids``,
``padding_mask``, ``weights``), each an int64 list of the same count, but token ids of 128 and
more take two or three bytes each, so the records' lengths differ and
:class:`~tpurun.data.native.layout.FixedLayout` cannot take them. Here the structure (the keys in
order, each one's list kind and number of value runs) is learnt from one record by
:func:`tpurun.data.native.layout.features`, then every record of the batch is walked at once: one
step of the wire format (a tag, a length varint, a key) for all the records together, each check
a numpy comparison. Int64 values are decoded with numpy too: the bytes below 0x80 end a varint,
and each value is gathered from its last byte back to its first.

The walk checks everything protobuf would: each tag and key, each length within its message,
whole floats, int64 runs that end on a varint's last byte with no varint over ten bytes. A batch
that leaves the structure anywhere (another key, another kind, another number of runs, a value
over 2**63 - 1 or negative in a feature read, a wanted feature of another size) is handed back,
and the per-record parser gives its results and its errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tpurun.data.native.layout import NotALayout, Wanted, agrees_with_protobuf, features
from tpurun.data.native.recycle import BatchArrays

_TAGS = {"bytes_list": 0x0A, "float_list": 0x12, "int64_list": 0x1A}
_PAD = 64  # bytes after the records: reads a few bytes past a record's end stay in the buffer
_FIVE = np.arange(5)  # a length varint: up to 5 bytes
_SHIFTS = 7 * _FIVE
_MAX_VARINT = 10  # protobuf's longest; a feature read takes 9 (values 0 to 2**63 - 1)
#: The walk costs about as much per feature as the per-record parser spends on this many bytes
#: of records (measured: ~70 us a feature against ~1 us + 12 ns a byte for each record).
_BYTES_PER_FEATURE = 6000


@dataclass(frozen=True)
class _Entry:
    """One feature of the structure: its map entry from the key to the Feature's length."""

    head: np.ndarray  # the key's tag, length and bytes, then the Feature's tag
    kind: str | None  # None: a Feature with no list
    runs: int  # value runs in its list (one for a list read; each bytes value of a bytes list)
    wanted: tuple[int, ...]  # its places among the wanted features (none: not read)


class VaryingLayout:
    """Parses a batch at once when its records share the structure of the last one that did.

    Args:
        wanted: the features to return, in order.
    """

    def __init__(self, wanted: Sequence[Wanted], arrays: BatchArrays | None = None):
        self.wanted = tuple(wanted)
        self.arrays = arrays or BatchArrays()  # the batches' arrays
        self._structure: tuple[_Entry, ...] | None = None

    def parse(self, records: Sequence[bytes]) -> list[np.ndarray] | None:
        """Each wanted feature of every record, as an array ``(len(records), *shape)``, or None
        where the batch does not share one structure (parse it record by record then)."""
        arrays = None
        if records and self._pays(records):
            structure = self._structure
            arrays = self._parse(records, structure)
            if arrays is None:  # a first batch, or the structure changed
                structure = self._learn(records[0])
                arrays = self._parse(records, structure)
            if arrays is not None:
                self._structure = structure
        return arrays

    def _parse(
        self, records: Sequence[bytes], structure: tuple[_Entry, ...] | None
    ) -> list[np.ndarray] | None:
        return None if structure is None else _parse(records, structure, self.wanted, self.arrays)

    def _pays(self, records: Sequence[bytes]) -> bool:
        """Whether walking the batch costs less than parsing it record by record."""
        entries = len(self._structure) if self._structure is not None else len(self.wanted) + 1
        return entries * _BYTES_PER_FEATURE < len(records) * (len(records[0]) + 100)

    def _learn(self, record: bytes) -> tuple[_Entry, ...] | None:
        """The structure of ``record``, checked against protobuf's own parse of it."""
        try:
            structure = _structure(record, self.wanted)
        except NotALayout:
            return None
        one = _parse([record], structure, self.wanted, self.arrays)
        return (
            structure
            if one is not None and agrees_with_protobuf(record, one, self.wanted)
            else None
        )


def _structure(record: bytes, wanted: Sequence[Wanted]) -> tuple[_Entry, ...]:
    """The entries of ``record`` in order, where it holds every wanted feature as one run.

    Raises:
        NotALayout: it does not, or it is not laid out as the walker reads records.
    """
    found = features(record)
    for want in wanted:
        kind, spans = found.get(want.key, (None, []))
        if kind != want.kind or len(spans) != 1:
            raise NotALayout
    entries = []
    for key, (kind, spans) in found.items():
        name = key.encode()
        if len(name) > 127:
            raise NotALayout  # a key's length is one byte here
        head = np.frombuffer(bytes([0x0A, len(name)]) + name + b"\x12", np.uint8)
        places = tuple(i for i, want in enumerate(wanted) if want.key == key)
        entries.append(_Entry(head, kind, len(spans), places))
    return tuple(entries)


class _Mismatch(Exception):
    """A record of the batch leaves the structure."""


def _require(condition: np.ndarray | bool) -> None:
    if not np.all(condition):
        raise _Mismatch


class _Walk:
    """Every record of the batch, walked at once: ``pos[i]`` is where record ``i`` is read."""

    def __init__(self, records: Sequence[bytes]):
        lengths = np.fromiter(map(len, records), np.int64, len(records))
        self.end = np.cumsum(lengths)
        self.pos = self.end - lengths
        # Padded by a record's length: a window of any run's width fits from any run's start.
        pad = bytes(int(lengths.max(initial=0)) + _PAD)
        self.buf = np.frombuffer(b"".join([*records, pad]), np.uint8)
        self._stops: np.ndarray | None = None

    def stops(self) -> np.ndarray:
        """Where each byte below 0x80 is in the batch (each could end a varint)."""
        if self._stops is None:
            self._stops = np.flatnonzero(self.buf < 0x80)
        return self._stops

    def tag(self, tag: int, limit: np.ndarray) -> None:
        _require(self.pos < limit)
        _require(self.buf[self.pos] == tag)
        self.pos = self.pos + 1

    def length(self, limit: np.ndarray) -> np.ndarray:
        """A length varint at each record's position: where what it measures ends (within
        ``limit``); the position moves to where it starts."""
        _require(self.pos < limit)
        buf, pos = self.buf, self.pos
        first = buf[pos]
        one = first < 0x80
        if one.all():  # lengths below 128
            value, size = first.astype(np.int64), 1
        else:
            second = buf[pos + 1]
            if (one | (second < 0x80)).all():  # below 16384
                value = np.where(one, first, (first & 0x7F) | (second.astype(np.int64) << 7))
                size = 2 - one
            else:
                window = buf[pos[:, None] + _FIVE]
                last = window < 0x80
                _require(last.any(axis=1))
                size = last.argmax(axis=1) + 1
                used = _FIVE < size[:, None]
                value = (((window & 0x7F).astype(np.int64) << _SHIFTS) * used).sum(axis=1)
        self.pos = pos + size
        stop = self.pos + value
        _require(stop <= limit)
        return stop

    def bytes(self, expected: np.ndarray, limit: np.ndarray) -> None:
        _require(self.pos + len(expected) <= limit)
        _require(self.buf[self.pos[:, None] + np.arange(len(expected))] == expected)
        self.pos = self.pos + len(expected)


def _parse(
    records: Sequence[bytes],
    structure: tuple[_Entry, ...],
    wanted: Sequence[Wanted],
    arrays: BatchArrays,
) -> list[np.ndarray] | None:
    """The wanted features of every record (in ``arrays``' arrays), or None where one leaves
    ``structure``."""
    walk = _Walk(records)
    try:
        runs = _walk(walk, structure)
        return [_values(walk, start, stop, want, arrays)
                for (start, stop), want in zip(runs, wanted, strict=True)]  # fmt: skip
    except _Mismatch:
        return None


def _walk(walk: _Walk, structure: tuple[_Entry, ...]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Walks each record through ``structure``; returns each wanted feature's run (start, stop).

    Raises:
        _Mismatch: a record leaves the structure.
    """
    record_end = walk.end
    walk.tag(0x0A, record_end)
    _require(walk.length(record_end) == record_end)
    runs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for entry in structure:
        walk.tag(0x0A, record_end)
        entry_end = walk.length(record_end)
        walk.bytes(entry.head, entry_end)
        _require(walk.length(entry_end) == entry_end)
        if entry.kind is not None:
            walk.tag(_TAGS[entry.kind], entry_end)
            _require(walk.length(entry_end) == entry_end)
        for _ in range(entry.runs):
            walk.tag(0x0A, entry_end)
            stop = walk.length(entry_end)
            start, walk.pos = walk.pos, stop
            for place in entry.wanted:
                runs[place] = (start, stop)
            if not entry.wanted:
                _check_unread(walk, entry.kind, start, stop)
        _require(walk.pos == entry_end)
    _require(walk.pos == record_end)
    return [runs[i] for i in sorted(runs)]


def _check_unread(walk: _Walk, kind: str | None, start: np.ndarray, stop: np.ndarray) -> None:
    """A run of a feature not read must still parse: whole floats; varints that end in the run,
    none longer than ten bytes (the byte before a run, its length's last, is below 0x80)."""
    if kind == "float_list":
        _require((stop - start) % 4 == 0)
    elif kind == "int64_list":
        _require(walk.buf[stop[stop > start] - 1] < 0x80)
        if (stop - start).max(initial=0) <= _MAX_VARINT:
            return  # no run long enough to hold a varint too long (a scalar's, say)
        ends = walk.stops()
        long = np.flatnonzero(np.diff(ends) > _MAX_VARINT)
        if long.size:  # where 10 bytes >= 0x80 or more follow one another: inside no run
            first = ends[long] + 1
            run = np.searchsorted(start, first, side="right") - 1
            _require((run < 0) | (first >= stop[np.maximum(run, 0)]))


def _ends(walk: _Walk, start: np.ndarray, stop: np.ndarray, count: int) -> tuple:
    """Each run's bytes as a row of ``data``, after the four bytes before it (the last of them
    its length's last byte, below 0x80), and where each varint ends less three: ``data[3:][e]``
    is its last byte, ``data[2:][e]`` the byte before, and so on; ``count`` of them a row, the
    last on the run's last byte."""
    n, lengths = len(start), stop - start
    rows = sliding_window_view(walk.buf, int(lengths.max()) + 4)[start - 4]
    width = rows.shape[1]
    last = rows < 0x80
    last[:, :4] = False
    # The columns up to each run's last byte, compared in the narrowest integers that hold them:
    # on 1,024 rows of 1,291 bytes, 0.11 ms in uint16 against 0.45 ms in int64.
    columns = np.arange(width, dtype=np.uint16 if width <= 1 << 16 else np.int64)
    last &= columns <= (lengths + 3).astype(columns.dtype)[:, None]
    ends = np.flatnonzero(last.reshape(-1)[3:])
    _require(len(ends) == n * count)
    ends = ends.reshape(n, count)
    # Every ``count``-th end on a run's last byte: then each row holds exactly ``count``.
    _require(ends[:, -1] == np.arange(n) * width + lengths)
    return rows.reshape(-1), ends


def _values(
    walk: _Walk, start: np.ndarray, stop: np.ndarray, want: Wanted, arrays: BatchArrays
) -> np.ndarray:
    """A wanted feature's values, one row a record (in ``arrays``' arrays)."""
    n, buf = len(start), walk.buf
    if want.kind != "int64_list":  # raw bytes, packed floats: a fixed size in bytes
        _require(stop - start == want.nbytes)
        out = arrays.empty((n, want.nbytes), np.uint8)
        # mode="clip": the starts are in range, and "raise" would copy through a buffer first
        array = np.take(sliding_window_view(buf, want.nbytes), start, axis=0, out=out, mode="clip")
        array = array.view(want.dtype)
        if want.kind == "float_list":
            array = array.astype(np.float32, copy=False)
        return array.reshape(n, *want.shape)
    size = want.nbytes  # an int64 list: its count
    if np.all(stop - start == size):  # as many bytes as values: one byte each, if all < 0x80
        small = sliding_window_view(buf, size)[start]
        if small.max(initial=0) < 0x80:
            return want.ints(small, arrays).reshape(n, *want.shape)
    data, ends = _ends(walk, start, stop, size)
    values = _short_varints(data, ends)
    values = want.ints(values if values is not None else _varints(data, ends + 3), arrays)
    return values.reshape(n, *want.shape)


def _short_varints(data: np.ndarray, ends: np.ndarray) -> np.ndarray | None:
    """The values (int32) of varints of at most three bytes (below 2**21: token ids), from the
    bytes at and before each end (see :func:`_ends`); None where one is longer."""
    # np.take, not data[ends]: 0.18 ms against 0.24 ms a gather of 525k bytes.
    top, second, third, fourth = (np.take(data[3 - back :], ends) for back in range(4))
    two = second >> 7  # 1 where the varint has a second byte (the byte before is not a last)
    three = two & (third >> 7)
    if (three & (fourth >> 7)).any():
        return None
    values = top.astype(np.int32) << (7 * (two + three))
    values |= ((second & 0x7F) * two).astype(np.int32) << (7 * three)
    values |= (third & 0x7F) * three
    return values


def _varints(data: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The values of varints of up to nine bytes (0 to 2**63 - 1), from each one's last byte
    back to its first.

    Raises:
        _Mismatch: one of ten bytes: a negative value (or one past int64).
    """
    values = data[ends].astype(np.int64)
    before = ends - 1
    more = data[before] >= 0x80  # before a row's first varint: a byte below 0x80
    for _ in range(_MAX_VARINT - 2):
        if not more.any():
            return values
        values = np.where(more, (values << 7) | (data[before] & 0x7F), values)
        before -= 1
        more &= data[before] >= 0x80
    _require(~more)
    return values
