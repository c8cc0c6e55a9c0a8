"""A run on one device (one GPU, a one-chip TPU, a one-device mesh) compiles each step once.

Found by the GPU check on an H200: epoch 2 of every run was slower than epoch 3 (a Gemma 2B LoRA:
15.5 s against 6.6 s), because the training step was compiled a third time at its first step. A
Keras distribution over one device leaves the variables uncommitted, while the batches it lays out
are committed, and JAX compiles again whenever that mix changes (the step's outputs are committed;
the metrics reset at each epoch are not). A ``runtime.mesh`` over one device did the same. Faked
here on one CPU device: the machine says one GPU with JAX's CUDA plugin, and JAX's GPU devices are
the first CPU device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections import Counter

import jax
import pytest
from helpers import FACTORIES, toy_config

import tpurun
from tpurun.data.native import keras_input
from tpurun.errors import ConfigError
from tpurun.runtime import activate
from tpurun.runtime.machine import probe
from tpurun.training import session


class _Compiles(logging.Handler):
    """Counts the programs XLA compiles (or loads from the persistent cache), by name."""

    def __init__(self):
        super().__init__()
        self.names: Counter = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"Finished XLA compilation of jit\((\w+)\)", record.getMessage())
        if found:
            self.names[found.group(1)] += 1


@pytest.fixture
def one_gpu(monkeypatch):
    """The machine has one GPU; JAX's "GPU" is the first CPU device."""
    monkeypatch.setattr(
        session, "probe", lambda: dataclasses.replace(probe(), gpu_count=1, jax_gpu=True)
    )
    monkeypatch.setattr(activate, "_jax_devices", lambda choice: jax.devices("cpu")[:1])
    monkeypatch.setattr(keras_input, "_on_accelerator", lambda: True)
    for name in ("KERAS_BACKEND", "TF_CPP_MIN_LOG_LEVEL"):  # set by conftest; the run sets them
        monkeypatch.setenv(name, os.environ[name])


@pytest.mark.parametrize("mesh", [None, {"model": 1}], ids=["data-parallel", "one-device-mesh"])
def test_on_one_accelerator_the_training_and_evaluation_steps_compile_once(
    one_gpu, toy_data, tmp_path, mesh
):
    compiles = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(compiles)
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 3, "steps_per_execution": 2})
    if mesh is not None:
        config["runtime"]["mesh"] = mesh
    try:
        with jax.log_compiles(True):
            summary = tpurun.train(config, verbose=False)
    finally:
        logger.removeHandler(compiles)
    assert (summary["accelerator"], summary["replicas"]) == ("gpu", 1)
    assert summary["epochs_completed"] == 3
    assert compiles.names["train_step"] == 1, compiles.names
    assert compiles.names["test_step"] == 1, compiles.names


def test_a_one_device_mesh_still_refuses_a_rule_that_matches_nothing(one_gpu, toy_data, tmp_path):
    """Its weights are placed after the build (no distribution places them as they are made),
    and the layout is checked as on a larger mesh."""
    config = toy_config(toy_data, tmp_path / "runs", name="unmatched",
                        model={"factory": f"{FACTORIES}:mlp", "kwargs": {"units": 64}},
                        runtime={"mesh": {"model": 1},
                                 "layout": [{"pattern": "decoder/ffn/kernel", "axes": [None, "model"]}]})  # fmt: skip
    with pytest.raises(ConfigError, match=r"'decoder/ffn/kernel' matches no variable.* closest "
                       r"of its \d+ paths: .*dense\w*/kernel"):  # fmt: skip
        tpurun.train(config, verbose=False)
    assert not (tmp_path / "runs" / "unmatched" / "log.csv").exists()
