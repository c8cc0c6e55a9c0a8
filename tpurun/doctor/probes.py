"""The device counts, the choice ``train`` would make, and a health computation on it.

The counts and the computation run in child processes with a timeout (the scripts
:mod:`tpurun.doctor.scripts.devices` and :mod:`tpurun.doctor.scripts.health`; see
:mod:`tpurun.doctor.child` for why); the choice is :func:`tpurun.runtime.choice.choose`, the very
call ``train`` makes. The GCS probe is :mod:`tpurun.doctor.gcs`.
"""

from __future__ import annotations

import subprocess
from dataclasses import asdict
from typing import Any

from tpurun.config import RuntimeConfig
from tpurun.doctor.check import Check
from tpurun.doctor.child import Child, child_env
from tpurun.errors import TpurunError
from tpurun.runtime.choice import choose
from tpurun.runtime.machine import Machine


# --------------------------------------------------------------------------------------- devices
def _nvidia_smi(timeout: float = 5.0) -> list[dict[str, str]]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, _, memory = line.partition(",")
        gpus.append({"name": name.strip(), "memory": memory.strip()})
    return gpus


def device_counts(m: Machine, timeout: float) -> dict[str, Any]:
    """Devices per backend, each counted in a child process (which exits, freeing the TPU)."""
    # A clean child: no forced CPU platform or simulated devices from this process.
    env = child_env(drop=("JAX_PLATFORMS", "XLA_FLAGS"))
    out: dict[str, Any] = {}
    jax_child = tf_child = None
    if m.jax:
        jax_child = Child.script("devices", {"backend": "jax"}, timeout=timeout, env=env)
    if jax_child and m.tpu_present:
        out["jax"] = jax_child.result()  # one child at a time on the TPU: libtpu's lock
    if m.tensorflow:
        tf_child = Child.script("devices", {"backend": "tensorflow"}, timeout=timeout, env=env)
    if jax_child and "jax" not in out:
        out["jax"] = jax_child.result()
    if tf_child:
        out["tensorflow"] = tf_child.result()
    if m.gpu_count:
        out["gpus"] = _nvidia_smi()
    return out


# ---------------------------------------------------------------------------------------- choice
def check_choice(cfg: Any, m: Machine, holder: list) -> Check:
    """What ``tpurun train`` would choose: :func:`tpurun.runtime.choice.choose`, the very same call."""
    runtime_cfg = cfg.runtime if cfg is not None else RuntimeConfig()
    spe = cfg.train.steps_per_execution if cfg is not None else "auto"
    try:
        choice = choose(runtime_cfg, spe, m)
    except TpurunError as exc:
        return Check(
            "choice",
            "fail",
            f"train cannot run here: {exc.message}",
            "change the runtime section as the message says",
        )
    holder.append(choice)
    data = asdict(choice)
    status, fix = "ok", None
    if choice.warnings:
        status, fix = "warn", choice.warnings[0]
    return Check("choice", status, choice.summary, fix, data)


# ---------------------------------------------------------------------------------------- health
def _health_child(choice: Any, timeout: float) -> Child | None:
    """The health script started for the choice, in an environment set for it (None: not probed)."""
    replicas = choice.replicas or 0  # 0: every TPU core
    if choice.backend == "jax":
        env = {"XLA_FLAGS": ""}
        if choice.accelerator == "cpu":
            env = {
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={max(1, replicas)}",
            }
        asked = {"backend": "jax", "replicas": replicas}
        return Child.script("health", asked, timeout=timeout, env=child_env(env))
    if choice.accelerator == "tpu":
        return None
    asked = {"backend": "tensorflow", "replicas": max(1, replicas),
             "cpu_only": choice.accelerator == "cpu"}  # fmt: skip
    return Child.script("health", asked, timeout=timeout, env=child_env())


def check_health(holder: list, timeout: float) -> Check:
    """A small timed computation and an all-reduce over the chosen replicas, in a child."""
    if not holder:
        return Check("health", "skip", "no runtime was chosen (see the choice check)")
    choice = holder[0]
    child = _health_child(choice, timeout)
    if child is None:
        return Check(
            "health",
            "skip",
            "TensorFlow on a TPU: not probed (it would need the TPU "
            "system initialised); `tpurun train` connects to it",
            None,
        )
    result = child.result()
    if result.get("error"):
        status = "warn" if result.get("timed_out") else "fail"
        return Check(
            "health",
            status,
            f"the all-reduce probe failed: {result['error']}",
            "run it again; if it persists, see the devices and tpu checks",
            result,
        )
    if not result["agree"]:
        return Check(
            "health",
            "fail",
            f"the all-reduce over {result['replicas']} replica(s) "
            f"disagrees: {result['values']} (expected {result['expected']:g})",
            "the devices compute different numbers: restart the runtime",
            result,
        )
    return Check(
        "health",
        "ok",
        f"matmul + all-reduce over {result['replicas']} {result['platform'].upper()} replica(s): "
        f"numbers agree; step {result['step_seconds'] * 1000:.1f} ms "
        f"(child {result['seconds']:.1f} s with imports)",
        None,
        result,
    )


__all__ = ["check_choice", "check_health", "device_counts"]
