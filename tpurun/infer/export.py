"""``tpurun export``: a trained run's model as an artifact that loads without tpurun, described by a
sidecar, and checked on the spot.

Formats: ``keras`` (a ``.keras`` file; with a small loader module beside it when the model uses code
of its own), ``saved_model`` (TensorFlow SavedModel with a serving signature, through Keras'
``ExportArchive``) and ``onnx`` (Keras' own ONNX export: jax2onnx on JAX, tf2onnx on TensorFlow);
:mod:`tpurun.infer.formats` writes them; a preset run's ``lora`` and ``huggingface`` too (hf_export).

A JAX model goes into a SavedModel through jax2tf, whose native serialization targets only the
export-time platform unless told otherwise: a model exported on a TPU would refuse to run on a GPU.
So it is exported for ``--platforms`` (default cpu and cuda).

A run with a model axis (``runtime.mesh``) is built and its checkpoint restored under the run's
mesh, as ``train`` built it (no device holds the model whole), and its reference outputs computed
there; the writers then gather each weight to the host (Keras' savers read each as one NumPy
array). A LoRA run's ``lora`` export writes the adapter alone: the base stays split on the devices.

Everything is written into a private folder beside the output first, loaded there in a fresh Python
process that never imports tpurun (:mod:`tpurun.infer.check`), and compared with the trained
model's outputs on a few records. Only an artifact that matches is moved into place; otherwise
nothing is left behind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpurun import frameworks
from tpurun.errors import EnvironmentSetupError, TpurunError
from tpurun.infer import checking, hf_export, hub_export, preset

# lora: a preset run's adapter alone; huggingface: a causal LM's folder (hf_export.py)
FORMATS = ("keras", "saved_model", "onnx", "lora", hf_export.FORMAT)
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # what jax2tf's native_serialization_platforms takes
DEFAULT_PLATFORMS = ("cpu", "cuda")
CHECK_RECORDS = 16
_HERE = Path(__file__).resolve().parent


def check_format(value: str) -> str:
    """``--format``, checked before anything is loaded: a SavedModel is TensorFlow's format.

    Raises:
        TpurunError: an unknown format; ``saved_model`` where TensorFlow is not installed.
    """
    if value not in FORMATS:
        raise TpurunError(f"--format {value}: expected one of {', '.join(FORMATS)}.")
    if value == "saved_model" and importlib.util.find_spec("tensorflow") is None:
        raise EnvironmentSetupError(
            "--format saved_model writes a TensorFlow SavedModel, and TensorFlow is not "
            "installed here: pip install 'tpurun[tensorflow]' (or tensorflow-cpu), or export "
            "--format keras or onnx, which need none."
        )
    return value


def parse_platforms(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``cpu,cuda`` -> ``("cpu", "cuda")``, checked.

    Raises:
        TpurunError: an unknown platform, or a list without cpu (the check runs on the CPU).
    """
    if value is None:
        return DEFAULT_PLATFORMS
    items = value.split(",") if isinstance(value, str) else list(value)
    platforms = tuple(dict.fromkeys(p.strip().lower() for p in items if p.strip()))
    unknown = [p for p in platforms if p not in PLATFORMS]
    if unknown or not platforms:
        raise TpurunError(
            f"--platforms {value}: expected a comma-separated list of {', '.join(PLATFORMS)} "
            f"(e.g. cpu,cuda){'; unknown: ' + ', '.join(unknown) if unknown else ''}."
        )
    if "cpu" not in platforms:
        raise TpurunError(
            f"--platforms {value}: include cpu (e.g. cpu,{','.join(platforms)}): export loads the "
            "artifact on the CPU to check it before keeping it."
        )
    return platforms


def tolerance(precision: str, accelerator: str, sharded: bool = False) -> float:
    """How close the artifact's outputs must be to the trained model's. float32 on the CPU computes
    the same operations; an accelerator (TF32, TPU matmul passes) or a 16-bit policy differs more,
    and so does a model split over a model axis (``sharded``: each sum over a split dimension is
    added up in another order than the artifact's, on one device)."""
    if precision != "float32":
        return 2e-2
    if accelerator != "cpu":
        return 1e-3
    return 1e-4 if sharded else 1e-5


