"""The tests' shared helpers, one copy each: toy data and configs, the console script and its
environment, config files, run directories (log, summary, resume point), waiting for a process to
train, a fake terminal, encoded images and schema-described datasets.

Plain functions (the fixtures are in conftest.py, which re-exports the older names). Nothing here
imports a framework at import time: conftest.py sets the test process up first.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
FACTORIES = Path(__file__).resolve().parent / "factories.py"
#: The console script a user runs (the venv's ``tpurun``).
TPURUN = str(Path(sys.executable).parent / "tpurun")

#: What this process set for itself (conftest.py): a subprocess picks its own, as a user's shell.
_OWN_SETTINGS = ("KERAS_BACKEND", "XLA_FLAGS", "JAX_PLATFORMS")
#: TensorFlow is installed. It is optional: without it, the tests that need it are skipped.
HAS_TENSORFLOW = importlib.util.find_spec("tensorflow") is not None


def installed_tensorflow_build() -> str | None:
    """The TensorFlow wheel this environment has, as tpurun names it: ``tensorflow`` where the
    hub extra's tensorflow-text pulled the full wheel in beside ``tensorflow-cpu`` (make install),
    ``tensorflow-cpu`` alone, or None (the JAX-only venv)."""
    from importlib.metadata import PackageNotFoundError, version

    for build in ("tensorflow", "tensorflow-cpu"):
        try:
            version(build)
        except PackageNotFoundError:
            continue
        return build
    return None


#: Whatever asks tpurun for plain lines (a terminal test drops them all).
PLAIN_SIGNALS = ("TPURUN_PLAIN", "CI", "JPY_PARENT_PID", "COLAB_RELEASE_TAG",
                  "KAGGLE_KERNEL_RUN_TYPE")  # fmt: skip


# ---------------------------------------------------------------------------------- toy data
#: TensorFlow's and XLA's C++ start-up logging, which no command may show: absl/glog lines
#: (``I0000 00:00:...``, ``E0000 ... cuda_platform.cc] failed call to cuInit``), oneDNN notices.
TF_START_UP = re.compile(
    r"^[IWEF]\d{4} |oneDNN|absl::InitializeLog|cpu_feature_guard|cuInit|cuda_", re.M
)


def signal_at(marker: Path, epoch: int, step: int, signal: str = "SIGTERM") -> dict:
    """A ``callbacks.extra`` entry that sends the training process ``signal`` once, after that
    step of that epoch (1-based; tests/factories.py SignalAt): ``marker`` records that it fired."""
    return {"name": f"{FACTORIES}:SignalAt", "epoch": epoch, "step": step, "signal": signal,
            "marker": str(marker)}  # fmt: skip


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


def write_config(where: Path, config: dict, name: str | None = None) -> Path:
    """Write ``config`` as YAML and return the file: ``where`` itself when it ends in .yaml, else
    ``where/<name>.yaml`` (``exp.yaml`` without a name). A ``name`` also names the run."""
    if name is not None:
        config = {**config, "name": name}
    path = where if where.suffix in (".yaml", ".yml") else where / f"{name or 'exp'}.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# ------------------------------------------------------------------------- the console script
def cli_env(env: dict | None = None, *, plain: bool = True, **extra: str) -> dict:
    """The environment of a ``tpurun`` (or Python) subprocess: this process's, less the backend
    and devices it set for itself; plain lines unless ``plain`` is False (then nothing asks for
    them, as on a person's terminal)."""
    full = {k: v for k, v in os.environ.items() if k not in _OWN_SETTINGS}
    if plain:
        full["TPURUN_PLAIN"] = "1"
    else:
        for key in PLAIN_SIGNALS:
            full.pop(key, None)
    return {**full, **(env or {}), **extra}


def run_cli(*args: str, env: dict | None = None, timeout: float = 600, cwd: Path = ROOT):
    """Run the real ``tpurun`` console script; ``timeout`` is a hang guard."""
    return subprocess.run([TPURUN, *args], capture_output=True, text=True, env=cli_env(env),
                          timeout=timeout, cwd=cwd)  # fmt: skip


def start_cli(*args: str, env: dict | None = None, cwd: Path = ROOT, **popen):
    """Start the real ``tpurun`` console script, its stdout and stderr piped (to send it signals,
    to read its lines)."""
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
    return subprocess.Popen([TPURUN, *args], env=cli_env(env), cwd=cwd, **options)


# ---------------------------------------------------------------------------- run directories
def read_log(run_dir: Path, filename: str = "log.csv") -> list[dict]:
    """A run's CSV log, one dict per epoch row."""
    with open(Path(run_dir) / filename, newline="") as f:
        return list(csv.DictReader(f))


def logged_epochs(run_dir: Path) -> list[str]:
    """The ``epoch`` column of a run's log (empty without a log)."""
    if not (Path(run_dir) / "log.csv").exists():
        return []
    return [row["epoch"] for row in read_log(run_dir)]


def assert_same_log(a: Path, b: Path, atol: float = 0.0, filename: str = "log.csv") -> None:
    """Two runs' CSV logs agree in every row and every column. ``atol`` 0: the same text in each
    cell (JAX on one device: a resumed run is the unbroken one to the last digit); otherwise each
    numeric cell within ``atol`` of the other's (TensorFlow: within 1e-4)."""
    left, right = read_log(a, filename), read_log(b, filename)
    assert [list(r) for r in left[:1]] == [list(r) for r in right[:1]], "the logs' columns differ"
    assert len(left) == len(right), f"{len(left)} rows in {a}, {len(right)} in {b}"
    for row, (one, other) in enumerate(zip(left, right, strict=True)):
        for column, value in one.items():
            same = value == other[column] or (
                atol > 0 and abs(float(value) - float(other[column])) <= atol
            )
            assert same, f"row {row}, {column}: {value} in {a}, {other[column]} in {b}"


def saved_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every array a Keras file holds, by its path in the file: a ``.weights.h5`` (or a LoRA
    ``.adapter.h5``), or a ``.keras`` archive's weights. Read with h5py, so no model is built and
    any backend's file reads the same; the optimizer's state is included where it was saved."""
    import zipfile

    import h5py

    path = Path(path)
    if path.suffix == ".keras":
        with zipfile.ZipFile(path) as archive:
            data = io.BytesIO(archive.read("model.weights.h5"))
        opened = h5py.File(data, "r")
    else:
        opened = h5py.File(path, "r")
    arrays: dict[str, np.ndarray] = {}
    with opened as f:
        f.visititems(
            lambda name, item: arrays.__setitem__(name, item[()])
            if isinstance(item, h5py.Dataset) else None
        )  # fmt: skip
    return arrays


def assert_same_arrays(a: dict, b: dict, atol: float = 0.0) -> None:
    """The same names and, name by name, the same arrays: bit for bit with ``atol`` 0."""
    assert sorted(a) == sorted(b), "the files hold different arrays"
    assert a, "no arrays to compare"
    for name in a:
        assert a[name].shape == b[name].shape and a[name].dtype == b[name].dtype, name
        if atol:
            np.testing.assert_allclose(a[name], b[name], rtol=0, atol=atol, err_msg=name)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def assert_same_model(a: Path, b: Path, atol: float = 0.0) -> None:
    """Two runs' final ``model.keras`` hold the same weights and optimizer state, array by
    array (see :func:`saved_arrays`)."""
    assert_same_arrays(saved_arrays(Path(a) / "model.keras"), saved_arrays(Path(b) / "model.keras"),
                       atol)  # fmt: skip


def token_loss_by_hand(task, batches) -> tuple[float, float, int]:
    """A causal LM's summed token loss in float64 over ``batches`` of ``(x, y, weights)`` numpy
    arrays, computed from its logits by hand: ``(weighted loss, weight, positions of a batch)``
    (the per-token mean is the first over the second)."""
    total = tokens = 0.0
    positions = 0
    for x, y, w in batches:
        logits = np.asarray(task.predict_on_batch(x), dtype=np.float64)
        top = logits.max(axis=-1, keepdims=True)
        log_p = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
        nll = -np.take_along_axis(log_p, y[..., None], axis=-1)[..., 0]
        total, tokens, positions = total + (nll * w).sum(), tokens + w.sum(), w.size
    return total, tokens, positions


def read_summary(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "summary.json").read_text())


def read_latest(run_dir: Path) -> dict:
    """The run's resume point (checkpoints/latest.json)."""
    return json.loads((Path(run_dir) / "checkpoints" / "latest.json").read_text())


def read_previous(run_dir: Path) -> dict:
    """The resume point kept before the latest (checkpoints/previous.json)."""
    return json.loads((Path(run_dir) / "checkpoints" / "previous.json").read_text())


def wait_until(done: Callable[[], bool], proc: subprocess.Popen, what: str,
               timeout: float = 300) -> None:  # fmt: skip
    """Poll ``done`` until it holds (a file it reads may be missing or being replaced: not yet).
    Fails with the process's output if it ends first, or after ``timeout`` seconds (a hang
    guard, not a measure of speed)."""

    def holds() -> bool:
        try:
            return bool(done())
        except (OSError, ValueError, KeyError):
            return False

    deadline = time.monotonic() + timeout
    while not holds():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"exited {proc.returncode} before {what}:\n{out or ''}{err or ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s")
        time.sleep(0.05)


