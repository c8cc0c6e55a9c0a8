"""Fine-tuning the tiny presets with `tpurun train`: text records tokenised in the pipeline by the
preset's own preprocessor, prompt tokens weighted 0, LoRA training only the adapter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import read_log, write_config, write_jsonl
from hub_presets import sentences
from typer.testing import CliRunner

from tpurun import frameworks
from tpurun.cli.app import app
from tpurun.config import DataConfig
from tpurun.data import pipeline
from tpurun.data.resolve import preset_refs
from tpurun.errors import ConfigError
from tpurun.hub import batches
from tpurun.hub.task_model import enable_lora, lora_layers
from tpurun.training.checkpoints import adapter

runner = CliRunner()


def lm_config(tmp_path: Path, preset: Path, data: Path, **train) -> Path:
    config = {
        "name": "lm",
        "model": {"preset": str(preset), "lora": {"rank": 4}, "sequence_length": 24},
        "data": {
            "train": str(data / "chat-train-*"),
            "validation": str(data / "chat-validation-*"),
        },
        "train": {"per_core_batch_size": 4, "epochs": 4, "learning_rate": {"base": 1e-2}, **train},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(tmp_path / "runs")},
    }
    return write_config(tmp_path, config, "lm")


# ------------------------------------------------------------------ which features are which
@pytest.mark.parametrize(
    ("features", "expected"),
    [
        ({"prompt": "text", "response": "text"}, ("prompt", "response")),
        ({"text": "text"}, ("text", "text")),
        ({"review": "text", "label": "int64"}, ("review", "label")),
        ({"image": "image", "class": "int64"}, ("image", "class")),
        ({"first": "text", "second": "text", "label": "int64"}, (["first", "second"], "label")),
    ],
)
def test_a_presets_inputs_and_targets_come_from_its_features(features, expected):
    declared = {name: {"type": kind} for name, kind in features.items()}
    assert preset_refs(declared, None, None) == expected


def test_features_that_do_not_say_which_is_which_are_refused():
    declared = {"a": {"type": "int64"}, "b": {"type": "int64"}}
    with pytest.raises(ConfigError, match=r"data.inputs / data.targets: left out.*a \(int64\)"):
        preset_refs(declared, None, None)


# ------------------------------------------------------------------ the pipeline's batches
def test_prompt_tokens_weigh_nothing_and_the_response_is_learned(
    chat_records, tiny_presets, tmp_path
):
    keras_hub = frameworks.keras_hub()
    preprocessor = keras_hub.models.CausalLMPreprocessor.from_preset(str(tiny_presets.gemma))
    preprocessor.sequence_length = 40
    data_dir = chat_records(16)
    features = {"prompt": {"type": "text"}, "response": {"type": "text"}}
    data = DataConfig.model_validate({"train": "-", "features": features,
                                      "inputs": "prompt", "targets": "response"})  # fmt: skip
    files = sorted(str(p) for p in data_dir.glob("chat-train-*"))
    ds = pipeline.make_dataset(files, data, 4, training=False,
                               transform=batches.transform(preprocessor, data))  # fmt: skip
    x, y, weights = next(iter(ds))
    raw = next(iter(pipeline.make_dataset(files, data, 4, training=False)))
    tokenizer = preprocessor.tokenizer
    for i in range(4):
        prompt = np.asarray(tokenizer(raw[0][i]))
        response = np.asarray(tokenizer(raw[1][i]))
        ids, w = x["token_ids"][i].numpy(), weights[i].numpy()
        # <bos>, the prompt, the response, <eos>, padding: each target is the next token.
        assert ids[0] == tokenizer.start_token_id
        assert list(ids[1 : 1 + len(prompt)]) == list(prompt)
        answer = slice(len(prompt), len(prompt) + len(response) + 1)  # the response and <eos>
        assert list(y[i].numpy()[answer]) == [*response, tokenizer.end_token_id]
        assert (
            w[: len(prompt)].sum() == 0 and (w[answer] == 1).all() and w[answer.stop :].sum() == 0
        )


def test_exact_validation_weights_multiply_the_tokens(chat_records, tiny_presets, tmp_path):
    keras_hub = frameworks.keras_hub()
    preprocessor = keras_hub.models.CausalLMPreprocessor.from_preset(str(tiny_presets.gemma))
    data_dir = chat_records(16)
    features = {"text": {"type": "text", "key": "prompt"}}
    data = DataConfig.model_validate({"train": "-", "features": features,
                                      "inputs": "text", "targets": "text"})  # fmt: skip
    files = sorted(str(p) for p in data_dir.glob("chat-train-*"))
    ds = pipeline.make_dataset(files, data, 4, training=False, score_records=6,
                               transform=batches.transform(preprocessor, data))  # fmt: skip
    per_record = [w.numpy().sum(axis=1) for _, _, w in ds]
    assert len(per_record) == 2 and (per_record[0] > 0).all()
    assert (per_record[1][:2] > 0).all() and (per_record[1][2:] == 0).all()  # 2 fillers


# ------------------------------------------------------------------ fine-tuning
@pytest.mark.slow
def test_lora_fine_tune_of_the_causal_lm_changes_only_the_adapted_kernels(
    chat_lora_run, tiny_presets
):
    """The session's LoRA fine-tune (conftest's chat_lora_run, 4 epochs with `tpurun train`)."""
    keras_hub = frameworks.keras_hub()
    assert "E0000" not in chat_lora_run.output and "oneDNN" not in chat_lora_run.output
    run = chat_lora_run.run_dir
    losses = [float(row["loss"]) for row in read_log(run)]
    assert (
        all(b < a for a, b in zip(losses, losses[1:], strict=False))
        and losses[-1] < 0.9 * losses[0]
    ), losses
    written = yaml.safe_load((run / "config.yaml").read_text())
    assert written["data"]["inputs"] == "prompt" and written["data"]["targets"] == "response"

    # A LoRA run's artifact is the adapter, not the model again: the preset + model.lora.h5.
    assert (run / "model.lora.h5").is_file() and not (run / "model.keras").exists()
    base = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    tuned = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    enable_lora(tuned, 4)
    adapter.load_lora(tuned, str(run / "model.lora.h5"), "model.lora.h5")
    merged = {layer.path: np.asarray(layer.kernel) for layer in lora_layers(tuned.backbone)}
    frozen = {v.path: np.asarray(v.value) for v in tuned.weights if not v.trainable}
    changed = {
        v.path
        for v in base.weights
        if v.path in frozen and not np.array_equal(np.asarray(v.value), frozen[v.path])
    }
    assert not changed, changed  # the base weights are the preset's
    before = {layer.path: np.asarray(layer.kernel) for layer in lora_layers(_with_lora(base))}
    assert merged.keys() == before.keys() and len(merged) == 4  # query and value, 2 layers
    assert all(not np.allclose(merged[k], before[k]) for k in merged)  # each adapter learned


def _with_lora(task):
    enable_lora(task, 4)  # fresh adapters: B is zero, so the merged kernel is the preset's
    return task


@pytest.mark.slow
def test_the_text_classifier_learns_a_keyword_task(tiny_presets, tmp_path):
    animals = ("cat", "dog", "bird", "fox")
    rows = [{"text": s, "label": int(any(a in s for a in animals))} for s in sentences(384)]
    source = write_jsonl(tmp_path / "reviews.jsonl", rows)
    result = runner.invoke(app, ["data", "write", str(source), str(tmp_path / "data" / "rev"),
                                 "--label", "label",
                                 "--validation-fraction", "0.25"])  # fmt: skip
    assert result.exit_code == 0, result.output
    config = {
        "name": "cls",
        "model": {"preset": str(tiny_presets.bert), "metrics": ["sparse_categorical_accuracy"]},
        "data": {"train": str(tmp_path / "data" / "rev-train-*"),
                 "validation": str(tmp_path / "data" / "rev-validation-*")},
        "train": {"per_core_batch_size": 16, "epochs": 6, "learning_rate": {"base": 3e-3}},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(tmp_path / "runs")},
    }  # fmt: skip
    result = runner.invoke(app, ["train", str(write_config(tmp_path, config, "cls"))])
    assert result.exit_code == 0, result.output
    last = read_log(tmp_path / "runs" / "cls")[-1]
    assert float(last["val_sparse_categorical_accuracy"]) >= 0.9, last


def test_perplexity_is_exact_over_the_weighted_tokens_of_a_padded_validation(
    chat_records, tiny_presets, tmp_path
):
    """KerasHub's Perplexity, added as a weighted metric, against exp of the mean loss over the
    response tokens of the six records scored (two padding records in the last batch weigh 0)."""
    import tpurun
    from tpurun.plan.prepare import prepare_here
    from tpurun.training.model import build_model, compile_model

    keras = frameworks.keras()
    data_dir = chat_records(16)
    config = tpurun.load_config(
        {"name": "ppl", "model": {"preset": str(tiny_presets.gemma), "sequence_length": 24},
         "data": {"train": str(data_dir / "chat-train-*")},
         "train": {"per_core_batch_size": 1}, "runtime": {"cpu_devices": 1}}
    )  # fmt: skip
    prepared = prepare_here(config)
    model = build_model(prepared.config, "jax")
    compile_model(model, prepared.config, prepared.plan)
    preprocessor = batches.detach(model)
    data = prepared.config.data
    files = sorted(str(p) for p in data_dir.glob("chat-train-*"))
    ds = pipeline.make_dataset(files, data, 4, training=False, score_records=6,
                               transform=batches.transform(preprocessor, data))  # fmt: skip
    logs = model.evaluate(ds, return_dict=True, verbose=0)

    nll, tokens = 0.0, 0.0
    for x, y, w in ds:
        losses = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
        nll += float(np.sum(np.asarray(losses) * np.asarray(w)))
        tokens += float(np.sum(np.asarray(w)))
    np.testing.assert_allclose(logs["perplexity"], np.exp(nll / tokens), rtol=1e-4)


def test_normalize_is_refused_for_a_preset(tmp_path):
    import tpurun

    config = {"name": "n", "model": {"preset": "presets/tiny"},
              "data": {"train": "x-*", "features": {"x": {"type": "float", "shape": [4],
                                                          "normalize": True},
                                                    "y": {"type": "int64"}}}}  # fmt: skip
    with pytest.raises(ConfigError, match="data.features.x.normalize: a preset's own"):
        tpurun.load_config(config)


@pytest.mark.slow
def test_doctor_steps_a_preset_on_its_tokenised_batch(chat_records, tiny_presets, tmp_path):
    """doctor's model check feeds the preset's task as train does: tokenised in the pipeline."""
    from tpurun.doctor import run_checks

    path = lm_config(tmp_path, tiny_presets.gemma, chat_records())
    config = yaml.safe_load(path.read_text())
    checks = {c.name: c for c in run_checks(config, env={}, lock_path=str(tmp_path / "lock"),
                                            gcs_timeout=1)}  # fmt: skip
    model = checks["model"]
    assert model.status == "ok", model
    assert np.isfinite(model.data["loss"]) and model.data["params"] > 0
    # LoRA's effect, as tpurun config shows it: only the adapter trains.
    assert 0 < model.data["trainable"] < model.data["params"] / 10
    assert f"({model.data['trainable']:,} trainable)" in model.finding
    preset = checks["model.preset"]
    assert preset.status == "ok" and preset.data["sequence_length"] == 24
    assert "task GemmaCausalLM" in preset.finding and "sequence length 24" in preset.finding


@pytest.mark.slow
def test_a_lora_fine_tune_on_two_processes(chat_records, tiny_presets, tmp_path):
    """`tpurun launch -n 2`: the preset built in each process, the data split between them, one
    writer, the adapter trained as on one process."""
    from helpers import cli_env, read_summary, run_cli

    path = lm_config(tmp_path, tiny_presets.gemma, chat_records(), epochs=3)
    result = run_cli("launch", "-n", "2", "train", str(path),
                     env=cli_env(TPURUN_LOST_AFTER_SECONDS="30"))  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "lm"
    summary = read_summary(run)
    assert summary["status"] == "completed" and summary["processes"] == 2, summary
    losses = [float(row["loss"]) for row in read_log(run)]
    assert len(losses) == 3 and losses[-1] < losses[0], losses


@pytest.mark.slow
def test_early_stopping_keeps_a_lora_runs_adapter_not_the_base(
    chat_records, tiny_presets, tmp_path
):
    """restore_best_weights in a LoRA run: the best weights kept (in memory and in
    early_stopping_best.npz) are the trainable ones, and the run ends on the best epoch's."""
    keras_hub = frameworks.keras_hub()
    path = lm_config(tmp_path, tiny_presets.gemma, chat_records(), epochs=3)
    config = yaml.safe_load(path.read_text())
    config["callbacks"] = {"early_stopping": {"monitor": "val_loss", "patience": 5,
                                              "restore_best_weights": True}}  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    result = runner.invoke(app, ["train", str(path)])
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "lm"
    task = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    enable_lora(task, 4)
    with np.load(run / "checkpoints" / "early_stopping_best.npz") as npz:
        kept = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    assert [k.shape for k in kept] == [tuple(v.shape) for v in task.trainable_variables]
    adapter.load_lora(task, str(run / "model.lora.h5"), "model.lora.h5")
    for variable, best in zip(task.trainable_variables, kept, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), best)


