"""After fine-tuning a tiny preset: `tpurun.load` gives the KerasHub task with its preprocessor (a
LoRA run's preset + adapter with its alpha, a full fine-tune's model.keras), `evaluate` reports a
causal LM's loss per token and its perplexity, `predict` completes prompts (greedy or top-k) or
writes a classifier's class names and probabilities, `export` writes the merged task or the
adapter, checked in a fresh process; bad input exits 2 with what to do.

Two runs are trained once per module with the CLI in-process: a LoRA fine-tune of the tiny Gemma
on prompt/response pairs, and a full fine-tune of the tiny BERT classifier."""

from __future__ import annotations

import csv
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from helpers import token_loss_by_hand, write_config
from hub_presets import sentences
from typer.testing import CliRunner

import tpurun
from tpurun import frameworks
from tpurun.cli.app import app
from tpurun.errors import TpurunError

runner = CliRunner()
#: conftest's chat_lora_run: rank 4, alpha 8 (alpha != rank: a loader that dropped it would
#: differ), sequences of 24 tokens.
SEQUENCE_LENGTH = 24
ANIMALS = ("cat", "dog", "bird", "fox")


@dataclass(frozen=True)
class Trained:
    run: Path
    data: Path  # the records' folder
    preset: Path

    def glob(self, split: str) -> str:
        prefix = "chat" if (self.data / "chat.schema.json").exists() else "rev"
        return str(self.data / f"{prefix}-{split}-*")


def _write(folder: Path, name: str, rows: list[dict], *args: str) -> Path:
    source = folder / f"{name}.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = runner.invoke(app, ["data", "write", str(source), str(folder / "data" / name),
                                 "--validation-fraction", "0.25", *args])  # fmt: skip
    assert result.exit_code == 0, result.output
    return folder / "data"


def _train(folder: Path, name: str, model: dict, data: Path, prefix: str, **train) -> Path:
    config = {
        "model": model,
        "data": {"train": str(data / f"{prefix}-train-*"),
                 "validation": str(data / f"{prefix}-validation-*")},
        "train": {"epochs": 4, **train},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(folder / "runs")},
    }  # fmt: skip
    result = runner.invoke(app, ["train", str(write_config(folder, config, name))])
    assert result.exit_code == 0, result.output
    return folder / "runs" / name


@pytest.fixture(scope="module")
def lm_run(chat_lora_run) -> Trained:
    """The session's LoRA fine-tune of the tiny Gemma on question/answer pairs (conftest's
    chat_lora_run, rank 4, alpha 8): every answer starts with "answer:", which 4 epochs learn.
    Read in place; a test that writes into the run copies it."""
    return Trained(chat_lora_run.run_dir, chat_lora_run.data, chat_lora_run.preset)


@pytest.fixture(scope="module")
def classifier_run(tiny_presets, tmp_path_factory) -> Trained:
    """A full fine-tune of the tiny BERT on a keyword task, labels stored as class names."""
    folder = tmp_path_factory.mktemp("hub-infer-cls")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TPURUN_CACHE_DIR", str(folder / "cache"))
        rows = [{"text": s, "label": "animal" if any(a in s for a in ANIMALS) else "other"}
                for s in sentences(256)]  # fmt: skip
        data = _write(folder, "rev", rows, "--label", "label")
        model = {"preset": str(tiny_presets.bert), "metrics": ["sparse_categorical_accuracy"]}
        run = _train(folder, "cls", model, data, "rev", per_core_batch_size=16,
                     learning_rate={"base": 3e-3})  # fmt: skip
    return Trained(run, data, tiny_presets.bert)


def _texts(glob: str, feature: str) -> list[str]:
    """A feature's text in file order, as predict reads the records."""
    from tpurun.infer import trained_run

    tf = frameworks.tensorflow()
    files = trained_run.find_records(glob, {}, "--data").files
    return [tf.train.Example.FromString(r.numpy()).features.feature[feature].bytes_list.value[0]
            .decode() for r in tf.data.TFRecordDataset(files)]  # fmt: skip


