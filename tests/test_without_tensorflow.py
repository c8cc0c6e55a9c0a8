"""Every command on a machine without TensorFlow, as a JAX-only image has it: the console script of
``.venv-jax`` (made by ``make install``: tpurun, JAX and the core dependencies, keras-hub without
tensorflow-text, and no TensorFlow). What truly needs TensorFlow exits 2 with the command to
install it; everything else works, on the native reader."""

from __future__ import annotations

import csv
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import ROOT, cli_env, read_log, run_cli, write_config

JAX_VENV = ROOT / ".venv-jax"
TPURUN_JAX = JAX_VENV / "bin" / "tpurun"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not TPURUN_JAX.exists(), reason="make install builds .venv-jax"),
]

MODEL = """import keras


def build(units=16):
    inputs = keras.Input(shape=(4,), name="x")
    hidden = keras.layers.Dense(units, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(2, activation="softmax")(hidden))
"""


def jax_cli(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """``tpurun ARGS`` from the environment without TensorFlow."""
    return subprocess.run([str(TPURUN_JAX), *args], capture_output=True, text=True, cwd=cwd,
                          env=cli_env(), timeout=timeout)  # fmt: skip


def ok(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout + done.stderr


def refused(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    return done.stderr


def test_the_environment_has_no_tensorflow():
    python = JAX_VENV / "bin" / "python"
    done = subprocess.run([str(python), "-c", "import tensorflow"], capture_output=True, text=True)
    assert done.returncode == 1 and "No module named 'tensorflow'" in done.stderr


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The README's quickstart in an empty folder, each command run without TensorFlow."""
    root = tmp_path_factory.mktemp("no-tf")
    x = np.random.default_rng(0).normal(size=(600, 4))
    with open(root / "train.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["a", "b", "c", "d", "target"])
        out.writerows([[*row, int(row.sum() > 0)] for row in x.round(4)])
    ok(jax_cli("data", "write", "train.csv", "data/tab", "--label", "target", "--pack", "x",
               "--validation-fraction", "0.2", cwd=root))  # fmt: skip
    (root / "model.py").write_text(MODEL)
    config = {
        "name": "tabular",
        "model": {
            "factory": "model.py:build",
            "loss": "sparse_categorical_crossentropy",
            "metrics": ["accuracy"],
        },  # fmt: skip
        "data": {
            "train": "data/tab-train-*.tfrecord",
            "validation": "data/tab-validation-*.tfrecord",
            "inputs": "x",
            "targets": "target",
        },  # fmt: skip
        "train": {"per_core_batch_size": 16, "epochs": 3},
        "runtime": {"cpu_devices": 2},
    }
    write_config(root / "config.yaml", config)
    said = ok(jax_cli("train", "config.yaml", cwd=root))
    assert "reader: native (TensorFlow is not installed)" in said
    return root


def test_train_writes_the_whole_run_directory(project):
    run = project / "runs" / "tabular"
    for name in ("config.yaml", "log.csv", "summary.json", "model.keras", "curves.png",
                 "checkpoints/latest.json", "checkpoints/best.keras"):  # fmt: skip
        assert (run / name).is_file(), name
    assert len(read_log(run)) == 3
    events = sorted(p.parent.name for p in run.glob("*/events.out.tfevents.*"))
    assert events == ["train", "validation"]
    assert yaml.safe_load((run / "config.yaml").read_text())["derived"]["reader"] == "native"


def test_evaluate_predict_runs_and_plot(project):
    run = project / "runs" / "tabular"
    said = ok(jax_cli("evaluate", "runs/tabular", "--json", cwd=project))
    scored = json.loads(said[said.index("{") :])
    best = json.loads((run / "summary.json").read_text())["best"]
    assert best["monitor"] == "val_loss"  # the best checkpoint, scored again: the same loss
    assert scored["metrics"]["loss"] == pytest.approx(best["value"], rel=1e-6)
    ok(jax_cli("predict", "runs/tabular", "--data", "data/tab-validation-*.tfrecord",
               "--output", "p.csv", cwd=project))  # fmt: skip
    rows = list(csv.DictReader(open(project / "p.csv")))
    derived = yaml.safe_load((run / "config.yaml").read_text())["derived"]
    assert len(rows) == derived["validation_records"] == 120
    assert "completed" in ok(jax_cli("runs", "runs", cwd=project))
    said = ok(jax_cli("plot", "tabular", "--output", "c.png", cwd=project))
    assert said.startswith("wrote c.png (1280x400 px): loss, accuracy of 1 run(s), 4 lines")


def test_exports_keras_and_onnx_and_refuses_saved_model(project):
    ok(jax_cli("export", "runs/tabular", "--format", "keras", "--output", "m.keras", cwd=project))
    ok(jax_cli("export", "runs/tabular", "--format", "onnx", "--output", "m.onnx", cwd=project))
    assert (project / "m.keras").is_file() and (project / "m.onnx").is_file()
    err = refused(jax_cli("export", "runs/tabular", "--format", "saved_model", "--output", "sm",
                          cwd=project))  # fmt: skip
    assert "saved_model" in err and "pip install" in err and "tensorflow" in err
    assert not (project / "sm").exists()


def test_what_needs_tensorflow_is_refused_with_the_install_command(project):
    err = refused(jax_cli("train", "config.yaml", "--set", "runtime.backend=tensorflow",
                          "--set", "name=tf", cwd=project))  # fmt: skip
    assert "pip install" in err and "tensorflow" in err
    err = refused(jax_cli("train", "config.yaml", "--set", "data.reader=tf_data",
                          "--set", "name=tfdata", cwd=project))  # fmt: skip
    assert "data.reader: tf_data" in err and "pip install tensorflow-cpu" in err
    assert not (project / "runs" / "tf").exists() and not (project / "runs" / "tfdata").exists()


def test_data_inspect_and_bench(project):
    said = ok(jax_cli("data", "inspect", "data/tab-train-*.tfrecord", cwd=project))
    assert "x: {type: float, shape: [4]}" in said
    said = ok(jax_cli("data", "bench", "config.yaml", cwd=project))
    assert "reader      native (TensorFlow is not installed)" in said and "examples/s" in said


def test_doctor_names_the_reader_and_does_not_fail_for_a_missing_tensorflow(project):
    done = jax_cli("doctor", "config.yaml", cwd=project)
    said = done.stdout + done.stderr
    assert done.returncode == 0, said
    assert re.search(r"^ok +reader +native \(TensorFlow is not installed\)", said, re.M)


def test_launch_two_processes(project):
    said = ok(jax_cli("launch", "-n", "2", "train", "config.yaml", "--set", "name=two",
                      cwd=project))  # fmt: skip
    assert json.loads((project / "runs" / "two" / "summary.json").read_text())["processes"] == 2
    assert "completed" in said


def test_a_lora_fine_tune_on_token_ids_trains_and_exports(tiny_presets, chat_records, tmp_path):
    """Token ids written once (here, where TensorFlow is), then fine-tuned, evaluated and
    exported without it; the same preset on text records is refused with the two ways out."""
    data = chat_records()
    tokenised = tmp_path / "tok" / "chat"
    done = run_cli("data", "write", str(data.parent / "chat.jsonl"), str(tokenised), "--tokenize",
                   str(tiny_presets.gemma), "--sequence-length", "24",
                   "--validation-fraction", "0.25")  # fmt: skip
    assert done.returncode == 0, done.stderr
    config = {
        "name": "lm",
        "model": {"preset": str(tiny_presets.gemma), "lora": {"rank": 4}, "sequence_length": 24},
        "data": {"train": f"{tokenised}-train-*", "validation": f"{tokenised}-validation-*"},
        "train": {"per_core_batch_size": 4, "epochs": 2, "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(tmp_path / "runs")},
    }
    path = write_config(tmp_path, config, "lm")
    ok(jax_cli("train", str(path), cwd=tmp_path))
    log = read_log(tmp_path / "runs" / "lm")
    assert float(log[-1]["loss"]) < float(log[0]["loss"])
    ok(jax_cli("evaluate", str(tmp_path / "runs" / "lm"), cwd=tmp_path))
    ok(jax_cli("export", str(tmp_path / "runs" / "lm"), "--format", "lora", "--output",
               str(tmp_path / "a.lora.h5"), cwd=tmp_path))  # fmt: skip

    text = {**config, "name": "text",
            "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")}}  # fmt: skip
    err = refused(jax_cli("train", str(write_config(tmp_path, text, "text")), cwd=tmp_path))
    assert "tensorflow-text" in err
    assert "pip install 'tpurun[hub]'" in err and "--tokenize" in err
    # And tokenising itself, which runs KerasHub's tokenizer: refused the same way, nothing made.
    err = refused(jax_cli("data", "write", str(data.parent / "chat.jsonl"), "again", "--tokenize",
                          str(tiny_presets.gemma), cwd=tmp_path))  # fmt: skip
    assert err.startswith(f"error: --tokenize {tiny_presets.gemma}: KerasHub's tokenizers run on")
    assert "pip install 'tpurun[hub]'" in err and "training on token ids needs no TensorFlow" in err
    assert not list(tmp_path.glob("again*"))