# ------------------------------------------------------------------------------------ the check
def reference_inputs(trained: Any, n: int = CHECK_RECORDS) -> tuple[Any, str]:
    """Model inputs to check the artifact on: the first records of the run's validation (else
    training) data, or, where they cannot be read here, normal draws shaped as the features.
    Read by the native reader, whatever the run's: a few records as numpy arrays, in file order,
    the same from either reader, without TensorFlow."""
    from tpurun.config import DataConfig
    from tpurun.data import reader as readers
    from tpurun.data.native import pipeline as native
    from tpurun.data.resolve import path_resolver
    from tpurun.infer import loading

    data = trained.config.data
    features = {name: data.features[name] for name in DataConfig.names(data.inputs)}
    for key, patterns in (("data.validation", data.validation), ("data.train", data.train)):
        if not patterns:
            continue
        try:
            found = loading.find_records(patterns, features, key, path_resolver(trained.config))
        except TpurunError:
            continue
        take = min(n, found.records)
        ds = native.make_ordered_dataset(found.files, found.compression, take, records=take,
                                         features=features, inputs=data.inputs)  # fmt: skip
        inputs, _ = readers.first_batch(ds)
        return inputs, f"the first {take} records of {key}"
    return loading.sample_inputs(data, n, seed=0), f"{n} random inputs (no records readable here)"


def _feature_names(data: Any) -> list[str]:
    """The input features in the order the artifact takes its inputs (``keras.tree.flatten``)."""
    keras = frameworks.keras()

    from tpurun.config import DataConfig
    from tpurun.data import decode as feat

    names = {n: n for n in DataConfig.names(data.inputs)}
    return [str(n) for n in keras.tree.flatten(feat.select(names, data.inputs))]


def _described_inputs(report: dict, data: Any) -> list[dict]:
    """The artifact's inputs, each with the feature that feeds it."""
    order = _feature_names(data)
    by_name = dict(data.inputs) if isinstance(data.inputs, dict) else {n: n for n in order}
    described = []
    for i, spec in enumerate(report["inputs"]):
        feature = by_name.get(spec["name"]) or (order[i] if i < len(order) else None)
        described.append({**spec, "feature": feature})
    return described


def _usage(fmt: str, name: str, loader: str | None) -> str:
    if fmt == "saved_model":
        return f"import tensorflow as tf; model = tf.saved_model.load('{name}'); y = model.serve(x)"
    if fmt == "onnx":
        return ("import onnxruntime as ort; session = ort.InferenceSession('" + name + "'); "
                "y = session.run(None, {session.get_inputs()[0].name: x})[0]")  # fmt: skip
    if loader:
        module = os.path.basename(loader).removesuffix(".py")
        return (f"import sys; sys.path.insert(0, FOLDER); import {module}; "
                f"model = {module}.load(); y = model.predict(x)")  # fmt: skip
    return f"import keras; model = keras.saving.load_model('{name}', compile=False)"


def _destinations(fmt: str, output: str) -> list[str]:
    folder, name = os.path.split(output)
    paths = [output, f"{output}.json"]
    if fmt == "keras":
        stem = name.removesuffix(".keras")
        paths += [os.path.join(folder, f"{stem}_code"), os.path.join(folder, f"{stem}_loader.py")]
    return paths


def _check_destinations(fmt: str, output: str) -> None:
    """Refuse to replace a folder that is not a previous export's."""
    for path in _destinations(fmt, output):
        if not os.path.isdir(path):
            continue
        ours = (
            os.path.exists(os.path.join(path, "saved_model.pb")) or not os.listdir(path)
            if path == output and fmt == "saved_model"
            else os.path.exists(os.path.join(path, "modules.txt")) and path != output
        )
        if not ours:
            raise TpurunError(
                f"--output {output}: {path} is a folder that export would replace, and it does "
                "not hold an earlier export. Choose another --output."
            )


def _place(stage: str, replaced: list[str], aside: str) -> list[str]:
    """Move what ``stage`` holds into the output's folder. Every earlier file at ``replaced``
    (a previous export's, including a loader this export no longer needs) is moved aside first,
    then deleted with ``aside``."""
    os.makedirs(aside, exist_ok=True)
    for i, target in enumerate(replaced):
        if os.path.lexists(target):
            os.rename(target, os.path.join(aside, f"{i}-{os.path.basename(target)}"))
    placed = []
    folder = os.path.dirname(replaced[0])
    for name in sorted(os.listdir(stage)):
        os.rename(os.path.join(stage, name), os.path.join(folder, name))
        placed.append(os.path.join(folder, name))
    return placed


def _highest_precision():
    """The trained model's reference outputs at full float32 matmul precision: on a TPU or a
    recent GPU, JAX's default would round float32 matmuls to bfloat16 passes or TF32."""
    keras = frameworks.keras()

    if keras.backend.backend() != "jax":
        return contextlib.nullcontext()
    jax = frameworks.jax()

    return jax.default_matmul_precision("highest")


