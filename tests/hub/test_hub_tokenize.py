"""Text tokenised once (`tpurun data write --tokenize PRESET --sequence-length N`) trains exactly as
text tokenised in the pipeline: the same batches, element for element; records made for another
tokenizer, sequence length or kind of task are refused; inspect and bench show tokens."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import read_log, write_config
from hub_presets import prompt_response_pairs, sentences
from typer.testing import CliRunner

import tpurun
from tpurun import frameworks
from tpurun.cli.app import app
from tpurun.data import pipeline
from tpurun.data.resolve import preset_refs
from tpurun.data.statistics import Statistics
from tpurun.errors import DataError
from tpurun.hub import batches
from tpurun.hub.task_model import build_preprocessor
from tpurun.plan.prepare import prepare_here

runner = CliRunner()
LENGTH = 32  # the chat pairs pack to 25..37 tokens: some are cut, most are padded


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def chat_rows(n: int = 48) -> list[dict]:
    rows = [{"prompt": p, "response": r} for p, r in prompt_response_pairs(n)]
    rows[3]["prompt"] = " ".join(["question: what"] * 12) + "?"  # no room left for the answer
    rows[5]["response"] = "answer: yes."  # short: mostly padding
    return rows


def write(tmp_path: Path, rows: list[dict], name: str, *options: str) -> Path:
    """``tpurun data write`` of ``rows`` under tmp_path/data/<name> (a quarter for validation)."""
    source = write_jsonl(tmp_path / f"{name}.jsonl", rows)
    out = tmp_path / "data" / name
    result = runner.invoke(app, ["data", "write", str(source), str(out),
                                 "--validation-fraction", "0.25", *options])  # fmt: skip
    assert result.exit_code == 0, result.output
    return tmp_path / "data"


def preset_config(tmp_path: Path, preset: Path, name: str, **model) -> dict:
    data = tmp_path / "data"
    return {
        "name": name,
        "model": {"preset": str(preset), **model},
        "data": {
            "train": str(data / f"{name}-train-*"),
            "validation": str(data / f"{name}-validation-*"),
        },  # fmt: skip
        "train": {"per_core_batch_size": 4, "epochs": 2, "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 1},
        "output": {"dir": str(tmp_path / "runs")},
    }


def pipeline_batches(config: dict, training: bool, count: int = 4) -> list:
    """The batches a run of ``config`` feeds: its records through its preset's transform."""
    config = tpurun.load_config(config)
    prepared = prepare_here(config)
    data, resolved = prepared.config.data, prepared.data
    # As a run's activate() does, and before the tokenizer exists: seeding TF afterwards drops
    # the SentencePiece resource the tokenizer made ("Resource ... does not exist").
    frameworks.tensorflow().random.set_seed(1)
    preprocessor = build_preprocessor(config)
    transform = batches.transform(preprocessor, data, resolved.tokenized)
    files = resolved.train_files if training else resolved.validation_files
    ds = pipeline.make_dataset(
        files, data, 4, training=training, seed=3, transform=transform,
        score_records=None if training else resolved.validation_records,
    )  # fmt: skip
    return [batch for batch, _ in zip(ds, range(count), strict=False)]


def assert_same_batches(tokenised: list, text: list) -> None:
    assert len(tokenised) == len(text) > 0
    for ours, theirs in zip(tokenised, text, strict=True):
        flat_ours, flat_theirs = flatten(ours), flatten(theirs)
        assert flat_ours.keys() == flat_theirs.keys()
        for key, value in flat_theirs.items():
            assert flat_ours[key].dtype == value.dtype, key
            np.testing.assert_array_equal(flat_ours[key], value, err_msg=key)


def flatten(batch) -> dict[str, np.ndarray]:
    out = {}
    for i, part in enumerate(batch):
        items = part.items() if isinstance(part, dict) else [("", part)]
        for key, value in items:
            out[f"{i}/{key}"] = np.asarray(value)
    return out


