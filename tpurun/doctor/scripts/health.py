"""A small timed computation and an all-reduce over the chosen replicas (doctor's ``health`` check).

Run by :func:`tpurun.doctor.probes.check_health` as ``python -m tpurun.doctor.scripts.health
'{"backend": "jax", "replicas": 4}'`` (``"replicas": 0``: every local device), or with
``"backend": "tensorflow"`` and ``"cpu_only"``. The parent sets the child's environment for the
choice first (for JAX on the CPU: JAX_PLATFORMS=cpu and XLA_FLAGS with the device count), since JAX
fixes its devices when it starts; on a TPU the child takes the lock and gives it back as it exits.

Each replica reduces its own matrix product to one number, and the all-reduce sums them: every
replica must end with the same sum, and that sum must be the one computed directly.

Answer: ``{"replicas", "values" (the first 8), "expected", "agree", "step_seconds" (one step, after
a first one that compiles), "platform", "total_seconds" (with the imports)}``.
"""

from __future__ import annotations

import time
from typing import Any

from tpurun.doctor.child import payload, reply

SIZE = 256  # each replica's matrix is SIZE x SIZE
SHOWN = 8  # values kept in the answer


def agree(values: list[float], expected: float, rel: float = 1e-3) -> bool:
    """Every replica got the same sum, and it is the expected one (to ``rel``)."""
    return (
        bool(values)
        and all(v == values[0] for v in values)
        and (abs(values[0] - expected) <= rel * abs(expected))
    )


def answer(
    values: list[float], expected: float, step_seconds: float, platform: str, started: float
) -> dict[str, Any]:
    return {
        "replicas": len(values),
        "values": values[:SHOWN],
        "expected": expected,
        "agree": agree(values, expected),
        "step_seconds": step_seconds,
        "platform": platform,
        "total_seconds": time.perf_counter() - started,
    }


def tf_expected(replicas: int) -> float:
    """The all-reduced sum of TensorFlow's step: replica i's matrix is filled with (i + 1) / SIZE,
    so the sum of its square's entries is SIZE^3 ((i + 1) / SIZE)^2."""
    return float(sum(SIZE**3 * ((i + 1) / SIZE) ** 2 for i in range(replicas)))


def jax_health(replicas: int, started: float) -> dict[str, Any]:
    from tpurun import frameworks

    # The parent fixed this process's environment before it started: it is set up for JAX.
    frameworks.activated("jax")
    jax, jnp = frameworks.jax(), frameworks.jax("numpy")
    devices = jax.local_devices()[:replicas] if replicas else jax.local_devices()
    n = len(devices)
    x = jnp.arange(n * SIZE * SIZE, dtype=jnp.float32).reshape(n, SIZE, SIZE) / (SIZE * SIZE * n)
    step = jax.pmap(lambda a: jax.lax.psum(jnp.sum(a @ a.T), "i"), axis_name="i", devices=devices)
    step(x).block_until_ready()  # compiles
    t0 = time.perf_counter()
    out = step(x).block_until_ready()
    seconds = time.perf_counter() - t0
    expected = float(sum(jnp.sum(x[i] @ x[i].T) for i in range(n)))
    return answer([float(v) for v in out], expected, seconds, devices[0].platform, started)


def tf_health(replicas: int, cpu_only: bool, started: float) -> dict[str, Any]:
    from tpurun import frameworks

    tf = frameworks.tensorflow()
    cpu = tf.config.list_physical_devices("CPU")[0]
    if replicas > 1:
        config = [tf.config.LogicalDeviceConfiguration()] * replicas
        tf.config.set_logical_device_configuration(cpu, config)
    if cpu_only:
        tf.config.set_visible_devices([], "GPU")
    kind = "CPU" if cpu_only else "GPU"
    names = [d.name for d in tf.config.list_logical_devices(kind)][:replicas]
    strategy = tf.distribute.MirroredStrategy(devices=names)

    def step():
        ctx = tf.distribute.get_replica_context()
        fill = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32) / SIZE
        a = tf.fill([SIZE, SIZE], fill)
        return ctx.all_reduce("sum", tf.reduce_sum(tf.matmul(a, a)))

    run = tf.function(lambda: strategy.run(step))
    run()  # traces
    t0 = time.perf_counter()
    out = strategy.experimental_local_results(run())
    seconds = time.perf_counter() - t0
    values = [float(v) for v in out]
    return answer(values, tf_expected(replicas), seconds, kind.lower(), started)


def main() -> None:
    started = time.perf_counter()
    asked = payload()
    replicas = int(asked.get("replicas", 0))
    if asked.get("backend", "jax") == "jax":
        reply(jax_health(replicas, started))
    else:
        reply(tf_health(max(1, replicas), bool(asked.get("cpu_only")), started))


if __name__ == "__main__":
    main()
