"""``tpurun export`` of a run that fine-tuned a KerasHub preset (:mod:`tpurun.infer.export` places
and checks what this writes, in a fresh process without tpurun, as for any run).

- ``keras``: the merged task, a ``.keras`` file with its preprocessor: each LoRA adapter merged
  into its kernel and LoRA off, a task as ``from_preset`` builds one. Checked on the records'
  text, so the check covers the tokenizer too. Loads with plain ``keras.saving.load_model``
  where keras-hub is installed (Keras imports it as it reads the file).
- ``saved_model``: the merged task without its preprocessor: token ids in (the preset
  tokenizer's, padded to the run's sequence length: a fixed length, since jax2tf cannot export
  KerasHub's attention over a length left open), logits out.
- A QLoRA run's (``model.quantize``) ``keras`` and ``saved_model`` hold the adapter merged into
  the preset's original float weights (:func:`tpurun.infer.preset_task.merged_into_float`), checked
  against that merged model's own outputs.
- ``lora``: the adapter alone, KerasHub's ``.lora.h5`` (``save_lora_weights``), for the preset it
  was trained on; checked by loading that preset and the adapter in the fresh process.

A run on tokenised records (``tpurun data write --tokenize``) is checked on their token ids (as
its pipeline fed them, :func:`tpurun.hub.batches.token_inputs`), and its ``keras`` and ``lora``
artifacts take them as it trained: with the task's preprocessor off, ``predict_on_batch``.

ONNX is refused: on the tiny Gemma and BERT of the tests, Keras' ONNX export fails on Gemma's
attention (jax2onnx) and writes a BERT graph that onnxruntime cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpurun import frameworks
from tpurun.config import DataConfig
from tpurun.data import schema_file
from tpurun.errors import TpurunError
from tpurun.hub import batches, tokenize
from tpurun.infer import formats, preset_task

LORA_FORMAT = "lora"


@dataclass
class HubReference:
    """What the check compares: the model to write, its inputs and the run's outputs for them."""

    model: Any  # what is written (the merged task; the run's own task for lora)
    inputs: Any
    source: str
    expected: list
    notes: list[str] = field(default_factory=list)
    check: dict = field(default_factory=dict)  # what run_artifact.py needs beside the artifact


def refuse(trained: Any, fmt: str) -> None:
    """Formats a preset run cannot have, refused before anything is loaded.

    Raises:
        TpurunError: onnx, or lora for a run without LoRA.
    """
    config = trained.config
    if fmt == "onnx":
        raise TpurunError(
            "--format onnx: a KerasHub task does not export to ONNX with Keras here (it fails on "
            "Gemma's attention, and writes a BERT graph onnxruntime cannot run). Use --format "
            "saved_model (token ids in, logits out) or keras (the task with its preprocessor)."
        )
    if fmt == LORA_FORMAT and not preset_task.has_lora(config):
        raise TpurunError(
            f"--format lora: {trained.run.path} has no model.lora: it fine-tuned every weight, so "
            "there is no adapter to export alone. Export the whole model: --format keras (or "
            "saved_model)."
        )


def refuse_for_task(trained: Any, task: Any) -> None:
    """An adapter file holds the LoRA kernels only: a task that trained more is refused.

    Raises:
        TpurunError: naming the weights the file would leave behind.
    """
    left = preset_task.untracked_weights(task)
    if left:
        shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        raise TpurunError(
            f"--format lora: {type(task).__name__} trains {len(left)} weight(s) beside the LoRA "
            f"adapter ({shown}), which a .lora.h5 file does not hold: the adapter alone would "
            "lose them. Export the merged model instead: --format keras (or saved_model)."
        )


def _texts(value: Any) -> Any:
    """Decoded text features (bytes) as numpy ``str`` arrays, which ``np.savez`` stores plainly."""
    import numpy as np

    keras = frameworks.keras()
    return keras.tree.map_structure(
        lambda a: np.asarray([v.decode("utf-8") for v in np.asarray(a).reshape(-1)]), value
    )