# ------------------------------------------------------------------ the same batches, both ways
@pytest.mark.parametrize("whole_text", [False, True], ids=["prompt-response", "one-text"])
def test_tokenised_causal_lm_records_feed_the_batches_text_feeds(
    tiny_presets, tmp_path, whole_text
):
    rows = chat_rows()
    if whole_text:
        rows = [{"text": f"{row['prompt']} {row['response']}"} for row in rows]
    write(tmp_path, rows, "text")
    write(tmp_path, rows, "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", str(LENGTH))  # fmt: skip
    text = preset_config(tmp_path, tiny_presets.gemma, "text", sequence_length=LENGTH)
    tok = preset_config(tmp_path, tiny_presets.gemma, "tok", sequence_length=LENGTH)
    for training in (True, False):  # the shuffled stream, and exact validation's weighted batches
        assert_same_batches(pipeline_batches(tok, training), pipeline_batches(text, training))
    x, y, weights = pipeline_batches(tok, training=False)[0]
    assert x["token_ids"].shape == y.shape == weights.shape == (4, LENGTH)
    schema = json.loads((tmp_path / "data" / "tok.schema.json").read_text())
    entry = schema["tokenized"]
    assert entry["kind"] == "causal_lm" and entry["sequence_length"] == LENGTH
    assert entry["source"] == (
        {"inputs": "text", "targets": "text"}
        if whole_text
        else {"inputs": "prompt", "targets": "response"}
    )
    tokens = schema["statistics"]["tokens"]
    assert (
        tokens["positions"] == LENGTH + 1 and tokens["full"] >= 1 and tokens["min_tokens"] < LENGTH
    )
    assert "token_ids" not in schema["statistics"]["features"]  # no mean id per position


def test_the_prompt_that_fills_the_sequence_leaves_nothing_to_learn(tiny_presets, tmp_path):
    rows = chat_rows(8)
    write(tmp_path, rows, "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", "16")  # fmt: skip
    config = tpurun.load_config(preset_config(tmp_path, tiny_presets.gemma, "tok",
                                              sequence_length=16))  # fmt: skip
    prepared = prepare_here(config)
    files = prepared.data.train_files + prepared.data.validation_files
    ds = pipeline.make_dataset(files, prepared.config.data, 1, training=False)
    inputs, targets = next(iter(ds))
    assert set(inputs) == {"token_ids", "padding_mask"} and set(targets) == {"token_ids", "weights"}
    weights = [float(np.asarray(t["weights"]).sum()) for _, t in ds]
    assert min(weights) == 0 and max(weights) > 0  # row 3's prompt fills all 17 positions


def test_tokenised_classifier_records_feed_the_batches_text_feeds(tiny_presets, tmp_path):
    animals = ("cat", "dog", "bird", "fox")
    rows = [{"text": s, "label": int(any(a in s for a in animals))} for s in sentences(40)]
    write(tmp_path, rows, "text", "--label", "label")
    write(tmp_path, rows, "tok", "--label", "label", "--tokenize", str(tiny_presets.bert))
    text = preset_config(tmp_path, tiny_presets.bert, "text")
    tok = preset_config(tmp_path, tiny_presets.bert, "tok")
    for training in (True, False):
        assert_same_batches(pipeline_batches(tok, training), pipeline_batches(text, training))
    features = json.loads((tmp_path / "data" / "tok.schema.json").read_text())["features"]
    assert list(features) == ["token_ids", "padding_mask", "segment_ids", "label"]
    assert features["token_ids"] == {"type": "int64", "shape": [16], "cast": "int32"}


# ------------------------------------------------------------------ which features are which
def test_tokenised_features_say_which_are_inputs_and_targets():
    ids = {"type": "int64", "shape": [33]}
    causal = {"token_ids": ids, "padding_mask": ids, "weights": {"type": "float", "shape": [33]}}
    assert preset_refs(causal, None, None) == (
        {"token_ids": "token_ids", "padding_mask": "padding_mask"},
        {"token_ids": "token_ids", "weights": "weights"},
    )
    classifier = {
        "token_ids": ids,
        "padding_mask": ids,
        "segment_ids": ids,
        "label": {"type": "int64"},
    }
    inputs, targets = preset_refs(classifier, None, None)
    assert inputs == {n: n for n in ("token_ids", "padding_mask", "segment_ids")}
    assert targets == "label"


