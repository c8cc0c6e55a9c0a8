"""Backend, accelerator and distribution: one ordered decision, shared by ``train`` and ``doctor``.

Two steps, kept apart so that the decision can be tested anywhere:

* :func:`tpurun.runtime.machine.probe` gathers facts about the machine *without importing*
  TensorFlow, JAX or Keras (device files, environment variables, installed distributions);
* :func:`choose` is a pure function of the config and those facts: TPU -> GPUs -> CPU, then the
  backend that can run the config as written, then the distribution.

:func:`tpurun.runtime.activate.activate` then sets the process up for the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tpurun.config import RuntimeConfig
from tpurun.errors import EnvironmentSetupError
from tpurun.multihost.cluster import Cluster, cluster
from tpurun.runtime import mesh as meshes
from tpurun.runtime.machine import Machine

# keras-team/keras#19246: TF backend + MirroredStrategy with 2+ replicas + steps_per_execution > 1
# fails inside fit() with "You must feed a value for placeholder tensor".
KERAS_19246 = "keras-team/keras#19246"


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
    mesh_config: Any = None  # runtime.mesh as written (MeshConfig); resolved at activation
    mesh: tuple[int, int] | None = None  # (data, model), where the device count is known
    tensorflow: str | None = None  # its version where installed: the tf_data reader needs it
    compilation_cache: str | bool = "auto"  # runtime.compilation_cache, resolved at activation

    @property
    def mesh_text(self) -> str:
        if self.mesh_config is None:
            return ""
        if self.mesh is not None:
            return f"mesh {self.mesh[0]}x{self.mesh[1]}"
        return f"mesh {self.mesh_config.data}x{self.mesh_config.model}"

    @property
    def summary(self) -> str:
        # Under a mesh the devices are not replicas of the model: each holds a slice of it.
        unit = "device(s)" if self.mesh_config is not None else "replica(s)"
        replicas = "TPU cores" if self.replicas is None else f"{self.replicas} {unit}"
        hosts = (
            f", process {self.cluster.process_id} of {self.cluster.num_processes}"
            if self.cluster.multi
            else ""
        )
        mesh = f" {self.mesh_text}" if self.mesh_text else ""
        return (
            f"{self.accelerator.upper()} via {self.backend} ({self.distribution}{mesh}, {replicas}"
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
        machine: facts from :func:`tpurun.runtime.machine.probe`.

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
    replicas = _replicas(cfg, accelerator, machine, hosts)
    if accelerator != "cpu" and cfg.cpu_devices > 1:
        why += "; runtime.cpu_devices applies only on the CPU"
    if hosts.multi:
        why += _check_hosts(cfg, accelerator, drivers, hosts)
    multi = replicas is None or replicas > 1

    def hits_19246(backend: str) -> bool:
        return backend == "tensorflow" and accelerator != "tpu" and multi

    spe = steps_per_execution if isinstance(steps_per_execution, int) else 1
    backend, backend_why = _backend(cfg, machine, accelerator, drivers, hits_19246, spe, replicas)
    precision, warnings = _precision(cfg, accelerator, backend, machine)
    mesh = None
    if cfg.mesh is not None:
        meshes.check_support(cfg.mesh, backend)
        if replicas is not None:  # a TPU's devices are counted when it starts (activate)
            mesh = meshes.resolve(cfg.mesh, replicas, hosts.num_processes)
    tpu_address = None
    if accelerator == "tpu" and backend == "tensorflow":
        tpu_address = resolve_tpu_address(cfg.tpu, machine)
    return Choice(
        backend=backend,
        accelerator=accelerator,
        distribution="model_parallel"
        if cfg.mesh is not None and cfg.mesh.model > 1
        else _distribution(accelerator, backend, multi),
        replicas=replicas,
        precision=precision,
        reason=f"{why}; backend {backend}: {backend_why}",
        tpu_address=tpu_address,
        cpu_devices=cfg.cpu_devices if accelerator == "cpu" else 1,
        # Where keras#19246 applies, an `auto` steps_per_execution must resolve to 1.
        max_steps_per_execution=1 if hits_19246(backend) else None,
        warnings=tuple(warnings),
        cluster=hosts,
        mesh_config=cfg.mesh,
        mesh=mesh,
        tensorflow=machine.tensorflow,
        compilation_cache=cfg.compilation_cache,
    )


def _replicas(cfg: RuntimeConfig, accelerator: str, machine: Machine, hosts: Cluster) -> int | None:
    """Replicas over all processes; None on a TPU, whose core count is known once it starts."""
    if accelerator == "tpu":
        return None
    if accelerator == "gpu":
        return machine.gpu_count * hosts.num_processes  # the same GPUs on every host
    return cfg.cpu_devices  # all processes together: `tpurun launch` splits them


def _check_hosts(cfg: RuntimeConfig, accelerator: str, drivers: list[str], hosts: Cluster) -> str:
    """Refuse what several processes cannot run; returns the reason's note on the processes."""
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
    return f"; {hosts.num_processes} processes from {hosts.source}"


def _backend(
    cfg: RuntimeConfig,
    machine: Machine,
    accelerator: str,
    drivers: list[str],
    hits_19246,
    spe: int,
    replicas: int | None,
) -> tuple[str, str]:
    """The backend to run, and why: the config's, else the fastest that drives the accelerator
    and can run the config as written."""
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
    runnable = [b for b in candidates if not (hits_19246(b) and spe > 1)]
    if not runnable:
        raise EnvironmentSetupError(
            f"train.steps_per_execution: {spe} with the TensorFlow backend on "
            f"{replicas} replicas hits a known Keras 3 bug ({KERAS_19246}: fit() fails with "
            "'You must feed a value for placeholder tensor'). Set runtime.backend: jax (it runs this "
            "fine; pip install jax if it is missing), or train.steps_per_execution: 1."
        )
    backend = runnable[0]
    if cfg.backend != "auto":
        return backend, "asked for in runtime.backend"
    if machine.keras_loaded_backend:
        return backend, "Keras is already imported with it in this process"
    if backend == "jax":
        return backend, "JAX is the fastest backend installed that drives it"
    if drivers[0] == "jax":
        return backend, f"steps_per_execution > 1 on several replicas needs it ({KERAS_19246})"
    return backend, "the only installed backend that drives it"


def _distribution(accelerator: str, backend: str, multi: bool) -> str:
    if accelerator == "tpu":
        return "data_parallel" if backend == "jax" else "tpu_strategy"
    if backend == "jax":
        return "data_parallel"
    return "mirrored" if multi else "default"


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
