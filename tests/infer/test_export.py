"""tpurun export: a model trained on JAX (8 simulated devices) as a SavedModel and as ONNX, each
loaded in a fresh process that never imports tpurun, matching the checkpoint it was made from
within 1e-5 (the latest resume point, a weights file given by path); a .keras file whose custom
layer travels with a loader; a mismatch (keras, ONNX) leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import HAS_TENSORFLOW, cli_env, run_cli
from trained import in_file_order, train_toy
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app
from tpurun.errors import TpurunError

runner = CliRunner()


def _without_tpurun(script: str, x, backend: str = "tensorflow") -> np.ndarray:
    """Run ``script`` in a fresh Python (it reads ``x.npy``, writes ``y.npy``); it fails if
    anything imported tpurun."""
    folder = os.path.dirname(script)
    np.save(os.path.join(folder, "x.npy"), x)
    check = "\nimport sys\nassert 'tpurun' not in sys.modules, 'tpurun was imported'\n"
    with open(script, "a") as f:
        f.write(check)
    env = cli_env(KERAS_BACKEND=backend)
    done = subprocess.run([sys.executable, "-I", script], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(os.path.join(folder, "y.npy"))


def _script(folder, name: str, body: str) -> str:
    path = folder / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.mark.slow
def test_saved_model_and_onnx_load_without_tpurun(trained_toy_run, tmp_path):
    """Both through the CLI: the SavedModel from the latest resume point by the console script
    (its backend is the run's, JAX, not the one auto would pick there for 8 CPU devices), the
    ONNX file from a weights file given by path; each loaded without tpurun computes what Keras
    computes with those weights."""
    run_dir, test_glob = trained_toy_run.run_dir, trained_toy_run.unlabeled_glob
    other = trained_toy_run.altered_weights(tmp_path / "other.weights.h5")
    out = tmp_path / "export"
    saved = run_cli("export", str(run_dir), "--format", "saved_model", "--checkpoint", "latest",
                    "--output", str(out / "saved_model"), "--json")  # fmt: skip
    assert saved.returncode == 0, saved.stderr
    shown = json.loads(saved.stdout)
    assert (shown["backend"], shown["platforms"]) == ("jax", ["cpu", "cuda"])
    assert shown["checkpoint_label"] == "latest (end of epoch 1)"
    onnx = runner.invoke(app, ["export", str(run_dir), "--format", "onnx", "--checkpoint",
                               str(other), "-o", str(out / "model.onnx"), "--json"])  # fmt: skip
    assert onnx.exit_code == 0, onnx.output
    onnx = json.loads(onnx.output)
    assert onnx["checkpoint"] == str(other) and onnx["format"] == "onnx"
    _, x, _ = in_file_order(test_glob)
    model, spec = tpurun.load(str(run_dir))
    expected = model.predict(x, batch_size=len(x), verbose=0)  # one epoch: latest is best
    model.load_weights(str(other))
    altered = model.predict(x, batch_size=len(x), verbose=0)
    assert np.abs(altered - expected).max() > 1e-2

    sidecar = json.loads((out / "saved_model.json").read_text())
    assert sidecar["inputs"] == [{"name": "x", "shape": [None, 8], "dtype": "float32",
                                  "feature": "x"}]  # fmt: skip
    assert sidecar["data"]["features"]["x"] == {"type": "raw", "dtype": "float32", "shape": [8]}
    assert sidecar["data"] == spec and sidecar["checked"]["loaded_without_tpurun"]
    assert sorted(p.name for p in out.iterdir()) == ["model.onnx", "model.onnx.json",
                                                      "saved_model", "saved_model.json"]  # fmt: skip
    got = _without_tpurun(_script(tmp_path, "load_saved_model.py", """
        import numpy as np
        import tensorflow as tf
        from tensorflow.core.protobuf import saved_model_pb2

        model = tf.saved_model.load("export/saved_model")
        np.save("y.npy", model.serve(tf.constant(np.load("x.npy"))).numpy())
        # jax2tf's native serialization: lowered for the platforms asked for, not just this one
        proto = saved_model_pb2.SavedModel()
        proto.ParseFromString(open("export/saved_model/saved_model.pb", "rb").read())
        platforms = {tuple(node.attr["platforms"].list.s)
                     for function in proto.meta_graphs[0].graph_def.library.function
                     for node in function.node_def if node.op == "XlaCallModule"}
        assert platforms == {(b"CPU", b"CUDA")}, platforms
    """), x)  # fmt: skip
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)

    assert onnx["checked"]["max_abs_diff"] <= 1e-5
    got = _without_tpurun(_script(tmp_path, "load_onnx.py", """
        import numpy as np
        import onnxruntime as ort

        session = ort.InferenceSession("export/model.onnx")
        name = session.get_inputs()[0].name
        np.save("y.npy", session.run(None, {name: np.load("x.npy")})[0])
    """), x)  # fmt: skip
    np.testing.assert_allclose(got, altered, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_an_onnx_file_that_computes_something_else_leaves_nothing(trained_toy_run, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    from tpurun.infer import formats as export_formats

    real = export_formats.write_onnx

    def altered(model, path):  # an artifact that no longer computes what was trained
        model.layers[-1].kernel.assign(model.layers[-1].kernel + 0.5)
        return real(model, path)

    monkeypatch.setattr(export_formats, "write_onnx", altered)
    out = tmp_path / "out"
    result = runner.invoke(app, ["export", str(trained_toy_run.run_dir), "--format", "onnx",
                                 "-o", str(out / "model.onnx")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "the onnx artifact's outputs differ from the trained model's" in result.output
    assert "Traceback" not in result.output
    assert list(out.iterdir()) == []  # the folder made for it stays, with nothing in it


CUSTOM = '''
import keras


class Scale(keras.layers.Layer):
    """A layer of the user's own: plain load_model cannot find it in another process."""

    def __init__(self, factor=2.0, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, inputs):
        return inputs * self.factor

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


def scaled_mlp():
    inputs = keras.Input(shape=(8,), name="x")
    hidden = Scale(0.5)(keras.layers.Dense(8, activation="relu")(inputs))
    return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(hidden))
