"""Fault injection with real processes: SIGKILL at random points, kills inside a checkpoint write,
SIGTERM mid-epoch on the TensorFlow backend. Nothing trained may be lost, and the run that was
killed must end where the unbroken one does."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    FACTORIES,
    HAS_TENSORFLOW,
    ROOT,
    assert_same_log,
    assert_same_model,
    cli_env,
    logged_epochs,
    read_latest,
    read_summary,
    run_cli,
    saved_arrays,
    signal_at,
    start_cli,
    toy_config,
    write_config,
    write_toy_data,
)

from tpurun.storage.rundir import RunDir
from tpurun.training.checkpoints import resume as resume_lib

pytestmark = pytest.mark.slow


def finish(path: Path) -> subprocess.CompletedProcess:
    done = run_cli("train", str(path))
    assert done.returncode == 0, done.stderr
    return done


def check_finished(run_dir: Path, epochs: int, reference: Path, atol: float = 0.0) -> dict:
    """The killed run finished, and ends where the unbroken ``reference`` run does (same
    backend, same seed): every cell of its log, and its final weights and optimizer state, exact
    on JAX (``atol`` 0), within ``atol`` on TensorFlow."""
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["epochs_completed"] == epochs
    assert logged_epochs(run_dir) == [str(i) for i in range(epochs)]  # each epoch once, no gap
    assert_same_log(run_dir, reference, atol)
    assert_same_model(run_dir, reference, atol)
    if not atol:
        assert summary["final_metrics"] == read_summary(reference)["final_metrics"]
    return summary


@pytest.fixture(scope="module")
def longer(tmp_path_factory):
    """Data for ~128 steps an epoch, a config saving every 4 steps, and its unbroken result."""
    tmp = tmp_path_factory.mktemp("faults")
    data = write_toy_data(tmp / "data", n_train=4096, n_val=256, shards=8)
    config = toy_config(data, tmp / "runs", train={"epochs": 3, "steps_per_execution": 1})
    config["callbacks"] = {"checkpoint": {"every_steps": 4}}
    finish(write_config(tmp, config, "unbroken"))
    reference = tmp / "runs" / "unbroken"
    assert read_summary(reference)["backend"] == "jax"
    return tmp, config, reference


def test_sigkill_at_random_points_then_finish(longer):
    tmp, config, reference = longer
    path = write_config(tmp, config, "killed")
    run_dir = tmp / "runs" / "killed"
    rng = random.Random(20261122)
    positions: list = []
    # Each kill is timed by the run's own saves, not by the clock alone: a fast machine trains
    # the whole run in a few seconds (one here finished it before a third kill landed).
    for kill in range(6):
        proc = start_cli("train", str(path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before = positions[-1] if positions else None
        # The first: during start-up, at the latest at the first save. The others: at a random
        # instant shortly after this session's first new save.
        deadline = time.monotonic() + rng.uniform(0.5, 2.5) if kill == 0 else None
        while proc.poll() is None and (deadline is None or time.monotonic() < deadline):
            point = resume_lib.latest(RunDir(str(run_dir)))
            if point is not None and point.position != before:
                break
            time.sleep(0.02)
        if kill:
            time.sleep(rng.uniform(0.0, 0.15))
        if proc.poll() is not None:
            break  # it finished before this kill
        proc.kill()
        proc.wait()
        point = resume_lib.latest(RunDir(str(run_dir)))
        positions.append(point.position if point else None)
        if point:  # after any kill, the resume point is complete and loads
            assert (
                Path(point.weights).exists() and point.state["weights"] == Path(point.weights).name
            )
    finish(path)
    summary = check_finished(run_dir, 3, reference)
    kills = [p for p in positions if p is not None]
    assert len(kills) >= 3, positions  # kills landed while training
    assert any(step for _, step in kills), positions  # and one of them mid-epoch
    print(f"kills: {len(positions)}, at {positions}; resumes {len(summary['resumes'])}")


@pytest.mark.parametrize("target", ["weights", "state"])
def test_a_kill_inside_a_checkpoint_write_leaves_the_previous_one(longer, target):
    """The process kills itself halfway through writing its 5th resume point: the weights file
    (``weights``), or latest.json after the weights were in place (``state``)."""
    tmp, config, reference = longer
    name = f"torn-{target}"
    path = write_config(tmp, config, name)
    run_dir = tmp / "runs" / name
    driver = f"""
