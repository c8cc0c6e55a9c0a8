"""TensorBoard names a run's curves after the run: the event folders sit in the run directory
(`tensorboard --logdir runs` shows `toy/train` and `toy/validation`); a run begun with the older
tensorboard/ folder keeps writing there, so its curves stay in one place."""

from __future__ import annotations

from conftest import toy_config

import tpurun


def test_event_folders_sit_in_the_run_directory(toy_data, tmp_path):
    tpurun.train(toy_config(toy_data, tmp_path / "runs", train={"epochs": 1}), verbose=False)
    run_dir = tmp_path / "runs" / "toy"
    for split in ("train", "validation"):
        assert list((run_dir / split).glob("events.out.tfevents.*")), split
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
    assert len(list((legacy / "train").glob("events.out.tfevents.*"))) >= 1
