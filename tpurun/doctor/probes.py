"""Probes that run in child processes with a timeout: device counts, a health computation; the GCS
probe is :mod:`tpurun.doctor.gcs` (re-exported here).

A child that initialises JAX or TensorFlow on a TPU takes the libtpu lock and gives it back when it
exits, so ``!tpurun doctor`` followed by ``!tpurun train`` works; a child that hangs is killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from tpurun.doctor import Check
from tpurun.errors import TpurunError
from tpurun.runtime.choice import choose
from tpurun.runtime.machine import Machine

MARK = "@@tpurun-doctor@@"


def _child_env(extra: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in drop and k != "KERAS_BACKEND"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra or {})
    return env


def _last_error_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1].strip()[:300]


def _code(template: str, **values: Any) -> str:
    """Fill a child's code template: ``__NAME__`` becomes ``repr(value)``."""
    code = template.replace("__MARK__", repr(MARK))
    for key, value in values.items():
        code = code.replace(f"__{key.upper()}__", repr(value))
    return code


class Child:
    """A Python child process that prints ``MARK`` + a JSON object as its answer."""

    def __init__(self, code: str, timeout: float, env: dict[str, str] | None = None):
        self.timeout = timeout
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env or _child_env(),
        )
        self._result: dict[str, Any] | None = None

    def result(self) -> dict[str, Any]:
        """The child's JSON answer, or ``{"error": ..., "timed_out": bool}``; always returns."""
        if self._result is not None:
            return self._result
        left = max(0.1, self.timeout - (time.monotonic() - self.started))
        try:
            out, err = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            self._result = {"error": f"timed out after {self.timeout:g} s", "timed_out": True}
        else:
            answer = None
            for line in out.splitlines():
                if line.startswith(MARK):
                    answer = json.loads(line[len(MARK) :])
            if answer is None:
                answer = {"error": _last_error_line(err or out) + f" (exit {self.proc.returncode})"}
            self._result = answer
        # The child's own time when it reports one: it ran alongside other checks.
        self._result.setdefault("seconds", round(time.monotonic() - self.started, 3))
        return self._result


# --------------------------------------------------------------------------------------- devices
_JAX_DEVICES = """
import json, collections
try:
    import jax
    kinds = collections.Counter(d.platform for d in jax.devices())
    cpu = len(jax.devices("cpu")) if "cpu" not in kinds else kinds["cpu"]
    answer = {"platforms": dict(kinds), "cpu": cpu, "kinds": sorted({d.device_kind for d in jax.devices()})}
except Exception as exc:
    answer = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"}
print(__MARK__ + json.dumps(answer))
"""

_TF_DEVICES = """
import json, collections
try:
    import tensorflow as tf
    devices = tf.config.list_physical_devices()
    kinds = collections.Counter(d.device_type.lower() for d in devices)
    gpus = []
    for d in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(d)
        gpus.append(details.get("device_name", d.name))
    answer = {"platforms": dict(kinds), "gpu_names": gpus}
except Exception as exc:
    answer = {"error": f"{type(exc).__name__}: {exc}"}
print(__MARK__ + json.dumps(answer))
"""


def _nvidia_smi(timeout: float = 5.0) -> list[dict[str, str]]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=timeout, check=True,
        ).stdout  # fmt: skip
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
    env = _child_env(drop=("JAX_PLATFORMS", "XLA_FLAGS"))
    out: dict[str, Any] = {}
    tpu = m.tpu_present
    jax_child = Child(_code(_JAX_DEVICES), timeout, env) if m.jax else None
    if jax_child and tpu:
        out["jax"] = jax_child.result()  # one child at a time on the TPU: libtpu's lock
    tf_child = Child(_code(_TF_DEVICES), timeout, env) if m.tensorflow else None
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
    from tpurun.config import RuntimeConfig

    runtime_cfg = cfg.runtime if cfg is not None else RuntimeConfig()
    spe = cfg.train.steps_per_execution if cfg is not None else "auto"
    try:
        choice = choose(runtime_cfg, spe, m)
    except TpurunError as exc:
        return Check("choice", "fail", f"train cannot run here: {exc.message}",
                     "change the runtime section as the message says")  # fmt: skip
    holder.append(choice)
    data = asdict(choice)
    status, fix = "ok", None
    if choice.warnings:
        status, fix = "warn", choice.warnings[0]
    replicas = "TPU cores" if choice.replicas is None else f"{choice.replicas} replica(s)"
    finding = (
        f"{choice.accelerator.upper()} via {choice.backend} ({choice.distribution}, {replicas}, "
        f"{choice.precision}): {choice.reason}"
    )
    return Check("choice", status, finding, fix, data)


