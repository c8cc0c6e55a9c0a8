"""Gradient accumulation (``train.gradient_accumulation_steps``): the plan's effective batch and
learning rate, updates equal to a bigger batch's, schedules that count updates (read back from
TensorBoard), both backends with several steps per execution, and an exact resume after SIGKILL.

What Keras 3.15 does (``keras/src/optimizers/base_optimizer.py``): every batch adds its gradient to
a ``gradient_accumulator`` slot per variable and advances ``_iterations``; at batch ``k*N + N-1``
it applies the mean of the N gradients, with the schedule read at that batch count, and zeroes the
slots; ``optimizer.iterations`` reads ``_iterations // N``, the updates done.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
from helpers import (
    FACTORIES,
    read_log,
    read_summary,
    run_cli,
    signal_at,
    toy_config,
    write_config,
)
from test_tensorboard import read_events

import tpurun
from tpurun.config import load_config
from tpurun.errors import TpurunError
from tpurun.plan.plan import make_plan
from tpurun.runtime.choice import Choice

#: Warmup then cosine decay, with SGD: each update moves the weights by exactly lr x gradient.
SCHEDULE = {"base": 0.05, "warmup_epochs": 1.5, "schedule": "cosine"}


def accumulating(toy_data, tmp_path, name: str, batch: int, n: int, **train) -> dict:
    """The toy config at global batch ``batch``, N = ``n``, SGD on a schedule."""
    train = {"per_core_batch_size": batch, "gradient_accumulation_steps": n, "epochs": 3,
             "learning_rate": SCHEDULE, **train}  # fmt: skip
    config = toy_config(toy_data, tmp_path / "runs", name=name, train=train)
    config["model"]["optimizer"] = {"name": "sgd"}
    return config


def final_weights(run_dir) -> list[np.ndarray]:
    return keras.saving.load_model(run_dir / "model.keras").get_weights()


def assert_same_weights(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- the plan
def _plan(n: int, steps_per_epoch: int | str = "auto", **lr):
    config = load_config(
        {
            "name": "p",
            "model": {"factory": "m.py:f", "loss": "mse"},
            "data": {
                "train": "x-*.tfrecord",
                "features": {"x": {"type": "float"}},
                "inputs": "x",
                "targets": "x",
            },
            "train": {
                "per_core_batch_size": 16,
                "epochs": 4,
                "gradient_accumulation_steps": n,
                "steps_per_epoch": steps_per_epoch,
                "steps_per_execution": 1,
                "learning_rate": {"base": 0.1, "base_batch_size": 128, **lr},
            },
        }  # fmt: skip
    )
    choice = Choice(backend="jax", accelerator="cpu", distribution="data_parallel",
                    replicas=8, precision="float32", reason="test")  # fmt: skip
    return make_plan(config, choice, 8, [12_800], None)


def test_the_effective_batch_scales_the_learning_rate_and_the_schedule_counts_updates():
    one, four = _plan(1, warmup_epochs=0.5), _plan(4, warmup_epochs=0.5)
    assert (four.global_batch_size, four.effective_global_batch_size) == (128, 512)
    assert (one.global_batch_size, one.effective_global_batch_size) == (128, 128)
    assert four.learning_rate == pytest.approx(0.4) and one.learning_rate == pytest.approx(0.1)
    assert four.steps_per_epoch == one.steps_per_epoch == 100  # batches, as before
    assert (one.warmup_steps, one.total_steps) == (50, 400)
    assert (four.warmup_steps, four.total_steps) == (12, 100)  # updates
    assert not [w for w in four.warnings if "gradient_accumulation_steps" in w]


def test_an_epoch_that_is_not_a_multiple_of_n_is_said():
    plan = _plan(4, steps_per_epoch=10)  # 40 batches: 10 updates, two of them over two epochs
    assert plan.total_steps == 10
    assert any("not a multiple of gradient_accumulation_steps 4" in w and "make no update" not in w
               for w in plan.warnings)  # fmt: skip
    plan = _plan(3, steps_per_epoch=10)  # 40 batches: 13 updates, and 1 batch left over
    assert plan.total_steps == 13
    assert any("the run's last 1 batch(es) make no update" in w for w in plan.warnings)


def test_tpurun_config_shows_the_effective_batch_beside_the_global_batch(toy_data, tmp_path):
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    config = accumulating(toy_data, tmp_path, "shown", 32, 4)
    config["train"]["learning_rate"] = {"base": 0.01, "base_batch_size": 32}
    path = write_config(tmp_path, config, "shown")
    result = CliRunner().invoke(app, ["config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    derived = json.loads(result.stdout)["derived"]
    assert (derived["global_batch_size"], derived["gradient_accumulation_steps"],
            derived["effective_global_batch_size"]) == (32, 4, 128)  # fmt: skip
    assert derived["learning_rate"] == pytest.approx(0.04)  # scaled for 128, not 32
    result = CliRunner().invoke(app, ["config", str(path)])
    lines = result.stdout.splitlines()
    at = lines.index("  global_batch_size: 32")
    assert lines[at + 1 : at + 3] == ["  gradient_accumulation_steps: 4",
                                      "  effective_global_batch_size: 128"]  # fmt: skip


def test_the_optimizer_setting_it_itself_is_refused(toy_data, tmp_path):
    config = accumulating(toy_data, tmp_path, "own", 32, 1)
    config["model"]["optimizer"] = {"name": "sgd", "gradient_accumulation_steps": 4}
    with pytest.raises(TpurunError, match="set train.gradient_accumulation_steps instead"):
        tpurun.train(config, verbose=False)


# ------------------------------------------------------------------------- what a fit does
@pytest.mark.parametrize(("replicas", "steps_per_execution"), [(1, 1), (1, 4), (8, 4)])
def test_two_accumulated_batches_update_as_one_batch_twice_their_size(
    toy_data, tmp_path, replicas, steps_per_execution
):
    """SGD with warmup and cosine decay: 3 epochs of 8 updates, each of 2 x 32 records, end on the
    weights of 3 epochs of 8 updates of 64, the same records in the same order. The mean of the
    micro-batches' gradients is the big batch's (the loss is a mean), and update k gets step k's
    learning rate: a schedule read at batch counts would not."""

    def config(name: str, batch: int, n: int) -> dict:
        config = accumulating(toy_data, tmp_path, name, batch // replicas, n,
                              steps_per_execution=steps_per_execution)  # fmt: skip
        config["runtime"] = {"cpu_devices": replicas}
        return config

    big = tpurun.train(config("big", 64, 1), verbose=False)
    small = tpurun.train(config("small", 32, 2), verbose=False)
    assert small["replicas"] == replicas
    assert big["status"] == small["status"] == "completed"
    runs = tmp_path / "runs"
    assert_same_weights(final_weights(runs / "small"), final_weights(runs / "big"))
    model = keras.saving.load_model(runs / "small" / "model.keras")  # loads without tpurun
    assert model.optimizer.gradient_accumulation_steps == 2
    assert (
        int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 3 * 8
    )  # updates (Keras: batches // N)
    rates = [
        [float(r["learning_rate"]) for r in read_log(runs / name)] for name in ("small", "big")
    ]
    assert rates[0] == pytest.approx(rates[1], rel=1e-6)
    assert rates[0][0] < rates[0][1] > rates[0][2]  # warmup (12 updates), then the decay


@pytest.mark.slow
def test_on_tensorflow_with_several_steps_per_execution_and_refused_under_a_strategy(
    toy_data, tmp_path
):
    """The same equality on the TensorFlow backend (one device, 4 steps per execution); with 2
    replicas (MirroredStrategy) Keras fails in the first step, so the plan refuses it first."""
    for name, batch, n in (("big", 64, 1), ("small", 32, 2)):
        config = accumulating(toy_data, tmp_path, name, batch, n, steps_per_execution=4)
        config["runtime"] = {"backend": "tensorflow"}
        done = run_cli("train", str(write_config(tmp_path, config, name)))
        assert done.returncode == 0, done.stderr
    runs = tmp_path / "runs"
    assert_same_weights(final_weights(runs / "small"), final_weights(runs / "big"))
    for key in ("learning_rate", "loss", "val_loss"):
        columns = [[float(r[key]) for r in read_log(runs / name)] for name in ("small", "big")]
        assert columns[0] == pytest.approx(columns[1], rel=1e-5, abs=1e-7), key

    config["runtime"] = {"backend": "tensorflow", "cpu_devices": 2}
    config["train"].update(per_core_batch_size=16, steps_per_execution=1)  # keras#19246 aside
    refused = run_cli("train", str(write_config(tmp_path, config, "mirrored")))
    assert refused.returncode == 2, refused.stderr
    assert "train.gradient_accumulation_steps: 2 on the TensorFlow backend with a mirrored" in (
        refused.stderr
    )
    assert "runtime.backend: jax" in refused.stderr


# ------------------------------------------------------------------------------- TensorBoard
def test_tensorboard_learning_rate_of_batch_16_n4_is_batch_64_n1(toy_data, tmp_path):
    """(batch 16, N=4) and (batch 64, N=1), warmup and cosine decay, the learning rate scaled
    linearly from a base batch of 16: TensorBoard's ``learning_rate`` has the same values at the
    same epochs, the first the warmup's at update 8 of 12. Its steps count batches (as the loss
    curves' do), so the accumulating run's are 4 times as many."""
    lr = {"base": 0.01, "base_batch_size": 16, "warmup_epochs": 1.5, "schedule": "cosine"}
    curves = {}
    for name, batch, n in (("n1", 64, 1), ("n4", 16, 4)):
        config = accumulating(toy_data, tmp_path, name, batch, n, epochs=4, learning_rate=lr)
        config["callbacks"] = {"tensorboard": {"loss_every_steps": 8}}
        summary = tpurun.train(config, verbose=False)
        assert summary["status"] == "completed"
        curves[name] = read_events(tmp_path / "runs" / name)["train/learning_rate"]
    assert [s for s, _ in curves["n1"]] == [8, 16, 24, 32]
    assert [s for s, _ in curves["n4"]] == [32, 64, 96, 128]
    values = [v for _, v in curves["n4"]]
    assert values == pytest.approx([v for _, v in curves["n1"]], rel=1e-6)
    peak = 0.04  # 0.01 x 64 / 16: the effective batch's
    assert values[0] == pytest.approx(peak / 12 + (peak - peak / 12) * 8 / 12, rel=1e-6)
    assert values[1] < peak and values[3] < values[2] < values[1]  # decaying to 0 at update 32


# ------------------------------------------------------------------------------------ resume
@pytest.mark.slow
def test_sigkill_mid_epoch_with_gradients_half_accumulated_then_resume_is_exact(toy_data, tmp_path):
    """N=3 over 16 batches an epoch: updates straddle epoch ends. Saves every 4 batches; the
    process SIGKILLs itself after batch 7 of epoch 2, so it resumes from batch 4 of epoch 2
    (global batch 20: 2 gradients accumulated, in the checkpoint). It ends on the unbroken run's
    weights, log and optimizer state."""

    def config(name: str, kill: bool) -> dict:
        config = accumulating(toy_data, tmp_path, name, 32, 3, steps_per_execution=1)
        extra = [signal_at(tmp_path / "fired", 2, 7, "SIGKILL")] if kill else []
        config["callbacks"] = {"checkpoint": {"every_steps": 4}, "extra": extra}
        return config

    unbroken = run_cli("train", str(write_config(tmp_path, config("unbroken", False), "unbroken")))
    assert unbroken.returncode == 0, unbroken.stderr
    path = write_config(tmp_path, config("killed", True), "killed")
    killed = run_cli("train", str(path))
    assert killed.returncode == -9, killed.stderr
    run_dir = tmp_path / "runs" / "killed"
    state = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert (state["epoch"], state["step"]) == (1, 4)
    accumulated = saved_accumulators(run_dir / "checkpoints" / state["weights"])
    assert accumulated and all(np.any(a != 0) for a in accumulated)
    done = run_cli("train", str(path))
    assert done.returncode == 0, done.stderr
    assert read_summary(run_dir)["resumes"][-1]["step"] == 4
    reference = tmp_path / "runs" / "unbroken"
    assert read_log(run_dir) == read_log(reference)
    for mine, theirs in zip(final_weights(run_dir), final_weights(reference), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    optimizers = [
        keras.saving.load_model(r / "model.keras").optimizer for r in (run_dir, reference)
    ]
    for mine, theirs in zip(*(o.variables for o in optimizers), strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(mine),
                                      keras.ops.convert_to_numpy(theirs))  # fmt: skip


def saved_accumulators(weights_file) -> list[np.ndarray]:
    """The optimizer slots of a ``.weights.h5`` checkpoint that are not its iteration count:
    without momentum, SGD's only slots are the gradient accumulators."""
    import h5py

    with h5py.File(weights_file) as f:
        group = f["optimizer"]["vars"]
        values = [np.asarray(group[k]) for k in sorted(group, key=int)]
    return [v for v in values if v.ndim > 0]


def test_a_failing_callback_is_reported_as_itself_under_accumulation(toy_data, tmp_path):
    """Keras' ``optimizer.iterations`` is a computed array under accumulation (batches // N), not
    a variable: what tpurun reads from it when a fit fails must not fail in its turn."""
    config = accumulating(toy_data, tmp_path, "boom", 32, 2, epochs=1)
    config["callbacks"] = {"extra": [f"{FACTORIES}:Exploding"]}
    with pytest.raises(RuntimeError, match="boom"):
        tpurun.train(config, verbose=False)