def _lora_layers(task) -> list:
    return [x for x in task.backbone._flatten_layers() if getattr(x, "lora_enabled", False)]


def _rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------------- load
def test_load_rebuilds_a_lora_run_from_its_preset_rank_alpha_and_adapter(lm_run, tmp_path):
    keras_hub = frameworks.keras_hub()
    assert (lm_run.run / "model.lora.h5").exists() and not (lm_run.run / "model.keras").exists()
    task, spec = tpurun.load(str(lm_run.run))
    assert isinstance(task, keras_hub.models.GemmaCausalLM) and spec["inputs"] == "prompt"
    assert task.preprocessor.sequence_length == SEQUENCE_LENGTH
    layers = _lora_layers(task)
    assert layers and {(x.lora_rank, x.lora_alpha) for x in layers} == {(4, 8.0)}
    prompts = ["question: what eats the cat?", "question: what sees a dog?"]
    logits = np.asarray(task.predict(prompts, verbose=0))

    # The same by hand, KerasHub only: the preset, LoRA with the run's alpha, the adapter.
    def by_hand(alpha: float | None):
        task = keras_hub.models.GemmaCausalLM.from_preset(str(lm_run.preset))
        task.backbone.enable_lora(4)
        for layer in _lora_layers(task) if alpha else []:
            layer.lora_alpha = alpha  # before the first call: a traced call keeps its alpha
        task.backbone.load_lora_weights(str(lm_run.run / "model.lora.h5"))
        task.preprocessor.sequence_length = SEQUENCE_LENGTH
        return np.asarray(task.predict(prompts, verbose=0))

    np.testing.assert_allclose(by_hand(8.0), logits, rtol=1e-5, atol=1e-5)
    assert np.abs(by_hand(None) - logits).max() > 1e-3  # alpha = rank: a scale of 1, not 2

    # A file KerasHub's own save_lora_weights wrote loads too (--checkpoint PATH).
    plain = tmp_path / "plain.lora.h5"
    task.backbone.save_lora_weights(str(plain))
    again, _ = tpurun.load(str(lm_run.run), str(plain))
    np.testing.assert_array_equal(np.asarray(again.predict(prompts, verbose=0)), logits)


def test_load_a_lora_runs_best_and_latest_checkpoints(lm_run):
    """The loss fell every epoch: the best checkpoint (checkpoints/best.adapter.h5) is the last
    epoch's, as the final model and the resume point are."""
    prompt = ["question: what finds a fox?"]

    def logits(checkpoint: str) -> np.ndarray:
        task, _ = tpurun.load(str(lm_run.run), checkpoint)
        return np.asarray(task.predict(prompt, verbose=0))

    expected = logits(str(lm_run.run / "model.lora.h5"))
    for checkpoint in ("best", "latest", "checkpoints/best.adapter.h5"):
        np.testing.assert_array_equal(logits(checkpoint), expected)


