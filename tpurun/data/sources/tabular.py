"""CSV sources for ``tpurun data write``: typed columns, packed vectors, missing values, labels.

By default every column becomes one scalar feature, in column order: integers int64, other numbers
float, anything else text (one UTF-8 string, as the CSV holds it). :class:`TableOptions`
(:mod:`.columns`, shared with JSONL files) changes that the way a tabular model wants it:

- ``pack``: numeric columns packed into one float vector feature (``x`` of shape ``[20]`` rather
  than 20 scalars, so the model needs one ``keras.Input``). The vector keeps the columns' order.
- ``label``: the label column. It is never packed with "every other column", and a label of text
  values becomes class indices 0..K-1, the class names (sorted, as Keras orders class folders) kept
  in the schema file.
- ``fill_missing``: empty (or ``nan``) cells of numeric columns are an error unless a fill is
  chosen: a number, or ``"mean"`` (each column's mean over its present values, of the train split
  only when the rows are split: a mean that had seen the validation rows would leak them). A
  silent NaN would only surface later, as a NaN loss.
- ``text``: columns stored as text whatever their values (zip codes, ids with leading zeros).
  A text column's empty cell is the empty string.

Two passes over the files, neither holding more than one chunk of rows: the first counts rows and
infers each column's type, missing cells, sums (for means) and label values; the second yields the
records. The statistics the schema file records are not the first pass's sums: they are taken from
the records as they are written, of the train split only (``tpurun.data.statistics``).
"""

from __future__ import annotations

import csv
import difflib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpurun.data.sources.base import Source
from tpurun.data.sources.columns import ClassValues, TableOptions, table_options
from tpurun.errors import DataError

__all__ = ["CsvSource", "TableOptions", "table_options"]

_INT = re.compile(r"[+-]?\d+")
_INT64_MAX = 2**63 - 1
_MISSING = ("", "nan")  # what a cell holds when it has no value (pandas writes NaN as "")
_TYPES = {"int": "int64", "float": "float"}


def _is_int64(text: str) -> bool:
    return bool(_INT.fullmatch(text)) and abs(int(text)) <= _INT64_MAX


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return "_" not in text  # Python accepts 1_000; a CSV writer meant a string


def _rows(n: int) -> str:
    return "1 row" if n == 1 else f"{n} rows"


def _missing(text: str) -> bool:
    return text.lower() in _MISSING


_ID_NAME = re.compile(r"^(id|idx|index|row|row_?id|unnamed: ?0|.*[_ ]id)$", re.I)


@dataclass
class _Column:
    """What the first pass learned of one column."""

    name: str
    kind: str = "int"  # "int", then "float", then "text" as the values demand
    present: int = 0  # cells with a value
    missing: int = 0  # empty or nan cells
    total: float = 0.0  # sum of the numeric values, for a mean
    text: str | None = None  # the first value that is not a number
    values: ClassValues | None = None  # the label's distinct values, while they may be classes
    increasing: bool = True  # every integer so far above the one before: a row id, likely
    last: int | None = None

    def see(self, text: str) -> None:
        if _missing(text):
            self.missing += 1
            return
        self.present += 1
        if self.values is not None:
            self.values.add(text)
        if self.kind == "text":
            return
        if self.kind == "float" or not _is_int64(text):
            self.kind = "float" if _is_float(text) else "text"
        if self.kind == "text":
            self.text = text
        else:
            self.total += float(text)
        if self.kind == "int" and self.increasing:
            value = int(text)
            self.increasing = self.last is None or value > self.last
            self.last = value
        else:
            self.increasing = False

    def looks_like_an_id(self) -> str | None:
        """Why this column may be a row id rather than a feature; None if nothing says so."""
        if _ID_NAME.match(self.name.strip()):
            return "its name"
        if self.kind == "int" and self.increasing and self.present > 2 and not self.missing:
            return "its values are distinct integers, each above the last"
        return None


