"""What a file given where TFRecords are expected is, when it is not one, and how to make TFRecords
of it.

Told from the file's content, never its name alone: the reader of TFRecords
(:func:`tpurun.data.native.framing.iter_records`, which every command's first check goes through,
whichever reader then trains) asks :func:`kind_of` about the first bytes of a file whose first
record does not frame. A known kind (CSV, JSONL, plain text, an image, Parquet, NumPy arrays, an
archive; inside gzip too) raises :class:`NotTFRecords`, which names it and the ``tpurun data write``
command that makes TFRecords of it; anything else stays a damaged TFRecord file. A command that
knows how the run's training data was written (its schema file) adds those flags
(:meth:`NotTFRecords.advised`).
"""

from __future__ import annotations

import csv
import shlex
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tpurun.errors import DataError

#: Bytes of a file looked at: enough for a CSV header and a row or two.
HEAD = 1 << 16
_GZIP = b"\x1f\x8b"


@dataclass(frozen=True)
class Kind:
    """What a file is: ``family`` picks the command that writes it as TFRecords."""

    said: str  # "a CSV file", "a gzip-compressed JSONL file", ...
    family: str  # csv, tsv, jsonl, json, text, image, parquet, numpy, zip, archive, hdf5, pdf
    gzip: bool = False


_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image", "image"),
    (b"\xff\xd8\xff", "a JPEG image", "image"),
    (b"GIF87a", "a GIF image", "image"),
    (b"GIF89a", "a GIF image", "image"),
    (b"PAR1", "a Parquet file", "parquet"),
    (b"\x93NUMPY", "a NumPy .npy array", "numpy"),
    (b"PK\x03\x04", "a zip archive", "zip"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file (such as Keras weights)", "hdf5"),
    (b"%PDF-", "a PDF document", "pdf"),
    (b"BZh", "a bzip2-compressed file", "archive"),
    (b"\xfd7zXZ\x00", "an xz-compressed file", "archive"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "archive"),
    (b"7z\xbc\xaf\x27\x1c", "a 7-Zip archive", "archive"),
)


def kind_of(head: bytes, name: str = "") -> Kind | None:
    """What the bytes at the start of a file say it is; None for none of the known kinds (a
    TFRecord file, a damaged one, or an unknown binary).

    Args:
        head: the file's first bytes (up to :data:`HEAD` are looked at).
        name: its path, only to tell a ``.npz`` from another zip archive.
    """
    head = head[:HEAD]
    if head.startswith(_GZIP):
        inner = kind_of(_gunzipped(head), name)
        if inner is None:
            return Kind("a gzip-compressed file", "archive", gzip=True)
        return Kind(f"a gzip-compressed {inner.said.split(' ', 1)[1]}", inner.family, gzip=True)
    for magic, said, family in _MAGIC:
        if head.startswith(magic):
            if family == "zip" and name.lower().endswith(".npz"):
                return Kind("a NumPy .npz archive", "numpy")
            return Kind(said, family)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return Kind("a WebP image", "image")
    if len(head) > 262 and head[257:262] == b"ustar":
        return Kind("a tar archive", "archive")
    text = _text(head)
    return None if text is None else _text_kind(text)


def _gunzipped(head: bytes) -> bytes:
    """As much of a gzip stream's start as ``head`` holds, inflated (b"" if it is damaged)."""
    try:
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, HEAD)
    except zlib.error:
        return b""


def _text(head: bytes) -> str | None:
    """``head`` as UTF-8 text (a character cut by the end of the head forgiven), or None where it
    holds bytes no text file holds."""
    head = head.removeprefix(b"\xef\xbb\xbf")
    if not head.strip():
        return None
    for cut in range(4):  # a multi-byte character may straddle the end of the head
        try:
            text = head[: len(head) - cut].decode("utf-8")
            break
        except UnicodeDecodeError:
            continue
    else:
        return None
    if any(ord(c) < 32 and c not in "\t\n\r\f" for c in text):
        return None
    return text


def _text_kind(text: str) -> Kind:
    lines = [line for line in text.splitlines() if line.strip()]
    first = lines[0].strip()
    if first.startswith("{"):
        return Kind("a JSONL file", "jsonl")
    if first.startswith("["):
        return Kind("a JSON file", "json")
    complete = lines[:-1] if len(lines) > 1 and not text.endswith("\n") else lines
    for delimiter, said, family in (
        (",", "a CSV file", "csv"),
        ("\t", "a tab-separated file", "tsv"),
    ):
        widths = {len(row) for row in csv.reader(complete[:20], delimiter=delimiter)}
        if len(widths) == 1 and widths.pop() > 1:
            return Kind(said, family)
    return Kind("a plain text file", "text")


# --------------------------------------------------------------------------------------- advice
def written_flags(schema: Mapping[str, Any] | None) -> list[str]:
    """The ``tpurun data write`` options a schema file says its records were written with:
    ``--label``, ``--pack``, ``--fill-missing``, ``--tokenize``/``--sequence-length``."""
    schema = schema or {}
    flags: list[str] = []
    if schema.get("label"):
        flags += ["--label", schema["label"]]
    for name, columns in (schema.get("packed") or {}).items():
        flags += ["--pack", f"{name}={','.join(columns)}"]
    fills = schema.get("fill_missing") or {}
    if fills:
        values = set(fills.values())
        flags += ["--fill-missing", f"{values.pop():g}" if len(values) == 1 else "mean"]
    tokenized = schema.get("tokenized") or {}
    if tokenized.get("preset"):
        flags += ["--tokenize", tokenized["preset"]]
        if tokenized.get("sequence_length"):
            flags += ["--sequence-length", str(tokenized["sequence_length"])]
    return flags


