"""What this machine and Python environment offer: device files, environment variables and the
installed distributions, found without importing any framework (so ``tpurun doctor`` and the
choice can run before anything is set up, and in a process that must not touch the TPU)."""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

_TF_BUILDS = ("tensorflow-tpu", "tensorflow", "tensorflow-cpu", "tf-nightly", "tf-nightly-cpu")


def installed_version(dist: str) -> str | None:
    """The version of an installed distribution (``tensorflow-cpu``, ``jax``), without importing it."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class Machine:
    """What this machine and Python environment offer, found without importing any framework."""

    env: Mapping[str, str] = field(default_factory=dict)
    tpu_device_files: tuple[str, ...] = ()
    gpu_count: int = 0
    tensorflow: str | None = None  # version
    tensorflow_build: str | None = None  # tensorflow | tensorflow-cpu | tensorflow-tpu | ...
    jax: str | None = None
    jax_tpu: bool = False  # libtpu installed: JAX can drive a TPU
    jax_gpu: bool = False  # a CUDA plugin installed: JAX can drive GPUs
    keras: str | None = None
    keras_loaded_backend: str | None = None  # Keras already imported in this process (a notebook)

    @property
    def tpu_vm(self) -> bool:
        """A TPU attached to this host (TPU VM), as opposed to a network TPU node."""
        env = self.env
        return bool(
            self.tpu_device_files
            or env.get("ISTPUVM") == "1"
            or env.get("COLAB_TPU_1VM") == "1"
            or env.get("TPU_PROCESS_ADDRESSES") == "local"
        )

    @property
    def tpu_node(self) -> str | None:
        """The address of a network TPU node (retired on Kaggle and Colab, still on Cloud)."""
        if self.env.get("TPU_NAME"):
            return self.env["TPU_NAME"]
        if self.env.get("COLAB_TPU_ADDR"):
            return "grpc://" + self.env["COLAB_TPU_ADDR"]
        return None

    @property
    def tpu_present(self) -> bool:
        return self.tpu_vm or self.tpu_node is not None

    @property
    def tf_can_drive_tpu(self) -> bool:
        if self.tensorflow is None:
            return False
        # A TPU node is driven over gRPC by any TF; a TPU VM needs a TPU build of TF.
        return self.tensorflow_build == "tensorflow-tpu" or (
            self.tpu_node is not None and not self.tpu_vm
        )

    @property
    def tf_can_drive_gpu(self) -> bool:
        return self.tensorflow_build in ("tensorflow", "tf-nightly")


def probe(env: Mapping[str, str] | None = None, dev_root: str = "/dev") -> Machine:
    """Gather the facts :func:`choose` needs. Cheap: no framework is imported."""
    env = dict(os.environ if env is None else env)
    tpu_files = sorted(glob.glob(f"{dev_root}/accel*") + glob.glob(f"{dev_root}/vfio/[0-9]*"))
    gpus = [p for p in glob.glob(f"{dev_root}/nvidia*") if p[len(dev_root) + 7 :].isdigit()]
    build = next((b for b in _TF_BUILDS if installed_version(b)), None)
    loaded = None
    if "keras" in sys.modules:
        with contextlib.suppress(Exception):
            loaded = sys.modules["keras"].backend.backend()
    return Machine(
        env=env,
        tpu_device_files=tuple(tpu_files),
        gpu_count=len(gpus),
        tensorflow=installed_version(build) if build else None,
        tensorflow_build=build,
        jax=installed_version("jax") if importlib.util.find_spec("jax") else None,
        jax_tpu=bool(installed_version("libtpu") or installed_version("libtpu-nightly")),
        jax_gpu=any(
            installed_version(p)
            for p in ("jax-cuda12-plugin", "jax-cuda13-plugin", "jax-rocm-plugin")
        ),
        keras=installed_version("keras"),
        keras_loaded_backend=loaded,
    )
