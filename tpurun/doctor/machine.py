"""Checks of the machine itself: platform, versions, TPU, devices, GCS credentials, hosts (the
libtpu lock is :mod:`tpurun.doctor.libtpu_lock`).

These read files, environment variables and installed distributions; nothing here imports a
framework or touches an accelerator (device discovery runs in children, see ``probes``).
"""

from __future__ import annotations

import os
import platform as platform_lib
import socket
from collections.abc import Mapping
from typing import Any

from tpurun import frameworks
from tpurun._version import __version__
from tpurun.config import RuntimeConfig
from tpurun.doctor.check import Check
from tpurun.errors import TpurunError
from tpurun.multihost.cluster import cluster
from tpurun.runtime.machine import Machine, installed_version

JAX_TPU_INSTALL = "pip install -U 'jax[tpu]'"


# ------------------------------------------------------------------------------------- platform
def detect_platform(m: Machine, env: Mapping[str, str]) -> tuple[str, str]:
    """The hosting platform and the signal it was recognised by."""
    kaggle = "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env
    colab = any(k.startswith("COLAB_") for k in env)
    host = "Kaggle" if kaggle else "Colab" if colab else None
    if m.tpu_vm:
        signal = (
            f"device files {', '.join(m.tpu_device_files[:3])}"
            if m.tpu_device_files
            else "ISTPUVM / COLAB_TPU_1VM / TPU_PROCESS_ADDRESSES=local"
        )
        return (f"{host} TPU VM" if host else "Cloud TPU VM"), signal
    if m.tpu_node:
        return (f"{host} " if host else "") + "legacy TPU node", f"TPU address {m.tpu_node}"
    kind = "GPU machine" if m.gpu_count else "CPU machine"
    signal = (
        f"{m.gpu_count} /dev/nvidia* device(s)" if m.gpu_count else "no TPU or GPU device files"
    )
    if host:
        return f"{host} {kind}", signal + f"; {'KAGGLE_*' if kaggle else 'COLAB_*'} variables"
    return kind, signal


def check_platform(m: Machine, env: Mapping[str, str]) -> Check:
    name, signal = detect_platform(m, env)
    data = {
        "platform": name,
        "signal": signal,
        "tpu_vm": m.tpu_vm,
        "tpu_node": m.tpu_node,
        "tpu_device_files": list(m.tpu_device_files),
        "gpu_count": m.gpu_count,
        "os": platform_lib.platform(),
    }
    if m.tpu_node and not m.tpu_vm:
        return Check(
            "platform",
            "warn",
            f"{name} ({signal}): the TPU is on the network",
            "TPU nodes are retired on Kaggle and Colab; they read data only from gs://. "
            "Prefer a TPU VM runtime.",
            data,
        )
    return Check("platform", "ok", f"{name} ({signal})", None, data)


# ------------------------------------------------------------------------------------- versions
def check_versions(m: Machine) -> Check:
    versions = {
        "python": platform_lib.python_version(),
        "tensorflow": m.tensorflow,
        "tensorflow_build": m.tensorflow_build,
        "keras": m.keras,
        "jax": m.jax,
        "jaxlib": installed_version("jaxlib"),
        "libtpu": installed_version("libtpu") or installed_version("libtpu-nightly"),
        "tpurun": __version__,
    }
    shown = ", ".join(
        f"{k} {v}" for k, v in versions.items() if v and k not in ("tensorflow_build",)
    ).replace("tensorflow ", f"{m.tensorflow_build or 'tensorflow'} ", 1)
    problems: list[tuple[str, str, str]] = []  # (status, problem, fix)
    if m.keras is None:
        problems.append(("fail", "Keras is not installed", "pip install 'keras>=3'"))
    elif int(m.keras.split(".")[0]) < 3:
        problems.append(("fail", f"Keras {m.keras} is Keras 2", "pip install -U 'keras>=3'"))
    if m.jax is None and m.tensorflow is None:
        problems.append(("fail", "no Keras backend (JAX or TensorFlow)", "pip install jax"))
    if m.jax and versions["jaxlib"] and versions["jaxlib"] != m.jax:
        problems.append(
            (
                "warn",
                f"jax {m.jax} and jaxlib {versions['jaxlib']} differ",
                f"pip install -U 'jax=={m.jax}' 'jaxlib=={m.jax}'",
            )
        )
    if m.tpu_present and not m.jax_tpu and not m.tf_can_drive_tpu:
        problems.append(
            (
                "fail",
                "a TPU is attached but neither libtpu (for JAX) nor tensorflow-tpu is installed",
                JAX_TPU_INSTALL,
            )
        )
    if m.tpu_present and m.jax_tpu and m.tensorflow_build == "tensorflow-tpu":
        problems.append(
            (
                "warn",
                "tensorflow-tpu beside JAX with libtpu: TF may hold the TPU JAX needs",
                "pip uninstall -y tensorflow-tpu && pip install tensorflow-cpu",
            )
        )
    data = {"versions": versions, "problems": [p for _, p, _ in problems]}
    if not problems:
        return Check("versions", "ok", shown, None, data)
    worst = "fail" if any(s == "fail" for s, _, _ in problems) else "warn"
    first = next(p for p in problems if p[0] == worst)
    finding = "; ".join(p for _, p, _ in problems) + f" ({shown})"
    return Check("versions", worst, finding, first[2], data)


