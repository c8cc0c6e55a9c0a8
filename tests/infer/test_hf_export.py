"""`tpurun export --format huggingface`: a LoRA fine-tune of the tiny Gemma, exported with the
adapter merged, loads in transformers (``.venv-hf``: torch and transformers, no tpurun, no Keras)
and gives the trained model's logits and the preset tokenizer's ids; the untouched base's logits
it does not give. Gemma with one key/value head (conftest's chat_lora_run) and with four
(``gemma_mesh``, trained here), the case keras-hub 0.32's own exporter writes wrong. QLoRA runs
(int8 and int4 bases, 2 steps each) give the preset's *float* weights with the adapter merged in,
not their quantized model. Llama 3, Qwen 2, Mistral, Gemma 3, Gemma 4 and GPT-2
(tests/hf_presets.py) are written from their preset with the LoRA B matrices set to random values,
not trained: what is family-specific is the mapping and the tokenizer files, which the same
transformers process checks (Gemma 4's also with config values written wrong, which must not match).

This process (.venv) has no transformers, so an export is written unchecked, with the note that
says how to check it; the other is checked with ``--check-python .venv-hf/bin/python``, as the note
says. Then one .venv-hf process loads both and the test compares. What cannot be exported exits 2 before anything is loaded.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import without_full_collections, write_config
from typer.testing import CliRunner

from tpurun.cli.app import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]
HF_PYTHON = ROOT / ".venv-hf" / "bin" / "python"
PROMPTS = (
    "question: what builds a fox?",
    "answer: the small bird reads a book.",
    "the word bakoda means tifu and lemi.",
    "Some Capitals, digits 1234 and  two spaces",
)
#: Loads each folder as a user of transformers would; the ids and logits of every prompt, for
#: every folder, in one process.
HF_SCRIPT = """
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folders, prompts, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
saved, ids, models = {}, {}, {}
for name, folder in folders.items():
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids[name] = [tokenizer(p)["input_ids"] for p in prompts]
    models[name] = type(model).__name__
    with torch.no_grad():
        for i, row in enumerate(ids[name]):
            saved[f"{name}_{i}"] = model(torch.tensor([row])).logits[0].numpy()
