"""tpurun's ``auto`` layout on the families KerasHub gives no layout map (keras-hub#2807), and the
placement listing (``tpurun config CONFIG --placement``).

Tiny Gemma 3 (4 query heads, 1 key/value head) and Qwen 3 (8 query heads, 2 key/value heads)
models, with their real layer names, are built on a 2 x 4 mesh of the 8 simulated CPU devices and
take one training step; the shardings are read back from JAX. A model axis of 4 divides the query
heads, so they are split by head; it divides neither key/value head count, so those kernels are
split along the hidden size instead and every head stays whole on one device.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import write_config
from typer.testing import CliRunner

from tpurun import frameworks
from tpurun.cli.app import app
from tpurun.runtime.auto_layout import Weight, auto_rule, einsum_roles
from tpurun.runtime.layout import Placer, check_placements
from tpurun.runtime.mesh import placing

SIZES = {"num_layers": 2, "hidden_dim": 64, "intermediate_dim": 128, "head_dim": 16}
GEMMA3 = {**SIZES, "num_query_heads": 4, "num_key_value_heads": 1}
QWEN3 = {**SIZES, "num_query_heads": 8, "num_key_value_heads": 2}

# Each variable kind's split on the 2 x 4 mesh (data x model), one entry per dimension.
GEMMA3_SPECS = {
    r"token_embedding/embeddings": ("model", None),  # [vocabulary, hidden]
    r"decoder_block_\d/attention/query/kernel": ("model", None, None),  # [heads 4, hidden, head]
    r"decoder_block_\d/attention/(key|value)/kernel": (None, "model", None),  # 1 head: hidden
    r"decoder_block_\d/attention/attention_output/kernel": ("model", None, None),  # heads 4
    r"decoder_block_\d/ffw_gating(_2)?/kernel": (None, "model"),  # [hidden, intermediate]
    r"decoder_block_\d/ffw_linear/kernel": ("model", None),  # [intermediate, hidden]
    r".*(norm|normalization)/scale": (None,),
}
QWEN3_SPECS = {
    r"token_embedding/embeddings": ("model", None),
    r"transformer_layer_\d/self_attention/query/kernel": (None, "model", None),  # [hidden, 8, head]
    r"transformer_layer_\d/self_attention/(key|value)/kernel": ("model", None, None),  # 2 heads
    r"transformer_layer_\d/self_attention/attention_output/kernel": ("model", None, None),
    r"transformer_layer_\d/feedforward_(intermediate|gate)_dense/kernel": (None, "model"),
    r"transformer_layer_\d/feedforward_output_dense/kernel": ("model", None),
    r".*layernorm/scale": (None,),
}


def _pad(spec: tuple, n: int) -> tuple:
    return tuple(spec) + (None,) * (n - len(spec))


def kinds(model, specs: dict[str, tuple]) -> dict[str, tuple]:
    """Each variable's JAX partition spec, checked to be its kind's: ``{path: spec}``."""
    found = {}
    for v in model.variables:
        kind = [k for k in specs if re.fullmatch(k, v.path)]
        assert len(kind) == 1, (v.path, kind)
        found[v.path] = _pad(tuple(v.value.sharding.spec), len(v.shape))
        assert found[v.path] == specs[kind[0]], (v.path, found[v.path])
    assert {k for k in specs if any(re.fullmatch(k, p) for p in found)} == set(specs)
    return found


def gemma3_preset(folder: Path) -> Path:
    """A Gemma 3 causal LM preset of the tiny SentencePiece vocabulary, text only."""
    from hub_presets import GEMMA_SEQUENCE_LENGTH, _sentencepiece_proto, corpus

    keras, keras_hub = frameworks.keras(), frameworks.keras_hub()
    keras.utils.set_random_seed(0)
    tokenizer = keras_hub.models.Gemma3Tokenizer(
        proto=_sentencepiece_proto(corpus()), has_vision_tokens=False
    )
    preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor(
        tokenizer, sequence_length=GEMMA_SEQUENCE_LENGTH
    )
    backbone = keras_hub.models.Gemma3Backbone(
        vocabulary_size=tokenizer.vocabulary_size(), image_size=None, **GEMMA3
    )
    task = keras_hub.models.Gemma3CausalLM(backbone=backbone, preprocessor=preprocessor)
    task.save_to_preset(str(folder))
    return folder


def first_query(task):
    """The first layer's query kernel."""
    return next(v for v in task.variables if re.search(r"_0/(self_)?attention/query/", v.path))


