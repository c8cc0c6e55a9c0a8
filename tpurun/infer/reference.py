"""What an export is checked against: the trained model's own outputs on a few inputs, and how
close the artifact's must come to them.

The inputs are the first records of the run's validation (else training) data, or normal draws
shaped as the features where none can be read here (:func:`reference_inputs`). The trained model
runs them at full float32 matmul precision (:func:`highest_precision`); a preset run's task gets its
inputs and outputs from :func:`tpurun.infer.hub_export.reference`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from tpurun import frameworks
from tpurun.config import DataConfig
from tpurun.data import reader as readers
from tpurun.data.native import pipeline as native
from tpurun.data.resolve import path_resolver
from tpurun.errors import TpurunError
from tpurun.infer import hub_export, trained_run

CHECK_RECORDS = 16


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


def reference_inputs(trained: Any, n: int = CHECK_RECORDS) -> tuple[Any, str]:
    """Model inputs to check the artifact on: the first records of the run's validation (else
    training) data, or, where they cannot be read here, normal draws shaped as the features.
    Read by the native reader, whatever the run's: a few records as numpy arrays, in file order,
    the same from either reader, without TensorFlow."""
    data = trained.config.data
    features = {name: data.features[name] for name in DataConfig.names(data.inputs)}
    for key, patterns in (("data.validation", data.validation), ("data.train", data.train)):
        if not patterns:
            continue
        try:
            found = trained_run.find_records(patterns, features, key, path_resolver(trained.config))
        except TpurunError:
            continue
        take = min(n, found.records)
        ds = native.make_ordered_dataset(
            found.files,
            found.compression,
            take,
            records=take,
            features=features,
            inputs=data.inputs,
        )
        inputs, _ = readers.first_batch(ds)
        return inputs, f"the first {take} records of {key}"
    return trained_run.sample_inputs(
        data, n, seed=0
    ), f"{n} random inputs (no records readable here)"


def highest_precision():
    """The trained model's reference outputs at full float32 matmul precision: on a TPU or a
    recent GPU, JAX's default would round float32 matmuls to bfloat16 passes or TF32."""
    keras = frameworks.keras()

    if keras.backend.backend() != "jax":
        return contextlib.nullcontext()
    jax = frameworks.jax()

    return jax.default_matmul_precision("highest")


@dataclass
class Reference:
    """The trained model, the inputs it is checked on, and its own outputs for them."""

    model: Any
    inputs: Any
    source: str  # where the inputs came from
    expected: list
    backend: str
    precision: str
    notes: list[str]
    hub: Any = None  # a preset run's: hub_export.HubReference


def trained_reference(trained: Any, found: Any, fmt: str, hub: bool, runtime: Any) -> Reference:
    """The run's model and its outputs: built on one device (an artifact holds plain weights,
    not a layout over devices), or under the run's mesh for a model split over a model axis (no
    device holds it whole); the writers then run without a distribution, gathering each weight
    to the host."""
    if not runtime.sharded:
        runtime.release()
    try:
        return (_hub_reference if hub else _reference)(
            trained, found, fmt, runtime.choice.precision
        )
    finally:
        runtime.release()


def _hub_reference(trained: Any, found: Any, fmt: str, precision: str) -> Reference:
    """A preset run's task, checked on the first records (their text, or their token ids for a
    SavedModel and for a run trained on tokenised records): :func:`tpurun.infer.hub_export.reference`."""
    keras = frameworks.keras()
    task = trained_run.build(trained, found)
    with highest_precision():
        ref = hub_export.reference(trained, task, fmt, reference_inputs(trained))
    return Reference(
        ref.model,
        ref.inputs,
        ref.source,
        ref.expected,
        keras.backend.backend(),
        precision,
        ref.notes,
        ref,
    )


def _reference(trained: Any, found: Any, fmt: str, precision: str) -> Reference:

    keras = frameworks.keras()
    notes = []
    if fmt == "onnx" and precision != "float32":
        notes.append(f"trained with {precision}; exported in float32 (Keras' ONNX export needs it)")
        keras.mixed_precision.set_global_policy(precision := "float32")
    model = trained_run.build(trained, found)
    inputs, source = reference_inputs(trained)
    model(inputs)  # Keras' ONNX export wants a model that has been called
    with highest_precision():
        expected = [keras.ops.convert_to_numpy(o) for o in keras.tree.flatten(
            model.predict(inputs, batch_size=len(keras.tree.flatten(inputs)[0]), verbose=0))]  # fmt: skip
    return Reference(model, inputs, source, expected, keras.backend.backend(), precision, notes)
