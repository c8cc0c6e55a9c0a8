"""TFRecord files read and written without TensorFlow: each record framed with its CRC32C checks.

A TFRecord file is a sequence of records, each framed as TensorFlow's ``record_writer.cc`` writes
it::

    uint64 length (little-endian)
    uint32 masked CRC32C of the 8 length bytes
    byte   data[length]
    uint32 masked CRC32C of the data

where a CRC is masked as ``((crc >> 15) | (crc << 17)) + 0xa282ead8`` (32 bits). A GZIP file is
the same bytes, gzip-compressed as one stream (several concatenated streams are read too).

Reading streams a file in large blocks through :func:`tpurun.storage.fileio.open_binary` (local
or ``gs://``) and checks both CRCs of every record; damage raises :class:`DamagedRecord`, naming
the file, the record and where it starts; a file whose first record does not frame and whose bytes
are another known kind of file (CSV, JSONL, an image, ...) raises :class:`~tpurun.data.sniff.NotTFRecords`
instead. It is stricter than TensorFlow's reader in one way: a
record header cut short by the end of the file is damage here, where TensorFlow ends the file
there without a word.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

import google_crc32c

from tpurun.data import sniff
from tpurun.errors import DataError
from tpurun.storage import fileio

#: Bytes of framing around each record's data: length (8), its CRC (4), the data's CRC (4).
FRAMING = 16
_HEADER = 12
_MASK_DELTA = 0xA282EAD8
#: Bytes read (or decompressed) at a time: 256 KiB read records of 2-4 kB with 17-39% less CPU
#: than 1 MiB did here (each fresh MiB costs the system page faults), small ones 4% less.
_BLOCK = 1 << 18
_GZIP_WBITS = 16 + zlib.MAX_WBITS  # a gzip header and trailer around the deflate stream
_crc = google_crc32c.value
_unpack_header = struct.Struct("<QI").unpack_from
_unpack_crc = struct.Struct("<I").unpack_from

TRUNCATED = "truncated record"
CORRUPTED = "corrupted record (checksum mismatch)"
NOT_TFRECORD = "not a TFRecord file, or one truncated in its header"


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32C of ``data``."""
    crc = _crc(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def where_damaged(reason: str, offset: int | None, good: int, compression: str = "none") -> str:
    """``truncated record at byte 1662, after 19 good records``: what is wrong, and where."""
    at = ""
    if offset is not None:
        of = " of the decompressed data" if compression == "gzip" else ""
        at = f" at byte {offset}{of}"
    if not good:
        return f"{reason}{at} (the first record)" if at else reason
    return f"{reason}{at}, after {good} good record{'' if good == 1 else 's'}"


class DamagedRecord(DataError):
    """A TFRecord file cannot be read past one of its records.

    Attributes:
        path: the file.
        index: the damaged record's number, from 0: the good records before it.
        offset: where that record starts, in bytes of the file (of its decompressed data when
            ``compression`` is "gzip"); None when the reader cannot tell (a GZIP data error).
        reason: ``truncated record``, ``corrupted record (checksum mismatch)``,
            ``GZIP data error (...)`` or ``not a TFRecord file, or one truncated in its header``.
        compression: "none" or "gzip", which says what ``offset`` counts.
    """

    def __init__(
        self, path: str, index: int, offset: int | None, reason: str, compression: str = "none"
    ):
        self.path, self.index, self.offset = path, index, offset
        self.reason, self.compression = reason, compression
        super().__init__(
            f"{path}: cannot read it as TFRecords: "
            f"{where_damaged(reason, offset, index, compression)}. Re-copy or re-write the file."
        )


# ---------------------------------------------------------------------------------- blocks
class _GzipDamage(Exception):
    """The gzip stream itself is damaged: zlib's words for it."""


class _CutShort(Exception):
    """The gzip stream ends inside a member's compressed data: what follows is lost."""


def _blocks(path: str, compression: str) -> Iterator[bytes]:
    """The file's bytes (decompressed for "gzip"), in blocks of about ``_BLOCK``.

    Raises:
        _GzipDamage: the gzip stream is damaged (zlib fails a whole block at once).
        _CutShort: after the last block, when the gzip stream was cut short.
    """
    if compression not in ("none", "gzip"):
        raise ValueError(f"compression must be 'none' or 'gzip'; received {compression!r}")
    with fileio.open_binary(path) as f:
        if compression == "none":
            while block := f.read(_BLOCK):
                yield block
        else:
            yield from _inflated(f)


def _gzip_header(data: bytes) -> int | None:
    """The length of the gzip member header at the start of ``data``; None while incomplete."""
    if data[:3] != b"\x1f\x8b\x08"[: len(data[:3])]:
        raise _GzipDamage("incorrect header check")
    if len(data) < 10:
        return None
    flags, pos = data[3], 10
    if flags & 4:  # FEXTRA: a length, then that many bytes
        if len(data) < 12:
            return None
        pos += 2 + int.from_bytes(data[10:12], "little")
    for flag in (8, 16):  # FNAME, FCOMMENT: zero-terminated
        if flags & flag:
            end = data.find(b"\0", pos)
            if end < 0:
                return None
            pos = end + 1
    pos += 2 if flags & 2 else 0  # FHCRC
    return pos if pos <= len(data) else None


def _inflated(f: Any) -> Iterator[bytes]:
    """Gzip members one after another, each a header, raw deflate data and an 8-byte trailer.

    The deflate data is inflated raw so that its end is known: a stream cut inside it is cut
    short (``_CutShort``), while one missing only (part of) its trailer lost nothing, and is read
    as TensorFlow reads it. A whole trailer is checked (CRC-32 and length) before the data of its
    block is handed on, as zlib's own gzip mode would.
    """
    data, inflate, crc, size = b"", None, 0, 0
    while True:
        if inflate is None or not data:
            more = f.read(_BLOCK)
            if not more and (not data or inflate is None and _gzip_header(data) is None):
                break
            data += more
        if inflate is None:
            start = _gzip_header(data)
            if start is None:
                continue
            inflate, crc, size, data = zlib.decompressobj(-zlib.MAX_WBITS), 0, 0, data[start:]
        try:
            block = inflate.decompress(data)
        except zlib.error as exc:
            raise _GzipDamage(str(exc).split(": ", 1)[-1]) from None
        crc, size, data = zlib.crc32(block, crc), size + len(block), b""
        if inflate.eof:
            data = inflate.unused_data
            if len(data) < 8:
                data += f.read(8 - len(data))
            if len(data) >= 8:  # a trailer cut off at the end of the file is not checked
                if int.from_bytes(data[:4], "little") != crc:
                    raise _GzipDamage("incorrect data check")
                if int.from_bytes(data[4:8], "little") != size & 0xFFFFFFFF:
                    raise _GzipDamage("incorrect length check")
            data, inflate = data[8:], None
        if block:
            yield block
    if inflate is not None or data:
        raise _CutShort


# --------------------------------------------------------------------------------- reading
def iter_records(path: str, compression: str = "none") -> Iterator[bytes]:
    """The records of one TFRecord file, in order, streamed (the file is never held whole).

    Args:
        path: a local, ``gs://`` or ``ram://`` path.
        compression: "none" or "gzip".

    Raises:
        DamagedRecord: a record is cut short, fails a CRC, or the gzip stream is damaged; the
            records before it have been yielded.
        NotTFRecords: the first record does not frame, and the file is another kind of file.
        StorageError: a remote file cannot be read (unreachable, no permission).
    """
    blocks = _blocks(path, compression)
    refill = _Refill(blocks)
    buffer, pos, consumed, index = b"", 0, 0, 0  # consumed: stream bytes before buffer[0]
    crc, unpack_header, unpack_crc = _crc, _unpack_header, _unpack_crc  # locals: the hot loop
    # The last length whose CRC checked, and that CRC: the 8 length bytes are the length itself,
    # so a record of the same length with the same stored CRC passes the same check (records of
    # one length, as fixed layouts write them, are checked once; any other length or CRC, damage
    # included, is checked in full).
    checked_length, checked_crc = -1, -1
    try:
        while True:
            limit, need = len(buffer), _HEADER
            while pos + _HEADER <= limit:  # the records whole in the buffer, without a call
                length, length_crc = unpack_header(buffer, pos)
                if length != checked_length or length_crc != checked_crc:
                    masked = crc(buffer[pos : pos + 8])
                    if (((masked >> 15) | (masked << 17)) + _MASK_DELTA) & 0xFFFFFFFF != length_crc:
                        if not index:
                            sniff.refuse(path, buffer, compression)
                        raise DamagedRecord(path, index, consumed + pos, CORRUPTED, compression)
                    checked_length, checked_crc = length, length_crc
                end = pos + _HEADER + length + 4
                if end > limit:
                    need = _HEADER + length + 4
                    break
                data = buffer[pos + _HEADER : end - 4]
                masked = crc(data)
                if (((masked >> 15) | (masked << 17)) + _MASK_DELTA) & 0xFFFFFFFF != unpack_crc(
                    buffer, end - 4
                )[0]:
                    raise DamagedRecord(path, index, consumed + pos, CORRUPTED, compression)
                yield data
                pos, index = end, index + 1
            consumed += pos
            buffer, pos, have, cut = refill(buffer[pos:], need)
            consumed -= pos  # buffer[pos] is where the rest began
            if have < need:
                if have or cut:
                    if not index:
                        sniff.refuse(path, buffer, compression)
                    reason = NOT_TFRECORD if have < _HEADER and not index else TRUNCATED
                    raise DamagedRecord(path, index, consumed + pos, reason, compression)
                return
    except _GzipDamage as exc:
        raise DamagedRecord(path, index, None, f"GZIP data error ({exc})", compression) from None
    finally:
        blocks.close()


class _Refill:
    """The reader's next buffer, from the rest of its last one and the blocks after it.

    A block is read in place where the rest is empty and it holds the next record's first
    ``need`` bytes; otherwise the rest and just the bytes that complete the wanted ``need`` are
    joined into a short bridge, and the block they were cut from is read in place after it. (The
    rest joined with whole blocks copied every byte once more, into fresh memory: framing 1,024
    records of 4 kB took 2.8 ms that way, and takes 1.4 ms this way.)
    """

    def __init__(self, blocks: Iterator[bytes]):
        self.blocks = blocks
        self.spare, self.spare_at = b"", 0  # read, not yet in a buffer: spare[spare_at:]

    def __call__(self, rest: bytes, need: int) -> tuple[bytes, int, int, bool]:
        """``(buffer, pos, have, cut)``: ``buffer[pos:]`` starts with ``rest``; ``have``: its
        bytes from ``pos`` (less than ``need`` only at the stream's end); ``cut``: the gzip stream
        was cut short."""
        spare, at = self.spare, self.spare_at
        self.spare, self.spare_at = b"", 0
        cut = False
        if not rest:
            if at >= len(spare):
                try:
                    spare, at = next(self.blocks, b""), 0
                except _CutShort:
                    spare, at, cut = b"", 0, True
            if len(spare) - at >= need or not spare:
                return spare, at, len(spare) - at, cut
        pieces, have = [rest] if rest else [], len(rest)
        while not cut:
            if at < len(spare):
                if have + len(spare) - at > need:  # a bridge to the record's end, then the block
                    take = at + need - have
                    pieces.append(spare[at:take])
                    self.spare, self.spare_at = spare, take
                    return b"".join(pieces), 0, need, False
                pieces.append(spare[at:] if at else spare)
                have += len(spare) - at
                if have == need:
                    break
            try:
                spare, at = next(self.blocks, b""), 0  # blocks are never empty: b"" is the end
            except _CutShort:
                cut = True
                break
            if not spare:
                break
        return b"".join(pieces), 0, have, cut


def scan(path: str, compression: str = "none") -> tuple[int, int] | DamagedRecord:
    """Read a file through, checking every CRC: ``(records, data bytes)``, or where it is damaged.

    Returns:
        The record count and the sum of their lengths; or, for a damaged file, the
        :class:`DamagedRecord` (returned, not raised), whose ``index`` is the good records.

    Raises:
        NotTFRecords: the file is another kind of file (CSV, JSONL, an image, ...).
        StorageError: a remote file cannot be read (unreachable, no permission).
    """
    count = nbytes = 0
    try:
        for record in iter_records(path, compression):
            count += 1
            nbytes += len(record)
    except DamagedRecord as exc:
        return exc
    return count, nbytes


# --------------------------------------------------------------------------------- writing
def frame(record: bytes) -> bytes:
    """One record with its TFRecord framing."""
    header = struct.pack("<Q", len(record))
    return b"".join(
        (
            header,
            struct.pack("<I", masked_crc(header)),
            record,
            struct.pack("<I", masked_crc(record)),
        )
    )


class RecordWriter:
    """Writes framed records into one file, buffered, gzip-compressed for "gzip".

    A context manager; ``close`` (or leaving the ``with``) flushes and closes the file. Remote
    paths go through :func:`tpurun.storage.fileio.open_binary`.
    """

    def __init__(self, path: str, compression: str = "none"):
        if compression not in ("none", "gzip"):
            raise ValueError(f"compression must be 'none' or 'gzip'; received {compression!r}")
        self.path = path
        self._file = fileio.open_binary(path, "wb")
        self._deflate = (
            zlib.compressobj(6, zlib.DEFLATED, _GZIP_WBITS) if compression == "gzip" else None
        )
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self.records = 0

    def write(self, record: bytes) -> None:
        framed = frame(record)
        self._pending.append(framed)
        self._pending_bytes += len(framed)
        self.records += 1
        if self._pending_bytes >= _BLOCK:
            self._flush()

    def _flush(self) -> None:
        data = b"".join(self._pending)
        self._pending, self._pending_bytes = [], 0
        if self._deflate is not None:
            data = self._deflate.compress(data)
        if data:
            self._file.write(data)

    def close(self) -> None:
        if self._file is None:
            return
        try:
            self._flush()
            if self._deflate is not None:
                self._file.write(self._deflate.flush())
        finally:
            file, self._file = self._file, None
            file.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_records(path: str, records: Iterable[bytes], compression: str = "none") -> int:
    """Write ``records`` as one TFRecord file (replacing it); return how many were written."""
    with RecordWriter(path, compression) as writer:
        for record in records:
            writer.write(record)
    return writer.records
