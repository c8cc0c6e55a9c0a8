"""Curves as pictures: ``tpurun plot``, ``tpurun.plot`` and each run's ``curves.png``: what the
picture shows (its panels and lines, read from the Figure drawn into it), runs named as ``tpurun
runs`` lists them, and a machine without matplotlib."""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
from pathlib import Path

import pytest
from helpers import run_cli
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app
from tpurun.storage.rundir import RunDir


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])  # the IHDR chunk: width, height


def fake_run(folder: Path, name: str, losses: list[float], lr: list[float]) -> Path:
    """A run directory with a CSV log as tpurun writes it."""
    (folder / name).mkdir()
    run = RunDir(str(folder / name))
    for epoch, (loss, rate) in enumerate(zip(losses, lr, strict=True)):
        run.append_log("log.csv", epoch, {
            "loss": loss, "val_loss": loss * 1.1, "accuracy": 1 - loss / 20,
            "val_accuracy": 1 - loss / 18, "learning_rate": rate,
        })  # fmt: skip
    return Path(run.path)


@pytest.fixture
def two_runs(tmp_path):
    """Runs a and b under ``tmp_path/runs``, as ``tpurun train`` leaves them there."""
    (tmp_path / "runs").mkdir()
    a = fake_run(tmp_path / "runs", "a", [10.0, 1.0, 0.1, 0.02], [1e-3, 1e-3, 1e-4, 1e-5])
    b = fake_run(tmp_path / "runs", "b", [5.0, 4.0, 3.5], [1e-3, 1e-3, 1e-3])
    return a, b


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The Figures saved as PNGs from here on (by ``tpurun plot`` or ``tpurun.plot``), each
    with the path it went to: what the picture shows, read back from what drew it."""
    from tpurun.observe import curves

    saved, real = [], curves.save

    def save(fig, path):
        saved.append((fig, path))
        return real(fig, path)

    monkeypatch.setattr(curves, "save", save)
    return saved


def panels(fig) -> dict[str, list[str]]:
    """Each visible panel's title and the labels of its lines (the learning rate's axis, which
    has no title, counted with the panel it shares)."""
    titled = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    shown = {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in titled}
    for twin in [ax for ax in fig.axes if ax.get_visible() and not ax.get_title()]:
        [panel] = [ax for ax in titled if ax in twin.get_shared_x_axes().get_siblings(twin)]
        shown[panel.get_title()] += [line.get_label() for line in twin.get_lines()]
    return shown


def test_the_figure_has_one_line_per_run_and_metric_and_the_lr_on_a_second_axis(two_runs):
    fig = tpurun.plot([str(p) for p in two_runs])
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["loss", "accuracy"]
    for ax in panels:
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == ["a train", "a validation", "b train", "b validation"]
        assert [len(line.get_xdata()) for line in ax.get_lines()] == [4, 4, 3, 3]
    loss, accuracy = panels
    assert list(loss.get_lines()[0].get_xdata()) == [1, 2, 3, 4]  # epochs from 1
    assert loss.get_yscale() == "log"  # 10 down to 0.02: three decades
    assert accuracy.get_yscale() == "linear"
    (twin,) = [ax for ax in fig.axes if not ax.get_title()]  # the learning rate's axis
    assert [line.get_label() for line in twin.get_lines()] == ["a learning rate", "b learning rate"]
    assert twin.get_ylabel() == "learning rate" and twin.get_yscale() == "log"


def test_tpurun_plot_draws_two_panels_of_every_run_into_the_png(two_runs, tmp_path, drawn):
    a, b = two_runs
    out = tmp_path / "curves.png"
    result = CliRunner().invoke(app, ["plot", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert png_size(out) == (1280, 400)  # two 640x400 panels
    assert f"wrote {out} (1280x400 px): loss, accuracy of 2 run(s), 8 lines" in result.output
    [(fig, path)] = drawn
    assert path == str(out)
    assert panels(fig) == {
        "loss": ["a train", "a validation", "b train", "b validation", "a learning rate",
                 "b learning rate"],
        "accuracy": ["a train", "a validation", "b train", "b validation"],
    }  # fmt: skip

    one = tmp_path / "accuracy.png"
    result = CliRunner().invoke(app, ["plot", str(a), str(b), "--metric", "val_accuracy",
                                      "-o", str(one)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert png_size(one) == (640, 400)
    assert "accuracy of 2 run(s), 4 lines" in result.output
    # One panel: the learning rate goes on it, as on the first panel of several.
    assert panels(drawn[-1][0]) == {"accuracy": ["a train", "a validation", "b train",
                                                 "b validation", "a learning rate",
                                                 "b learning rate"]}  # fmt: skip


def test_runs_given_by_name_are_found_under_runs(two_runs, tmp_path, monkeypatch, drawn):
    """The names `tpurun runs` lists, from the folder that holds ./runs."""
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["plot", "b", "-o", "b.png", "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["runs"] == [os.path.join("runs", "b")] and shown["lines"] == 4
    assert png_size(tmp_path / "b.png") == (1280, 400)
    # One run: its lines are named train and validation, without the run's name.
    assert panels(drawn[0][0]) == {"loss": ["train", "validation", "learning rate"],
                                   "accuracy": ["train", "validation"]}  # fmt: skip
    fig = tpurun.plot(["a", "b"], ["loss"], output=str(tmp_path / "loss.png"))
    assert drawn[-1] == (fig, str(tmp_path / "loss.png"))
    assert [len(line.get_xdata()) for line in fig.axes[0].get_lines()] == [4, 4, 3, 3]
    result = CliRunner().invoke(app, ["plot", "c"])
    assert result.exit_code == 2 and "c: no such run directory" in result.output


@pytest.mark.slow
def test_without_matplotlib_plot_names_the_viz_extra(two_runs, tmp_path):
    """A machine without matplotlib (an import that fails, as on a bare install): exit 2 and
    what to install; no picture."""
    shadow = tmp_path / "no-matplotlib" / "matplotlib"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    a, _ = two_runs
    done = run_cli("plot", str(a), "-o", str(tmp_path / "a.png"),
                   env={"PYTHONPATH": str(shadow.parent)}, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(
        "error: plotting needs matplotlib: pip install 'tpurun[viz]' (or pip install matplotlib)"
    ), done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "a.png").exists()


def test_plot_errors_name_the_run_or_the_metric(two_runs, tmp_path):
    a, _ = two_runs
    result = CliRunner().invoke(app, ["plot", str(a), "--metric", "auc", "-o", "x.png"])
    assert result.exit_code == 2
    assert "--metric auc: not in the logs of a; they log loss, accuracy." in result.output
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(app, ["plot", str(empty)])
    assert result.exit_code == 2 and "no epochs to plot: log.csv is missing" in result.output
    result = CliRunner().invoke(app, ["plot", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "nowhere: no such run directory" in result.output


def test_every_session_ends_with_curves_png_covering_all_epochs(trained_toy_run, tmp_path):
    """The session's toy run (1 epoch) has its curves.png; one more epoch, resumed from the run
    directory's own config.yaml with the Python API's overrides, draws it again with 2."""
    run_dir = trained_toy_run.copy(tmp_path)
    curves = run_dir / "curves.png"
    assert png_size(curves) == (1280, 400)
    first = curves.read_bytes()

    summary = tpurun.train(str(run_dir / "config.yaml"), overrides=["train.epochs=2"],
                           output=str(tmp_path), verbose=False)  # fmt: skip
    assert summary["resumes"][-1]["epoch"] == 1 and summary["epochs_completed"] == 2
    assert curves.read_bytes() != first
    fig = tpurun.plot(str(run_dir))
    assert [len(line.get_xdata()) for line in fig.axes[0].get_lines()] == [2, 2]


def test_matplotlib_is_imported_ahead_in_its_own_thread_for_the_end(
    trained_toy_run, tmp_path, monkeypatch
):
    """curves.png's import of matplotlib starts in a thread of its own as training begins (it
    overlaps the first step's compiling), once, before the end draws with it."""
    import matplotlib.figure

    from tpurun.observe import curves
    from tpurun.training import ending

    events: list[str] = []

    def imported() -> None:  # the import, as it leaves sys.modules (not run twice)
        events.append(f"import in {threading.current_thread().name}")
        sys.modules["matplotlib.figure"] = matplotlib.figure

    def save_curves(run):
        events.append("draw")
        return real_save(run)

    real_save = ending.save_curves
    monkeypatch.delitem(sys.modules, "matplotlib.figure")  # as in a new process
    monkeypatch.setattr(curves, "_import_figure", imported)
    monkeypatch.setattr(ending, "save_curves", save_curves)
    run_dir = trained_toy_run.copy(tmp_path)
    tpurun.train(str(run_dir / "config.yaml"), overrides=["train.epochs=2"],
                 output=str(tmp_path), verbose=False)  # fmt: skip
    assert events == ["import in tpurun-matplotlib", "draw"]
    assert png_size(run_dir / "curves.png") == (1280, 400)


def test_matplotlib_is_not_imported_ahead_where_nothing_would_draw(tmp_path, monkeypatch):
    """Not by a process that does not write the run directory, not where matplotlib is imported
    already, and not where it is not installed."""
    import importlib.util

    from tpurun.observe import curves

    started: list[str] = []
    monkeypatch.setattr(curves, "_import_figure", lambda: started.append("import"))
    writer, reader = RunDir(str(tmp_path), writer=True), RunDir(str(tmp_path), writer=False)
    assert curves.import_ahead(writer) is None  # imported already in this process
    monkeypatch.delitem(sys.modules, "matplotlib.figure")
    assert curves.import_ahead(reader) is None
    real_find = importlib.util.find_spec
    with monkeypatch.context() as patch:
        patch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "matplotlib" else real_find(name, *a))  # fmt: skip
        assert curves.import_ahead(writer) is None
    assert started == []
    thread = curves.import_ahead(writer)  # the one case that imports
    thread.join()
    assert (thread.name, started) == ("tpurun-matplotlib", ["import"])
