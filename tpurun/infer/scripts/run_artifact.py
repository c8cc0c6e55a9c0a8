"""Load an exported artifact as a user without tpurun would, run inputs through it, save the outputs.

``tpurun export`` runs this file by its path in a fresh Python process (``python -I``), so nothing of
tpurun is imported: it imports only what the format needs (TensorFlow for a SavedModel, onnxruntime
for ONNX, Keras for a ``.keras`` file, KerasHub for a ``.lora.h5`` adapter and the preset it
adapts). Standalone on purpose: keep tpurun imports out of it.

Usage: python -I run_artifact.py FORMAT ARTIFACT INPUTS.npz OUTPUTS.npz STRUCTURE.json

INPUTS.npz holds ``in_0 .. in_N`` (the model's inputs, flattened as ``keras.tree.flatten`` orders
them); STRUCTURE.json says how they nest (``{"kind": "single" | "list" | "dict", "keys": [...]}``)
and names the loader module, if any, and for an adapter the preset, task class, kwargs, LoRA rank
and alpha, sequence length and dtype policy (``"hub"``). A KerasHub task takes text (``str``
arrays), or token ids with its preprocessor off where ``"hub"`` says ``"token_ids"`` (a run on
tokenised records). OUTPUTS.npz receives ``out_0 .. out_M`` in the same flattened order. The last line printed is a JSON object: the artifact's input and output names, shapes and
dtypes, and whether tpurun was imported.
"""

import json
import sys

import numpy as np


def _nested(flat, structure):
    if structure["kind"] == "single":
        return flat[0]
    if structure["kind"] == "dict":
        return dict(zip(structure["keys"], flat, strict=True))
    return list(flat)


def _spec(name, shape, dtype):
    return {"name": name, "shape": [d if isinstance(d, int) else None for d in shape],
            "dtype": str(dtype)}  # fmt: skip


def _flatten(value):
    """Outputs flattened as keras.tree.flatten does: dicts by sorted key."""
    if isinstance(value, dict):
        return [x for key in sorted(value) for x in _flatten(value[key])]
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flatten(item)]
    return [value]


def run_saved_model(path, flat, structure):
    import tensorflow as tf

    loaded = tf.saved_model.load(path)
    outputs = loaded.serve(_nested([tf.constant(a) for a in flat], structure))
    signature = loaded.signatures["serving_default"]
    inputs = [_spec(k, v.shape.as_list(), v.dtype.name)
              for k, v in signature.structured_input_signature[1].items()]  # fmt: skip
    described = [_spec(k, v.shape.as_list(), v.dtype.name)
                 for k, v in signature.structured_outputs.items()]  # fmt: skip
    return [np.asarray(o) for o in _flatten(outputs)], inputs, described


def run_onnx(path, flat, structure):
    import onnxruntime

    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {i.name: a for i, a in zip(session.get_inputs(), flat, strict=True)}
    outputs = session.run(None, feeds)
    onnx_dtype = {"tensor(float)": "float32", "tensor(double)": "float64",
                  "tensor(int64)": "int64", "tensor(int32)": "int32"}  # fmt: skip
    inputs = [_spec(i.name, i.shape, onnx_dtype.get(i.type, i.type)) for i in session.get_inputs()]
    described = [_spec(o.name, o.shape, onnx_dtype.get(o.type, o.type))
                 for o in session.get_outputs()]  # fmt: skip
    return [np.asarray(o) for o in outputs], inputs, described


def run_keras(path, flat, structure):
    import keras

    loader = structure.get("loader")
    if loader:
        import importlib.util

        spec = importlib.util.spec_from_file_location("exported_model_loader", loader)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        model = module.load(path)
    else:
        model = keras.saving.load_model(path, compile=False)
    outputs = _predict(model, flat, structure)
    inputs = [_spec(t.name, t.shape, t.dtype) for t in model.inputs]
    described = [_spec(t.name, t.shape, t.dtype) for t in model.outputs]
    return [np.asarray(o) for o in _flatten(outputs)], inputs, described


def _predict(model, flat, structure):
    """The model's outputs for the inputs, all in one batch. A KerasHub task trained on token ids
    (``"token_ids"`` in ``"hub"``) takes them with its preprocessor off, one batch through
    ``predict_on_batch``: its ``predict`` would make a dataset of them, which needs TensorFlow or
    Grain."""
    inputs = _nested(flat, structure)
    if (structure.get("hub") or {}).get("token_ids"):
        model.preprocessor = None
        return model.predict_on_batch(inputs)
    return model.predict(inputs, batch_size=len(flat[0]), verbose=0)


def run_lora(path, flat, structure):
    """A KerasHub adapter (``.lora.h5``) on the preset it was trained on, rebuilt as a user would:
    ``from_preset``, ``enable_lora``, the run's alpha, ``load_lora_weights``."""
    import keras
    import keras_hub

    hub = structure["hub"]
    keras.config.set_dtype_policy(hub["dtype_policy"])
    task = getattr(keras_hub.models, hub["task"]).from_preset(hub["preset"], **hub["kwargs"])
    task.backbone.enable_lora(hub["rank"])
    for layer in task.backbone._flatten_layers(include_self=False):
        if getattr(layer, "lora_enabled", False):
            layer.lora_alpha = hub["alpha"]
    task.backbone.load_lora_weights(path)
    if hub.get("sequence_length") and not hub.get("token_ids"):
        task.preprocessor.sequence_length = hub["sequence_length"]
    outputs = _predict(task, flat, structure)
    inputs = [_spec(t.name, t.shape, t.dtype) for t in task.inputs]
    described = [_spec(t.name, t.shape, t.dtype) for t in task.outputs]
    return [np.asarray(o) for o in _flatten(outputs)], inputs, described


def main(argv):
    fmt, artifact, inputs_path, outputs_path, structure_path = argv
    with open(structure_path) as f:
        structure = json.load(f)
    with np.load(inputs_path) as saved:
        flat = [saved[f"in_{i}"] for i in range(len(saved.files))]
    runners = {"saved_model": run_saved_model, "onnx": run_onnx, "keras": run_keras,
               "lora": run_lora}  # fmt: skip
    runner = runners[fmt]
    outputs, inputs, described = runner(artifact, flat, structure)
    np.savez(outputs_path, **{f"out_{i}": o for i, o in enumerate(outputs)})
    report = {"inputs": inputs, "outputs": described, "tpurun_imported": "tpurun" in sys.modules}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
