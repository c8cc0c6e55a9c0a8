"""A real notebook, run by nbclient on real IPython kernels, as a user meets tpurun.

Two kernels, registered in a temporary ``JUPYTER_PATH`` (nothing is installed globally):

- ``other-env``: ``.venv-kernel`` (``make install``), with ipykernel but no tpurun and no
  TensorFlow. Its cells call ``!.venv/bin/tpurun``, a process of another environment that
  inherits the kernel's ``MPLBACKEND=module://matplotlib_inline.backend_inline`` (which it cannot
  import) and a pseudo-terminal with ``JPY_PARENT_PID`` set.
- ``tpurun-env``: ``.venv``'s own Python, with tpurun, for the Python API in a cell. ipykernel
  comes from ``.venv-kernel``, appended to ``sys.path`` so that ``.venv``'s packages win:
  installing ipykernel into ``.venv`` would bring matplotlib-inline with it, and the first
  kernel's backend would then be importable by ``!.venv/bin/tpurun``, hiding the case above.

The kernels get this process's environment less what conftest.py set for the tests (the backend,
devices, TensorFlow's log level, JAX's cache) and less anything that asks for plain lines: what
tpurun prints is what it decides on its own in a notebook.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
from helpers import PLAIN_SIGNALS, ROOT, TF_START_UP, read_summary

pytestmark = pytest.mark.slow

nbformat = pytest.importorskip("nbformat", reason="the dev extra's nbformat: run make install")
nbclient = pytest.importorskip("nbclient", reason="the dev extra's nbclient: run make install")

KERNEL_VENV = ROOT / ".venv-kernel"
KERNEL_PYTHON = KERNEL_VENV / "bin" / "python"
TPURUN = shlex.quote(str(ROOT / ".venv" / "bin" / "tpurun"))
QUICKSTART = shlex.quote(str(ROOT / "configs" / "quickstart.yaml"))

ANSI = re.compile(r"\x1b[\[\]()]")
#: What this process (conftest.py) or the caller's shell set that a notebook kernel would not have.
_NOT_A_USERS = (*PLAIN_SIGNALS, "MPLBACKEND", "NO_COLOR", "FORCE_COLOR", "TPURUN_PROGRESS_SECONDS")
_NOT_A_USERS_PREFIXES = ("KERAS_", "JAX_", "XLA_", "TF_")


def _kernel_site_packages() -> Path:
    if not KERNEL_PYTHON.exists():
        pytest.skip(
            f"no {KERNEL_PYTHON.relative_to(ROOT)}: run make install (it makes .venv-kernel)"
        )
    own = f"python{sys.version_info.major}.{sys.version_info.minor}"
    found = sorted((KERNEL_VENV / "lib").glob("python*/site-packages"))
    if [p.parent.name for p in found] != [own]:
        pytest.skip(f".venv-kernel is not on {own} as .venv is: run make clean install")
    return found[0]


def _register_kernels(tmp_path: Path, monkeypatch) -> None:
    """The two kernelspecs, in a JUPYTER_PATH of the test's own."""
    borrow = (
        f"import sys; sys.path.append({str(_kernel_site_packages())!r}); "
        "from ipykernel.kernelapp import launch_new_instance; launch_new_instance()"
    )
    specs = {
        "other-env": [str(KERNEL_PYTHON), "-m", "ipykernel_launcher"],
        "tpurun-env": [str(ROOT / ".venv" / "bin" / "python"), "-c", borrow],
    }
    jupyter = tmp_path / "jupyter"
    for name, argv in specs.items():
        folder = jupyter / "kernels" / name
        folder.mkdir(parents=True)
        spec = {"argv": [*argv, "-f", "{connection_file}"], "display_name": name,
                "language": "python"}  # fmt: skip
        (folder / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter-runtime"))


def _users_env() -> dict:
    return {
        k: v
        for k, v in os.environ.items()
        if k not in _NOT_A_USERS and not k.startswith(_NOT_A_USERS_PREFIXES)
    }


def run_notebook(cells: list[str], kernel: str, tmp_path: Path, monkeypatch) -> list[str]:
    """Run ``cells`` as one notebook on ``kernel`` (in ``tmp_path``); each cell's printed text.
    A cell that raises fails the test with its traceback (nbclient's CellExecutionError)."""
    _register_kernels(tmp_path, monkeypatch)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, kernel_name=kernel, timeout=600,
                                     resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
    client.execute(env=_users_env())
    return [
        "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")
        for cell in nb.cells
    ]


