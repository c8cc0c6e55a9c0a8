"""Shared fixtures: real TFRecord files in tmp_path, tiny model factories, config dicts, and the
runs several files read (trained once per session).

The test process itself runs Keras on the JAX backend with 8 simulated CPU devices (set here,
before anything imports JAX or Keras); TensorFlow-backend runs go through real `tpurun`
subprocesses, since Keras fixes its backend once per process.

Honest markers: a test left unmarked is in `make test-fast`, so two checks fail an unmarked test
that is not fast, each by a count (never a clock, which a loaded machine would make flaky):

- it starts Python or `tpurun` in a subprocess (seconds of start-up each);
- its call phase trains more than MAX_UNMARKED_WORK parameter-steps in this process: each step
  Keras runs counts the model's parameters, so a step of the tiny Gemma (60,384) weighs as 375
  of the toy MLP (161). 500,000 lets a test train the toy for 3,000 steps, or the tiny Gemma for
  8. A module or session fixture's training is not counted: sharing a heavy run is the point.

Mark such a test ``slow``, or share its training in a fixture.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import weakref
from collections import Counter
from dataclasses import dataclass
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
# XLA compiles the tests' programs with its optimizations mostly off (LLVM -O0, no expensive
# passes): the tests' models are tiny, so their compiles cost far more than their steps. Measured
# on 2 cores, a first run (the JAX cache empty): the whole suite in 2,490 CPU-s and 21:56 against
# 2,725 and 23:40; three training files run again (the cache full), 151 CPU-s against 172. A run's
# numbers change in their last bits: every comparison in the tests is of two runs made alike, or
# within a tolerance.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# The tests are grouped by the package's folders (tests/training/ for tpurun/training/, ...). A test
# module may import another's helpers by name (read_events from test_tensorboard, ...), wherever the
# two live: every group's folder is importable, as this one is (pytest puts it first on sys.path).
sys.path.extend(str(group) for group in sorted(Path(__file__).resolve().parent.iterdir())
                if group.is_dir() and any(group.glob("test_*.py")))  # fmt: skip

# A suite started from a background job (`make test &`, nohup) inherits SIGINT ignored, and Python
# then installs no KeyboardInterrupt handler: the signal tests need the one an interactive or CI
# shell gives, and the subprocesses they start inherit it from here.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

from tpurun import frameworks  # noqa: E402

# The environment above sets this process up as tpurun.runtime.activate would (the JAX backend, 8
# CPU devices), so tests may import Keras and tpurun's modules that build on it.
frameworks.activated("jax")

# The helpers live in helpers.py; these names stay importable from conftest too.
from helpers import (  # noqa: E402, F401
    FACTORIES,
    PLAIN_SIGNALS,
    ROOT,
    FakeTTY,
    cli_env,
    make_records,
    run_cli,
    start_cli,
    toy_config,
    write_toy_data,
)

_cli_env = cli_env  # the older name


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


class _TrainingWork:
    """Counts the training this process does, in parameter-steps: each step adds the model's
    parameter count (frozen ones too: the step computes through them). Each execution reports
    its first and last step to the fit's callbacks (``on_train_batch_begin(begin)``,
    ``on_train_batch_end(end)``), on either backend and any ``steps_per_execution``."""

    def __init__(self):
        self.steps, self.work, self._begin = 0, 0, 0
        self._parameters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def reset(self) -> None:
        self.steps = self.work = 0

    def install(self) -> None:
        from keras.callbacks import CallbackList

        real_begin, real_end = CallbackList.on_train_batch_begin, CallbackList.on_train_batch_end
        counter = self

        def begin(self, batch, logs=None):
            counter._begin = batch
            return real_begin(self, batch, logs)

        def end(self, batch, logs=None):
            counter.count(self.model, batch - counter._begin + 1)
            return real_end(self, batch, logs)

        CallbackList.on_train_batch_begin, CallbackList.on_train_batch_end = begin, end

    def count(self, model, steps: int) -> None:
        if model not in self._parameters:
            self._parameters[model] = model.count_params()
        self.steps += steps
        self.work += steps * self._parameters[model]


_TRAINING = _TrainingWork()
#: The most training an unmarked test's call phase may do in this process, in parameter-steps
#: (the module docstring says why).
MAX_UNMARKED_WORK = 500_000


def pytest_configure(config):
    _TRAINING.install()


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests first, each file's tests in their order: with
    ``--dist loadfile`` a worker takes a whole file at a time, in this order (``make test`` passes
    ``--no-loadscope-reorder``; xdist's own order, the most tests first, put the files of a few
    long end-to-end tests last, where one of them kept a worker busy minutes after the others
    had finished)."""
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    first_seen = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-slow[item.path], first_seen[item.path]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """An unmarked test must stay fast: it fails when its call phase trained more than
    MAX_UNMARKED_WORK parameter-steps in this process (a count, not a clock: the same on a loaded
    machine). A module or session fixture's training is not counted: sharing a heavy run that
    way is the point. (Subprocesses are the other autouse check's.)"""
    _TRAINING.reset()
    outcome = yield
    slow = item.get_closest_marker("slow") is not None
    report = os.environ.get("TPURUN_TEST_WORK_REPORT")  # a file: list each test's count
    if report:
        with open(report, "a") as f:
            f.write(f"{item.nodeid}\t{_TRAINING.steps}\t{_TRAINING.work}\t{slow}\n")
        return
    if _TRAINING.work > MAX_UNMARKED_WORK and not slow and outcome.excinfo is None:
        outcome.force_exception(
            pytest.fail.Exception(
                f"{item.nodeid} trained {_TRAINING.steps} steps ({_TRAINING.work:,} "
                f"parameter-steps, more than {MAX_UNMARKED_WORK:,}) in this process: mark it "
                "slow, or share the training in a fixture"
            )
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With ``TPURUN_TEST_CPU_REPORT`` set to a file, each test's CPU seconds (setup, call and
    teardown; this process and the subprocesses it waited for) are appended to it: where the
    suite's time goes on a machine whose cores it keeps busy (CONTRIBUTING.md, "Tests")."""
    report = os.environ.get("TPURUN_TEST_CPU_REPORT")
    before = os.times()
    yield
    if not report:
        return
    after = os.times()
    spent = sum(after[i] - before[i] for i in range(4))  # user, system, children's both
    with open(report, "a") as f:
        f.write(f"{item.nodeid}\t{spent:.2f}\n")


