"""A run on one accelerator (one GPU, a one-chip TPU) compiles each step once.

Found by the GPU check on an H200: epoch 2 of every run was slower than epoch 3 (a Gemma 2B LoRA:
15.5 s against 6.6 s), because the training step was compiled a third time at its first step. A
Keras distribution over one device leaves the variables uncommitted, while the batches it lays out
are committed, and JAX compiles again whenever that mix changes (the step's outputs are committed;
the metrics reset at each epoch are not). Faked here on one CPU device: the machine says one GPU
with JAX's CUDA plugin, and JAX's GPU devices are the first CPU device.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections import Counter

import jax
import pytest
from helpers import toy_config

import tpurun
from tpurun.data.native import keras_input
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


def test_on_one_accelerator_the_training_and_evaluation_steps_compile_once(
    one_gpu, toy_data, tmp_path
):
    compiles = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(compiles)
    config = toy_config(toy_data, tmp_path / "runs", train={"epochs": 3, "steps_per_execution": 2})
    try:
        with jax.log_compiles(True):
            summary = tpurun.train(config, verbose=False)
    finally:
        logger.removeHandler(compiles)
    assert (summary["accelerator"], summary["replicas"]) == ("gpu", 1)
    assert summary["epochs_completed"] == 3
    assert compiles.names["train_step"] == 1, compiles.names
    assert compiles.names["test_step"] == 1, compiles.names