'''


@pytest.mark.slow
def test_keras_format_carries_custom_code_and_a_mismatch_leaves_nothing(tmp_path, monkeypatch):
    from tpurun.infer import formats as export_formats

    code = tmp_path / "code" / "custom_model.py"
    code.parent.mkdir()
    code.write_text(CUSTOM)
    run_dir = train_toy(tmp_path / "train", model={"factory": f"{code}:scaled_mlp"})
    out = tmp_path / "export"
    result = tpurun.export(str(run_dir), "keras", str(out / "model.keras"))
    assert sorted(p.name for p in out.iterdir()) == [
        "model.keras", "model.keras.json", "model_code", "model_loader.py"]  # fmt: skip
    assert result["loader"] == "model_loader.py"
    x = np.random.default_rng(0).normal(size=(5, 8)).astype("float32")
    expected = tpurun.load(str(run_dir)).model.predict(x, verbose=0)
    away = code.rename(code.with_suffix(".away"))  # the export carries its own copy
    got = _without_tpurun(_script(tmp_path, "load_keras.py", """
        import sys
        import numpy as np
        sys.path.insert(0, "export")
        import model_loader

        np.save("y.npy", model_loader.load().predict(np.load("x.npy"), verbose=0))
    """), x, backend="jax")  # fmt: skip
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    away.rename(code)

    real = export_formats.write_keras

    def altered(model, path, config):  # an artifact that no longer computes what was trained
        model.layers[-1].kernel.assign(model.layers[-1].kernel + 0.5)
        return real(model, path, config)

    monkeypatch.setattr(export_formats, "write_keras", altered)
    again = tmp_path / "again"
    with pytest.raises(TpurunError, match="outputs differ from the trained model's"):
        tpurun.export(str(run_dir), "keras", str(again / "model.keras"))
    assert list(again.iterdir()) == []


@pytest.mark.skipif(not HAS_TENSORFLOW, reason="a SavedModel export needs TensorFlow")
@pytest.mark.parametrize(
    "platforms, message",
    [("cpu,gpu", "unknown: gpu"), ("cuda", "include cpu (e.g. cpu,cuda)")],
)
def test_platforms_are_checked(trained_toy_run, tmp_path, platforms, message):
    run_dir = trained_toy_run.run_dir
    args = ["export", str(run_dir), "--format", "saved_model", "--output", str(tmp_path / "m"),
            "--platforms", platforms]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "m").exists()