def wait_for_epoch(run_dir: Path, proc: subprocess.Popen, epochs: int = 1,
                   timeout: float = 300) -> None:  # fmt: skip
    """Until the run has logged ``epochs`` epochs (it is training)."""

    wait_until(lambda: len(logged_epochs(run_dir)) >= epochs, proc,
               f"epoch {epochs} in {run_dir}/log.csv", timeout)  # fmt: skip


def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, mid_epoch: bool = False,
                        timeout: float = 300) -> dict:  # fmt: skip
    """Until the run has a resume point (``mid_epoch``: one inside an epoch); returns it."""
    seen: dict = {}

    def saved() -> bool:
        seen.update(read_latest(run_dir))
        return not mid_epoch or seen.get("step", 0) > 0

    wait_until(saved, proc, f"{'a mid-epoch' if mid_epoch else 'a'} checkpoint in {run_dir}",
               timeout)  # fmt: skip
    return seen


# ------------------------------------------------------------------------------- the terminal
class FakeTTY(io.StringIO):
    """A text stream that says it is a terminal."""

    def isatty(self):
        return True


# ------------------------------------------------------------------------------------- images
def encode_image(pixels: np.ndarray, format: str = "png") -> bytes:
    """``pixels`` (height, width, channels; uint8) as PNG or JPEG bytes."""
    import tensorflow as tf

    encode = {"png": tf.io.encode_png, "jpeg": tf.io.encode_jpeg}[format]
    return encode(np.asarray(pixels, np.uint8)).numpy()


