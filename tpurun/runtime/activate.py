"""Setting this process up for a :class:`~tpurun.runtime.choice.Choice`: environment variables, simulated
CPU devices, the Keras distribution or ``tf.distribute`` strategy, precision and seeds.

:func:`activate` runs before anything imports Keras or JAX (Keras fixes its backend at import, JAX
its devices at first use); :mod:`tpurun.frameworks` refuses them until it has declared the process
set up.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from tpurun import frameworks
from tpurun.errors import EnvironmentSetupError
from tpurun.runtime import compile_cache
from tpurun.runtime import mesh as meshes
from tpurun.runtime.choice import Choice


@dataclass
class ActiveRuntime:
    """The process, set up for a Choice: the replica count and the scope to build models in."""

    choice: Choice
    replicas: int
    strategy: Any = None  # tf.distribute strategy (TF backend, several devices or a TPU)
    distribution: Any = None  # keras.distribution (JAX backend)
    mesh: tuple[int, int] | None = None  # (data, model) under runtime.mesh
    devices: list | None = None  # JAX's devices of all processes, the mesh's
    placer: Any = None  # the layout (tpurun.runtime.layout.Placer), once mesh.install set it
    warnings: tuple[str, ...] = ()  # found while setting up (the compilation cache passed over)

    @property
    def sharded(self) -> bool:
        """Whether weights are split over a model axis (then checkpoints are sharded too)."""
        return self.mesh is not None and self.mesh[1] > 1

    def scope(self):
        return self.strategy.scope() if self.strategy is not None else contextlib.nullcontext()

    def release(self) -> None:
        """Clear the global Keras distribution, so a notebook kernel's later Keras work (say,
        ``predict`` on 3 samples) is not sharded over this run's devices."""
        if self.distribution is not None:
            keras = frameworks.keras()

            keras.distribution.set_distribution(None)


def _prepare_environment(choice: Choice) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", frameworks.TF_LOG_LEVEL)
    os.environ["KERAS_BACKEND"] = choice.backend
    if choice.backend == "jax" and choice.accelerator == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        local = choice.cpu_devices // choice.cluster.num_processes  # split by `tpurun launch`
        if local > 1:
            flags = [
                f
                for f in os.environ.get("XLA_FLAGS", "").split()
                if not f.startswith("--xla_force_host_platform_device_count")
            ]
            flags.append(f"--xla_force_host_platform_device_count={local}")
            os.environ["XLA_FLAGS"] = " ".join(flags)


#: Seconds without a heartbeat after which JAX's coordination service declares a process dead
#: and stops the others (its default, 100 s, is long for a notebook session); tpurun's own
#: watchdog (tpurun.multihost.cluster) names the lost process sooner.
JAX_HEARTBEAT_SECONDS = 90


#: This process joined other processes through JAX's distributed runtime (see :func:`leave`).
joined_cluster = False


def leave(code: int) -> None:
    """End a process that joined a cluster and is failing (``code`` not 0 or 3) at once.

    An ordinary exit runs JAX's shutdown, a barrier with every other process: one stuck in a
    collective waiting for this one would hold it there until a watchdog gives up, and the
    launcher would report an abort instead of this process's own error. The message is already
    written; flush it and go.
    """
    if joined_cluster and code not in (0, 3):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _join_cluster(choice: Choice) -> None:
    """Connect to the other processes through JAX's distributed runtime, before JAX starts."""
    global joined_cluster
    jax = frameworks.jax()

    hosts = choice.cluster
    if choice.accelerator == "cpu":
        # CPU devices of several processes reduce over gloo (checked with jax 0.10 on 127.0.0.1).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=hosts.coordinator,
            num_processes=hosts.num_processes,
            process_id=hosts.process_id,
            initialization_timeout=120,
            heartbeat_timeout_seconds=JAX_HEARTBEAT_SECONDS,
        )
        joined_cluster = True
    except (RuntimeError, ValueError) as exc:
        where = hosts.coordinator or "the coordinator JAX found"
        raise EnvironmentSetupError(
            f"process {hosts.process_id} of {hosts.num_processes} could not join the others at "
            f"{where}: {str(exc).strip().splitlines()[0]}. Start the same command on every host "
            "(process 0 first is not needed), check runtime.coordinator / "
            "KERAS_DISTRIBUTION_JOB_ADDRESSES and that its port is open; `tpurun doctor CONFIG` "
            "checks the coordinator."
        ) from None