def one_step(task) -> float:
    """One training step of ``task`` on a batch of 8 sequences of 8 token ids; its loss."""
    keras = frameworks.keras()
    task.compile(optimizer=keras.optimizers.Adam(1e-3),
                 loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))  # fmt: skip
    ids = np.random.default_rng(0).integers(4, 256, size=(8, 9)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((8, 8), dtype="bool")}
    return float(task.train_on_batch(x, ids[:, 1:], return_dict=True)["loss"])


@pytest.fixture(scope="module")
def on_2x4(tmp_path_factory) -> SimpleNamespace:
    """The tiny Gemma 3 (from its preset, as train loads it) and Qwen 3 causal LMs built under
    the auto layout on a 2 x 4 mesh, each after one training step: ``gemma3``, ``qwen3`` (the
    models), their ``placers``, their ``losses`` and the query kernels ``before`` the step."""
    keras, keras_hub = frameworks.keras(), frameworks.keras_hub()
    preset = gemma3_preset(tmp_path_factory.mktemp("gemma3") / "gemma3")
    mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"],
                                         keras.distribution.list_devices())  # fmt: skip
    out = SimpleNamespace(preset=preset, placers={}, losses={}, before={})
    for name in ("gemma3", "qwen3"):
        placer = Placer([], {"data": 2, "model": 4}, "auto", auto=True)
        with placing(placer, mesh).scope():
            if name == "gemma3":
                task = keras_hub.models.Gemma3CausalLM.from_preset(str(preset), preprocessor=None)
            else:
                backbone = keras_hub.models.Qwen3Backbone(vocabulary_size=256, **QWEN3)
                task = keras_hub.models.Qwen3CausalLM(backbone=backbone, preprocessor=None)
            out.before[name] = np.asarray(first_query(task).value)
            out.losses[name] = one_step(task)
        setattr(out, name, task)
        out.placers[name] = placer
    return out


# ------------------------------------------------------------------------------- the auto rule
@pytest.mark.parametrize(
    ("equation", "roles"),
    [("btd,ndh->btnh", ["heads", "features", "head"]),  # Gemma's query
     ("btnh,nhd->btd", ["heads", "head", "features"]),  # Gemma's attention output
     ("bqm,muh->bquh", ["features", "heads", "head"]),  # Qwen, Mistral, Phi-3's query
     ("abc,cde->abde", ["features", "heads", "head"]),  # keras.layers.MultiHeadAttention's
     ("btd,df->btf", ["features", "features"]),  # a feed-forward kernel
     ("ab->b", None)],  # not input,kernel->output
)  # fmt: skip
def test_an_einsum_equation_says_which_kernel_dimension_counts_heads(equation, roles):
    assert einsum_roles(equation, len(roles or "ab")) == roles


