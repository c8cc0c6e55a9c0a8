"""``train.remat`` (tpurun/training/remat.py): each block recomputed in the backward pass. The
loss is the same as without it, the train step really holds ``jax.checkpoint``s (one per block),
the memory estimate follows Korthikanti et al.'s full recomputation, a refusal suggests it where
it would fit, and the suggested run then trains.
"""

from __future__ import annotations

import json
import re

import keras
import numpy as np
import pytest
from helpers import FACTORIES, read_log, toy_config
from test_memory import MESH, config_file, loaded, plan_for, set_mesh

import tpurun
from tpurun import frameworks
from tpurun.errors import ConfigError
from tpurun.runtime.memory_check import Limit, estimate_for_model, refusal
from tpurun.training.model import build_model, compile_model

BLOCKS = {"factory": f"{FACTORIES}:residual_blocks", "loss": "binary_crossentropy"}


def checkpoints_in_the_step(model, inputs) -> int:
    """``jax.checkpoint`` equations in the gradient of a training forward pass of ``model``."""
    jax = frameworks.jax()
    trainable = [v.value for v in model.trainable_variables]
    others = [v.value for v in model.non_trainable_variables]

    def loss(values):
        out, _ = model.stateless_call(values, others, inputs, training=True)
        return keras.ops.mean(keras.ops.cast(out, "float32"))

    text = str(jax.make_jaxpr(jax.grad(loss))(trainable))
    return len(re.findall(r"\b(?:remat\d*|checkpoint)\[", text))


def toy_run(tmp_path, name: str, model: dict, **train) -> list[dict]:
    """Two epochs on the toy data (the ``toy_data`` fixture's, in ``tmp_path / "data"``)."""
    config = toy_config(tmp_path / "data", tmp_path / "runs", name=name, model=model,
                        train={"per_core_batch_size": 32, "epochs": 2,
                               "learning_rate": {"base": 0.01}, **train})  # fmt: skip
    assert tpurun.train(config, verbose=False)["status"] == "completed"
    return read_log(tmp_path / "runs" / name)


def assert_same_losses(plain: list[dict], remat: list[dict]) -> None:
    for key in ("loss", "val_loss"):
        ours = [float(row[key]) for row in remat]
        assert ours == pytest.approx([float(row[key]) for row in plain], rel=1e-5), key


# --------------------------------------------------------------------- the same maths, recomputed
def test_remat_recomputes_each_block_and_leaves_the_loss_as_it_was(tmp_path, toy_data):
    """A factory's model of residual blocks (dropout and batch norm inside, state updated in
    the recomputed part): the same training and validation losses, epoch by epoch."""
    plain = toy_run(tmp_path, "plain", BLOCKS)
    remat = toy_run(tmp_path, "remat", BLOCKS, remat=True)
    assert_same_losses(plain, remat)

    batch = np.zeros((4, 8), "float32")
    for on, expected in ((False, 0), (True, 2)):  # the model's 2 blocks, its Dense layers not
        config = loaded(tmp_path, BLOCKS, train={"remat": on})
        assert checkpoints_in_the_step(build_model(config, "jax"), batch) == expected


def test_a_model_without_blocks_is_refused(tmp_path, toy_data):
    config = toy_config(toy_data, tmp_path / "runs", train={"remat": True, "epochs": 1})
    with pytest.raises(ConfigError, match=r"train\.remat: Functional .* has no block to recompute"):
        tpurun.train(config, verbose=False)


@pytest.mark.slow
def test_a_preset_fine_tunes_with_remat(tmp_path, tiny_presets, chat_records):
    """The tiny Gemma's two decoder blocks recomputed: a LoRA fine-tune's losses as without."""

    data = chat_records(48)
    losses = []
    for name, on in (("plain", False), ("remat", True)):
        config = {
            "name": name,
            "model": {"preset": str(tiny_presets.gemma), "lora": {"rank": 4}, "sequence_length": 16},
            "data": {"train": str(data / "chat-train-*"),
                     "validation": str(data / "chat-validation-*")},
            "train": {"per_core_batch_size": 4, "epochs": 2, "remat": on,
                      "learning_rate": {"base": 1e-2}},
            "runtime": {"cpu_devices": 2},
            "callbacks": {"checkpoint": None},
            "output": {"dir": str(tmp_path / "runs")},
        }  # fmt: skip
        assert tpurun.train(config, verbose=False)["status"] == "completed"
        losses.append(read_log(tmp_path / "runs" / name))
    assert_same_losses(*losses)
    config = tpurun.load_config(config)
    inputs = {"token_ids": np.zeros((2, 16), "int32"), "padding_mask": np.ones((2, 16), "int32")}
    assert checkpoints_in_the_step(build_model(config, "jax"), inputs) == 2


# ------------------------------------------------------------------------------------ memory
def gemma_estimates(tmp_path, tiny_presets):
    """The tiny Gemma (8 heads, 2 layers) on a 2x4 mesh, 16 examples a core, without and with
    remat: ``(config, plan, estimate)`` each."""
    out = []
    set_mesh()
    try:
        for on in (False, True):
            config = loaded(tmp_path, {"preset": str(tiny_presets.gemma_mesh)},
                            train={"per_core_batch_size": 16, "epochs": 1, "remat": on})  # fmt: skip
            plan = plan_for(config)
            model = build_model(config, "jax")
            compile_model(model, config, plan)
            out.append((config, plan, estimate_for_model(model, config, plan, MESH), model))
    finally:
        keras.distribution.set_distribution(None)
    return out


