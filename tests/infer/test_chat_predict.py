"""`tpurun predict RUN --data conversations.jsonl` on a run fine-tuned on chat records: each prompt
is laid out token for token as `data write` lays out the same turns, up to the answer's opener;
generation stops at the format's end-of-turn token and the completion is the answer's text alone.
Plain prompts are one user turn; a run not trained on chat refuses a conversations file, and a
conversation that does not end with the user's turn is refused by its line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from hub_presets import conversations
from test_chat import TWO_TURNS, read_records, write_chat
from typer.testing import CliRunner

import tpurun
from tpurun.cli.app import app
from tpurun.infer import chat_prompts, prompts

runner = CliRunner()
LENGTH = 64
ASKED = TWO_TURNS[:4]  # the two-turn conversation without its last answer


@pytest.fixture(scope="module")
def chat_run(chat_preset, tmp_path_factory) -> Path:
    """A LoRA fine-tune of 3 short epochs (6 steps each) on 16 conversations in Gemma's turns."""
    folder = tmp_path_factory.mktemp("chat-run")
    written = write_chat(folder, conversations(16, most_turns=2), chat_preset,
                         "--sequence-length", str(LENGTH), "--validation-fraction", "0.25")  # fmt: skip
    assert written.exit_code == 0, written.output
    data = folder / "data"
    config = {
        "name": "chat",
        "model": {"preset": str(chat_preset), "lora": {"rank": 4}, "sequence_length": LENGTH},
        "data": {
            "train": str(data / "chat-train-*"),
            "validation": str(data / "chat-validation-*"),
        },
        "train": {"per_core_batch_size": 2, "epochs": 3, "learning_rate": {"base": 2e-2}},
        "runtime": {"cpu_devices": 1},
        "output": {"dir": str(folder / "runs")},
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TPURUN_CACHE_DIR", str(folder / "cache"))
        tpurun.train(config, verbose=False)
    return folder / "runs" / "chat"


def written_ids(folder: Path, turns: list[dict], preset: Path) -> list[int]:
    """The ids `data write` writes for ``turns`` (ending with an answer), up to that answer's
    first weighted token: the conversation and the answer's opener."""
    result = write_chat(folder, [turns], preset, "--sequence-length", str(LENGTH))
    assert result.exit_code == 0, result.output
    [record] = read_records(str(folder / "data" / "chat-*.tfrecord"))
    weighted = np.flatnonzero(record["weights"])
    last_answer = [i for i in weighted if i - 1 not in weighted][-1]
    return record["token_ids"][:last_answer].tolist()


@pytest.mark.slow  # chat_run trains
def test_a_conversation_is_laid_out_as_data_write_lays_it_out_and_answered_up_to_a_stop_id(
    chat_run, chat_preset, tmp_path, monkeypatch
):
    keras_hub = tpurun.frameworks.keras_hub()
    calls, outputs = [], []
    real = keras_hub.models.GemmaCausalLM.generate

    def spy(model, inputs, **kwargs):
        calls.append(({k: np.array(v) for k, v in inputs.items()}, kwargs))
        outputs.append(real(model, inputs, **kwargs))
        return outputs[-1]

    monkeypatch.setattr(keras_hub.models.GemmaCausalLM, "generate", spy)
    asked = tmp_path / "ask.jsonl"
    asked.write_text(json.dumps({"messages": ASKED, "id": "q1"}) + "\n")
    result = runner.invoke(app, ["predict", str(chat_run), "--data", str(asked), "--output",
                                 str(tmp_path / "answers.jsonl"), "--id-feature", "id"])  # fmt: skip
    assert result.exit_code == 0, result.output

    tokenizer = keras_hub.models.GemmaTokenizer.from_preset(str(chat_preset))
    end = tokenizer.token_to_id("<end_of_turn>")
    [(inputs, kwargs)] = calls
    assert kwargs == {"stop_token_ids": (end, tokenizer.end_token_id), "strip_prompt": True}
    ids = inputs["token_ids"][0][inputs["padding_mask"][0]].tolist()
    expected = written_ids(tmp_path / "write", TWO_TURNS, chat_preset)
    assert ids == expected
    opener = [tokenizer.token_to_id("<start_of_turn>"), *tokenizer("model\n").tolist()]
    assert ids[-len(opener) :] == opener  # the prompt ends where the answer begins

    # The completion: the generated ids up to the first stop id, as text.
    generated = outputs[0]["token_ids"][0][outputs[0]["padding_mask"][0]].tolist()
    stops = [i for i, token in enumerate(generated) if token in (end, tokenizer.end_token_id)]
    answer = tokenizer.detokenize(np.array(generated[: (stops or [len(generated)])[0]]))
    [row] = [json.loads(line) for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert row == {"id": "q1", "prompt": "and the cat?", "completion": answer}


@pytest.mark.slow  # chat_run trains
def test_generation_stops_at_the_end_of_turn_token_and_shows_the_text_before_it(chat_run, tmp_path):
    keras_hub = tpurun.frameworks.keras_hub()
    task, _ = tpurun.load(str(chat_run))
    tokenizer = task.preprocessor.tokenizer
    end = tokenizer.token_to_id("<end_of_turn>")
    # Force the marker to come: its (tied) embedding made twice that of a token the run's greedy
    # answer holds from its fourth token on, so it wins there.
    table = task.backbone.token_embedding.embeddings
    weights = np.array(table.value)
    weights[end] = 2.0 * weights[249]
    table.assign(weights)
    asked = [chat_prompts.Prompt(7, [{"role": "user", "content": "what eats a fox?"}], "q")]
    form = tpurun.hub.chat.FORMATS["gemma"]
    ids = chat_prompts.Answering(task.preprocessor, form).prompt_ids(asked)[0]
    x = {"token_ids": np.zeros((1, 48), "int32"), "padding_mask": np.zeros((1, 48), bool)}
    x["token_ids"][0, : len(ids)], x["padding_mask"][0, : len(ids)] = ids, True
    preprocessor = task.preprocessor
    task.preprocessor = None
    task.compile(sampler=keras_hub.samplers.GreedySampler())
    raw = task.generate(x, stop_token_ids=None, strip_prompt=True)
    task.preprocessor = preprocessor
    generated = raw["token_ids"][0][raw["padding_mask"][0]].tolist()
    stop = generated.index(end)
    assert stop == 3 and generated[stop + 1 :] == [end] * (48 - len(ids) - 4)

    out = tmp_path / "answers.csv"
    sampling = tpurun.infer.generate.Sampling(max_length=48)
    done = chat_prompts.complete(task, form, asked, str(out), ".csv", sampling, "id", 1, 0)
    assert done["stop_token_ids"] == [end, tokenizer.end_token_id]
    answer = tokenizer.detokenize(np.array(generated[:stop]))
    assert out.read_text().splitlines() == ["id,prompt,completion", f"7,q,{answer}"]
    assert answer.strip() and "<" not in answer
    assert task.preprocessor is preprocessor  # put back


def test_a_plain_prompt_on_a_chat_run_is_one_user_turn(chat_preset, tmp_path):
    keras_hub = tpurun.frameworks.keras_hub()
    text = tmp_path / "prompts.txt"
    text.write_text("what eats a fox?\n\n")
    [asked] = chat_prompts.read(prompts.find(str(text)), None)
    assert asked.turns == [{"role": "user", "content": "what eats a fox?"}]
    preprocessor = keras_hub.models.GemmaCausalLMPreprocessor.from_preset(
        str(chat_preset), sequence_length=LENGTH
    )
    answering = chat_prompts.Answering(preprocessor, tpurun.hub.chat.FORMATS["gemma"])
    turns = [*asked.turns, {"role": "assistant", "content": "a fox eats a book."}]
    assert answering.prompt_ids([asked]) == [written_ids(tmp_path, turns, chat_preset)]


def test_a_conversations_file_is_refused_by_a_run_not_trained_on_chat(chat_lora_run, tmp_path):
    asked = tmp_path / "ask.jsonl"
    asked.write_text(json.dumps({"messages": ASKED}) + "\n")
    result = runner.invoke(app, ["predict", str(chat_lora_run.run_dir), "--data", str(asked),
                                 "--output", str(tmp_path / "out.csv")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--data: {asked} holds conversations" in result.output
    assert "did not train on chat records" in result.output
    assert "`tpurun data write CHAT.jsonl OUT --tokenize PRESET`" in result.output
    assert not (tmp_path / "out.csv").exists()


@pytest.mark.slow  # chat_run trains
def test_a_chat_run_refuses_a_conversation_ending_with_an_answer_and_token_records(
    chat_run, tmp_path
):
    asked = tmp_path / "ask.jsonl"
    lines = [{"messages": ASKED}, {"messages": TWO_TURNS}]
    asked.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = runner.invoke(app, ["predict", str(chat_run), "--data", str(asked), "--output",
                                 str(tmp_path / "out.csv")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"--data: {asked}:2: the last turn is the assistant's" in " ".join(result.output.split())
    records = str(chat_run.parent.parent / "data" / "chat-validation-*")
    result = runner.invoke(app, ["predict", str(chat_run), "--data", records, "--output",
                                 str(tmp_path / "out.csv")])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "fine-tuned a causal LM on chat records" in " ".join(result.output.split())
    assert not (tmp_path / "out.csv").exists()


@pytest.mark.slow  # chat_run trains
def test_the_run_keeps_its_chat_format_when_its_data_has_moved(
    chat_run, chat_preset, tmp_path, monkeypatch
):
    """train records the data's chat format in config.yaml (derived.chat); predict renders in it
    with the data folder gone, as it did with the data in place."""
    config = yaml.safe_load((chat_run / "config.yaml").read_text())
    schema = json.loads(next((chat_run.parent.parent / "data").glob("*schema*.json")).read_text())
    assert config["derived"]["chat"] == schema["tokenized"]["chat"]
    moved = tmp_path / "run"
    shutil.copytree(chat_run, moved)
    config["data"]["train"] = str(tmp_path / "gone" / "chat-train-*")  # moved: no schema to read
    config["data"]["validation"] = str(tmp_path / "gone" / "chat-validation-*")
    (moved / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))

    keras_hub = tpurun.frameworks.keras_hub()
    calls = []
    real = keras_hub.models.GemmaCausalLM.generate

    def spy(model, inputs, **kwargs):
        calls.append(np.array(inputs["token_ids"][0])[np.array(inputs["padding_mask"][0])])
        return real(model, inputs, **kwargs)

    monkeypatch.setattr(keras_hub.models.GemmaCausalLM, "generate", spy)
    asked = tmp_path / "ask.jsonl"
    asked.write_text(json.dumps({"messages": ASKED}) + "\n")
    result = runner.invoke(app, ["predict", str(moved), "--data", str(asked), "--output",
                                 str(tmp_path / "answers.jsonl")])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert calls[0].tolist() == written_ids(tmp_path / "write", TWO_TURNS, chat_preset)
