"""What every process does together, beyond the training step: agree on a stop, check that the run
directory is shared, wait for each other. Each is a collective: every process must call it."""

from __future__ import annotations

from tpurun import frameworks
from tpurun.errors import EnvironmentSetupError
from tpurun.multihost.cluster import Cluster


def lost_peer(exc: BaseException) -> bool:
    """Whether a collective failed because another process went away (gloo on CPUs, the
    coordination service elsewhere)."""
    text = str(exc)
    return type(exc).__name__ == "JaxRuntimeError" and any(
        s in text
        for s in ("Connection reset", "Connection refused", "heartbeat", "Barrier", "closed")
    )


_REASONS = ("", "SIGTERM", "SIGINT", "train.time_limit")


def agree_on_stop(reason: str | None, save_by_clock: bool = False) -> tuple[str | None, bool]:
    """The stop every process takes, and whether all save now, given this process's stop reason
    (None: none) and whether its own clock says an ``every_minutes`` save is due.

    The last step of :meth:`tpurun.training.signals.Stop.agreed`. A signal or the time limit can
    reach any one process (a preemption notice, a Ctrl-C on one host), and ``every_minutes`` saves
    follow each process's own clock; but a save is a collective, and a process that stopped alone
    would leave the others waiting in one forever. So at every execution's end all processes
    exchange what they were asked, and all stop (or save) if any was. Costs one small all-gather
    per execution (measured in benchmarks/multi_process.py).
    """
    import numpy as np

    multihost_utils = frameworks.jax("experimental.multihost_utils")

    codes = np.array([_REASONS.index(reason) if reason in _REASONS else int(bool(reason)),
                      int(bool(save_by_clock))], dtype=np.int32)  # fmt: skip
    agreed = np.max(np.reshape(multihost_utils.process_allgather(codes), (-1, 2)), axis=0)
    return (_REASONS[int(agreed[0])] or None), bool(agreed[1])


def check_shared_folder(folder: str, cluster: Cluster) -> None:
    """Refuse a run directory that not every process can see: only process 0 writes it, and every
    process must read the same resume point. Process 0 writes a token into ``folder``; all check
    they read it back. Passes on one machine (`tpurun launch`), a shared filesystem or ``gs://``.

    Raises:
        EnvironmentSetupError: on every process, when any process cannot see the token.
    """
    import secrets

    import numpy as np

    multihost_utils = frameworks.jax("experimental.multihost_utils")

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


def sync_processes(name: str) -> None:
    """Wait until every process reaches this point."""
    multihost_utils = frameworks.jax("experimental.multihost_utils")

    multihost_utils.sync_global_devices(name)