def test_statistics_count_tokens_not_ids():
    features = {"token_ids": {"type": "int64", "shape": [4]},
                "padding_mask": {"type": "int64", "shape": [4]}}  # fmt: skip
    entry = {"features": ["token_ids", "padding_mask"], "mask": "padding_mask"}
    stats = Statistics(features, tokenized=entry)
    mask = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]])
    stats.update({"token_ids": mask * 7, "padding_mask": mask}, keep=np.array([True, True, False]))
    schema = stats.to_schema("train")
    assert schema["features"] == {}
    assert schema["tokens"] == {"count": 2, "positions": 4, "min_tokens": 2, "mean_tokens": 3.0,
                                "max_tokens": 4, "full": 1}  # fmt: skip


# ------------------------------------------------------------------ records the run did not make
def test_another_sequence_length_is_refused(tiny_presets, tmp_path):
    write(tmp_path, chat_rows(16), "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", "24")  # fmt: skip
    config = preset_config(tmp_path, tiny_presets.gemma, "tok", sequence_length=20)
    with pytest.raises(DataError, match=r"model.sequence_length: the records of .*tok.schema.json "
                       r"hold sequences of 24 tokens, and this run's preprocessor packs 20: set "
                       r"model.sequence_length: 24, or write the records again"):  # fmt: skip
        pipeline_batches(config, training=True)


def other_vocabulary(preset: Path, tmp_path: Path) -> Path:
    """The same model with another vocabulary (made of other words): other ids for the text."""
    from hub_presets import _sentencepiece_proto, made_up_sentences

    other = shutil.copytree(preset, tmp_path / "other_gemma")
    proto = _sentencepiece_proto(sentences() + made_up_sentences(300, seed=9))
    (other / "assets" / "tokenizer" / "vocabulary.spm").write_bytes(proto)
    return other


def test_another_tokenizer_is_refused(tiny_presets, tmp_path):
    other = other_vocabulary(tiny_presets.gemma, tmp_path)
    write(tmp_path, chat_rows(16), "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", "24")  # fmt: skip
    config = preset_config(tmp_path, other, "tok", sequence_length=24)
    with pytest.raises(DataError, match=f"model.preset: the records of .* were tokenised by the "
                       f"tokenizer of {tiny_presets.gemma} \\(GemmaTokenizer\\), and this "
                       "preset's tokenizer"):  # fmt: skip
        pipeline_batches(config, training=True)


def test_causal_lm_records_are_refused_for_a_classifier(tiny_presets, tmp_path):
    write(tmp_path, chat_rows(16), "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", "16")  # fmt: skip
    config = preset_config(tmp_path, tiny_presets.bert, "tok", sequence_length=16)
    with pytest.raises(DataError, match="tokenised for GemmaCausalLM as causal lm records, and "
                       "model.preset builds a classifier"):  # fmt: skip
        pipeline_batches(config, training=True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--sequence-length", "8"], "--sequence-length: applies with --tokenize PRESET"),
        (["--tokenize", "no/such/preset"], "--tokenize: no folder"),
        (["--tokenize", "RESNET"], "--tokenize: .*tiny_resnet is a ResNetImageClassifier"),
        (["--tokenize", "BERT", "--sequence-length", "4096"],
         "--sequence-length: 4096 is over the longest sequence"),
        (["--tokenize", "BERT"], "--tokenize for BertTextClassifier takes text features and "
                                 "one label \\(--label\\); the source has prompt \\(text\\), "
                                 "response \\(text\\)"),
    ],
)  # fmt: skip
def test_bad_tokenize_options_are_refused(tiny_presets, tmp_path, options, message):
    source = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    named = {"RESNET": tiny_presets.resnet, "GEMMA": tiny_presets.gemma, "BERT": tiny_presets.bert}
    options = [str(named.get(o, o)) for o in options]
    result = runner.invoke(app, ["data", "write", str(source), str(tmp_path / "out"), *options])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ")
    assert re.search(message, result.output.replace("\n", " ")), result.output
    assert not list(tmp_path.glob("out*"))


