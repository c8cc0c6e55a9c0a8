"""What the table sources (CSV in :mod:`.tabular`, JSONL in :mod:`.jsonl`) share: the options that
lay out their columns as features, and a text label's classes.

Which column is text: every column whose values are not all numbers (a CSV cell that does not
parse as one, a JSON string), except the label, and every column named by ``text`` (``--text``),
whatever its values; a ``text`` column is stored as one UTF-8 string a record, exactly as read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tpurun.errors import DataError, TpurunError

#: More distinct label texts than this are not classes.
MAX_CLASSES = 65536


@dataclass(frozen=True)
class TableOptions:
    """How the columns of a CSV (or JSONL) source become features.

    Attributes:
        label: the label column, or None.
        pack: CSV only: ``{feature: columns}``; each column is a name or an inclusive
            ``FIRST:LAST`` range in the header's order. ``None`` as the columns: every numeric
            column that is not the label nor in another pack.
        fill_missing: CSV only: None (missing values are an error), a number, or "mean".
        text: columns stored as text whatever their values (a CSV's zip codes keep their leading
            zeros); in a JSONL file, each of their values must be a string.
    """

    label: str | None = None
    pack: Mapping[str, Sequence[str] | None] = field(default_factory=dict)
    fill_missing: float | str | None = None
    text: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.label or self.pack or self.fill_missing is not None or self.text)


def table_options(
    label: str | None = None,
    pack: Mapping[str, Sequence[str] | None] | Sequence[str] | None = None,
    fill_missing: float | str | None = None,
    text: Sequence[str] | str | None = None,
) -> TableOptions:
    """Check and parse the table options as ``tpurun data write`` takes them.

    Args:
        label: the label column.
        pack: ``{name: columns}``, or ``--pack`` texts: ``NAME=COL,COL,...``, ``NAME=FIRST:LAST``,
            or ``NAME`` alone (every numeric column but the label).
        fill_missing: a number (or its text), or "mean".
        text: the columns to store as text (``--text``, repeatable, or ``COL,COL``).

    Raises:
        TpurunError: an option that cannot be read, naming it and what it takes.
    """
    texts = [text] if isinstance(text, str) else list(text or ())
    columns = tuple(c.strip() for t in texts for c in t.split(",") if c.strip())
    if label is not None and label in columns:
        raise TpurunError(
            f"Invalid options --label {label} and --text {label}: a label is a class (its names "
            "become class indices) or a number, not text. Leave it out of --text."
        )
    return TableOptions(label, _packs(pack), _fill(fill_missing), tuple(dict.fromkeys(columns)))


def _packs(pack: Mapping[str, Sequence[str] | None] | Sequence[str] | None) -> dict:
    if isinstance(pack, str):
        pack = [pack]
    if pack is None or isinstance(pack, Mapping):
        packs = {
            name: columns.split(",") if isinstance(columns, str) else columns
            for name, columns in (pack or {}).items()
        }
    else:
        packs = {}
        for text in pack:
            name, has_columns, columns = text.partition("=")
            name = name.strip()
            if not name.isidentifier() or name in packs:
                what = "repeated" if name in packs else "not a feature name"
                raise TpurunError(
                    f"Invalid option --pack {text!r}: {name!r} is {what}. Expected NAME=COL,COL,..."
                    ", NAME=FIRST:LAST or NAME alone (every numeric column but --label)."
                )
            packs[name] = [c.strip() for c in columns.split(",")] if has_columns else None
    if sum(columns is None for columns in packs.values()) > 1:
        raise TpurunError(
            "Invalid option --pack: only one pack can take 'every other numeric column' (a NAME "
            "without =COLUMNS); list the columns of the others."
        )
    return packs


def _fill(fill_missing: float | str | None) -> float | str | None:
    fill = fill_missing
    if isinstance(fill, str) and fill.strip().lower() != "mean":
        try:
            fill = float(fill)
        except ValueError:
            fill = None
        if fill is None or not math.isfinite(fill):
            raise TpurunError(
                f"Invalid option --fill-missing {fill_missing!r}. Expected a number (e.g. 0) or "
                "'mean' (each column's mean)."
            ) from None
    elif isinstance(fill, str):
        fill = "mean"
    return fill


class ClassValues:
    """The distinct values of a text label column, while there are few enough to be classes."""

    def __init__(self) -> None:
        self.values: set[str] | None = set()

    def add(self, value: str) -> None:
        if self.values is not None:
            self.values.add(value)
            if len(self.values) > MAX_CLASSES:
                self.values = None

    def classes(self, path: str, label: str) -> dict[str, int]:
        """Each class name's index: the names sorted, as Keras orders class folders.

        Raises:
            DataError: more distinct values than classes can be.
        """
        if self.values is None:
            raise DataError(
                f"{path}: the label column '{label}' holds more than {MAX_CLASSES} distinct "
                "texts; that is not a class label."
            )
        return {name: i for i, name in enumerate(sorted(self.values))}
