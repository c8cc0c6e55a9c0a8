"""Which process of how many this is, and how the processes meet (TPU pod slices, SLURM, GPU
nodes, `tpurun launch` on one machine).

JAX's distributed runtime connects them (``jax.distributed``, through which Keras' ``DataParallel``
builds global batches from each process's own); this module reads the description of the cluster
from the config or the environment. Imports no framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tpurun.config import RuntimeConfig
from tpurun.errors import EnvironmentSetupError


@dataclass(frozen=True)
class Cluster:
    """Which process of how many this is, and how they meet (JAX's distributed runtime)."""

    num_processes: int = 1
    process_id: int = 0
    coordinator: str | None = None  # host:port of process 0; None: JAX finds it (Cloud TPU, SLURM)
    source: str = "one process"

    @property
    def multi(self) -> bool:
        return self.num_processes > 1

    @property
    def chief(self) -> bool:
        return self.process_id == 0


def _int(value: str | None, name: str) -> int | None:
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise EnvironmentSetupError(f"{name}: '{value}' is not a whole number.") from None


def cluster(cfg: RuntimeConfig, env: Mapping[str, str]) -> Cluster:
    """The processes training together, from the config's runtime keys, else the standard
    ``KERAS_DISTRIBUTION_*`` variables, else a Cloud TPU pod's or SLURM's own variables.

    Raises:
        EnvironmentSetupError: an incomplete or inconsistent description.
    """
    if cfg.num_processes is not None or cfg.coordinator is not None or cfg.process_id is not None:
        n, i = cfg.num_processes or 1, cfg.process_id or 0
        coordinator, source, key = cfg.coordinator, "runtime.num_processes", "runtime"
    elif env.get("KERAS_DISTRIBUTION_NUM_PROCESSES"):
        n = _int(env["KERAS_DISTRIBUTION_NUM_PROCESSES"], "KERAS_DISTRIBUTION_NUM_PROCESSES")
        i = _int(env.get("KERAS_DISTRIBUTION_PROCESS_ID"), "KERAS_DISTRIBUTION_PROCESS_ID") or 0
        addresses = env.get("KERAS_DISTRIBUTION_JOB_ADDRESSES") or None
        coordinator = addresses.split(",")[0] if addresses else None
        source, key = "KERAS_DISTRIBUTION_* variables", "KERAS_DISTRIBUTION"
    elif len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        n = len(env["TPU_WORKER_HOSTNAMES"].split(","))
        i = _int(env.get("TPU_WORKER_ID"), "TPU_WORKER_ID") or 0
        coordinator, source, key = None, "a Cloud TPU pod slice (TPU_WORKER_HOSTNAMES)", "TPU"
    elif (_int(env.get("SLURM_NTASKS"), "SLURM_NTASKS") or 1) > 1:
        n, i = int(env["SLURM_NTASKS"]), _int(env.get("SLURM_PROCID"), "SLURM_PROCID") or 0
        coordinator, source, key = None, "SLURM (SLURM_NTASKS)", "SLURM"
    else:
        return Cluster()
    if not 0 <= i < n:
        raise EnvironmentSetupError(
            f"{key}: process id {i} is outside 0..{n - 1} for {n} processes; give each process "
            "its own id, 0 on the coordinator."
        )
    if n > 1 and coordinator is None and key in ("runtime", "KERAS_DISTRIBUTION"):
        raise EnvironmentSetupError(
            f"{key}: {n} processes but no coordinator: set runtime.coordinator: HOST:PORT (process "
            "0's address, the same on every process), or KERAS_DISTRIBUTION_JOB_ADDRESSES."
        )
    return Cluster(n, i, coordinator, source)