# ------------------------------------------------------------------ inspect, bench, train
def test_inspect_shows_tokens(tiny_presets, tmp_path):
    data = write(tmp_path, chat_rows(16), "tok", "--tokenize", str(tiny_presets.gemma),
                 "--sequence-length", "24")  # fmt: skip
    result = runner.invoke(app, ["data", "inspect", str(data / "tok-*"), "--plain"])
    assert result.exit_code == 0, result.output
    assert re.search("tokenized +for GemmaCausalLM at sequence length 24", result.output)
    assert "from inputs prompt, targets response" in result.output
    assert "tokens, mean" in result.output and "fill all 25 positions" in result.output
    first = [line for line in result.output.splitlines() if "of 25 tokens)" in line]
    assert first and first[0].strip().startswith("[2 "), result.output  # <bos> first
    report = json.loads(runner.invoke(app, ["data", "inspect", str(data / "tok-*"),
                                            "--json"]).output)  # fmt: skip
    assert report["tokenized"]["lengths"]["positions"] == 25


def test_bench_times_the_tokenising_both_ways(tiny_presets, tmp_path):
    rows = chat_rows(64)
    write(tmp_path, rows, "text")
    write(tmp_path, rows, "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", str(LENGTH))  # fmt: skip
    results = {}
    for name in ("text", "tok"):
        config = preset_config(tmp_path, tiny_presets.gemma, name, sequence_length=LENGTH)
        path = write_config(tmp_path, config, name)
        result = runner.invoke(app, ["data", "bench", str(path), "--steps", "5", "--json"])
        assert result.exit_code == 0, result.output
        results[name] = json.loads(result.output)
    for result in results.values():
        assert result["positions"] == LENGTH
        assert result["tokens_per_sec"] == pytest.approx(result["examples_per_sec"] * LENGTH)
    assert "tokenises each batch" in results["text"]["preprocessing"]
    assert "tokenised once for GemmaCausalLM" in results["tok"]["preprocessing"]
    # What the sequence length cuts: counted on the text (tokenised records were cut when written).
    lengths = results["text"]["token_lengths"]
    assert lengths["sequence_length"] == LENGTH and lengths["sampled"] == 48  # the train split
    assert lengths["sentence"].startswith(f"model.sequence_length: {LENGTH} tokens ")
    assert results["tok"]["token_lengths"] is None


@pytest.mark.slow
def test_a_fine_tune_on_tokenised_records_is_the_fine_tune_on_text(tiny_presets, tmp_path):
    rows = chat_rows(64)
    write(tmp_path, rows, "text")
    write(tmp_path, rows, "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", "24")  # fmt: skip
    losses = {}
    for name in ("text", "tok"):
        config = preset_config(tmp_path, tiny_presets.gemma, name, sequence_length=24,
                               lora={"rank": 4})  # fmt: skip
        result = runner.invoke(app, ["train", str(write_config(tmp_path, config, name))])
        assert result.exit_code == 0, result.output
        losses[name] = [(r["loss"], r["val_loss"]) for r in read_log(tmp_path / "runs" / name)]
    assert losses["tok"] == losses["text"] and len(losses["tok"]) == 2
    assert float(losses["tok"][-1][0]) < float(losses["tok"][0][0])


@pytest.mark.slow
@pytest.mark.parametrize("change", ["sequence length", "tokenizer"])
def test_train_refuses_records_it_would_not_have_made(tiny_presets, tmp_path, change):
    write(tmp_path, chat_rows(16), "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", "24")  # fmt: skip
    if change == "sequence length":  # the preset's own: 32
        config = preset_config(tmp_path, tiny_presets.gemma, "tok", lora={"rank": 4})
        expected = ["hold sequences of 24 tokens, and this run's preprocessor packs 32",
                    "set model.sequence_length: 24"]  # fmt: skip
    else:
        other = other_vocabulary(tiny_presets.gemma, tmp_path)
        config = preset_config(tmp_path, other, "tok", sequence_length=24, lora={"rank": 4})
        expected = [f"were tokenised by the tokenizer of {tiny_presets.gemma}"]
    result = runner.invoke(app, ["train", str(write_config(tmp_path, config, "tok"))])
    assert result.exit_code == 2, result.output
    for words in expected:
        assert words in result.output.replace("\n", " "), result.output
    assert not (tmp_path / "runs" / "tok" / "config.yaml").exists()  # nothing trained or kept


