"""The one decision: accelerator TPU -> GPU -> CPU, backend, distribution, precision.

The machine is faked: environment variables, a device-file root, installed frameworks.
"""

from __future__ import annotations

from importlib.metadata import version

import pytest
from helpers import HAS_TENSORFLOW, installed_tensorflow_build

from tpurun.config import RuntimeConfig
from tpurun.errors import EnvironmentSetupError
from tpurun.runtime.choice import KERAS_19246, Choice, choose, resolve_tpu_address
from tpurun.runtime.machine import Machine, probe

CPU_BOTH = Machine(tensorflow="2.21.0", tensorflow_build="tensorflow-cpu", jax="0.10.2")
KAGGLE_TPU_VM = Machine(
    env={"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "ISTPUVM": "1", "TPU_PROCESS_ADDRESSES": "local"},
    tpu_device_files=("/dev/vfio/0",),
    tensorflow="2.20.0",
    tensorflow_build="tensorflow-cpu",
    jax="0.10.2",
    jax_tpu=True,
)


def rc(**kw) -> RuntimeConfig:
    return RuntimeConfig(**kw)


def test_cpu_defaults_to_jax():
    choice = choose(rc(), "auto", CPU_BOTH)
    assert (choice.accelerator, choice.backend, choice.distribution) == (
        "cpu",
        "jax",
        "data_parallel",
    )
    assert choice.replicas == 1 and choice.precision == "float32"
    assert "no TPU or GPU found" in choice.reason


def test_simulated_cores_on_both_backends():
    jax_choice = choose(rc(cpu_devices=8), 32, CPU_BOTH)
    assert (jax_choice.backend, jax_choice.replicas, jax_choice.cpu_devices) == ("jax", 8, 8)
    tf_choice = choose(rc(cpu_devices=8, backend="tensorflow"), 1, CPU_BOTH)
    assert (tf_choice.distribution, tf_choice.replicas) == ("mirrored", 8)
    one = choose(rc(backend="tensorflow"), 32, CPU_BOTH)
    assert one.distribution == "default" and one.max_steps_per_execution is None


def test_keras_19246_explicit_tf_is_a_clear_error():
    with pytest.raises(EnvironmentSetupError) as info:
        choose(rc(cpu_devices=2, backend="tensorflow"), 32, CPU_BOTH)
    message = str(info.value)
    assert KERAS_19246 in message and "runtime.backend: jax" in message
    assert "steps_per_execution: 1" in message


def test_keras_19246_auto_avoids_tf_or_caps_steps():
    only_tf = Machine(tensorflow="2.21.0", tensorflow_build="tensorflow-cpu")
    with pytest.raises(EnvironmentSetupError, match="keras-team/keras#19246"):
        choose(rc(cpu_devices=8), 32, only_tf)
    capped = choose(rc(cpu_devices=8), "auto", only_tf)
    assert capped.backend == "tensorflow" and capped.max_steps_per_execution == 1


def test_kaggle_tpu_vm_uses_jax_in_bfloat16():
    choice = choose(rc(), "auto", KAGGLE_TPU_VM)
    assert (choice.accelerator, choice.backend, choice.distribution) == (
        "tpu",
        "jax",
        "data_parallel",
    )
    assert choice.precision == "mixed_bfloat16"
    assert choice.replicas is None  # known once the TPU is initialised


def test_tpu_that_nothing_can_drive_is_an_error_even_in_auto():
    machine = Machine(
        tpu_device_files=("/dev/accel0",),
        tensorflow="2.21.0",
        tensorflow_build="tensorflow-cpu",
        jax="0.10.2",
    )
    with pytest.raises(EnvironmentSetupError) as info:
        choose(rc(), "auto", machine)
    assert "pip install 'jax[tpu]'" in str(info.value)
    assert "runtime.accelerator: cpu" in str(info.value)
    # ...and training on the CPU on purpose still works
    assert choose(rc(accelerator="cpu"), "auto", machine).accelerator == "cpu"


def test_tf_backend_asked_for_on_a_tpu_it_cannot_drive():
    with pytest.raises(
        EnvironmentSetupError, match="'tensorflow' cannot drive the TPU.*tensorflow-tpu"
    ):
        choose(rc(backend="tensorflow"), "auto", KAGGLE_TPU_VM)


def test_tpu_node_with_tensorflow_gets_tpu_strategy_and_address():
    machine = Machine(
        env={"TPU_NAME": "grpc://10.0.0.2:8470"}, tensorflow="2.15.0", tensorflow_build="tensorflow"
    )
    choice = choose(rc(), 32, machine)
    assert (choice.backend, choice.distribution) == ("tensorflow", "tpu_strategy")
    assert choice.tpu_address == "grpc://10.0.0.2:8470"
    assert choice.max_steps_per_execution is None  # keras#19246 is MirroredStrategy's


def test_tpu_address_resolution():
    assert resolve_tpu_address("auto", KAGGLE_TPU_VM) == "local"
    assert resolve_tpu_address("my-tpu", KAGGLE_TPU_VM) == "my-tpu"
    colab_node = Machine(env={"COLAB_TPU_ADDR": "10.1.2.3:8470"})
    assert resolve_tpu_address("auto", colab_node) == "grpc://10.1.2.3:8470"
    with pytest.raises(EnvironmentSetupError, match="found no TPU"):
        resolve_tpu_address("auto", CPU_BOTH)


def test_explicit_accelerators_that_are_absent():
    with pytest.raises(
        EnvironmentSetupError, match="'tpu' was asked for, but this machine has no TPU"
    ):
        choose(rc(accelerator="tpu"), "auto", CPU_BOTH)
    with pytest.raises(EnvironmentSetupError, match="'gpu' was asked for, but no NVIDIA GPU"):
        choose(rc(accelerator="gpu"), "auto", CPU_BOTH)


def test_gpus_prefer_jax_with_cuda_else_tensorflow():
    gpus = Machine(
        gpu_count=4, tensorflow="2.21.0", tensorflow_build="tensorflow", jax="0.10.2", jax_gpu=True
    )
    choice = choose(rc(), 16, gpus)
    assert (choice.accelerator, choice.backend, choice.replicas) == ("gpu", "jax", 4)
    tf_only = Machine(gpu_count=2, tensorflow="2.21.0", tensorflow_build="tensorflow", jax="0.10.2")
    choice = choose(rc(), "auto", tf_only)
    assert (choice.backend, choice.distribution, choice.max_steps_per_execution) == (
        "tensorflow",
        "mirrored",
        1,
    )


def test_gpu_without_cuda_frameworks_falls_back_to_cpu_and_says_why():
    machine = Machine(
        gpu_count=1, tensorflow="2.21.0", tensorflow_build="tensorflow-cpu", jax="0.10.2"
    )
    choice = choose(rc(), "auto", machine)
    assert (
        choice.accelerator == "cpu" and "no installed framework has CUDA support" in choice.reason
    )


def test_float16_on_tpu_warns():
    choice = choose(rc(precision="mixed_float16"), "auto", KAGGLE_TPU_VM)
    assert any("mixed_bfloat16" in w for w in choice.warnings)


def test_keras_already_imported_in_a_notebook():
    loaded_tf = Machine(
        tensorflow="2.21.0",
        tensorflow_build="tensorflow-cpu",
        jax="0.10.2",
        keras_loaded_backend="tensorflow",
    )
    assert choose(rc(), 1, loaded_tf).backend == "tensorflow"
    with pytest.raises(
        EnvironmentSetupError,
        match="already imported in this Python process with the tensorflow backend",
    ):
        choose(rc(backend="jax"), 1, loaded_tf)


def test_probe_reads_device_files_and_environment(tmp_path):
    (tmp_path / "accel0").touch()
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidia1").touch()
    (tmp_path / "nvidiactl").touch()  # not a GPU
    machine = probe(env={"TPU_NAME": "t1"}, dev_root=str(tmp_path))
    assert machine.tpu_device_files == (str(tmp_path / "accel0"),)
    assert machine.gpu_count == 2
    assert machine.tpu_vm and machine.tpu_present
    empty = probe(env={}, dev_root=str(tmp_path / "none"))
    assert not empty.tpu_present and empty.gpu_count == 0
    # this environment's frameworks, as installed (make install: the hub extra's tensorflow-text
    # installs the full tensorflow beside tensorflow-cpu, and the full one is named)
    assert empty.tensorflow_build == installed_tensorflow_build()
    assert empty.jax == version("jax") and empty.keras == version("keras")


@pytest.mark.parametrize(
    ("wheels", "build"),
    [({"tensorflow-cpu", "tensorflow"}, "tensorflow"), ({"tensorflow-cpu"}, "tensorflow-cpu"),
     ({"tensorflow-tpu", "tensorflow"}, "tensorflow-tpu"), (set(), None)],
)  # fmt: skip
def test_probe_names_the_tensorflow_build_that_can_drive_the_most(monkeypatch, wheels, build):
    from tpurun.runtime import machine

    monkeypatch.setattr(machine, "installed_version", lambda d: "2.21.0" if d in wheels else None)
    found = probe(env={}, dev_root="/nonexistent")
    assert (found.tensorflow_build, found.tensorflow) == (build, "2.21.0" if build else None)


def tpu_choice(backend: str) -> Choice:
    distribution = "tpu_strategy" if backend == "tensorflow" else "data_parallel"
    return Choice(backend, "tpu", distribution, None, "mixed_bfloat16", "test", tpu_address="local")


def test_a_tpu_held_by_another_process_names_the_notebook_trap(monkeypatch):
    import jax

    from tpurun.runtime import activate as process

    def held(platform=None):
        raise RuntimeError(
            "Unable to initialize backend 'tpu': ABORTED: The TPU is already in use by process with pid 4242."
        )

    monkeypatch.setattr(jax, "devices", held)
    with pytest.raises(
        EnvironmentSetupError, match=r"held by another process.*pid 4242.*restart it"
    ):
        process._jax_devices(tpu_choice("jax"))


def test_jax_without_the_tpu_platform_is_a_clear_error(monkeypatch):
    import jax

    from tpurun.runtime import activate as process

    def missing(platform=None):
        raise RuntimeError(
            "Unknown backend: 'tpu' requested, but no platforms that are instances of tpu are present."
        )

    monkeypatch.setattr(jax, "devices", missing)
    with pytest.raises(EnvironmentSetupError, match="JAX cannot use the TPU: Unknown backend"):
        process._jax_devices(tpu_choice("jax"))


@pytest.mark.skipif(not HAS_TENSORFLOW, reason="TensorFlow's TPU resolver")
def test_tf_tpu_resolver_failure_is_a_clear_error(monkeypatch):
    import tensorflow as tf

    from tpurun.runtime import activate as process

    class Resolver:
        def __init__(self, tpu=None):
            raise ValueError("Please provide a TPU Name to connect to.")

    monkeypatch.setattr(tf.distribute.cluster_resolver, "TPUClusterResolver", Resolver)
    with pytest.raises(
        EnvironmentSetupError,
        match="cannot reach the TPU at 'local': Please provide a TPU Name.*runtime.backend: jax",
    ):
        process._tf_strategy(tpu_choice("tensorflow"))
