"""Checkpoints of a LoRA run: what trains and what a resume needs, not the frozen base again.

Keras' ``.weights.h5`` is wrong for a LoRA run twice over. It writes every frozen base weight at
every save (a Gemma 2B's 5 GB, into Kaggle's limited output folder, or one upload per save to
``gs://``). And EinsumDense/Dense ``save_own_variables`` write the adapter merged into the kernel,
while ``load_own_variables`` zero the adapter: the outputs match, the raw variables do not, so the
next updates differ and a resume is not exact.

An adapter checkpoint (``*.adapter.h5``, HDF5) holds:

- ``model/<variable.path>``: each trainable variable: the LoRA A and B kernels, and whatever
  KerasHub leaves trainable beside them (a BERT's query/value biases, a classifier's head);
- ``state/<i>``: the non-trainable variables that are not the frozen backbone's weights, in
  ``model.non_trainable_variables`` order: the dropout layers' seed generator states (a task
  head's own non-trainable weights too). By position: a seed generator's path carries a
  per-process counter (``seed_generator_7``);
- ``optimizer/<i>``: every optimizer variable (iterations, learning rate, slots, gradient
  accumulators), by position, as Keras' own saving does: the optimizer's name, and so each path,
  can differ between processes (``adam_w_1``);
- attributes: the format, its version and the preset it adapts (:func:`preset_record`).

Each value keeps its dtype (``bfloat16`` as its 16 bits, attribute ``dtype``). The frozen base comes
from the preset: :func:`load` refuses a file recorded against other preset files, or whose keys,
shapes or dtypes do not fit the model, before it assigns anything.

A LoRA run's final artifact, ``model.lora.h5`` (:func:`save_lora`), is KerasHub's
``Backbone.save_lora_weights`` file (the adapter kernels by layer index, the rank) with a
``tpurun`` group beside it: the LoRA alpha and the other trainable variables by path (the head,
the biases), which KerasHub's ``load_lora_weights`` ignores.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpurun import frameworks
from tpurun.errors import ModelError, describe
from tpurun.hub import quantize
from tpurun.hub.preset import CONFIG, is_handle
from tpurun.hub.task_model import lora_layers
from tpurun.storage import fileio
from tpurun.storage.rundir import ADAPTER_SUFFIX, LORA_SUFFIX, WEIGHTS_SUFFIX

FORMAT = "tpurun-adapter"
VERSION = 1
GROUPS = ("model", "state", "optimizer")
EXTRAS = "tpurun"  # model.lora.h5's own group, beside KerasHub's "lora"


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a KerasHub task with LoRA on: its checkpoints are adapter files."""
    backbone = getattr(model, "backbone", None)
    return backbone is not None and bool(lora_layers(backbone))


def adapter_name(name: str) -> str:
    """A checkpoint file name as a LoRA run writes it: ``model-05.keras`` ->
    ``model-05.adapter.h5``."""
    for suffix in (ADAPTER_SUFFIX, WEIGHTS_SUFFIX, LORA_SUFFIX, ".keras", ".h5"):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ADAPTER_SUFFIX
    return name + ADAPTER_SUFFIX


# ------------------------------------------------------------------ the preset it adapts
def preset_record(location: str | None, model: Any = None) -> dict | None:
    """Which preset a checkpoint belongs to: its location, and a fingerprint that is cheap to
    take: a hash of ``config.json``, and of each ``*.weights.h5`` file its size and a hash of
    samples spread over it (:func:`_sampled_sha256`). None without a preset; a handle
    (``kaggle://``) is recorded by name only (its files are in a cache). A ``model`` whose base
    was quantized adds the quantized base's fingerprint (``quantized``:
    :func:`tpurun.hub.quantize.record`)."""
    if not location:
        return None
    record: dict[str, Any] = {"location": location}
    if quantize.record_of(model) is not None:
        record["quantized"] = quantize.record_of(model)
    if is_handle(location) or not os.path.isdir(location):
        return record
    config = os.path.join(location, CONFIG)
    if os.path.isfile(config):
        record["config_sha256"] = _sampled_sha256(config)
    record["weights"] = {
        name: [os.path.getsize(path), _sampled_sha256(path)]
        for name in sorted(os.listdir(location))
        if name.endswith(WEIGHTS_SUFFIX) and os.path.isfile(path := os.path.join(location, name))
    }
    return record


