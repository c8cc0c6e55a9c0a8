"""What the one-shot commands print: the config, doctor's checks, and the data commands' reports.

Each ``show_*`` takes what the library returned and prints it to stdout: JSON with ``--json``, a Rich
table on a terminal, aligned plain lines in a notebook, a pipe or CI (:func:`tpurun.display.lines.want_plain`).
Training's own output (a live view or plain lines) is :mod:`tpurun.display.lines`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from tpurun.display.reporter import want_plain

_STYLES = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def note(text: str) -> None:
    """A line on stderr that is not part of the result (so ``--json`` output stays clean)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def show_json(data: Any) -> None:
    _out(json.dumps(data, indent=2))


def _table(title: str | None = None, columns: Sequence[str] = ()) -> Any:
    from rich.table import Table

    table = Table(title=title, show_header=bool(columns), header_style="bold", box=None,
                  pad_edge=False)  # fmt: skip
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
            _out(title)
        width = max((len(k) for k, _ in rows), default=0)
        for key, value in rows:
            _out(f"  {key.ljust(width)}  {value}")
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
    import yaml

    sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    from tpurun.runtime.memory_check import memory_lines

    for line in memory_lines(data.get("derived") or {}):
        _out(f"# {line}")


def show_valid(source: str, factory: str | None) -> None:
    """``tpurun config --check``: the config having loaded, what that covered (``factory``: what
    was found of the model factory without importing it) and what it leaves to ``doctor``."""
    _out(f"{source}: valid")
    _out(f"  checked: its keys and values{f'; {factory} (not imported)' if factory else ''}")
    _out(f"  not checked: the data, the model as built, this machine (`tpurun doctor {source}`)")


# ---------------------------------------------------------------------------------------- doctor
def show_checks(checks: Sequence[Any], as_json: bool = False, plain: bool = False) -> None:
    """Doctor's checks: one line (or row) each, with the fix under any that is not ok."""
    if as_json:
        from tpurun.doctor import report

        show_json(report(checks))
        return
    if want_plain(plain):
        width = max(len(c.name) for c in checks)
        for c in checks:
            _out(f"{c.status:<5} {c.name:<{width}}  {c.finding}  ({c.seconds:.1f}s)")
            if c.fix and c.status != "ok":
                _out(f"{'':<5} {'':<{width}}  fix: {c.fix}")
        return
    table = _table(columns=("status", "check", "finding", "s"))
    for c in checks:
        finding = c.finding if not (c.fix and c.status != "ok") else f"{c.finding}\nfix: {c.fix}"
        table.add_row(f"[{_STYLES[c.status]}]{c.status}[/]", c.name, finding, f"{c.seconds:.1f}")
    _print(table)


# ------------------------------------------------------------------------------------------ data
def show_bench(result: dict[str, Any], config: str, as_json: bool = False) -> None:
    """``tpurun data bench``: the input pipeline's throughput."""
    if as_json:
        show_json(result)
        return
    batches = f"{result['batches_per_sec']:,.1f}  (global batch {result['global_batch_size']})"
    size = (
        f"{result['mb_per_sec']:,.1f}  ({result['bytes_per_record']:,.0f} bytes/record as stored)"
    )
    timed = (
        f"{result['steps']} batches in {result['seconds']:.2f}s after {result['warmup_steps']} "
        "warm-up"
    )
    rows = [("examples/s", f"{result['examples_per_sec']:,.0f}")]
    if result.get("reader"):
        rows.append(("reader", f"{result['reader']} ({result['reader_reason']})"))
    if result.get("tokens_per_sec") is not None:
        rows.append(("tokens/s", f"{result['tokens_per_sec']:,.0f}  ({result['positions']} "
                                 "positions per example)"))  # fmt: skip
    if result.get("preprocessing"):
        rows.append(("preprocessing", result["preprocessing"]))
    if result.get("token_lengths"):
        rows.append(("sequence length", result["token_lengths"]["sentence"]))
    rows += [
        ("batches/s", batches),
        ("MB/s", size),
        ("timed", timed),
        ("CPU cores", str(result["cpu_cores"])),
        ("files", f"{result['train_files']} ({result['train_records']:,} records)"),
    ]
    show_rows(rows, title=f"input pipeline: {config}")


def show_written(report: Any, source: str, as_json: bool = False, plain: bool = False) -> None:
    """``tpurun data write``: the shards of each split, the features, the schema file; its
    warnings on stderr (with ``--json`` too, which keeps stdout clean)."""
    for warning in report.warnings:
        note(f"warning: {warning}")
    if as_json:
        show_json(report.to_dict())
        return
    rows = []
    for split, shards in report.splits.items():
        records = sum(n for _, n, _ in shards)
        size = sum(b for _, _, b in shards)
        rows.append((split, f"{len(shards)} shards · {records:,} records · {size / 1e6:,.1f} MB"))
    rows.append(("features", ", ".join(f"{k} ({v['type']})" for k, v in report.features.items())))
    if report.class_names:
        rows.append(("classes", ", ".join(report.class_names)))
    tokenized = report.layout.get("tokenized")
    if tokenized:
        rows.append(("tokenized", f"for {tokenized['task']} at sequence length "
                                  f"{tokenized['sequence_length']} ({tokenized['preset']})"))  # fmt: skip
        if tokenized.get("chat"):
            rows.append(("chat format", tokenized["chat"]["format"]))
        packed = tokenized.get("packing")
        if packed:
            rows.append(("packing", f"{packed['examples']:,} train examples in "
                                    f"{packed['records']:,} records; padding "
                                    f"{packed['padding']:.0%} (unpacked: "
                                    f"{packed['padding_unpacked']:.0%})"))  # fmt: skip
    rows.append(("schema", report.schema_path))
    rate = report.records / max(report.seconds, 1e-9)
    rows.append(("time", f"{report.seconds:.1f}s ({rate:,.0f} records/s)"))
    show_rows(rows, title=f"wrote {report.records:,} records from {source}", plain=plain)


