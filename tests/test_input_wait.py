"""Input wait: the seconds a real fit spends in ``next()``, measured against inputs and steps made
slow on purpose by a known sleep (ratios that hold on a loaded machine, where absolute times do
not); the verdict's thresholds; the measure never reaches the CSV log."""

from __future__ import annotations

import csv
import re
import time
from types import SimpleNamespace

import numpy as np
from helpers import toy_config

import tpurun
from tpurun.observe.callbacks import InputWait
from tpurun.observe.input_wait import verdict

SLEEP = 0.05  # seconds: what a batch costs on purpose, the input's or the step's
BATCHES = 8


def timed_fit(input_sleep: float, step_sleep: float) -> InputWait:
    """A real Keras fit of a tiny model whose input costs ``input_sleep`` a batch (a generator
    that sleeps) and whose step costs ``step_sleep`` more (a callback that sleeps before it)."""
    import keras

    def batches():
        rng = np.random.default_rng(0)
        x, y = rng.normal(size=(4, 8)).astype("float32"), np.ones((4, 1), "float32")
        while True:
            time.sleep(input_sleep)
            yield x, y

    class SlowStep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            time.sleep(step_sleep)

    keras.distribution.set_distribution(None)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    wait = InputWait(SimpleNamespace(backend="jax", steps_per_execution=1, accelerator="cpu"))
    model.fit(batches(), steps_per_epoch=BATCHES, epochs=2, verbose=0, shuffle=False,
              callbacks=[wait, SlowStep()])  # fmt: skip
    return wait


def test_a_slow_input_is_measured_as_the_time_it_takes():
    """Each batch sleeps SLEEP in the input: the wait measured is at least that, batch by batch
    (a sleep never ends early), and not much more (the measure adds two clock reads)."""
    wait = timed_fit(input_sleep=SLEEP, step_sleep=0.0)
    assert len(wait.epoch_waits) == 2
    waited, seconds = wait.epoch_waits[1]  # the second epoch: nothing compiles in it
    assert 1.0 <= waited / (BATCHES * SLEEP) < 3.0, wait.epoch_waits
    assert waited <= seconds
    assert 0.0 < wait.epoch_value <= 1.0


def test_a_slow_step_on_a_fast_input_waits_for_almost_nothing():
    wait = timed_fit(input_sleep=0.0, step_sleep=SLEEP)
    waited, seconds = wait.epoch_waits[1]
    assert seconds >= BATCHES * SLEEP  # the steps' sleeps are inside the epoch's time
    assert waited / (BATCHES * SLEEP) < 0.5, wait.epoch_waits  # but not inside next()


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