import os, signal, sys
real_replace, count = os.replace, [0]
def dying_replace(src, dst):
    base = os.path.basename(str(dst))
    hit = base.startswith("latest-") if {target!r} == "weights" else base == "latest.json"
    if hit:
        count[0] += 1
        if count[0] == 5:
            with open(src, "r+b") as f:
                f.truncate(os.path.getsize(src) // 2)  # half written
            os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(src, dst)
os.replace = dying_replace
sys.argv = ["tpurun", "train", {str(path)!r}]
from tpurun.cli.app import main
main()
"""
    killed = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                            cwd=ROOT, env=cli_env(), timeout=600)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    point = resume_lib.latest(RunDir(str(run_dir)))
    assert point is not None  # the previous (4th) resume point is whole
    assert point.position == (0, 16)  # saves at steps 4, 8, 12, 16; the 5th (20) was torn
    # A complete file: every array of a resume point, each of its shape (the unbroken run's
    # last one has them all), and the rerun loads it.
    kept = saved_arrays(Path(point.weights))
    whole = saved_arrays(reference / "checkpoints" / read_latest(reference)["weights"])
    assert {k: v.shape for k, v in kept.items()} == {k: v.shape for k, v in whole.items()}
    finish(path)
    check_finished(run_dir, 3, reference)


@pytest.mark.skipif(not HAS_TENSORFLOW, reason="the TensorFlow backend is not installed")
def test_sigterm_mid_epoch_on_tensorflow_resumes_at_the_step(tmp_path):
    """On TF with MirroredStrategy over 2 CPU replicas (metric sums are per-replica there): the
    process gets SIGTERM after step 21 of epoch 1 (of 64), between saves (every 8 steps), stops
    at that step, and the rerun ends within 1e-4 of the unbroken run in every cell and weight."""
    data = write_toy_data(tmp_path / "data", n_train=2048, n_val=256)
    config = toy_config(data, tmp_path / "runs", train={"epochs": 2, "steps_per_execution": 1,
                                                        "per_core_batch_size": 16},
                        runtime={"backend": "tensorflow", "cpu_devices": 2})  # fmt: skip
    config["callbacks"] = {"checkpoint": {"every_steps": 8}}
    unbroken = finish(write_config(tmp_path, config, "tf-unbroken"))
    reference = tmp_path / "runs" / "tf-unbroken"
    summary = read_summary(reference)
    assert (summary["backend"], summary["replicas"]) == ("tensorflow", 2)
    assert summary["final_metrics"]["val_accuracy"] > 0.75  # it learns
    # plain output: epoch lines, no ANSI escapes, no carriage-return redraws
    assert "[tpurun] epoch 2/2" in unbroken.stdout
    assert "\x1b[" not in unbroken.stdout and "\r" not in unbroken.stdout

    config["callbacks"]["extra"] = [signal_at(tmp_path / "fired", 1, 21)]
    path = write_config(tmp_path, config, "tf-stopped")
    run_dir = tmp_path / "runs" / "tf-stopped"
    stopped = run_cli("train", str(path))
    assert stopped.returncode == 3, stopped.stderr
    state = read_latest(run_dir)
    assert read_summary(run_dir)["distribution"] == "mirrored"
    assert (state["epoch"], state["step"], state["reason"]) == (0, 21, "SIGTERM"), state
    assert logged_epochs(run_dir) == []
    done = finish(path)
    assert f"resuming at epoch {state['epoch'] + 1}, step {state['step']}" in done.stdout
    check_finished(run_dir, 2, reference, atol=1e-4)


def test_a_second_sigint_exits_at_once_and_keeps_the_last_checkpoint(tmp_path):
    data = write_toy_data(tmp_path / "data")
    config = toy_config(data, tmp_path / "runs", train={"epochs": 3, "steps_per_execution": 2})
    config["callbacks"] = {"extra": [{"name": f"{FACTORIES}:SignalAt", "epoch": 2, "step": 4,
                                      "marker": str(tmp_path / "fired"), "signal": "SIGINT",
                                      "times": 2}]}  # fmt: skip
    path = write_config(tmp_path, config, "twice")
    done = run_cli("train", str(path))
    assert done.returncode == 130, done.stderr  # no waiting for the next step's save
    assert "Traceback" not in done.stderr
    run_dir = tmp_path / "runs" / "twice"
    assert read_summary(run_dir)["status"] == "interrupted"
    point = resume_lib.latest(RunDir(str(run_dir)))
    assert point is not None and point.position == (1, 0)  # epoch 1's end: nothing lost
    finish(path)
    assert logged_epochs(run_dir) == ["0", "1", "2"]