#: A file up to this size is hashed whole; a larger one in ``_SAMPLES`` slices spread over it (a
#: preset's weights are gigabytes: reading them all at every resume would take a while).
_WHOLE_BYTES = 1 << 20
_SAMPLES = 16


def _sampled_sha256(path: str) -> str:
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        if size <= _WHOLE_BYTES:
            digest.update(f.read())
        for i in range(_SAMPLES if size > _WHOLE_BYTES else 0):
            f.seek(size * i // _SAMPLES)
            digest.update(f.read(_WHOLE_BYTES // _SAMPLES))
    return digest.hexdigest()[:16]


def preset_changes(saved: dict | None, now: dict | None) -> list[str]:
    """How the preset's files differ from the ones a checkpoint was saved against (its location
    is the config's, checked with the rest of it)."""
    if not saved or not now or "weights" not in saved:
        return []  # a handle: its name is its version
    changes = []
    if saved.get("config_sha256") != now.get("config_sha256"):
        changes.append(f"{CONFIG} differs")
    before, after = saved.get("weights") or {}, now.get("weights") or {}
    for name in sorted(set(before) | set(after)):
        was, now_ = before.get(name), after.get(name)
        if was is None or now_ is None:
            changes.append(f"{name} {'added' if was is None else 'gone'}")
        elif was[0] != now_[0]:
            changes.append(f"{name}: {was[0]} -> {now_[0]} bytes")
        elif was[1] != now_[1]:
            changes.append(f"{name}: other contents")
    return changes


# ------------------------------------------------------------------ what the file holds
@dataclass
class _Parts:
    """The variables an adapter checkpoint holds, by group: ``model`` keyed by path, ``state``
    and ``optimizer`` by position."""

    model: dict[str, Any]
    state: list[Any]
    optimizer: list[Any]

    def keyed(self, group: str) -> dict[str, Any]:
        if group == "model":
            return self.model
        return {str(i): v for i, v in enumerate(getattr(self, group))}


def _parts(model: Any) -> _Parts:
    trainable: dict[str, Any] = {}
    for variable in model.trainable_variables:
        if variable.path in trainable:
            raise ModelError(
                f"two trainable variables of the model share the path {variable.path}: an "
                "adapter checkpoint keys them by path. Give one of their layers another name."
            )
        trainable[variable.path] = variable
    frozen = {id(v) for v in model.backbone.non_trainable_weights}
    state = [v for v in model.non_trainable_variables if id(v) not in frozen]
    optimizer = list(model.optimizer.variables) if model.optimizer is not None else []
    return _Parts(trainable, state, optimizer)


def _dtype(value: Any) -> str:
    return frameworks.keras().backend.standardize_dtype(value.dtype)


def _put(group: Any, key: str, variable: Any) -> None:
    """One variable as a dataset: its value (bfloat16 as its bits), its dtype and path."""
    value = np.asarray(frameworks.keras().ops.convert_to_numpy(variable))
    dtype = _dtype(value)
    dataset = group.create_dataset(
        key, data=value.view(np.uint16) if dtype == "bfloat16" else value
    )
    dataset.attrs["dtype"] = dtype
    dataset.attrs["path"] = variable.path


def _get(dataset: Any) -> np.ndarray:
    value = np.asarray(dataset[()])
    if dataset.attrs.get("dtype") == "bfloat16":
        import ml_dtypes

        value = value.view(ml_dtypes.bfloat16)
    return value


def _datasets(group: Any) -> dict[str, Any]:
    """Every dataset under ``group``, by its path inside it (``a/b/kernel``)."""
    h5py = _h5py()
    found: dict[str, Any] = {}
    group.visititems(
        lambda name, obj: found.update({name: obj}) if isinstance(obj, h5py.Dataset) else None
    )
    return found


def _h5py():
    import h5py  # Keras' own dependency, for its .h5 files

    return h5py


@contextlib.contextmanager
def _open(path: str) -> Iterator[Any]:
    """The HDF5 file at ``path`` for reading; one in a bucket is read into memory first (h5py
    reads local files only, and an adapter is small)."""
    h5py = _h5py()
    source = io.BytesIO(fileio.read_bytes(path)) if fileio.is_remote(path) else path
    with h5py.File(source, "r") as f:
        yield f


# ------------------------------------------------------------------ save and load
def save(model: Any, path: str, preset: dict | None = None) -> None:
    """Write ``model``'s adapter checkpoint to the local file ``path`` (the run directory makes it
    atomic and uploads it: :meth:`~tpurun.storage.rundir.RunDir.save_checkpoint`)."""
    parts = _parts(model)
    with _h5py().File(path, "w") as f:
        f.attrs["format"], f.attrs["version"] = FORMAT, VERSION
        f.attrs["preset"] = json.dumps(preset)
        for group in GROUPS:
            made = f.create_group(group)
            for key, variable in parts.keyed(group).items():
                _put(made, key, variable)


def read(path: str) -> dict[str, dict[str, np.ndarray]]:
    """An adapter checkpoint's values: ``{"model": {path: value}, "state": {"0": value, ...},
    "optimizer": {"0": value, ...}}``, positions in order."""
    with _open(path) as f:
        _check_format(f, path)
        found = {g: _datasets(f[g]) for g in GROUPS}
        order = {g: sorted(found[g], key=None if g == "model" else int) for g in GROUPS}
        return {g: {k: _get(found[g][k]) for k in order[g]} for g in GROUPS}


def _check_format(f: Any, path: str) -> None:
    if f.attrs.get("format") != FORMAT:
        raise ModelError(f"{path} is not a tpurun adapter checkpoint (no '{FORMAT}' mark).")
    if int(f.attrs.get("version", 0)) > VERSION:
        raise ModelError(
            f"{path} was written by a newer tpurun (adapter format "
            f"{int(f.attrs['version'])}); upgrade tpurun to resume from it."
        )


def load(model: Any, path: str, source: str, preset: str | None = None) -> None:
    """Load an adapter checkpoint into ``model`` (built from its preset with LoRA on, its
    optimizer built): every key, shape and dtype is checked before anything is assigned.

    Args:
        path: the file (local or in a bucket).
        source: what to call it in messages.
        preset: the preset's location now; its files must be the ones the checkpoint recorded.

    Raises:
        ModelError: the preset's files changed, or the file does not fit the model (naming what
            differs).
    """
    name = fileio.basename(path)
    with _open(path) as f:
        _check_format(f, path)
        saved, now = json.loads(f.attrs.get("preset", "null")), preset_record(preset, model)
        _check_quantized(source, name, saved, now)
        changes = preset_changes(saved, now)
        if changes:
            raise ModelError(
                f"{source}: {name} holds a LoRA adapter trained on other base weights than the "
                f"preset {preset} has now ({'; '.join(changes[:4])}). An adapter checkpoint "
                "holds no base weights: they come from the preset. Give model.preset the preset "
                "it was trained on, or pass --restart to start over."
            )
        parts = _parts(model)
        found = {g: _datasets(f[g]) if g in f else {} for g in GROUPS}
        problems = [p for g in GROUPS for p in _misfits(g, found[g], parts.keyed(g))]
        if problems:
            raise ModelError(
                f"{source}: {name} does not fit this model ({'; '.join(problems[:4])}"
                f"{f' and {len(problems) - 4} more' if len(problems) > 4 else ''}). It was "
                "saved from another model, LoRA rank, optimizer or gradient accumulation: resume "
                "with the config it was trained with, or pass --restart to start over."
            )
        for group in GROUPS:
            for key, variable in parts.keyed(group).items():
                variable.assign(_get(found[group][key]))


def _check_quantized(source: str, name: str, saved: dict | None, now: dict | None) -> None:
    """Refuse an adapter trained on a quantized base other than the one rebuilt now."""
    changes = quantize.changes((saved or {}).get("quantized"), (now or {}).get("quantized"))
    if changes:
        raise ModelError(
            f"{source}: {name} holds a LoRA adapter trained on another quantized base than the "
            f"one rebuilt now ({'; '.join(changes[:4])}). Quantizing the same preset in the same "
            "mode with the same Keras gives the same base; the adapter learnt to correct that "
            "one. Resume with the model.quantize and Keras the run was trained with, or pass "
            "--restart to start over."
        )


def _misfits(group: str, saved: dict[str, Any], expected: dict[str, Any]) -> list[str]:
    """What differs between a group's datasets and the model's variables, one phrase each."""

    def label(key: str, item: Any) -> str:
        if group == "model":
            return key
        return f"{group} variable {key} ({item.attrs['path'] if hasattr(item, 'attrs') else item.path})"

    out = [f"{label(k, v)} missing from the file" for k, v in expected.items() if k not in saved]
    out += [f"{label(k, d)} not in the model" for k, d in saved.items() if k not in expected]
    for key in (k for k in expected if k in saved):
        dataset, variable = saved[key], expected[key]
        was = (tuple(dataset.shape), str(dataset.attrs.get("dtype")))
        now = (tuple(variable.shape), _dtype(variable))
        if was != now:
            out.append(f"{label(key, variable)}: {_shape(*was)} in the file, {_shape(*now)} here")
    return out


def _shape(shape: tuple, dtype: str) -> str:
    return f"{dtype}{list(shape)}"


# ------------------------------------------------------------------ the final artifact
def save_lora(task: Any, path: str) -> None:
    """``model.lora.h5``: KerasHub's ``save_lora_weights`` file, plus the ``tpurun`` group (rank,
    alpha, and the trainable variables that are not adapter kernels, by path)."""
    backbone = task.backbone
    backbone.save_lora_weights(path)
    layers = lora_layers(backbone)
    kernels = {id(v) for layer in layers for v in (layer.lora_kernel_a, layer.lora_kernel_b)}
    with _h5py().File(path, "a") as f:
        extras = f.create_group(EXTRAS)
        extras.attrs["lora_rank"] = int(layers[0].lora_rank)
        extras.attrs["lora_alpha"] = float(layers[0].lora_alpha)
        trainable = extras.create_group("trainable")
        for variable in task.trainable_variables:
            if id(variable) not in kernels:
                _put(trainable, variable.path, variable)


def load_lora(task: Any, path: str, source: str) -> None:
    """Load a ``model.lora.h5`` into ``task`` (LoRA on, at the file's rank): KerasHub's adapter
    kernels, then the other trainable variables :func:`save_lora` kept.

    Raises:
        ModelError: LoRA is off, the rank differs, or the variables do not fit.
    """
    if not is_lora(task):
        raise ModelError(f"{source}: a LoRA adapter, for a model with LoRA on: set model.lora.")
    with contextlib.ExitStack() as stack:
        local = path
        if fileio.is_remote(path):  # KerasHub's reader opens a local path
            local = os.path.join(
                stack.enter_context(tempfile.TemporaryDirectory()), fileio.basename(path)
            )
            fileio.copy(path, local)
        try:
            task.backbone.load_lora_weights(local)
        except (ValueError, KeyError) as exc:
            raise ModelError(f"{source}: cannot load the adapter: {describe(exc)}") from None
        with _open(local) as f:
            saved = _datasets(f[EXTRAS]["trainable"]) if EXTRAS in f else {}
            expected = {v.path: v for v in task.trainable_variables if v.path in saved}
            problems = _misfits("model", saved, expected)
            if problems:
                raise ModelError(f"{source}: {'; '.join(problems[:4])}.")
            for key, variable in expected.items():
                variable.assign(_get(saved[key]))
