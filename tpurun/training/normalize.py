"""``normalize: true``: the factory's model behind a ``keras.layers.Normalization`` per input.

The factory cannot see the data, so tpurun puts the standardization in front of its model: a new
functional model with the same inputs (names, shapes, dtypes, structure), each normalized input
going through ``Normalization(mean=..., variance=...)`` (float32, whatever the precision policy:
subtracting a large mean in bfloat16 would lose the value), then the factory's model, then its
outputs under their own names. The numbers are constants of the layer, so ``evaluate``,
``predict`` and every export format compute with exactly them, with no code of tpurun's.

Where the numbers come from: a fresh run, the schema file's statistics (``derived.normalization``
in its ``config.yaml``); a resumed run, the ``config.yaml`` of the run it resumes (the data may
have been written again since); a run opened again, its own ``config.yaml``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from tpurun import frameworks
from tpurun.config import Config, DataConfig
from tpurun.data import files as datafiles
from tpurun.data.decode import decoded_dtype
from tpurun.data.resolve import path_resolver
from tpurun.data.statistics import normalization
from tpurun.errors import ModelError
from tpurun.training.input_check import slots


def _normalized(data: DataConfig) -> set[str]:
    return {n for n, f in data.features.items() if getattr(f, "normalize", False)}


def _model_input(model: Any, ref: Any, slot: Any) -> Any:
    """The factory model's own input tensor for one slot, or None when it declares none (a
    subclassed model, a Sequential without an Input) or its inputs have another structure."""
    try:
        declared = model.input
    except (AttributeError, ValueError):
        return None
    if isinstance(ref, str):
        if isinstance(declared, (list, tuple)):
            return declared[0] if len(declared) == 1 else None
        return None if isinstance(declared, dict) else declared
    if isinstance(declared, dict):
        return declared.get(slot) if isinstance(slot, str) else None
    if isinstance(declared, (list, tuple)):
        if isinstance(slot, int):
            return declared[slot] if len(declared) == len(ref) else None
        named = [t for t in declared if t.name == slot]
        return named[0] if named else None
    return None


def _input(keras: Any, own: Any, data: DataConfig, slot: Any, feature: str) -> Any:
    """A new ``keras.Input`` standing for one of the factory model's inputs (``own``, if it
    declares it), fed by ``feature``."""
    name = slot if isinstance(slot, str) else (own.name if own is not None else feature)
    if own is not None:
        return keras.Input(shape=own.shape[1:], dtype=own.dtype, name=name)
    spec = data.features[feature]
    return keras.Input(shape=tuple(spec.shape), dtype=decoded_dtype(spec), name=name)


def _layer(keras: Any, name: str, feature: str, shape: tuple, own: Any, numbers: Mapping) -> Any:
    """The Normalization layer of one input (``shape`` per record); ``own``, the factory model's
    input it feeds, if it declares one."""
    import numpy as np

    entry = numbers.get(feature)
    if entry is None:
        raise ModelError(
            f"data.features.{feature}.normalize is true, and the run's config.yaml has no numbers "
            f"for '{feature}' under derived.normalization (was it trained before tpurun normalized "
            "inputs, or was the file edited?). Train the run again, or restore its config.yaml."
        )
    if own is not None and ("int" in str(own.dtype) or "bool" in str(own.dtype)):
        raise ModelError(
            f"data.features.{feature}.normalize: the model's input '{name}' is {own.dtype}, and a "
            "normalized input arrives as float32 values. Declare it "
            f"keras.Input(..., dtype='float32', name='{name}') in the factory."
        )
    if np.shape(entry["mean"]) != shape:
        raise ModelError(
            f"data.features.{feature}.normalize: the model's input '{name}' takes "
            f"{list(shape)} values per record, and the numbers for '{feature}' have shape "
            f"{list(np.shape(entry['mean']))}. Make keras.Input's shape the feature's shape."
        )
    return keras.layers.Normalization(
        axis=tuple(range(1, len(shape) + 1)) if shape else None,
        mean=entry["mean"],
        variance=entry["variance"],
        dtype="float32",
        name=f"{name}_normalization",
    )


def wrap(model: Any, config: Config, numbers: Mapping[str, Mapping] | None) -> Any:
    """The factory's model behind a Normalization layer for each input whose feature asks for it;
    the model itself when none does.

    Args:
        model: what the factory returned.
        config: the run's config (``data.features``, ``data.inputs``).
        numbers: ``{feature: {"mean": ..., "variance": ...}}`` (``derived.normalization``);
            None: from the schema file's statistics, as a fresh run takes them (``doctor``).

    Raises:
        ModelError: no numbers for a normalized feature, or an integer model input fed by one.
    """
    data = config.data
    wanted = _normalized(data)
    if not wanted:
        return model
    if numbers is None:
        numbers = schema_numbers(config)
    keras = frameworks.keras()
    fed: dict[Any, Any] = {}
    inputs: dict[Any, Any] = {}
    for slot, feature in slots(data.inputs):
        own = _model_input(model, data.inputs, slot)
        tensor = inputs[slot] = _input(keras, own, data, slot, feature)
        if feature in wanted:
            shape = tuple(tensor.shape[1:])
            tensor = _layer(keras, tensor.name, feature, shape, own, numbers)(tensor)
        fed[slot] = tensor
    try:
        outputs = model(_structured(data.inputs, fed))
        named = _named_outputs(keras, model, outputs)
        return keras.Model(_structured(data.inputs, inputs), named, name=model.name)
    except ValueError as exc:  # a model that cannot be called on its own inputs' shapes, a name
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ModelError(
            f"normalize: the factory's model {model.name} could not be put behind its "
            f"Normalization layer(s): {first}"
        ) from None


def _structured(ref: Any, values: dict) -> Any:
    """``values`` by slot, in the structure the pipeline feeds (``data.inputs``' own)."""
    if isinstance(ref, str):
        return values[None]
    if isinstance(ref, dict):
        return dict(values)
    return [values[i] for i in range(len(ref))]


def _named_outputs(keras: Any, model: Any, outputs: Any) -> Any:
    """The outputs under the factory model's output names, so that losses, metrics and
    ``data.targets`` keyed by output name find them (a nested model would name them all after
    itself)."""
    names = list(getattr(model, "output_names", None) or [])
    flat = keras.tree.flatten(outputs)
    if len(names) != len(flat):
        return outputs
    renamed = iter([keras.layers.Identity(name=n)(t) for n, t in zip(names, flat, strict=True)])
    return keras.tree.map_structure(lambda _: next(renamed), outputs)


def schema_numbers(config: Config) -> dict[str, dict]:
    """The numbers from the schema file beside ``data.train``'s first file, as ``prepare`` finds
    them for a fresh run."""
    files = datafiles.expand(config.data.train, path_resolver(config), "data.train")
    return normalization(config.data, files)[0]


def for_session(prepared: Any, point: Any, effective: dict, reporter: Any) -> dict | None:
    """The numbers this training session normalizes with, also written into ``effective``
    (``config.yaml``'s ``derived.normalization``).

    A fresh run takes the schema file's (``prepared.normalization``). A resumed one keeps those of
    the run it resumes, as its ``config.yaml`` recorded them: the checkpoint's weights were
    trained on inputs standardized with them. When the schema's have changed since (the data
    was written again), a warning says so.
    """
    numbers = prepared.normalization
    if not numbers:
        return numbers
    before = None
    if point is not None and not point.state.get("warm_start"):
        with contextlib.suppress(Exception):  # a run directory without a readable config.yaml
            before = ((point.run.read_config() or {}).get("derived") or {}).get("normalization")
    if isinstance(before, dict):
        kept = {name: before.get(name) or now for name, now in numbers.items()}
        changed = [
            name for name, now in numbers.items()
            if (kept[name]["mean"], kept[name]["variance"]) != (now["mean"], now["variance"])
        ]  # fmt: skip
        if changed:
            reporter.message(
                f"the statistics of {', '.join(changed)} in the schema file changed since this run "
                "began (was the data written again?); it keeps normalizing with the numbers it "
                "trained with (config.yaml, derived.normalization). --restart uses the new ones.",
                "warn",
            )
        numbers = kept
    effective.setdefault("derived", {})["normalization"] = numbers
    return numbers