def shell(command: str) -> str:
    """A ``!`` line as a user writes it; IPython's ``!`` does not raise when the command fails,
    so the cell prints the exit status."""
    return f'!{command}; echo "exit=$?"'


def assert_reads_as_lines(text: str) -> None:
    """What a person reads in a cell: no escape codes, no carriage-return redraws, no traceback,
    no framework start-up chatter, no matplotlib refusing the kernel's backend."""
    assert not ANSI.search(text), repr(text)
    assert "\r" not in text.replace("\r\n", "\n"), repr(text)
    assert "Traceback" not in text and "Key backend" not in text, text
    assert not TF_START_UP.search(text), text


def test_tpurun_cells_in_a_kernel_of_another_environment(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    version, doctor, train, listing, kernel = run_notebook(
        [
            shell(f"{TPURUN} --version"),
            shell(f"{TPURUN} doctor"),
            shell(f"{TPURUN} train {QUICKSTART} --set train.epochs=2 --output {runs}"),
            shell(f"{TPURUN} runs {runs}"),
            "import os, sys\n"
            'assert "tensorflow" not in sys.modules\n'
            'assert os.environ["MPLBACKEND"] == "module://matplotlib_inline.backend_inline"\n'
            'assert "XLA_FLAGS" not in os.environ and "TPURUN_PLAIN" not in os.environ\n'
            'print("kernel ok")',
        ],
        "other-env", tmp_path, monkeypatch,
    )  # fmt: skip

    for text in (version, doctor, train, listing):
        assert text.rstrip().endswith("exit=0"), text
        assert_reads_as_lines(text)
    assert version.startswith("tpurun "), version

    matplotlib = [line for line in doctor.splitlines() if re.match(r"\w+\s+matplotlib\s", line)]
    assert len(matplotlib) == 1, doctor
    # "usable here" instead means .venv can import matplotlib_inline (ipykernel in .venv?): this
    # notebook then no longer shows what a kernel of another environment does.
    assert matplotlib[0].startswith("ok "), doctor
    assert "module://matplotlib_inline.backend_inline" in matplotlib[0], doctor
    assert "uses agg" in matplotlib[0], doctor

    lines = train.splitlines()
    assert "[tpurun] epoch 1/2" in train and "[tpurun] epoch 2/2" in train, train
    assert any(line.startswith("[tpurun] completed") for line in lines), train
    assert all(line.startswith("[tpurun] ") for line in lines[:-1]), train  # then exit=0

    run_dir = runs / "quickstart"
    summary = read_summary(run_dir)
    assert summary["status"] == "completed" and summary["epochs_completed"] == 2, summary
    row = [line for line in listing.splitlines() if line.startswith("quickstart ")]
    assert len(row) == 1 and "completed" in row[0] and "2/2" in row[0], listing

    assert kernel.strip() == "kernel ok", kernel


def test_the_python_api_in_a_kernel_with_tpurun(tmp_path, monkeypatch):
    out = tmp_path / "runs"
    train, after = run_notebook(
        [
            "import tpurun\n"
            f"s = tpurun.train({str(ROOT / 'configs' / 'quickstart.yaml')!r}, "
            f'overrides=["train.epochs=1"], output={str(out)!r})\n'
            'assert s["status"] == "completed", s',
            "import keras\n"
            "assert keras.distribution.distribution() is None, keras.distribution.distribution()\n"
            'print("keras ok")',
        ],
        "tpurun-env", tmp_path, monkeypatch,
    )  # fmt: skip

    assert_reads_as_lines(train)
    assert "[tpurun] epoch 1/1" in train, train
    assert all(line.startswith("[tpurun] ") for line in train.splitlines()), train
    assert any(line.startswith("[tpurun] completed") for line in train.splitlines()), train
    assert read_summary(out / "quickstart")["status"] == "completed"
    assert after.strip() == "keras ok", after