np.savez(out, **saved)
print(json.dumps({"ids": ids, "models": models, "tpurun": "tpurun" in sys.modules, "keras": "keras" in sys.modules}))
"""


def _hf_python() -> Path:
    if not HF_PYTHON.exists():
        pytest.fail(f"no {HF_PYTHON.relative_to(ROOT)}: run make install (it makes .venv-hf)")
    return HF_PYTHON


@pytest.fixture(scope="module")
def mesh_lora_run(tiny_presets, chat_records, tmp_path_factory) -> Path:
    """A LoRA fine-tune (rank 4, alpha 8) of the tiny Gemma with 8 query and 4 key/value heads:
    one epoch of 3 steps on 12 records."""
    folder = tmp_path_factory.mktemp("hf-mesh")
    data = chat_records(16)
    config = {
        "model": {"preset": str(tiny_presets.gemma_mesh), "lora": {"rank": 4, "alpha": 8.0},
                  "sequence_length": 24},
        "data": {"train": str(data / "chat-train-*"), "validation": str(data / "chat-validation-*")},
        "train": {"per_core_batch_size": 2, "epochs": 1, "learning_rate": {"base": 3e-2}},
        "runtime": {"cpu_devices": 2},
        "output": {"dir": str(folder / "runs")},
    }  # fmt: skip
    result = runner.invoke(app, ["train", str(write_config(folder, config, "mesh"))])
    assert result.exit_code == 0, result.output
    return folder / "runs" / "mesh"


@pytest.fixture(scope="module")
def exported(chat_lora_run, mesh_lora_run, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """``{"one_kv": (run, folder), "four_kv": (run, folder)}``, exported in-process: one_kv
    without transformers here (unchecked); four_kv over a copy of it (an earlier export, with a
    file of its own), checked with ``--check-python .venv-hf/bin/python``."""
    folder = tmp_path_factory.mktemp("hf-exports")
    out = {"one_kv": (chat_lora_run.run_dir, folder / "one_kv"),
           "four_kv": (mesh_lora_run, folder / "four_kv")}  # fmt: skip
    for name, (run, output) in out.items():
        check = []
        if name == "four_kv":
            shutil.copytree(out["one_kv"][1], output)
            (output / "stale.txt").write_text("from the earlier export")
            check = ["--check-python", str(_hf_python())]
        result = runner.invoke(app, ["export", str(run), "--format", "huggingface", "--output",
                                     str(output), "--json", *check])  # fmt: skip
        assert result.exit_code == 0, result.output
    return out


def _keras_side(run: Path) -> tuple[list[list[int]], list[np.ndarray], list[np.ndarray]]:
    """The preset tokenizer's ids of each prompt, start token first; the merged task's logits
    for them (what the export was made from); the untouched preset's."""
    import tpurun
    from tpurun import frameworks
    from tpurun.infer import preset_task, trained_run

    keras_hub = frameworks.keras_hub()
    task, _ = tpurun.load(str(run))
    merged = preset_task.merged(task, trained_run.open_run(str(run)).config)
    base = keras_hub.models.GemmaCausalLM.from_preset(
        yaml.safe_load((run / "config.yaml").read_text())["model"]["preset"]
    )
    tokenizer = task.preprocessor.tokenizer
    ids = [[tokenizer.start_token_id, *map(int, np.asarray(tokenizer(p)))] for p in PROMPTS]
    merged.preprocessor = base.preprocessor = None
    longest = max(map(len, ids))
    x = {"token_ids": np.array([row + [0] * (longest - len(row)) for row in ids]),
         "padding_mask": np.array([[i < len(row) for i in range(longest)] for row in ids])}  # fmt: skip
    # One padded batch: the causal mask keeps each prompt's logits from its padding.
    out = [np.asarray(model.predict_on_batch(x)) for model in (merged, base)]
    return ids, *([o[i, : len(row)] for i, row in enumerate(ids)] for o in out)