def reference(trained: Any, task: Any, fmt: str, records: tuple[Any, str]) -> HubReference:
    """The model to write for ``fmt``, the inputs to check it on (text, or token ids for a
    SavedModel or a run on tokenised records) and the run's task's outputs for them.

    Args:
        task: the run's task, with its preprocessor.
        records: :func:`tpurun.infer.export.reference_inputs`' (inputs, where they came from).
    """
    keras = frameworks.keras()
    config, source = trained.config, records[1]
    on_tokens = schema_file.is_tokenized(config.data)
    if on_tokens:  # the records' token ids, as the run's pipeline fed them
        positions = tokenize.takes_positions(task)
        inputs = batches.token_inputs(task.preprocessor, records[0], positions)
    else:
        inputs = _texts(records[0])
    served, notes = task, []  # the model whose outputs the artifact must reproduce
    if config.model.quantize is not None:
        # QLoRA: every artifact is served on the preset's float weights (the adapter loaded onto
        # the float preset, or merged into it), not on the quantized base it trained against.
        served, notes = preset_task.merged(task, config), [_float_note(config)]
        task = task if fmt == LORA_FORMAT else served
    if fmt == "saved_model":
        return _saved_model(task, config, inputs, source, on_tokens)
    if fmt == LORA_FORMAT:
        refuse_for_task(trained, task)
    if on_tokens:
        expected = _on_tokens(served, inputs)
        notes.append(_token_note(config, inputs, fmt))
    else:
        n = len(keras.tree.flatten(inputs)[0])
        expected = _flat(served.predict(inputs, batch_size=n, verbose=0))
    if fmt == LORA_FORMAT:
        check = {**_lora_check(trained, task), "token_ids": on_tokens}
        return HubReference(task, inputs, source, expected, notes, check)
    plain = preset_task.merged(task, config)
    return HubReference(plain, inputs, source, expected, notes, {"token_ids": on_tokens})


def _float_note(config: Any) -> str:
    return (
        f"the run trained against the preset quantized to {config.model.quantize} "
        "(model.quantize); this artifact is for its original float weights, and its outputs "
        "differ from the quantized run's by the quantization's error"
    )


def _saved_model(task: Any, config: Any, inputs: Any, source: str, on_tokens: bool) -> HubReference:
    """The merged task without its preprocessor, checked on token ids: the records' own, or
    the text's, tokenised here."""
    keras = frameworks.keras()
    plain = preset_task.merged(task, config)
    preprocessor, tokens = task.preprocessor, inputs
    if not on_tokens:
        tokens, _, _ = keras.utils.unpack_x_y_sample_weight(preprocessor(inputs))
        tokens = {k: keras.ops.convert_to_numpy(v) for k, v in tokens.items()}
    task.preprocessor = plain.preprocessor = None  # the SavedModel takes token ids
    try:
        expected = _flat(task.predict_on_batch(tokens))
    finally:
        task.preprocessor = preprocessor
    return HubReference(
        plain, tokens, source, expected, notes=[_token_note(config, tokens, "saved_model")]
    )


def _on_tokens(task: Any, tokens: dict) -> list:
    """The task's outputs for token ids: its preprocessor off, as the run trained it
    (:func:`tpurun.hub.batches.detach`), and back on after."""
    preprocessor = batches.detach(task)
    try:
        return _flat(task.predict(tokens, batch_size=len(next(iter(tokens.values()))), verbose=0))
    finally:
        batches.attach(task, preprocessor)


def _token_note(config: Any, tokens: dict, fmt: str) -> str:
    """What an artifact that takes token ids takes, and where they come from."""
    length = len(next(iter(tokens.values()))[0])
    said = f"takes token ids ({', '.join(sorted(tokens))}: [batch, {length}])"
    if fmt != "saved_model":
        said += " with the task's preprocessor off (task.preprocessor = None)"
    if not schema_file.is_tokenized(config.data):
        return (
            f"{said}: the preset tokenizer's, padded to model.sequence_length {length}; "
            "tokenize with keras_hub.models.*Preprocessor.from_preset (not in the "
            "SavedModel)"
        )
    less = ", less each record's last position" if _causal_tokens(config) else ""
    return (
        f"{said}: as `tpurun data write --tokenize` wrote the run's records{less} (ids "
        "int32, masks 0/1 or boolean)"
    )


def _causal_tokens(config: Any) -> bool:
    """Whether a run on tokenised records fine-tuned a causal LM (its records weigh each next
    token, :mod:`tpurun.hub.tokenize`), where :func:`preset_task.is_causal_lm` looks for text."""
    return schema_file.is_tokenized(config.data) and "weights" in config.data.features