def test_the_auto_rule_never_splits_inside_a_head():
    gemma_kv = Weight("EinsumDense", equation="bsd,kdh->bskh")
    # 8 heads on 4: by head. 1 or 2 heads: the hidden size. Heads and hidden indivisible: whole,
    # though the head's own 16 divides 4.
    assert auto_rule((8, 64, 16), 4, gemma_kv) == (("model", None, None), "attention heads")
    assert auto_rule((2, 64, 16), 4, gemma_kv) == (
        (None, "model", None), "features (head count 2 not divisible by 4)")  # fmt: skip
    assert auto_rule((2, 6, 16), 4, gemma_kv) == (
        (None, None, None), "whole (head count 2 and features not divisible by 4)")  # fmt: skip
    embedding = Weight("ReversibleEmbedding", vocabulary=256)
    assert auto_rule((256, 512), 4, embedding) == (("model", None), "vocabulary")
    assert auto_rule((512, 256), 4, embedding) == ((None, "model"), "vocabulary")  # reverse
    # A layer that says nothing (a mixture of experts' stacked kernels): the largest dimension.
    assert auto_rule((4, 64, 128), 4) == ((None, None, "model"), "largest divisible dimension")
    assert auto_rule((64,), 4) == ((None,), "whole (a vector)")


# ------------------------------------------------------------------------- Gemma 3, Qwen 3 on 2x4
def test_gemma3_is_split_by_heads_where_4_divides_them_and_by_hidden_size_where_not(on_2x4):
    specs = kinds(on_2x4.gemma3, GEMMA3_SPECS)
    placements = on_2x4.placers["gemma3"].placements
    assert placements["decoder_block_0/attention/query/kernel"].how == "auto: attention heads"
    assert placements["decoder_block_0/attention/key/kernel"].how == (
        "auto: features (head count 1 not divisible by 4)")  # fmt: skip
    assert placements["token_embedding/embeddings"].how == "auto: vocabulary"
    assert all(placements[p].axes == s for p, s in specs.items())  # as placed, so held
    paths = [v.path for v in on_2x4.gemma3.variables]
    check_placements(on_2x4.placers["gemma3"], paths)  # no large weight whole: train's check


def test_qwen3_is_split_by_heads_where_4_divides_them_and_by_hidden_size_where_not(on_2x4):
    kinds(on_2x4.qwen3, QWEN3_SPECS)
    placements = on_2x4.placers["qwen3"].placements
    assert placements["transformer_layer_1/self_attention/value/kernel"].how == (
        "auto: features (head count 2 not divisible by 4)")  # fmt: skip
    check_placements(on_2x4.placers["qwen3"], [v.path for v in on_2x4.qwen3.variables])


@pytest.mark.parametrize("name", ["gemma3", "qwen3"])
def test_a_training_step_runs_on_the_auto_layout_and_keeps_it(on_2x4, name):
    task = getattr(on_2x4, name)
    assert np.isfinite(on_2x4.losses[name]) and on_2x4.losses[name] > 0
    query = first_query(task)
    assert not np.allclose(np.asarray(query.value), on_2x4.before[name])  # it trained
    assert len(query.value.sharding.device_set) == 8
    assert query.value.sharding.shard_shape(query.shape) in {(1, 64, 16), (64, 2, 16)}


# ----------------------------------------------------------------------- the placement listing
def placement_config(tmp_path: Path, preset: Path, data: Path, **runtime) -> Path:
    config = {
        "name": "placed",
        "model": {"preset": str(preset), "sequence_length": 16},
        "data": {"train": str(data / "chat-train-*")},
        "train": {"per_core_batch_size": 1},
        "runtime": {"cpu_devices": 8, "mesh": {"data": 2, "model": 4}, **runtime},
        "output": {"dir": str(tmp_path / "runs")},
    }
    return write_config(tmp_path / "placed.yaml", config)


