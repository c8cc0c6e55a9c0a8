"""Throughput users compare (tpurun/observe/throughput.py): tokens or examples per second, TFLOP/s
per device and MFU, from XLA's cost analysis of Keras' train step, in the epoch line,
summary.json and TensorBoard; MFU absent where the device's peak is unknown."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from helpers import read_summary, toy_config
from test_tensorboard import read_events

import tpurun
from tpurun import frameworks
from tpurun.observe import throughput
from tpurun.observe.throughput import StepCost

FLOP_RATE = re.compile(
    r"[\d.]+ [PTGMk]?FLOP/s/device"
)  # the unit that reads: display.lines.flop_rate

keras = frameworks.keras()
tf = frameworks.tensorflow()


# ------------------------------------------------------------------------------ the arithmetic
def test_mfu_is_the_measured_rate_over_a_fake_peak():
    peak = throughput.peak_tflops(40.0, "cpu")  # runtime.peak_tflops wins over the device table
    cost = StepCost("tokens", per_step=8 * 512, flops_per_device=2.5e12, peak_tflops=peak)
    figures = cost.epoch(steps=10, seconds=0.5)
    assert figures["tokens_per_second"] == 8 * 512 * 10 / 0.5  # 81,920
    assert figures["tflops_per_device"] == pytest.approx(50.0)  # 2.5e12 x 10 / 0.5 s / 1e12
    assert figures["mfu"] == pytest.approx(50.0 / 40.0)


def test_the_peak_comes_from_the_device_table_and_a_cpu_has_none():
    assert throughput.peak_tflops(None, "TPU v5 lite") == 197.0
    assert throughput.peak_tflops(None, "TPU v4") == 275.0
    assert throughput.peak_tflops(None, "cpu") is None
    cost = StepCost("examples", per_step=64, flops_per_device=1e9, peak_tflops=None)
    figures = cost.epoch(steps=4, seconds=2.0)
    assert figures == {"examples_per_second": 128.0, "tflops_per_device": 2e-3, "mfu": None}
    tf_backend = StepCost("examples", per_step=64, flops_per_device=None, peak_tflops=197.0)
    assert tf_backend.epoch(4, 2.0)["tflops_per_device"] is None  # no FLOPs: no MFU either


def test_the_summary_keeps_the_steady_epochs_mean():
    cost = StepCost("tokens", per_step=100, flops_per_device=1e12, peak_tflops=10.0)
    epochs = [cost.epoch(10, 4.0), cost.epoch(10, 1.0), cost.epoch(10, 2.0)]  # the first compiles
    steady = throughput.steady(cost, epochs)
    assert steady["tokens_per_second"] == pytest.approx((1000 + 500) / 2)
    assert steady["tflops_per_device"] == pytest.approx((10 + 5) / 2)
    assert steady["mfu"] == pytest.approx(0.75)
    assert steady["tokens_per_step"] == 100 and steady["flops_per_step_per_device"] == 1e12
    assert throughput.steady(cost, []) is None


def test_token_inputs_count_every_token_of_the_batch_padding_included():
    spec = ({"token_ids": tf.TensorSpec((None, 128), tf.int32),
             "padding_mask": tf.TensorSpec((None, 128), tf.bool)},
            tf.TensorSpec((None, 128), tf.int32))  # fmt: skip
    assert throughput.consumed_per_step(spec, 16) == ("tokens", 16 * 128)
    plain = (tf.TensorSpec((None, 8), tf.float32), tf.TensorSpec((None,), tf.float32))
    assert throughput.consumed_per_step(plain, 16) == ("examples", 16)


# ------------------------------------------------------------------ FLOPs against the hand count
B, IN, HIDDEN, OUT = 64, 256, 256, 128


def _dense_model():
    inputs = keras.Input((IN,))
    hidden = keras.layers.Dense(HIDDEN, use_bias=False)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(OUT, use_bias=False)(hidden))
    model.compile(optimizer="adam", loss="mse")
    data = tf.data.Dataset.from_tensors(
        (np.ones((B, IN), "float32"), np.zeros((B, OUT), "float32"))
    )
    model.fit(data, verbose=0, shuffle=False)  # builds the optimizer's and the metrics' variables
    return model, data.element_spec


@pytest.mark.parametrize("data_parallel", [False, True])
def test_a_dense_models_step_flops_match_the_hand_count(data_parallel):
    """Forward: 2·in·out a layer per example. Backward: the kernel's gradient costs as much again,
    and the input's gradient too, except for the first layer, whose input (the data) needs none:
    2 + 2 + 1 forward matmul costs in all, not 3 + 3. Adam: 11 FLOPs a parameter
    (m += (g - m)(1 - b1): 3; v += (g² - v)(1 - b2): 4; w -= m·lr / (√v + eps): 4, the square
    root counted apart, as a transcendental). Left out of the hand count: the MSE loss and its
    gradient on the 64 x 128 outputs, a few FLOPs an output, 0.2% of the total; asserted to 0.5%.
    Over 8 data-parallel devices, each device's share is an eighth."""
    keras.distribution.set_distribution(
        keras.distribution.DataParallel() if data_parallel else None
    )
    try:
        model, spec = _dense_model()
        flops = throughput.flops_per_device(model, spec, B)
    finally:
        keras.distribution.set_distribution(None)
    first, second = 2 * B * IN * HIDDEN, 2 * B * HIDDEN * OUT
    matmuls = 2 * first + 3 * second
    adam = 11 * model.count_params()
    devices = 8 if data_parallel else 1
    assert flops * devices == pytest.approx(matmuls + adam, rel=0.005)
    assert flops * devices > matmuls + adam  # the loss's own work, never less


