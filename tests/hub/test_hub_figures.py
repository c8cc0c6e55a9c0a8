"""A fine-tune's figures agree: every loss a user reads (the progress line, ``log.csv``,
``summary.json``, TensorBoard, ``evaluate``) is the mean over the tokens that count, so that
perplexity = exp(loss); the best checkpoint is picked on it.

One run is trained once per module with `tpurun train` in-process: the tiny Gemma's LoRA
fine-tune in bfloat16 with gradient accumulation, its 4 validation records in a batch of 6 (2
padding records weighted 0), so every path that could disagree is on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import read_log, token_loss_by_hand, write_config
from typer.testing import CliRunner

from tpurun.cli.app import app

runner = CliRunner()
pytestmark = pytest.mark.slow  # a fine-tune (compiled twice: train, evaluate)


@pytest.fixture(scope="module")
def padded_run(tiny_presets, chat_records, tmp_path_factory) -> tuple[Path, Path, str]:
    """``(run_dir, records folder, train's output)``."""
    folder = tmp_path_factory.mktemp("hub-figures")
    data = chat_records(16)  # 12 train, 4 validation records
    config = {
        "name": "figures",
        "model": {"preset": str(tiny_presets.gemma), "lora": {"rank": 4}, "sequence_length": 16},
        "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")},
        "train": {"per_core_batch_size": 3, "gradient_accumulation_steps": 2, "epochs": 2,
                  "steps_per_execution": 1, "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 2, "precision": "bfloat16"},
        "callbacks": {"tensorboard": {"loss_every_steps": 1}},
        "output": {"dir": str(folder / "runs")},
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TPURUN_CACHE_DIR", str(folder / "cache"))
        patch.setenv("COLUMNS", "200")
        result = runner.invoke(app, ["train", str(write_config(folder, config, "figures"))])
    assert result.exit_code == 0, result.output
    return folder / "runs" / "figures", data, result.output


def test_every_loss_written_is_the_log_of_its_perplexity(padded_run):
    from test_tensorboard import read_events

    run, _, output = padded_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["validation_steps"] == 1 and summary["global_batch_size"] == 6  # 2 padding
    rows = read_log(run)
    assert len(rows) == 2
    for row in rows:
        for prefix in ("", "val_"):
            assert math.exp(float(row[f"{prefix}loss"])) == pytest.approx(
                float(row[f"{prefix}perplexity"]), rel=1e-5
            ), row
    last = rows[-1]
    assert summary["final_metrics"]["loss"] == pytest.approx(float(last["loss"]), rel=1e-6)
    assert summary["final_metrics"]["val_loss"] == pytest.approx(float(last["val_loss"]), rel=1e-6)
    best = min(range(2), key=lambda i: float(rows[i]["val_loss"]))
    assert summary["best"]["epoch"] == best + 1
    assert summary["best"]["value"] == pytest.approx(float(rows[best]["val_loss"]), rel=1e-6)

    # The progress line's last epoch: the losses as in the log.
    shown = [line for line in output.splitlines() if "perplexity" in line and "val_loss" in line]
    assert f"loss {float(last['loss']):.4f}  perplexity" in shown[-1], shown[-1]
    assert f"val_loss {float(last['val_loss']):.4f}  val_perplexity" in shown[-1], shown[-1]

    events = read_events(run)
    for split, prefix in (("train", ""), ("validation", "val_")):
        logged = [value for _, value in events[f"{split}/epoch_loss"]]
        assert logged == pytest.approx([float(r[f"{prefix}loss"]) for r in rows], rel=1e-6)
    # The running loss each step: its epoch's last one is the epoch's loss (2 steps an epoch).
    batch = [value for _, value in events["train/batch_loss"]]
    assert batch[1::2] == pytest.approx([float(r["loss"]) for r in rows], rel=1e-6)


def test_evaluate_gives_the_logged_val_loss_the_mean_over_the_response_tokens(padded_run, tmp_path):
    """evaluate's loss on the best checkpoint is its epoch's val_loss in the log, and both are
    the mean over the validation's response tokens, computed here in float64."""
    import shutil

    import tpurun
    from tpurun.data import pipeline
    from tpurun.hub import batches
    from tpurun.infer import trained_run

    shared, data, _ = padded_run
    run = tmp_path / "figures"  # evaluate writes its eval-*.json into the run
    shutil.copytree(shared, run)
    result = runner.invoke(app, ["evaluate", str(run), "--json"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["records"] == 4 and shown["padding_records"] == 2
    metrics = shown["metrics"]
    summary = json.loads((run / "summary.json").read_text())
    assert metrics["loss"] == pytest.approx(summary["best"]["value"], rel=1e-5)
    assert math.exp(metrics["loss"]) == pytest.approx(metrics["perplexity"], rel=1e-6)

    trained = trained_run.open_run(str(run))
    task, _ = tpurun.load(str(run), checkpoint="best")
    transform = batches.transform(batches.detach(task), trained.config.data)
    files = trained_run.find_records(str(data / "chat-validation-*"), {}, "--data").files
    ds = pipeline.make_dataset(files, trained.config.data, 6, training=False, score_records=4,
                               transform=transform)  # fmt: skip
    total, tokens, positions = token_loss_by_hand(task, ds.as_numpy_iterator())
    assert tokens < positions / 2  # prompts and padding: most positions weigh 0
    assert metrics["loss"] == pytest.approx(total / tokens, rel=1e-3)  # bfloat16 logits


# ------------------------------------------------------------------ what sequence_length cuts
def _needed(preset: Path, data: Path, split: str) -> list[int]:
    """Each record's length as sequence_length counts it, by hand: packed at 200 positions by the
    pipeline's own packing, its padding mask's ones less one (each position predicts the next)."""
    import tensorflow as tf

    from tpurun import frameworks
    from tpurun.hub import tokenize

    preprocessor = frameworks.keras_hub().models.CausalLMPreprocessor.from_preset(str(preset))
    preprocessor.sequence_length = 199
    prompts, responses = [], []
    for path in sorted(data.glob(f"chat-{split}-*")):
        for record in tf.data.TFRecordDataset(str(path)).as_numpy_iterator():
            feature = tf.train.Example.FromString(record).features.feature
            prompts.append(feature["prompt"].bytes_list.value[0])
            responses.append(feature["response"].bytes_list.value[0])
    pack = tokenize.pack_prompt_response(preprocessor)  # in tf.data, as the pipeline runs it
    ds = tf.data.Dataset.from_tensor_slices((prompts, responses)).batch(len(prompts))
    _, mask, _ = next(iter(ds.map(pack)))
    return sorted(int(n) - 1 for n in tf.reduce_sum(tf.cast(mask, tf.int32), axis=1).numpy())


def test_train_says_the_share_of_records_cut_and_the_length_that_keeps_95_percent(
    padded_run, tiny_presets
):
    _, data, output = padded_run
    needed = _needed(tiny_presets.gemma, data, "train")
    assert len(needed) == 12 and needed[-1] < 199
    cut = sum(n > 16 for n in needed)
    keep = needed[math.ceil(0.95 * 12) - 1]
    assert cut > 0 and keep > 16
    expected = (
        f"warning: model.sequence_length: 16 tokens cuts {cut / 12:.0%} of the records ({cut} of "
        f"all 12 records are longer; the longest needs {needed[-1]}); 95% of them fit in {keep}: "
        f"set model.sequence_length: {keep}"
    )
    assert expected in output, output


def test_inspect_shows_the_token_lengths_for_a_preset(chat_records, tiny_presets):
    data = chat_records(16)
    needed = _needed(tiny_presets.gemma, data, "validation")
    glob = str(data / "chat-validation-*")
    result = runner.invoke(app, ["data", "inspect", glob, "--preset", str(tiny_presets.gemma),
                                 "--sequence-length", str(needed[1]), "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    lengths = json.loads(result.output)["token_lengths"]
    assert (lengths["sampled"], lengths["min"], lengths["max"]) == (4, needed[0], needed[-1])
    assert lengths["cut"] == sum(n > needed[1] for n in needed)
    assert lengths["keep_95"] == needed[-1]  # 95% of 4 records: all of them
    result = runner.invoke(app, ["data", "inspect", glob, "--plain", "--preset",
                                 str(tiny_presets.gemma), "--sequence-length", "199"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (
        f"min {needed[0]}  median {needed[1]}  90% {needed[-1]}  95% {needed[-1]}  "
        f"max {needed[-1]}" in result.output
    )
    assert (
        f"model.sequence_length: 199 tokens keeps every record whole (all 4 records; the longest "
        f"needs {needed[-1]})" in result.output
    )
    result = runner.invoke(app, ["data", "inspect", glob, "--sequence-length", "24"])
    assert result.exit_code == 2
    assert "--sequence-length goes with --preset" in result.output