# ------------------------------------------------------------------------------------------- tpu
def check_matplotlib_backend(env: Mapping[str, str]) -> Check:
    """The ``MPLBACKEND`` this process inherited, and what tpurun does with it: one matplotlib
    would refuse (a notebook kernel's, from another environment) is replaced by agg in tpurun's
    own process, since importing TensorFlow imports matplotlib."""
    inherited = env.get("MPLBACKEND", "")
    data = {"inherited": inherited or None, "used": "agg"}
    if not inherited:
        return Check("matplotlib", "ok", "MPLBACKEND not set: curves are drawn with agg", data=data)
    if frameworks.usable_matplotlib_backend(dict(env)) is None:
        data["used"] = inherited
        return Check("matplotlib", "ok", f"MPLBACKEND={inherited}: usable here", data=data)
    kernel = " (a notebook kernel's)" if "backend_inline" in inherited else ""
    return Check(
        "matplotlib",
        "ok",
        f"MPLBACKEND={inherited}{kernel} cannot be loaded in this environment; tpurun draws no "
        "window, so it uses agg in its own processes instead",
        data=data,
    )


def check_tpu(m: Machine, devices: dict[str, Any]) -> Check:
    data: dict[str, Any] = {
        "present": m.tpu_present,
        "device_files": list(m.tpu_device_files),
        "tpu_node": m.tpu_node,
        "jax_can_drive": m.jax is not None and m.jax_tpu,
        "tf_can_drive": m.tf_can_drive_tpu,
    }
    if not m.tpu_present:
        return Check(
            "tpu", "skip", "no TPU: no /dev/accel* or /dev/vfio/* device, no TPU_NAME", None, data
        )
    jax_result = devices.get("jax", {})
    data["jax_probe"] = jax_result
    drivers = [n for n, ok in (("JAX", data["jax_can_drive"]), ("TensorFlow", m.tf_can_drive_tpu))
               if ok]  # fmt: skip
    if not drivers:
        return Check(
            "tpu",
            "fail",
            "a TPU is attached, but JAX has no libtpu and TensorFlow "
            f"({m.tensorflow_build or 'not installed'}) has no TPU support",
            f"{JAX_TPU_INSTALL} (TensorFlow: tensorflow-tpu <= 2.20 is the newest TPU build)",
            data,
        )
    if data["jax_can_drive"]:
        tpu_count = jax_result.get("platforms", {}).get("tpu")
        if tpu_count:
            return Check(
                "tpu",
                "ok",
                f"JAX drives {tpu_count} TPU core(s)"
                + (" (TensorFlow can too)" if m.tf_can_drive_tpu else ""),
                None,
                data,
            )
        error = jax_result.get("error") or "JAX found no TPU device"
        if "in use" in error or "lockfile" in error:
            fix = "another process holds the TPU: see the libtpu_lock check"
        else:
            fix = f"{JAX_TPU_INSTALL}, then restart the runtime"
        return Check("tpu", "fail", f"JAX cannot use the TPU: {error}", fix, data)
    return Check(
        "tpu",
        "ok",
        "TensorFlow can drive the TPU (not probed; JAX has no libtpu)",
        None,
        data,
    )


# --------------------------------------------------------------------------------------- devices
def check_devices(devices: dict[str, Any]) -> Check:
    parts, problems = [], []
    for backend in ("jax", "tensorflow"):
        result = devices.get(backend)
        if result is None:
            continue
        if result.get("error"):
            problems.append(f"{backend}: {result['error']}")
            continue
        counts = result.get("platforms", {})
        parts.append(f"{backend}: " + ", ".join(f"{n} {p.upper()}" for p, n in counts.items()))
    gpus = devices.get("gpus") or []
    if gpus:
        parts.append("GPUs: " + ", ".join(f"{g['name']} ({g['memory']})" for g in gpus))
    data = dict(devices)
    spent = [r.get("seconds", 0.0) for r in devices.values() if isinstance(r, dict)]
    if problems:
        status = "fail" if not parts else "warn"
        return Check(
            "devices", status, "; ".join(parts + problems), "see the versions and tpu checks", data
        )
    if not parts:
        return Check("devices", "skip", "no backend installed to count devices with", None, data)
    return Check("devices", "ok", "; ".join(parts), None, data, max(spent, default=0.0))


