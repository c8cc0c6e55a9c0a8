"""Backend, accelerator and distribution: one ordered decision, shared by ``train`` and ``doctor``.

Two steps, kept apart so that the decision can be tested anywhere:

* :func:`probe` gathers facts about the machine *without importing* TensorFlow, JAX or Keras
  (device files, environment variables, installed distributions);
* :func:`choose` is a pure function of the config and those facts: TPU -> GPUs -> CPU, then the
  backend that can run the config as written, then the distribution.

:func:`tpurun.runtime.activate.activate` then sets the process up for the choice.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from tpurun.config import RuntimeConfig
from tpurun.errors import EnvironmentSetupError
from tpurun.multihost.cluster import Cluster, cluster

# keras-team/keras#19246: TF backend + MirroredStrategy with 2+ replicas + steps_per_execution > 1
# fails inside fit() with "You must feed a value for placeholder tensor".
KERAS_19246 = "keras-team/keras#19246"
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


@dataclass(frozen=True)
class Choice:
    """What ``tpurun train`` will run on, and why."""

    backend: str  # jax | tensorflow
    accelerator: str  # tpu | gpu | cpu
    distribution: str  # data_parallel | tpu_strategy | mirrored | default
    replicas: int | None  # None: a TPU's core count, known once it is initialised
    precision: str
    reason: str
    tpu_address: str | None = None
    cpu_devices: int = 1
    max_steps_per_execution: int | None = None  # 1 where keras#19246 applies
    warnings: tuple[str, ...] = ()
    cluster: Cluster = Cluster()

    @property
    def summary(self) -> str:
        replicas = "TPU cores" if self.replicas is None else f"{self.replicas} replica(s)"
        hosts = (
            f", process {self.cluster.process_id} of {self.cluster.num_processes}"
            if self.cluster.multi
            else ""
        )
        return (
            f"{self.accelerator.upper()} via {self.backend} ({self.distribution}, {replicas}"
            f"{hosts}, {self.precision}): {self.reason}"
        )


def resolve_tpu_address(tpu: str, machine: Machine) -> str:
    """TF's TPUClusterResolver argument: ``local`` on a TPU VM, ``TPU_NAME``, or the given address."""
    if tpu != "auto":
        return tpu
    if machine.tpu_vm:
        return "local"
    if machine.tpu_node:
        return machine.tpu_node
    raise EnvironmentSetupError(
        "runtime.tpu: 'auto' found no TPU: no TPU device files, no TPU_NAME. Set runtime.tpu to "
        "'local', a TPU name or grpc://host:port."
    )


def _install_hint(backend: str, accelerator: str) -> str:
    return {
        ("jax", "tpu"): "pip install 'jax[tpu]'",
        ("jax", "gpu"): "pip install 'jax[cuda12]'",
        (
            "tensorflow",
            "tpu",
        ): "a TPU build of TensorFlow (tensorflow-tpu <= 2.20; none newer exists)",
        ("tensorflow", "gpu"): "pip install 'tensorflow[and-cuda]'",
    }.get((backend, accelerator), f"pip install {backend}")


def _drivers(accelerator: str, m: Machine) -> list[str]:
    """Backends installed here that can drive the accelerator, fastest first."""
    can = {
        "tpu": {"jax": m.jax is not None and m.jax_tpu, "tensorflow": m.tf_can_drive_tpu},
        "gpu": {"jax": m.jax is not None and m.jax_gpu, "tensorflow": m.tf_can_drive_gpu},
        "cpu": {"jax": m.jax is not None, "tensorflow": m.tensorflow is not None},
    }[accelerator]
    return [b for b in ("jax", "tensorflow") if can[b]]


def _accelerator(cfg: RuntimeConfig, m: Machine) -> tuple[str, str]:
    """TPU -> GPU -> CPU. Returns the accelerator and why."""
    if cfg.accelerator == "tpu" and not m.tpu_present and cfg.tpu == "auto":
        raise EnvironmentSetupError(
            "runtime.accelerator: 'tpu' was asked for, but this machine has no TPU (no /dev/accel* "
            "or /dev/vfio device, no TPU_NAME). Pick a TPU runtime, or set runtime.accelerator: auto."
        )
    if cfg.accelerator == "gpu" and m.gpu_count == 0:
        raise EnvironmentSetupError(
            "runtime.accelerator: 'gpu' was asked for, but no NVIDIA GPU is visible (no /dev/nvidia0)."
            " Pick a GPU runtime, or set runtime.accelerator: auto."
        )
    if cfg.accelerator != "auto":
        return cfg.accelerator, "asked for in runtime.accelerator"
    if m.tpu_present:
        if not _drivers("tpu", m):
            raise EnvironmentSetupError(
                "A TPU is attached, but no installed framework can drive it: "
                f"JAX {'has no libtpu' if m.jax else 'is not installed'}, and TensorFlow "
                f"({m.tensorflow_build or 'not installed'}) has no TPU support. Install "
                "'jax[tpu]' (pip install 'jax[tpu]'), or set runtime.accelerator: cpu to train on "
                "the CPU on purpose."
            )
        return "tpu", "a TPU is attached"
    if m.gpu_count:
        if _drivers("gpu", m):
            return "gpu", f"{m.gpu_count} GPU(s) found, no TPU"
        return "cpu", (
            f"{m.gpu_count} GPU(s) found, but no installed framework has CUDA support "
            "(pip install 'jax[cuda12]')"
        )
    return "cpu", "no TPU or GPU found"