def test_load_under_the_runs_precision(lm_run, tmp_path):
    """bfloat16 (runtime.precision): from_preset casts the base to bfloat16; the adapter stays
    float32, as KerasHub keeps it."""
    import shutil

    import yaml

    keras = frameworks.keras()
    run = tmp_path / "lm"
    shutil.copytree(lm_run.run, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["runtime"]["precision"] = "bfloat16"
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    try:
        task, _ = tpurun.load(str(run), str(run / "model.lora.h5"))
        dtypes = {v.path.rsplit("/", 1)[-1]: v.dtype for v in task.weights}
        assert dtypes["kernel"] == "bfloat16" and dtypes["lora_kernel_a"] == "float32"
    finally:
        keras.config.set_dtype_policy("float32")


def test_load_a_full_fine_tune_gives_its_model_keras(classifier_run):
    keras_hub = frameworks.keras_hub()
    assert (classifier_run.run / "model.keras").exists()
    task, spec = tpurun.load(str(classifier_run.run))
    assert isinstance(task, keras_hub.models.BertTextClassifier)
    assert spec["class_names"] == ["animal", "other"] and not _lora_layers(task)
    assert np.asarray(task.predict(["the cat eats an apple today."], verbose=0)).shape == (1, 2)


# ------------------------------------------------------------------------------------- evaluate
def test_evaluate_reports_the_loss_per_token_and_its_perplexity(lm_run, tmp_path):
    from tpurun.data import pipeline
    from tpurun.hub import batches
    from tpurun.infer import trained_run

    run = tmp_path / "lm"  # evaluate writes its eval-*.json into the run: a copy of the shared one
    shutil.copytree(lm_run.run, run)
    result = runner.invoke(app, ["evaluate", str(run), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["records"] == 24 and shown["loss_exact"] and shown["loss_per"] == "token"

    # By hand: every response token of the 24 validation records (prompts and padding out), in
    # batches of 5 (the last one padded with weight 0), summed in float64.
    trained = trained_run.open_run(str(run))
    task, _ = tpurun.load(str(run))
    transform = batches.transform(batches.detach(task), trained.config.data)
    files = trained_run.find_records(lm_run.glob("validation"), {}, "--data").files
    ds = pipeline.make_dataset(files, trained.config.data, 5, training=False, score_records=24,
                               transform=transform)  # fmt: skip
    total, tokens, _ = token_loss_by_hand(task, ds.as_numpy_iterator())
    assert tokens > 24 * 5  # many tokens per answer
    assert shown["metrics"]["loss"] == pytest.approx(total / tokens, rel=1e-5)
    assert shown["metrics"]["perplexity"] == pytest.approx(np.exp(total / tokens), rel=1e-5)


def test_evaluate_a_classifier_reports_its_accuracy(classifier_run):
    result = runner.invoke(app, ["evaluate", str(classifier_run.run), "--json"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output)["metrics"]
    texts = _texts(classifier_run.glob("validation"), "text")
    task, spec = tpurun.load(str(classifier_run.run))
    predicted = np.asarray(task.predict(np.asarray(texts), verbose=0)).argmax(axis=1)
    truth = [int(not any(a in t for a in ANIMALS)) for t in texts]  # animal: 0, other: 1
    assert metrics["sparse_categorical_accuracy"] == pytest.approx(
        float(np.mean(predicted == truth)), abs=1e-6
    )
    assert "perplexity" not in metrics


# ------------------------------------------------------------------------------------- predict
def _predict(run: Path, data: str, output: Path, *options: str) -> list[dict]:
    result = runner.invoke(app, ["predict", str(run), "--data", data, "--output", str(output),
                                 *options, "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["rows"] == len(_rows(output)) and shown["columns"] == [
        "id",
        "prompt",
        "completion",
    ]
    return _rows(output)


def test_greedy_completions_repeat_and_answer_as_trained(lm_run, tmp_path):
    glob = lm_run.glob("train")
    first = _predict(lm_run.run, glob, tmp_path / "a.jsonl")
    again = _predict(lm_run.run, glob, tmp_path / "b.csv")
    assert [r["completion"] for r in first] == [r["completion"] for r in again]
    prompts = _texts(glob, "prompt")
    assert [r["prompt"] for r in first] == prompts and [r["id"] for r in first] == list(
        range(len(prompts))
    )
    learned = [r["completion"].startswith("answer:") for r in first]
    assert np.mean(learned) >= 0.9, [r["completion"] for r in first[:8]]
    said = runner.invoke(app, ["predict", str(lm_run.run), "--data", glob,
                               "--output", str(tmp_path / "c.jsonl")]).output  # fmt: skip
    assert "columns" in said and "arrays" not in said, said  # a .jsonl's are columns too


def test_max_length_is_the_whole_sequence(lm_run, tmp_path):
    """Greedy decoding to a shorter length stops earlier on the same tokens."""
    glob = lm_run.glob("validation")
    full = _predict(lm_run.run, glob, tmp_path / "full.jsonl")
    short = _predict(lm_run.run, glob, tmp_path / "short.jsonl", "--max-length", "18")
    task, _ = tpurun.load(str(lm_run.run))
    tokenizer = task.preprocessor.tokenizer
    for a, b in zip(full, short, strict=True):
        cut = np.asarray(tokenizer(b["completion"]))
        assert list(cut) == list(np.asarray(tokenizer(a["completion"]))[: len(cut)])
        # <bos>, the prompt and the completion fit in 18 tokens (a longer prompt is cut).
        assert len(cut) <= max(0, 18 - 1 - len(np.asarray(tokenizer(b["prompt"]))))
    assert 0 < sum(len(b["completion"]) for b in short) < sum(len(a["completion"]) for a in full)


def test_top_k_draws_repeat_with_their_seed(lm_run, tmp_path):
    glob = lm_run.glob("validation")
    top_k = ("--sampler", "top_k", "--top-k", "50")
    one = _predict(lm_run.run, glob, tmp_path / "one.jsonl", *top_k, "--seed", "1")
    same = _predict(lm_run.run, glob, tmp_path / "same.jsonl", *top_k, "--seed", "1")
    other = _predict(lm_run.run, glob, tmp_path / "other.jsonl", *top_k, "--seed", "2")
    assert one == same and one != other


def test_predict_a_classifier_writes_class_names_and_probabilities(classifier_run, tmp_path):
    output = tmp_path / "classes.csv"
    result = runner.invoke(app, ["predict", str(classifier_run.run), "--data",
                                 classifier_run.glob("validation"), "--output", str(output)])  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = _rows(output)
    assert list(rows[0]) == ["row", "class", "animal", "other"] and len(rows) == 64
    task, _ = tpurun.load(str(classifier_run.run))
    logits = np.asarray(task.predict(np.asarray(_texts(classifier_run.glob("validation"), "text")),
                                     verbose=0))  # fmt: skip
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    got = np.asarray([[float(r["animal"]), float(r["other"])] for r in rows])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert [r["class"] for r in rows] == [["animal", "other"][i] for i in got.argmax(axis=1)]


# --------------------------------------------------------------------------------- prompt files
def test_prompt_files_complete_as_their_records_do(lm_run, tmp_path):
    """A text file (one prompt a line, named .txt or not) and a JSONL file with ids give the
    completions that the same prompts as records give, in the same order."""
    glob = lm_run.glob("validation")
    prompts = _texts(glob, "prompt")
    as_records = _predict(lm_run.run, glob, tmp_path / "records.jsonl")
    text = tmp_path / "prompts"  # no suffix: the content says what it is
    text.write_text("".join(f"{p}\n\n" for p in prompts))  # blank lines are skipped
    lines = tmp_path / "prompts.jsonl"
    lines.write_text("".join(json.dumps({"id": f"q{i}", "prompt": p}) + "\n"
                             for i, p in enumerate(prompts)))  # fmt: skip
    from_text = _predict(lm_run.run, str(text), tmp_path / "text.jsonl")
    from_lines = _predict(lm_run.run, str(lines), tmp_path / "lines.csv", "--id-feature", "id")
    assert [r["prompt"] for r in from_text] == prompts
    assert from_text == as_records
    assert [r["id"] for r in from_lines] == [f"q{i}" for i in range(len(prompts))]
    assert [r["completion"] for r in from_lines] == [r["completion"] for r in as_records]


def test_a_classifier_reads_a_text_file(classifier_run, tmp_path):
    glob = classifier_run.glob("validation")
    text = tmp_path / "reviews.txt"
    text.write_text("".join(f"{t}\n" for t in _texts(glob, "text")))
    for data, output in ((glob, "records.csv"), (str(text), "text.csv")):
        result = runner.invoke(app, ["predict", str(classifier_run.run), "--data", data,
                                     "--output", str(tmp_path / output)])  # fmt: skip
        assert result.exit_code == 0, result.output
    assert _rows(tmp_path / "text.csv") == _rows(tmp_path / "records.csv")
    assert list(_rows(tmp_path / "text.csv")[0]) == ["row", "class", "animal", "other"]


def test_prompt_files_that_cannot_be_read_are_named(lm_run, tmp_path):
    lines = tmp_path / "asks.jsonl"
    lines.write_text('{"prompt": "what is a cat?"}\n{"question": "and a dog?"}\n')
    out = str(tmp_path / "out.jsonl")
    shown = _refused("predict", str(lm_run.run), "--data", str(lines), "--output", out)
    assert f'{lines}, line 2: no "prompt" text' in shown and "the line holds: question" in shown
    text = tmp_path / "asks.txt"
    text.write_text("what is a cat?\n")
    shown = _refused("predict", str(lm_run.run), "--data", str(text), "--output", out,
                     "--id-feature", "id")  # fmt: skip
    assert "--id-feature id: a text file of prompts holds only the prompts" in shown
    assert not (tmp_path / "out.jsonl").exists()


# ------------------------------------------------------------------------------------- bad input
def _refused(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return " ".join(result.output.split())


def test_prompts_without_the_prompt_feature_are_refused(lm_run, tmp_path):
    rows = [{"question": f"what is {i}?"} for i in range(4)]
    source = tmp_path / "q.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert runner.invoke(app, ["data", "write", str(source), str(tmp_path / "q")]).exit_code == 0
    shown = _refused("predict", str(lm_run.run), "--data", str(tmp_path / "q-*"), "--output",
                     str(tmp_path / "out.jsonl"))  # fmt: skip
    assert "holds no 'prompt' feature" in shown and "q-00000-of-00001.tfrecord" in shown
    assert "only: question" in shown and "tpurun data write PROMPTS.jsonl" in shown
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--sampler", "top_k"], "--sampler top_k needs --top-k K"),
        (["--top-k", "5"], "--top-k applies to --sampler top_k"),
        (["--sampler", "beam"], "--sampler beam: expected greedy"),
        (["--max-length", "1"], "--max-length 1: the whole sequence in tokens"),
    ],
)
def test_sampling_options_are_checked_first(tmp_path, options, message):
    """Refused before the run is even opened (no such run here)."""
    shown = _refused("predict", str(tmp_path / "none"), "--data", "x", "--output",
                     str(tmp_path / "out.csv"), *options)  # fmt: skip
    assert message in shown


def test_a_classifier_refuses_generation_options_and_jsonl(classifier_run, tmp_path):
    glob = classifier_run.glob("validation")
    shown = _refused("predict", str(classifier_run.run), "--data", glob, "--output",
                     str(tmp_path / "out.csv"), "--max-length", "8")  # fmt: skip
    assert "--max-length: generation options" in shown and "holds no causal LM" in shown
    shown = _refused("predict", str(classifier_run.run), "--data", glob, "--output",
                     str(tmp_path / "out.jsonl"))  # fmt: skip
    assert ".jsonl holds a causal LM's completions" in shown


def test_a_causal_lm_refuses_array_outputs(lm_run, tmp_path):
    shown = _refused("predict", str(lm_run.run), "--data", lm_run.glob("validation"), "--output",
                     str(tmp_path / "out.npz"))  # fmt: skip
    assert "go to a .csv or a .jsonl file" in shown


def test_export_lora_of_a_run_without_lora_is_refused(classifier_run, tmp_path):
    shown = _refused("export", str(classifier_run.run), "--format", "lora", "--output",
                     str(tmp_path / "a.lora.h5"))  # fmt: skip
    assert "has no model.lora" in shown and "--format keras" in shown
    assert not list(tmp_path.iterdir())


def test_export_onnx_of_a_preset_and_a_lora_name_are_refused(lm_run, tmp_path):
    shown = _refused("export", str(lm_run.run), "--format", "onnx", "--output",
                     str(tmp_path / "m.onnx"))  # fmt: skip
    assert "--format onnx: a KerasHub task does not export to ONNX" in shown
    shown = _refused("export", str(lm_run.run), "--format", "lora", "--output",
                     str(tmp_path / "adapter.h5"))  # fmt: skip
    assert "a lora export is a .lora.h5 file" in shown


def test_an_adapter_alone_is_refused_where_more_than_the_adapter_trains(tiny_presets):
    """A BERT classifier's head and its adapted layers' biases train beside the adapter, and
    KerasHub's .lora.h5 holds only the adapter kernels."""
    from tpurun.infer import hub_export

    keras_hub = frameworks.keras_hub()
    task = keras_hub.models.BertTextClassifier.from_preset(str(tiny_presets.bert))
    task.backbone.enable_lora(2)
    with pytest.raises(TpurunError, match=r"trains 6 weight\(s\) beside the LoRA adapter .*"
                                          r"query/bias.*--format keras"):  # fmt: skip
        hub_export.refuse_for_task(None, task)


# ------------------------------------------------------------------------------------- export
def _sidecar(path: Path) -> dict:
    return json.loads(Path(f"{path}.json").read_text())


@pytest.mark.slow
def test_export_the_adapter_alone_checked_on_the_preset(lm_run, tmp_path):
    keras_hub = frameworks.keras_hub()
    output = tmp_path / "adapter.lora.h5"
    result = runner.invoke(app, ["export", str(lm_run.run), "--format", "lora", "--output",
                                 str(output)])  # fmt: skip
    assert result.exit_code == 0, result.output
    sidecar = _sidecar(output)
    assert (
        sidecar["checked"]["loaded_without_tpurun"] and sidecar["checked"]["max_abs_diff"] <= 1e-5
    )
    assert "enable_lora(4)" in sidecar["usage"] and "lora_alpha', 8.0" in sidecar["usage"]
    assert [i["feature"] for i in sidecar["inputs"]] == ["prompt"]
    # What the usage line says, done here: the same completions as the run's model.
    tuned, _ = tpurun.load(str(lm_run.run))  # first: a load re-seeds, freeing older tokenizers
    task = keras_hub.models.GemmaCausalLM.from_preset(str(lm_run.preset))
    task.backbone.enable_lora(4)
    for layer in _lora_layers(task):
        layer.lora_alpha = 8.0
    task.backbone.load_lora_weights(str(output))
    task.preprocessor.sequence_length = SEQUENCE_LENGTH
    prompts = ["question: what eats the cat?", "question: what moves a farmer?"]
    for model in (task, tuned):
        model.compile(sampler="greedy")
    assert task.generate(prompts) == tuned.generate(prompts)


@pytest.mark.slow
def test_export_the_merged_causal_lm(lm_run, tmp_path):
    keras = frameworks.keras()
    output = tmp_path / "merged.keras"
    result = runner.invoke(app, ["export", str(lm_run.run), "--format", "keras", "--output",
                                 str(output)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert _sidecar(output)["checked"]["loaded_without_tpurun"]
    assert not (tmp_path / "merged_loader.py").exists()  # KerasHub's classes need no loader
    tuned, _ = tpurun.load(str(lm_run.run))
    merged = keras.saving.load_model(str(output), compile=False)
    assert not _lora_layers(merged) and merged.preprocessor.sequence_length == SEQUENCE_LENGTH
    prompts = ["question: what reads the child?"]
    np.testing.assert_allclose(np.asarray(merged.predict(prompts, verbose=0)),
                               np.asarray(tuned.predict(prompts, verbose=0)), atol=1e-5)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("which", ["lm", "classifier"])
def test_export_a_saved_model_taking_token_ids(which, lm_run, classifier_run, tmp_path):
    trained = lm_run if which == "lm" else classifier_run
    output = tmp_path / "served"
    result = runner.invoke(app, ["export", str(trained.run), "--format", "saved_model",
                                 "--output", str(output), "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    sidecar = _sidecar(output)
    assert sidecar["checked"]["loaded_without_tpurun"]
    assert sidecar["checked"]["max_abs_diff"] <= sidecar["checked"]["tolerance"]
    names = {i["name"] for i in sidecar["inputs"]}
    assert {"token_ids", "padding_mask"} <= names and "token ids" in sidecar["notes"][0]