@pytest.fixture(scope="module")
def qlora_exports(tiny_presets, chat_records, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """QLoRA fine-tunes of the tiny Gemma (tests/hub/test_qlora.py's config: rank 4, alpha 8) on
    an int8 and an int4 base, one epoch of 2 steps each, exported in-process as a user would
    (unchecked here): ``{"int8": (run, folder), "int4": (run, folder)}``."""
    from test_qlora import qlora_config

    import tpurun

    root, data, out = tmp_path_factory.mktemp("hf-qlora"), chat_records(16), {}
    for mode in ("int8", "int4"):
        train = {"epochs": 1, "per_core_batch_size": 3, "learning_rate": {"base": 3e-2}}
        run, folder = root / "runs" / mode, root / f"hf-{mode}"
        with without_full_collections():
            tpurun.train(qlora_config(root, tiny_presets.gemma, data, mode, mode, train=train),
                         verbose=False)  # fmt: skip
            result = runner.invoke(app, ["export", str(run), "--format", "huggingface",
                                         "--output", str(folder)])  # fmt: skip
        assert result.exit_code == 0, result.output
        out[mode] = (run, folder)
    return out


def _qlora_side(run: Path) -> tuple[list[list[int]], list[np.ndarray], ...]:
    """The preset tokenizer's ids of each prompt; the logits of the preset's float weights with
    each adapter added (alpha / rank * A @ B, computed here from the trained adapter); of the
    run's own quantized model (what it trained and evaluates); of the untouched preset."""
    import tpurun
    from tpurun import frameworks

    with without_full_collections():
        quantized, _ = tpurun.load(str(run))
    tokenizer = quantized.preprocessor.tokenizer
    ids = [[tokenizer.start_token_id, *map(int, np.asarray(tokenizer(p)))] for p in PROMPTS]
    float_merged = frameworks.keras_hub().models.GemmaCausalLM.from_preset(
        yaml.safe_load((run / "config.yaml").read_text())["model"]["preset"]
    )
    kernels = {layer.path: layer for layer in float_merged.backbone._flatten_layers()}
    adapted = [layer for layer in quantized.backbone._flatten_layers()
               if getattr(layer, "lora_enabled", False)]  # fmt: skip
    assert {layer.quantization_mode for layer in adapted} == {run.name}
    base = _eager_logits(float_merged, ids)
    for layer in adapted:
        a, b = np.asarray(layer.lora_kernel_a), np.asarray(layer.lora_kernel_b)
        kernel = kernels[layer.path].kernel
        kernel.assign(np.asarray(kernel) + 8.0 / 4 * (a @ b))
    return ids, _eager_logits(float_merged, ids), _eager_logits(quantized, ids), base


#: The families beside Gemma: tests/hf_presets.py's builder of each, transformers' class.
FAMILIES = {"llama3": "LlamaForCausalLM", "qwen": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "gemma4": "Gemma4ForCausalLM", "gpt2": "GPT2LMHeadModel"}  # fmt: skip
#: Each family's key/value heads in config.json (GPT-2's are its 4 heads, under n_head).
KV_HEADS = {"llama3": 2, "qwen": 2, "mistral": 2, "gemma3": 2, "gemma4": 2, "gpt2": None}
#: The tiny Gemma 4's folder again with one config.json value as keras-hub 0.32's exporter or
#: transformers' defaults would have it: each moves transformers' logits (the test checks), so the
#: folder's match is these settings', not the tiny model's indifference to them. (Without
#: attention_k_eq_v, which keras-hub's leaves out, transformers refuses the folder: k_proj's shape.)
GEMMA4_MISWRITTEN = {
    "full_rotary": {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
    "no_window": {"sliding_window": 512},
    "no_soft_cap": {"final_logit_softcapping": None},
}  # fmt: skip


@pytest.fixture(scope="module")
def family_exports(tmp_path_factory) -> dict[str, tuple[Path, list, list, list]]:
    """Each family's tiny preset with LoRA on (rank 4) and its B matrices set to random values,
    so the merged kernels differ from the base's, written by :func:`hf_export.write` (what
    ``export`` writes, without a run to train): ``{family: (folder, ids, merged logits, base
    logits)}``, the preset tokenizer's ids of each prompt (start token first where the family
    has one) and the task's logits for them, before and after the adapter is set."""
    import hf_presets

    from tpurun import frameworks
    from tpurun.infer import hf_export

    keras_hub = frameworks.keras_hub()
    root, rng, out = tmp_path_factory.mktemp("hf-families"), np.random.default_rng(0), {}
    for family in FAMILIES:
        preset = getattr(hf_presets, family)(root / f"preset-{family}")
        # The class it was saved as, as tpurun builds it: keras-hub 0.32's CausalLM.from_preset
        # may give a Gemma 4 preset's Gemma4AssistantCausalLM (which then fails to build).
        saved = json.loads((preset / "task.json").read_text())["class_name"]
        task = getattr(keras_hub.models, saved).from_preset(str(preset))
        tokenizer, start = task.preprocessor.tokenizer, task.preprocessor.tokenizer.start_token_id
        ids = [[start] * (start is not None) + [int(t) for t in np.asarray(tokenizer(p))]
               for p in PROMPTS]  # fmt: skip
        task.backbone.enable_lora(4)
        base = _eager_logits(task, ids)
        for weight in task.backbone.weights:
            if weight.path.endswith("lora_kernel_b"):
                weight.assign(rng.normal(0.0, 0.2, weight.shape).astype("float32"))
        merged = _eager_logits(task, ids)
        hf_export.write(task, str(root / family))
        out[family] = (root / family, ids, merged, base)
    for name, values in GEMMA4_MISWRITTEN.items():
        shutil.copytree(root / "gemma4", root / f"gemma4-{name}")
        config = json.loads((root / "gemma4" / "config.json").read_text())
        (root / f"gemma4-{name}" / "config.json").write_text(json.dumps({**config, **values}))
    return out


def _eager_logits(task, ids: list[list[int]]) -> list[np.ndarray]:
    """The task's logits for each row of ids, in one padded batch, called eagerly."""
    longest = max(map(len, ids))
    x = {"token_ids": np.array([row + [0] * (longest - len(row)) for row in ids]),
         "padding_mask": np.array([[i < len(row) for i in range(longest)] for row in ids])}  # fmt: skip
    if "position_ids" in {tensor.name for tensor in task.inputs}:  # Gemma 4's
        x["position_ids"] = np.broadcast_to(np.arange(longest), (len(ids), longest))
    out = np.asarray(task(x))
    return [out[i, : len(row)] for i, row in enumerate(ids)]


@pytest.mark.slow
def test_transformers_loads_the_export_and_gives_the_trained_models_logits(
    exported, family_exports, qlora_exports, tmp_path
):
    """One .venv-hf process loads every folder (the Gemma runs', the QLoRA runs' and each
    family's); the tokenizer splits every prompt as the preset's does, and the logits match the
    merged task's to float32's rounding, not the base's."""
    folders = {name: str(folder) for name, (_, folder) in exported.items()}
    folders.update({name: str(found[0]) for name, found in family_exports.items()})
    folders.update({name: str(folder) for name, (_, folder) in qlora_exports.items()})
    root = family_exports["gemma4"][0].parent
    folders.update({f"gemma4-{name}": str(root / f"gemma4-{name}") for name in GEMMA4_MISWRITTEN})
    done = subprocess.run(
        [str(_hf_python()), "-I", "-c", HF_SCRIPT, json.dumps(folders), json.dumps(PROMPTS),
         str(tmp_path / "hf.npz")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["tpurun"] is False and report["keras"] is False
    with np.load(tmp_path / "hf.npz") as saved:
        hf = {key: saved[key] for key in saved.files}
    for name, (run, folder) in exported.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["num_key_value_heads"] == {"one_kv": 1, "four_kv": 4}[name]
        ids, merged, base = _keras_side(run)
        assert report["ids"][name] == ids
        diffs = []
        for i, (want, untouched) in enumerate(zip(merged, base, strict=True)):
            got = hf[f"{name}_{i}"]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            diffs.append(float(np.max(np.abs(got - want))))
            # The adapter is in: the fine-tune moved every prompt's logits away from the base's.
            assert np.max(np.abs(got - untouched)) > 1e-2
        print(f"{name}: max |transformers - tpurun| {max(diffs):.3g} over {len(PROMPTS)} prompts")
    _check_qlora(qlora_exports, report, hf)
    for name, (folder, ids, merged, base) in family_exports.items():
        config = json.loads((folder / "config.json").read_text())
        assert config["architectures"] == [FAMILIES[name]]
        assert config.get("num_key_value_heads") == KV_HEADS[name]
        assert report["models"][name] == FAMILIES[name]
        assert report["ids"][name] == ids, name
        diffs = []
        for i, (want, untouched) in enumerate(zip(merged, base, strict=True)):
            got = hf[f"{name}_{i}"]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
            diffs.append(float(np.max(np.abs(got - want))))
            assert np.max(np.abs(got - untouched)) > 1e-2, name  # the adapter is in
        print(f"{name}: max |transformers - tpurun| {max(diffs):.3g} over {len(PROMPTS)} prompts")
    _, _, merged, _ = family_exports["gemma4"]
    for name in GEMMA4_MISWRITTEN:
        moved = max(float(np.max(np.abs(hf[f"gemma4-{name}_{i}"] - want)))
                    for i, want in enumerate(merged))  # fmt: skip
        assert moved > 1e-2, name
        print(f"gemma4 with {GEMMA4_MISWRITTEN[name]}: transformers' logits move by {moved:.3g}")


@pytest.mark.slow  # its fixture builds every family's preset
def test_a_gemma4_task_with_its_own_logit_cap_is_refused_before_anything_is_written(
    family_exports, tmp_path
):
    """Gemma4CausalLM's final_logit_cap caps over the backbone's final_logit_soft_cap;
    transformers' Gemma 4 has one cap."""
    from tpurun import frameworks
    from tpurun.errors import ModelError
    from tpurun.infer import hf_export

    keras_hub = frameworks.keras_hub()
    preset = family_exports["gemma4"][0].parent / "preset-gemma4"
    backbone = keras_hub.models.Gemma4Backbone.from_preset(str(preset))
    preprocessor = keras_hub.models.Gemma4CausalLMPreprocessor.from_preset(str(preset))
    task = keras_hub.models.Gemma4CausalLM(preprocessor, backbone, final_logit_cap=30.0)
    with pytest.raises(ModelError, match=r"has its own final_logit_cap=30.0 over the backbone's"):
        hf_export.write(task, str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def _check_qlora(qlora_exports, report: dict, hf: dict) -> None:
    """A QLoRA run's folder is the preset's *float* weights with the adapter merged in: float32
    both sides, so to float32's rounding (1e-5, as the other folders; 2e-6 seen). The run's own
    quantized model is another: its logits are 3e-2 (int8) and 0.4 (int4) away."""
    for mode, (run, folder) in qlora_exports.items():
        header = json.loads((folder / "config.json").read_text())
        assert (header["architectures"], header["dtype"]) == (["GemmaForCausalLM"], "float32")
        assert report["models"][mode] == "GemmaForCausalLM"
        ids, float_merged, quantized, base = _qlora_side(run)
        assert report["ids"][mode] == ids
        diffs = []
        for i, want in enumerate(float_merged):
            got = hf[f"{mode}_{i}"]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=mode)
            diffs.append(float(np.max(np.abs(got - want))))
            assert np.max(np.abs(got - quantized[i])) > 1e-2, mode  # not the quantized model
            assert np.max(np.abs(got - base[i])) > 1e-1, mode  # the adapter is in
        print(f"QLoRA {mode}: max |transformers - float merged| {max(diffs):.3g} over "
              f"{len(PROMPTS)} prompts")  # fmt: skip


@pytest.mark.slow  # its fixture checks an export with .venv-hf
def test_without_transformers_the_export_is_written_unchecked_and_says_how_to_check(exported):
    run, folder = exported["one_kv"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.model",
        "tokenizer_config.json",
    ]  # fmt: skip
    sidecar = json.loads(Path(f"{folder}.json").read_text())
    assert (sidecar["format"], sidecar["family"], sidecar["merged"]) == (
        "huggingface",
        "Gemma",
        True,
    )
    assert sidecar["checked"] is None
    assert sidecar["notes"] == [
        "not checked: transformers and torch are not installed in this Python. Check it with a "
        f"Python that has them: tpurun export {run} --format huggingface --output {folder} "
        f"--checkpoint {sidecar['checkpoint']} --check-python PATH/TO/python"
    ]
    header = json.loads((folder / "config.json").read_text())
    assert (header["model_type"], header["dtype"]) == ("gemma", "float32")


@pytest.mark.slow
def test_check_python_checks_with_transformers_and_replaces_an_earlier_export(exported):
    """The note's command, with .venv-hf's Python: checked in a fresh process, over an earlier
    export at the same place."""
    _, output = exported["four_kv"]
    checked = json.loads(Path(f"{output}.json").read_text())["checked"]
    assert checked["max_abs_diff"] <= 1e-5 and checked["tolerance"] == 1e-5
    assert (checked["model"], checked["tokenizer"], checked["dtype"]) == (
        "GemmaForCausalLM", "GemmaTokenizer", "float32")  # fmt: skip
    assert checked["tokenizer_ids_equal"] and checked["loaded_without_tpurun"]
    assert checked["python"] == str(_hf_python())
    assert checked["on"] == "4 prompts: the first 4 records of data.validation"
    assert not (output / "stale.txt").exists()  # the earlier export was replaced whole
    assert [p.name for p in output.parent.iterdir() if p.name.startswith(".")] == []


def _edited_run(run: Path, tmp_path: Path, **model) -> Path:
    """A copy of ``run`` whose config.yaml's model section has ``model``'s values."""
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    raw = yaml.safe_load((copy / "config.yaml").read_text())
    raw["model"].update(model)
    (copy / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return copy


def _export(run: Path, output: Path) -> object:
    return runner.invoke(app, ["export", str(run), "--format", "huggingface", "--output",
                               str(output)])  # fmt: skip


def test_what_cannot_be_exported_exits_2_before_anything_is_loaded(
    chat_lora_run, tiny_presets, tmp_path
):
    # The BERT classifier: not a causal LM.
    bert = _edited_run(chat_lora_run.run_dir, tmp_path / "bert", preset=str(tiny_presets.bert))
    result = _export(bert, tmp_path / "out")
    assert result.exit_code == 2
    assert f"{bert} fine-tuned BertTextClassifier (model.task), not a causal LM" in result.output
    claimed = ("Gemma (GemmaBackbone), Llama 3 (Llama3Backbone), Qwen 2 (QwenBackbone), Mistral "
               "(MistralBackbone), Gemma 3 (Gemma3Backbone), Gemma 4 (Gemma4Backbone), GPT-2 "
               "(GPT2Backbone)")  # fmt: skip
    assert f"causal LMs of {claimed} for transformers" in " ".join(result.output.split())
    # A GemmaBackbone with Gemma 2's settings is another model in transformers.
    gemma2 = tmp_path / "gemma2"
    shutil.copytree(tiny_presets.gemma, gemma2)
    config = json.loads((gemma2 / "config.json").read_text())
    config["config"].update(use_post_ffw_norm=True, final_logit_soft_cap=30.0)
    (gemma2 / "config.json").write_text(json.dumps(config))
    run = _edited_run(chat_lora_run.run_dir, tmp_path / "g2", preset=str(gemma2))
    result = _export(run, tmp_path / "out")
    assert result.exit_code == 2
    assert (
        "is a GemmaBackbone with Gemma 2's settings (use_post_ffw_norm=True, "
        "final_logit_soft_cap=30.0); tpurun exports Gemma (v1) only" in result.output
    )
    # Another family.
    config["class_name"], config["registered_name"] = "Phi3Backbone", "keras_hub>Phi3Backbone"
    (gemma2 / "config.json").write_text(json.dumps(config))
    result = _export(run, tmp_path / "out")
    assert result.exit_code == 2
    assert f"is a Phi3Backbone, and tpurun exports only {claimed} to Hugging Face" in " ".join(
        result.output.split()
    )
    # Gemma 3 with its vision encoder, without the post-norms transformers' Gemma 3 has, or with
    # a soft cap (this config's Gemma 2 settings stay).
    config["class_name"], config["registered_name"] = "Gemma3Backbone", "keras_hub>Gemma3Backbone"
    config["config"].update(vision_encoder={"class_name": "Gemma3VisionEncoder", "config": {}},
                            use_post_ffw_norm=False)  # fmt: skip
    (gemma2 / "config.json").write_text(json.dumps(config))
    result = _export(run, tmp_path / "out")
    assert result.exit_code == 2
    assert (
        "is a Gemma3Backbone with vision_encoder=a Gemma3VisionEncoder, "
        "use_post_attention_norm=False, use_post_ffw_norm=False, final_logit_soft_cap=30.0; "
        "tpurun exports Gemma 3 with vision_encoder=None, use_query_key_norm=True, "
        "use_post_attention_norm=True, use_post_ffw_norm=True, attention_logit_soft_cap=None, "
        "final_logit_soft_cap=None, use_bidirectional_attention=False, is_embedding_model=False, "
        "layer_norm_epsilon=1e-06 only" in " ".join(result.output.split())
    )
    # Gemma 4's mixture of experts (26B A4B), with its vision encoder, an attention soft cap
    # (transformers' Gemma 4 has none) and no sliding windows (Gemma (v1)'s setting stays).
    config["class_name"], config["registered_name"] = "Gemma4Backbone", "keras_hub>Gemma4Backbone"
    config["config"].update(vision_encoder={"class_name": "Gemma4VisionEncoder", "config": {}},
                            enable_moe_block=True, attention_logit_soft_cap=50.0)  # fmt: skip
    (gemma2 / "config.json").write_text(json.dumps(config))
    result = _export(run, tmp_path / "out")
    assert result.exit_code == 2
    assert (
        "is a Gemma4Backbone with vision_encoder=a Gemma4VisionEncoder, enable_moe_block=True, "
        "attention_logit_soft_cap=50.0, use_sliding_window_attention=False; tpurun exports Gemma 4 "
        "with vision_encoder=None, audio_encoder=None, enable_moe_block=False, "
        "attention_logit_soft_cap=None, local_rope_scaling_factor=1.0, "
        "global_rope_scaling_factor=1.0, use_sliding_window_attention=True, "
        "use_bidirectional_attention=False, is_embedding_model=False only"
        in " ".join(result.output.split())
    )
    # A claimed family with a setting its transformers model is not checked with.
    config["class_name"], config["registered_name"] = "QwenBackbone", "keras_hub>QwenBackbone"
    config["config"]["use_sliding_window_attention"] = True
    (gemma2 / "config.json").write_text(json.dumps(config))
    result = _export(run, tmp_path / "out")
    assert result.exit_code == 2
    assert (
        "is a QwenBackbone with use_sliding_window_attention=True; tpurun exports Qwen 2 with "
        "rope_scaling_factor=1.0, use_sliding_window_attention=False only" in result.output
    )
    assert not (tmp_path / "out").exists()
    # An output that is not an earlier export's folder.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    result = _export(chat_lora_run.run_dir, tmp_path / "mine")
    assert result.exit_code == 2
    assert "the folder holds files that are not an earlier Hugging Face export" in result.output
    assert (tmp_path / "mine" / "notes.txt").read_text() == "mine"


def test_the_help_names_the_format_and_the_checker():
    result = runner.invoke(app, ["export", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "keras|saved_model|onnx|lora|huggingface" in result.output
    assert "--check-python" in result.output


def test_safetensors_keeps_each_dtype_and_a_missing_package_says_how_to_install_it(
    tmp_path, monkeypatch
):
    """The weights' file holds float32, float16 and bfloat16 (ml_dtypes', as JAX gives a
    bfloat16 run's weights) as themselves, read back exactly by safetensors' own reader."""
    import ml_dtypes
    from safetensors.numpy import load_file

    from tpurun.errors import TpurunError
    from tpurun.infer import hf_export

    values = np.linspace(-2.0, 2.0, 12, dtype="float32").reshape(3, 4)
    tensors = {
        "a.f32": values,
        "b.f16": values.astype("float16"),
        "c.bf16": values.astype(ml_dtypes.bfloat16).T,  # a transposed view, as the mapping's
    }
    hf_export.write_safetensors(tensors, str(tmp_path / "model.safetensors"))
    raw = (tmp_path / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert {k: header[k]["dtype"] for k in tensors} == {"a.f32": "F32", "b.f16": "F16",
                                                        "c.bf16": "BF16"}  # fmt: skip
    back = load_file(str(tmp_path / "model.safetensors"))
    for key, value in tensors.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape
        np.testing.assert_array_equal(back[key], value)
    monkeypatch.setitem(sys.modules, "safetensors.numpy", None)
    with pytest.raises(TpurunError, match=r"python -m pip install safetensors"):
        hf_export.write_safetensors(tensors, str(tmp_path / "again.safetensors"))
