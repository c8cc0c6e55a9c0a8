"""The memory estimate (tpurun/runtime/memory.py) and the check before compiling
(tpurun/runtime/memory_check.py): parameters and optimizer state exact against the shards a 2x4
mesh really holds, the device's limit found in order, a run too big for a small pretend device
refused with its terms and fixes, and ``tpurun config`` / doctor reporting it.

The test process has 8 simulated CPU devices (conftest); the 2x4 ``ModelParallel`` is set by hand.
"""

from __future__ import annotations

from pathlib import Path

import keras
import pytest
from helpers import FACTORIES, HAS_TENSORFLOW, toy_config

import tpurun
from tpurun import frameworks
from tpurun.errors import EnvironmentSetupError
from tpurun.plan.plan import make_plan
from tpurun.runtime.activations import Activations
from tpurun.runtime.choice import Choice
from tpurun.runtime.memory_check import (
    Limit,
    check_fits,
    device_limit,
    estimate_for_model,
    refusal,
)
from tpurun.training.model import build_model, compile_model

MESH = (2, 4)


def loaded(tmp_path: Path, model: dict, **sections):
    config = toy_config(tmp_path / "data", tmp_path / "runs", **sections)
    config["model"] = model
    return tpurun.load_config(config)


def plan_for(config, replicas: int = 8, records: int = 10_000):
    choice = Choice(backend="jax", accelerator="cpu", distribution="default", replicas=replicas,
                    precision="float32", reason="test")  # fmt: skip
    return make_plan(config, choice, replicas, [records], None)


def set_mesh(layout=None):
    """A hand-set 2x4 ``ModelParallel`` (until the lead's mesh lands): Gemma's layout map, or
    ``layout``'s ``{pattern: axes}``."""
    device_mesh = keras.distribution.DeviceMesh(MESH, ["data", "model"],
                                                keras.distribution.list_devices())  # fmt: skip
    if layout is None:
        layout_map = frameworks.keras_hub().models.GemmaBackbone.get_layout_map(
            device_mesh, data_parallel_dim_name="data", model_parallel_dim_name="model"
        )
    else:
        layout_map = keras.distribution.LayoutMap(device_mesh)
        for pattern, axes in layout.items():
            layout_map[pattern] = axes
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    )


@pytest.fixture
def mesh_2x4():
    set_mesh()
    yield
    keras.distribution.set_distribution(None)


@pytest.fixture
def dense_2x4():
    set_mesh({".*dense.*/kernel": ("model", None)})
    yield
    keras.distribution.set_distribution(None)


def resident(variables, device) -> int:
    """Ground truth: bytes of the shards that live on ``device``."""
    return sum(
        s.data.nbytes for v in variables for s in v.value.addressable_shards if s.device == device
    )


def built(config):
    """The model as train builds and compiles it, its optimizer built (what the estimate must
    predict without building it)."""
    plan = plan_for(config)
    model = build_model(config, "jax")
    compile_model(model, config, plan)
    est = estimate_for_model(model, config, plan, MESH)
    model.optimizer.build(model.trainable_variables)
    return model, est


def assert_exact(model, est):
    device = frameworks.jax().devices()[0]
    assert est.parameters == resident(model.weights, device)
    assert est.gradients == resident(model.trainable_weights, device)
    assert est.optimizer == resident(model.optimizer.variables, device)


# ----------------------------------------------------------------------- exact against shards
@pytest.mark.parametrize("lora", [None, {"rank": 4}], ids=["full", "lora"])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_gemma_2x4_parameters_and_optimizer_are_exact(tmp_path, tiny_presets, mesh_2x4, lora,
                                                      optimizer):  # fmt: skip
    model = {"preset": str(tiny_presets.gemma_mesh), "optimizer": optimizer}
    if lora:
        model["lora"] = lora
    config = loaded(tmp_path, model, train={"per_core_batch_size": 2, "epochs": 1,
                                            "learning_rate": {"base": 1e-3}})  # fmt: skip
    keras_model, est = built(config)
    assert est.entries and any("model" in e.axes() for e in est.entries)  # really sharded
    assert_exact(keras_model, est)
    sharded = sum(e.nbytes for e in est.entries)
    assert est.parameters < sharded  # a device holds less than the whole model
    if lora:
        # Only the adapters train: float32, replicated (no rule of Gemma's matches them).
        assert est.trainable and all(e.lora and e.dtype == "float32" for e in est.trainable)
        assert est.gradients == sum(e.nbytes for e in est.trainable)
    if optimizer == "sgd":  # no momentum: only Keras' iteration counter and learning rate
        assert est.optimizer == 8