def test_a_tokenizer_loaded_earlier_survives_the_next_commands_seeding(tiny_presets):
    """TensorFlow's set_seed clears its kernel caches, freeing a SentencePiece tokenizer's
    resource as a tf.data map (predict, generate) uses it: a notebook's `tpurun.load` result
    broke at the next command's seeding."""
    from tpurun.runtime.activate import seed_everything

    keras, tf = frameworks.keras(), frameworks.tensorflow()
    keras_hub = frameworks.keras_hub()
    seed_everything(keras, 42)  # a command sets the process up, then loads the model
    tokenizer = keras_hub.models.GemmaTokenizer.from_preset(str(tiny_presets.gemma))

    def tokenised() -> list:
        ds = tf.data.Dataset.from_tensor_slices(["the cat eats", "a dog"]).map(tokenizer)
        return [np.asarray(t).tolist() for t in ds]

    first = tokenised()
    seed_everything(keras, 42)  # another command with the run's seed
    assert tokenised() == first
    keras.utils.set_random_seed(42)  # Keras' own sets TensorFlow's again: the resource is gone
    with pytest.raises(tf.errors.NotFoundError, match="SentencepieceOp"):
        tokenised()


@pytest.mark.slow
def test_an_image_classifier_preset_learns_from_an_image_folder(tiny_presets, tmp_path):
    """Images for a KerasHub classifier use the image feature: fed 0..255, which the preset's
    image converter scales as it was pretrained (a [0, 1] image would be scaled twice)."""
    from helpers import encode_image

    rng = np.random.default_rng(0)
    for name, level in (("dark", 40), ("bright", 210)):
        (tmp_path / "pics" / name).mkdir(parents=True)
        for i in range(32):
            pixels = np.clip(rng.normal(level, 25, (32, 32, 3)), 0, 255)
            (tmp_path / "pics" / name / f"{i}.png").write_bytes(encode_image(pixels))
    result = runner.invoke(app, ["data", "write", str(tmp_path / "pics"),
                                 str(tmp_path / "data" / "pics"), "--validation-fraction", "0.25"])  # fmt: skip
    assert result.exit_code == 0, result.output
    config = {
        "name": "pics",
        "model": {"preset": str(tiny_presets.resnet), "metrics": ["sparse_categorical_accuracy"]},
        "data": {"train": str(tmp_path / "data" / "pics-train-*"),
                 "validation": str(tmp_path / "data" / "pics-validation-*")},
        "train": {"per_core_batch_size": 8, "epochs": 4, "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(tmp_path / "runs")},
    }  # fmt: skip
    result = runner.invoke(app, ["train", str(write_config(tmp_path, config, "pics"))])
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "pics"
    written = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert written["features"]["image"]["scale"] is False
    assert (written["inputs"], written["targets"]) == ("image", "label")
    assert float(read_log(run)[-1]["val_sparse_categorical_accuracy"]) >= 0.9


def test_a_presets_images_refuse_scale_true():
    import tpurun

    config = {"name": "p", "model": {"preset": "presets/tiny"},
              "data": {"train": "x-*", "features": {
                  "image": {"type": "image", "shape": [32, 32, 3], "scale": True},
                  "label": {"type": "int64"}}}}  # fmt: skip
    with pytest.raises(ConfigError, match="data.features.image.scale: a preset's image converter"):
        tpurun.load_config(config)


def test_a_causal_lm_fed_numbers_is_told_to_write_text(tiny_presets, toy_data, tmp_path):
    from helpers import toy_config

    config = toy_config(toy_data, tmp_path / "runs")
    config["model"] = {"preset": str(tiny_presets.gemma)}
    result = runner.invoke(app, ["train", str(write_config(tmp_path, config, "numbers"))])
    assert result.exit_code == 2, result.output
    assert "data.inputs: a causal LM takes one text feature" in result.output
    assert "tpurun data write FILE.jsonl OUT_PREFIX" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs" / "toy").exists()  # nothing trained, nothing left behind


def test_a_text_classifier_fed_numbers_is_told_what_it_takes(tiny_presets, toy_data, tmp_path):
    from helpers import toy_config

    config = toy_config(toy_data, tmp_path / "runs")
    config["model"] = {"preset": str(tiny_presets.bert)}
    result = runner.invoke(app, ["train", str(write_config(tmp_path, config, "numbers"))])
    assert result.exit_code == 2, result.output
    assert "data.inputs: BertTextClassifierPreprocessor takes text features, and 'x' is a raw" in (
        result.output
    )
    assert "Traceback" not in result.output


def test_a_cross_entropy_without_from_logits_is_refused_for_a_preset(
    tiny_presets, toy_data, tmp_path
):
    from helpers import toy_config

    config = toy_config(toy_data, tmp_path / "runs")
    config["model"] = {"preset": str(tiny_presets.bert), "loss": "sparse_categorical_crossentropy"}
    result = runner.invoke(app, ["train", str(write_config(tmp_path, config, "logits"))])
    assert result.exit_code == 2, result.output
    assert (
        "model.loss: sparse_categorical_crossentropy on a preset's task, which outputs logits"
        in (result.output)
    )
    assert "from_logits: true" in result.output