def test_the_listing_names_each_variables_rule_and_bytes_per_device(on_2x4, chat_records,
                                                                    tmp_path):  # fmt: skip
    path = placement_config(tmp_path, on_2x4.preset, chat_records(64))
    done = CliRunner().invoke(app, ["config", str(path), "--placement"])
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert lines[0] == "24 variables on a mesh of data 2 x model 4, layout auto:"
    assert re.fullmatch(r"path +shape +split +rule +per device", lines[1])
    row = {line.split()[0]: re.split(r"  +", line) for line in lines[2:-1]}
    assert row["decoder_block_0/attention/query/kernel"] == [
        "decoder_block_0/attention/query/kernel", "[4, 64, 16]", "model, -, -",
        "auto: attention heads", "4.0 KiB"]  # fmt: skip
    assert row["decoder_block_1/attention/value/kernel"][2:] == [
        "-, model, -", "auto: features (head count 1 not divisible by 4)", "1.0 KiB"]  # fmt: skip
    assert row["final_normalization/scale"][2:] == ["-", "auto: whole (a vector)", "256 B"]
    assert lines[-1].startswith("weights per device: ")
    assert not (tmp_path / "runs").exists()  # nothing trained, nothing written


def test_the_listing_is_where_train_puts_each_weight(on_2x4, chat_records, tmp_path):
    """Built on the CPU without weights, the listing's split of each variable is the one JAX holds
    for the model built on the mesh."""
    path = placement_config(tmp_path, on_2x4.preset, chat_records(64))
    done = CliRunner().invoke(app, ["config", str(path), "--placement", "--json"])
    assert done.exit_code == 0, done.output
    listing = json.loads(done.output)
    held = {
        v.path: _pad(tuple(v.value.sharding.spec), len(v.shape)) for v in on_2x4.gemma3.variables
    }
    assert {v["path"]: tuple(v["axes"]) for v in listing["variables"]} == held
    split = sum(v["bytes"] for v in listing["variables"] if any(v["axes"]))
    whole = sum(v["bytes"] for v in listing["variables"] if not any(v["axes"]))
    assert listing["bytes_per_device"] == split // 4 + whole


def test_a_layout_pattern_is_matched_against_the_whole_path(on_2x4, chat_records, tmp_path):
    """Keras 3.14 made LayoutMap keys re.fullmatch (keras#22164); tpurun's patterns are matched
    in full too. One that matches only part of a path (as re.search would) is refused with the
    pattern to write; written so, it places those variables and the listing names it."""
    data = chat_records(64)
    partial = [{"pattern": "attention/query/kernel", "axes": [None, "model", None]}]
    path = placement_config(tmp_path, on_2x4.preset, data, layout=partial)
    done = CliRunner().invoke(app, ["config", str(path), "--placement"])
    assert done.exit_code == 2, done.output
    assert (
        "error: invalid config: runtime.layout: the pattern 'attention/query/kernel' matches no "
        "whole variable path: tpurun matches each pattern against the whole path (re.fullmatch, "
        "as Keras 3.14 and later match LayoutMap keys, keras#22164), and it matches only part of "
        "2 path(s), such as decoder_block_0/attention/query/kernel. To place those, write "
        "'.*attention/query/kernel'."
    ) in " ".join(done.output.split()), done.output

    whole = [{"pattern": ".*attention/query/kernel", "axes": [None, "model", None]}]
    path = placement_config(tmp_path, on_2x4.preset, data, layout=whole)
    done = CliRunner().invoke(app, ["config", str(path), "--placement", "--json"])
    assert done.exit_code == 0, done.output
    rows = {v["path"]: v for v in json.loads(done.output)["variables"]}
    query = rows["decoder_block_1/attention/query/kernel"]
    assert (query["axes"], query["rule"]) == (
        [None, "model", None], "runtime.layout: .*attention/query/kernel")  # fmt: skip
    assert rows["decoder_block_1/attention/key/kernel"]["rule"].startswith("auto: features")


