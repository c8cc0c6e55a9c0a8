"""Derived values: global batch, LR scaling, steps, steps_per_execution."""

from __future__ import annotations

import math

import pytest

from tpurun.config import load_config
from tpurun.errors import ConfigError, DataError
from tpurun.plan.plan import auto_steps_per_execution, make_plan
from tpurun.runtime.choice import Choice


def config(**train):
    return load_config(
        {
            "model": {"factory": "m:f", "loss": "mse"},
            "data": {"train": "t", "validation": "v", "features": {"x": {"type": "float"}}, "inputs": "x", "targets": "x"},
            "train": train,
        }
    )  # fmt: skip


def choice(replicas=8, max_spe=None) -> Choice:
    return Choice(
        "jax", "cpu", "data_parallel", replicas, "float32", "test", max_steps_per_execution=max_spe
    )


def plan(cfg, replicas=8, records=10_000, val=1000, max_spe=None):
    return make_plan(
        cfg, choice(replicas, max_spe), replicas, [records], None if val is None else [val]
    )


def test_global_batch_and_linear_scaling_like_a_v3_8():
    cfg = config(per_core_batch_size=128, learning_rate={"base": 1e-3, "base_batch_size": 128})
    p = plan(cfg, records=10_000, val=2100)
    assert (p.per_core_batch_size, p.global_batch_size) == (128, 1024)
    assert p.learning_rate == pytest.approx(8e-3)
    # Validation scores every record: 2100 = 2 x 1024 + 52, so a third, padded batch.
    assert (p.steps_per_epoch, p.validation_steps, p.validation_scored) == (9, 3, 2100)


def test_sqrt_and_no_scaling():
    p = plan(
        config(
            per_core_batch_size=64,
            learning_rate={"base": 1e-3, "base_batch_size": 128, "scaling": "sqrt"},
        )
    )
    assert p.learning_rate == pytest.approx(1e-3 * math.sqrt(4))
    p = plan(
        config(
            per_core_batch_size=64,
            learning_rate={"base": 1e-3, "base_batch_size": 128, "scaling": "none"},
        )
    )
    assert p.learning_rate == pytest.approx(1e-3)
    p = plan(config(per_core_batch_size=64))  # no base_batch_size: base is for this batch
    assert p.learning_rate == pytest.approx(1e-3)


def test_global_batch_size_must_divide_over_replicas():
    assert plan(config(global_batch_size=256)).per_core_batch_size == 32
    with pytest.raises(ConfigError, match="100 does not divide evenly over 8 replicas"):
        plan(config(global_batch_size=100))


def test_small_or_odd_per_core_batches_warn():
    assert any("below 8" in w for w in plan(config(per_core_batch_size=4)).warnings)
    assert any("not a multiple of 8" in w for w in plan(config(per_core_batch_size=12)).warnings)
    assert not plan(config(per_core_batch_size=16)).warnings


def test_auto_steps_from_record_counts():
    p = plan(config(per_core_batch_size=16), records=1437, val=360)
    assert (p.steps_per_epoch, p.validation_steps) == (11, 3)
    with pytest.raises(DataError, match="fewer than one global batch of 128"):
        plan(config(per_core_batch_size=16), records=100)


def test_auto_steps_per_execution_divides_the_epoch():
    assert auto_steps_per_execution(11, None) == 11
    assert auto_steps_per_execution(100, None) == 25
    assert auto_steps_per_execution(64, None) == 32
    assert auto_steps_per_execution(97, None) == 1  # prime: one step per execution
    assert auto_steps_per_execution(64, 1) == 1  # keras#19246 cap
    assert plan(config(per_core_batch_size=16), records=1437, max_spe=1).steps_per_execution == 1


def test_explicit_steps_per_execution_rounds_the_epoch_to_whole_executions():
    p = plan(config(per_core_batch_size=16, steps_per_epoch=10, steps_per_execution=4))
    assert (p.steps_per_epoch, p.steps_per_execution) == (8, 4)
    assert any("not a multiple of steps_per_execution 4" in w for w in p.warnings)
    p = plan(config(per_core_batch_size=16, steps_per_epoch=10, steps_per_execution=32))
    assert (p.steps_per_epoch, p.steps_per_execution) == (10, 10)


def test_warmup_and_total_steps():
    p = plan(
        config(
            per_core_batch_size=16,
            epochs=4,
            steps_per_epoch=50,
            learning_rate={"warmup_epochs": 0.5},
        )
    )
    assert (p.warmup_steps, p.total_steps) == (25, 200)


def test_monitor_auto_is_val_loss_with_validation():
    assert plan(config()).monitor == "val_loss"


def test_validation_smaller_than_a_batch_is_scored_and_explicit_steps_are_capped():
    p = plan(config(per_core_batch_size=16), records=1000, val=60)  # global batch 128
    assert (p.validation_steps, p.validation_scored) == (1, 60)
    p = plan(config(per_core_batch_size=16, validation_steps=5), records=1000, val=300)
    assert (p.validation_steps, p.validation_scored) == (3, 300)  # only 3 batches exist
    p = plan(config(per_core_batch_size=16, validation_steps=1), records=1000, val=300)
    assert (p.validation_steps, p.validation_scored) == (1, 128)  # the first batch, as asked


def test_too_few_training_records_names_the_fix_that_works():
    with pytest.raises(
        DataError, match=r"fewer than one global batch of 128.*Lower train.per_core_batch_size"
    ):
        plan(config(per_core_batch_size=16), records=100)
