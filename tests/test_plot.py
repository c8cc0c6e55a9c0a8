"""Curves as pictures: ``tpurun plot``, ``tpurun.plot`` and each run's ``curves.png``."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from conftest import toy_config
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
    a = fake_run(tmp_path, "a", [10.0, 1.0, 0.1, 0.02], [1e-3, 1e-3, 1e-4, 1e-5])
    b = fake_run(tmp_path, "b", [5.0, 4.0, 3.5], [1e-3, 1e-3, 1e-3])
    return a, b


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


def test_tpurun_plot_writes_a_png_of_the_expected_size(two_runs, tmp_path):
    a, b = two_runs
    out = tmp_path / "curves.png"
    result = CliRunner().invoke(app, ["plot", str(a), str(b), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert png_size(out) == (1280, 400)  # two 640x400 panels
    assert f"wrote {out} (1280x400 px): loss, accuracy of 2 run(s), 8 lines" in result.output

    one = tmp_path / "accuracy.png"
    result = CliRunner().invoke(app, ["plot", str(a), str(b), "--metric", "val_accuracy",
                                      "-o", str(one)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert png_size(one) == (640, 400)
    assert "accuracy of 2 run(s), 4 lines" in result.output


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


def test_every_session_ends_with_curves_png_covering_all_epochs(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 1})
    tpurun.train(config, verbose=False)
    curves = tmp_path / "runs" / "toy" / "curves.png"
    assert png_size(curves) == (1280, 400)
    first = curves.read_bytes()

    config["train"]["epochs"] = 2  # resume for one more epoch: the picture is drawn again
    tpurun.train(config, verbose=False)
    assert curves.read_bytes() != first
    fig = tpurun.plot(str(tmp_path / "runs" / "toy"))
    assert [len(line.get_xdata()) for line in fig.axes[0].get_lines()] == [2, 2]