def test_plain_keras_model_2x4_with_accumulation_is_exact(tmp_path, dense_2x4):
    config = loaded(
        tmp_path,
        {"factory": f"{FACTORIES}:mlp", "kwargs": {"units": 64}, "loss": "binary_crossentropy",
         "optimizer": {"name": "rmsprop", "momentum": 0.9, "centered": True}},
        train={"per_core_batch_size": 4, "gradient_accumulation_steps": 2, "epochs": 1,
               "learning_rate": {"base": 1e-3, "warmup_epochs": 1}},
    )  # fmt: skip
    keras_model, est = built(config)
    assert_exact(keras_model, est)
    assert any("model" in e.axes() for e in est.entries)
    assert est.slots.per_variable == 3  # velocity, momentum, average gradient
    assert est.optimizer == 4 * est.gradients + 4  # + the accumulators; a schedule, no LR variable
    # Every layer's float32 output, per example: the input (8), the hidden layer (64), the
    # output (1); for the device's slice of the global batch of 32 over the data axis of 2.
    assert est.activations == Activations(
        "every layer's output for the batch", 16, (8 + 64 + 1) * 4
    )


def test_data_parallel_with_the_optimizer_state_split_is_exact(tmp_path):
    """Data parallel over 8 devices, Adam's moments split over them (runtime.shard_optimizer_state,
    the default): the estimate's optimizer term is what a device holds once they are placed."""
    from types import SimpleNamespace

    from tpurun.runtime import optimizer_split

    config = loaded(
        tmp_path,
        {"factory": f"{FACTORIES}:mlp", "kwargs": {"units": 64}, "loss": "binary_crossentropy",
         "optimizer": "adam"},
        train={"per_core_batch_size": 4, "epochs": 1, "learning_rate": {"base": 1e-3}},
    )  # fmt: skip
    choice = Choice(backend="jax", accelerator="cpu", distribution="data_parallel", replicas=8,
                    precision="float32", reason="test")  # fmt: skip
    plan = make_plan(config, choice, 8, [10_000], None)
    distribution = keras.distribution.DataParallel(devices=keras.distribution.list_devices())
    keras.distribution.set_distribution(distribution)
    try:
        model = build_model(config, "jax")
        compile_model(model, config, plan)
        est = estimate_for_model(model, config, plan, None)
        model.optimizer.build(model.trainable_variables)
        # Both moments of the 8x64 and 64x1 kernels and of the 64 biases; the output's one bias
        # and Keras' scalars stay whole.
        placed = optimizer_split.place(model, SimpleNamespace(distribution=distribution), 8)
        assert placed == 6
        assert_exact(model, est)
    finally:
        keras.distribution.set_distribution(None)
    whole = est.on(optimizer_devices=1)
    assert whole.optimizer - est.optimizer == 2 * (8 * 64 + 64 + 64) * 4 * 7 // 8


# --------------------------------------------------------------------------- the device's limit
class FakeDevice:
    """A JAX device as the limit reads it: its kind and what ``memory_stats()`` reports."""

    def __init__(self, kind: str, stats: dict | None):
        self.device_kind, self._stats = kind, stats

    def memory_stats(self):
        return self._stats


def test_device_limit_config_then_runtime_then_table_then_none(tmp_path):
    factory = {"factory": f"{FACTORIES}:mlp", "loss": "binary_crossentropy"}
    plain = loaded(tmp_path, factory)
    v5e = FakeDevice("TPU v5 lite", None)
    assert device_limit(plain, v5e) == Limit(int(15.75 * 1024**3), "tpurun's table (v5e)")
    reported = device_limit(plain, FakeDevice("TPU v5 lite", {"bytes_limit": 123_000}))
    assert reported.bytes == 123_000 and "memory_stats" in reported.source
    set_ = loaded(tmp_path, factory, runtime={"device_memory": "64KB"})
    assert device_limit(set_, v5e) == Limit(64_000, "runtime.device_memory")
    assert device_limit(plain, frameworks.jax().devices()[0]) is None  # a CPU: no check
    assert device_limit(plain, kind="TPU v4") == Limit(int(31.75 * 1024**3), "tpurun's table (v4)")


# ---------------------------------------------------------------------------- refused, or not
def gemma_estimate(tmp_path, tiny_presets, **train):
    config = loaded(tmp_path, {"preset": str(tiny_presets.gemma_mesh)},
                    train={"per_core_batch_size": 16, "epochs": 1, **train})  # fmt: skip
    plan = plan_for(config)
    model = build_model(config, "jax")
    compile_model(model, config, plan)
    return config, plan, estimate_for_model(model, config, plan, MESH)