_JAX_HEALTH = """
import json, time
started = time.perf_counter()
import jax, jax.numpy as jnp
devices = jax.local_devices()[:__REPLICAS__] if __REPLICAS__ else jax.local_devices()
n = len(devices)
x = jnp.arange(n * 256 * 256, dtype=jnp.float32).reshape(n, 256, 256) / (256.0 * 256.0 * n)
f = jax.pmap(lambda a: jax.lax.psum(jnp.sum(a @ a.T), "i"), axis_name="i", devices=devices)
out = f(x).block_until_ready()
t0 = time.perf_counter()
out = f(x).block_until_ready()
seconds = time.perf_counter() - t0
values = [float(v) for v in out]
expected = float(sum(jnp.sum(x[i] @ x[i].T) for i in range(n)))
agree = all(v == values[0] for v in values) and abs(values[0] - expected) <= 1e-3 * abs(expected)
print(__MARK__ + json.dumps({"replicas": n, "values": values[:8], "expected": expected,
      "agree": agree, "step_seconds": seconds, "platform": devices[0].platform,
      "total_seconds": time.perf_counter() - started}))
"""

_TF_HEALTH = """
import json, time
started = time.perf_counter()
import tensorflow as tf
n = __REPLICAS__
cpu = tf.config.list_physical_devices("CPU")[0]
if n > 1:
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
tf.config.set_visible_devices([], "GPU") if __CPU_ONLY__ else None
kind = "CPU" if __CPU_ONLY__ else "GPU"
names = [d.name for d in tf.config.list_logical_devices(kind)][:n]
strategy = tf.distribute.MirroredStrategy(devices=names)
def step():
    ctx = tf.distribute.get_replica_context()
    a = tf.fill([256, 256], tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32) / 256.0)
    return ctx.all_reduce("sum", tf.reduce_sum(tf.matmul(a, a)))
fn = tf.function(lambda: strategy.run(step))
fn()
t0 = time.perf_counter()
out = strategy.experimental_local_results(fn())
seconds = time.perf_counter() - t0
values = [float(v) for v in out]
expected = float(sum(256 * 256 * 256 * ((i + 1) / 256.0) ** 2 for i in range(n)))
agree = all(v == values[0] for v in values) and abs(values[0] - expected) <= 1e-3 * expected
print(__MARK__ + json.dumps({"replicas": len(values), "values": values[:8], "expected": expected,
      "agree": agree, "step_seconds": seconds, "platform": kind.lower(),
      "total_seconds": time.perf_counter() - started}))
"""


def check_health(holder: list, timeout: float) -> Check:
    """A small timed computation and an all-reduce over the chosen replicas, in a child."""
    if not holder:
        return Check("health", "skip", "no runtime was chosen (see the choice check)")
    choice = holder[0]
    replicas = choice.replicas or 0  # 0: every TPU core
    if choice.backend == "jax":
        env = {"XLA_FLAGS": ""}
        if choice.accelerator == "cpu":
            env = {
                "JAX_PLATFORMS": "cpu",
                "XLA_FLAGS": f"--xla_force_host_platform_device_count={max(1, replicas)}",
            }
        child = Child(_code(_JAX_HEALTH, replicas=replicas), timeout, _child_env(env))
    elif choice.accelerator == "tpu":
        return Check("health", "skip", "TensorFlow on a TPU: not probed (it would need the TPU "
                     "system initialised); `tpurun train` connects to it", None)  # fmt: skip
    else:
        code = _code(_TF_HEALTH, replicas=max(1, replicas), cpu_only=choice.accelerator == "cpu")
        child = Child(code, timeout, _child_env())
    result = child.result()
    if result.get("error"):
        status = "warn" if result.get("timed_out") else "fail"
        return Check("health", status, f"the all-reduce probe failed: {result['error']}",
                     "run it again; if it persists, see the devices and tpu checks", result)  # fmt: skip
    if not result["agree"]:
        return Check("health", "fail", f"the all-reduce over {result['replicas']} replica(s) "
                     f"disagrees: {result['values']} (expected {result['expected']:g})",
                     "the devices compute different numbers: restart the runtime", result)  # fmt: skip
    return Check(
        "health", "ok",
        f"matmul + all-reduce over {result['replicas']} {result['platform'].upper()} replica(s): "
        f"numbers agree; step {result['step_seconds'] * 1000:.1f} ms "
        f"(child {result['seconds']:.1f} s with imports)",
        None, result,
    )  # fmt: skip


from tpurun.doctor.gcs import (  # noqa: E402  (a part of the probes)
    GCS_ENDPOINT,
    GCS_PROBE_URL,
    GCS_RETRY_ENV,
    GcsProbe,
    gcs_targets,
    start_gcs_probe,
)

__all__ = [
    "GCS_ENDPOINT", "GCS_PROBE_URL", "GCS_RETRY_ENV", "Child", "GcsProbe", "check_choice",
    "check_health", "device_counts", "gcs_targets", "start_gcs_probe",
]  # fmt: skip
