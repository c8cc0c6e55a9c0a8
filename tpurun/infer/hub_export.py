"""``tpurun export`` of a run that fine-tuned a KerasHub preset (:mod:`tpurun.infer.export` places
and checks what this writes, in a fresh process without tpurun, as for any run).

- ``keras``: the merged task, a ``.keras`` file with its preprocessor: each LoRA adapter merged
  into its kernel and LoRA off, a task as ``from_preset`` builds one. Checked on the records'
  text, so the check covers the tokenizer too. Loads with plain ``keras.saving.load_model``
  where keras-hub is installed (Keras imports it as it reads the file).
- ``saved_model``: the merged task without its preprocessor: token ids in (the preset
  tokenizer's, padded to the run's sequence length: a fixed length, since jax2tf cannot export
  KerasHub's attention over a length left open), logits out.
- ``lora``: the adapter alone, KerasHub's ``.lora.h5`` (``save_lora_weights``), for the preset it
  was trained on; checked by loading that preset and the adapter in the fresh process.

ONNX is refused: on the tiny Gemma and BERT of the tests, Keras' ONNX export fails on Gemma's
attention (jax2onnx) and writes a BERT graph that onnxruntime cannot run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpurun import frameworks
from tpurun.errors import TpurunError
from tpurun.infer import preset

LORA_FORMAT = "lora"


@dataclass
class HubReference:
    """What the check compares: the model to write, its inputs and the run's outputs for them."""

    model: Any  # what is written (the merged task; the run's own task for lora)
    inputs: Any
    source: str
    expected: list
    notes: list[str] = field(default_factory=list)
    check: dict = field(default_factory=dict)  # what check.py needs beside the artifact


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
    if fmt == LORA_FORMAT and not preset.has_lora(config):
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
    left = preset.untracked_weights(task)
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
    SavedModel) and the run's task's outputs for them.

    Args:
        task: the run's task, with its preprocessor.
        records: :func:`tpurun.infer.export.reference_inputs`' (inputs, where they came from).
    """
    keras = frameworks.keras()
    config = trained.config
    texts, source = _texts(records[0]), records[1]
    n = len(keras.tree.flatten(texts)[0])
    if fmt == LORA_FORMAT:
        refuse_for_task(trained, task)
        expected = _flat(task.predict(texts, batch_size=n, verbose=0))
        return HubReference(task, texts, source, expected, check=_lora_check(trained, task))
    plain = preset.merged(task, config)
    if fmt == "keras":
        expected = _flat(task.predict(texts, batch_size=n, verbose=0))
        return HubReference(plain, texts, source, expected)
    preprocessor = task.preprocessor
    tokens, _, _ = keras.utils.unpack_x_y_sample_weight(preprocessor(texts))
    tokens = {k: keras.ops.convert_to_numpy(v) for k, v in tokens.items()}
    task.preprocessor = plain.preprocessor = None  # the SavedModel takes token ids
    try:
        expected = _flat(task.predict_on_batch(tokens))
    finally:
        task.preprocessor = preprocessor
    length = preprocessor.sequence_length
    note = (f"takes token ids ({', '.join(sorted(tokens))}: int32 [batch, {length}]): the preset "
            f"tokenizer's, padded to model.sequence_length {length}; tokenize with "
            "keras_hub.models.*Preprocessor.from_preset (not in the SavedModel)")  # fmt: skip
    return HubReference(plain, tokens, source, expected, notes=[note])


def _flat(outputs: Any) -> list:
    keras = frameworks.keras()
    return [keras.ops.convert_to_numpy(o) for o in keras.tree.flatten(outputs)]


def _lora_check(trained: Any, task: Any) -> dict:
    """How check.py rebuilds the task: the preset, the task class, its kwargs, LoRA, length."""
    keras = frameworks.keras()
    config = trained.config
    return {
        "preset": str(config.model.preset),
        "task": type(task).__name__,
        "kwargs": dict(config.model.kwargs),
        **preset.lora_settings(config),
        "sequence_length": task.preprocessor.sequence_length,
        "dtype_policy": keras.config.dtype_policy().name,
    }


def write(fmt: str, ref: HubReference, artifact: str, platforms: Any) -> None:
    """Write the artifact ``fmt`` names."""
    from tpurun.infer import formats

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
    """How to load the artifact without tpurun."""
    config = trained.config
    call = "generate(['PROMPT'])" if preset.is_causal_lm(config) else "predict(['TEXT'])"
    if fmt == "keras":
        return (f"import keras; model = keras.saving.load_model('{name}'); model.{call}  "
                "(keras-hub installed)")  # fmt: skip
    if fmt == "saved_model":
        return (f"import tensorflow as tf; model = tf.saved_model.load('{name}'); "
                "logits = model.serve({'token_ids': ids, 'padding_mask': mask, ...})")  # fmt: skip
    lora = preset.lora_settings(config)
    alpha = ""
    if lora["alpha"] != lora["rank"]:
        alpha = ("; [setattr(l, 'lora_alpha', " + f"{lora['alpha']}" + ") for l in "
                 "task.backbone._flatten_layers() if getattr(l, 'lora_enabled', False)]")  # fmt: skip
    length = config.model.sequence_length
    length = f"; task.preprocessor.sequence_length = {length}" if length else ""
    return (f"import keras_hub; task = keras_hub.models.{task_name}.from_preset("
            f"'{config.model.preset}'); task.backbone.enable_lora({lora['rank']}){alpha}; "
            f"task.backbone.load_lora_weights('{name}'){length}; task.{call}")  # fmt: skip


def described_inputs(fmt: str, report: dict, data: Any) -> list[dict]:
    """The artifact's inputs for the sidecar: token ids for a SavedModel, else the text
    features the task's preprocessor takes."""
    from tpurun.config import DataConfig

    if fmt == "saved_model":
        return [{**spec, "feature": None} for spec in report["inputs"]]
    return [{"name": n, "shape": [None], "dtype": "string", "feature": n}
            for n in DataConfig.names(data.inputs)]  # fmt: skip
