"""``tpurun runs``: completed, stopped, killed and running runs, read from their summaries alone."""

from __future__ import annotations

import builtins
import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from conftest import start_cli, toy_config
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app
from tpurun.observe.runs import list_runs
from tpurun.storage.rundir import RunDir
from tpurun.storage.summary import Summary


def runs_json(folder: Path) -> dict[str, dict]:
    result = CliRunner().invoke(app, ["runs", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    return {run["name"]: run for run in json.loads(result.output)}


def wait_for_epoch(run_dir: Path, proc, timeout: float = 240) -> None:
    """Until the run has logged an epoch (it is training), or fail with what it printed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / "log.csv").exists() and len((run_dir / "log.csv").read_text().split()) > 1:
            return
        if proc.poll() is not None:
            raise AssertionError(proc.communicate()[1])
        time.sleep(0.2)
    raise AssertionError(f"{run_dir}: no epoch logged in {timeout} s")


@pytest.mark.slow
def test_completed_stopped_killed_and_running_runs(toy_data, tmp_path):
    runs = tmp_path / "runs"
    tpurun.train(toy_config(toy_data, runs, name="done", train={"epochs": 1}), verbose=False)

    procs = {}
    for name in ("stopped", "killed", "live"):  # real processes, still training
        config = toy_config(toy_data, runs, name=name, train={"epochs": 500})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        procs[name] = start_cli("train", str(path))
    try:
        for name, proc in procs.items():
            wait_for_epoch(runs / name, proc)
        procs["stopped"].send_signal(signal.SIGTERM)
        procs["killed"].send_signal(signal.SIGKILL)
        procs["stopped"].communicate(timeout=120)
        procs["killed"].communicate(timeout=60)
        assert procs["stopped"].returncode == 3 and procs["killed"].returncode == -9

        listed = runs_json(runs)
        assert {name: run["status"] for name, run in listed.items()} == {
            "done": "completed", "stopped": "stopped", "killed": "died", "live": "running",
        }  # fmt: skip
        # The killed run's summary still says running: only its released lock tells.
        assert json.loads((runs / "killed" / "summary.json").read_text())["status"] == "running"
        done = listed["done"]
        assert (done["epochs_completed"], done["epochs"], done["best_epoch"]) == (1, 1, 1)
        assert done["best_monitor"] == "val_loss" and done["best_value"] > 0
        assert (done["backend"], done["replicas"]) == ("jax", 1)
        assert done["examples_per_sec"] > 0 and 0 <= done["input_wait"] <= 1
        live = listed["live"]  # its summary is the one it started with; its log is newer
        assert live["epochs"] == 500 and live["epochs_completed"] >= 1
        assert live["best_monitor"] == "val_loss" and live["best_value"] > 0
        assert next(iter(listed)) != "done"  # newest first: the others updated later

        table = CliRunner().invoke(app, ["runs", str(runs), "--plain"])
        assert table.exit_code == 0, table.output
        lines = table.output.splitlines()
        assert lines[0].split() == ["run", "status", "epochs", "best", "backend", "examples/s",
                                    "input", "wait", "updated"]  # fmt: skip
        done_line = next(line for line in lines if line.startswith("done "))
        assert " completed " in done_line and " 1/1 " in done_line and " jax x1 " in done_line
        assert "val_loss" in done_line and "@1" in done_line
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=60)


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