def show_inspected(
    report: Any, globs: Sequence[str], as_json: bool = False, plain: bool = False,
    token_lengths: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """``tpurun data inspect``: files and counts, the inferred features as a pasteable block;
    with ``--preset``, the text's lengths in tokens (``token_lengths``)."""
    if as_json:
        show_json(
            {**report.to_dict(), **({"token_lengths": token_lengths} if token_lengths else {})}
        )
        return
    from tpurun.data.advice import format_bytes

    source = f"from {report.schema_path}" if report.counts_from == "schema" else "counted"
    rows = [
        ("files", f"{len(report.files)} · {format_bytes(report.total_bytes)} · "
                  f"{report.total_records:,} records ({source})"),
        ("compression", report.compression),
    ]  # fmt: skip
    if report.class_names:
        rows.append(("classes", ", ".join(report.class_names)))
    if report.tokenized:
        rows.extend(_tokenized_rows(report.tokenized))
    for info in report.files[:10]:
        rows.append(("", f"{info.path}  {format_bytes(info.bytes)}  {info.records:,} records"))
    if len(report.files) > 10:
        rows.append(("", f"... {len(report.files) - 10} more"))
    show_rows(rows, title=f"dataset: {' '.join(globs)}", plain=plain)
    _out(
        f"\nfeatures (from {report.sampled_records} sampled records; largest "
        f"{format_bytes(report.largest_sampled_record)}):"
    )
    for feature in report.features:
        spec = feature.spec or {}
        described = " ".join(str(v) for k, v in spec.items() if k != "key") or feature.stored
        notes = "".join(f"  · {note}" for note in feature.notes)
        _out(f"  {feature.name:<16} {described}{notes}")
        if feature.text:
            _out(f"  {'':<16} {_text_lines(feature.text)}")
        if feature.tokens:
            tokens = feature.tokens
            ids = " ".join(str(i) for i in tokens["first"])
            more = " ..." if tokens["positions"] > len(tokens["first"]) else ""
            _out(f"  {'':<16} [{ids}{more}]  ({tokens['length']} of {tokens['positions']} tokens)")
    if token_lengths:
        t = token_lengths
        _out(f"\nlength in tokens for {t['preset']} ({t['sampled']} records sampled, the "
             "sequence_length each needs):")  # fmt: skip
        _out(
            f"  min {t['min']}  median {t['p50']}  90% {t['p90']}  95% {t['keep_95']}  max {t['max']}"
        )
        _out(f"  {t['sentence']}")
    _out("\npaste into data: in the config")
    _out(report.features_yaml.rstrip())
    if report.advice:
        _out("\nadvice:")
        for line in report.advice:
            _out(f"  - {line}")


def _tokenized_rows(entry: dict[str, Any]) -> list[tuple[str, str]]:
    """Records written with ``--tokenize``: for which task, preset and tokenizer, and their
    lengths in tokens."""
    made = entry.get("source") or {}
    rows = [
        ("tokenized", f"for {entry['task']} at sequence length {entry['sequence_length']}"),
        ("", f"preset {entry['preset']}"),
        ("", f"tokenizer {entry['tokenizer']} {entry['fingerprint'][:19]}"),
        ("", f"from inputs {made.get('inputs')}, targets {made.get('targets')}"),
    ]
    lengths = entry.get("lengths")
    if lengths:
        over = f"{lengths['count']:,} {'' if lengths['split'] == 'all' else lengths['split'] + ' '}"
        rows.append(("", f"length {lengths['min_tokens']:,} to {lengths['max_tokens']:,} tokens, "
                         f"mean {lengths['mean_tokens']:,.1f} ({over}records); {lengths['full']:,} "
                         f"fill all {lengths['positions']} positions (text longer than that was cut)"))  # fmt: skip
    return rows


def _text_lines(text: dict[str, Any]) -> str:
    """A text feature in ``data inspect``: its first value, then its lengths in characters."""
    lengths = (
        f"{text['min_chars']:,} to {text['max_chars']:,} characters, mean "
        f"{text['mean_chars']:,.1f} ({text['over']})"
    )
    return f"{text['sample']}  ({text['sample_chars']:,} chars)\n  {'':<16} length {lengths}"


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
        rows.append(("note", "the loss's reduction is not Keras' default: its mean includes the "
                             "padding records (weighted 0); the other metrics are exact"))  # fmt: skip
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
                                       if result["platforms"] else "")),  # fmt: skip
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


def show_runs(runs: list[dict[str, Any]], folder: str, as_json: bool = False,
              plain: bool = False) -> None:  # fmt: skip
    """``tpurun runs``: one row per run, newest first."""
    if as_json:
        show_json(runs)
        return
    if not runs:
        _out(f"no runs in {folder}")
        return
    rows = [_run_cells(run) for run in runs]
    if want_plain(plain):
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(_RUN_COLUMNS)]
        for cells in [list(_RUN_COLUMNS), *rows]:
            _out(
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
    _out(
        f"wrote {result['output']} ({result['width']}x{result['height']} px): "
        f"{', '.join(result['metrics'])} of {len(result['runs'])} run(s), {result['lines']} lines"
    )
