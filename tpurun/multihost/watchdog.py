"""The watchdog: a thread that notices another process is gone and ends this one, naming it."""

from __future__ import annotations

import os

from tpurun import frameworks
from tpurun.multihost.cluster import Cluster

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

        distributed = frameworks.jax("_src.distributed")

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
                        self._lost(
                            f"process {other} of {n} stopped answering "
                            f"{now - seen[other][1]:.0f} s ago"
                        )
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
