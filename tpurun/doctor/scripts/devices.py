"""Count the devices JAX or TensorFlow sees (doctor's ``devices`` and ``tpu`` checks).

Run by :func:`tpurun.doctor.probes.device_counts` as ``python -m tpurun.doctor.scripts.devices
'{"backend": "jax"}'`` (or ``"tensorflow"``), in a child whose environment has none of the parent's
JAX_PLATFORMS, XLA_FLAGS or KERAS_BACKEND: it counts what the machine has, not what the parent was
set up to use. On a TPU, the JAX child takes the libtpu lock and gives it back as it exits.

Answer (JAX): ``{"platforms": {"tpu": 8}, "cpu": 1, "kinds": ["TPU v3"], "bytes_limit": ...}``; (TensorFlow):
``{"platforms": {"cpu": 1, "gpu": 1}, "gpu_names": ["Tesla T4"]}``; or ``{"error": "Type: ..."}``
when the framework cannot start.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from tpurun.doctor.child import payload, reply


def jax_summary(devices: Iterable[Any], cpu: int) -> dict[str, Any]:
    """JAX's devices (objects with ``platform`` and ``device_kind``) and its CPU device count;
    the first device's memory limit where the runtime reports one (None on a CPU)."""
    devices = list(devices)
    try:
        stats = devices[0].memory_stats() or {} if devices else {}
    except Exception:  # a plugin without memory_stats
        stats = {}
    return {
        "platforms": dict(Counter(d.platform for d in devices)),
        "cpu": cpu,
        "kinds": sorted({d.device_kind for d in devices}),
        "bytes_limit": stats.get("bytes_limit"),
    }


def tf_summary(device_types: Iterable[str], gpu_names: list[str]) -> dict[str, Any]:
    """TensorFlow's physical device types (``CPU``, ``GPU``, ``TPU``) and its GPUs' names."""
    return {"platforms": dict(Counter(t.lower() for t in device_types)), "gpu_names": gpu_names}


def jax_error(exc: BaseException) -> str:
    """``Type: message``, the message cut to its last line: JAX's backend errors end with the line
    that names the cause (``TPU is already in use by process with pid ...``)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"


def jax_devices() -> dict[str, Any]:
    from tpurun import frameworks

    # The parent fixed this process's environment before it started: it is set up for JAX.
    frameworks.activated("jax")
    try:
        jax = frameworks.jax()
        devices = jax.devices()
        # On a TPU or GPU, jax.devices() lists those only; the CPU devices are asked for apart.
        cpu = sum(d.platform == "cpu" for d in devices) or len(jax.devices("cpu"))
        return jax_summary(devices, cpu)
    except Exception as exc:
        return {"error": jax_error(exc)}


def tf_devices() -> dict[str, Any]:
    from tpurun import frameworks

    try:
        tf = frameworks.tensorflow()
        types = [d.device_type for d in tf.config.list_physical_devices()]
        gpus = []
        for device in tf.config.list_physical_devices("GPU"):
            details = tf.config.experimental.get_device_details(device)
            gpus.append(details.get("device_name", device.name))
        return tf_summary(types, gpus)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    backend = payload().get("backend", "jax")
    reply(jax_devices() if backend == "jax" else tf_devices())


if __name__ == "__main__":
    main()
