"""Packing (`tpurun data write ... --tokenize PRESET --packing`): first-fit, deterministic; every
train example is written once, whole, in fewer records with less padding; the validation split is
written as it is unpacked. A LoRA fit on packed chat records lowers the loss, and its validation loss is exactly the per-token mean over the answers of the unpacked
validation records, computed by hand from the model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import read_log, read_summary, token_loss_by_hand
from hub_presets import conversations
from test_chat import FEATURES, read_records, write_chat

import tpurun
from tpurun.data.packing import first_fit
from tpurun.errors import ModelError
from tpurun.hub import batches, tokenize

LENGTH = 127  # examples of 1 or 2 exchanges (a system turn in some): 33 to 81 tokens


def test_first_fit_places_each_example_in_the_first_open_record_with_room():
    assert first_fit([5, 3, 4, 2, 6, 1], 8) == [[0, 1], [2, 3, 5], [4]]
    assert first_fit([8, 8], 8) == [[0], [1]]
    # With one record open at a time, an earlier record with room is closed for good.
    assert first_fit([5, 4, 3], 8, open_records=1) == [[0], [1, 2]]


@pytest.fixture(scope="module")
def written(chat_preset, tmp_path_factory) -> Path:
    """The same 48 conversations written twice, a quarter for validation: ``unpacked/`` and
    ``packed/``."""
    folder = tmp_path_factory.mktemp("packing")
    rows = conversations(48, most_turns=2)
    for name, extra in (("unpacked", ()), ("packed", ("--packing",))):
        result = write_chat(folder / name, rows, chat_preset, "--sequence-length", str(LENGTH),
                            "--validation-fraction", "0.25", *extra)  # fmt: skip
        assert result.exit_code == 0, result.output
    return folder


def examples(record: dict[str, np.ndarray], start: int) -> list[tuple]:
    """A record's examples, cut where a start token begins one: ``(ids, weights)`` tuples."""
    n = int(record["padding_mask"].sum())
    ids, weights = record["token_ids"][:n].tolist(), record["weights"][:n].tolist()
    starts = [i for i, token in enumerate(ids) if token == start] + [n]
    return [
        (tuple(ids[a:b]), tuple(weights[a:b])) for a, b in zip(starts, starts[1:], strict=False)
    ]


def test_packing_writes_every_train_example_once_and_leaves_validation_as_it_was(written):
    unpacked = read_records(str(written / "unpacked/data/chat-train-*"))
    packed = read_records(str(written / "packed/data/chat-train-*"))
    start = int(unpacked[0]["token_ids"][0])  # <bos>
    alone = sorted(e for r in unpacked for e in examples(r, start))
    together = sorted(e for r in packed for e in examples(r, start))
    assert len(alone) == 36
    assert together == alone
    assert len(packed) < len(unpacked) * 0.7

    def padding(records):
        return 1 - sum(int(r["padding_mask"].sum()) for r in records) / (
            len(records) * (LENGTH + 1)
        )

    entry = json.loads((written / "packed/data/chat.schema.json").read_text())["tokenized"]
    assert entry["packing"] == {
        "examples": 36,
        "records": len(packed),
        "padding": round(padding(packed), 4),
        "padding_unpacked": round(padding(unpacked), 4),
    }
    assert padding(packed) < padding(unpacked) / 2
    for split in ("validation-00000-of-00008", "validation-00007-of-00008"):
        name = f"data/chat-{split}.tfrecord"
        assert (written / "packed" / name).read_bytes() == (
            written / "unpacked" / name
        ).read_bytes()


def test_packing_a_classifier_is_refused(tiny_presets):
    with pytest.raises(ModelError, match="--packing: packs a causal LM's examples"):
        tokenize.mapper(str(tiny_presets.bert), None, packing=True)


@pytest.fixture(scope="module")
def packed_run(chat_preset, written, tmp_path_factory) -> Path:
    """A LoRA fine-tune of 3 epochs on the packed chat records."""
    folder, data = tmp_path_factory.mktemp("packed-run"), written / "packed/data"
    config = {
        "name": "packed",
        "model": {"preset": str(chat_preset), "lora": {"rank": 4}, "sequence_length": LENGTH},
        "data": {
            "train": str(data / "chat-train-*"),
            "validation": str(data / "chat-validation-*"),
        },
        "train": {"per_core_batch_size": 2, "epochs": 3, "learning_rate": {"base": 1e-2}},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(folder / "runs")},
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TPURUN_CACHE_DIR", str(folder / "cache"))
        tpurun.train(config, verbose=False)
    return folder / "runs" / "packed"


@pytest.mark.slow
def test_a_fit_on_packed_chat_records_learns_and_scores_every_validation_example_once(
    packed_run, written
):
    losses = [float(row["val_loss"]) for row in read_log(packed_run)]
    assert losses[2] < losses[0] - 0.5
    best = read_summary(packed_run)["best"]["value"]
    assert best == min(losses)
    # The unpacked write's validation records: every example alone, each scored once.
    task, _ = tpurun.load(str(packed_run))
    batches.detach(task)
    records = read_records(str(written / "unpacked/data/chat-validation-*"))
    assert len(records) == 12
    ids, mask, weights = (np.stack([r[k] for r in records]) for k in FEATURES)
    x = {"token_ids": ids[:, :-1].astype(np.int32), "padding_mask": mask[:, :-1].astype(bool)}
    total, tokens, _ = token_loss_by_hand(task, [(x, ids[:, 1:], weights[:, 1:])])
    assert tokens == int(sum(r["weights"][1:].sum() for r in records))  # the answers' tokens
    assert best == pytest.approx(total / tokens, rel=1e-5)