def test_a_factory_models_placement_and_a_data_parallel_one(toy_data, tmp_path):
    """auto on a model.factory model: mlp(64)'s kernels [8, 64] and [64, 1] both along their 64
    (the largest dimension 4 divides), the biases whole; without a mesh every weight is whole."""
    from helpers import FACTORIES, toy_config

    config = toy_config(toy_data, tmp_path / "runs",
                        model={"factory": f"{FACTORIES}:mlp", "kwargs": {"units": 64}},
                        runtime={"cpu_devices": 8, "mesh": {"model": 4}})  # fmt: skip
    path = write_config(tmp_path / "mlp.yaml", config)
    done = CliRunner().invoke(app, ["config", str(path), "--placement", "--json"])
    assert done.exit_code == 0, done.output
    listing = json.loads(done.output)
    assert (listing["mesh"], listing["layout"]) == ({"data": 2, "model": 4}, "auto")
    largest = "auto: largest divisible dimension"
    assert [(v["shape"], v["axes"], v["rule"], v["bytes_per_device"]) for v in listing["variables"]] == [
        ([8, 64], [None, "model"], largest, 8 * 16 * 4), ([64], [None], "auto: whole (a vector)", 256),
        ([64, 1], ["model", None], largest, 16 * 4), ([1], [None], "auto: whole (a vector)", 4)]  # fmt: skip

    done = CliRunner().invoke(app, ["config", str(path), "--placement", "--json",
                                    "--set", "runtime.mesh=null"])  # fmt: skip
    assert done.exit_code == 0, done.output
    listing = json.loads(done.output)
    assert {v["rule"] for v in listing["variables"]} == {"whole (data parallel: no runtime.mesh)"}
    assert listing["bytes_per_device"] == listing["bytes"] == (8 * 64 + 64 + 64 + 1) * 4


# ----------------------------------------------------------- Gemma 3 fine-tuned through tpurun
def test_gemma3_prompts_and_responses_pack_as_its_own_preprocessor_packs_them(on_2x4):
    """Gemma 3's preprocessor packs with segment ids, not a padding mask (MultiSegmentPacker):
    tpurun's prompt/response packing gives its very ids, mask and answer weights."""
    from tpurun.hub import tokenize

    keras_hub, tf = frameworks.keras_hub(), frameworks.tensorflow()
    preprocessor = keras_hub.models.Gemma3CausalLMPreprocessor.from_preset(str(on_2x4.preset))
    preprocessor.sequence_length = 12  # cuts the second pair's response
    prompts = tf.constant(["the cat eats", "our teacher reads an apple"])
    responses = tf.constant(["an apple today.", "some bread every day with joy again."])
    pack = tokenize.pack_prompt_response(preprocessor)  # inside tf.data, as the pipeline runs it
    packed = tf.data.Dataset.from_tensors((prompts, responses)).map(pack).get_single_element()
    x, y, weights = tokenize.shifted(*packed)
    own_x, own_y, own_weights = preprocessor({"prompts": prompts, "responses": responses})
    np.testing.assert_array_equal(x["token_ids"], own_x["token_ids"])
    np.testing.assert_array_equal(x["padding_mask"], own_x["padding_mask"])
    np.testing.assert_array_equal(y, own_y)
    np.testing.assert_array_equal(weights, np.asarray(own_weights, dtype="float32"))
    assert 0 < int(np.sum(weights)) < int(np.sum(x["padding_mask"]))  # the prompts are masked


@pytest.mark.slow
def test_a_gemma3_preset_fine_tunes_with_lora_on_the_auto_layout(on_2x4, chat_records, tmp_path):
    path = placement_config(tmp_path, on_2x4.preset, chat_records(64))
    config = {**__import__("yaml").safe_load(path.read_text()), "train": {
        "per_core_batch_size": 1, "epochs": 1, "steps_per_execution": 1}}  # fmt: skip
    config["model"]["lora"] = {"rank": 2}
    done = CliRunner().invoke(app, ["train", str(write_config(tmp_path / "lora.yaml", config))])
    assert done.exit_code == 0, done.output
    assert "model_parallel mesh 2x4" in done.output
    summary = json.loads((tmp_path / "runs" / "placed" / "summary.json").read_text())
    assert summary["epochs_completed"] == 1
    assert np.isfinite(summary["best"]["value"])
