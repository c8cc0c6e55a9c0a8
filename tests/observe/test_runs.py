"""``tpurun runs``: every status a run can list with (completed, early-stopped, stopped, nan,
failed, died, running), read from the summaries alone, newest first; the default folder; a table
that fits a narrow terminal."""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path

import pytest
from helpers import (
    read_log,
    read_summary,
    start_cli,
    toy_config,
    wait_for_epoch,
    write_config,
)
from typer.testing import CliRunner

from tpurun.cli.app import app
from tpurun.display import reports
from tpurun.observe.runs import list_runs
from tpurun.storage.rundir import RunDir
from tpurun.storage.summary import Summary


def runs_json(*args: str) -> dict[str, dict]:
    result = CliRunner().invoke(app, ["runs", *args, "--json"])
    assert result.exit_code == 0, result.output
    return {run["name"]: run for run in json.loads(result.output)}


def write_run(folder: Path, name: str, updated: str, **summary) -> Path:
    """A run directory whose summary says ``summary``, its lock released (its process ended), as
    the run wrote it at ``updated`` (HH:MM on 2026-01-01)."""
    run = RunDir(str(folder / name))
    run.create()
    run.write_summary(Summary(**summary))
    run.unlock()
    path = Path(run.path) / "summary.json"
    data = json.loads(path.read_text())
    data["updated"] = f"2026-01-01T{updated}:00+0000"
    path.write_text(json.dumps(data))
    return Path(run.path)


@pytest.fixture
def ended_runs(tmp_path, trained_toy_run) -> Path:
    """./runs with a real completed run (the session's toy run, 1 epoch on 8 replicas) and a run
    of each other way to end, their summaries written as tpurun writes them."""
    runs = tmp_path / "runs"
    runs.mkdir()
    done = trained_toy_run.copy(runs)
    data = json.loads((done / "summary.json").read_text())
    data["updated"] = "2026-01-01T00:06:00+0000"
    (done / "summary.json").write_text(json.dumps(data))
    best = {"monitor": "val_loss", "value": 0.25, "epoch": 2}
    common = {"epochs": 5, "backend": "jax", "replicas": 1, "best": best}
    write_run(runs, "early", "00:05", status="stopped_early", epochs_completed=3, **common)
    write_run(runs, "stopped", "00:04", status="interrupted", epochs_completed=2, **common)
    write_run(runs, "nan", "00:03", status="nan", epochs_completed=0, epochs=5)
    write_run(runs, "failed", "00:02", status="failed", epochs_completed=1, **common)
    # SIGKILL leaves the summary at running: only its released lock tells.
    write_run(runs, "killed", "00:01", status="running", epochs_completed=0, epochs=5)
    return runs


EXPECTED = {"toy": "completed", "early": "early-stopped", "stopped": "stopped", "nan": "nan",
            "failed": "failed", "killed": "died"}  # fmt: skip


@pytest.mark.slow
def test_every_status_and_a_live_run_newest_first(ended_runs, toy_data):
    """One real process, still training, beside the runs that ended."""
    runs = ended_runs
    config = toy_config(toy_data, runs, name="live", train={"epochs": 500})
    live = start_cli("train", str(write_config(runs.parent, config, "live")))
    try:
        wait_for_epoch(runs / "live", live)
        listed = runs_json(str(runs))
        assert {name: run["status"] for name, run in listed.items()} == {
            "live": "running",
            **EXPECTED,
        }
        # Newest first: the live run's log is newer than every summary written above.
        assert list(listed) == ["live", "toy", "early", "stopped", "nan", "failed", "killed"]
        running = listed["live"]  # its summary is the one it started with; its log is newer
        assert running["epochs"] == 500 and running["epochs_completed"] >= 1
        # The best of the epochs its summary counts (the log, read after, holds at least those).
        done_rows = read_log(runs / "live")[: running["epochs_completed"]]
        assert len(done_rows) == running["epochs_completed"]
        assert running["best_monitor"] == "val_loss"
        assert running["best_value"] == min(float(r["val_loss"]) for r in done_rows)
    finally:
        live.kill()
        live.communicate(timeout=60)
    assert runs_json(str(runs))["live"]["status"] == "died"  # killed: the lock went with it


def test_a_real_completed_run_and_the_plain_table(ended_runs):
    listed = runs_json(str(ended_runs))
    assert {name: run["status"] for name, run in listed.items()} == EXPECTED
    done = listed["toy"]  # the session's toy run: every field from a real summary
    assert (done["epochs_completed"], done["epochs"], done["best_epoch"]) == (1, 1, 1)
    summary = read_summary(ended_runs / "toy")  # what the run wrote, listed as it is
    assert (done["best_monitor"], done["best_value"]) == ("val_loss", summary["best"]["value"])
    assert done["best_value"] == float(read_log(ended_runs / "toy")[0]["val_loss"])  # its 1 epoch
    assert (done["backend"], done["replicas"]) == ("jax", 8)
    assert done["examples_per_sec"] == summary["examples_per_sec"]
    assert done["input_wait"] == summary["input_wait"]

    table = CliRunner().invoke(app, ["runs", str(ended_runs), "--plain"])
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert lines[0].split() == ["run", "status", "epochs", "best", "backend", "examples/s",
                                "input", "wait", "updated"]  # fmt: skip
    assert [line.split()[:2] for line in lines[1:]] == [[n, s] for n, s in EXPECTED.items()]
    done_line = lines[1]
    assert " 1/1 " in done_line and " jax x8 " in done_line
    assert "val_loss" in done_line and "@1" in done_line
    early = lines[2].split()
    assert early[2:6] == ["3/5", "val_loss", "0.25", "@2"] and lines[2].endswith("2026-01-01 00:05")
    assert lines[4].split()[2:4] == ["0/5", "-"]  # the NaN run: no best value


