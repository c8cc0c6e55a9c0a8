"""tpurun.frameworks: what the one door to TensorFlow, JAX and Keras adds to a plain import."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_cli
from helpers import TF_START_UP

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
