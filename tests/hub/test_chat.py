"""Chat data: `tpurun data write CHAT.jsonl OUT --tokenize PRESET` lays conversations out in the
preset's chat format (Gemma's turn markers as single tokens), weights only the assistant's
tokens, takes a template by hand, refuses a malformed line naming it. A fit on chat records (its
loss falls, its validation loss is the per-token mean over the answers) is in test_packing.py,
which trains on them packed."""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import write_jsonl
from hub_presets import conversations
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app
from tpurun.data.native import example, framing
from tpurun.errors import ModelError
from tpurun.hub import chat

runner = CliRunner()
LENGTH = 64
FEATURES = ("token_ids", "padding_mask", "weights")
TWO_TURNS = [
    {"role": "system", "content": "be brief."},
    {"role": "user", "content": "what eats a fox?"},
    {"role": "assistant", "content": "a fox eats a book."},
    {"role": "user", "content": "and the cat?"},
    {"role": "assistant", "content": "the cat eats an apple."},
]


def write_chat(folder: Path, rows: list[list[dict]], preset: Path, *options: str) -> Any:
    """``tpurun data write`` of ``rows`` as chat JSONL into folder/data/chat; the CLI result."""
    folder.mkdir(parents=True, exist_ok=True)
    source = write_jsonl(folder / "chat.jsonl", [{"messages": turns} for turns in rows])
    return runner.invoke(app, ["data", "write", str(source), str(folder / "data" / "chat"),
                               "--tokenize", str(preset), *options])  # fmt: skip


def read_records(pattern: str) -> list[dict[str, np.ndarray]]:
    """Every record of the files matching ``pattern`` (sorted), as int64 arrays."""
    out = []
    for path in sorted(glob.glob(pattern)):
        for record in framing.iter_records(path, "none"):
            feature = example.parse(record).features.feature
            out.append({k: np.array(feature[k].int64_list.value) for k in FEATURES})
    return out


def test_a_two_turn_conversation_is_written_in_gemma_turns_with_only_the_answers_weighted(
    chat_preset, tmp_path
):
    result = write_chat(tmp_path, [TWO_TURNS], chat_preset, "--sequence-length", str(LENGTH))
    assert result.exit_code == 0, result.output
    assert "chat format  gemma" in result.output
    [record] = read_records(str(tmp_path / "data" / "chat-*.tfrecord"))

    keras_hub = tpurun.frameworks.keras_hub()
    tokenizer = keras_hub.models.GemmaTokenizer.from_preset(str(chat_preset))
    start, end = tokenizer.token_to_id("<start_of_turn>"), tokenizer.token_to_id("<end_of_turn>")
    assert tokenizer.id_to_token(start) == "<start_of_turn>"  # one piece each, not <unk>
    assert tokenizer.id_to_token(end) == "<end_of_turn>"

    def text(s: str) -> list[int]:
        return [int(i) for i in tokenizer(s)]

    # (ids, weighted): Gemma has no system role, so its text opens the first user turn.
    laid = [
        ([tokenizer.start_token_id, start, *text("user\n")], 0),
        ([*text("be brief.\n\nwhat eats a fox?"), end, *text("\n")], 0),
        ([start, *text("model\n")], 0),
        ([*text("a fox eats a book."), end, *text("\n")], 1),
        ([start, *text("user\n"), *text("and the cat?"), end, *text("\n")], 0),
        ([start, *text("model\n")], 0),
        ([*text("the cat eats an apple."), end, *text("\n")], 1),
    ]
    ids = [i for part, _ in laid for i in part]
    weights = [w for part, w in laid for _ in part]
    n = len(ids)
    assert n < LENGTH + 1
    assert record["token_ids"].tolist() == ids + [tokenizer.pad_token_id] * (LENGTH + 1 - n)
    assert record["padding_mask"].tolist() == [1] * n + [0] * (LENGTH + 1 - n)
    assert record["weights"].tolist() == weights + [0] * (LENGTH + 1 - n)
    answers = record["token_ids"][record["weights"] == 1]
    assert tokenizer.detokenize(answers) == (
        "a fox eats a book.<end_of_turn>\nthe cat eats an apple.<end_of_turn>\n"
    )
    schema = json.loads((tmp_path / "data" / "chat.schema.json").read_text())
    assert schema["tokenized"]["chat"]["format"] == "gemma"
    assert schema["tokenized"]["chat"]["single_tokens"] == ["<end_of_turn>", "<start_of_turn>"]


