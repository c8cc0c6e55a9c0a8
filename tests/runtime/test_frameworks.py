"""tpurun.frameworks: what the one door to TensorFlow, JAX and Keras adds to a plain import."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli
from helpers import TF_START_UP, cli_env

from tpurun import frameworks

NOTEBOOK_BACKEND = "module://matplotlib_inline.backend_inline"  # what ipykernel exports


@pytest.mark.parametrize(
    ("inherited", "kept"),
    [
        ("module://no_such_package.backend", False),  # cannot be imported here
        ("module://matplotlib.backends.backend_agg", True),  # can
        ("TkAgg", True),  # one of matplotlib's own names (any case)
        ("no-such-backend", False),  # neither
    ],
)
def test_an_inherited_matplotlib_backend_is_kept_only_when_usable(inherited, kept):
    env = {"MPLBACKEND": inherited}
    replaced = frameworks.usable_matplotlib_backend(env)
    assert env["MPLBACKEND"] == (inherited if kept else "agg")
    assert replaced == (None if kept else inherited)


def test_no_backend_set_is_left_alone():
    env: dict = {}
    assert frameworks.usable_matplotlib_backend(env) is None and env == {}


@pytest.mark.slow
def test_a_notebook_kernels_backend_does_not_stop_a_command():
    """A kernel from another environment exports its inline backend; tpurun's TensorFlow import
    (which imports matplotlib) must not fail on it."""
    result = run_cli("config", str(ROOT / "configs" / "quickstart.yaml"),
                     env={"MPLBACKEND": NOTEBOOK_BACKEND})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Key backend" not in result.stderr


QUICKSTART = str(ROOT / "configs" / "quickstart.yaml")


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["config", QUICKSTART],
        ["data", "bench", QUICKSTART, "--steps", "2"],
        ["data", "inspect", str(ROOT / "configs" / "data" / "digits" / "digits-train-*")],
        ["train", QUICKSTART, "--set", "train.epochs=1", "--output", "{tmp}"],
    ],
    ids=["config", "data-bench", "data-inspect", "train"],
)
def test_no_command_shows_tensorflows_start_up_lines(args, tmp_path):
    """TensorFlow logs oneDNN and CPU-feature notices through absl before its log level applies,
    and a full (CUDA) build logs "failed call to cuInit" when it first lists devices on a machine
    without a GPU; every command imports it through the door, which keeps them off stderr."""
    result = run_cli(*(arg.format(tmp=tmp_path) for arg in args))
    assert result.returncode == 0, result.stderr
    assert not TF_START_UP.search(result.stderr), result.stderr


def test_doctor_says_which_backend_it_found_and_which_it_uses():
    from tpurun.doctor.machine import check_matplotlib_backend

    elsewhere = "module://only_in_the_kernels_env.backend_inline"  # not importable here
    kernel = check_matplotlib_backend({"MPLBACKEND": elsewhere})
    assert kernel.status == "ok" and kernel.data == {"inherited": elsewhere, "used": "agg"}
    assert "(a notebook kernel's) cannot be loaded in this environment" in kernel.finding
    assert check_matplotlib_backend({"MPLBACKEND": "agg"}).data["used"] == "agg"
    assert check_matplotlib_backend({}).finding.startswith("MPLBACKEND not set")


# ---------------------------------------------------------- TensorFlow kept out of the JAX path
def test_keras_serialization_sees_tensorflow_only_once_imported(monkeypatch):
    """The view frameworks.keras() gives Keras' serialization answers "is it available" from
    sys.modules, without asking the lazy module (whose answer imports TensorFlow)."""
    from keras.src.saving import serialization_lib

    class Lazy:
        asked = 0

        @property
        def available(self):
            Lazy.asked += 1
            return True

        TensorShape = "the lazy module's"

    frameworks.keras()
    assert type(serialization_lib.tf) is frameworks._ImportedOnly
    view = frameworks._ImportedOnly(Lazy())
    monkeypatch.delitem(sys.modules, "tensorflow", raising=False)
    assert view.available is False and Lazy.asked == 0
    monkeypatch.setitem(sys.modules, "tensorflow", sys)  # any module: "imported"
    assert view.available is True and Lazy.asked == 1
    assert view.TensorShape == "the lazy module's"  # everything else: the lazy module's


# Sets a process up for JAX as tpurun does, then saves and loads a .keras model and reports; Keras'
# import left matplotlib's pyplot unloaded (frameworks._pyplot_on_first_use), and Keras' own
# plotting helper still draws a PNG with it.
_SAVE_ON_JAX = """
import sys, numpy as np
from tpurun import frameworks
from tpurun.config import RuntimeConfig
from tpurun.runtime.activate import activate
from tpurun.runtime.choice import choose
from tpurun.runtime.machine import probe

