"""What the one-shot commands print: tables on a terminal, plain lines elsewhere or with --plain."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tpurun.display import data_reports, reports
from tpurun.doctor import Check
from tpurun.doctor import report as doctor_report

CHECKS = [
    Check("platform", "ok", "CPU machine", seconds=0.01),
    Check("gcs.reachable", "skip", "not needed: no gs:// path in this config"),
    Check("data.train", "fail", "no file matches", "fix the glob", seconds=1.25),
]


def test_checks_as_plain_lines_with_the_fix_under_what_is_not_ok(terminal):
    terminal = terminal()
    reports.show_checks(doctor_report(CHECKS), plain=True)
    assert terminal.getvalue().splitlines() == [
        "ok    platform       CPU machine  (0.0s)",
        "skip  gcs.reachable  not needed: no gs:// path in this config  (0.0s)",
        "fail  data.train     no file matches  (1.2s)",
        "                     fix: fix the glob",
    ]


def test_checks_as_a_table_on_a_terminal_and_as_json(terminal):
    terminal = terminal()
    reports.show_checks(doctor_report(CHECKS))
    text = terminal.getvalue()
    assert "\x1b[" in text and "fix: fix the glob" in text and "data.train" in text
    terminal.truncate(0), terminal.seek(0)
    reports.show_checks(doctor_report(CHECKS), as_json=True)
    data = json.loads(terminal.getvalue())
    assert data["exit_code"] == 1 and [c["name"] for c in data["checks"]][-1] == "data.train"


def test_data_write_report_honours_plain_on_a_terminal(terminal):
    report = SimpleNamespace(
        splits={"train": [("a-00000-of-00002.tfrecord", 6, 600), ("b", 4, 400)]},
        features={"x": {"type": "raw"}, "y": {"type": "int64"}}, class_names=["cat", "dog"],
        schema_path="out/a.schema.json", records=10, seconds=2.0, warnings=[], layout={},
    )  # fmt: skip
    terminal = terminal()
    data_reports.show_written(report, "arrays.npz", plain=True)
    assert terminal.getvalue().splitlines() == [
        "wrote 10 records from arrays.npz",
        "  train     2 shards · 10 records · 0.0 MB",
        "  features  x (raw), y (int64)",
        "  classes   cat, dog",
        "  schema    out/a.schema.json",
        "  time      2.0s (5 records/s)",
    ]
    terminal.truncate(0), terminal.seek(0)
    data_reports.show_written(report, "arrays.npz")
    assert "\x1b[" in terminal.getvalue()  # a Rich table without --plain
