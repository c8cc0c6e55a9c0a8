"""The learning-rate axis of a plot means something: a constant rate is drawn on an axis from 0
to twice it, not on float noise."""

from __future__ import annotations

import pytest

import tpurun

pytest.importorskip("matplotlib")


def write_run(folder, rates):
    folder.mkdir(parents=True)
    rows = ["epoch,loss,learning_rate"] + [
        f"{i},{1 / (i + 1):.4f},{r}" for i, r in enumerate(rates)
    ]
    (folder / "log.csv").write_text("\n".join(rows) + "\n")


def lr_axis(fig):
    (twin,) = [ax for ax in fig.axes if ax.get_ylabel() == "learning rate"]
    return twin


def test_a_constant_learning_rate_gets_an_axis_from_zero(tmp_path):
    write_run(tmp_path / "const", [0.001] * 5)
    twin = lr_axis(tpurun.plot(str(tmp_path / "const")))
    assert twin.get_ylim() == pytest.approx((0.0, 0.002))
    assert twin.get_yscale() == "linear"


def test_a_changing_rate_keeps_its_own_range(tmp_path):
    write_run(tmp_path / "decay", [0.001, 0.0005, 0.0002, 0.0001, 0.00001])
    twin = lr_axis(tpurun.plot(str(tmp_path / "decay")))
    assert twin.get_yscale() == "log"  # two decades
