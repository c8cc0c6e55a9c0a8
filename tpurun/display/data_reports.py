"""What the ``tpurun data`` commands print: ``bench``'s throughput, ``write``'s shards, ``inspect``'s
files and features.

The shared pieces (JSON, two-column rows, notes on stderr) are in :mod:`tpurun.display.reports`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tpurun.data.advice import format_bytes
from tpurun.display.reports import note, out, show_json, show_rows


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
        rows.append(
            (
                "tokens/s",
                f"{result['tokens_per_sec']:,.0f}  ({result['positions']} positions per example)",
            )
        )
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
        rows.append(
            (
                "tokenized",
                f"for {tokenized['task']} at sequence length "
                f"{tokenized['sequence_length']} ({tokenized['preset']})",
            )
        )
        if tokenized.get("chat"):
            rows.append(("chat format", tokenized["chat"]["format"]))
        packed = tokenized.get("packing")
        if packed:
            rows.append(
                (
                    "packing",
                    f"{packed['examples']:,} train examples in "
                    f"{packed['records']:,} records; padding "
                    f"{packed['padding']:.0%} (unpacked: "
                    f"{packed['padding_unpacked']:.0%})",
                )
            )
    rows.append(("schema", report.schema_path))
    rate = report.records / max(report.seconds, 1e-9)
    rows.append(("time", f"{report.seconds:.1f}s ({rate:,.0f} records/s)"))
    show_rows(rows, title=f"wrote {report.records:,} records from {source}", plain=plain)


def show_inspected(
    report: Any,
    globs: Sequence[str],
    as_json: bool = False,
    plain: bool = False,
    token_lengths: dict[str, Any] | None = None,
) -> None:
    """``tpurun data inspect``: files and counts, the inferred features as a pasteable block;
    with ``--preset``, the text's lengths in tokens (``token_lengths``)."""
    if as_json:
        show_json(
            {**report.to_dict(), **({"token_lengths": token_lengths} if token_lengths else {})}
        )
        return
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
    out(
        f"\nfeatures (from {report.sampled_records} sampled records; largest "
        f"{format_bytes(report.largest_sampled_record)}):"
    )
    for feature in report.features:
        spec = feature.spec or {}
        described = " ".join(str(v) for k, v in spec.items() if k != "key") or feature.stored
        notes = "".join(f"  · {note}" for note in feature.notes)
        out(f"  {feature.name:<16} {described}{notes}")
        if feature.text:
            out(f"  {'':<16} {_text_lines(feature.text)}")
        if feature.tokens:
            tokens = feature.tokens
            ids = " ".join(str(i) for i in tokens["first"])
            more = " ..." if tokens["positions"] > len(tokens["first"]) else ""
            out(f"  {'':<16} [{ids}{more}]  ({tokens['length']} of {tokens['positions']} tokens)")
    if token_lengths:
        t = token_lengths
        out(
            f"\nlength in tokens for {t['preset']} ({t['sampled']} records sampled, the "
            "sequence_length each needs):"
        )
        out(
            f"  min {t['min']}  median {t['p50']}  90% {t['p90']}  95% {t['keep_95']}  max {t['max']}"
        )
        out(f"  {t['sentence']}")
    out("\npaste into data: in the config")
    out(report.features_yaml.rstrip())
    if report.advice:
        out("\nadvice:")
        for line in report.advice:
            out(f"  - {line}")


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
        rows.append(
            (
                "",
                f"length {lengths['min_tokens']:,} to {lengths['max_tokens']:,} tokens, "
                f"mean {lengths['mean_tokens']:,.1f} ({over}records); {lengths['full']:,} "
                f"fill all {lengths['positions']} positions (text longer than that was cut)",
            )
        )
    return rows


def _text_lines(text: dict[str, Any]) -> str:
    """A text feature in ``data inspect``: its first value, then its lengths in characters."""
    lengths = (
        f"{text['min_chars']:,} to {text['max_chars']:,} characters, mean "
        f"{text['mean_chars']:,.1f} ({text['over']})"
    )
    return f"{text['sample']}  ({text['sample_chars']:,} chars)\n  {'':<16} length {lengths}"