def _jax_devices(choice: Choice) -> list:
    jax = frameworks.jax()

    platform = {"tpu": "tpu", "gpu": "gpu", "cpu": "cpu"}[choice.accelerator]
    try:
        devices = jax.devices(platform)
    except RuntimeError as exc:
        text = str(exc)
        if "already in use" in text or "libtpu_lockfile" in text:
            raise EnvironmentSetupError(
                f"The TPU is held by another process ({text.strip().splitlines()[-1]}). In a "
                "notebook this is usually the kernel itself: restart it without touching JAX or "
                "TensorFlow, then run !tpurun. `tpurun doctor` names the holder."
            ) from None
        raise EnvironmentSetupError(f"JAX cannot use the {platform.upper()}: {text}") from None
    if choice.cluster.multi:
        return devices  # every process's: DataParallel spans them all
    if choice.accelerator == "cpu":
        if len(devices) < choice.cpu_devices:
            raise EnvironmentSetupError(
                f"runtime.cpu_devices: {choice.cpu_devices} asked for, but JAX was already started in "
                f"this process with {len(devices)} CPU device(s). Restart the kernel, or run "
                "!tpurun train in a cell."
            )
        devices = devices[: choice.cpu_devices]
    return devices


def _tf_strategy(choice: Choice):
    tf = frameworks.tensorflow()

    if choice.accelerator == "cpu":
        tf.config.set_visible_devices([], "GPU")
        if choice.cpu_devices > 1:
            cpu = tf.config.list_physical_devices("CPU")[0]
            try:
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration()] * choice.cpu_devices
                )
            except RuntimeError:
                pass  # TF already started in this process; checked below
            logical = tf.config.list_logical_devices("CPU")
            if len(logical) < choice.cpu_devices:
                raise EnvironmentSetupError(
                    f"runtime.cpu_devices: {choice.cpu_devices} asked for, but TensorFlow was already "
                    f"started in this process with {len(logical)} CPU device(s). Restart the kernel."
                )
    if choice.distribution == "tpu_strategy":
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=choice.tpu_address)
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except (ValueError, tf.errors.OpError, RuntimeError) as exc:
            raise EnvironmentSetupError(
                f"TensorFlow cannot reach the TPU at '{choice.tpu_address}': {exc}. Check "
                "runtime.tpu, or use the JAX backend (runtime.backend: jax)."
            ) from None
        return tf.distribute.TPUStrategy(resolver)
    if choice.distribution == "mirrored":
        kind = "GPU" if choice.accelerator == "gpu" else "CPU"
        devices = [d.name for d in tf.config.list_logical_devices(kind)]
        if kind == "CPU":
            devices = devices[: choice.cpu_devices]
        return tf.distribute.MirroredStrategy(devices=devices)
    return None


