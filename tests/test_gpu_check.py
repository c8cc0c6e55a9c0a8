"""benchmarks/gpu_check.sh's Python half: which carried wheels it installs, and its Gemma LoRA run
with TensorFlow absent, as on the GPU machine (KerasHub on the native reader), read back by its
report."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT, cli_env, read_log

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
_spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def fake_wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    """A wheel holding only its METADATA: what the choice reads."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
             *(f"Requires-Dist: {r}" for r in requires)]  # fmt: skip
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def test_the_wheels_installed_are_the_missing_ones_and_those_too_old_here(tmp_path, capsys):
    """Absent here: installed. Present: kept, unless a wheel to be installed (or tpurun) needs a
    newer one; a requirement of an extra, or of a wheel not installed, changes nothing."""
    from importlib import metadata

    pytest_version = metadata.version("pytest")
    fake_wheel(tmp_path, "tpurun", "0.1.0", "pluggy>=0.1", "iniconfig>=0.1")
    fake_wheel(tmp_path, "zz-absent", "1.0", "pytest>=999", "iniconfig>=999; extra == 'dev'")
    fake_wheel(tmp_path, "pytest", "999.0")  # needed newer by zz-absent
    fake_wheel(tmp_path, "iniconfig", "999.0")  # only an extra wants it newer
    fake_wheel(tmp_path, "pluggy", "999.0", "zz-never>=1")  # kept: its needs do not count
    gpu_check.missing(str(tmp_path))
    out, err = capsys.readouterr()
    assert out.split() == ["pytest", "zz-absent"]
    assert err.splitlines() == [
        "  zz-absent: not installed",
        f"  pytest: {pytest_version} here, pytest>=999 wanted",
    ]


# TensorFlow hidden from the import system, as on the GPU machine (importlib.util.find_spec
# answers None, an import fails), then the benchmark's step or tpurun run as a script.
_WITHOUT_TENSORFLOW = """
import importlib.machinery, runpy, sys

class Hiding(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in ("tensorflow", "tensorflow_text"):
            return None
        return super().find_spec(name, path, target)

sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = Hiding
sys.argv = sys.argv[1:]
if sys.argv[0] == "tpurun":
    runpy.run_module("tpurun", run_name="__main__")
else:
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def without_tensorflow(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TENSORFLOW, *args], capture_output=True,
                          text=True, env=cli_env(), timeout=600, cwd=cwd)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("keras_hub") is None, reason="needs keras-hub")
def test_the_gemma_lora_run_trains_without_tensorflow_and_is_reported(tmp_path):
    """The tiny scale of the GPU check's third run: a Gemma preset from its config, token records
    written directly, a LoRA fine-tune on the native reader (KerasHub's Task.fit takes only
    tf.data or Grain datasets: tpurun hands the batches to plain Keras' fit), all without
    TensorFlow; then the report's table and JSON from the run's summary."""
    made = without_tensorflow(str(SCRIPT), "gemma", str(tmp_path), "tiny", "989", cwd=tmp_path)
    assert "records: 64 train, 32 validation, 33 tokens each" in made.stdout
    config = tmp_path / "gemma" / "gemma_lora.yaml"
    # The package metadata still says TensorFlow is installed, so auto would pick tf.data here.
    trained = without_tensorflow("tpurun", "train", str(config), "--output", str(tmp_path / "runs"),
                                 "--set", "data.reader=native", cwd=tmp_path)  # fmt: skip
    assert "reader: native (asked for in data.reader)" in trained.stdout

    run = tmp_path / "runs" / "gemma_lora"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["precision"], summary["steps_per_epoch"]) == (
        "completed", "bfloat16", 8)  # fmt: skip
    losses = [float(row["loss"]) for row in read_log(run)]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert abs(losses[0] - math.log(256)) < 0.2  # the untrained model: a uniform guess
    assert (run / "model.lora.h5").is_file()

    (tmp_path / "steps.tsv").write_text("gemma_lora\t0\t42\t240\ntotal\t0\t60\t480\n")
    assert gpu_check.report(str(tmp_path), str(tmp_path / "out")) == 1  # two runs are missing
    reported = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    figures = reported["runs"]["gemma_lora"]
    throughput = summary["throughput"]
    assert figures["tokens_per_sec"] == throughput["tokens_per_second"]
    assert figures["mfu"] == throughput["mfu"]
    assert throughput["mfu"] == pytest.approx(throughput["tflops_per_device"] / 989, rel=1e-12)
    assert reported["runs"]["quickstart"] is None and reported["steps"]["gemma_lora"] == {
        "exit": 0, "seconds": 42, "bound": 240}  # fmt: skip
