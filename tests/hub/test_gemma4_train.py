"""A Gemma 4 preset fine-tunes: its backbone takes each token's position (``position_ids``) beside
the tokens, which KerasHub's Gemma4CausalLMPreprocessor makes and tpurun's own batches (prompt and
response packed in the pipeline, records tokenised once) now make too. The tiny text-only Gemma 4
of tests/hf_presets.py (whose Hugging Face export test_hf_export checks) trains with LoRA on text
records and on the same records tokenised, batch for batch the same, and evaluate scores it. (The
native reader's numpy position ids: the first test; by hand, the tokenised records read natively
and through tf.data, unshuffled, gave the same log.csv byte for byte.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers import read_log
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app
from tpurun.hub import tokenize


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory) -> Path:
    from hf_presets import gemma4

    return gemma4(tmp_path_factory.mktemp("gemma4") / "tiny_gemma4")


def config(root: Path, preset: Path, data: Path, name: str) -> dict:
    """2 epochs of 6 steps (48 records, global batch 8)."""
    return {
        "name": name,
        "model": {"preset": str(preset), "lora": {"rank": 4}, "sequence_length": 24},
        "data": {
            "train": str(data / "chat-train-*"),
            "validation": str(data / "chat-validation-*"),
        },
        "train": {"per_core_batch_size": 4, "epochs": 2, "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(root / "runs")},
    }


def test_position_ids_follow_the_tokens_on_both_readers_batches():
    ids = np.arange(12).reshape(2, 6)
    x, y, _ = tokenize.shifted(ids, np.ones_like(ids), np.ones_like(ids), positions=True)
    np.testing.assert_array_equal(x["position_ids"], [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    assert x["position_ids"].dtype == np.int32
    assert "position_ids" not in tokenize.shifted(ids, ids, ids)[0]


@pytest.mark.slow
def test_gemma4_trains_on_text_and_on_tokenised_records_alike(gemma4, chat_records, tmp_path):
    text = chat_records(64)
    written = CliRunner().invoke(app, [
        "data", "write", str(text.parent / "chat.jsonl"), str(tmp_path / "tok" / "chat"),
        "--tokenize", str(gemma4), "--sequence-length", "24", "--validation-fraction", "0.25"])  # fmt: skip
    assert written.exit_code == 0, written.output
    tpurun.train(config(tmp_path, gemma4, text, "text"), verbose=False)
    tpurun.train(config(tmp_path, gemma4, tmp_path / "tok", "tokens"), verbose=False)
    on_text, on_tokens = (read_log(tmp_path / "runs" / name) for name in ("text", "tokens"))
    assert float(on_text[1]["loss"]) < float(on_text[0]["loss"]) - 0.2
    assert [r["val_loss"] for r in on_tokens] == [r["val_loss"] for r in on_text]
    scored = tpurun.evaluate(str(tmp_path / "runs" / "tokens"))["metrics"]["loss"]
    assert scored == pytest.approx(min(float(r["val_loss"]) for r in on_tokens), rel=1e-5)