@pytest.fixture(autouse=True, scope="module")
def _keras_policy_per_file():
    """Each test file starts from Keras' default dtype policy. A run sets the global policy
    (runtime.precision) as it activates, as in a notebook; with --dist loadfile one worker runs
    several files in a row, and a file whose bfloat16 run went first must not make the next
    file's models bfloat16 (test_hub's LoRA arithmetic failed so, after test_hub_figures)."""
    yield
    keras = sys.modules.get("keras")
    if keras is not None:
        keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    # Record counts are cached per user; keep each test's cache its own.
    monkeypatch.setenv("TPURUN_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def toy_data(tmp_path) -> Path:
    return write_toy_data(tmp_path / "data")


@pytest.fixture
def terminal(monkeypatch):
    """stdout is a real-looking terminal: nothing asks for plain lines. Call it in the test body
    (pytest puts its own capture back on sys.stdout between the setup and the call); it returns
    the FakeTTY that stdout now is. ``terminal(columns=60)``: a terminal that wide (Rich reads
    COLUMNS)."""
    for name in PLAIN_SIGNALS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")

    def install(columns: int | None = None) -> FakeTTY:
        if columns is not None:
            monkeypatch.setenv("COLUMNS", str(columns))
        out = FakeTTY()
        monkeypatch.setattr("sys.stdout", out)
        return out

    return install


# ------------------------------------------------------------------------ runs trained once
@dataclass(frozen=True)
class TrainedToy:
    """The toy model trained once for the session (see tests/trained.py): 1 epoch on 8 replicas.
    Read it in place; a test that writes into a run directory (evaluate writes eval-*.json)
    takes its own copy with :meth:`copy`."""

    run_dir: Path
    test_glob: str  # 1,003 records with targets
    unlabeled_glob: str  # the same records without the target

    def copy(self, folder: Path) -> Path:
        """A copy of the run directory under ``folder`` (same name), for a test to write into."""
        target = folder / self.run_dir.name
        shutil.copytree(self.run_dir, target)
        return target

    def altered_weights(self, path: Path) -> Path:
        """A weights file (``path`` ends in .weights.h5) for the same model that computes
        something else (its output layer's kernel moved by 0.5): evidence of which checkpoint
        a command loaded."""
        import tpurun

        model, _spec = tpurun.load(str(self.run_dir))
        last = model.layers[-1]
        last.kernel.assign(last.kernel + 0.5)
        model.save_weights(str(path))
        return path


@pytest.fixture(scope="session")
def trained_toy_run(tmp_path_factory) -> TrainedToy:
    """What test_evaluate, test_predict and test_export used to train each for themselves."""
    from trained import train_toy, write_test_set

    folder = tmp_path_factory.mktemp("trained-toy")
    run_dir = train_toy(folder)
    return TrainedToy(run_dir, write_test_set(folder / "test"),
                      write_test_set(folder / "unlabeled", targets=False))  # fmt: skip


# ------------------------------------------------------------------- tiny KerasHub presets
@pytest.fixture(scope="session")
def tiny_presets(tmp_path_factory):
    """Tiny Gemma causal LM, BERT classifier and ResNet classifier presets (tests/hub_presets.py),
    built once per session in this process; read them in place (a test that edits one copies
    it first)."""
    from hub_presets import build

    return build(tmp_path_factory.mktemp("hub-presets"))


@pytest.fixture(scope="session")
def chat_preset(tmp_path_factory) -> Path:
    """The tiny Gemma whose vocabulary holds Gemma's turn markers (hub_presets.chat_gemma), for
    chat data; built once per session."""
    from hub_presets import chat_gemma

    return chat_gemma(tmp_path_factory.mktemp("chat-preset") / "tiny_gemma_chat")


@pytest.fixture(scope="session")
def chat_records(tmp_path_factory):
    """``chat_records(n=96)``: the folder of ``n`` prompt/response records written by `tpurun
    data write` (helpers.write_chat_data), built once per session for each ``n``; read them in
    place."""
    from helpers import write_chat_data

    built: dict[int, Path] = {}

    def folder(n: int = 96) -> Path:
        if n not in built:
            built[n] = write_chat_data(tmp_path_factory.mktemp(f"chat-{n}"), n)
        return built[n]

    return folder


@pytest.fixture(scope="session")
def chat_lora_run(tiny_presets, chat_records, tmp_path_factory):
    """The tiny Gemma's LoRA fine-tune on the 96 chat records, trained once for the session with
    `tpurun train` (tests/trained.py): what test_hub_train, test_hub_infer and test_hub_checkpoints
    each trained before. Read it in place; a test that writes into it takes :meth:`copy`."""
    from trained import train_chat_lora

    return train_chat_lora(tmp_path_factory.mktemp("chat-lora"), tiny_presets.gemma,
                           chat_records())  # fmt: skip


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