def test_too_big_is_refused_with_its_terms_and_what_would_fit(tmp_path, tiny_presets, mesh_2x4):
    config, plan, est = gemma_estimate(tmp_path, tiny_presets)
    limit = Limit(6_000_000, "runtime.device_memory")
    assert est.total > limit.bytes
    with pytest.raises(EnvironmentSetupError) as caught:
        check_fits(est, limit, config, plan)
    message = caught.value.message
    for words in ("per device on a 2x4 mesh", "parameters 45.2 KiB", "gradients 45.2 KiB",
                  "optimizer state 90.5 KiB (Adam: 2 slots per trainable variable)",
                  "activations about", "a device has 5.7 MiB (runtime.device_memory)",
                  "What would fit: ", "runtime.precision: bfloat16 (about 5.6 MiB per device)",
                  "train.per_core_batch_size: 8 with train.gradient_accumulation_steps: 2",
                  "Nothing was compiled."):  # fmt: skip
        assert words in message, message
    assert "model.lora" not in message  # LoRA would not lower it: activations dominate here
    assert "runtime.mesh" not in message  # a model axis of 8 does not divide the 4 kv heads
    assert "\n" not in message
    fits = Limit(est.total, "runtime.device_memory")
    assert check_fits(est, fits, config, plan).startswith("memory: about 11.2 MiB per device")
    assert check_fits(est, None, config, plan) is None  # no known limit: no check


def test_nothing_fits_alone_says_so(tmp_path, tiny_presets, mesh_2x4):
    config, plan, est = gemma_estimate(tmp_path, tiny_presets)
    message = refusal(est, Limit(64_000, "runtime.device_memory"), config, plan)
    assert "Alone, none of these fits: train.remat: true (about " in message, message
    assert "; runtime.precision: bfloat16" in message
    assert "use a device with more memory" in message


def test_a_larger_model_axis_is_the_smallest_that_fits(tmp_path):
    config = loaded(
        tmp_path,
        {"factory": f"{FACTORIES}:mlp", "kwargs": {"units": 4096}, "loss": "binary_crossentropy"},
        train={"per_core_batch_size": 1, "epochs": 1}, runtime={"precision": "bfloat16"},
    )  # fmt: skip
    plan = plan_for(config)
    model = build_model(config, "jax")
    compile_model(model, config, plan)
    est = estimate_for_model(model, config, plan, None)  # data parallel: 8 replicas
    assert est.mesh == {"data": 8, "model": 1}
    assert est.parameters == sum(e.nbytes for e in est.entries)  # every weight whole
    message = refusal(est, Limit(300_000, "runtime.device_memory"), config, plan)
    assert "What would fit: runtime.mesh: {data: 2, model: 4} (about" in message, message
    assert "runtime.precision" not in message  # already bfloat16


def test_bfloat16_weights_with_float32_lora_slots_are_exact(tmp_path, tiny_presets, mesh_2x4):
    config = loaded(tmp_path, {"preset": str(tiny_presets.gemma_mesh), "lora": {"rank": 4}},
                    train={"per_core_batch_size": 2, "epochs": 1})  # fmt: skip
    keras.config.set_dtype_policy("bfloat16")
    try:
        keras_model, est = built(config)
    finally:
        keras.config.set_dtype_policy("float32")
    assert_exact(keras_model, est)
    assert {e.dtype for e in est.entries if not e.trainable} == {"bfloat16"}
    assert {e.dtype for e in est.trainable} == {"float32"}  # adapters, and so their slots
    assert est.optimizer == 2 * est.gradients + 8  # 2 slots; the iteration, the learning rate


# ------------------------------------------------------------------------- tpurun config, doctor
def config_file(tmp_path, toy_data, model: dict, **sections) -> Path:
    from helpers import write_config

    config = toy_config(toy_data, tmp_path / "runs", **sections)
    config["model"] = model
    return write_config(tmp_path, config, "memory")