def test_the_default_folder_is_runs_in_the_working_directory(ended_runs, monkeypatch):
    monkeypatch.chdir(ended_runs.parent)
    assert list(runs_json()) == list(EXPECTED)
    monkeypatch.chdir(ended_runs)  # no ./runs here
    result = CliRunner().invoke(app, ["runs"])
    assert result.exit_code == 2 and "runs: no such folder" in result.output


def narrow_table(runs: Path, terminal, columns: int = 60) -> list[str]:
    """``tpurun runs`` on a terminal ``columns`` wide: its lines as they show (escapes removed)."""
    import re

    out = terminal(columns)
    reports.show_runs(list_runs(str(runs)), str(runs))
    text = out.getvalue()
    assert "\x1b[" in text  # a Rich table, not the plain lines
    return [re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", line).rstrip() for line in text.splitlines()
            if line.strip()]  # fmt: skip


def test_a_narrow_terminal_cuts_cells_short_and_keeps_one_line_per_run(ended_runs, terminal):
    lines = narrow_table(ended_runs, terminal)
    assert len(lines) == 1 + len(EXPECTED), lines  # a header and one line per run: no wrap
    assert all(len(line) <= 60 for line in lines), lines
    assert all("…" in line for line in lines)  # what does not fit is cut short


def test_a_narrow_terminal_still_names_each_run_and_its_status(ended_runs, terminal):
    lines = narrow_table(ended_runs, terminal)
    assert [line.split()[:2] for line in lines[1:]] == [[n, s] for n, s in EXPECTED.items()]


def test_two_hundred_runs_list_from_their_summaries_alone_newest_first(tmp_path, monkeypatch):
    for i in range(200):
        run = RunDir(str(tmp_path / f"run-{i:03d}"))
        run.create()  # takes the lock: released below, as when a process ends
        summary = Summary(status="running" if i % 50 == 0 else "completed", epochs=10,
                          epochs_completed=i % 11, backend="jax", replicas=8, input_wait=0.25)  # fmt: skip
        run.write_summary(summary)
        data = json.loads((Path(run.path) / "summary.json").read_text())
        data["updated"] = f"2026-01-01T{i // 60:02d}:{i % 60:02d}:00+0000"
        (Path(run.path) / "summary.json").write_text(json.dumps(data))
        (Path(run.path) / "checkpoints" / "huge.weights.h5").write_bytes(b"\0")  # never read
        run.unlock()
    opened = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        opened.append(os.fspath(file) if isinstance(file, (str, os.PathLike)) else file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    rows = list_runs(str(tmp_path))
    monkeypatch.undo()
    # What keeps the listing fast (it is not timed here): one summary read per run; for the
    # running ones, their lock, config and log; never a checkpoint.
    names = [
        os.path.basename(f) for f in opened if isinstance(f, str) and f.startswith(str(tmp_path))
    ]
    assert names.count("summary.json") == 200
    assert set(names) <= {"summary.json", "run.lock", "config.yaml", "log.csv"}, set(names)
    assert names.count("config.yaml") <= 4  # the four summaries that say running
    assert len(rows) == 200 and rows[0]["name"] == "run-199" and rows[-1]["name"] == "run-000"
    died = {row["name"] for row in rows if row["status"] == "died"}
    assert died == {"run-000", "run-050", "run-100", "run-150"}  # running, nobody holds the lock
    assert {row["input_wait"] for row in rows} == {0.25}


def test_runs_of_a_folder_that_does_not_exist(tmp_path):
    result = CliRunner().invoke(app, ["runs", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "nowhere: no such folder" in result.output
    empty = CliRunner().invoke(app, ["runs", str(tmp_path)])
    assert empty.exit_code == 0 and f"no runs in {tmp_path}" in empty.output


def test_a_log_newer_than_the_summary_gives_its_epochs_and_best_together(tmp_path):
    """The summary is rewritten after each epoch's log row: read between the two, the listing
    shows the log's epochs with the log's best, never the summary's best beside the log's count."""
    best = {"monitor": "val_loss", "value": 0.5, "epoch": 2}
    run = write_run(tmp_path, "raced", "00:01", status="running", epochs=9, epochs_completed=2,
                    best=best)  # fmt: skip
    (run / "log.csv").write_text("epoch,loss,val_loss\n0,0.9,0.7\n1,0.6,0.5\n2,0.4,0.3\n")
    [row] = list_runs(str(tmp_path))
    assert (row["epochs_completed"], row["best_value"], row["best_epoch"]) == (3, 0.3, 3)
    # The log no newer than the summary: the summary's epochs and best, which agree.
    (run / "log.csv").write_text("epoch,loss,val_loss\n0,0.9,0.7\n1,0.6,0.5\n")
    [row] = list_runs(str(tmp_path))
    assert (row["epochs_completed"], row["best_value"], row["best_epoch"]) == (2, 0.5, 2)
