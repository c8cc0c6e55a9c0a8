"""The optimizer's state split over the data-parallel devices (tpurun/runtime/optimizer_split.py):
which runs split it, along which dimension, and real fits on 8 simulated CPU devices whose weights
and optimizer state end bit for bit as with a whole copy on each device, a resume included."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from helpers import FACTORIES, assert_same_model, signal_at, toy_config

import tpurun
from tpurun.errors import Interrupted
from tpurun.runtime.optimizer_split import devices_for, split_dim


@pytest.mark.parametrize(
    ("shape", "devices", "dim"),
    [
        ((1024, 256), 8, 0),  # the largest the devices divide
        ((256, 1024), 8, 1),
        ((256, 256), 8, 0),  # the first of equals
        ((12, 16), 8, 1),  # 12 is not a multiple of 8
        ((256, 1), 8, 0),
        ((1,), 8, None),  # a bias of one unit stays whole
        ((), 8, None),  # a scalar: the iteration count, the learning rate
        ((4,), 8, None),  # fewer elements than devices
        ((1024, 256), 1, None),  # one device: nothing to split
    ],
)
def test_a_variable_is_split_along_its_largest_dimension_the_devices_divide(shape, devices, dim):
    assert split_dim(shape, devices) == dim


def plan(**changes) -> SimpleNamespace:
    fields = {"backend": "jax", "distribution": "data_parallel", "num_processes": 1, "replicas": 8}
    return SimpleNamespace(**{**fields, **changes})


def config(shard: bool = True, mesh=None) -> SimpleNamespace:
    return SimpleNamespace(runtime=SimpleNamespace(shard_optimizer_state=shard, mesh=mesh))


@pytest.mark.parametrize(
    ("run", "settings", "devices"),
    [
        (plan(), config(), 8),
        (plan(replicas=4), config(), 4),
        (plan(), config(shard=False), 1),  # runtime.shard_optimizer_state: false
        (plan(replicas=1, distribution="default"), config(), 1),  # one device
        (plan(backend="tensorflow", distribution="mirrored"), config(), 1),
        (plan(distribution="model_parallel"), config(mesh={"data": 2, "model": 4}), 1),
        (plan(num_processes=2), config(), 1),  # a share on another host is not addressable
    ],
    ids=["8-devices", "4-devices", "off", "one-device", "tensorflow", "mesh", "two-processes"],
)
def test_the_state_is_split_on_jax_data_parallel_in_one_process_unless_switched_off(
    run, settings, devices
):
    assert devices_for(run, settings) == devices


def eight_devices(toy_data, tmp_path, name: str, shard: bool, *extra) -> dict:
    config = toy_config(toy_data, tmp_path / "runs", name=name,
                        runtime={"cpu_devices": 8, "shard_optimizer_state": shard},
                        train={"epochs": 2, "per_core_batch_size": 4, "steps_per_execution": 2})  # fmt: skip
    config["model"]["optimizer"] = {"name": "adam"}
    out = str(tmp_path / f"{name}.layout.json")
    config["callbacks"] = {"extra": [*extra, {"name": f"{FACTORIES}:RecordOptimizerLayout",
                                              "out": out}]}  # fmt: skip
    return config


def layout(tmp_path, name: str) -> dict:
    return json.loads((tmp_path / f"{name}.layout.json").read_text())


def test_a_split_state_trains_the_same_weights_and_state_as_whole_copies(toy_data, tmp_path):
    """The toy MLP (8 -> 16 -> 1) with Adam over 8 devices: each moment of a kernel (8x16,
    16x1) and of the hidden bias (16) is split, 1/8 of it on each device; the output bias (1)
    and Keras' scalars stay whole; the trained weights and optimizer state equal those of the run
    with whole copies, bit for bit."""
    for name, shard in (("split", True), ("whole", False)):
        summary = tpurun.train(eight_devices(toy_data, tmp_path, name, shard), verbose=False)
        assert (summary["status"], summary["replicas"]) == ("completed", 8)
    split, whole = layout(tmp_path, "split"), layout(tmp_path, "whole")
    assert [v["shape"] for v in split] == [v["shape"] for v in whole]
    moments = [(v, w) for v, w in zip(split, whole, strict=True)
               if v["path"].endswith(("_momentum", "_velocity"))]  # fmt: skip
    assert sorted(tuple(v["shape"]) for v, _ in moments) == [(1,)] * 2 + [(8, 16)] * 2 + [
        (16,)] * 2 + [(16, 1)] * 2  # fmt: skip
    for held, copy in moments:
        assert copy["bytes"] == copy["whole"] and "batch" not in copy["spec"]  # whole on each
        if held["shape"] == [1]:  # the output layer's bias: one unit
            assert held == {**copy, "path": held["path"]}
        else:
            assert held["bytes"] * 8 == held["whole"] and "batch" in held["spec"], held
    scalars = [v for v in split if not v["shape"]]  # the iteration count, the learning rate
    assert scalars and all(v["bytes"] == v["whole"] for v in scalars)
    assert_same_model(tmp_path / "runs" / "split", tmp_path / "runs" / "whole")


@pytest.mark.slow
def test_a_split_state_stopped_mid_epoch_resumes_split_and_ends_as_an_unbroken_run(
    toy_data, tmp_path
):
    """The resume assigns the saved (whole) moments into the split variables: split again, and
    the run ends bit for bit on the unbroken run's weights and state."""
    tpurun.train(eight_devices(toy_data, tmp_path, "unbroken", True), verbose=False)
    stopped = eight_devices(toy_data, tmp_path, "b", True, signal_at(tmp_path / "fired", 2, 3))
    with pytest.raises(Interrupted, match=r"stopped at epoch 2, step 4"):
        tpurun.train(stopped, verbose=False)
    resumed = tpurun.train(stopped, verbose=False)
    assert resumed["status"] == "completed" and resumed["resumes"][-1]["step"] == 4
    kernels = [v for v in layout(tmp_path, "b") if v["shape"] == [8, 16]]
    assert len(kernels) == 2  # its momentum and velocity, split again after the resume
    assert all("batch" in v["spec"] and v["bytes"] * 8 == v["whole"] for v in kernels)
    assert_same_model(tmp_path / "runs" / "b", tmp_path / "runs" / "unbroken")