def activate(choice: Choice, seed: int) -> ActiveRuntime:
    """Set this process up for the choice. Call before anything imports Keras.

    Raises:
        EnvironmentSetupError: the devices asked for cannot be had in this process.
    """
    _prepare_environment(choice)
    frameworks.activated(choice.backend)  # Keras and JAX may be imported from here on
    if choice.cluster.multi:
        _join_cluster(choice)
    warnings: tuple[str, ...] = ()
    if choice.backend == "jax":
        folder, warning = compile_cache.resolve(choice.compilation_cache, os.environ)
        compile_cache.install(folder)  # before JAX compiles anything
        warnings = (warning,) if warning else ()
        devices = _jax_devices(choice)  # before TF, so JAX is first to claim the accelerator
        # TensorFlow comes only if something needs it (tf.data, a SavedModel export); then it
        # keeps off the GPUs, so JAX has their memory.
        frameworks.when_tensorflow_imported("off the GPUs", _tensorflow_off_the_gpus)
        keras = frameworks.keras()

        _check_keras_backend(keras, choice)
        distribution, mesh = None, None
        if choice.mesh_config is not None:
            # The mesh's distribution needs the model's layout: set by mesh.install before the
            # model is built. Resolved here, where a TPU's device count is first known (the
            # choice's own mesh is None there).
            mesh = meshes.resolve(choice.mesh_config, len(devices), choice.cluster.num_processes)
        elif len(devices) > 1:
            # None over one device (one GPU, a one-chip TPU), as on one CPU. Keras leaves a
            # variable on a one-device mesh uncommitted (distribute_tensor finds it "equivalent"
            # to its layout) while it commits the batches, and JAX compiles a step again when
            # that mix changes: the training step was compiled 3 times (at steps 1 and 2, and at
            # epoch 2, its metrics reset), the evaluation step twice; a Gemma 2B LoRA's epoch 2
            # took 15.5 s against epoch 3's 6.6 s on an H200.
            # Each process feeds its own share of every global batch (tpurun.multihost.cluster): Keras must
            # not shard the dataset again.
            distribution = keras.distribution.DataParallel(
                devices=devices, auto_shard_dataset=not choice.cluster.multi
            )
        # Set (or clear) it every time: a notebook kernel keeps the previous run's distribution.
        keras.distribution.set_distribution(distribution)
        runtime = ActiveRuntime(
            choice,
            len(devices),
            distribution=distribution,
            mesh=mesh,
            devices=devices,
            warnings=warnings,
        )
    else:
        compile_cache.use.reset(None)  # TensorFlow compiles its own way
        strategy = _tf_strategy(choice)
        keras = frameworks.keras()

        _check_keras_backend(keras, choice)
        if strategy is None:  # one device: TF's default strategy, nothing to distribute
            runtime = ActiveRuntime(choice, 1)
        else:
            runtime = ActiveRuntime(choice, strategy.num_replicas_in_sync, strategy=strategy)
    keras.mixed_precision.set_global_policy(choice.precision)
    seed_everything(keras, seed)
    return runtime


def _tensorflow_off_the_gpus(tf: Any) -> None:
    with contextlib.suppress(RuntimeError):  # TF's devices already started: nothing to change
        tf.config.set_visible_devices([], "GPU")


#: What Keras' ``set_random_seed`` is shown instead of its lazy TensorFlow module (see below).
_NO_TENSORFLOW = SimpleNamespace(available=False)


def seed_everything(keras: Any, seed: int) -> None:
    """Keras' ``set_random_seed`` (Python, NumPy, Keras), and TensorFlow's seed once TensorFlow is
    in the process (:func:`tpurun.frameworks.when_tensorflow_imported`).

    Keras' own call would seed TensorFlow wherever it is installed, importing it (4-5 s) on the
    JAX backend where nothing may need it; it is shown no TensorFlow, and tpurun seeds it itself
    when it comes: before any ``tf.data`` op, which all ask :func:`tpurun.frameworks.tensorflow`
    first.
    """
    rng = sys.modules[keras.utils.set_random_seed.__module__]
    with _replaced(rng, "tf", _NO_TENSORFLOW) if hasattr(rng, "tf") else contextlib.nullcontext():
        keras.utils.set_random_seed(seed)
    frameworks.when_tensorflow_imported("seed", lambda tf: _seed_tensorflow(tf, seed))


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` is ``value`` inside the block, and what it was after (unittest.mock's
    ``patch.object`` did this, and cost every run 30 ms of importing asyncio)."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def _seed_tensorflow(tf: Any, seed: int) -> None:
    """TensorFlow's global seed, set only when it changes.

    ``tf.random.set_seed`` clears TensorFlow's kernel caches, and with them the resources other
    objects hold: in a notebook, a KerasHub SentencePiece tokenizer loaded earlier
    (``tpurun.load``) fails at its next call ("Resource ... SentencepieceOp does not exist") once
    another command has set the seed again. Set to the same value, there is nothing to change.
    """
    # Never 0 (see frameworks.TF_SEED_FOR_ZERO); still a function of the config's seed. A seed
    # of 0 set outside tpurun is met where it matters, by tf.data's pass graphs (data.pipeline).
    tf_seed = frameworks.TF_SEED_FOR_ZERO if seed == 0 else seed
    if tf.compat.v1.get_seed(None)[0] != tf_seed:
        tf.random.set_seed(tf_seed)


def _check_keras_backend(keras: Any, choice: Choice) -> None:
    loaded = keras.backend.backend()
    if loaded != choice.backend:
        raise EnvironmentSetupError(
            f"Keras is already imported in this process with the {loaded} backend; tpurun chose "
            f"{choice.backend}. Set runtime.backend: {loaded}, or restart the kernel and call "
            "tpurun.train() before importing keras."
        )
