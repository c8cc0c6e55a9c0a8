"""evaluate, predict, export and `tpurun.load` on a run with a model axis, whose checkpoints are
sharded Orbax folders (best.orbax, latest-e<E>-s<S>.orbax, pattern-named .orbax).

One full fine-tune of the tiny Gemma with 8 query / 4 key-value heads (tests/hub_presets.py
``gemma_mesh``) under a 2x4 mesh of the 8 simulated CPU devices, trained once for the module, keeps
a folder per epoch beside best and latest; a LoRA fine-tune under the same mesh keeps its adapter
files. evaluate builds the model under the run's mesh (the weights land split); `tpurun.load` on
one device (the weights whole); export gathers to the host, or writes a LoRA adapter alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest
from test_sharded_checkpoints import checkpoint_values
from typer.testing import CliRunner

import tpurun
from tpurun import frameworks
from tpurun.cli.app import app
from tpurun.infer import hub_export, trained_run

runner = CliRunner()
PROMPTS = ["question: what eats the cat?", "question: what reads the child?"]


def _config(root: Path, preset: Path, data: Path, name: str, **sections) -> dict:
    """A fine-tune under a 2x4 mesh: 3 steps an epoch of 8 records, one validation batch."""
    config = {
        "name": name,
        "model": {"preset": str(preset), "sequence_length": 16},
        "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")},
        "train": {"per_core_batch_size": 1, "epochs": 2, "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 8, "mesh": {"data": 2, "model": 4}},
        "output": {"dir": str(root / "runs")},
    }  # fmt: skip
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return config


def _trained(tmp_path_factory, data: Path, preset: Path, name: str, **sections) -> Path:
    folder = tmp_path_factory.mktemp(f"sharded-infer-{name}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TPURUN_CACHE_DIR", str(folder / "cache"))
        config = _config(folder, preset, data, name, **sections)
        assert tpurun.train(config, verbose=False)["status"] == "completed"
    return folder / "runs" / name


@pytest.fixture(scope="module")
def mesh_run(tiny_presets, chat_records, tmp_path_factory) -> Path:
    """Every weight trains (Orbax checkpoints); e1.orbax and e2.orbax kept beside best and latest."""
    return _trained(tmp_path_factory, chat_records(32), tiny_presets.gemma_mesh, "mesh",
                    callbacks={"checkpoint": {"filename": "e{epoch}.keras",
                                              "save_best_only": False}})  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(tiny_presets, chat_records, tmp_path_factory) -> Path:
    return _trained(tmp_path_factory, chat_records(32), tiny_presets.gemma_mesh, "lora",
                    model={"lora": {"rank": 2}},
                    train={"epochs": 1})  # fmt: skip


@pytest.fixture
def built(monkeypatch) -> list:
    """The partition spec of the token embedding of each model a command (or tpurun.load)
    builds."""
    specs = []
    real = trained_run.build

    def spy(*args, **kwargs):
        model = real(*args, **kwargs)
        sharding = model.backbone.token_embedding.embeddings.value.sharding
        specs.append(tuple(getattr(sharding, "spec", ())))  # () on one device
        return model

    monkeypatch.setattr(trained_run, "build", spy)
    return specs


def _state(run: Path, name: str) -> dict:
    return json.loads((run / "checkpoints" / name).read_text())


def _evaluate(run: Path, *args: str) -> dict:
    result = runner.invoke(app, ["evaluate", str(run), "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def _same_as_trained(result: dict, logs: dict) -> None:
    """evaluate's metrics are the validation metrics the run logged with these weights."""
    metrics = result["metrics"]
    assert metrics["perplexity"] == pytest.approx(logs["val_perplexity"], rel=1e-5)
    assert metrics["sparse_categorical_accuracy"] == pytest.approx(
        logs["val_sparse_categorical_accuracy"], abs=1e-6
    )


