"""A device mesh with a model axis (runtime.mesh, runtime.layout) on 8 simulated CPU devices: the
weights land where the layout says (read back from their shardings), and what would silently
replicate a large weight or crash deep in JAX is one message before anything is compiled.

The model is tests/hub_presets.py's tiny Gemma with 8 query and 4 key/value heads: a model axis
of 4 divides every head count; one of 8 does not divide the key/value heads (grouped-query
attention, the case users hit on Gemma and Llama)."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import FACTORIES, read_summary, run_cli, toy_config, write_config

import tpurun
from tpurun import frameworks
from tpurun.config import RuntimeConfig
from tpurun.errors import ConfigError
from tpurun.runtime.layout import Placer, auto_axes, check_placements
from tpurun.runtime.mesh import check_support, resolve


@pytest.fixture(scope="module")
def chat(chat_records) -> Path:
    return chat_records(64)


def mesh_config(root: Path, preset: Path, data: Path, mesh: dict, **runtime) -> dict:
    """A full fine-tune (no LoRA: every weight trains) of one epoch, 6 steps of 8 records."""
    return {
        "name": "mesh",
        "model": {"preset": str(preset), "sequence_length": 16},
        "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")},
        "train": {"per_core_batch_size": 1, "epochs": 1, "steps_per_execution": 2,
                  "learning_rate": {"base": 1e-3}},
        "runtime": {"cpu_devices": 8, "mesh": mesh, **runtime},
        "callbacks": {"checkpoint": None},
        "output": {"dir": str(root / "runs")},
    }  # fmt: skip


def shardings(model) -> dict[str, tuple]:
    """Each variable's partition spec as JAX holds it."""
    return {v.path: tuple(v.value.sharding.spec) for v in model.variables}


@contextlib.contextmanager
def spied_model():
    """``{"model", "placer"}`` of the run trained inside: the model as it trained, on the mesh."""
    from tpurun.training import fit

    captured, original = {}, fit.train

    def spy(job):
        result = original(job)
        captured["model"], captured["placer"] = result.model, job.runtime.placer
        return result

    fit.train = spy
    try:
        yield captured
    finally:
        fit.train = original


def _pad(spec: tuple, n: int) -> tuple:
    return tuple(spec) + (None,) * (n - len(spec))


# ------------------------------------------------------------------------------ the mesh's shape
@pytest.mark.parametrize(
    ("mesh", "devices", "processes", "expected"),
    [({"model": 4}, 8, 1, (2, 4)), ({"data": 2, "model": 4}, 8, 1, (2, 4)),
     ({"data": "auto", "model": 8}, 8, 1, (1, 8)), ({"model": 2}, 8, 2, (4, 2))],
)  # fmt: skip
def test_the_mesh_fills_the_devices(mesh, devices, processes, expected):
    assert resolve(RuntimeConfig(mesh=mesh).mesh, devices, processes) == expected


@pytest.mark.parametrize(
    ("mesh", "devices", "processes", "message"),
    [({"data": 2, "model": 2}, 8, 1, r"data 2 x model 2 = 4 devices, and this run has 8"),
     ({"model": 3}, 8, 1, r"model: 3 does not divide the 8 devices.*\(1, 2, 4, 8\)"),
     ({"data": 1, "model": 8}, 8, 2, r"data axis \(1\) must be a multiple of the 2 processes")],
)  # fmt: skip
def test_a_mesh_that_does_not_fit_the_devices_is_refused(mesh, devices, processes, message):
    with pytest.raises(ConfigError, match=message):
        resolve(RuntimeConfig(mesh=mesh).mesh, devices, processes)


def test_the_auto_rule_splits_the_largest_dimension_the_model_axis_divides():
    assert auto_axes((64, 256), 4) == (None, "model")
    assert auto_axes((256, 64), 4) == ("model", None)
    assert auto_axes((3, 3, 16, 30), 4) == (None, None, "model", None)
    assert auto_axes((30,), 4) == (None,)  # vectors stay whole
    assert auto_axes((6, 10), 4) == (None, None)  # nothing divides: whole (checked later)


