"""A quantized base under LoRA (``model.quantize: int8 | int4``, QLoRA) on the tiny Gemma: what the
base stores and what trains, the gradient the adapters get, the loss falling, checkpoints of the
adapter alone with the quantized base's fingerprint, evaluate and predict on the quantized base,
export merged into the preset's float weights, a resume onto another quantized base refused, the
memory fix, a 2x4 mesh, the refusals, and (slow) a SIGKILL resume that ends on the unbroken run's
bits."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import keras
import numpy as np
import pytest
from helpers import (
    read_latest,
    read_log,
    read_summary,
    run_cli,
    signal_at,
    without_full_collections,
    write_config,
)
from typer.testing import CliRunner

import tpurun
from tpurun import frameworks
from tpurun.cli.app import app
from tpurun.errors import ConfigError, EnvironmentSetupError, ModelError
from tpurun.hub import quantize
from tpurun.hub.task_model import build_task, lora_layers, parameter_counts
from tpurun.infer import preset_task as infer_preset
from tpurun.runtime.memory import entries_of
from tpurun.training.checkpoints import adapter


@pytest.fixture(scope="module")
def chat(chat_records) -> Path:
    return chat_records(64)


@pytest.fixture(scope="module", autouse=True)
def _quantize_without_full_collections():
    """Keras' per-kernel ``gc.collect()`` off while this module quantizes (helpers' docstring)."""
    with without_full_collections():
        yield


def qlora_config(root: Path, preset: Path, data: Path, name: str, mode: str | None = "int8",
                 **sections) -> dict:  # fmt: skip
    """The tiny Gemma's LoRA fine-tune on a base quantized to ``mode``: 6 steps an epoch (48
    records, global batch 8), 2 epochs."""
    model = {"preset": str(preset), "lora": {"rank": 4, "alpha": 8.0}, "sequence_length": 16}
    if mode is not None:
        model["quantize"] = mode
    config = {
        "name": name,
        "model": model,
        "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")},
        "train": {"per_core_batch_size": 4, "epochs": 2, "steps_per_execution": 1,
                  "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(root / "runs")},
    }  # fmt: skip
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return config


def built(preset: Path, mode: str | None):
    config = tpurun.load_config(qlora_config(Path("/unused"), preset, Path("/unused"), "b", mode))
    return build_task(config)


def parameter_bytes(task) -> int:
    return sum(e.nbytes for e in entries_of(task))


@pytest.fixture(scope="module")
def bases(tiny_presets) -> dict:
    """The tiny Gemma with LoRA on its float32, int8 and int4 bases (keys None, "int8", "int4"),
    built once: the tests read their shapes; the gradient test assigns their adapters."""
    return {mode: built(tiny_presets.gemma, mode) for mode in (None, "int8", "int4")}


@pytest.fixture(scope="module")
def qlora_run(tiny_presets, chat, tmp_path_factory):
    """The int8 QLoRA fine-tune the tests below read (never write into): its run directory and
    config."""
    root = tmp_path_factory.mktemp("qlora")
    config = qlora_config(root, tiny_presets.gemma, chat, "q8")
    tpurun.train(config, verbose=False)
    return root / "runs" / "q8", config


# ------------------------------------------------------------------ what the base holds
def test_a_quantized_base_stores_fewer_bytes_and_trains_the_same_adapter(bases):
    """int8 and int4 against float32: the same parameters (the float model's count) and the same
    trainable adapter; the stored bytes per device (data parallel: every device the whole model)
    fall to 30% and 20% on the tiny Gemma (its norms and float32 adapters stay)."""
    tasks = bases
    counts = {mode: parameter_counts(task) for mode, task in tasks.items()}
    assert {c.to_dict()["total"] for c in counts.values()} == {64576}
    assert {c.to_dict()["trainable"] for c in counts.values()} == {2816}
    stored = {mode: parameter_bytes(task) for mode, task in tasks.items()}
    print(f"\ntiny Gemma bytes per device: {stored}")
    assert stored == {None: 258304, "int8": 77824, "int4": 51904}
    for mode in ("int8", "int4"):
        task = tasks[mode]
        assert sorted(v.path for v in task.trainable_variables) == sorted(
            v.path for v in tasks[None].trainable_variables
        )
        assert {str(v.dtype) for v in task.trainable_variables} == {"float32"}
        query = task.backbone.get_layer("decoder_block_0").attention.query_dense
        assert (query.quantization_mode, query._kernel.dtype) == (mode, "int8")
        assert query.lora_enabled and not query._kernel.trainable
    # Keras' int8 logits quantize their inputs with no straight-through gradient: tpurun's int8
    # embedding is weights-only; the attention and MLP kernels keep Keras' int8 inputs.
    embedding = tasks["int8"].backbone.token_embedding
    assert embedding.quantization_mode == "int8" and embedding.inputs_quantizer is None
    query = tasks["int8"].backbone.get_layer("decoder_block_0").attention.query_dense
    assert isinstance(query.inputs_quantizer, keras.quantizers.AbsMaxQuantizer)


def test_quantizing_is_deterministic_and_the_fingerprint_names_each_integer_kernel(
    bases, tiny_presets
):
    a, b = bases["int4"], built(tiny_presets.gemma, "int4")
    for x, y in zip(a.backbone.non_trainable_weights, b.backbone.non_trainable_weights,
                    strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(x.value), np.asarray(y.value), err_msg=x.path)
    record = quantize.record_of(a)
    assert record == quantize.record_of(b)
    assert record["mode"] == "int4" and record["keras"] == keras.__version__
    # int4 kernels and zero points: the embedding's 2, and 7 layers of 2 in each of 2 blocks.
    assert len(record["variables"]) == 30
    assert record["variables"]["decoder_block_0/attention/query/kernel"].startswith("int8[64, 32] ")


def test_the_int8_adapters_get_the_float_models_gradient(bases, tiny_presets):
    """Against the float model with the same adapter values: tpurun's int8 base gives the
    adapters the float gradient (cosine > 0.99); Keras' own int8 (its logits quantizing their
    inputs without a straight-through gradient) does not. When Keras fixes that, the second
    assert fails and the weights-only embedding can go."""
    jax, jnp = frameworks.jax(), frameworks.jax("numpy")
    float_task, ours = bases[None], bases["int8"]
    keras_default = frameworks.keras_hub().models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    keras_default.backbone.quantize("int8")
    keras_default.backbone.enable_lora(4)
    rng = np.random.default_rng(0)
    values = [rng.normal(size=v.shape).astype("float32") * 0.1
              for v in float_task.trainable_variables]  # fmt: skip
    x, y, w = float_task.preprocessor(["the cat eats an apple today.", "a dog sees a book."])

    def gradients(task):
        for variable, value in zip(task.trainable_variables, values, strict=True):
            variable.assign(value)
        fixed = [v.value for v in task.non_trainable_variables]

        def loss(trainable):
            logits, _ = task.stateless_call(trainable, fixed, x)
            per_token = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            return jnp.sum(per_token * w) / jnp.sum(w)

        return [np.asarray(g) for g in jax.grad(loss)([v.value for v in task.trainable_variables])]

    def cosines(task):
        return [float((a * b).sum() / np.linalg.norm(a) / np.linalg.norm(b))
                for a, b in zip(gradients(task), reference, strict=True)]  # fmt: skip

    reference = gradients(float_task)
    assert min(cosines(ours)) > 0.99
    assert min(cosines(keras_default)) < 0.5


# ------------------------------------------------------------------ a QLoRA run
def test_the_loss_falls_and_checkpoints_hold_only_the_adapter(qlora_run):
    run_dir, _ = qlora_run
    log = read_log(run_dir)
    assert float(log[1]["loss"]) < float(log[0]["loss"])
    assert float(log[1]["val_loss"]) < float(log[0]["val_loss"])
    checkpoint = run_dir / "checkpoints" / read_latest(run_dir)["weights"]
    held = adapter.read(str(checkpoint))
    assert held["model"] and all("lora_kernel" in path for path in held["model"])
    with h5py.File(checkpoint) as f:
        base = json.loads(f.attrs["preset"])["quantized"]
    assert base["mode"] == "int8" and len(base["variables"]) == 15  # embedding + 7 x 2 kernels
    assert (run_dir / "model.lora.h5").is_file() and not (run_dir / "model.keras").exists()
    assert read_summary(run_dir)["status"] == "completed"


def test_evaluate_and_load_use_the_quantized_base(qlora_run):
    """evaluate's loss over the validation split is the run's own best val_loss, which it scored
    on the quantized base (a float base scores otherwise)."""
    run_dir, _ = qlora_run
    task, _ = tpurun.load(str(run_dir))
    assert {layer.quantization_mode for layer in lora_layers(task.backbone)} == {"int8"}
    scored = tpurun.evaluate(str(run_dir))["metrics"]["loss"]
    best = min(float(row["val_loss"]) for row in read_log(run_dir))
    assert scored == pytest.approx(best, rel=1e-5)


def test_the_merge_is_the_presets_float_weights_plus_the_adapter(qlora_run, tiny_presets):
    """What export --format keras (and huggingface) writes: each adapted kernel is the float
    preset's plus alpha / rank * A @ B, every other weight the float preset's, nothing quantized."""
    run_dir, config = qlora_run
    task, _ = tpurun.load(str(run_dir))
    plain = infer_preset.merged(task, tpurun.load_config(config))
    original = frameworks.keras_hub().models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    assert not quantize.quantized_layers(plain.backbone)
    adapted = {layer.path: layer for layer in lora_layers(task.backbone)}
    assert len(adapted) == 4
    before = {v.path: np.asarray(v.value, dtype=np.float64) for v in original.weights}
    for variable in plain.weights:
        layer = adapted.get(variable.path.rsplit("/", 1)[0])
        expected = before[variable.path]
        if layer is not None:
            a, b = (np.asarray(k.value, dtype=np.float64)
                    for k in (layer.lora_kernel_a, layer.lora_kernel_b))  # fmt: skip
            expected = expected + 8.0 / 4 * (a @ b)
            assert np.abs(expected - before[variable.path]).max() > 1e-3  # the adapter trained
        np.testing.assert_allclose(np.asarray(variable.value), expected, atol=1e-6,
                                   err_msg=variable.path)  # fmt: skip


def test_a_resume_onto_another_quantized_base_is_refused(qlora_run, tmp_path, monkeypatch):
    """Keras rounding otherwise (a later release, say): the rebuilt base's integers differ, and
    the resume names the kernels that differ instead of training the adapter against them."""
    run_dir, config = qlora_run
    shutil.copytree(run_dir, tmp_path / "runs" / "q8")
    quantizer = frameworks.keras("src.quantizers.quantizers").AbsMaxQuantizer
    original = quantizer.__call__

    def rounding_otherwise(self, x, *args, **kwargs):
        values, scale = original(self, x, *args, **kwargs)
        return keras.ops.cast(keras.ops.clip(values + 1, -127, 127), values.dtype), scale

    monkeypatch.setattr(quantizer, "__call__", rounding_otherwise)
    again = {**config, "output": {"dir": str(tmp_path / "runs")}, "train": {**config["train"],
                                                                           "epochs": 3}}  # fmt: skip
    with pytest.raises(ModelError, match=r"another quantized base than the one rebuilt now \("
                       r"token_embedding/embeddings: int8\[256, 64\] [0-9a-f]{8} -> "
                       r"int8\[256, 64\] [0-9a-f]{8}; "):  # fmt: skip
        tpurun.train(again, verbose=False)


# ------------------------------------------------------------------ memory
def test_the_memory_refusal_offers_quantization_after_bfloat16(tiny_presets, chat, tmp_path):
    """The float LoRA run (962.3 KiB) is over a 900 KiB device: bfloat16 fits, then int8 (the
    estimate of the quantized bytes, 787.5 KiB, against 786.0 KiB that train counts on the int8
    model itself); with int8 already, over 780 KiB, int4 is what is left to offer. (The adapters'
    Adam moments are split over the 2 devices: runtime.shard_optimizer_state.)"""
    runner = CliRunner()

    def fixes(mode: str | None) -> str:
        config = qlora_config(
            tmp_path,
            tiny_presets.gemma,
            chat,
            "m",
            mode,
            runtime={"device_memory": "900KiB" if mode is None else "780KiB"},
        )
        result = runner.invoke(app, ["config", str(write_config(tmp_path, config, "m"))])
        assert result.exit_code == 0, result.output
        return result.output  # fmt: skip

    output = fixes(None)
    assert ("- 'runtime.precision: bfloat16 (about 497.6 KiB per device)'\n"
            "    - 'model.quantize: int8 (about 787.5 KiB per device)'") in output  # fmt: skip
    assert "memory per device: about 962.3 KiB" in output
    output = fixes("int8")  # config counts without the weights: the kernels as int8 stores them
    assert "memory per device: about 787.5 KiB" in output
    assert "- 'model.quantize: int4 (about 759.9 KiB per device)'" in output
    # train counts the quantized model's own variables, and stops before compiling.
    config = qlora_config(tmp_path, tiny_presets.gemma, chat, "m", "int8",
                          runtime={"device_memory": "780KiB"})  # fmt: skip
    with pytest.raises(EnvironmentSetupError, match=r"about 786.0 KiB per device .* What would "
                       r"fit: .*model.quantize: int4 \(about 758.4 KiB per device\)"):  # fmt: skip
        tpurun.train(config, verbose=False)


# ------------------------------------------------------------------ a model axis
@pytest.mark.slow
def test_int8_splits_as_the_presets_layout_and_int4_needs_the_auto_layout(
    tiny_presets, chat_records, tmp_path
):
    """On 2x4 the preset's layout splits int8 kernels as the float ones (their shapes are the
    same; the scales stay whole) and the run trains; int4's packed 2-D kernels do not fit its
    per-head rules (refused, naming runtime.layout: auto; the auto rule's placement of any 2-D
    kernel is tests/runtime/test_layouts.py's)."""
    from test_mesh import shardings, spied_model

    data = chat_records(16)
    mesh = {"cpu_devices": 8, "mesh": {"data": 2, "model": 4}}

    def config(mode: str, **runtime) -> dict:
        return qlora_config(tmp_path, tiny_presets.gemma_mesh, data, mode + str(len(runtime)),
                            mode, runtime={**mesh, **runtime}, train={"epochs": 1, "per_core_batch_size": 1},
                            callbacks={"checkpoint": None})  # fmt: skip

    with spied_model() as captured:
        assert tpurun.train(config("int8"), verbose=False)["status"] == "completed"
    specs = shardings(captured["model"])
    assert specs["decoder_block_0/attention/query/kernel"] == ("model", "data", None)
    assert specs["token_embedding/embeddings"] == ("model", "data")
    assert specs["decoder_block_0/attention/query/kernel_scale"] in ((), (None,) * 4)
    with pytest.raises(ConfigError, match="model.quantize: int4 makes new kernels .*set "
                       "runtime.layout: auto"):  # fmt: skip
        tpurun.train(config("int4"), verbose=False)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lora": None}, "model.quantize: int8 needs model.lora: Keras' quantized layers hold "
         "their kernels as integers that do not train"),
        ({"quantize": "float8"}, "model.quantize: Input should be 'int8' or 'int4'"),
    ],
)  # fmt: skip
def test_a_config_keras_cannot_train_quantized_exits_2(tiny_presets, tmp_path, change, message):
    config = qlora_config(tmp_path, tiny_presets.gemma, tmp_path, "r")
    config["model"] = {k: v for k, v in {**config["model"], **change}.items() if v is not None}
    result = CliRunner().invoke(app, ["config", str(write_config(tmp_path, config, "r"))])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())