# ------------------------------------------------------------------------------------- evaluate
def test_evaluate_takes_best_latest_and_a_named_sharded_checkpoint(mesh_run, built):
    names = sorted(p.name for p in (mesh_run / "checkpoints").iterdir())
    assert {"best.orbax", "e1.orbax", "e2.orbax", "latest-e0002-s0000000.orbax"} <= set(names)
    assert (mesh_run / "model.keras").exists()

    best = _evaluate(mesh_run)  # the default: best.orbax, before the final model.keras
    assert best["checkpoint"] == str(mesh_run / "checkpoints" / "best.orbax")
    _same_as_trained(best, _state(mesh_run, "best.json")["logs"])

    latest = _evaluate(mesh_run, "--checkpoint", "latest")
    assert latest["checkpoint"].endswith("latest-e0002-s0000000.orbax")
    assert latest["checkpoint_label"] == "latest (end of epoch 2)"
    _same_as_trained(latest, _state(mesh_run, "latest.json")["logs"])

    first = _evaluate(mesh_run, "--checkpoint", "e1.orbax")
    _same_as_trained(first, _state(mesh_run, "e1.json")["logs"])
    assert first["metrics"]["perplexity"] != pytest.approx(latest["metrics"]["perplexity"])
    # Built under the run's mesh: the embedding split over the model axis, as training had it.
    assert len(built) == 3 and all("model" in spec for spec in built)
    assert keras.distribution.distribution() is None  # released for what the process does next


def test_a_missing_checkpoint_lists_the_sharded_ones(mesh_run):
    result = runner.invoke(app, ["evaluate", str(mesh_run), "--checkpoint", "e9.orbax"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    listed = text.split("There: ")[1].split(". Give")[0].split(", ")
    assert listed[:2] == ["best", "latest"] and listed[-1] == str(mesh_run / "model.keras")
    assert sorted(listed[2:-1]) == ["checkpoints/best.orbax", "checkpoints/e1.orbax",
                                    "checkpoints/e2.orbax"]  # fmt: skip
    assert "checkpoints/latest-e0002" not in text  # the resume point is `latest`
    assert (
        "a model-parallel run's best.orbax" in text and "sharded checkpoint's .orbax folder" in text
    )


def test_a_sharded_checkpoint_of_another_model_exits_2_naming_the_variables(
    mesh_run, tiny_presets, tmp_path
):
    """The tiny Gemma with one key/value head: the same variables, other shapes."""
    from tpurun.training.checkpoints import sharded

    keras_hub = frameworks.keras_hub()
    other = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma), preprocessor=None)
    sharded.save(other, str(tmp_path / "other.orbax"))
    result = runner.invoke(app, ["evaluate", str(mesh_run), "--checkpoint",
                                 str(tmp_path / "other.orbax")])  # fmt: skip
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "other.orbax does not fit this model (" in text and "Traceback" not in text
    assert "decoder_block_0/attention/key/kernel: float32[1, 64, 16] in the checkpoint, " \
           "float32[4, 64, 16] here" in text  # fmt: skip
    assert "A checkpoint only fits the model it was trained as" in text