# ----------------------------------------------------------------------------------- credentials
def gcs_credentials(m: Machine, env: Mapping[str, str]) -> tuple[str | None, str]:
    """Where Google credentials would come from (a path or a source; never the contents)."""
    if env.get("GOOGLE_AUTH_TOKEN_FOR_TESTING"):  # TF's GCS client sends it as it is
        return "GOOGLE_AUTH_TOKEN_FOR_TESTING", "a fixed access token (for tests and emulators)"
    path = env.get("GOOGLE_APPLICATION_CREDENTIALS")
    if path:
        if os.path.isfile(path):
            return "GOOGLE_APPLICATION_CREDENTIALS", path
        return None, f"GOOGLE_APPLICATION_CREDENTIALS={path} names no file"
    home = env.get("HOME") or os.path.expanduser("~")
    adc = os.path.join(
        env.get("CLOUDSDK_CONFIG") or os.path.join(home, ".config", "gcloud"),
        "application_default_credentials.json",
    )
    if os.path.isfile(adc):
        return "gcloud application-default login", adc
    if (
        m.tpu_vm
        and "KAGGLE_KERNEL_RUN_TYPE" not in env
        and not any(k.startswith("COLAB_") for k in env)
    ):
        return "the TPU VM's service account (metadata server)", "metadata.google.internal"
    if "KAGGLE_KERNEL_RUN_TYPE" in env:
        return None, (
            "Kaggle: public data works as is; private buckets need the Google Cloud SDK add-on or "
            "UserSecretsClient credentials"
        )
    if any(k.startswith("COLAB_") for k in env):
        return None, "Colab: run google.colab.auth.authenticate_user() for private buckets"
    return None, "no GOOGLE_APPLICATION_CREDENTIALS, no gcloud application-default credentials"


def check_gcs_credentials(m: Machine, env: Mapping[str, str], uses_gcs: bool | None) -> Check:
    source, where = gcs_credentials(m, env)
    data = {"source": source, "where": where, "config_uses_gcs": uses_gcs}
    if source:
        return Check("gcs.credentials", "ok", f"found: {source} ({where})", None, data)
    if uses_gcs:
        return Check(
            "gcs.credentials",
            "warn",
            f"none found: {where}; only public buckets can be read",
            "gcloud auth application-default login, or set GOOGLE_APPLICATION_CREDENTIALS",
            data,
        )
    return Check("gcs.credentials", "ok", f"none found ({where}); public buckets only", None, data)


def check_hosts(cfg: Any, env: Mapping[str, str], timeout: float = 3.0) -> Check:
    """How many processes train together, which one this is, and whether the coordinator answers
    (a TCP connect, so it never hangs)."""
    try:
        hosts = cluster(cfg.runtime if cfg is not None else RuntimeConfig(), env)
    except TpurunError as exc:
        return Check("hosts", "fail", exc.message, "fix the runtime keys or KERAS_DISTRIBUTION_*")
    data = {"num_processes": hosts.num_processes, "process_id": hosts.process_id,
            "coordinator": hosts.coordinator, "source": hosts.source}  # fmt: skip
    if not hosts.multi:
        return Check(
            "hosts",
            "ok",
            "one process (no runtime.num_processes, KERAS_DISTRIBUTION_*, pod or SLURM variables)",
            None,
            data,
        )
    finding = f"process {hosts.process_id} of {hosts.num_processes} ({hosts.source})"
    if hosts.coordinator is None:
        return Check("hosts", "ok", f"{finding}; JAX finds the coordinator itself", None, data)
    host, _, port = hosts.coordinator.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except (OSError, ValueError) as exc:
        if hosts.chief:  # process 0 opens the port itself when it starts
            return Check(
                "hosts", "ok", f"{finding}; this process will serve {hosts.coordinator}", None, data
            )
        return Check(
            "hosts",
            "warn",
            f"{finding}; the coordinator {hosts.coordinator} does not answer ({exc})",
            "start process 0 (it opens the port), or check the address "
            "and that the port is open between the hosts",
            data,
        )
    data["coordinator_reachable"] = True
    return Check(
        "hosts", "ok", f"{finding}; the coordinator {hosts.coordinator} answers", None, data
    )
