"""Several processes training together (TPU pod slices, GPU nodes, `tpurun launch` on one machine).

Which process of how many this is, how each one's share of the data is chosen, and how they agree
on a stop. JAX's distributed runtime connects them (``jax.distributed``, through which Keras'
``DataParallel`` builds global batches from each process's own); this module holds the decisions
that runtime leaves to tpurun. Imports no framework at module level.
"""

from __future__ import annotations

import os
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


# ------------------------------------------------------------------------------------ data shares
@dataclass(frozen=True)
class Share:
    """What one process reads of a split: its files, and (when there are fewer files than
    processes) its records of them, every ``num_shards``-th from ``shard_index``."""

    files: list[str]
    records: int
    shard: tuple[int, int] | None = None  # (num_shards, index) at the record level


def shares(files: list[str], counts: list[int], processes: int) -> list[Share]:
    """Each process's share of a split, so that no record is read by two processes in one pass
    and together they read every record.

    Files are dealt round-robin (they are sorted, so every process computes the same deal).
    With fewer files than processes, every process reads all of them and keeps every
    ``processes``-th record: slower to read, and said in a warning by the caller.
    """
    if processes == 1:
        return [Share(list(files), sum(counts))]
    if len(files) >= processes:
        return [Share(files[i::processes], sum(counts[i::processes])) for i in range(processes)]
    total = sum(counts)
    return [
        Share(list(files), total // processes + (i < total % processes), (processes, i))
        for i in range(processes)
    ]


def share_warning(split: str, files: list[str], processes: int) -> str | None:
    if processes > 1 and len(files) < processes:
        return (
            f"data.{split}: {len(files)} file(s) for {processes} processes: each process reads "
            f"them all and keeps every {processes}th record. Write at least {processes} shards "
            "(`tpurun data write SOURCE OUT_PREFIX --shard-multiple 8`) so each reads only its own."
        )
    return None


# ------------------------------------------------------------------------------- agreeing on stops
_REASONS = ("", "SIGTERM", "SIGINT", "train.time_limit")


def agree_on_stop(reason: str | None, save: str | None = None) -> tuple[str | None, str | None]:
    """The stop (and the mid-epoch save) every process takes, given this one's (None: none).

    A signal or the time limit can reach any one process (a preemption notice, a Ctrl-C on one
    host), and ``every_minutes`` saves follow each process's own clock; but a save is a collective
    and a process that stopped alone would leave the others waiting forever in one. So at every
    execution's end all processes exchange what they were asked, and all stop (or save) if any
    was. Costs one small all-gather per execution (measured in benchmarks/multi_process.py).
    """
    import numpy as np
    from jax.experimental import multihost_utils

    codes = np.array([_REASONS.index(reason) if reason in _REASONS else int(bool(reason)),
                      int(bool(save))], dtype=np.int32)  # fmt: skip
    agreed = np.max(np.reshape(multihost_utils.process_allgather(codes), (-1, 2)), axis=0)
    return (_REASONS[int(agreed[0])] or None), ("every_minutes" if agreed[1] else None)


def check_shared_folder(folder: str, cluster: Cluster) -> None:
    """Refuse a run directory that not every process can see: only process 0 writes it, and every
    process must read the same resume point. Process 0 writes a token into ``folder``; all check
    they read it back. Passes on one machine (`tpurun launch`), a shared filesystem or ``gs://``.

    Raises:
        EnvironmentSetupError: on every process, when any process cannot see the token.
    """
    import secrets

    import numpy as np
    from jax.experimental import multihost_utils

    from tpurun.storage import fileio

    marker = fileio.join(folder, f".tpurun-shared-{cluster.num_processes}")
    token = np.array([secrets.randbits(31) if cluster.chief else 0], dtype=np.int32)
    token = int(multihost_utils.broadcast_one_to_all(token)[0])
    if cluster.chief:
        fileio.makedirs(folder)
        fileio.write_text(marker, str(token))
    multihost_utils.sync_global_devices("tpurun: shared-folder token written")
    seen = (fileio.read_text_or_none(marker) or "").strip() == str(token)
    everyone = multihost_utils.process_allgather(np.array([int(seen)], dtype=np.int32))
    multihost_utils.sync_global_devices("tpurun: shared-folder token read")
    if cluster.chief:
        fileio.remove(marker)
    blind = [i for i, ok in enumerate(np.ravel(everyone)) if not ok]
    if blind:
        raise EnvironmentSetupError(
            f"output.dir: {folder} is not shared: process(es) {', '.join(map(str, blind))} of "
            f"{cluster.num_processes} cannot see what process 0 writes there, and every process "
            "must read the same checkpoints. Put output.dir on gs://bucket/... (or a filesystem "
            "every host mounts)."
        )


# ------------------------------------------------------------------------------- a lost process
#: A process whose heartbeat has not moved for this long is lost (JAX's own, longer timeout
#: would end the others with an abort that names no process).
LOST_AFTER_SECONDS = float(os.environ.get("TPURUN_LOST_AFTER_SECONDS", "45"))  # tests lower it
_BEAT_SECONDS = 3.0


class Watchdog:
    """A thread that tells, within about a minute, that another process died (SIGKILL, OOM, a VM
    gone), names it, and ends this one: the others would otherwise wait in a collective.

    Each process bumps a counter in the coordinator's key-value store every few seconds and reads
    the others'; a counter that has not moved for ``LOST_AFTER_SECONDS`` of local time (no clocks
    are compared), or a coordinator that stops answering, is a lost process.
    """

    def __init__(self, cluster: Cluster, on_lost, lost_after: float = LOST_AFTER_SECONDS):
        import threading

        self.cluster, self.on_lost, self.lost_after = cluster, on_lost, lost_after
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tpurun-watchdog", daemon=True)

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _run(self) -> None:
        import time

        from jax._src import distributed

        client = distributed.global_state.client
        me, n = self.cluster.process_id, self.cluster.num_processes
        seen: dict[int, tuple[str, float]] = {}
        beat = 0
        while not self._stop.wait(_BEAT_SECONDS):
            now = time.monotonic()
            try:
                beat += 1
                client.key_value_set(f"tpurun/beat/{me}", str(beat), allow_overwrite=True)
                for other in range(n):
                    if other == me:
                        continue
                    try:
                        value = client.key_value_try_get(f"tpurun/beat/{other}")
                    except Exception:  # not written yet: counts as unchanged
                        value = ""
                    if seen.get(other, (None,))[0] != value:
                        seen[other] = (value, now)
                    elif now - seen[other][1] > self.lost_after:
                        self._lost(f"process {other} of {n} stopped answering "
                                   f"{now - seen[other][1]:.0f} s ago")  # fmt: skip
                        return
            except Exception as exc:  # the coordinator (process 0) is gone
                if self._stop.is_set():
                    return
                self._lost(f"the coordinator (process 0) stopped answering ({type(exc).__name__})")
                return

    def _lost(self, what: str) -> None:
        self.on_lost(
            f"{what}: killed, out of memory, or its machine stopped. This process stops too, "
            "since the others cannot go on without it. Rerun the same command on every host to "
            "resume from the last checkpoint."
        )


def sync_processes(name: str) -> None:
    """Wait until every process reaches this point."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
