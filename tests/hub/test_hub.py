"""KerasHub presets as models: the preset folder checked, the task built (sequence length, LoRA,
kwargs), compiled with KerasHub's own loss, counted by ``tpurun config``, checked by doctor, and
every bad input answered with exit 2 and what to do.

The presets are tests/hub_presets.py's tiny Gemma causal LM, BERT classifier and ResNet image
classifier, built once per session (the ``tiny_presets`` fixture). Training them is tested where
the fit loop is.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from helpers import run_cli, toy_config, write_config
from hub_presets import BERT_MAX_SEQUENCE_LENGTH, GEMMA_SEQUENCE_LENGTH
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app
from tpurun.errors import ConfigError, EnvironmentSetupError, ModelError
from tpurun.hub import preset as presets
from tpurun.hub.task_model import build_preprocessor, build_task, lora_layers, parameter_counts
from tpurun.training.model import build_model, compile_model

runner = CliRunner()


def preset_config(tmp_path: Path, preset: str | Path, **model) -> dict:
    """The toy data's config with a preset for its model (``tpurun config`` reads the data, not
    the model's inputs)."""
    config = toy_config(tmp_path / "data", tmp_path / "runs")
    config["model"] = {"preset": str(preset), **model}
    return config


def loaded(tmp_path: Path, preset: str | Path, **model):
    return tpurun.load_config(preset_config(tmp_path, preset, **model))


def size(variables) -> int:
    return sum(math.prod(v.shape) for v in variables)


def config_command(tmp_path, toy_data, preset, *options, **model):
    """``tpurun config`` (in this process) on a preset config of the toy data."""
    config = toy_config(toy_data, tmp_path / "runs")
    config["model"] = {"preset": str(preset), **model}
    path = write_config(tmp_path, config, "hub")
    return runner.invoke(app, ["config", str(path), *options])