def _flat(outputs: Any) -> list:
    keras = frameworks.keras()
    return [keras.ops.convert_to_numpy(o) for o in keras.tree.flatten(outputs)]


def _lora_check(trained: Any, task: Any) -> dict:
    """How run_artifact.py rebuilds the task: the preset, the task class, its kwargs, LoRA, length."""
    keras = frameworks.keras()
    config = trained.config
    return {
        "preset": str(config.model.preset),
        "task": type(task).__name__,
        "kwargs": dict(config.model.kwargs),
        **preset_task.lora_settings(config),
        "sequence_length": task.preprocessor.sequence_length,
        "dtype_policy": keras.config.dtype_policy().name,
    }


def write(fmt: str, ref: HubReference, artifact: str, platforms: Any) -> None:
    """Write the artifact ``fmt`` names."""
    model = ref.model
    if fmt == LORA_FORMAT:
        model.backbone.save_lora_weights(artifact)
    elif fmt == "keras":
        model.save(artifact)  # KerasHub's classes are registered: no loader module beside it
    else:
        tf = frameworks.tensorflow()
        length = len(next(iter(ref.inputs.values()))[0])
        signature = {name: tf.TensorSpec((None, length), ref.inputs[name].dtype, name=name)
                     for name in model.input}  # fmt: skip
        formats.write_saved_model(model, artifact, platforms, [signature])


def usage(fmt: str, name: str, trained: Any, task_name: str) -> str:
    """How to load the artifact without tpurun: a task fed text, or token ids with its
    preprocessor off where the run trained on tokenised records."""
    config = trained.config
    on_tokens = schema_file.is_tokenized(config.data)
    if fmt == "keras":
        said = "; token ids as `tpurun data write --tokenize` writes them" if on_tokens else ""
        return (
            f"import keras; model = keras.saving.load_model('{name}'); "
            f"{_call(config, 'model')}  (keras-hub installed{said})"
        )
    if fmt == "saved_model":
        return (
            f"import tensorflow as tf; model = tf.saved_model.load('{name}'); "
            "logits = model.serve({'token_ids': ids, 'padding_mask': mask, ...})"
        )
    lora = preset_task.lora_settings(config)
    alpha = ""
    if lora["alpha"] != lora["rank"]:
        alpha = (
            "; [setattr(l, 'lora_alpha', " + f"{lora['alpha']}" + ") for l in "
            "task.backbone._flatten_layers() if getattr(l, 'lora_enabled', False)]"
        )
    length = config.model.sequence_length
    length = f"; task.preprocessor.sequence_length = {length}" if length and not on_tokens else ""
    return (
        f"import keras_hub; task = keras_hub.models.{task_name}.from_preset("
        f"'{config.model.preset}'); task.backbone.enable_lora({lora['rank']}){alpha}; "
        f"task.backbone.load_lora_weights('{name}'){length}; {_call(config, 'task')}"
    )


def _call(config: Any, model: str) -> str:
    """What a user runs the task ``model`` on: prompts, texts, or (a run on tokenised records)
    token ids with its preprocessor off."""
    if schema_file.is_tokenized(config.data):
        fed = ", ".join(f"'{k}': {k}" for k in config.data.inputs)
        return f"{model}.preprocessor = None; logits = {model}.predict_on_batch({{{fed}}})"
    if preset_task.is_causal_lm(config):
        return f"{model}.generate(['PROMPT'])"
    return f"{model}.predict(['TEXT'])"


def described_inputs(fmt: str, report: dict, data: Any) -> list[dict]:
    """The artifact's inputs for the sidecar: token ids for a SavedModel or a run on tokenised
    records (each with the feature that holds them, for the latter), else the text features
    the task's preprocessor takes."""
    if schema_file.is_tokenized(data):
        return [{**spec, "feature": data.inputs.get(spec["name"])} for spec in report["inputs"]]
    if fmt == "saved_model":
        return [{**spec, "feature": None} for spec in report["inputs"]]
    return [{"name": n, "shape": [None], "dtype": "string", "feature": n}
            for n in DataConfig.names(data.inputs)]  # fmt: skip
