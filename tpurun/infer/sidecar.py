"""An export's sidecar, ``<output>.json``: what the artifact is, how to load and feed it (the
inputs, each with the feature that feeds it, and how a record decodes into them), and how it was
checked. A preset run's usage and inputs come from :mod:`tpurun.infer.hub_export`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tpurun import frameworks
from tpurun._version import __version__
from tpurun.config import DataConfig
from tpurun.data import decode as feat
from tpurun.infer import hub_export, trained_run
from tpurun.infer.reference import Reference
from tpurun.storage.rundir import now_iso


def sidecar(
    fmt: str,
    name: str,
    loader: str | None,
    report: dict,
    trained: Any,
    found: Any,
    ref: Reference,
    platforms: Sequence[str],
    tol: float,
) -> dict[str, Any]:
    """``<output>.json``: what the artifact is, how to load and feed it, and how it was checked."""
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
        "data": trained_run.feature_spec(trained.config.data, trained.class_names),
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


def _feature_names(data: Any) -> list[str]:
    """The input features in the order the artifact takes its inputs (``keras.tree.flatten``)."""
    keras = frameworks.keras()

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
        return (
            "import onnxruntime as ort; session = ort.InferenceSession('" + name + "'); "
            "y = session.run(None, {session.get_inputs()[0].name: x})[0]"
        )
    if loader:
        module = os.path.basename(loader).removesuffix(".py")
        return (
            f"import sys; sys.path.insert(0, FOLDER); import {module}; "
            f"model = {module}.load(); y = model.predict(x)"
        )
    return f"import keras; model = keras.saving.load_model('{name}', compile=False)"