def test_a_factory_model_cannot_be_quantized(toy_data, tmp_path):
    from helpers import toy_config

    config = toy_config(toy_data, tmp_path / "runs")
    config["model"]["quantize"] = "int8"
    result = CliRunner().invoke(app, ["config", str(write_config(tmp_path, config, "f"))])
    assert result.exit_code == 2, result.output
    assert ("model.quantize (the pretrained base quantized under LoRA (a quantized kernel does "
            "not train)) applies to a model.preset") in " ".join(result.output.split())  # fmt: skip


def test_a_backbone_with_no_layer_keras_quantizes_is_refused(tiny_presets, tmp_path):
    config = tpurun.load_config({"model": {"preset": str(tiny_presets.resnet), "lora": {"rank": 2},
                                           "quantize": "int4"},
                                 "data": {"train": "x-*"}})  # fmt: skip
    with pytest.raises(ModelError, match="model.quantize: int4 quantized no layer of "
                       "ResNetBackbone"):  # fmt: skip
        build_task(config)


# ------------------------------------------------------------------ exact resume, export
@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_is_bit_exact(qlora_run, tiny_presets, chat, tmp_path):
    """int8: SIGKILL after step 4 of epoch 2 (saves every 2 steps), then resume: the log and the
    adapter checkpoint are the unbroken run's (qlora_run, the same config but its saves), bit for
    bit. (What export writes of it, the float preset plus the adapter, is
    test_the_merge_is_the_presets_float_weights_plus_the_adapter's.)"""
    extra = [signal_at(tmp_path / "fired", 2, 5, "SIGKILL")]
    config = qlora_config(tmp_path, tiny_presets.gemma, chat, "killed", "int8",
                          callbacks={"checkpoint": {"every_steps": 2}, "extra": extra})  # fmt: skip
    path = write_config(tmp_path, config, "killed")
    killed = run_cli("train", str(path))
    assert killed.returncode == -9, killed.stderr
    run_dir, reference = tmp_path / "runs" / "killed", qlora_run[0]
    assert (read_latest(run_dir)["epoch"], read_latest(run_dir)["step"]) == (1, 4)
    tpurun.train(str(path), verbose=False)
    assert read_summary(run_dir)["resumes"][-1]["step"] == 4
    assert read_log(run_dir) == read_log(reference)
    mine = adapter.read(str(run_dir / "checkpoints" / read_latest(run_dir)["weights"]))
    theirs = adapter.read(str(reference / "checkpoints" / read_latest(reference)["weights"]))
    for group in adapter.GROUPS:
        assert sorted(mine[group]) == sorted(theirs[group])
        for key in mine[group]:
            np.testing.assert_array_equal(mine[group][key], theirs[group][key], err_msg=key)


def test_predict_completes_on_the_quantized_base(qlora_run, tmp_path):
    """predict's completions are the loaded QLoRA task's own greedy generations (its int8 base
    and adapter), prompt for prompt."""
    run_dir, _ = qlora_run
    prompts = ["question: what eats the cat?", "question: what likes a farmer?",
               "question: what builds my friend?"]  # fmt: skip
    source = tmp_path / "prompts.txt"
    source.write_text("".join(f"{p}\n" for p in prompts))
    result = tpurun.predict(str(run_dir), str(source), str(tmp_path / "out.jsonl"))
    assert result["rows"] == 3
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    task, _ = tpurun.load(str(run_dir))
    assert {layer.quantization_mode for layer in lora_layers(task.backbone)} == {"int8"}
    task.compile(sampler="greedy")
    expected = task.generate(prompts, max_length=16, strip_prompt=True)
    assert [row["prompt"] for row in rows] == prompts
    assert [row["completion"] for row in rows] == [str(text) for text in expected]
