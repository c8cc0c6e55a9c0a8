"""What every process does together, beyond the training step: agree on a stop, check that the run
directory is shared, wait for each other. Each is a collective: every process must call it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tpurun import frameworks
from tpurun.errors import EnvironmentSetupError
from tpurun.multihost.cluster import Cluster
from tpurun.storage import fileio


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

    codes = np.array(
        [
            _REASONS.index(reason) if reason in _REASONS else int(bool(reason)),
            int(bool(save_by_clock)),
        ],
        dtype=np.int32,
    )
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


def agree_on_start(facts: Mapping[str, str], cluster: Cluster) -> None:
    """Refuse, on every process, a start the processes do not agree on.

    ``facts`` (the same names, in the same order, on every process) are what every process of one
    run must share before its first step: the config, section by section, the resume point and the
    record counts. Two processes started with different config files, or with a ``--resume`` given
    to one of them, would otherwise train out of step (or wait in a collective forever). A digest
    of each is exchanged (one small all-gather).

    Raises:
        EnvironmentSetupError: on every process, naming each fact that differs and the processes
            whose value is not process 0's, with this process's own value.
    """
    import numpy as np

    multihost_utils = frameworks.jax("experimental.multihost_utils")

    names = list(facts)
    mine = np.array([_digest(facts[name]) for name in names], dtype=np.int32)
    everyone = np.reshape(multihost_utils.process_allgather(mine), (-1, len(names)))
    differ = {}
    for j, name in enumerate(names):
        others = [i for i in range(len(everyone)) if everyone[i, j] != everyone[0, j]]
        if others:
            differ[name] = f"{name} (process {', '.join(map(str, others))} against process 0)"
    if not differ:
        return
    shown = "; ".join(f"{name}: {_short(facts[name])}" for name in differ)
    raise EnvironmentSetupError(
        f"the {cluster.num_processes} processes of this run disagree before the first step: "
        f"{'; '.join(differ.values())}. On process {cluster.process_id}: {shown}. Every process must run "
        "the same command with the same config file, --set options and --resume, and read the "
        "same data: start them again alike (tpurun launch -n N train CONFIG does)."
    )


#: runtime keys that say how a process joins the cluster: set in the config on one process and by
#: KERAS_DISTRIBUTION_* variables on another, they describe the same cluster.
_CLUSTER_KEYS = ("process_id", "num_processes", "coordinator")


def start_facts(effective: Mapping[str, Any], point: Any) -> dict[str, str]:
    """What :func:`agree_on_start` compares: each section of the effective config (less how the
    process joined the cluster), the resume point (a ResumePoint, or None), and the record counts."""
    resume_point = (
        f"{point.source}, {point.where()}" if point is not None else "none (a fresh start)"
    )
    facts = {}
    for key, value in effective.items():
        if key == "runtime":  # how each process found the cluster may differ (keys, variables)
            value = {k: v for k, v in value.items() if k not in _CLUSTER_KEYS}
        if key != "derived":
            facts[f"the config's {key}"] = json.dumps(value, sort_keys=True, default=str)
    derived = effective.get("derived") or {}
    counts = {k: derived.get(k) for k in ("train_files", "train_records", "validation_files",
                                          "validation_records")}  # fmt: skip
    return {**facts, "the resume point": resume_point, "the record counts": json.dumps(counts)}


def _digest(text: str) -> int:
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") >> 1  # an int32


def _short(text: str) -> str:
    return text if len(text) <= 120 else text[:117] + "..."


def sync_processes(name: str) -> None:
    """Wait until every process reaches this point."""
    multihost_utils = frameworks.jax("experimental.multihost_utils")

    multihost_utils.sync_global_devices(name)
