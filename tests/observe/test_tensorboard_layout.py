"""TensorBoard names a run's curves after the run: the event folders sit in the run directory
(`tensorboard --logdir runs` shows `toy/train` and `toy/validation`); a run begun with the older
tensorboard/ folder keeps writing there, so its curves stay in one place."""

from __future__ import annotations

from conftest import toy_config
from test_tensorboard import scalars_in

import tpurun


def test_event_folders_sit_in_the_run_directory(toy_data, tmp_path):
    tpurun.train(toy_config(toy_data, tmp_path / "runs", train={"epochs": 1}), verbose=False)
    run_dir = tmp_path / "runs" / "toy"
    for split in ("train", "validation"):
        assert len(list((run_dir / split).glob("events.out.tfevents.*"))) == 1, split
        assert [step for step, _ in scalars_in(run_dir / split)["epoch_loss"]] == [16], split
    assert not (run_dir / "tensorboard").exists()


def test_a_run_begun_with_a_tensorboard_folder_keeps_it(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 1})
    tpurun.train(config, verbose=False)
    run_dir = tmp_path / "runs" / "toy"
    legacy = run_dir / "tensorboard"
    legacy.mkdir()
    for split in ("train", "validation"):
        (run_dir / split).rename(legacy / split)
    config["train"]["epochs"] = 2
    tpurun.train(config, verbose=False)
    assert not (run_dir / "train").exists()
    for split in ("train", "validation"):  # a file a session; epochs at their last step (16 a pass)
        assert len(list((legacy / split).glob("events.out.tfevents.*"))) == 2, split
        assert [step for step, _ in scalars_in(legacy / split)["epoch_loss"]] == [16, 32], split


def test_a_new_event_file_sorts_after_the_ones_already_there(tmp_path):
    """TensorBoard reads a folder's event files in name order; a session opened in the same
    second as the last one (here: a file named as if written by a pid that sorts last) still
    gets a file that sorts after it."""
    import time

    from tpurun.observe.events import EventFile, after_the_last_file

    train = tmp_path / "train"
    train.mkdir()
    (train / f"events.out.tfevents.{int(time.time())}.host.99999.9.v2").write_bytes(b"")
    after_the_last_file(str(tmp_path))
    EventFile(str(train)).close()
    names = sorted(p.name for p in train.iterdir())
    assert len(names) == 2 and ".99999.9.v2" in names[0], names