def test_two_rules_matching_one_variable_are_refused():
    placer = Placer([("dense.*", (None, "model")), (".*kernel", ("model", None))],
                    {"data": 2, "model": 4}, "runtime.layout")  # fmt: skip
    with pytest.raises(ConfigError, match=r"dense/kernel matches 2 rules"):
        placer.place("dense/kernel", (8, 8), 4)


# ------------------------------------------------------------------------- a fine-tune on 2 x 4
@pytest.fixture(scope="module")
def trained_2x4(tiny_presets, chat, tmp_path_factory) -> SimpleNamespace:
    """The one-epoch full fine-tune under 2x4 that the tests below read (never write into): its
    ``run_dir``, its ``summary``, the lines it printed (``out``), and the ``model`` and
    ``placer`` as it trained."""
    root = tmp_path_factory.mktemp("mesh-2x4")
    config = mesh_config(root, tiny_presets.gemma_mesh, chat, {"data": 2, "model": 4})
    printed = io.StringIO()
    with spied_model() as captured, contextlib.redirect_stdout(printed):
        summary = tpurun.train(config, verbose=True)
    return SimpleNamespace(run_dir=root / "runs" / "mesh", summary=summary,
                           out=printed.getvalue(), **captured)  # fmt: skip


@pytest.mark.slow
def test_a_preset_under_2x4_is_sharded_as_its_layout_says_and_trains(trained_2x4):
    assert trained_2x4.summary["status"] == "completed"
    # The devices each hold a slice of the model: not "8 replica(s)".
    assert "(model_parallel mesh 2x4, 8 device(s), float32)" in trained_2x4.out
    model, _ = tpurun.load(trained_2x4.run_dir)  # gathered: whole, on one device
    assert type(model).__name__ == "GemmaCausalLM"
    assert all(len(v.value.sharding.device_set) == 1 for v in model.weights)
    run = read_summary(trained_2x4.run_dir)
    assert run["replicas"] == 8 and run["global_batch_size"] == 8


@pytest.mark.slow
def test_under_the_mesh_the_variables_have_the_layouts_shardings(trained_2x4):
    """Read back from JAX: Gemma's own map splits the embedding's vocabulary and the attention
    heads over `model`; norms stay whole; the layout summary counts them."""
    captured = {"model": trained_2x4.model, "placer": trained_2x4.placer}
    specs = shardings(captured["model"])
    assert _pad(specs["token_embedding/embeddings"], 2) == ("model", "data")
    assert _pad(specs["decoder_block_0/attention/query/kernel"], 3) == ("model", "data", None)
    assert _pad(specs["decoder_block_0/attention/key/kernel"], 3) == ("model", "data", None)
    assert _pad(specs["decoder_block_0/ffw_gating/kernel"], 2) == ("data", "model")
    assert _pad(specs["decoder_block_0/pre_attention_norm/scale"], 1) == (None,)
    placements = captured["placer"].placements
    for variable in captured["model"].variables:  # every one, as the placer placed it
        placement = placements[variable.path]
        assert _pad(specs[variable.path], len(placement.shape)) == placement.axes, variable.path


# ------------------------------------------------------------------------------ bad layouts
@pytest.mark.slow
def test_grouped_query_heads_the_model_axis_does_not_divide_are_named_and_the_fix_works(
    tiny_presets, chat, tmp_path
):
    """1 x 8: Gemma's own layout splits the 4 key/value heads 8 ways. The message names the
    variable, its shape, the axis and the sizes that divide it, and gives the rule that keeps the
    heads whole; added as written, the run trains."""
    config = mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, {"data": 1, "model": 8})
    with pytest.raises(ConfigError) as info:
        tpurun.train(config, verbose=False)
    text = str(info.value)
    assert "decoder_block_0/attention/key/kernel has shape [4, 64, 16]" in text, text
    assert "model axis of 8 devices (grouped-query attention" in text, text
    assert "Model axis sizes that divide it: 2, 4." in text, text
    rule = r"{pattern: 'decoder_block_\d+/attention/(key|value)/kernel', axes: [null, data, null]}"
    assert rule in text, text
    assert not (tmp_path / "runs" / "mesh" / "checkpoints").exists()  # nothing trained

    config["runtime"]["layout"] = [{"pattern": r"decoder_block_\d+/attention/(key|value)/kernel",
                                    "axes": [None, "data", None]}]  # fmt: skip
    assert tpurun.train(config, verbose=False)["status"] == "completed"


