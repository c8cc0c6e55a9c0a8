"""Input wait: the seconds a real fit spends in ``next()``, measured on a stepped clock (the
measure's own clock, which only the input and the step move, by known amounts: exact on a loaded
machine); the verdict's thresholds; the measure never reaches the CSV log."""

from __future__ import annotations

import csv
import re
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import toy_config

import tpurun
from tpurun.observe import callbacks
from tpurun.observe.callbacks import InputWait
from tpurun.observe.input_wait import verdict

BATCHES = 8


class SteppedClock:
    """The measure's ``time.perf_counter``: it stands still until something costs time."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> SteppedClock:
    stepped = SteppedClock()
    monkeypatch.setattr(callbacks, "time", SimpleNamespace(perf_counter=stepped))
    return stepped


def stepped_fit(clock: SteppedClock, input_cost: float, step_cost: float) -> InputWait:
    """A real Keras fit of a tiny model whose input costs ``input_cost`` seconds a batch (a
    generator that moves the clock) and whose step costs ``step_cost`` more (a callback that moves
    it before the step)."""
    import keras

    def batches():
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(4, 8)).astype("float32"), np.ones((4, 1), "float32")
        while True:
            clock.spend(input_cost)
            yield x, y

    class SlowStep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            clock.spend(step_cost)

    keras.distribution.set_distribution(None)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    wait = InputWait(SimpleNamespace(backend="jax", steps_per_execution=1, accelerator="cpu"))
    model.fit(batches(), steps_per_epoch=BATCHES, epochs=2, verbose=0, shuffle=False,
              callbacks=[wait, SlowStep()])  # fmt: skip
    return wait


def test_a_slow_input_is_measured_as_the_time_it_takes(clock):
    """Each batch costs 0.25 s of input and 0.5 s of step: of the second epoch's 6 s, the 2 s
    inside ``next()`` are the wait. (Keras reads the first batches before the first epoch
    begins, to learn their shapes: that epoch, compiling too, is the one the verdict leaves out.)"""
    wait = stepped_fit(clock, input_cost=0.25, step_cost=0.5)
    assert len(wait.epoch_waits) == 2
    assert wait.epoch_waits[1] == (BATCHES * 0.25, BATCHES * 0.75)
    assert wait.epoch_value == 0.25 / 0.75


def test_a_slow_step_on_a_fast_input_waits_for_nothing(clock):
    wait = stepped_fit(clock, input_cost=0.0, step_cost=0.5)
    assert wait.epoch_waits[1] == (0.0, BATCHES * 0.5)  # the steps' time is not in next()
    assert wait.epoch_value == 0.0


def test_a_run_shows_its_input_wait_and_keeps_it_out_of_the_log(toy_data, tmp_path, capsys):
    config = toy_config(toy_data, tmp_path / "runs", name="wait", train={"epochs": 3})
    summary = tpurun.train(config)
    out = capsys.readouterr().out
    assert len(summary["epoch_input_wait"]) == 3
    assert all(0.0 <= w <= 1.0 for w in summary["epoch_input_wait"])
    assert (
        len(
            re.findall(
                r"^\[tpurun\] epoch \d/3 .* ex/s  (.*FLOP/s/device  )?input wait \d+%$", out, re.M
            )
        )
        == 3
    ), out
    with open(tmp_path / "runs" / "wait" / "log.csv", newline="") as f:
        header = next(csv.reader(f))
    assert "input_wait" not in header  # shown, then taken out of the logs
    assert "input_wait" not in summary["final_metrics"]


def test_the_verdict_needs_a_second_of_training_and_names_the_bench_command():
    slow = [(9.0, 10.0), (3.0, 5.0), (3.2, 5.0)]  # the first epoch (compiling) is left out
    text, level = verdict(slow, "runs/x/config.yaml")
    assert level == "warn" and text.startswith("input-bound: 62% of the training loop's time")
    assert "`tpurun data bench runs/x/config.yaml`" in text
    assert verdict([(0.0, 1.0), (0.1, 2.0)], "c.yaml")[0].startswith("compute-bound: 5%")
    assert verdict([(0.0, 1.0), (0.5, 2.0)], "c.yaml")[0].startswith("partly input-bound: 25%")
    assert verdict([(0.4, 0.5), (0.4, 0.5)], "c.yaml") is None  # half a second: too short
    assert verdict([], "c.yaml") is None  # not measured