@pytest.mark.skipif(not HAS_TENSORFLOW, reason="the preset's tokenizer needs tensorflow-text")
def test_config_json_gives_mesh_layout_and_memory(tmp_path, toy_data, tiny_presets):
    """The plan's estimate (the layout's rules on the shapes, no device) is the live model's on a
    real 2x4 mesh, byte for byte."""
    import json

    from typer.testing import CliRunner

    from tpurun.cli.app import app

    model = {"preset": str(tiny_presets.gemma_mesh)}
    train = {"per_core_batch_size": 2, "epochs": 1}
    runtime = {"cpu_devices": 8, "mesh": {"data": 2, "model": 4}, "device_memory": "64KB"}
    path = config_file(tmp_path, toy_data, model, runtime=runtime, train=train)
    result = CliRunner().invoke(app, ["config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    derived = json.loads(result.output)["derived"]
    assert derived["mesh"] == {"data": 2, "model": 4}
    layout = derived["layout"]
    assert layout["source"] == "the preset's (GemmaBackbone)"
    assert layout["split"]["model"]["variables"] == 15 and layout["replicated"]["variables"] == 5
    memory = derived["memory_per_device"]
    assert memory["total"] == sum(v for k, v in memory.items() if k != "total")
    assert derived["device_memory"] == {
        "bytes": 64_000,
        "source": "runtime.device_memory",
        "fits": False,
        "fixes": [],
    }  # nothing fits alone
    set_mesh()
    try:
        _, live = built(tpurun.load_config(path))
    finally:
        keras.distribution.set_distribution(None)
    assert derived["parameters"] == live.counts()
    for term in ("parameters", "gradients", "optimizer"):
        assert memory[term] == live.to_dict()[term], term


@pytest.mark.skipif(not HAS_TENSORFLOW, reason="the preset's tokenizer needs tensorflow-text")
def test_config_shows_the_mesh_layout_and_memory_in_words(tmp_path, toy_data, tiny_presets):
    import yaml
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    path = config_file(tmp_path, toy_data, {"preset": str(tiny_presets.gemma_mesh)},
                       runtime={"cpu_devices": 8, "mesh": {"data": 2, "model": 4}},
                       train={"per_core_batch_size": 2, "epochs": 1})  # fmt: skip
    result = CliRunner().invoke(app, ["config", str(path)])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output)["derived"]["mesh"] == {"data": 2, "model": 4}
    assert ("# mesh 2x4, layout the preset's (GemmaBackbone): 15 variables (352.0 KiB) split over "
            "model, 15 over data, 5 (1.2 KiB) whole on every device") in result.output  # fmt: skip
    assert "# memory per device: about " in result.output
    assert "of " not in result.output.split("# memory per device")[1]  # a CPU: no limit known


@pytest.mark.skipif(not HAS_TENSORFLOW, reason="the preset's tokenizer needs tensorflow-text")
def test_doctor_reports_memory_against_the_detected_device(tmp_path, toy_data, tiny_presets):
    """The devices probe's answer for a v5e (its kind and memory_stats' limit) against the
    config's estimate; the same config on the CPU has no limit and is not checked."""
    from tpurun.doctor.memory import check_memory
    from tpurun.plan.prepare import prepare_here

    path = config_file(tmp_path, toy_data, {"preset": str(tiny_presets.gemma_mesh)},
                       runtime={"cpu_devices": 8, "mesh": {"data": 2, "model": 4}},
                       train={"per_core_batch_size": 2, "epochs": 1})  # fmt: skip
    prepared = prepare_here(tpurun.load_config(path))
    on_cpu = check_memory(prepared.config, prepared, {"jax": {"kinds": ["cpu"]}})
    assert on_cpu.status == "ok" and "no memory limit known on the CPU" in on_cpu.finding
    assert on_cpu.data["mesh"] == {"data": 2, "model": 4}

    tpu = type(prepared.choice)(**{**vars(prepared.choice), "accelerator": "tpu"})
    on_tpu = type(prepared)(**{**vars(prepared), "choice": tpu})
    probe = {"jax": {"kinds": ["TPU v5 lite"], "bytes_limit": 1_000_000}}
    small = check_memory(prepared.config, on_tpu, probe)
    assert small.status == "fail", small.finding
    assert "of 976.6 KiB (the runtime's memory_stats() on TPU v5 lite): does NOT" in small.finding
    assert small.fix.startswith("what would fit: runtime.precision: bfloat16 (about")
    assert "; train.per_core_batch_size: 1" in small.fix
    big = check_memory(prepared.config, on_tpu, {"jax": {"kinds": ["TPU v5 lite"]}})
    assert big.status == "ok" and "(tpurun's table (v5e)): fits" in big.finding


@pytest.mark.slow
def test_a_run_too_big_for_the_device_is_refused_before_compiling(
    tmp_path, tiny_presets, chat_records
):
    """Through tpurun.train: a 2 x 4 full fine-tune (about 493 KiB a device) against a pretend
    400 KB device. Refused before the first step compiles, with the terms and what would fit,
    first train.remat (the activations recomputed); with it the run passes the check and trains
    its 6 steps."""
    from test_mesh import mesh_config

    data = chat_records(64)
    config = mesh_config(tmp_path, tiny_presets.gemma_mesh, data, {"data": 2, "model": 4},
                         device_memory="400KB")  # fmt: skip
    with pytest.raises(EnvironmentSetupError) as info:
        tpurun.train(config, verbose=False)
    text = str(info.value)
    assert "Nothing was compiled." in text, text
    assert "(runtime.device_memory)" in text, text
    assert "What would fit: train.remat: true (about 377.0 KiB per device)" in text, text
    assert "; runtime.precision: bfloat16 (about" in text, text
    assert not (tmp_path / "runs" / "mesh" / "log.csv").exists()
    config["train"]["remat"] = True
    summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed" and summary["steps_per_epoch"] == 6