# -------------------------------------------------------------------------------------- predict
def _completions(run: Path, output: Path, checkpoint: str) -> tuple[dict, list[str]]:
    import yaml

    data = yaml.safe_load((run / "config.yaml").read_text())["data"]["validation"]  # as trained
    result = runner.invoke(app, ["predict", str(run), "--data", data, "--output", str(output),
                                 "--checkpoint", checkpoint, "--max-length", "20", "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    return json.loads(result.output), [row["completion"] for row in rows]


def test_predict_from_the_latest_sharded_checkpoint(mesh_run, built, tmp_path):
    """The resume point at the end of the run holds the final model's weights: the same greedy
    completions as model.keras, both built under the mesh."""
    shown, completions = _completions(mesh_run, tmp_path / "a.jsonl", "latest")
    assert shown["checkpoint"].endswith("latest-e0002-s0000000.orbax") and shown["rows"] == 8
    _, final = _completions(mesh_run, tmp_path / "b.jsonl", "model.keras")
    assert completions == final
    assert len(built) == 2 and all("model" in spec for spec in built)


# ----------------------------------------------------------------------------------------- load
def test_load_restores_best_orbax_whole_on_one_device(mesh_run):
    task, spec = tpurun.load(str(mesh_run))
    assert keras.distribution.distribution() is None and spec["inputs"] == "prompt"
    stored = checkpoint_values(mesh_run / "checkpoints" / "best.orbax")
    for i, variable in enumerate(task.weights):
        assert len(variable.value.sharding.device_set) == 1, variable.path
        np.testing.assert_array_equal(np.asarray(variable.value), stored[f"model/{i:04d}"],
                                      err_msg=variable.path)  # fmt: skip
    first, _ = tpurun.load(str(mesh_run), "checkpoints/e1.orbax")
    stored = checkpoint_values(mesh_run / "checkpoints" / "e1.orbax")
    for i, variable in enumerate(first.weights):
        np.testing.assert_array_equal(np.asarray(variable.value), stored[f"model/{i:04d}"],
                                      err_msg=variable.path)  # fmt: skip


# --------------------------------------------------------------------------------------- export
def _exported(run: Path, fmt: str, output: Path) -> dict:
    result = runner.invoke(app, ["export", str(run), "--format", fmt, "--output", str(output),
                                 "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    sidecar = json.loads(Path(f"{output}.json").read_text())
    assert sidecar["checked"]["loaded_without_tpurun"]
    assert sidecar["checked"]["max_abs_diff"] <= sidecar["checked"]["tolerance"]
    return sidecar


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["keras", "saved_model"])
def test_export_gathers_a_mesh_run_to_the_host(fmt, mesh_run, built, tmp_path):
    """Built and restored under the mesh, written whole: the artifact predicts what the run's
    best.orbax restored on one device predicts."""
    tf = frameworks.tensorflow()
    output = tmp_path / ("model.keras" if fmt == "keras" else "served")
    sidecar = _exported(mesh_run, fmt, output)
    assert sidecar["checkpoint"] == str(mesh_run / "checkpoints" / "best.orbax")
    assert built and "model" in built[0]
    tuned, _ = tpurun.load(str(mesh_run))
    if fmt == "keras":
        got = keras.saving.load_model(str(output), compile=False).predict(PROMPTS, verbose=0)
        want = tuned.predict(PROMPTS, verbose=0)
    else:
        tokens, _, _ = keras.utils.unpack_x_y_sample_weight(tuned.preprocessor(PROMPTS))
        tokens = {k: keras.ops.convert_to_numpy(v) for k, v in tokens.items()}
        served = tf.saved_model.load(str(output))  # kept: its function holds the variables
        got = served.serve(tokens).numpy()
        want = keras.ops.convert_to_numpy(tuned(tokens))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4)


@pytest.mark.slow
def test_export_a_lora_runs_adapter_alone_under_the_mesh(lora_run, tiny_presets, monkeypatch,
                                                          tmp_path):  # fmt: skip
    """The adapter is written from the task built under the mesh, its base still split over the
    devices; it loads onto the preset by hand and predicts what the run's model predicts."""
    keras_hub = frameworks.keras_hub()
    names = sorted(p.name for p in (lora_run / "checkpoints").iterdir())
    assert "best.adapter.h5" in names and not any(n.endswith(".orbax") for n in names)
    bases = []
    real = hub_export.write

    def spy(fmt, ref, artifact, platforms):
        kernel = {v.path: v for v in ref.model.weights}["decoder_block_0/attention/query/kernel"]
        bases.append(tuple(kernel.value.sharding.spec))
        return real(fmt, ref, artifact, platforms)

    monkeypatch.setattr(hub_export, "write", spy)
    output = tmp_path / "adapter.lora.h5"
    _exported(lora_run, "lora", output)
    assert len(bases) == 1 and "model" in bases[0]  # the base was not gathered to write it
    tuned, _ = tpurun.load(str(lora_run))
    task = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma_mesh))
    task.backbone.enable_lora(2)
    task.backbone.load_lora_weights(str(output))
    task.preprocessor.sequence_length = 16
    np.testing.assert_allclose(np.asarray(task.predict(PROMPTS, verbose=0)),
                               np.asarray(tuned.predict(PROMPTS, verbose=0)), atol=1e-5)  # fmt: skip
