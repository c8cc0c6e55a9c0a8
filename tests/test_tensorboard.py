"""TensorBoard logs, read back from the event files: tags and steps across a SIGTERM and a resume
(with events a killed session left past its checkpoint), a NaN restore, switched off, and on gs://.
The TensorFlow backend's events are checked in test_profile (one subprocess for both)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import FACTORIES, read_log, toy_config, write_config, write_toy_data

import tpurun
from tpurun.errors import Interrupted


def events_in(records) -> list[tuple[str, int, float, str]]:
    """(tag, step, value, plugin) of each scalar in a sequence of serialized Event records."""
    import tensorflow as tf
    from tensorflow.core.util import event_pb2

    found = []
    for record in records:
        event = event_pb2.Event.FromString(record)
        for value in event.summary.value:
            found.append((value.tag, event.step, float(tf.make_ndarray(value.tensor)),
                          value.metadata.plugin_data.plugin_name))  # fmt: skip
    return found


def read_events(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train/epoch_loss": [(step, value), ...]}``, files in name order as TensorBoard reads
    them; every scalar is the scalars plugin's."""
    import tensorflow as tf

    out: dict[str, list[tuple[int, float]]] = {}
    for split in ("train", "validation"):
        for path in sorted((folder / split).glob("events.out.tfevents.*")):
            records = [r.numpy() for r in tf.data.TFRecordDataset(str(path))]
            for tag, step, value, plugin in events_in(records):
                assert plugin in ("scalars", ""), (tag, plugin)  # metadata on a tag's first event
                out.setdefault(f"{split}/{tag}", []).append((step, value))
    return out


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

    # What a session killed after its checkpoint leaves: events past the resume point.
    import tensorflow as tf

    stale = tf.summary.create_file_writer(str(folder / "train"))
    with stale.as_default():
        tf.summary.write("batch_loss", 999.0, step=24)
        tf.summary.write("epoch_loss", 999.0, step=32)
    stale.close()

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
            assert [v for _, v in points] == pytest.approx(
                [float(r[prefix + metric]) for r in rows], rel=1e-6
            )
    for tag in ("learning_rate", "examples_per_sec", "input_wait"):
        assert [s for s, _ in events[f"train/{tag}"]] == [16, 32, 48], tag
    assert [v for _, v in events["train/learning_rate"]] == pytest.approx([0.01] * 3)
    assert all(0 <= v <= 1 for _, v in events["train/input_wait"])


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
        raw = gcs.get(f"{run}/{events_file}")
        local = tmp_path / f"{split}.events"
        local.write_bytes(raw)
        import tensorflow as tf

        records = [r.numpy() for r in tf.data.TFRecordDataset(str(local))]
        steps = [s for tag, s, _, _ in events_in(records) if tag == "epoch_loss"]
        assert steps == [16, 32], split
    assert list(work.iterdir()) == [] and list(temp.iterdir()) == []  # nothing left locally