def test_where_jax_has_no_analysis_of_the_lowered_step_the_cpus_counts_the_same_flops(
    monkeypatch,
):
    """On a PJRT plugin (CUDA, a TPU's libtpu) ``Lowered.cost_analysis`` gives None; the FLOPs
    then come from the CPU client's analysis of the same module: the same count, here where both
    can be had (the GPU check found none on an H100 before)."""
    import jax

    model, spec = _dense_model()
    lowered = throughput.lowered_train_step(model, spec, B)
    direct = throughput.lowered_flops(lowered)
    monkeypatch.setattr(jax.stages.Lowered, "cost_analysis", lambda self: None)
    assert throughput.lowered_flops(lowered) == direct
    first, second = 2 * B * IN * HIDDEN, 2 * B * HIDDEN * OUT
    assert direct == pytest.approx(2 * first + 3 * second + 11 * model.count_params(), rel=0.005)
    monkeypatch.setattr(lowered, "compiler_ir", lambda dialect: None)  # JAX's internals moved
    assert throughput.lowered_flops(lowered) is None


# -------------------------------------------------------------------------------- a real run
def _run(tmp_path, capsys, **runtime):
    config = toy_config(tmp_path / "data", tmp_path / "runs", runtime={"cpu_devices": 1, **runtime},
                        train={"epochs": 2, "per_core_batch_size": 32},
                        callbacks={"tensorboard": {}})  # fmt: skip
    from helpers import write_toy_data

    write_toy_data(tmp_path / "data")
    tpurun.train(config, verbose=True)
    run = tmp_path / "runs" / "toy"
    lines = [line for line in capsys.readouterr().out.splitlines() if "epoch 2/2" in line]
    return read_summary(run), lines[-1], read_events(run)


def test_a_run_with_a_peak_shows_tflops_and_mfu_in_its_line_summary_and_tensorboard(
    tmp_path, capsys
):
    summary, line, events = _run(tmp_path, capsys, peak_tflops=0.001)
    figures = summary["throughput"]
    assert figures["examples_per_step"] == 32 and figures["peak_tflops"] == 0.001
    assert figures["flops_per_step_per_device"] > 0
    # One epoch's figures hang together: TFLOP/s = FLOPs a step x steps / s; MFU = that / peak.
    assert figures["mfu"] == pytest.approx(figures["tflops_per_device"] / 0.001)
    rate = figures["examples_per_second"]
    assert figures["tflops_per_device"] == pytest.approx(
        rate / 32 * figures["flops_per_step_per_device"] / 1e12
    )
    assert summary["examples_per_sec"] == pytest.approx(rate, abs=0.1)
    assert FLOP_RATE.search(line) and "MFU " in line and " ex/s" in line
    last = events["train/tflops_per_device"][-1]
    assert last[0] == 2 * summary["steps_per_epoch"]
    assert math.isclose(events["train/mfu"][-1][1], last[1] / 0.001, rel_tol=1e-5)