def export(
    run_dir: str,
    format: str,
    output: str,
    *,
    checkpoint: str = "best",
    platforms: str | Sequence[str] | None = None,
    machine: Any = None,
    check_python: str | None = None,
) -> dict[str, Any]:
    """Export a run's model as ``format`` to ``output``, with a sidecar, checked on the spot.

    Args:
        run_dir: the run directory ``train`` made.
        format: ``keras``, ``saved_model``, ``onnx``, ``lora`` or ``huggingface``.
        output: the artifact's path (a file, or a folder); its sidecar is ``<output>.json``.
        checkpoint: best, latest, or a checkpoint file.
        platforms: what a JAX model's SavedModel runs on (``cpu,cuda`` by default; cpu included).
        machine: facts about the machine (tests inject them); probed when None.
        check_python: the Python whose transformers checks a huggingface folder.

    Raises:
        TpurunError: an unknown format or platform, an output that cannot be written, no such run
            or checkpoint, a missing export package, or an artifact that does not load or does
            not match the trained model (then nothing is written).
    """
    from tpurun.infer import loading

    started = time.monotonic()
    fmt, chosen = check_format(format), parse_platforms(platforms)
    output = _checked_output(fmt, output)
    trained = loading.open_run(run_dir)
    if fmt == hf_export.FORMAT:
        return _huggingface(trained, checkpoint, machine, output, check_python)
    hub = preset.is_preset(trained.config)
    if hub:
        hub_export.refuse(trained, fmt)
    elif fmt == "lora":
        raise TpurunError(f"--format lora: {trained.run.path} did not fine-tune a model.preset "
                          "with model.lora; export keras, saved_model or onnx.")  # fmt: skip
    found = loading.find_checkpoint(trained, checkpoint)
    runtime = loading.activate_for(trained, machine)
    ref = _trained_reference(trained, found, fmt, hub, runtime)
    tol = tolerance(ref.precision, runtime.choice.accelerator, runtime.sharded)
    folder, name = os.path.split(output)
    work = tempfile.mkdtemp(prefix=f".{name}.tpurun-", dir=folder)
    try:
        stage = os.path.join(work, "out")
        os.makedirs(stage)
        artifact = os.path.join(stage, name)
        began = time.monotonic()
        loader = None
        if ref.hub is not None:
            hub_export.write(fmt, ref.hub, artifact, chosen)
        else:
            loader = _write(fmt, ref.model, artifact, chosen, trained.config)
        wrote = time.monotonic() - began
        report = checking.check(fmt, artifact, ref.inputs, ref.expected, loader, ref.backend, work, tol,
                        ref.hub.check if ref.hub is not None else None)  # fmt: skip
        checked = time.monotonic() - began - wrote
        sidecar = _sidecar(fmt, name, loader, report, trained, found, ref, chosen, tol)
        Path(stage, f"{name}.json").write_text(json.dumps(sidecar, indent=2) + "\n")
        placed = _place(stage, _destinations(fmt, output), os.path.join(work, "replaced"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    keys = ("format", "backend", "precision", "platforms", "checked", "notes", "loader", "usage")
    return {
        **{k: sidecar[k] for k in keys},
        "output": output,
        "sidecar": f"{output}.json",
        "files": placed,
        "checkpoint": found.path,
        "checkpoint_label": found.label,
        "run_dir": trained.run.path,
        "seconds": {
            "export": round(wrote, 3),
            "check": round(checked, 3),
            "total": round(time.monotonic() - started, 3),
        },  # fmt: skip
    }


def _huggingface(
    trained: Any, checkpoint: str, machine: Any, output: str, check_python: Any
) -> dict:
    """``--format huggingface`` (:mod:`tpurun.infer.hf_export`): refused before anything is
    loaded; checked in float32 whatever the run's precision (``hf_export._in_float32``)."""
    from tpurun.infer import loading

    hf_export.refuse(trained)
    found = loading.find_checkpoint(trained, checkpoint)
    runtime = loading.activate_for(trained, machine)
    tol = tolerance("float32", runtime.choice.accelerator, runtime.sharded)
    return hf_export.export(trained, found, runtime, output, reference_inputs(trained), tol,
                            check_python)  # fmt: skip


def _checked_output(fmt: str, output: str) -> str:
    """The output path, once it is known to fit the format and to be writable."""
    from tpurun.infer import loading

    output = loading.writable_output(output).rstrip(os.sep)
    if fmt == hf_export.FORMAT:
        hf_export.check_output(output)
        return output
    if fmt == "keras" and not output.endswith(".keras"):
        raise TpurunError(f"--output {output}: a keras export is a .keras file (Keras saves no "
                          "other name), e.g. --output export/model.keras.")  # fmt: skip
    if fmt == "lora" and not output.endswith(".lora.h5"):
        raise TpurunError(f"--output {output}: a lora export is a .lora.h5 file (KerasHub loads "
                          "no other name), e.g. --output export/adapter.lora.h5.")  # fmt: skip
    if fmt == "onnx" and importlib.util.find_spec("onnxruntime") is None:
        raise TpurunError("--format onnx: onnxruntime is not installed, and export loads the "
                          "artifact with it to check it: pip install 'tpurun[export]'.")  # fmt: skip
    _check_destinations(fmt, output)
    return output


@dataclass
class _Reference:
    """The trained model, the inputs it is checked on, and its own outputs for them."""

    model: Any
    inputs: Any
    source: str  # where the inputs came from
    expected: list
    backend: str
    precision: str
    notes: list[str]
    hub: Any = None  # a preset run's: hub_export.HubReference


def _trained_reference(trained: Any, found: Any, fmt: str, hub: bool, runtime: Any) -> _Reference:
    """The run's model and its outputs: built on one device (an artifact holds plain weights,
    not a layout over devices), or under the run's mesh for a model split over a model axis (no
    device holds it whole); the writers then run without a distribution, gathering each weight
    to the host."""
    if not runtime.sharded:
        runtime.release()
    try:
        return (_hub_reference if hub else _reference)(trained, found, fmt,
                                                       runtime.choice.precision)  # fmt: skip
    finally:
        runtime.release()


def _hub_reference(trained: Any, found: Any, fmt: str, precision: str) -> _Reference:
    """A preset run's task, checked on the first records (their text, or their token ids for a
    SavedModel and for a run trained on tokenised records): :func:`tpurun.infer.hub_export.reference`."""
    from tpurun.infer import loading

    keras = frameworks.keras()
    task = loading.build(trained, found)
    with _highest_precision():
        ref = hub_export.reference(trained, task, fmt, reference_inputs(trained))
    return _Reference(ref.model, ref.inputs, ref.source, ref.expected, keras.backend.backend(),
                      precision, ref.notes, ref)  # fmt: skip


def _reference(trained: Any, found: Any, fmt: str, precision: str) -> _Reference:
    from tpurun.infer import loading

    keras = frameworks.keras()
    notes = []
    if fmt == "onnx" and precision != "float32":
        notes.append(f"trained with {precision}; exported in float32 (Keras' ONNX export needs it)")
        keras.mixed_precision.set_global_policy(precision := "float32")
    model = loading.build(trained, found)
    inputs, source = reference_inputs(trained)
    model(inputs)  # Keras' ONNX export wants a model that has been called
    with _highest_precision():
        expected = [keras.ops.convert_to_numpy(o) for o in keras.tree.flatten(
            model.predict(inputs, batch_size=len(keras.tree.flatten(inputs)[0]), verbose=0))]  # fmt: skip
    return _Reference(model, inputs, source, expected, keras.backend.backend(), precision, notes)


def _write(
    fmt: str, model: Any, artifact: str, platforms: Sequence[str], config: Any
) -> str | None:
    """Write the artifact; returns the loader module written beside a keras export."""
    from tpurun.infer import formats

    if fmt == "saved_model":
        formats.write_saved_model(model, artifact, platforms)
    elif fmt == "onnx":
        formats.write_onnx(model, artifact)
    else:
        return formats.write_keras(model, artifact, config)
    return None


def _sidecar(
    fmt: str, name: str, loader: str | None, report: dict, trained: Any, found: Any,
    ref: _Reference, platforms: Sequence[str], tol: float,
) -> dict[str, Any]:  # fmt: skip
    """``<output>.json``: what the artifact is, how to load and feed it, and how it was checked."""
    from tpurun._version import __version__
    from tpurun.infer import loading
    from tpurun.storage.rundir import now_iso

    return {
        "format": fmt,
        "artifact": name,
        "loader": os.path.basename(loader) if loader else None,
        "usage": hub_export.usage(fmt, name, trained, type(ref.model).__name__)
        if ref.hub is not None
        else _usage(fmt, name, loader),
        "inputs": hub_export.described_inputs(fmt, report, trained.config.data)
        if ref.hub is not None
        else _described_inputs(report, trained.config.data),
        "outputs": report["outputs"],
        "class_names": trained.class_names,
        # How a record decodes into those inputs (tf.io.parse_example, then decode).
        "data": loading.feature_spec(trained.config.data, trained.class_names),
        "backend": ref.backend,
        "precision": ref.precision,
        "platforms": list(platforms) if fmt == "saved_model" and ref.backend == "jax" else None,
        "checked": {
            "on": ref.source,
            "max_abs_diff": report["max_abs_diff"],
            "tolerance": tol,
            "loaded_without_tpurun": not report["tpurun_imported"],
        },
        "notes": ref.notes,
        "run_dir": trained.run.path,
        "checkpoint": found.path,
        "exported": now_iso(),
        "tpurun_version": __version__,
    }