activate(choose(RuntimeConfig(cpu_devices=1), 1, probe()), seed=7)
deferred = "matplotlib.figure" not in sys.modules
drawn = np.random.rand()
keras = frameworks.keras()
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
model.compile(optimizer="adam", loss="mse")
model.save(sys.argv[1])
again = keras.saving.load_model(sys.argv[1])
same = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), again.get_weights()))
keras.visualization.plot_image_gallery(np.zeros((2, 8, 8, 3)), rows=1, cols=2,
                                       path=sys.argv[1] + ".png")
png = open(sys.argv[1] + ".png", "rb").read(8) == b"\\x89PNG\\r\\n\\x1a\\n"
print(drawn == np.random.RandomState(7).rand(), same, "tensorflow" in sys.modules, deferred, png)
if len(sys.argv) > 2:  # then TF comes, even past the door (a factory's own import)
    import tensorflow as tf

    hidden = []
    tf.config.set_visible_devices = lambda devices, kind: hidden.append((devices, kind))
    assert frameworks.imported_tensorflow() is tf  # the next door call catches up
    print(tf.compat.v1.get_seed(None)[0], hidden == [([], "GPU")])
"""


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=cli_env(), timeout=300, cwd=ROOT)  # fmt: skip


@pytest.mark.slow
def test_a_keras_save_on_jax_leaves_tensorflow_out(tmp_path):
    """With TensorFlow installed, Keras imports it at its first serialization (4-5 s): a .keras
    save on JAX must not, and the run's seeds are set without it."""
    result = run_python(_SAVE_ON_JAX, str(tmp_path / "model.keras"))
    assert result.stdout.split() == ["True", "True", "False", "True", "True"], result.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow comes later")
def test_tensorflow_coming_later_is_seeded_and_kept_off_the_gpus(tmp_path):
    result = run_python(_SAVE_ON_JAX, str(tmp_path / "model.keras"), "then-tensorflow")
    assert result.stdout.split() == ["True", "True", "False", "True", "True", "7", "True"], (
        result.stderr
    )


# A quickstart train on JAX with the native reader, its profile and TensorBoard logs, as a person
# runs it from Python.
_TRAIN_ON_JAX = """
import sys, tpurun
summary = tpurun.train(sys.argv[1], verbose=False, output=sys.argv[2], overrides=[
    "data.reader=native", "train.epochs=2", "train.profile={start_step: 3, steps: 2}"])
print(summary["status"], summary["steps_per_epoch"], "tensorflow" in sys.modules)
"""


@pytest.mark.slow
def test_a_jax_train_with_the_native_reader_leaves_tensorflow_out(tmp_path):
    """Where TensorFlow is installed, the JAX path trains, saves .keras checkpoints, writes its
    TensorBoard logs and a profile without importing it."""
    from test_tensorboard import read_events

    result = run_python(_TRAIN_ON_JAX, QUICKSTART, str(tmp_path))
    status, steps, imported = result.stdout.split()[-3:]
    assert (status, imported) == ("completed", "False"), result.stderr
    run = tmp_path / "quickstart"
    assert (run / "model.keras").is_file() and (run / "checkpoints" / "best.keras").is_file()
    assert len(list((run / "plugins" / "profile").glob("*/*.xplane.pb"))) == 1
    events = read_events(run)
    assert [s for s, _ in events["validation/epoch_accuracy"]] == [int(steps), 2 * int(steps)]
