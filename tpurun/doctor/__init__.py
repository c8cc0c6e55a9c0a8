"""``tpurun doctor``: can this machine train this config, and what should be fixed?

Pure data: :func:`run_checks` returns :class:`Check` records and prints nothing; ``cli.py`` renders
them (a table, plain lines, or :func:`report` as JSON) and exits with :func:`exit_code`.

Anything that could block or grab an accelerator (JAX/TF device discovery, the TPU, GCS) runs in a
child process with a timeout, so doctor never holds the libtpu lock and never hangs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tpurun._version import __version__

STATUSES = ("ok", "warn", "fail", "skip")
REPORT_VERSION = 1


@dataclass
class Check:
    """One finding.

    Attributes:
        name: a short stable id (``platform``, ``libtpu_lock``, ``data.train``, ...).
        status: ``ok``, ``warn``, ``fail`` or ``skip``.
        finding: one line saying what was found.
        fix: one line saying what to do; None when the check is ok.
        data: the details, as JSON-ready values.
        seconds: how long the check took.
    """

    name: str
    status: str
    finding: str
    fix: str | None = None
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Check.status: {self.status!r}; expected one of {STATUSES}")


def timed(name: str, fn: Callable[[], Check | list[Check]]) -> list[Check]:
    """Run one check, timing it; an unexpected exception becomes a ``fail``, not a crash."""
    started = time.monotonic()
    try:
        result = fn()
    except Exception as exc:  # a doctor that crashes on a broken machine helps nobody
        result = Check(
            name, "fail", f"the check itself failed: {type(exc).__name__}: {exc}",
            "report this as a tpurun bug, with the output of `tpurun doctor --json`",
        )  # fmt: skip
    checks = result if isinstance(result, list) else [result]
    elapsed = round(time.monotonic() - started, 3)
    for check in checks:
        check.seconds = check.seconds or elapsed
    return checks


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
    from tpurun.doctor import machine as mc
    from tpurun.doctor import probes
    from tpurun.runtime.machine import probe

    cfg = None
    if config is not None:
        from tpurun.config import Config, load_config

        cfg = config if isinstance(config, Config) else load_config(config, list(overrides))

    env = dict(os.environ if env is None else env)
    machine = probe(env, dev_root)
    uses_gcs = None if cfg is None else _uses_gcs(cfg)
    # Slow children first, so they overlap with the quick checks.
    gcs_probe = probes.start_gcs_probe(gcs_timeout, cfg) if uses_gcs is not False else None
    devices = probes.device_counts(machine, probe_timeout)

    checks: list[Check] = []
    checks += timed("platform", lambda: mc.check_platform(machine, env))
    checks += timed("versions", lambda: mc.check_versions(machine))
    checks += timed("tpu", lambda: mc.check_tpu(machine, devices))
    checks += timed("libtpu_lock", lambda: mc.check_lock(lock_path))
    checks += timed("devices", lambda: mc.check_devices(devices))
    choice_holder: list = []
    checks += timed("choice", lambda: probes.check_choice(cfg, machine, choice_holder))
    checks += timed("health", lambda: probes.check_health(choice_holder, probe_timeout))
    checks += timed("hosts", lambda: mc.check_hosts(cfg, env))
    checks += timed("gcs.credentials", lambda: mc.check_gcs_credentials(machine, env, uses_gcs))
    if gcs_probe is None:
        checks.append(Check("gcs.reachable", "skip", "not needed: no gs:// path in this config"))
    else:
        checks += timed("gcs.reachable", lambda: gcs_probe.check(uses_gcs))
    if cfg is not None:
        from tpurun.doctor import config_checks

        checks += config_checks.run(cfg, machine, choice_holder, devices, with_model)
    return checks


def _uses_gcs(cfg: Any) -> bool | None:
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


def exit_code(checks: Sequence[Check]) -> int:
    """0 when nothing fails, 1 when a check fails; warnings do not fail."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def report(checks: Sequence[Check]) -> dict[str, Any]:
    """The checks as JSON-ready data (``tpurun doctor --json``)."""
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    return {
        "version": REPORT_VERSION,
        "tpurun_version": __version__,
        "status": "fail" if counts["fail"] else ("warn" if counts["warn"] else "ok"),
        "exit_code": exit_code(checks),
        "counts": counts,
        "seconds": round(sum(c.seconds for c in checks), 3),
        "checks": [asdict(c) for c in checks],
    }


__all__ = ["Check", "REPORT_VERSION", "exit_code", "report", "run_checks"]
