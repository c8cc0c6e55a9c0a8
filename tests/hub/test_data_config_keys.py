"""A config's `data.packing` and `data.chat_template`: `tpurun data write SOURCE OUT --config
CONFIG` writes the records those keys (and model.preset, model.sequence_length) say, byte for byte
as the options would; the run's config.yaml keeps the template whole; a run whose records were
written otherwise is refused before anything loads, and the command the refusal names makes
records it takes."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from helpers import write_jsonl
from hub_presets import conversations
from typer.testing import CliRunner

from tpurun.cli.app import app
from tpurun.config import load_config
from tpurun.errors import DataError
from tpurun.plan.prepare import prepare_here

runner = CliRunner()
TEMPLATE = {
    "user": "<|user|>\n{content}<|end|>\n",
    "assistant": "<|assistant|>\n{content}<|end|>\n",
}


def write_config(folder: Path, preset: Path, prefix: str, **data) -> Path:
    config = {
        "name": "talk",
        "model": {"preset": str(preset), "lora": {"rank": 4}, "sequence_length": 96},
        "data": {"train": f"{prefix}-train-*.tfrecord",
                 "validation": f"{prefix}-validation-*.tfrecord", **data},
        "train": {"per_core_batch_size": 1, "epochs": 1},
        "runtime": {"cpu_devices": 2},
    }  # fmt: skip
    path = folder / f"{prefix.replace('/', '-')}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def data_write(source: Path, prefix: Path, *options: str):
    result = runner.invoke(app, ["data", "write", str(source), str(prefix), "--plain",
                                 "--validation-fraction", "0.25", *options])  # fmt: skip
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def folder(chat_preset, tmp_path_factory) -> Path:
    """talk.jsonl (24 conversations), tmpl.yaml, and talk.yaml, whose data.packing: true and
    data.chat_template: tmpl.yaml wrote data/talk through --config."""
    folder = tmp_path_factory.mktemp("config-keys")
    write_jsonl(folder / "talk.jsonl", [{"messages": turns} for turns in conversations(24)])
    (folder / "tmpl.yaml").write_text(yaml.safe_dump(TEMPLATE))
    config = write_config(folder, chat_preset, "data/talk", packing=True, chat_template="tmpl.yaml")
    data_write(folder / "talk.jsonl", folder / "data/talk", "--config", str(config))
    return folder


def test_data_write_config_writes_what_the_options_write(chat_preset, folder):
    data_write(folder / "talk.jsonl", folder / "by-options/talk", "--tokenize", str(chat_preset),
               "--sequence-length", "96", "--packing", "--chat-template",
               str(folder / "tmpl.yaml"))  # fmt: skip
    shards = sorted(p.name for p in (folder / "data").glob("talk-*.tfrecord"))
    assert shards == sorted(p.name for p in (folder / "by-options").glob("talk-*.tfrecord"))
    assert len(shards) == 9  # 8 train shards (--shard-multiple), 1 validation
    for name in shards:
        assert (folder / "data" / name).read_bytes() == (folder / "by-options" / name).read_bytes()
    written, by_options = (
        json.loads((folder / f / "talk.schema.json").read_text())["tokenized"]
        for f in ("data", "by-options")
    )
    assert written == by_options
    assert written["packing"]["examples"] == 18
    assert {k: written["chat"][k] for k in ("format", "user", "assistant", "system")} == {
        "format": "template", **TEMPLATE, "system": None}  # fmt: skip


def test_the_run_keeps_the_template_whole_and_the_records_as_the_config_says(folder):
    prepared = prepare_here(load_config(folder / "data-talk.yaml"))
    effective = prepared.effective()
    assert effective["data"]["packing"] is True
    assert effective["data"]["chat_template"] == {**TEMPLATE, "system": None}
    assert effective["derived"]["chat"]["user"] == TEMPLATE["user"]
    (folder / "tmpl.yaml").rename(folder / "moved.yaml")
    try:  # the run's config.yaml loads with the template file gone
        assert (
            load_config(effective).data.chat_template.model_dump()
            == effective["data"]["chat_template"]
        )
    finally:
        (folder / "moved.yaml").rename(folder / "tmpl.yaml")


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"packing": False}, "data.packing: false, and the records of .*talk.schema.json were "
                             "written packed, several examples a record"),
        ({"chat_template": {"user": "U {content}\n", "assistant": TEMPLATE["assistant"]}},
         "data.chat_template: the records of .*talk.schema.json were written in the template "
         "chat format, whose user turn differs from the config's \\(written: user: "
         "'<\\|user\\|>\\\\n\\{content\\}<\\|end\\|>\\\\n'\\)"),
        ({"chat_template": None, "packing": None, "train": "nothing-*.tfrecord"},
         "data.train: .*nothing-\\*.tfrecord: no file matches"),
    ],
    ids=["unpacked-wanted", "other-template", "control"],
)  # fmt: skip
def test_records_written_otherwise_than_the_config_says_exit_2(folder, change, said):
    config = yaml.safe_load((folder / "data-talk.yaml").read_text())
    config["data"] = {**config["data"], **change}
    path = folder / "changed.yaml"
    path.write_text(yaml.safe_dump(config))
    result = runner.invoke(app, ["config", str(path)])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ")
    assert re.search(said, " ".join(result.output.split())), result.output
    assert "Traceback" not in result.output


def test_text_records_with_packing_are_refused_and_the_named_command_makes_them_right(
    chat_preset, folder
):
    rows = [{"prompt": f"question: what sees the cat {i}?", "response": "answer: a fox."}
            for i in range(12)]  # fmt: skip
    source = write_jsonl(folder / "pr.jsonl", rows)
    data_write(source, folder / "data/pr")  # text records
    config = write_config(folder, chat_preset, "data/pr", packing=True)
    with pytest.raises(DataError, match="data.packing: true: applies to token records") as caught:
        prepare_here(load_config(config))
    command = re.search(r"`tpurun (data write .*?)`", str(caught.value)).group(1)
    assert command == "data write SOURCE OUT_PREFIX --config CONFIG --overwrite"
    filled = command.replace("SOURCE", str(source)).replace("OUT_PREFIX", str(folder / "data/pr"))
    result = runner.invoke(app, [*shlex.split(filled.replace("CONFIG", str(config))),
                                 "--validation-fraction", "0.25"])  # fmt: skip
    assert result.exit_code == 0, result.output
    prepared = prepare_here(load_config(config))
    assert prepared.data.tokenized["packing"]["examples"] == 9
    # With a template, prompt and response records are refused: they hold no conversations.
    with_template = write_config(folder, chat_preset, "data/pr", chat_template=TEMPLATE)
    with pytest.raises(DataError, match="data.chat_template: the records of .* hold no conv"):
        prepare_here(load_config(with_template))


def test_config_option_refusals_and_the_note_for_records_the_config_does_not_name(
    chat_preset, folder, tmp_path
):
    config = str(folder / "data-talk.yaml")
    source = str(folder / "talk.jsonl")
    result = runner.invoke(app, ["data", "write", source, str(tmp_path / "x"), "--config",
                                 config, "--packing"])  # fmt: skip
    assert result.exit_code == 2
    assert "and --packing was given too. Set it in the config" in " ".join(result.output.split())
    factory = tmp_path / "factory.yaml"
    factory.write_text(yaml.safe_dump({"model": {"factory": "m.py:build"},
                                       "data": {"train": "x-*", "inputs": "x", "targets": "y"}}))  # fmt: skip
    result = runner.invoke(app, ["data", "write", source, str(tmp_path / "x"), "--config",
                                 str(factory)])  # fmt: skip
    assert result.exit_code == 2
    assert "its model is a factory (no model.preset)" in result.output
    missing = write_config(tmp_path, tmp_path / "no-preset", "data/talk")
    result = runner.invoke(app, ["data", "write", source, str(tmp_path / "x"), "--config",
                                 str(missing)])  # fmt: skip
    assert result.exit_code == 2
    assert result.output.startswith(f"error: model.preset: no folder {tmp_path / 'no-preset'}")
    result = data_write(folder / "talk.jsonl", tmp_path / "elsewhere", "--config", config)
    assert (
        "data.train in the config (data/talk-train-*.tfrecord) does not name the train records "
        f"written here: set data.train: {Path('..') / tmp_path.name / 'elsewhere-train'}"
        in " ".join(result.output.split())
    )


@pytest.mark.slow
def test_doctor_fails_the_plan_check_with_the_fix(folder):
    result = runner.invoke(app, ["doctor", str(folder / "data-talk.yaml"), "--json",
                                 "--set", "data.packing=false"])  # fmt: skip
    assert result.exit_code == 1, result.output
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["plan"]["status"] == "fail"
    assert checks["plan"]["finding"].startswith("data.packing: false, and the records of ")
    assert checks["plan"]["fix"] == (
        "write the records as data.packing says (the command above), or change data.packing"
    )