def test_a_single_key_value_head_is_indivisible_by_any_model_axis(tiny_presets, chat, tmp_path):
    config = mesh_config(tmp_path, tiny_presets.gemma, chat, {"model": 2})
    with pytest.raises(ConfigError, match=r"key/kernel has shape \[1, 64, 16\].*divide it: 1\."):
        tpurun.train(config, verbose=False)


def test_a_renamed_weight_no_longer_matching_the_presets_rule_is_refused(tiny_presets):
    """keras-hub#2806: a layer renamed in a new release stops matching its rule; the model would
    load replicated and die out of memory. Gemma's own map, a renamed feed-forward kernel."""
    keras = frameworks.keras()
    keras_hub = frameworks.keras_hub()
    mesh = keras.distribution.DeviceMesh(
        (2, 4), ["data", "model"], keras.distribution.list_devices()
    )
    layout = keras_hub.models.GemmaBackbone.get_layout_map(mesh, data_parallel_dim_name="data")
    preset = [(pattern, tuple(value.axes)) for pattern, value in layout.items()]
    placer = Placer([], {"data": 2, "model": 4}, "the preset's (GemmaBackbone)", preset=preset)
    placer.place("token_embedding/embeddings", (256, 64), 4)
    placer.place("decoder_block_0/ffw_gating/kernel", (64, 256), 4)
    placer.place("decoder_block_0/feedforward_gate/kernel", (64, 256), 4)  # renamed
    paths = list(placer.placements)
    with pytest.raises(ConfigError) as info:
        check_placements(placer, paths)
    text = str(info.value)
    assert "leaves 1 large variable(s) whole on every device: " in text, text
    assert "decoder_block_0/feedforward_gate/kernel [64, 256] (64.0 KiB)" in text, text
    assert r"{pattern: 'decoder_block_\d+/feedforward_gate/kernel', axes: [null, model]}" in text


def test_a_large_weight_no_dimension_of_which_divides_the_model_axis_is_refused(toy_data, tmp_path):
    """auto on a factory model: the second kernel, [30, 1], has no dimension 4 divides."""
    config = toy_config(toy_data, tmp_path / "runs", name="whole",
                        model={"factory": f"{FACTORIES}:mlp", "kwargs": {"units": 30}},
                        runtime={"cpu_devices": 8, "mesh": {"model": 4}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"dense_\d+/kernel \[30, 1\].*No dimension of theirs"):
        tpurun.train(config, verbose=False)


def test_a_rule_that_matches_nothing_is_refused(tiny_presets, chat, tmp_path):
    config = mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, {"model": 4},
                         layout=[{"pattern": "decoder/ffn/kernel", "axes": [None, "model"]}])  # fmt: skip
    with pytest.raises(ConfigError, match=r"'decoder/ffn/kernel' matches no variable.* closest "
                       r"of its \d+ paths: .*decoder_block_\d+/\w+/kernel"):  # fmt: skip
        tpurun.train(config, verbose=False)


def test_auto_layout_shards_a_factory_model(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", name="auto",
                        model={"factory": f"{FACTORIES}:mlp", "kwargs": {"units": 64}},
                        runtime={"cpu_devices": 8, "mesh": {"model": 4}, "layout": "auto"},
                        train={"epochs": 1})  # fmt: skip
    with spied_model() as captured:
        summary = tpurun.train(config, verbose=False)
    assert summary["status"] == "completed"
    # mlp(64): Dense 8 -> 64 and 64 -> 1, read back from JAX in the model's order: each kernel
    # split over model along its 64 (the largest dimension 4 divides), the biases whole.
    specs = [_pad(tuple(v.value.sharding.spec), len(v.shape)) for v in captured["model"].weights]
    assert specs == [(None, "model"), (None,), ("model", None), (None,)]


