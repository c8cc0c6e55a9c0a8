"""TensorBoard logs, read back with TensorBoard's own reader: tags, steps and values across a
SIGTERM and a resume (with events a killed session left past its checkpoint, the last one cut
short), a NaN restore, switched off, and on gs://. The TensorFlow backend's events are checked in
test_profile (one subprocess for both); the event files themselves in test_tensorboard_events."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from helpers import FACTORIES, read_log, toy_config, write_config, write_toy_data

import tpurun
from tpurun.errors import Interrupted


def scalars_in(path: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of an event file (its name must hold ``tfevents``), or of a
    folder's files in name order, as TensorBoard's own reader reads them, nothing purged (a step
    that went backwards shows)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    reader = ea.EventAccumulator(str(path), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0},
                                 purge_orphaned_data=False)  # fmt: skip
    reader.Reload()
    assert reader.Tags()["tensors"] == []  # every value a scalar summary
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)]
            for tag in reader.Tags()["scalars"]}  # fmt: skip


def read_events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train/epoch_loss": [(step, value), ...]}`` of a run's two event folders."""
    return {f"{split}/{tag}": points
            for split in ("train", "validation") if (folder / split).is_dir()
            for tag, points in scalars_in(folder / split).items()}  # fmt: skip


def as_float32(values) -> list[float]:
    """What a value is once written: event files hold float32."""
    return [float(np.float32(v)) for v in values]


def assert_steps_only_go_forward(events: dict[str, list[tuple[int, float]]]) -> None:
    for tag, points in events.items():
        steps = [step for step, _ in points]
        assert steps == sorted(set(steps)), f"{tag}: duplicate or backwards steps {steps}"


def test_curves_continue_across_a_sigterm_and_resume_without_repeats(toy_data, tmp_path):
    marker = tmp_path / "fired"
    config = toy_config(
        toy_data, tmp_path / "runs",
        train={"epochs": 3, "steps_per_execution": 2},
        callbacks={"tensorboard": {"loss_every_steps": 4},
                   "extra": [{"name": f"{FACTORIES}:SignalAt", "epoch": 2, "step": 6,
                              "marker": str(marker)}]},
    )  # fmt: skip
    with pytest.raises(Interrupted, match="stopped at epoch 2, step 6"):
        tpurun.train(config, verbose=False)
    folder = tmp_path / "runs" / "toy"
    first = read_events(folder)
    assert max(step for points in first.values() for step, _ in points) <= 16 + 6
    assert [s for s, _ in first["train/batch_loss"]] == [4, 8, 12, 16, 20]

    # What a session killed after its checkpoint leaves: events past the resume point, the last
    # one cut short by the kill.
    from tpurun.observe.events import EventFile

    stale = EventFile(str(folder / "train"))
    stale.scalars({"batch_loss": 999.0}, 24)
    stale.scalars({"epoch_loss": 999.0}, 32)
    stale.close()
    Path(stale.path).write_bytes(Path(stale.path).read_bytes()[:-5])
    assert scalars_in(Path(stale.path)) == {"batch_loss": [(24, 999.0)]}

    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and summary["resumes"][0]["step"] == 6
    events = read_events(folder)
    assert_steps_only_go_forward(events)
    assert [s for s, _ in events["train/batch_loss"]] == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40,
                                                          44, 48]  # fmt: skip
    assert 999.0 not in [v for points in events.values() for _, v in points]
    rows = read_log(tmp_path / "runs" / "toy")
    for split, prefix in (("train", ""), ("validation", "val_")):
        for metric in ("loss", "accuracy"):
            points = events[f"{split}/epoch_{metric}"]
            assert [s for s, _ in points] == [16, 32, 48]
            assert [v for _, v in points] == as_float32(r[prefix + metric] for r in rows)
    assert set(events) == {
        "train/batch_loss", "train/epoch_loss", "train/epoch_accuracy", "train/learning_rate",
        "train/examples_per_sec", "train/tflops_per_device", "train/input_wait",
        "validation/epoch_loss", "validation/epoch_accuracy",
    }  # fmt: skip
    for tag in ("learning_rate", "examples_per_sec", "tflops_per_device", "input_wait"):
        assert [s for s, _ in events[f"train/{tag}"]] == [16, 32, 48], tag
    assert [v for _, v in events["train/learning_rate"]] == as_float32([0.01] * 3)
    # The first session's epoch stays as it wrote it; this session's are its summary's figures.
    assert events["train/input_wait"][0] == first["train/input_wait"][0]
    wait = [round(v, 4) for _, v in events["train/input_wait"][1:]]
    assert wait == summary["epoch_input_wait"]
    throughput = summary["throughput"]
    assert (
        events["train/examples_per_sec"][-1][1]
        == as_float32([throughput["examples_per_second"]])[0]
    )
    assert (
        events["train/tflops_per_device"][-1][1] == as_float32([throughput["tflops_per_device"]])[0]
    )


def test_a_nan_restore_leaves_no_backwards_steps(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", name="nan",
                        train={"epochs": 2, "steps_per_execution": 2,
                               "learning_rate": {"base": 1e30}})  # fmt: skip
    config["model"]["loss"] = "mse"
    config["callbacks"] = {"on_nan": "restore", "nan_lr_factor": 1e-32, "max_nan_restores": 2,
                           "tensorboard": {"loss_every_steps": 2}}  # fmt: skip
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and len(summary["nan_restores"]) == 1
    events = read_events(tmp_path / "runs" / "nan")
    assert_steps_only_go_forward(events)
    assert [s for s, _ in events["train/batch_loss"]] == list(range(2, 33, 2))
    assert all(math.isfinite(v) for points in events.values() for _, v in points)


def test_tensorboard_null_writes_no_logs(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 1},
                        callbacks={"tensorboard": None})  # fmt: skip
    tpurun.train(config, verbose=False)
    run_dir = tmp_path / "runs" / "toy"
    assert not any((run_dir / name).exists() for name in ("train", "validation", "tensorboard"))
    assert "learning_rate" in read_log(run_dir)[0]  # the curves' LR comes from the log


@pytest.mark.gcs
@pytest.mark.slow
def test_tensorboard_logs_and_curves_in_a_bucket(gcs, tmp_path):
    data = write_toy_data(tmp_path / "data")
    config = toy_config(data, tmp_path, train={"epochs": 2})
    config["output"]["dir"] = f"{gcs.bucket}/runs"
    path = write_config(tmp_path / "toy.yaml", config)
    work, temp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), temp.mkdir()
    done = gcs.tpurun("train", str(path), cwd=work, TMPDIR=str(temp))
    assert done.returncode == 0, done.stderr
    run = f"{gcs.bucket}/runs/toy"
    names = [p.removeprefix(run + "/") for p in gcs.list(run + "/")]
    assert "curves.png" in names and gcs.get(f"{run}/curves.png").startswith(b"\x89PNG")
    for split in ("train", "validation"):
        (events_file,) = [n for n in names if n.startswith(f"{split}/events.out")]
        local = tmp_path / split / Path(events_file).name  # a name the reader takes for a file
        local.parent.mkdir()
        local.write_bytes(gcs.get(f"{run}/{events_file}"))
        steps = [step for step, _ in scalars_in(local)["epoch_loss"]]
        assert steps == [16, 32], split
    assert list(work.iterdir()) == [] and list(temp.iterdir()) == []  # nothing left locally
