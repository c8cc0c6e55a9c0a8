"""Shared fixtures: real TFRecord files in tmp_path, tiny model factories, config dicts.

The test process itself runs Keras on the JAX backend with 8 simulated CPU devices (set here,
before anything imports JAX or Keras); TensorFlow-backend runs go through real `tpurun`
subprocesses, since Keras fixes its backend once per process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
# JAX's persistent compilation cache, for this process and every subprocess a test starts: the
# same toy models are compiled once per machine instead of once per process. A folder under the
# pytest cache, so `make clean` (or deleting .pytest_cache) empties it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR",
    str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "jax-compilation-cache"),
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tpurun import frameworks  # noqa: E402

# The environment above sets this process up as tpurun.runtime.activate would (the JAX backend, 8
# CPU devices), so tests may import Keras and tpurun's modules that build on it.
frameworks.activated("jax")

ROOT = Path(__file__).resolve().parent.parent
FACTORIES = Path(__file__).resolve().parent / "factories.py"


@pytest.fixture(autouse=True)
def _slow_marks_tell_the_truth(request, monkeypatch):
    """An unmarked test must not start Python (or tpurun) in a subprocess: such a test is
    `slow`, and `make test-fast` leaves it out. Fails the test that does, naming the program."""
    if request.node.get_closest_marker("slow"):
        return
    import subprocess

    real_init = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        first = args[0] if isinstance(args, (list, tuple)) else str(args).split()[0]
        program = os.path.basename(os.fspath(first))
        if program.startswith("python") or program == "tpurun":
            pytest.fail(f"{request.node.nodeid} starts {program} in a subprocess: mark it slow")
        real_init(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Record counts are cached per user; keep each test's cache its own.
    monkeypatch.setenv("TPURUN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


def make_records(n: int, seed: int = 0) -> list[dict]:
    """Separable toy data: x is 8 float32 values stored raw; y = 1 when their sum is positive."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x.sum(axis=1) > 0).astype(np.int64)
    return [{"x": x[i].tobytes(), "y": int(y[i]), "id": f"r{i}"} for i in range(n)]


def write_toy_data(folder: Path, n_train: int = 512, n_val: int = 128, shards: int = 4) -> Path:
    from tpurun.data.write import write_shards

    folder.mkdir(parents=True, exist_ok=True)
    write_shards(str(folder / "train"), make_records(n_train, 0), shards)
    write_shards(str(folder / "val"), make_records(n_val, 1), 2)
    return folder


def toy_config(data_dir: Path, out_dir: Path, **sections) -> dict:
    """A complete config dict for the toy data; ``sections`` update its top-level sections."""
    config = {
        "name": "toy",
        "seed": 7,
        "runtime": {"backend": "auto", "cpu_devices": 1},
        "model": {
            "factory": f"{FACTORIES}:mlp",
            "loss": "binary_crossentropy",
            "metrics": ["accuracy"],
        },
        "data": {
            "train": str(data_dir / "train-*.tfrecord"),
            "validation": str(data_dir / "val-*.tfrecord"),
            "features": {
                "x": {"type": "raw", "dtype": "float32", "shape": [8]},
                "y": {"type": "int64", "cast": "float32"},
            },
            "inputs": "x",
            "targets": "y",
            "shuffle_buffer": 256,
        },
        "train": {"per_core_batch_size": 32, "epochs": 2, "learning_rate": {"base": 0.01}},
        "output": {"dir": str(out_dir)},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


@pytest.fixture
def toy_data(tmp_path) -> Path:
    return write_toy_data(tmp_path / "data")


def _cli_env(env: dict | None) -> dict:
    full_env = {**os.environ, "TPURUN_PLAIN": "1", **(env or {})}
    # The subprocess picks its own backend and devices, as a user's shell would.
    for key in ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS"):
        full_env.pop(key, None)
    return full_env


def run_cli(*args: str, env: dict | None = None, timeout: float = 600):
    """Run the real `tpurun` console script in a subprocess."""
    import subprocess

    exe = Path(sys.executable).parent / "tpurun"
    return subprocess.run(
        [str(exe), *args], capture_output=True, text=True, env=_cli_env(env), timeout=timeout,
        cwd=ROOT,
    )  # fmt: skip


def start_cli(*args: str, env: dict | None = None):
    """Start the real `tpurun` console script, its stdout and stderr piped (to send it signals)."""
    import subprocess

    exe = Path(sys.executable).parent / "tpurun"
    return subprocess.Popen([str(exe), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_cli_env(env), cwd=ROOT)  # fmt: skip


# ---------------------------------------------------------------- a GCS server on 127.0.0.1
@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The GCS test server (tests/gcs_server.py), in its own process for the whole session."""
    from gcs_server import GcsServer

    server = GcsServer(tmp_path_factory.mktemp("gcs-server"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def gcs(gcs_server):
    """The GCS test server, running (a test may have killed it), with a fresh bucket of this
    test's own in ``gcs.bucket`` (``gs://...``). TensorFlow reaches it only in subprocesses started
    with ``gcs.env``: the GCS client reads its settings once per process."""
    import uuid

    if not gcs_server.alive:
        gcs_server.start()
    gcs_server.release()
    gcs_server.bucket = gcs_server.make_bucket(f"t-{uuid.uuid4().hex[:16]}")
    yield gcs_server
    if gcs_server.alive:
        gcs_server.release()
