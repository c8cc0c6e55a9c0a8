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
process that never imports tpurun (:mod:`tpurun.infer.artifact_check`), and compared with the
trained model's outputs on a few records (:mod:`tpurun.infer.reference`). Only an artifact that
matches is moved into place, with its sidecar (:mod:`tpurun.infer.sidecar`); otherwise nothing is
left behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tpurun.errors import EnvironmentSetupError, TpurunError
from tpurun.infer import (
    artifact_check,
    formats,
    hf_export,
    hub_export,
    preset_task,
    reference,
    sidecar,
    trained_run,
)

# lora: a preset run's adapter alone; huggingface: a causal LM's folder (hf_export.py)
FORMATS = ("keras", "saved_model", "onnx", "lora", hf_export.FORMAT)
PLATFORMS = ("cpu", "cuda", "rocm", "tpu")  # what jax2tf's native_serialization_platforms takes
DEFAULT_PLATFORMS = ("cpu", "cuda")


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
    started = time.monotonic()
    fmt, chosen = check_format(format), parse_platforms(platforms)
    output = _checked_output(fmt, output)
    trained = trained_run.open_run(run_dir)
    if fmt == hf_export.FORMAT:
        return _huggingface(trained, checkpoint, machine, output, check_python)
    hub = preset_task.is_preset(trained.config)
    if hub:
        hub_export.refuse(trained, fmt)
    elif fmt == "lora":
        raise TpurunError(
            f"--format lora: {trained.run.path} did not fine-tune a model.preset "
            "with model.lora; export keras, saved_model or onnx."
        )
    found = trained_run.find_checkpoint(trained, checkpoint)
    runtime = trained_run.activate_for(trained, machine)
    ref = reference.trained_reference(trained, found, fmt, hub, runtime)
    tol = reference.tolerance(ref.precision, runtime.choice.accelerator, runtime.sharded)
    written, placed, wrote, checked = _write_checked(fmt, output, ref, trained, found, chosen, tol)
    keys = ("format", "backend", "precision", "platforms", "checked", "notes", "loader", "usage")
    return {
        **{k: written[k] for k in keys},
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
        },
    }


def _write_checked(
    fmt: str,
    output: str,
    ref: reference.Reference,
    trained: Any,
    found: Any,
    platforms: Sequence[str],
    tol: float,
) -> tuple[dict, list[str], float, float]:
    """Write the artifact and its sidecar into a private folder beside ``output``, check it in a
    fresh process, and move it into place; nothing is left behind when the check fails.
    Returns the sidecar, the files placed, and the seconds spent writing and checking."""
    folder, name = os.path.split(output)
    work = tempfile.mkdtemp(prefix=f".{name}.tpurun-", dir=folder)
    try:
        stage = os.path.join(work, "out")
        os.makedirs(stage)
        artifact = os.path.join(stage, name)
        began = time.monotonic()
        loader = None
        if ref.hub is not None:
            hub_export.write(fmt, ref.hub, artifact, platforms)
        else:
            loader = _write(fmt, ref.model, artifact, platforms, trained.config)
        wrote = time.monotonic() - began
        report = artifact_check.check(
            fmt,
            artifact,
            ref.inputs,
            ref.expected,
            loader,
            ref.backend,
            work,
            tol,
            ref.hub.check if ref.hub is not None else None,
        )
        checked = time.monotonic() - began - wrote
        written = sidecar.sidecar(fmt, name, loader, report, trained, found, ref, platforms, tol)
        Path(stage, f"{name}.json").write_text(json.dumps(written, indent=2) + "\n")
        placed = _place(stage, _destinations(fmt, output), os.path.join(work, "replaced"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return written, placed, wrote, checked


def _huggingface(
    trained: Any, checkpoint: str, machine: Any, output: str, check_python: Any
) -> dict:
    """``--format huggingface`` (:mod:`tpurun.infer.hf_export`): refused before anything is
    loaded; checked in float32 whatever the run's precision (``hf_export._in_float32``)."""
    hf_export.refuse(trained)
    found = trained_run.find_checkpoint(trained, checkpoint)
    runtime = trained_run.activate_for(trained, machine)
    tol = reference.tolerance("float32", runtime.choice.accelerator, runtime.sharded)
    return hf_export.export(
        trained, found, runtime, output, reference.reference_inputs(trained), tol, check_python
    )


def _checked_output(fmt: str, output: str) -> str:
    """The output path, once it is known to fit the format and to be writable."""
    output = trained_run.writable_output(output).rstrip(os.sep)
    if fmt == hf_export.FORMAT:
        hf_export.check_output(output)
        return output
    if fmt == "keras" and not output.endswith(".keras"):
        raise TpurunError(
            f"--output {output}: a keras export is a .keras file (Keras saves no "
            "other name), e.g. --output export/model.keras."
        )
    if fmt == "lora" and not output.endswith(".lora.h5"):
        raise TpurunError(
            f"--output {output}: a lora export is a .lora.h5 file (KerasHub loads "
            "no other name), e.g. --output export/adapter.lora.h5."
        )
    if fmt == "onnx" and importlib.util.find_spec("onnxruntime") is None:
        raise TpurunError(
            "--format onnx: onnxruntime is not installed, and export loads the "
            "artifact with it to check it: pip install 'tpurun[export]'."
        )
    _check_destinations(fmt, output)
    return output


def _write(
    fmt: str, model: Any, artifact: str, platforms: Sequence[str], config: Any
) -> str | None:
    """Write the artifact; returns the loader module written beside a keras export."""
    if fmt == "saved_model":
        formats.write_saved_model(model, artifact, platforms)
    elif fmt == "onnx":
        formats.write_onnx(model, artifact)
    else:
        return formats.write_keras(model, artifact, config)
    return None