def test_a_template_by_hand_writes_what_the_family_format_writes(chat_preset, tmp_path):
    form = chat.FORMATS["gemma"]
    template = tmp_path / "template.yaml"
    template.write_text(json.dumps({"user": form.user, "assistant": form.assistant}))
    rows = conversations(6)
    by_family = write_chat(tmp_path / "a", rows, chat_preset, "--sequence-length", "48")
    by_hand = write_chat(tmp_path / "b", rows, chat_preset, "--sequence-length", "48",
                         "--chat-template", str(template))  # fmt: skip
    assert by_family.exit_code == 0 and by_hand.exit_code == 0, by_hand.output
    a, b = (read_records(str(tmp_path / f / "data/chat-*.tfrecord")) for f in "ab")
    assert len(a) == 6
    for x, y in zip(a, b, strict=True):
        for name in FEATURES:
            np.testing.assert_array_equal(x[name], y[name])


@pytest.mark.parametrize(
    ("line", "said"),
    [
        ({"messages": [{"role": "bot", "content": "hi"}]},
         'turn 1 has role "bot", not one of system, user, assistant'),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
         "turn 1's content is 3, not a string"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                       {"role": "assistant", "content": "c"}]},
         "turn 2 is a system turn, which only the first turn may be"),
        ({"messages": [], "id": 4}, "has the keys ['id', 'messages']"),
    ],
    ids=["role", "no-answer", "content", "late-system", "keys"],
)  # fmt: skip
def test_a_malformed_line_is_refused_naming_its_file_and_line(chat_preset, tmp_path, line, said):
    source = tmp_path / "chat.jsonl"
    good = {"messages": TWO_TURNS}
    source.write_text(f"{json.dumps(good)}\n\n{json.dumps(line)}\n")
    result = runner.invoke(app, ["data", "write", str(source), str(tmp_path / "out"),
                                 "--tokenize", str(chat_preset)])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"{source}:3: {said}" in result.output
    assert not (tmp_path / "out.schema.json").exists()


def test_chat_data_is_refused_without_a_preset_and_a_bad_template_with_its_key(
    chat_preset, tmp_path
):
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TWO_TURNS}])
    result = runner.invoke(app, ["data", "write", str(source), str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "--tokenize PRESET --sequence-length N" in result.output
    template = tmp_path / "template.yaml"
    template.write_text("user: '{content}{content}'\nassistant: '{content}'\n")
    result = runner.invoke(app, ["data", "write", str(source), str(tmp_path / "out"), "--tokenize",
                                 str(chat_preset), "--chat-template", str(template)])  # fmt: skip
    assert result.exit_code == 2
    assert "user: Value error, '{content}{content}' has 2 `{content}`" in result.output
    text_rows = write_jsonl(tmp_path / "text.jsonl", [{"text": "a fox eats a book."}])
    result = runner.invoke(app, ["data", "write", str(text_rows), str(tmp_path / "out"),
                                 "--tokenize", str(chat_preset), "--chat-template",
                                 str(tmp_path / "template.yaml")])  # fmt: skip
    assert result.exit_code == 2


def test_a_family_without_a_chat_format_asks_for_a_template():
    mistral = type("MistralTokenizer", (), {})()
    with pytest.raises(ModelError, match=r"MistralTokenizer, has no chat format .*--chat-template"):
        chat.chat_format(mistral, None, "presets/mistral")
