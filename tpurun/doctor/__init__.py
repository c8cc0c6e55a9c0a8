"""``tpurun doctor``: can this machine train this config, and what should be fixed?

Pure data: :func:`run_checks` returns :class:`Check` records and prints nothing; ``tpurun doctor``
renders them (a table, plain lines, or :func:`report` as JSON) and exits with :func:`exit_code`.

Anything that could block or grab an accelerator (JAX/TF device discovery, the TPU, GCS) runs in a
child process with a timeout, so doctor never holds the libtpu lock and never hangs.

The modules: :mod:`.check` (a finding, the report), :mod:`.machine` (the machine's own checks),
:mod:`.libtpu_lock` (who holds the TPU), :mod:`.probes` (devices, the choice, health), :mod:`.gcs`
(the storage probe), :mod:`.config_checks`, :mod:`.model_check`, :mod:`.preset_check` and
:mod:`.memory` (a config on this machine), :mod:`.child` (running a probe in a child process) and
:mod:`.scripts` (the probes that run there). This package imports only :mod:`.check` when it is
imported, so every child's start stays light; :func:`run_checks` imports the rest when it runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from tpurun.doctor.check import REPORT_VERSION, STATUSES, Check, exit_code, report, timed


def run_checks(
    config: Any = None,
    *,
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    dev_root: str = "/dev",
    lock_path: str = "/tmp/libtpu_lockfile",
    gcs_timeout: float = 5.0,
    with_model: bool = True,
    probe_timeout: float = 60.0,
) -> list[Check]:
    """Check this machine (and a config, if given) for training with tpurun.

    Args:
        config: None, a loaded ``Config``, a YAML path or a config dict.
        overrides: ``--set`` strings, applied when ``config`` is a path or dict.
        env: environment variables to read the machine's signals from (default ``os.environ``).
        dev_root: where device files are looked for (tests pass a fake folder).
        lock_path: the libtpu lock file.
        gcs_timeout: seconds the GCS reachability probe may take, in total.
        with_model: build the model and run one training step (config checks only).
        probe_timeout: seconds each device or health child process may take.

    Returns:
        The checks, in a fixed order.

    Raises:
        ConfigError: the config does not validate (the same error ``train`` raises).
    """
    # lazy: each probe's child process imports this package (through doctor.child); the checks,
    # the config and what they import would add their imports to every child's start.
    from tpurun.config import Config, load_config
    from tpurun.doctor import config_checks, gcs, libtpu_lock, probes
    from tpurun.doctor import machine as mc
    from tpurun.runtime.machine import probe

    cfg = None
    if config is not None:
        cfg = config if isinstance(config, Config) else load_config(config, list(overrides))

    env = dict(os.environ if env is None else env)
    machine = probe(env, dev_root)
    uses_gcs = None if cfg is None else config_uses_gcs(cfg)
    # Slow children first, so they overlap with the quick checks.
    if cfg is None and not machine.tpu_present:
        uses_gcs = False  # nothing asks for a bucket: without a config, only a TPU's data does
    gcs_probe = gcs.start_gcs_probe(gcs_timeout, cfg) if uses_gcs is not False else None
    devices = probes.device_counts(machine, probe_timeout)

    checks: list[Check] = []
    checks += timed("platform", lambda: mc.check_platform(machine, env))
    checks += timed("versions", lambda: mc.check_versions(machine))
    checks += timed("matplotlib", lambda: mc.check_matplotlib_backend(env))
    checks += timed("tpu", lambda: mc.check_tpu(machine, devices))
    checks += timed("libtpu_lock", lambda: libtpu_lock.check_lock(lock_path))
    checks += timed("devices", lambda: mc.check_devices(devices))
    choice_holder: list = []
    checks += timed("choice", lambda: probes.check_choice(cfg, machine, choice_holder))
    checks += timed("health", lambda: probes.check_health(choice_holder, probe_timeout))
    checks += timed("hosts", lambda: mc.check_hosts(cfg, env))
    checks += timed("gcs.credentials", lambda: mc.check_gcs_credentials(machine, env, uses_gcs))
    if gcs_probe is None:
        why = (
            "no gs:// path in this config"
            if cfg is not None
            else (
                "no config given and no TPU; `tpurun doctor CONFIG` checks a config's gs:// paths"
            )
        )
        checks.append(Check("gcs.reachable", "skip", f"not needed: {why}"))
    else:
        checks += timed("gcs.reachable", lambda: gcs_probe.check(uses_gcs))
    if cfg is not None:
        checks += config_checks.run(cfg, machine, choice_holder, devices, with_model)
    return checks


def config_uses_gcs(cfg: Any) -> bool | None:
    """Whether the config reads or writes gs:// paths; None where the machine decides (the relative
    globs of a ``data.kaggle_dataset`` are read from gs:// on TPU nodes, from /kaggle/input on VMs)."""
    data = cfg.data
    paths = [data.train] if isinstance(data.train, str) else list(data.train)
    if data.validation:
        paths += [data.validation] if isinstance(data.validation, str) else list(data.validation)
    if any(p.startswith("gs://") for p in [*paths, data.cache or "", cfg.output.dir]):
        return True
    if data.kaggle_dataset and any("://" not in p and not p.startswith("/") for p in paths):
        return None
    return False


__all__ = [
    "REPORT_VERSION", "STATUSES", "Check", "config_uses_gcs", "exit_code", "report", "run_checks",
    "timed",
]  # fmt: skip
