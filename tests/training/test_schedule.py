"""The learning-rate schedule across a resume that changes the run's length.

A rerun with more (or fewer) epochs stretches the decay left at the resume step over the batches
left to the new end, from where it is: the rate is continuous at the resume step, reaches the
decay's end at the new last step, and later sessions go on with the stretched schedule.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import keras
import numpy as np
import pytest
from helpers import read_latest, read_log, signal_at, toy_config

import tpurun
from tpurun.errors import Interrupted, TpurunError
from tpurun.training.schedule import continued_shape, learning_rate_schedule, schedule_shape


def _setup(total: int, warmup: int = 0, n: int = 1, schedule: str = "cosine"):
    config = SimpleNamespace(train=SimpleNamespace(
        learning_rate=SimpleNamespace(schedule=schedule), gradient_accumulation_steps=n))  # fmt: skip
    plan = SimpleNamespace(learning_rate=0.1, warmup_steps=warmup, total_steps=total)
    return config, plan


def _rate(schedule, batch: float) -> float:
    return float(keras.ops.convert_to_numpy(schedule(batch)))


@pytest.mark.parametrize(("warmup", "n"), [(0, 1), (10, 1), (0, 4), (10, 4)])
@pytest.mark.parametrize("new_total", [200, 150, 400])
def test_the_rate_is_continuous_at_the_resume_step_and_ends_at_the_new_end(warmup, n, new_total):
    config, old_plan = _setup(100, warmup, n)
    old = schedule_shape(config, old_plan)
    new_plan = SimpleNamespace(**{**vars(old_plan), "total_steps": new_total})
    configured = schedule_shape(config, new_plan)
    at = 60 * n  # batches done: past the warmup, the decay partly done
    shape, note = continued_shape(old, configured, at)
    before = _rate(learning_rate_schedule(config, old_plan, shape=old), at)
    after = learning_rate_schedule(config, new_plan, shape=shape)
    assert _rate(after, at) == pytest.approx(before, rel=1e-6)
    end = configured["warmup_steps"] + configured["decay_steps"]
    assert shape["warmup_steps"] + shape["decay_steps"] == pytest.approx(end)
    assert _rate(after, end) == pytest.approx(0.0, abs=1e-9)
    # Decreasing from the resume step to the end, with no jump anywhere.
    rates = [_rate(after, b) for b in np.linspace(at, end, 50)]
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    done = (at - old["warmup_steps"]) / old["decay_steps"]
    assert note == (
        f"learning rate: the run's length changed, so the decay left at step {at:,} "
        f"({done:.0%} done) is stretched to end at step {end:,}; the rate goes on from its "
        "value there (docs/resume.md)."
    )
    # What a plain rebuild over the new length would have done: a jump.
    plain = _rate(learning_rate_schedule(config, new_plan), at)
    assert not math.isclose(plain, before, rel_tol=1e-3)


def test_unchanged_lengths_in_the_warmup_and_a_second_resume_keep_the_schedule():
    config, plan = _setup(100, warmup=10)
    shape = schedule_shape(config, plan)
    assert continued_shape(shape, shape, 50) == (shape, None)
    assert continued_shape(None, shape, 50) == (shape, None)  # a checkpoint from before
    longer = schedule_shape(config, SimpleNamespace(**{**vars(plan), "total_steps": 200}))
    assert continued_shape(shape, longer, 5) == (longer, None)  # the decay has not begun
    stretched, _ = continued_shape(shape, longer, 50)
    assert continued_shape(stretched, longer, 120) == (stretched, None)  # its end: kept


def test_more_epochs_after_a_cosine_decay_ended_are_refused():
    config, plan = _setup(100)
    shape = schedule_shape(config, plan)
    longer = schedule_shape(config, SimpleNamespace(**{**vars(plan), "total_steps": 200}))
    with pytest.raises(TpurunError, match=r"decayed to 0 at step 100, where it stopped"):
        continued_shape(shape, longer, 100)
    assert continued_shape(shape, longer, 100, decays=False) == (longer, None)  # constant


def _config(toy_data, tmp_path, name: str, epochs: int) -> dict:
    return toy_config(toy_data, tmp_path / "runs", name=name,
                      train={"epochs": epochs, "steps_per_execution": 2,
                             "learning_rate": {"base": 0.01, "schedule": "cosine"}})  # fmt: skip


def test_more_epochs_on_a_resume_stretch_the_decay_and_later_sessions_keep_it(
    toy_data, tmp_path, capsys
):
    """4 epochs of 16 steps stopped at epoch 3, step 6, then rerun with 6 epochs: the rate goes on
    from its value at step 38 down to 0 at step 96; a second stop and rerun keep that schedule,
    and the log is the one of that session unbroken."""
    for name in ("a", "b"):
        stopped = _config(toy_data, tmp_path, name, 4)
        stopped["callbacks"] = {"extra": [signal_at(tmp_path / f"{name}-1", epoch=3, step=6)]}
        with pytest.raises(Interrupted):
            tpurun.train(stopped, verbose=False)
    capsys.readouterr()
    tpurun.train(_config(toy_data, tmp_path, "a", 6))
    out = capsys.readouterr().out
    done = 38 / 64
    assert "resuming at epoch 3, step 6 from" in out
    assert f"the decay left at step 38 ({done:.0%} done) is stretched to end at step 96" in out
    rows = read_log(tmp_path / "runs" / "a")
    shape = read_latest(tmp_path / "runs" / "a")["lr_shape"]
    assert shape["warmup_steps"] + shape["decay_steps"] == pytest.approx(96)
    # The logged rate is the next update's, after epoch e: batch 16e. Rows 1-2 follow the
    # 4-epoch cosine, rows 3-6 the stretched one, which meets it at step 38.
    peak = 0.01
    for epoch, row in enumerate(rows, start=1):
        step = 16 * epoch
        if epoch <= 2:
            expected = peak * 0.5 * (1 + math.cos(math.pi * step / 64))
        else:
            phase = done + (1 - done) * (step - 38) / (96 - 38)
            expected = peak * 0.5 * (1 + math.cos(math.pi * phase))
        assert float(row["learning_rate"]) == pytest.approx(expected, rel=1e-5, abs=1e-9)

    # The same lengthening, stopped again inside it and rerun: the stretched shape is kept.
    longer = _config(toy_data, tmp_path, "b", 6)
    longer["callbacks"] = {"extra": [signal_at(tmp_path / "b-2", epoch=5, step=3)]}
    with pytest.raises(Interrupted):
        tpurun.train(longer, verbose=False)
    tpurun.train(_config(toy_data, tmp_path, "b", 6), verbose=False)
    assert read_log(tmp_path / "runs" / "b") == rows