def test_on_a_cpu_without_a_peak_mfu_is_absent(tmp_path, capsys):
    summary, line, events = _run(tmp_path, capsys)
    assert summary["throughput"]["mfu"] is None and summary["throughput"]["peak_tflops"] is None
    assert summary["throughput"]["tflops_per_device"] > 0
    assert FLOP_RATE.search(line) and "MFU" not in line
    assert "train/tflops_per_device" in events and "train/mfu" not in events


# ------------------------------------------------------------------- the tiny Gemma on a 2 x 4 mesh
def _gemma_flops(preset, batch: int, length: int, mesh: tuple[int, int] | None):
    keras_hub = frameworks.keras_hub()
    if mesh is not None:
        devices = keras.distribution.DeviceMesh(mesh, ["data", "model"],
                                                keras.distribution.list_devices())  # fmt: skip
        layout = keras_hub.models.GemmaBackbone.get_layout_map(
            devices, data_parallel_dim_name="data"
        )
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="data")
        )
    try:
        lm = keras_hub.models.GemmaCausalLM.from_preset(str(preset), preprocessor=None)
        lm.compile(optimizer=keras.optimizers.AdamW(1e-3), weighted_metrics=["accuracy"],
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
        x = {"token_ids": np.ones((batch, length), "int32"),
             "padding_mask": np.ones((batch, length), bool)}  # fmt: skip
        data = tf.data.Dataset.from_tensors((x, np.ones((batch, length), "int32")))
        lm.fit(data, verbose=0, shuffle=False)
        return lm.backbone, throughput.flops_per_device(lm, data.element_spec, batch)
    finally:
        keras.distribution.set_distribution(None)


def test_the_tiny_gemmas_step_is_6nt_plus_attention_spread_over_the_mesh(tiny_presets):
    """6·N·T (N: the matmul weights, the tied embedding counted once as the output projection;
    T: tokens a step) plus attention's QKᵀ and AV (forward 4·B·S²·heads·head_dim a layer, x3 with
    the backward). XLA counts ~5% more here (measured 1.046): norms, rotary embeddings, softmax,
    the loss and AdamW's ~12 FLOPs a parameter, large beside a model this small."""
    batch, length = 16, 32
    backbone, per_device = _gemma_flops(tiny_presets.gemma_mesh, batch, length, (2, 4))
    _, single = _gemma_flops(tiny_presets.gemma_mesh, batch, length, None)
    assert per_device * 8 == pytest.approx(single, rel=1e-3)  # the model's FLOPs, an eighth each
    n = sum(int(np.prod(v.shape)) for v in backbone.weights if len(v.shape) >= 2)
    attention = (4 * batch * length**2 * backbone.num_query_heads * backbone.head_dim
                 * backbone.num_layers)  # fmt: skip
    expected = 6 * n * batch * length + 3 * attention
    assert 1.0 < single / expected < 1.1


@pytest.mark.slow
def test_a_fine_tune_on_a_2x4_mesh_counts_tokens(tiny_presets, chat_records, tmp_path, capsys):
    from test_mesh import mesh_config

    chat = chat_records(64)
    config = mesh_config(tmp_path, tiny_presets.gemma_mesh, chat, {"data": 2, "model": 4},
                         peak_tflops=1.0)  # fmt: skip
    tpurun.train(config, verbose=True)
    line = [x for x in capsys.readouterr().out.splitlines() if "epoch 1/1" in x][-1]
    figures = read_summary(tmp_path / "runs" / "mesh")["throughput"]
    assert figures["tokens_per_step"] == 8 * 16  # global batch x sequence length, padding included
    assert " tok/s" in line and FLOP_RATE.search(line) and "MFU" in line
    assert figures["mfu"] == pytest.approx(figures["tflops_per_device"] / 1.0)
