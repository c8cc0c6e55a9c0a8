"""What the one-shot commands print: the config, doctor's checks, evaluate, predict, export, runs
and plots; and the pieces every such report uses (JSON, two-column rows, notes on stderr).

Each ``show_*`` takes what the library returned and prints it to stdout: JSON with ``--json``, a Rich
table on a terminal, aligned plain lines in a notebook, a pipe or CI (:func:`tpurun.display.lines.want_plain`).
The data commands' reports are :mod:`tpurun.display.data_reports`; training's own output (a live
view or plain lines) is :mod:`tpurun.display.lines`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from tpurun.display.reporter import want_plain
from tpurun.runtime.memory_check import memory_lines

_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def out(text: str = "") -> None:
    """A line of the result, on stdout."""
    sys.stdout.write(text + "\n")


def note(text: str) -> None:
    """A line on stderr that is not part of the result (so ``--json`` output stays clean)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def show_json(data: Any) -> None:
    out(json.dumps(data, indent=2))


def _table(title: str | None = None, columns: Sequence[str] = ()) -> Any:
    from rich.table import Table

    table = Table(
        title=title, show_header=bool(columns), header_style="bold", box=None, pad_edge=False
    )
    for column in columns:
        table.add_column(column)
    return table


def _print(table: Any) -> None:
    from rich.console import Console

    Console().print(table)


def show_rows(rows: list[tuple[str, str]], title: str | None = None, plain: bool = False) -> None:
    """A two-column listing: a Rich table on a terminal, aligned plain text elsewhere."""
    if want_plain(plain):
        if title:
            out(title)
        width = max((len(k) for k, _ in rows), default=0)
        for key, value in rows:
            out(f"  {key.ljust(width)}  {value}")
        return
    table = _table(title)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, value)
    _print(table)


# ---------------------------------------------------------------------------------------- config
def show_config(data: dict[str, Any], as_json: bool = False) -> None:
    """The resolved config, as YAML (the form a user writes) or JSON."""
    if as_json:
        show_json(data)
        return
    sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    for line in memory_lines(data.get("derived") or {}):
        out(f"# {line}")


def show_valid(source: str, factory: str | None) -> None:
    """``tpurun config --check``: the config having loaded, what that covered (``factory``: what
    was found of the model factory without importing it) and what it leaves to ``doctor``."""
    out(f"{source}: valid")
    out(f"  checked: its keys and values{f'; {factory} (not imported)' if factory else ''}")
    out(f"  not checked: the data, the model as built, this machine (`tpurun doctor {source}`)")


# ---------------------------------------------------------------------------------------- doctor
def show_checks(report: dict[str, Any], as_json: bool = False, plain: bool = False) -> None:
    """Doctor's checks, given as its JSON-ready report (:func:`tpurun.doctor.report`): one line
    (or row) each, with the fix under any that is not ok."""
    if as_json:
        show_json(report)
        return
    checks = report["checks"]
    if want_plain(plain):
        width = max(len(c["name"]) for c in checks)
        for c in checks:
            out(f"{c['status']:<5} {c['name']:<{width}}  {c['finding']}  ({c['seconds']:.1f}s)")
            if c["fix"] and c["status"] != "ok":
                out(f"{'':<5} {'':<{width}}  fix: {c['fix']}")
        return
    table = _table(columns=("status", "check", "finding", "s"))
    for c in checks:
        finding = c["finding"]
        if c["fix"] and c["status"] != "ok":
            finding += f"\nfix: {c['fix']}"
        style = _STYLES[c["status"]]
        table.add_row(f"[{style}]{c['status']}[/]", c["name"], finding, f"{c['seconds']:.1f}")
    _print(table)