def refused(result, *words: str) -> str:
    """The message of a command that exited 2, checked for ``words``."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.output, result.output
    return result.output


# ----------------------------------------------------------------------------- the presets
def test_the_tiny_presets_are_read_as_saved(tiny_presets):
    gemma = presets.read_folder(tiny_presets.gemma)
    assert (gemma.backbone, gemma.saved_task, gemma.tasks) == ("GemmaBackbone", "GemmaCausalLM",
                                                               ["CausalLM"])  # fmt: skip
    assert gemma.max_sequence_length is None  # rotary position embeddings: nothing bounds it
    bert = presets.read_folder(tiny_presets.bert)
    assert (bert.backbone, bert.saved_task) == ("BertBackbone", "BertTextClassifier")
    assert bert.max_sequence_length == BERT_MAX_SEQUENCE_LENGTH
    assert bert.default_task() == "BertTextClassifier"
    resnet = presets.read_folder(tiny_presets.resnet)
    assert (resnet.backbone, resnet.saved_task) == ("ResNetBackbone", "ResNetImageClassifier")


def test_a_backbone_serving_several_tasks_needs_model_task(tiny_presets, tmp_path):
    folder = shutil.copytree(tiny_presets.bert, tmp_path / "bert")
    (folder / "task.json").unlink()  # saved as a backbone alone: MaskedLM, TextClassifier, ...
    with pytest.raises(ModelError, match="set model.task to the one to fine-tune"):
        presets.read_folder(folder).default_task()
    task = build_task(loaded(tmp_path, folder, task="TextClassifier", kwargs={"num_classes": 2}))
    assert type(task).__name__ == "BertTextClassifier"


# ----------------------------------------------------------------------------- the task
def test_build_model_builds_the_task_the_preset_was_saved_as(tiny_presets, tmp_path):
    model = build_model(loaded(tmp_path, tiny_presets.gemma), "jax")
    assert type(model).__name__ == "GemmaCausalLM"
    assert model.preprocessor.sequence_length == GEMMA_SEQUENCE_LENGTH
    # The preset's weights, not fresh ones: greedy decoding agrees with the preset loaded by hand.
    keras_hub = tpurun.frameworks.keras_hub()
    own = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    for mine, theirs in zip(model.weights, own.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


def test_a_generic_task_class_builds_the_presets_own(tiny_presets, tmp_path):
    model = build_task(loaded(tmp_path, tiny_presets.gemma, task="CausalLM"))
    assert type(model).__name__ == "GemmaCausalLM"


def test_lora_rank_4_leaves_only_the_adapters_trainable(tiny_presets, tmp_path):
    model = build_model(loaded(tmp_path, tiny_presets.gemma, lora={"rank": 4}), "jax")
    trainable = model.trainable_weights
    names = sorted(v.path.rsplit("/", 1)[-1] for v in trainable)
    # Query and value of both blocks: A and B each. Gemma's output layer is its token embedding
    # (frozen with the backbone), so nothing else trains.
    assert names == ["lora_kernel_a"] * 4 + ["lora_kernel_b"] * 4
    expected = 0
    for layer in lora_layers(model.backbone):
        kernel = layer._kernel.shape  # the frozen one (layer.kernel is the merged tensor)
        expected += math.prod(kernel[:-1]) * 4 + 4 * kernel[-1]
    counts = parameter_counts(model)
    assert counts.trainable == size(trainable) == expected
    base = json.loads((tiny_presets.gemma / "metadata.json").read_text())["parameter_count"]
    assert counts.total == base + expected


def test_lora_on_the_classifier_keeps_its_new_head_trainable(tiny_presets, tmp_path):
    model = build_task(
        loaded(tmp_path, tiny_presets.bert, lora={"rank": 2}, kwargs={"num_classes": 3})
    )
    paths = {v.path for v in model.trainable_weights}
    # KerasHub's enable_lora freezes the backbone's kernels but the adapted layers' biases; the
    # classifier's head is outside the backbone and trains whole.
    assert {"logits/kernel", "logits/bias"} <= paths
    rest = paths - {"logits/kernel", "logits/bias"}
    assert rest and all(p.endswith(("lora_kernel_a", "lora_kernel_b", "/bias")) for p in rest)
    assert all(("/query/" in p or "/value/" in p) for p in rest)


def test_lora_alpha_scales_the_adapters_update(tiny_presets, tmp_path):
    model = build_task(loaded(tmp_path, tiny_presets.gemma, lora={"rank": 4, "alpha": 8}))
    adapted = lora_layers(model.backbone)
    assert adapted and {layer.lora_alpha for layer in adapted} == {8}
    layer = adapted[0]
    layer.lora_kernel_b.assign(np.ones(layer.lora_kernel_b.shape, "float32"))
    update = np.asarray(layer.kernel) - np.asarray(layer._kernel)
    a_b = np.einsum(
        "...r,rk->...k", np.asarray(layer.lora_kernel_a), np.ones(layer.lora_kernel_b.shape)
    )
    np.testing.assert_allclose(update, 2.0 * a_b, rtol=1e-5, atol=1e-6)  # alpha / rank = 2


def test_bfloat16_weights_with_float32_adapters(tiny_presets, tmp_path):
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy("bfloat16")  # what runtime.precision: bfloat16 sets
    try:
        model = build_task(loaded(tmp_path, tiny_presets.gemma, lora={"rank": 4}))
    finally:
        keras.config.set_dtype_policy(before)
    dtypes = {v.path.rsplit("/", 1)[-1]: v.dtype for v in model.weights}
    assert dtypes["lora_kernel_a"] == dtypes["lora_kernel_b"] == "float32"
    assert dtypes["embeddings"] == "bfloat16"


def test_the_classifier_takes_num_classes_through_kwargs(tiny_presets, tmp_path):
    model = build_model(loaded(tmp_path, tiny_presets.bert, kwargs={"num_classes": 3}), "jax")
    logits = model.predict(np.array(["the cat eats an apple today.", "a fox reads."]), verbose=0)
    assert logits.shape == (2, 3)


def test_sequence_length_sets_the_preprocessors(tiny_presets, tmp_path):
    config = loaded(tmp_path, tiny_presets.gemma, sequence_length=12)
    model = build_task(config)
    assert model.preprocessor.sequence_length == 12
    x, y, weights = model.preprocessor(["the cat eats an apple today."])
    assert x["token_ids"].shape == (1, 12) and y.shape == (1, 12)
    preprocessor = build_preprocessor(config)  # alone, without the model's weights
    assert type(preprocessor).__name__ == "GemmaCausalLMPreprocessor"
    assert preprocessor.sequence_length == 12
    again, _, _ = preprocessor(["the cat eats an apple today."])
    np.testing.assert_array_equal(np.asarray(again["token_ids"]), np.asarray(x["token_ids"]))


def test_compile_keeps_kerashubs_loss_under_the_configs_optimizer(tiny_presets, toy_data, tmp_path):
    from tpurun.plan.prepare import prepare_here

    config = tpurun.load_config(
        {**toy_config(toy_data, tmp_path), "model": {"preset": str(tiny_presets.gemma),
                                                      "optimizer": "sgd", "lora": {"rank": 4}}}
    )  # fmt: skip
    plan = prepare_here(config).plan
    model = build_model(config, "jax")
    note = compile_model(model, config, plan)
    assert note.startswith("KerasHub compiled GemmaCausalLM (Adam, loss ")
    assert "the config's model.optimizer replace(s) KerasHub's" in note
    assert isinstance(model.optimizer, keras.optimizers.SGD)
    loss = model._compile_config.config["loss"]
    assert isinstance(loss, keras.losses.SparseCategoricalCrossentropy) and loss.from_logits
    before = np.asarray(model.backbone.token_embedding.embeddings)
    # The task's preprocessor makes the labels (the next tokens) and weights (padding out).
    text = np.array(["the cat eats an apple today.", "a dog sees the blue sky."])
    logs = model.train_on_batch(text, return_dict=True)
    assert np.isfinite(logs["loss"]) and "sparse_categorical_accuracy" in logs
    np.testing.assert_array_equal(before, np.asarray(model.backbone.token_embedding.embeddings))


def test_compile_gives_a_classifier_kerashubs_adam_at_tpuruns_rate(
    tiny_presets, toy_data, tmp_path
):
    from tpurun.plan.prepare import prepare_here

    config = tpurun.load_config(
        {**toy_config(toy_data, tmp_path), "model": {"preset": str(tiny_presets.bert)}}
    )
    plan = prepare_here(config).plan
    model = build_model(config, "jax")
    note = compile_model(model, config, plan)
    assert "KerasHub's optimizer/loss/metrics kept (left out of the config)" in note
    assert isinstance(model.optimizer, keras.optimizers.Adam)
    assert float(model.optimizer.learning_rate) == pytest.approx(plan.learning_rate)
    loss = model._compile_config.config["loss"]
    assert isinstance(loss, keras.losses.SparseCategoricalCrossentropy) and loss.from_logits
    text = np.array(["the cat eats an apple today.", "a dog sees the blue sky."])
    logs = model.train_on_batch(text, np.array([0, 1]), return_dict=True)
    assert np.isfinite(logs["loss"]) and "sparse_categorical_accuracy" in logs


# ---------------------------------------------------------------------------- tpurun config
def test_tpurun_config_shows_the_preset_and_its_parameters(tiny_presets, toy_data, tmp_path):
    full = config_command(tmp_path, toy_data, tiny_presets.gemma, "--json")
    assert full.exit_code == 0, full.output
    derived = json.loads(full.stdout)["derived"]
    assert derived["preset"] == {
        "location": str(tiny_presets.gemma), "task": "GemmaCausalLM", "backbone": "GemmaBackbone",
        "sequence_length": GEMMA_SEQUENCE_LENGTH, "max_sequence_length": None, "lora": None,
    }  # fmt: skip
    real = parameter_counts(build_task(loaded(tmp_path, tiny_presets.gemma, lora={"rank": 4})))
    assert (
        derived["parameters"]["total"]
        == derived["parameters"]["trainable"]
        == real.total - real.trainable
    )
    lora = config_command(tmp_path, toy_data, tiny_presets.gemma, "--json", lora={"rank": 4},
                          sequence_length=16)  # fmt: skip
    derived = json.loads(lora.stdout)["derived"]
    assert derived["parameters"] == real.to_dict()
    assert (derived["preset"]["sequence_length"], derived["preset"]["lora"]) == (
        16,
        {"rank": 4, "alpha": 4},
    )
    shown = config_command(tmp_path, toy_data, tiny_presets.gemma, lora={"rank": 4}).stdout
    assert "  preset:\n" in shown and "    task: GemmaCausalLM\n" in shown
    assert f"  parameters:\n    total: {real.total}\n    trainable: {real.trainable}\n" in shown


def test_a_relative_preset_starts_at_the_config_files_folder(tiny_presets, toy_data, tmp_path):
    folder = tmp_path / "experiments" / "one"
    folder.mkdir(parents=True)
    relative = os.path.relpath(tiny_presets.bert, folder)
    config = toy_config(toy_data, tmp_path / "runs")
    config["model"] = {"preset": relative, "kwargs": {"num_classes": 2}}
    result = runner.invoke(app, ["config", str(write_config(folder, config)), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["derived"]["preset"]["location"] == str(tiny_presets.bert)
    # As a run directory's config.yaml keeps it: absolute, so that the run opens from anywhere.
    assert Path(shown["model"]["preset"]).resolve() == tiny_presets.bert.resolve()


@pytest.mark.slow
def test_tpurun_config_counts_a_preset_in_its_own_process(tiny_presets, toy_data, tmp_path):
    # The console script: tpurun config sets its own process up on the CPU to count.
    config = toy_config(toy_data, tmp_path / "runs")
    config["model"] = {"preset": str(tiny_presets.gemma), "lora": {"rank": 4}}
    result = run_cli("config", str(write_config(tmp_path, config, "hub")), "--json")
    assert result.returncode == 0, result.stderr
    real = parameter_counts(build_task(tpurun.load_config(config)))
    assert json.loads(result.stdout)["derived"]["parameters"] == real.to_dict()


# ------------------------------------------------------------------------------- bad input
def test_a_preset_folder_that_does_not_exist(toy_data, tmp_path):
    result = config_command(tmp_path, toy_data, tmp_path / "no-such-preset")
    refused(result, f"model.preset: no folder {tmp_path / 'no-such-preset'}",
            "attach the model as an input")  # fmt: skip
    result = config_command(tmp_path, toy_data, "gemma_2b_en")
    refused(result, "kaggle://keras/<model>/keras/gemma_2b_en")


@pytest.mark.parametrize(
    "missing",
    ["config.json", "metadata.json", "model.weights.h5", "assets/tokenizer/vocabulary.spm"],
)
def test_a_preset_missing_a_file_names_it(tiny_presets, toy_data, tmp_path, missing):
    folder = shutil.copytree(tiny_presets.gemma, tmp_path / "gemma")
    (folder / missing).unlink()
    result = config_command(tmp_path, toy_data, folder)
    refused(result, f"model.preset: {folder} has no {missing}", "Copy the whole preset folder")


def test_train_refuses_an_incomplete_preset_before_writing_anything(
    tiny_presets, toy_data, tmp_path
):
    folder = shutil.copytree(tiny_presets.gemma, tmp_path / "gemma")
    (folder / "metadata.json").unlink()
    config = toy_config(toy_data, tmp_path / "runs")
    config["model"] = {"preset": str(folder)}
    with pytest.raises(ModelError, match=f"{folder} has no metadata.json"):
        tpurun.train(config, verbose=False)
    assert not (tmp_path / "runs" / config["name"]).exists()


def test_a_bert_preset_missing_its_wordpiece_vocabulary(tiny_presets, tmp_path):
    folder = shutil.copytree(tiny_presets.bert, tmp_path / "bert")
    (folder / "assets" / "tokenizer" / "vocabulary.txt").unlink()
    with pytest.raises(ModelError, match="has no assets/tokenizer/vocabulary.txt"):
        build_task(loaded(tmp_path, folder))


def test_a_task_that_does_not_fit_the_preset(tiny_presets, toy_data, tmp_path):
    result = config_command(tmp_path, toy_data, tiny_presets.gemma, task="BertTextClassifier")
    refused(result, "model.task: BertTextClassifier does not fit the preset",
            "is built on BertBackbone, and the preset holds a GemmaBackbone",
            "Leave model.task out to build GemmaCausalLM")  # fmt: skip
    result = config_command(tmp_path, toy_data, tiny_presets.bert, task="CausalLM")
    refused(result, "CausalLM has no subclass for it", "BertTextClassifier")
    result = config_command(tmp_path, toy_data, tiny_presets.gemma, task="GemmaCausalLm")
    refused(result, "model.task: KerasHub", "has no task class 'GemmaCausalLm'",
            "Did you mean 'GemmaCausalLM'?")  # fmt: skip


def test_lora_on_a_backbone_with_nothing_to_adapt(tiny_presets, toy_data, tmp_path):
    result = config_command(tmp_path, toy_data, tiny_presets.resnet, lora={"rank": 4})
    refused(result, "model.lora: ResNetBackbone has no layer LoRA can adapt",
            "Remove model.lora")  # fmt: skip


def test_lora_on_a_backbone_without_enable_lora(tiny_presets, tmp_path, monkeypatch):
    keras_hub = tpurun.frameworks.keras_hub()
    monkeypatch.delattr(keras_hub.models.Backbone, "enable_lora")  # as a non-KerasHub backbone
    with pytest.raises(
        ModelError, match="backbone GemmaBackbone has no enable_lora: remove model.lora"
    ):
        build_task(loaded(tmp_path, tiny_presets.gemma, lora={"rank": 4}))


def test_a_sequence_length_over_the_backbones_maximum(tiny_presets, toy_data, tmp_path):
    result = config_command(tmp_path, toy_data, tiny_presets.bert, sequence_length=64)
    refused(result, f"model.sequence_length: 64 is over the longest sequence BertBackbone takes "
            f"({BERT_MAX_SEQUENCE_LENGTH}", f"set it to {BERT_MAX_SEQUENCE_LENGTH} or less")  # fmt: skip
    result = config_command(tmp_path, toy_data, tiny_presets.resnet, sequence_length=8)
    refused(
        result, "model.sequence_length: ResNetImageClassifier has", "remove model.sequence_length"
    )


def test_kwargs_the_task_does_not_take(tiny_presets, toy_data, tmp_path):
    # KerasHub itself would ignore both without a word.
    result = config_command(tmp_path, toy_data, tiny_presets.gemma, kwargs={"num_classes": 2})
    refused(
        result,
        "model.kwargs: GemmaCausalLM.from_preset takes no 'num_classes'; what it takes: name.",
    )
    result = config_command(tmp_path, toy_data, tiny_presets.bert, kwargs={"num_clases": 2})
    refused(result, "BertTextClassifier.from_preset takes no 'num_clases'",
            "Did you mean 'num_classes'?")  # fmt: skip
    result = config_command(tmp_path, toy_data, tiny_presets.gemma, kwargs={"dtype": "bfloat16"})
    refused(result, "model.kwargs.dtype: set runtime.precision instead")


def test_preset_only_keys_with_a_factory(toy_data, tmp_path):
    for key, value in (("lora", {"rank": 4}), ("sequence_length", 8), ("task", "CausalLM")):
        config = toy_config(toy_data, tmp_path / "runs", model={key: value})
        with pytest.raises(ConfigError, match=f"model.{key} .* applies to a model.preset; "
                           f"model.factory builds its own model: remove model.{key}"):  # fmt: skip
            tpurun.load_config(config)
    config = toy_config(toy_data, tmp_path / "runs", model={"preset": "somewhere"})
    with pytest.raises(ConfigError, match="set one of model.factory .* both are set"):
        tpurun.load_config(config)


def test_kerashub_not_installed_names_the_extra(tiny_presets, toy_data, tmp_path, monkeypatch):
    # What an environment without keras-hub meets: its import fails.
    monkeypatch.setitem(sys.modules, "keras_hub", None)
    result = config_command(tmp_path, toy_data, tiny_presets.gemma)
    refused(result, "model.preset needs KerasHub, which is not installed",
            "pip install 'tpurun[hub]'")  # fmt: skip
    with pytest.raises(EnvironmentSetupError, match=r"tpurun\[hub\]"):
        build_model(loaded(tmp_path, tiny_presets.gemma), "jax")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("handle", "variable"),
    [("kaggle://keras/gemma/keras/gemma_2b_en/2", "KAGGLE_API_ENDPOINT"),
     ("hf://google/gemma-2b", "HF_ENDPOINT")],
)  # fmt: skip
def test_a_handle_without_a_network(toy_data, tmp_path, monkeypatch, handle, variable):
    # The hub's endpoint is a port nobody listens on, as an offline machine's would fail; the
    # answer comes from one refused connection, not the hub client's retries.
    monkeypatch.setenv(variable, f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.delenv("KAGGLE_KERNEL_RUN_TYPE", raising=False)
    result = config_command(tmp_path, toy_data, handle)
    refused(result, f"model.preset: {handle} is downloaded from", "cannot be reached from here",
            "attach the model as a Kaggle input", "set model.preset to its folder")  # fmt: skip


def serve_from(folder: Path):
    """kagglehub.model_download as a Kaggle notebook with the model attached answers: from a folder."""

    def model_download(handle: str, path: str | None = None, **_) -> str:
        if path is not None and not (folder / path).is_file():
            raise ValueError(f"'{path}' is not present in the model files")
        return str(folder / path) if path else str(folder)

    return model_download


def test_a_kaggle_handle_is_checked_and_built_as_a_folder_is(tiny_presets, tmp_path, monkeypatch):
    import kagglehub

    handle = "kaggle://tpurun/tiny-gemma/keras/tiny/1"
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")  # kagglehub reaches attached models
    monkeypatch.setattr(kagglehub, "model_download", serve_from(tiny_presets.gemma))
    preset = presets.read(loaded(tmp_path, handle))
    assert (preset.remote, preset.backbone, preset.saved_task) == (
        True,
        "GemmaBackbone",
        "GemmaCausalLM",
    )
    model = build_task(loaded(tmp_path, handle, lora={"rank": 4}, sequence_length=16))
    assert type(model).__name__ == "GemmaCausalLM" and model.preprocessor.sequence_length == 16
    with pytest.raises(ModelError, match="does not fit the preset kaggle://"):
        build_task(loaded(tmp_path, handle, task="BertTextClassifier"))
    monkeypatch.setattr(kagglehub, "model_download", serve_from(tiny_presets.bert))
    with pytest.raises(ModelError, match="over the longest sequence BertBackbone takes"):
        presets.read(loaded(tmp_path, handle, sequence_length=64))


def test_a_handle_whose_download_fails(tmp_path, monkeypatch):
    import kagglehub
    import requests

    def offline(handle, path=None, **_):
        raise requests.exceptions.ConnectionError("Failed to resolve 'api.kaggle.com'")

    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.setattr(kagglehub, "model_download", offline)
    with pytest.raises(ModelError, match="fetching its config.json failed .* attach the model"):
        presets.read(loaded(tmp_path, "kaggle://keras/gemma/keras/gemma_2b_en/2"))


# ------------------------------------------------------------------------------------ doctor
def test_doctor_checks_the_preset_folder(tiny_presets, tmp_path):
    from tpurun.doctor.preset_check import check_preset

    check = check_preset(loaded(tmp_path, tiny_presets.gemma))
    assert check.status == "ok", check
    assert (
        "complete (GemmaBackbone, saved as GemmaCausalLM); task GemmaCausalLM fits it"
        in check.finding
    )
    folder = shutil.copytree(tiny_presets.gemma, tmp_path / "gemma")
    (folder / "assets" / "tokenizer" / "vocabulary.spm").unlink()
    check = check_preset(loaded(tmp_path, folder))
    assert check.status == "fail" and "has no assets/tokenizer/vocabulary.spm" in check.finding
    check = check_preset(loaded(tmp_path, tiny_presets.bert, task="GemmaCausalLM"))
    assert check.status == "fail" and "does not fit the preset" in check.finding


@pytest.mark.slow
def test_tpurun_doctor_names_the_file_a_preset_misses(tiny_presets, toy_data, tmp_path):
    from tpurun.doctor import run_checks

    folder = shutil.copytree(tiny_presets.gemma, tmp_path / "gemma")
    (folder / "model.weights.h5").unlink()
    config = toy_config(toy_data, tmp_path / "runs")
    config["model"] = {"preset": str(folder)}
    (tmp_path / "dev" / "vfio").mkdir(parents=True)  # a machine without a TPU
    checks = run_checks(config, env={}, dev_root=str(tmp_path / "dev"),
                        lock_path=str(tmp_path / "lock"), gcs_timeout=1)  # fmt: skip
    check = next(c for c in checks if c.name == "model.preset")
    assert check.status == "fail", check
    assert f"{folder} has no model.weights.h5 (the backbone's weights)" in check.finding
    assert check.fix.startswith("copy the whole preset folder")


# --------------------------------------------------------------------- the door, before set-up
@pytest.mark.slow
def test_kerashub_waits_for_activation():
    import subprocess

    code = "from tpurun import frameworks; frameworks.keras_hub()"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert result.returncode == 1
    assert "ImportOrderError" in result.stderr and "KerasHub was asked for" in result.stderr