def test_layout_preset_on_a_factory_model_is_refused(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", name="nolayout",
                        runtime={"cpu_devices": 8, "mesh": {"model": 4}, "layout": "preset"})  # fmt: skip
    with pytest.raises(ConfigError, match=r"a model.factory model has no layout of its own"):
        tpurun.train(config, verbose=False)


@pytest.mark.slow
def test_a_model_axis_on_the_tensorflow_backend_exits_2(toy_data, tmp_path):
    config = toy_config(toy_data, tmp_path / "runs", name="tf",
                        runtime={"backend": "tensorflow", "cpu_devices": 8,
                                 "mesh": {"model": 4}})  # fmt: skip
    path = write_config(tmp_path / "tf.yaml", config)
    done = run_cli("train", str(path))
    assert done.returncode == 2, done.stderr
    assert "runtime.mesh: a model axis (4) needs the JAX backend" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_mesh_the_choice_could_not_size_is_resolved_when_the_devices_are_counted(
    toy_data, tmp_path
):
    """On a TPU the choice cannot count the cores (they are known once the TPU starts), so its
    mesh is None: activation resolves runtime.mesh then, rather than falling back to data
    parallel (every weight whole on every chip)."""
    import dataclasses

    from tpurun.config import load_config
    from tpurun.plan.prepare import choose_for
    from tpurun.runtime.activate import activate

    config = load_config(toy_config(toy_data, tmp_path / "runs",
                                    runtime={"cpu_devices": 8, "mesh": {"model": 4}}))  # fmt: skip
    choice = dataclasses.replace(choose_for(config), mesh=None)  # as on a TPU
    runtime = activate(choice, config.seed)
    try:
        assert runtime.mesh == (2, 4) and runtime.sharded
        assert runtime.distribution is None  # mesh.install sets it, once the layout is known
    finally:
        runtime.release()


def test_a_model_axis_needs_a_keras_that_loads_sharded_weights_whole():
    """Keras before 3.15 dropped weights across shards loading sharded H5 files: refused, with
    the pip command."""
    mesh = RuntimeConfig(mesh={"model": 4}).mesh
    with pytest.raises(ConfigError, match=r"needs Keras 3.15 or later, and Keras 3.14.2 is "
                       r"installed.*pip install -U 'keras>=3.15'"):  # fmt: skip
        check_support(mesh, "jax", "3.14.2")
    for fine in ("3.15.1", "3.16.0.dev2026112300", "4.0.0"):
        check_support(mesh, "jax", fine)
    check_support(RuntimeConfig(mesh={"model": 1}).mesh, "jax", "3.10.0")  # data parallel only
    check_support(mesh, "jax")  # the installed Keras (make install pins 3.15.1)


# ------------------------------------------------------------------------------------ doctor
@pytest.mark.slow
def test_doctor_builds_the_model_on_the_mesh_and_checks_its_layout(tiny_presets, chat, tmp_path):
    """On a CPU, doctor's model step builds the model split as train would: a model axis of 8
    over 4 key/value heads fails there, naming the variable; a model axis of 4 passes."""
    from tpurun.doctor import run_checks

    def model_check(mesh: dict) -> Any:
        config = mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, mesh)
        (tmp_path / "dev" / "vfio").mkdir(parents=True, exist_ok=True)  # a machine without a TPU
        checks = run_checks(config, env={}, dev_root=str(tmp_path / "dev"),
                            lock_path=str(tmp_path / "lock"), gcs_timeout=1)  # fmt: skip
        return next(c for c in checks if c.name == "model")

    refused = model_check({"data": 1, "model": 8})
    assert refused.status == "fail", refused
    assert "decoder_block_0/attention/key/kernel has shape [4, 64, 16]" in refused.finding
    assert refused.fix == "change the config as the message says"
    passed = model_check({"data": 2, "model": 4})
    assert passed.status == "ok", passed