# ------------------------------------------------------------------- evaluate, predict, export
def _number(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def show_evaluation(result: dict[str, Any], as_json: bool = False) -> None:
    """``tpurun evaluate``: the metrics, then what was scored with what."""
    if as_json:
        show_json(result)
        return
    rows = [(name, _number(value)) for name, value in result["metrics"].items()]
    padding = result["padding_records"]
    scored = (
        f"{result['records']:,} records, each once ({result['files']} files; {result['batches']} "
        f"batches of {result['global_batch_size']} on {result['replicas']} replica(s)"
        + (f", the last padded with {padding} records weighted 0)" if padding else ")")
    )
    rows += [
        ("scored", scored),
        ("data", result["data"]),
        ("checkpoint", f"{result['checkpoint_label']}: {result['checkpoint']}"),
        ("time", f"{result['seconds']:.1f}s"),
    ]
    if result.get("written"):
        rows.append(("written", result["written"]))
    if not result.get("loss_exact", True):
        rows.append(
            (
                "note",
                "the loss's reduction is not Keras' default: its mean includes the "
                "padding records (weighted 0); the other metrics are exact",
            )
        )
    show_rows(rows, title=f"evaluate {result['name']}: {result['run_dir']}")


def show_predicted(result: dict[str, Any], as_json: bool = False) -> None:
    """``tpurun predict``: where the rows went."""
    if as_json:
        show_json(result)
        return
    columns = result["columns"]
    shown = ", ".join(columns[:8]) + (f", ... ({len(columns)} in all)" if len(columns) > 8 else "")
    rows = [
        ("rows", f"{result['rows']:,} (every record once, in file order; {result['files']} files)"),
        ("columns" if result["format"] in ("csv", "jsonl") else "arrays", shown),
        ("data", result["data"]),
        ("checkpoint", f"{result['checkpoint_label']}: {result['checkpoint']}"),
        ("time", f"{result['seconds']:.1f}s"),
    ]
    if result.get("class_names"):  # the label's values, in the order of the model's outputs
        rows.insert(2, ("classes", ", ".join(result["class_names"])))
    show_rows(rows, title=f"wrote {result['output']}")


def show_exported(result: dict[str, Any], as_json: bool = False) -> None:
    """``tpurun export``: the artifact, how it was checked, how to load it."""
    if as_json:
        show_json(result)
        return
    checked = result["checked"]
    seconds = result["seconds"]
    rows = [
        ("format", result["format"] + (f" (platforms {','.join(result['platforms'])})"
                                       if result["platforms"] else "")),
        ("checked", f"loaded in a fresh Python process without tpurun; on {checked['on']}: max "
                    f"|diff| {checked['max_abs_diff']:.3g} (tolerance {checked['tolerance']:g})"
         if checked else "no (see the note)"),
        ("files", ", ".join(result["files"])),
        ("load", result["usage"]),
        ("checkpoint", f"{result['checkpoint_label']}: {result['checkpoint']}"),
        ("time", f"{seconds['total']:.1f}s (export {seconds['export']:.1f}s, check "
                 f"{seconds['check']:.1f}s)"),
    ]  # fmt: skip
    rows += [("note", note) for note in result["notes"]]
    show_rows(rows, title=f"exported {result['output']}")


# ------------------------------------------------------------------------------- runs and plots
_RUN_STYLES = {"running": "cyan", "completed": "green", "early-stopped": "green",
               "stopped": "yellow", "died": "bold red", "failed": "bold red", "nan": "bold red"}  # fmt: skip
_RUN_COLUMNS = ("run", "status", "epochs", "best", "backend", "examples/s", "input wait", "updated")


def _run_cells(run: dict[str, Any]) -> list[str]:
    """One run's row of ``tpurun runs``, as text."""
    epochs = f"{run['epochs_completed'] if run['epochs_completed'] is not None else '-'}/" + (
        str(run["epochs"]) if run["epochs"] is not None else "-"
    )
    best = "-"
    if run["best_value"] is not None:
        best = f"{run['best_monitor']} {run['best_value']:.4g} @{run['best_epoch']}"
    backend = f"{run['backend']} x{run['replicas']}" if run["backend"] else "-"
    rate = f"{run['examples_per_sec']:,.0f}" if run["examples_per_sec"] is not None else "-"
    wait = f"{run['input_wait']:.0%}" if run["input_wait"] is not None else "-"
    updated = (run["updated"] or "-").replace("T", " ")[:16]
    return [run["name"], run["status"], epochs, best, backend, rate, wait, updated]


def show_runs(
    runs: list[dict[str, Any]], folder: str, as_json: bool = False, plain: bool = False
) -> None:
    """``tpurun runs``: one row per run, newest first."""
    if as_json:
        show_json(runs)
        return
    if not runs:
        out(f"no runs in {folder}")
        return
    rows = [_run_cells(run) for run in runs]
    if want_plain(plain):
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_RUN_COLUMNS)]
        for cells in [list(_RUN_COLUMNS), *rows]:
            out(
                "  ".join(
                    cell.ljust(width) for cell, width in zip(cells, widths, strict=True)
                ).rstrip()
            )
        return
    table = _table(columns=_RUN_COLUMNS)
    for column in table.columns:  # a narrow terminal cuts cells short rather than wrap rows
        column.no_wrap = True
    # ... but never the run's name (up to 24 characters) or its status: the other cells give way.
    for index, most in ((0, 24), (1, 13)):
        table.columns[index].min_width = min(most, max(len(r[index]) for r in rows))
    for cells in rows:
        style = _RUN_STYLES.get(cells[1])
        cells[1] = f"[{style}]{cells[1]}[/]" if style else cells[1]
        table.add_row(*cells)
    _print(table)


def show_plotted(result: dict[str, Any], as_json: bool = False) -> None:
    """``tpurun plot``: where the picture went and what it shows."""
    if as_json:
        show_json(result)
        return
    out(
        f"wrote {result['output']} ({result['width']}x{result['height']} px): "
        f"{', '.join(result['metrics'])} of {len(result['runs'])} run(s), {result['lines']} lines"
    )