class CsvSource(Source):
    """CSV files with one header row, laid out as :class:`TableOptions` says."""

    def __init__(self, path: str, files: list[str], options: TableOptions | None = None):
        self.path, self._files = path, files
        self._options = options or TableOptions()
        self.nbytes = sum(os.path.getsize(f) for f in files)
        self._header: list[str] = []
        self._label: int | None = None
        self._text: set[int] = set()
        self._packs: dict[str, list[int]] = {}
        self.warnings = []
        self._columns = self._scan()
        self._layout()

    def _rows(self) -> Iterator[list[str]]:
        """Every data row of every file, checking the headers and the number of values."""
        for file in self._files:
            with open(file, newline="", encoding="utf-8-sig") as f:
                reader = csv.reader(f)
                try:
                    yield from self._file_rows(file, reader)
                except UnicodeDecodeError:
                    # Text is decoded a block ahead of the reader: the line is a lower bound.
                    raise DataError(
                        f"{file}: not UTF-8 text: a byte at or after line {reader.line_num + 1} does not "
                        "decode as UTF-8. Save the CSV as UTF-8 (from Latin-1, for instance: "
                        "iconv -f latin1 -t utf-8 OLD.csv > NEW.csv)."
                    ) from None

    def _file_rows(self, file: str, reader: Any) -> Iterator[list[str]]:
        names = [name.strip() for name in next(reader, [])]
        if not names or not all(names) or len(set(names)) != len(names):
            raise DataError(
                f"{file}: the first row must be a header of distinct, non-empty column "
                f"names; found {names or 'an empty file'}."
            )
        if not self._header:
            self._header = names
            self._resolve_names()  # before a long first pass, not after it
        if names != self._header:
            raise DataError(
                f"{file}: its header {names} differs from {self._files[0]}'s "
                f"{self._header}; every file of a CSV glob needs the same columns."
            )
        for cells in reader:
            if cells and len(cells) != len(names):  # [] is a blank line: skipped
                raise DataError(
                    f"{file}:{reader.line_num}: {len(cells)} values, but the header has "
                    f"{len(names)} columns; quote values that contain commas."
                )
            if cells:
                yield cells

    def _scan(self) -> list[_Column]:
        columns: list[_Column] = []
        self.records = 0
        for cells in self._rows():
            if not columns:
                columns = [_Column(name) for name in self._header]
                if self._label is not None:
                    columns[self._label].values = ClassValues()
            self.records += 1
            for column, cell in zip(columns, cells, strict=True):
                column.see(cell.strip())
        if not self.records:
            raise DataError(f"{self.path}: the CSV holds a header but no row.")
        for j, column in enumerate(columns):
            if not column.present or j in self._text:
                column.kind = "text"  # --text, or no value at all: nothing says it is a number
        return columns

    # ------------------------------------------------------------------------------- layout
    def _find(self, name: str, what: str) -> int:
        if name in self._header:
            return self._header.index(name)
        close = difflib.get_close_matches(name, self._header, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; the columns are {self._header}."
        raise DataError(f"{self.path}: {what} names column '{name}', which the header lacks{hint}")

    def _resolve_names(self) -> None:
        """The label's and the listed packs' column indices (ranges in the header's order)."""
        options = self._options
        self._label = self._find(options.label, "--label") if options.label else None
        self._text = {self._find(name, "--text") for name in options.text}
        for name, specs in options.pack.items():
            indices = []
            for spec in specs or ():
                first, is_range, last = (part.strip() for part in spec.partition(":"))
                start = self._find(first, f"--pack {name}")
                stop = self._find(last, f"--pack {name}") if is_range else start
                if stop < start:
                    raise DataError(
                        f"{self.path}: --pack {name}: in '{spec}', column '{last}' comes before "
                        f"'{first}' in the header; write the range as FIRST:LAST."
                    )
                indices.extend(range(start, stop + 1))
            self._packs[name] = indices
        taken = [j for indices in self._packs.values() for j in indices]
        repeated = sorted({self._header[j] for j in taken if taken.count(j) > 1})
        if repeated:
            raise DataError(
                f"{self.path}: --pack names column(s) {repeated} more than once; each column goes "
                "into one feature."
            )
        if self._text.intersection(taken):
            named = sorted(self._header[j] for j in self._text.intersection(taken))
            raise DataError(
                f"{self.path}: column(s) {named} are both --text and packed; only numeric "
                "columns can be packed into a vector."
            )
        if self._label in taken:
            raise DataError(
                f"{self.path}: the label column '{options.label}' is also packed; leave it out "
                "of --pack."
            )
        for name in self._packs:
            if name in self._header and self._header.index(name) not in taken:
                raise DataError(
                    f"{self.path}: --pack {name}: a column of that name is written as its own "
                    "feature already; choose another name for the packed vector."
                )

    def _layout(self) -> None:
        """Features (in column order), class names and fills, from the first pass."""
        columns, label = self._columns, self._label
        for name, indices in self._packs.items():
            if self._options.pack[name] is None:  # every other numeric column
                taken = {j for other in self._packs.values() for j in other}
                indices[:] = [
                    j for j, c in enumerate(columns) if c.kind != "text" and j != label
                    and j not in taken
                ]  # fmt: skip
                if not indices:
                    raise DataError(
                        f"{self.path}: --pack {name}: no numeric column is left to pack (the "
                        "label and the other packs take them all)."
                    )
            if self._options.pack[name] is None:
                self._warn_of_ids(name, indices)
            for j in indices:
                if columns[j].kind == "text":
                    found = f"text such as '{columns[j].text}'" if columns[j].text else "no value"
                    raise DataError(
                        f"{self.path}: --pack {name}: column '{columns[j].name}' holds {found}; "
                        "only numeric columns can be packed into a vector."
                    )
        self._fills = self._fill_values()
        self.class_names = None
        self._classes: dict[str, int] | None = None
        if label is not None and columns[label].kind == "text":
            self._classes = columns[label].values.classes(self.path, self._options.label)
            self.class_names = list(self._classes)
            columns[label].kind = "int"
        # Each feature's source: a column index, or a pack's indices; a pack takes the place of
        # its first column, so the features keep the CSV's order.
        first_of = {min(indices): name for name, indices in self._packs.items()}
        packed = {j for indices in self._packs.values() for j in indices}
        self._sources: dict[str, int | list[int]] = {}
        self.features = {}
        for j, column in enumerate(columns):
            if j in first_of:
                name = first_of[j]
                self._sources[name] = self._packs[name]
                self.features[name] = {"type": "float", "shape": [len(self._packs[name])]}
            elif j not in packed:
                self._sources[column.name] = j
                self.features[column.name] = (
                    {"type": "text"}
                    if column.kind == "text"
                    else {"type": _TYPES[column.kind], "shape": []}
                )
        self.layout = {
            "label": self._options.label,
            "packed": {name: [self._header[j] for j in ix] for name, ix in self._packs.items()},
            "fill_missing": {self._header[j]: value for j, value in self._fills.items()},
        }
        self.layout = {key: value for key, value in self.layout.items() if value}

    def _warn_of_ids(self, name: str, indices: list[int]) -> None:
        """``--pack NAME`` took every numeric column: say so of those that look like row ids."""
        ids = [(j, why) for j in indices if (why := self._columns[j].looks_like_an_id())]
        if not ids:
            return
        rest = [j for j in indices if j not in {j for j, _ in ids}]
        names = [self._header[j] for j in rest]
        contiguous = rest == list(range(rest[0], rest[-1] + 1)) if rest else False
        cols = f"{names[0]}:{names[-1]}" if contiguous and len(names) > 2 else ",".join(names)
        for j, why in ids:
            self.warnings.append(
                f"--pack {name}: column '{self._header[j]}' looks like a row id ({why}), and it is "
                f"packed into {name}, where the model learns from it. To leave it out: "
                f"--pack {name}={cols}"
            )

    def _fill_values(self) -> dict[int, float | int]:
        """The value of each numeric column's missing cells, by column index.

        Raises:
            DataError: missing values without a fill (or in the label), naming columns and rows.
        """
        columns, fill = self._columns, self._options.fill_missing
        if self._label is not None and columns[self._label].missing:
            raise DataError(
                f"{self.path}: the label column '{self._options.label}' is empty in "
                f"{_rows(columns[self._label].missing)} of {self.records}; remove those rows (a "
                "fill would invent labels)."
            )
        missing = [j for j, c in enumerate(columns) if c.kind != "text" and c.missing]
        if missing and fill is None:
            named = ", ".join(
                f"'{columns[j].name}' ({_rows(columns[j].missing)})" for j in missing[:5]
            )
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise DataError(
                f"{self.path}: missing values (empty or nan cells) in {len(missing)} column(s): "
                f"{named}{more}. Choose a fill with --fill-missing 0 (or another number) or "
                "--fill-missing mean (each column's mean), or fill the cells in the CSV."
            )
        fills: dict[int, float | int] = {}
        for j in missing:
            column = columns[j]
            value = column.total / column.present if fill == "mean" else float(fill)
            if column.kind == "int" and fill != "mean" and value.is_integer():
                fills[j] = int(value)  # an integer column filled with an integer stays int64
            else:
                fills[j], column.kind = value, "float"
        return fills

    def use_split(self, is_validation: Any) -> None:
        """``--fill-missing mean`` with a validation split: each column's mean over the present
        values of the train split's rows only (one more pass, over those columns)."""
        if self._options.fill_missing != "mean" or is_validation is None or not self._fills:
            return
        sums, counts = dict.fromkeys(self._fills, 0.0), dict.fromkeys(self._fills, 0)
        for row, cells in enumerate(self._rows()):
            if row < len(is_validation) and not is_validation[row]:
                for j in sums:
                    text = cells[j].strip()
                    if not _missing(text):
                        sums[j] += float(text)
                        counts[j] += 1
        for j in sums:
            if counts[j]:  # else no train row has a value: the mean of the others stays
                self._fills[j] = sums[j] / counts[j]
        # In place: a source wrapping this one (MappedSource) shares the layout's dict.
        self.layout.get("fill_missing", {}).update(
            {self._header[j]: value for j, value in self._fills.items()}
        )

    # ------------------------------------------------------------------------------ records
    def chunks(self, size: int) -> Iterator[dict[str, Any]]:
        cells: list[list[str]] = [[] for _ in self._header]
        for row in self._rows():
            for column, cell in zip(cells, row, strict=True):
                column.append(cell)
            if len(cells[0]) == size:
                yield self._convert(cells)
                cells = [[] for _ in self._header]
        if cells[0]:
            yield self._convert(cells)

    def _convert(self, cells: list[list[str]]) -> dict[str, Any]:
        values: list[Any] = []
        for j, (column, texts) in enumerate(zip(self._columns, cells, strict=True)):
            fill = self._fills.get(j)
            if column.kind == "text":
                values.append([t.encode() for t in texts])  # as the CSV holds it, spaces too
                continue
            texts = [t.strip() for t in texts]
            if j == self._label and self._classes is not None:
                values.append(np.array([self._classes[t] for t in texts], np.int64))
            elif column.kind == "int":
                values.append(np.array([fill if _missing(t) else int(t) for t in texts], np.int64))
            else:
                values.append(np.array([fill if _missing(t) else float(t) for t in texts]))
        chunk: dict[str, Any] = {}
        for name, source in self._sources.items():
            if isinstance(source, list):
                chunk[name] = np.stack([values[j].astype(np.float32) for j in source], axis=1)
            else:
                chunk[name] = values[source]
        return chunk