def choose(cfg: RuntimeConfig, steps_per_execution: int | str, machine: Machine) -> Choice:
    """Decide backend, accelerator, distribution and precision for a config on a machine.

    Args:
        cfg: the config's ``runtime`` section.
        steps_per_execution: ``train.steps_per_execution`` as written (an int or ``"auto"``).
        machine: facts from :func:`probe`.

    Raises:
        EnvironmentSetupError: the config cannot run here as written; the message says what to
            install or change.
    """
    accelerator, why = _accelerator(cfg, machine)
    drivers = _drivers(accelerator, machine)
    if cfg.backend != "auto" and cfg.backend not in drivers:
        raise EnvironmentSetupError(
            f"runtime.backend: '{cfg.backend}' cannot drive the {accelerator.upper()} here. "
            f"Install {_install_hint(cfg.backend, accelerator)}, or set runtime.backend: auto."
        )
    hosts = cluster(cfg, machine.env)
    if accelerator == "tpu":
        replicas = None
    elif accelerator == "gpu":
        replicas = machine.gpu_count * hosts.num_processes  # the same GPUs on every host
    else:
        replicas = cfg.cpu_devices  # all processes together: `tpurun launch` splits them
    if accelerator != "cpu" and cfg.cpu_devices > 1:
        why += "; runtime.cpu_devices applies only on the CPU"
    if hosts.multi:
        if cfg.backend == "tensorflow" or (cfg.backend == "auto" and "jax" not in drivers):
            raise EnvironmentSetupError(
                f"{hosts.num_processes} processes ({hosts.source}) train together on JAX's "
                "distributed runtime only: Keras 3's fit does not support TensorFlow's "
                "MultiWorkerMirroredStrategy (keras-team/keras#20601). Set runtime.backend: jax "
                "(pip install jax)."
            )
        if accelerator == "cpu" and cfg.cpu_devices % hosts.num_processes:
            raise EnvironmentSetupError(
                f"runtime.cpu_devices: {cfg.cpu_devices} does not split evenly over "
                f"{hosts.num_processes} processes; use a multiple of {hosts.num_processes}."
            )
        why += f"; {hosts.num_processes} processes from {hosts.source}"

    multi = replicas is None or replicas > 1
    explicit_spe = steps_per_execution if isinstance(steps_per_execution, int) else 1

    def hits_19246(backend: str) -> bool:
        return backend == "tensorflow" and accelerator != "tpu" and multi

    candidates = [cfg.backend] if cfg.backend != "auto" else drivers
    if machine.keras_loaded_backend:
        # Keras fixes its backend at first import; in a notebook kernel that already imported it,
        # only that backend can run in this process.
        loaded = machine.keras_loaded_backend
        if loaded not in candidates:
            raise EnvironmentSetupError(
                f"Keras was already imported in this Python process with the {loaded} backend, and "
                f"this config needs {' or '.join(candidates) or 'another backend'} on the "
                f"{accelerator.upper()}. Restart the kernel and call tpurun.train() before importing"
                " keras, or run `!tpurun train CONFIG` in a cell."
            )
        candidates = [loaded]
    runnable = [b for b in candidates if not (hits_19246(b) and explicit_spe > 1)]
    if not runnable:
        raise EnvironmentSetupError(
            f"train.steps_per_execution: {explicit_spe} with the TensorFlow backend on "
            f"{replicas} replicas hits a known Keras 3 bug ({KERAS_19246}: fit() fails with "
            "'You must feed a value for placeholder tensor'). Set runtime.backend: jax (it runs this "
            "fine; pip install jax if it is missing), or train.steps_per_execution: 1."
        )
    backend = runnable[0]
    if cfg.backend != "auto":
        backend_why = "asked for in runtime.backend"
    elif machine.keras_loaded_backend:
        backend_why = "Keras is already imported with it in this process"
    elif backend == "jax":
        backend_why = "JAX is the fastest backend installed that drives it"
    elif drivers[0] == "jax":
        backend_why = f"steps_per_execution > 1 on several replicas needs it ({KERAS_19246})"
    else:
        backend_why = "the only installed backend that drives it"

    if accelerator == "tpu":
        distribution = "data_parallel" if backend == "jax" else "tpu_strategy"
    elif backend == "jax":
        distribution = "data_parallel"
    else:
        distribution = "mirrored" if multi else "default"

    precision, warnings = _precision(cfg, accelerator, backend, machine)
    tpu_address = None
    if accelerator == "tpu" and backend == "tensorflow":
        tpu_address = resolve_tpu_address(cfg.tpu, machine)
    return Choice(
        backend=backend,
        accelerator=accelerator,
        distribution=distribution,
        replicas=replicas,
        precision=precision,
        reason=f"{why}; backend {backend}: {backend_why}",
        tpu_address=tpu_address,
        cpu_devices=cfg.cpu_devices if accelerator == "cpu" else 1,
        # Where keras#19246 applies, an `auto` steps_per_execution must resolve to 1.
        max_steps_per_execution=1 if hits_19246(backend) else None,
        warnings=tuple(warnings),
        cluster=hosts,
    )


def _precision(
    cfg: RuntimeConfig, accelerator: str, backend: str, machine: Machine
) -> tuple[str, list[str]]:
    """``auto``: bfloat16 where the hardware computes in it (TPUs); float32, always sound, elsewhere."""
    warnings = []
    precision = cfg.precision
    if precision == "auto":
        precision = "mixed_bfloat16" if accelerator == "tpu" else "float32"
    if precision == "mixed_float16" and accelerator == "tpu":
        warnings.append(
            "runtime.precision: mixed_float16 on a TPU: TPUs compute in bfloat16; float16 adds loss "
            "scaling and risks overflow. Use mixed_bfloat16."
        )
    if accelerator == "tpu" and backend == "jax" and machine.tensorflow_build == "tensorflow-tpu":
        warnings.append(
            "tensorflow-tpu is installed beside JAX: it may hold the TPU and stop JAX from using "
            "it. tf.data needs only tensorflow-cpu."
        )
    return precision, warnings