# ------------------------------------------------------------------ export
@pytest.mark.slow
def test_a_fine_tune_on_tokenised_records_exports_an_adapter_and_a_task_taking_token_ids(
    tiny_presets, tmp_path
):
    """`export --format lora` and `keras` of a LoRA run on token ids: each checked in a fresh
    process on the records' token ids, and each, loaded as its usage line says (preprocessor
    off), gives the run's logits for the batches the run was fed."""
    pytest.importorskip("tensorflow")  # --tokenize: tensorflow-text (test_without_tensorflow)
    keras, keras_hub = frameworks.keras(), frameworks.keras_hub()
    write(tmp_path, chat_rows(48), "tok", "--tokenize", str(tiny_presets.gemma),
          "--sequence-length", "24")  # fmt: skip
    config = preset_config(tmp_path, tiny_presets.gemma, "tok", sequence_length=24,
                           lora={"rank": 4, "alpha": 8})  # fmt: skip
    result = runner.invoke(app, ["train", str(write_config(tmp_path, config, "tok"))])
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "tok"
    sidecars = {}
    for fmt, name in (("lora", "adapter.lora.h5"), ("keras", "merged.keras")):
        result = runner.invoke(app, ["export", str(run), "--format", fmt, "--output",
                                     str(tmp_path / name)])  # fmt: skip
        assert result.exit_code == 0, result.output
        sidecars[fmt] = json.loads((tmp_path / f"{name}.json").read_text())
    for sidecar in sidecars.values():
        checked = sidecar["checked"]
        assert checked["on"] == "the first 12 records of data.validation"
        assert checked["loaded_without_tpurun"] and checked["max_abs_diff"] <= 1e-5
        assert {(i["name"], i["feature"]) for i in sidecar["inputs"]} == {
            ("token_ids", "token_ids"), ("padding_mask", "padding_mask")}  # fmt: skip
        assert "preprocessor = None" in sidecar["usage"] and "predict_on_batch" in sidecar["usage"]
        assert "takes token ids (padding_mask, token_ids: [batch, 24])" in sidecar["notes"][0]
        assert "less each record's last position" in sidecar["notes"][0]
    assert "enable_lora(4)" in sidecars["lora"]["usage"]
    assert "lora_alpha', 8.0" in sidecars["lora"]["usage"]

    x, _, _ = pipeline_batches(config, training=False, count=1)[0]
    x = {k: np.asarray(v) for k, v in x.items()}
    tuned, _ = tpurun.load(str(run))  # first: a load re-seeds, freeing older tokenizers
    tuned.preprocessor = None
    want = np.asarray(tuned.predict_on_batch(x))
    base = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    adapted = keras_hub.models.GemmaCausalLM.from_preset(str(tiny_presets.gemma))
    adapted.backbone.enable_lora(4)
    for layer in adapted.backbone._flatten_layers():
        if getattr(layer, "lora_enabled", False):
            layer.lora_alpha = 8.0
    adapted.backbone.load_lora_weights(str(tmp_path / "adapter.lora.h5"))
    merged = keras.saving.load_model(str(tmp_path / "merged.keras"), compile=False)
    assert not [layer for layer in merged.backbone._flatten_layers()
                if getattr(layer, "lora_enabled", False)]  # fmt: skip
    for model in (base, adapted, merged):
        model.preprocessor = None
    assert want.shape == (4, 24, 256)
    assert np.max(np.abs(np.asarray(base.predict_on_batch(x)) - want)) > 1e-2  # it learned
    for model in (adapted, merged):
        np.testing.assert_allclose(np.asarray(model.predict_on_batch(x)), want, atol=1e-5)