_THEN = ", then give OUT_PREFIX-*.tfrecord in its place."


def _advice(path: str, kind: Kind, flags: list[str]) -> str:
    """What to do to make TFRecords of ``path``: a sentence or two, each command in backticks."""
    quoted = shlex.quote(path)
    if kind.family in ("csv", "jsonl"):
        suffix = f".{kind.family}"
        if kind.family == "jsonl":
            flags = [f for i, f in enumerate(flags) if not _csv_only(flags, i)]
        options = "".join(f" {shlex.quote(f)}" for f in flags)
        how = " as the run's training data was" if flags else ""
        if kind.gzip or not path.lower().endswith((suffix, ".ndjson")):
            stem = path.rsplit("/", 1)[-1].removesuffix(".gz").rsplit(".", 1)[0] or "data"
            plain = shlex.quote(f"{stem}{suffix}")
            made = f"gunzip -c {quoted} > {plain}" if kind.gzip else f"cp {quoted} {plain}"
            return (
                f"Write it as TFRecords{how} (data write knows a {suffix} file by its name): "
                f"`{made} && tpurun data write {plain} OUT_PREFIX{options}`{_THEN}"
            )
        return (
            f"Write it as TFRecords{how}: `tpurun data write {quoted} OUT_PREFIX{options}`{_THEN}"
        )
    if kind.family == "numpy":
        return f"Write it as TFRecords: `tpurun data write {quoted} OUT_PREFIX`{_THEN}"
    if kind.family == "image":
        return (
            "Write the folder of images (one subfolder of images per class) as TFRecords: "
            f"`tpurun data write IMAGE_FOLDER OUT_PREFIX`{_THEN}"
        )
    if kind.family in ("tsv", "parquet"):
        read = "read_csv(PATH, sep='\\t')" if kind.family == "tsv" else "read_parquet(PATH)"
        return (
            f"Save it as CSV first (pandas: `pd.{read}.to_csv('data.csv', index=False)`), "
            "then `tpurun data write data.csv OUT_PREFIX`, and give OUT_PREFIX-*.tfrecord in "
            "its place."
        )
    if kind.family in ("json", "text"):
        return (
            'Write it as JSONL first (one JSON object a line, e.g. {"text": "..."}), then '
            "`tpurun data write RECORDS.jsonl OUT_PREFIX`, and give OUT_PREFIX-*.tfrecord in its "
            "place. (`tpurun predict` on a text "
            "model reads prompts from a text or JSONL file as they are.)"
        )
    unpack = "Unpack it, then write" if kind.family in ("zip", "archive") else "Write"
    return (
        f"{unpack} the data as TFRecords with `tpurun data write SOURCE OUT_PREFIX`: it "
        "reads CSV, JSONL and NumPy files, and folders of images."
    )


def _csv_only(flags: list[str], i: int) -> bool:
    """Whether ``flags[i]`` is ``--pack`` / ``--fill-missing`` or the value after one."""
    return flags[i] in ("--pack", "--fill-missing") or (
        i > 0 and flags[i - 1] in ("--pack", "--fill-missing")
    )


class NotTFRecords(DataError):
    """A file given where TFRecords are expected is another kind of file.

    Attributes:
        path: the file.
        kind: what it is.
        flags: the ``data write`` options of the run's training data, when a command knew them.
        key: the option or config key that named it (``--data``, ``data.validation``), or "".
    """

    def __init__(self, path: str, kind: Kind, flags: list[str] | None = None, key: str = ""):
        self.path, self.kind, self.flags, self.key = path, kind, list(flags or []), key
        where = f"{key}: " if key else ""
        super().__init__(
            f"{where}{path} is {kind.said}, not TFRecords (the tf.train.Example records tpurun "
            f"reads). {_advice(path, kind, self.flags)}"
        )

    def advised(self, schema: Mapping[str, Any] | None = None, key: str = "") -> NotTFRecords:
        """The same error, with the options ``schema`` (the run's training data's schema file)
        was written with, and the key that named the file."""
        return NotTFRecords(
            self.path, self.kind, written_flags(schema) or self.flags, key or self.key
        )


def refuse(path: str, head: bytes, compression: str = "none") -> None:
    """Raise :class:`NotTFRecords` when ``head`` (a file's first bytes, decompressed where
    ``compression`` is gzip) is a known kind of file that is not TFRecords.

    Raises:
        NotTFRecords: naming what it is and the command that makes TFRecords of it.
    """
    kind = kind_of(head, path)
    if kind is None:
        return
    if compression == "gzip" and not kind.gzip:
        kind = Kind(f"a gzip-compressed {kind.said.split(' ', 1)[1]}", kind.family, gzip=True)
    raise NotTFRecords(path, kind)