def test_the_estimate_with_remat_is_full_recomputation(tmp_path, tiny_presets):
    """Korthikanti et al. 2022, section 5: each layer keeps its input (2sbh, 16-bit), and one
    layer's activations and the logits are held while it is recomputed."""
    (_, plan, plain, model), (_, _, remat, _) = gemma_estimates(tmp_path, tiny_presets)
    backbone = model.backbone
    layers, h, a = backbone.num_layers, backbone.hidden_dim, backbone.num_query_heads
    s, v, t = model.preprocessor.sequence_length, backbone.vocabulary_size, MESH[1]
    b = plan.global_batch_size // MESH[0]  # the examples a device's activations hold
    fp32 = 2  # float32: twice Korthikanti's 16-bit bytes
    layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * fp32
    logits = 4 * s * b * v / t
    assert plain.activation_bytes == pytest.approx(layers * layer + logits, abs=1)
    assert remat.activation_bytes == pytest.approx(2 * s * b * h * layers * fp32 + layer + logits,
                                                   abs=1)  # fmt: skip
    assert remat.total - plain.total == remat.activation_bytes - plain.activation_bytes < 0
    assert "recomputed" in remat.activations.basis


def test_config_json_shows_the_estimate_with_remat(tmp_path, toy_data, tiny_presets):
    from typer.testing import CliRunner

    from tpurun.cli.app import app

    memory = []
    for on in (False, True):
        path = config_file(tmp_path, toy_data, {"preset": str(tiny_presets.gemma_mesh)},
                           runtime={"cpu_devices": 8, "mesh": {"data": 2, "model": 4}},
                           train={"per_core_batch_size": 2, "epochs": 1, "remat": on})  # fmt: skip
        result = CliRunner().invoke(app, ["config", str(path), "--json"])
        assert result.exit_code == 0, result.output
        memory.append(json.loads(result.output)["derived"]["memory_per_device"])
    plain, remat = memory
    assert remat["activations"] < plain["activations"]
    assert plain["total"] - remat["total"] == plain["activations"] - remat["activations"]


def test_the_refusal_offers_remat_only_where_the_estimate_sees_it(tmp_path, tiny_presets):
    (config, plan, plain, _), (_, _, remat, _) = gemma_estimates(tmp_path, tiny_presets)
    between = Limit((plain.total + remat.total) // 2, "runtime.device_memory")
    message = refusal(plain, between, config, plan)
    assert "What would fit: train.remat: true (about " in message, message
    assert "train.remat" not in refusal(remat, between, config, plan)  # already on

    blocks = loaded(tmp_path, BLOCKS, train={"per_core_batch_size": 64, "epochs": 1})
    block_plan = plan_for(blocks)
    model = build_model(blocks, "jax")
    compile_model(model, blocks, block_plan)
    est = estimate_for_model(model, blocks, block_plan, None)
    # Every layer's output: remat would not change it, so it is not what would fit.
    assert "train.remat" not in refusal(est, Limit(est.total // 2, "x"), blocks, block_plan)


@pytest.mark.slow
def test_remat_on_tensorflow_leaves_the_loss_as_it_was(tmp_path, toy_data):
    """TensorFlow's ``tf.recompute_grad`` on 2 replicas (MirroredStrategy): the block's dropout
    mask and batch-norm update made once, the same losses as without remat."""
    import subprocess
    import sys

    from helpers import cli_env

    configs = [
        toy_config(toy_data, tmp_path / "runs", name=name, model=BLOCKS,
                   runtime={"backend": "tensorflow", "cpu_devices": 2},
                   train={"per_core_batch_size": 16, "epochs": 2, "remat": on,
                          "learning_rate": {"base": 0.01}})
        for name, on in (("plain", False), ("remat", True))
    ]  # fmt: skip
    # Counts the blocks Keras' TensorFlow remat hands to tf.recompute_grad: 0 without remat.
    code = (
        "import json, sys\n"
        "import tensorflow as tf\n"
        "calls, real = [], tf.recompute_grad\n"
        "tf.recompute_grad = lambda f: calls.append(f) or real(f)\n"
        "import tpurun\n"
        "for config in json.loads(sys.argv[1]):\n"
        "    before = len(calls)\n"
        "    assert tpurun.train(config, verbose=False)['status'] == 'completed'\n"
        "    print(config['name'], len(calls) - before)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, json.dumps(configs)], env=cli_env(),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    counts = dict(line.split() for line in done.stdout.splitlines() if line.startswith(("plain ",
                                                                                        "remat ")))  # fmt: skip
    # Each trace of the step (Keras traces it several times, per replica) hands over each of the
    # 2 blocks once: without remat, none.
    traced = int(counts["remat"])
    assert counts["plain"] == "0" and traced >= 2 and traced % 2 == 0, done.stdout
    assert "watched tensor" not in done.stderr
    assert_same_losses(read_log(tmp_path / "runs" / "plain"), read_log(tmp_path / "runs" / "remat"))
