"""A run that fine-tuned a ``model.preset``, opened again: the KerasHub task with its preprocessor.

What a preset run keeps as its model:

- with ``model.lora``: ``model.lora.h5``, the adapter in KerasHub's ``save_lora_weights`` format
  (with tpurun's group beside it: the other trainable weights, a classifier's head;
  :func:`tpurun.training.checkpoints.adapter.save_lora`). The task is rebuilt from the preset the
  run names (``from_preset`` under the run's precision, its sequence length), LoRA is enabled
  with the run's rank and alpha (:func:`tpurun.hub.task_model.enable_lora`), then the adapter's values
  are loaded. LoRA is enabled first on purpose: ``Backbone.load_lora_weights`` on a backbone
  without LoRA enables it itself, with alpha = rank, and the run's alpha would be lost
  (keras_hub/src/models/backbone.py); with LoRA on, it only checks the rank and assigns.
  Its checkpoints (``*.adapter.h5``) load the same way, their trainable variables by path.
- without: ``model.keras``, the task with its preprocessor (``keras.saving.load_model``; KerasHub
  registers its classes as Keras imports them).

A ``.weights.h5`` (a resume point) loads into the task rebuilt from the preset, as a resume does,
and so does a sharded checkpoint (an ``.orbax`` folder of a run with a model axis; its weights
only, :func:`tpurun.training.checkpoints.sharded.load`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from typing import Any

from tpurun import frameworks
from tpurun.config import DataConfig
from tpurun.data import schema_file
from tpurun.errors import ModelError, describe
from tpurun.hub import batches
from tpurun.hub.task_model import build_preprocessor, build_task, lora_layers, set_sequence_length
from tpurun.storage import fileio
from tpurun.storage.rundir import ADAPTER_SUFFIX, LORA_SUFFIX, SHARDED_SUFFIX
from tpurun.training.checkpoints import adapter, sharded


def is_preset(config: Any) -> bool:
    return config.model.preset is not None


def has_lora(config: Any) -> bool:
    return config.model.lora is not None


def lora_settings(config: Any) -> dict[str, float]:
    """``{"rank", "alpha"}`` as the run trained with them (alpha: the rank where unset)."""
    lora = config.model.lora
    return {"rank": lora.rank, "alpha": lora.alpha if lora.alpha is not None else lora.rank}


def is_causal_lm(config: Any) -> bool:
    """Whether a preset run fine-tuned a causal LM, told from its data without loading anything:
    a causal LM learns text (a response, or the text itself), a classifier a label."""
    data = config.data
    targets = [data.features[n] for n in DataConfig.names(data.targets)]
    return is_preset(config) and bool(targets) and all(f.type == "text" for f in targets)


def is_causal_tokens(config: Any) -> bool:
    """Whether a preset run fine-tuned a causal LM on token ids (``data write --tokenize``), whose
    records weigh each next token, where :func:`is_causal_lm` looks for text."""
    data = config.data
    return is_preset(config) and schema_file.is_tokenized(data) and "weights" in data.features


def preprocessed(model: Any, dataset: Any) -> Any:
    """``(inputs, extra)`` batches of decoded features -> ``(model inputs, extra)``: the task's
    preprocessor taken off it and mapped over the batches instead, as training does."""
    tf = frameworks.tensorflow()
    preprocessor = batches.detach(model)
    return dataset.map(
        lambda inputs, extra: (preprocessor(inputs), extra), num_parallel_calls=tf.data.AUTOTUNE
    )


def probabilities(model: Any) -> Any:
    """What turns a KerasHub classifier's outputs into probabilities: a softmax over its logits
    (sigmoid for one unit) when its head has no activation; None for any other task."""
    keras = frameworks.keras()
    keras_hub = frameworks.keras_hub()
    classifiers = tuple(
        getattr(keras_hub.models, n)
        for n in ("TextClassifier", "ImageClassifier", "AudioClassifier")
        if hasattr(keras_hub.models, n)
    )
    if not isinstance(model, classifiers):
        return None
    activation = getattr(model, "activation", None)
    if activation not in (None, "linear", keras.activations.linear):
        return None

    def scores(logits: Any) -> Any:
        if logits.shape[-1] == 1:
            return keras.ops.convert_to_numpy(keras.ops.sigmoid(logits))
        return keras.ops.convert_to_numpy(keras.ops.softmax(logits, axis=-1))

    return scores


def build(trained: Any, path: str, runtime: Any = None) -> Any:
    """The run's task with the weights ``path`` holds and its preprocessor attached, at the
    run's sequence length.

    Args:
        trained: the run (:class:`tpurun.infer.trained_run.TrainedRun`).
        path: a ``.lora.h5`` adapter, an ``.adapter.h5`` checkpoint, a ``.keras`` task, a
            ``.weights.h5`` file or an ``.orbax`` folder.
        runtime: build in its distribution scope (None: this process's default device).

    Raises:
        ModelError: the preset is gone or incomplete, or the file does not fit the task.
    """
    scope = runtime.scope() if runtime is not None else contextlib.nullcontext()
    with scope:
        if path.endswith(".keras"):
            task = _load_keras(trained, path)
        else:
            task = _from_preset(trained)
            if path.endswith(LORA_SUFFIX):
                load_adapter(task, path, trained.config)
            elif path.endswith(ADAPTER_SUFFIX):
                _load_checkpoint(task, path, trained.config)
            elif path.endswith(SHARDED_SUFFIX):
                sharded.load(task, path, trained.run.path, weights_only=True)
            else:
                _load_weights(task, path, trained.config)
    return task


def _load_checkpoint(task: Any, path: str, config: Any) -> None:
    """A LoRA run's checkpoint (``*.adapter.h5``): its trainable variables, by path (the
    optimizer's state in it is for a resume)."""
    _no_lora(task, path)
    saved = adapter.read(path)["model"]
    variables = {v.path: v for v in task.trainable_variables}
    misfits = sorted(set(saved) ^ set(variables))
    misfits += [k for k in saved if k in variables and saved[k].shape != variables[k].shape]
    if misfits:
        raise ModelError(
            f"{path}: does not fit {type(task).__name__} from {config.model.preset} with "
            f"model.lora rank {config.model.lora.rank} ({', '.join(misfits[:3])} differ). A "
            "checkpoint only fits the preset, task and LoRA rank it was trained with."
        )
    for key, value in saved.items():
        variables[key].assign(value)


def _from_preset(trained: Any) -> Any:

    try:
        return build_task(trained.config)
    except ModelError as exc:
        raise ModelError(
            f"{trained.run.path}: the run's weights load onto the preset it fine-tuned, named by "
            f"its config.yaml: {exc}"
        ) from None


def _load_keras(trained: Any, path: str) -> Any:

    keras = frameworks.keras()
    frameworks.keras_hub()  # registers KerasHub's classes before Keras looks them up
    try:
        with warnings.catch_warnings():
            # The task compiles itself as it is rebuilt; the file's optimizer state is for a
            # resume, and Keras says it skips it.
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            with fileio.local_copy(path) as local:  # Keras reads gs:// only through TensorFlow
                task = keras.saving.load_model(local, compile=False)
    except fileio.StorageError:
        raise
    except Exception as exc:  # Keras raises ValueError, TypeError, OSError... for a bad file
        raise ModelError(
            f"{path}: cannot load it as a KerasHub task: {describe(exc)}. Give a .keras file this "
            "run saved (model.keras, checkpoints/best.keras)."
        ) from None
    if task.preprocessor is None:
        # Saved during the fit, when the preprocessor works in the input pipeline instead
        # (tpurun.hub.batches.detach): the preset's own is the one it trained with.

        task.preprocessor = build_preprocessor(trained.config)
    set_sequence_length(task, trained.config.model.sequence_length)
    return task


def _load_weights(task: Any, path: str, config: Any) -> None:
    try:
        with fileio.local_copy(path) as local:  # Keras reads gs:// only through TensorFlow
            task.load_weights(local)
    except fileio.StorageError:
        raise
    except Exception as exc:
        raise ModelError(
            f"{path}: cannot load it into {type(task).__name__} from {config.model.preset}: "
            f"{describe(exc)}. The weights only fit the task the run trained (same preset, "
            "model.task, model.kwargs and model.lora)."
        ) from None


def load_adapter(task: Any, path: str, config: Any) -> None:
    """The adapter's values from a ``.lora.h5`` file onto a task with LoRA enabled.

    Raises:
        ModelError: the run has no LoRA, or the file's rank or layers do not fit the task.
    """
    _no_lora(task, path)
    try:
        # KerasHub's adapter kernels (LoRA is on already, so the run's alpha stays), then what
        # tpurun keeps beside them: the other trainable weights (a classifier's head, biases).
        adapter.load_lora(task, path, path)
    except ModelError as exc:
        raise ModelError(
            f"{exc} It was loaded onto {type(task).__name__} from {config.model.preset} with "
            f"model.lora rank {config.model.lora.rank}: an adapter only fits the preset and "
            "rank it was trained with."
        ) from None


def _no_lora(task: Any, path: str) -> None:
    if not getattr(task.backbone, "_lora_enabled_layers", None):
        raise ModelError(
            f"{path}: a LoRA adapter, and the run's config.yaml has no model.lora: it trained "
            "every weight. Give --checkpoint best (its model.keras)."
        )


def merged(task: Any, config: Any) -> Any:
    """The task with each adapter merged into its kernel and LoRA off: a plain KerasHub task,
    as ``from_preset`` builds one, for ``export --format keras`` and ``saved_model``.

    Keras saves a LoRA layer's kernel merged (``EinsumDense.save_own_variables``), under the
    names a layer without LoRA has, so the weights load into the task built without LoRA.
    """
    if not has_lora(config) or not lora_layers(task.backbone):
        return task
    if config.model.quantize is not None:
        return merged_into_float(task, config)
    plain = build_task(
        config.model_copy(update={"model": config.model.model_copy(update={"lora": None})})
    )
    work = tempfile.mkdtemp(prefix="tpurun-merge-")
    try:
        path = os.path.join(work, "merged.weights.h5")
        task.save_weights(path)
        plain.load_weights(path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plain.preprocessor = task.preprocessor
    return plain


def merged_into_float(task: Any, config: Any) -> Any:
    """A QLoRA run's task merged into the preset's *original* float weights: the preset loaded
    again without ``model.quantize``, each adapter's update (``alpha / rank * A @ B``, in float32)
    added to its float kernel, the other trainable weights copied. Not the dequantized integers
    plus the adapter (what Keras' own save of a quantized LoRA layer writes, quantized again):
    the adapter learnt to correct the quantized base, and what users serve is the float one."""
    ops = frameworks.keras().ops
    model = config.model.model_copy(update={"lora": None, "quantize": None})
    plain = build_task(config.model_copy(update={"model": model}))
    layers = {layer.path: layer for layer in plain.backbone._flatten_layers(include_self=False)}
    adapters = set()
    for layer in lora_layers(task.backbone):
        delta = ops.matmul(layer.lora_kernel_a, layer.lora_kernel_b)
        kernel = layers[layer.path]._kernel  # the float variable (LoRA is off in the plain task)
        update = ops.add(ops.cast(kernel, "float32"), (layer.lora_alpha / layer.lora_rank) * delta)
        kernel.assign(ops.cast(update, kernel.dtype))
        adapters.update({id(layer.lora_kernel_a), id(layer.lora_kernel_b)})
    own = {v.path: v for v in plain.weights}
    for variable in task.trainable_variables:  # a classifier's head, the adapted layers' biases
        if id(variable) not in adapters:
            own[variable.path].assign(variable)
    plain.preprocessor = task.preprocessor
    return plain


def untracked_weights(task: Any) -> list[str]:
    """Trainable weights besides the LoRA adapters (a classifier's head, the adapted layers'
    biases): a ``.lora.h5`` file does not hold them."""
    return [
        v.path
        for v in task.trainable_weights
        if not v.path.rsplit("/", 1)[-1].startswith(("lora_kernel_a", "lora_kernel_b"))
    ]