def make_image_folder(root: Path) -> Path:
    """cat/: three dark 8x6 PNGs; dog/: three bright 10x12 JPEGs; and a file that is skipped."""
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
    for i in range(3):
        (root / "cat" / f"{i}.png").write_bytes(encode_image(np.full((8, 6, 3), 20), "png"))
        (root / "dog" / f"{i}.jpg").write_bytes(encode_image(np.full((10, 12, 3), 230), "jpeg"))
    (root / "cat" / "notes.txt").write_text("not an image: skipped")
    return root


# ------------------------------------------------------------------------------- chat records
def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_chat_data(folder: Path, n: int = 96) -> Path:
    """``n`` prompt/response records (tests/hub_presets.py), a quarter for validation, written by
    `tpurun data write` as ``folder/data/chat-{train,validation}-*``; returns ``folder/data``.
    Tests share them through conftest's ``chat_records``."""
    from hub_presets import prompt_response_pairs
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": p, "response": r} for p, r in prompt_response_pairs(n)]
    source = write_jsonl(folder / "chat.jsonl", rows)
    result = CliRunner().invoke(app, ["data", "write", str(source), str(folder / "data" / "chat"),
                                      "--validation-fraction", "0.25"])  # fmt: skip
    assert result.exit_code == 0, result.output
    return folder / "data"


# ---------------------------------------------------------------- datasets with a schema file
SCHEMA_FEATURES = {
    "x": {"type": "raw", "dtype": "float32", "shape": [8]},
    "y": {"type": "int64", "shape": []},
}


def write_with_schema(folder: Path, n_train: int = 256, n_val: int = 64, *,
                      compression: str = "none", train_shards: int = 4, val_shards: int = 2,
                      class_names: list[str] | None = None) -> Path:  # fmt: skip
    """The toy records as ``folder/toy-{train,validation}-*.tfrecord`` and ``toy.schema.json``,
    as ``tpurun data write`` leaves them: the features, each shard's records and size in bytes.
    Returns ``folder``."""
    from tpurun.data import schema_file
    from tpurun.data.write import write_shards

    folder.mkdir(parents=True, exist_ok=True)
    prefix = str(folder / "toy")
    splits, sizes = {}, {}
    for split, n, shards, seed in (("train", n_train, train_shards, 0),
                                   ("validation", n_val, val_shards, 1)):  # fmt: skip
        if not n:
            continue
        paths = write_shards(f"{prefix}-{split}", make_records(n, seed), shards, compression)
        counts = [n // shards + (k < n % shards) for k in range(shards)]  # round-robin
        splits[split] = {os.path.basename(p): c for p, c in zip(paths, counts, strict=True)}
        sizes[split] = {os.path.basename(p): os.path.getsize(p) for p in paths}
    schema = schema_file.make(SCHEMA_FEATURES, splits, compression=compression,
                              class_names=class_names, shard_bytes=sizes)  # fmt: skip
    schema_file.write(schema_file.schema_path(prefix), schema)
    return folder


def schema_config(folder: Path, out: Path, **data) -> dict:
    """A toy config whose data section names only the files of :func:`write_with_schema`: the
    features come from the schema file."""
    config = toy_config(folder, out)
    validation = folder / "toy-validation-*.tfrecord"
    config["data"] = {"train": str(folder / "toy-train-*.tfrecord"),
                      "validation": str(validation) if list(folder.glob(validation.name)) else None,
                      "inputs": "x", "targets": "y", **data}  # fmt: skip
    return config


@contextlib.contextmanager
def without_full_collections():
    """Keras' ``quantize`` runs a full ``gc.collect()`` after each float kernel it replaces
    (keras/src/layers/layer.py, ``Layer.__delattr__``, so a device frees each float buffer before
    the next is quantized): about 0.26 s each in a test process, whose heap is large, 15 a
    quantize of the tiny Gemma. Switched off where tests quantize: the float buffers are freed
    later, by reference counts, and no value changes. tpurun itself keeps Keras' collections (they
    bound the peak memory of quantizing a model that fits only quantized)."""
    import gc

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gc, "collect", lambda generation=2: 0)
        yield
