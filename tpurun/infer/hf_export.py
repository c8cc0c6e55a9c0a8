"""``tpurun export RUN --format huggingface --output DIR``: a fine-tuned causal LM as a Hugging Face
model folder, for transformers and vLLM: ``model.safetensors``, ``config.json``,
``generation_config.json`` and the tokenizer's files (``tokenizer.model`` or ``tokenizer.json`` or
``vocab.json`` and ``merges.txt``, with ``tokenizer_config.json``), with the sidecar ``DIR.json``
beside it as for every format.

- LoRA is merged first: the weights are those of :func:`tpurun.infer.preset_task.merged`, the task
  ``--format keras`` writes (for a quantized base, the preset's float weights with the adapter).
- The weights' names and shapes are tpurun's own mapping (:mod:`tpurun.infer.hf_families`), which
  says what keras-hub's exporter gets wrong; the tokenizer files are KerasHub's
  (``Tokenizer.export_to_transformers``), checked below.
- What cannot be exported is refused before anything is loaded, from the config and the preset's
  ``config.json``: a run that is not a preset's causal LM, or a family tpurun does not claim.

**The check.** The folder is loaded in a fresh Python process by transformers itself
(``AutoTokenizer``, ``AutoModelForCausalLM``: :mod:`tpurun.infer.scripts.run_huggingface`), on the first
records' prompts: its tokenizer must give the preset tokenizer's ids, and its logits for them must
match the merged model's, both computing in float32 on the exported weights (a bfloat16 run's
upcast exactly: in bfloat16, two implementations differ by rounding that would hide a wrong mapping
in a loose tolerance), within float32's tolerance. As for every other format, an export that fails
is not kept. Unlike the others, the client is not tpurun's to install: torch and transformers are
several GB, and a TPU training environment has no other use for them. So export checks with the first of: ``--check-python PATH`` (a Python that has them,
e.g. a separate virtual environment), else this Python when both are importable here (a Kaggle or
Colab image has them). Where neither is, the folder is written unchecked, the sidecar's
``checked`` is null, and a note gives the command that checks it: the same export again with
``--check-python``. Running it unchecked rather than refusing keeps the export usable on a machine
that serves elsewhere; the note keeps it from passing as checked.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tpurun import frameworks
from tpurun._version import __version__
from tpurun.data import schema_file
from tpurun.errors import TpurunError
from tpurun.hub import batches, tokenize
from tpurun.hub import preset as hub_preset
from tpurun.infer import artifact_check, hf_families, hf_gpt2, hf_llama, preset_task, trained_run
from tpurun.storage.rundir import now_iso

FORMAT = "huggingface"
CHECK_PROMPTS = 8
#: What a previous export left in DIR: only such a folder (or an empty one) is replaced.
_OURS = ("config.json", "model.safetensors")


def refuse(trained: Any) -> str:
    """What cannot be exported, refused before anything is loaded; returns the family.

    Raises:
        TpurunError: a run that did not fine-tune a preset, or whose task is not a causal LM.
        ModelError: a family tpurun does not export.
    """
    config = trained.config
    if not preset_task.is_preset(config):
        raise TpurunError(
            f"--format huggingface: {trained.run.path} trained model.factory "
            f"{config.model.factory}, not a KerasHub preset: only a preset's causal LM has a "
            "Hugging Face form. Export --format keras, saved_model or onnx."
        )
    found = hub_preset.read(config)
    task = config.model.task or found.default_task()
    if not str(task).endswith("CausalLM"):
        raise TpurunError(
            f"--format huggingface: {trained.run.path} fine-tuned {task} (model.task), not a "
            f"causal LM: tpurun exports causal LMs of {hf_families.claimed()} for transformers "
            "and vLLM. Export --format keras or saved_model instead."
        )
    return hf_families.check_backbone(
        found.backbone, found.backbone_config, str(config.model.preset)
    )


def check_output(output: str) -> None:
    """``--output`` is a folder: refuse one that holds anything but an earlier export."""
    if os.path.isfile(output):
        raise TpurunError(
            f"--output {output}: a huggingface export is a folder, and {output} is "
            "a file. Give a folder, e.g. --output export/hf."
        )
    if os.path.isdir(output) and os.listdir(output):
        if not all(os.path.exists(os.path.join(output, name)) for name in _OURS):
            raise TpurunError(
                f"--output {output}: the folder holds files that are not an earlier Hugging Face "
                "export (no config.json and model.safetensors), and export would replace it. "
                "Choose another --output."
            )


def checker(check_python: str | None) -> str | None:
    """The Python that checks the folder: ``--check-python``, else this one where torch and
    transformers are importable, else None (written unchecked)."""
    if check_python:
        if not (os.path.isfile(check_python) and os.access(check_python, os.X_OK)):
            raise TpurunError(
                f"--check-python {check_python}: no such executable. Give the "
                "path of a Python with transformers and torch, e.g. "
                ".venv-hf/bin/python."
            )
        return check_python
    if all(importlib.util.find_spec(name) is not None for name in ("transformers", "torch")):
        return sys.executable
    return None


def export(
    trained: Any,
    found: Any,
    runtime: Any,
    output: str,
    records: tuple[Any, str],
    tol: float,
    check_python: str | None,
) -> dict[str, Any]:
    """Write the merged model as a Hugging Face folder at ``output``, checked with transformers
    where a Python that has it is found (:func:`checker`), then moved into place.

    Args:
        records: :func:`tpurun.infer.export.reference_inputs`' (inputs, where they came from).
        tol: how close transformers' logits must be to the trained model's.

    Raises:
        TpurunError: the checker fails to load the folder, its tokenizer splits a prompt otherwise,
            or its logits differ by more than ``tol`` (then nothing is written).
    """
    started = time.monotonic()
    family = refuse(trained)
    python = checker(check_python)
    if not runtime.sharded:  # built on one device; a model split over a model axis stays split
        runtime.release()
    try:
        task = _build(trained, found)
        merged = preset_task.merged(task, trained.config)
        if python is not None:  # what transformers must give; unchecked, nothing to compare
            prompts, ids = _prompts(task, trained.config, records[0])
            expected = _logits(_in_float32(merged), ids)
    finally:
        runtime.release()
    folder, name = os.path.split(output)
    work = tempfile.mkdtemp(prefix=f".{name}.tpurun-", dir=folder or ".")
    try:
        stage = os.path.join(work, name)
        began = time.monotonic()
        dtype = write(merged, stage)
        wrote = time.monotonic() - began
        checked = None
        if python is not None:
            checked = _check(python, stage, prompts, ids, expected, tol, work)
            checked["on"] = f"{len(prompts)} prompts: {records[1]}"
        checking = time.monotonic() - began - wrote
        sidecar = _sidecar(trained, found, family, dtype, checked, output, python)
        Path(work, f"{name}.json").write_text(json.dumps(sidecar, indent=2) + "\n")
        files = _place(work, name, output)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total = time.monotonic() - started
    return {
        **{k: sidecar[k] for k in ("format", "checked", "notes", "usage")},
        "backend": frameworks.keras().backend.backend(),
        "precision": runtime.choice.precision,
        "platforms": None,
        "loader": None,
        "output": output,
        "sidecar": f"{output}.json",
        "files": files,
        "checkpoint": found.path,
        "checkpoint_label": found.label,
        "run_dir": trained.run.path,
        "seconds": {
            "export": round(wrote, 3),
            "check": round(checking, 3),
            "total": round(total, 3),
        },
    }


def _build(trained: Any, found: Any) -> Any:

    return trained_run.build(trained, found)


def _prompts(task: Any, config: Any, inputs: Any) -> tuple[list[str], list[list[int]]]:
    """The first records' prompts (their text, or the text of their token ids) and the preset
    tokenizer's ids of each, start token first, at most the run's sequence length."""
    import numpy as np

    keras = frameworks.keras()
    preprocessor = task.preprocessor
    tokenizer = preprocessor.tokenizer
    if schema_file.is_tokenized(config.data):
        tokens = batches.token_inputs(preprocessor, inputs)
        rows = [np.asarray(t)[np.asarray(m).astype(bool)] for t, m in
                zip(tokens["token_ids"], tokens["padding_mask"], strict=True)]  # fmt: skip
        start = tokenizer.start_token_id
        prompts = [_text(tokenizer.detokenize([int(t) for t in row if t != start])) for row in rows]
    else:
        first = keras.tree.flatten(inputs)[0]
        prompts = [v.decode("utf-8") if isinstance(v, bytes) else str(v)
                   for v in np.asarray(first).reshape(-1)]  # fmt: skip
    prompts = [p for p in prompts if p.strip()][:CHECK_PROMPTS]
    length = getattr(preprocessor, "sequence_length", None) or 512
    start = tokenizer.start_token_id  # None for Qwen, whose prompts start with no token
    head = [start] if getattr(preprocessor, "add_start_token", True) and start is not None else []
    ids = [(head + [int(t) for t in np.asarray(tokenizer(p))])[:length] for p in prompts]
    return prompts, ids


def _text(value: Any) -> str:
    import numpy as np

    value = np.asarray(value).reshape(-1)[0] if np.ndim(value) else np.asarray(value).item()
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _in_float32(task: Any) -> Any:
    """The merged task computing in float32 on the same weights (a 16-bit run's upcast exactly),
    without its preprocessor: what the check compares with, transformers loading the folder in
    float32 too. Two implementations computing in bfloat16 differ by rounding that grows with
    depth (0.023 on the tiny Gemma's 2 layers), which would hide a wrong mapping in a loose
    tolerance or refuse a right one; in float32 both compute the same numbers to ~1e-6."""
    import numpy as np

    backbone = task.backbone
    if backbone.compute_dtype == "float32" and all(w.dtype == "float32" for w in backbone.weights):
        return task
    config = {**backbone.get_config(), "dtype": "float32"}
    copy = type(backbone).from_config(config)
    copy.set_weights(
        [
            np.asarray(w).astype("float32") if w.dtype in ("bfloat16", "float16") else np.asarray(w)
            for w in backbone.weights
        ]
    )
    return type(task)(backbone=copy, preprocessor=None)


def _logits(task: Any, ids: list[list[int]]) -> list[Any]:
    """The merged task's logits for each row of ids (its preprocessor off), at full float32
    matmul precision (a TPU or GPU would round them otherwise), each ``[length, vocabulary]``."""
    import contextlib

    import numpy as np

    keras = frameworks.keras()
    longest = max(len(row) for row in ids)
    token_ids = np.zeros((len(ids), longest), "int32")
    mask = np.zeros((len(ids), longest), bool)
    for i, row in enumerate(ids):
        token_ids[i, : len(row)], mask[i, : len(row)] = row, True
    precision = contextlib.nullcontext()
    if keras.backend.backend() == "jax":
        precision = frameworks.jax().default_matmul_precision("highest")
    inputs = {"token_ids": token_ids, "padding_mask": mask}
    if tokenize.takes_positions(task):  # Gemma 4's: 0, 1, ...
        inputs["position_ids"] = tokenize.position_ids(token_ids)
    preprocessor = batches.detach(task)
    try:
        with precision:
            out = task.predict_on_batch(inputs)
    finally:
        batches.attach(task, preprocessor)
    out = keras.ops.convert_to_numpy(out).astype("float32")
    return [out[i, : len(row)] for i, row in enumerate(ids)]


def write(task: Any, folder: str) -> str:
    """The task's Hugging Face folder: weights, configs, tokenizer files; returns the weights'
    dtype."""
    backbone, tokenizer = task.backbone, task.preprocessor.tokenizer
    hf_families.check_task(task)
    tensors = hf_families.weights(backbone)
    dtype = str(next(iter(tensors.values())).dtype)
    os.makedirs(folder)
    write_safetensors(tensors, os.path.join(folder, "model.safetensors"))
    config = hf_families.hf_config(backbone, tokenizer, dtype)
    Path(folder, "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    Path(folder, "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    tokenizer.export_to_transformers(folder)  # its vocabulary's files, tokenizer_config.json
    hf_llama.fix_tokenizer(tokenizer, folder)
    hf_gpt2.fix_tokenizer(tokenizer, folder)
    return dtype


def write_safetensors(tensors: dict[str, Any], path: str) -> None:
    """``model.safetensors`` through the safetensors package's numpy writer, which writes
    float32, float16 and bfloat16 (ml_dtypes' arrays, as JAX gives them) as their own dtypes
    (checked with safetensors 0.8).

    Raises:
        TpurunError: the safetensors package is not installed in this Python.
    """
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise TpurunError(
            "--format huggingface writes model.safetensors with the safetensors package, which "
            "this Python does not have. Install it (python -m pip install safetensors) and "
            "export again."
        ) from None
    import numpy as np

    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()}, path, metadata={"format": "pt"}
    )


def _check(
    python: str,
    folder: str,
    prompts: list[str],
    ids: list[list[int]],
    expected: list[Any],
    tol: float,
    work: str,
) -> dict[str, Any]:
    """Load ``folder`` with transformers in a fresh ``python`` and compare (:mod:`tpurun.infer.scripts.run_huggingface`).

    Raises:
        TpurunError: it does not load, a prompt splits otherwise, or the logits differ.
    """
    import numpy as np

    check, out = os.path.join(work, "check.json"), os.path.join(work, "logits.npz")
    Path(check).write_text(json.dumps({"prompts": prompts, "token_ids": ids}))
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "-1"}  # fmt: skip
    failure = (
        f"export: transformers does not load the Hugging Face folder in {python}: {{last}}. "
        "Nothing was written. Check that Python has transformers and torch (python -m pip "
        "install transformers torch), or give --check-python another one."
    )
    report = artifact_check.run_script(
        python, "run_huggingface.py", [folder, check, out], env, failure
    )
    for prompt, want, got in zip(prompts, ids, report["token_ids"], strict=True):
        if got != want:
            raise TpurunError(
                f"export: transformers' tokenizer splits {prompt!r} into {got}, the preset's "
                f"into {want}: a model served from this folder would read other tokens. "
                "Nothing was written."
            )
    with np.load(out) as saved:
        got = [saved[f"logits_{i}"] for i in range(len(prompts))]
    diff = max(
        float(np.max(np.abs(g.astype("float64") - e))) for g, e in zip(got, expected, strict=True)
    )
    close = all(np.allclose(g, e, rtol=tol, atol=tol) for g, e in zip(got, expected, strict=True))
    if not close:
        raise TpurunError(
            f"export: transformers' logits differ from the trained model's on {len(prompts)} "
            f"prompts by up to {diff:.3g} (tolerance {tol:g}). Nothing was written."
        )
    return {"max_abs_diff": diff, "tolerance": tol, "tokenizer_ids_equal": True,
            "loaded_without_tpurun": not report["tpurun_imported"],
            **{k: report[k] for k in ("model", "tokenizer", "dtype", "transformers", "torch")}}  # fmt: skip


def _usage(output: str) -> str:
    name = os.path.basename(output)
    return (
        f"from transformers import AutoModelForCausalLM, AutoTokenizer; model = "
        f"AutoModelForCausalLM.from_pretrained('{name}'); tokenizer = "
        f"AutoTokenizer.from_pretrained('{name}')  (or: vllm serve {name})"
    )


def _sidecar(
    trained: Any,
    found: Any,
    family: str,
    dtype: str,
    checked: dict | None,
    output: str,
    python: str | None,
) -> dict[str, Any]:

    notes = []
    if checked is None:
        notes.append(
            "not checked: transformers and torch are not installed in this Python. Check it with "
            f"a Python that has them: tpurun export {trained.run.path} --format huggingface "
            f"--output {output} --checkpoint {found.path} --check-python PATH/TO/python"
        )
    else:
        checked["python"] = python
    return {
        "format": FORMAT,
        "artifact": os.path.basename(output),
        "family": family,
        "dtype": dtype,
        "usage": _usage(output),
        "merged": preset_task.has_lora(trained.config),
        "checked": checked,
        "notes": notes,
        "run_dir": trained.run.path,
        "checkpoint": found.path,
        "exported": now_iso(),
        "tpurun_version": __version__,
    }


def _place(work: str, name: str, output: str) -> list[str]:
    """Move the staged folder and its sidecar into place; an earlier export there is moved aside
    first (into ``work``, deleted with it)."""
    folder = os.path.dirname(output) or "."
    placed = []
    for item in (name, f"{name}.json"):
        target = os.path.join(folder, item)
        if os.path.lexists(target):
            os.rename(target, os.path.join(work, f"replaced-{item}"))
        os.rename(os.path.join(work, item), target)
        placed.append(target)
    return placed
