"""A trained run, opened again: its config, a checkpoint, the model with its weights, and the records
to run it on. Shared by ``tpurun evaluate``, ``predict`` and ``export`` and by :func:`tpurun.load`.

The model is built by the run's own factory (``config.yaml`` names it, and every ``file.py:name``
import, by an absolute path) and the checkpoint's weights are loaded into it, as a resume does. So
custom layers are the user's code, found where training found them, and a ``.weights.h5`` resume
point loads as a ``.keras`` file does. A run that fine-tuned a ``model.preset`` is the KerasHub
task with its preprocessor instead (:mod:`tpurun.infer.preset_task`: the preset and a LoRA adapter, or
the task's ``model.keras``).

A run with a model axis (``runtime.mesh``) keeps sharded checkpoints, ``.orbax`` folders
(:mod:`tpurun.training.checkpoints.sharded`). ``evaluate``, ``predict`` and ``export`` build its
model under the run's mesh, as ``train`` does, and the folder's weights land sharded (its optimizer
state stays on disk); :func:`tpurun.load` builds it on one device, the weights whole.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from tpurun import frameworks
from tpurun.config import Config, DataConfig, load_config
from tpurun.data import decode as feat
from tpurun.data import files as datafiles
from tpurun.data import records
from tpurun.data import schema_file as schema_lib
from tpurun.data.files import detect_compression
from tpurun.data.native.framing import iter_records
from tpurun.data.resolve import path_resolver, tokenized_entry
from tpurun.data.sniff import NotTFRecords
from tpurun.errors import DataError, ModelError, TpurunError
from tpurun.hub import mesh_layout
from tpurun.infer import preset_task
from tpurun.plan.plan import batch_sizes
from tpurun.plan.prepare import choose_for
from tpurun.runtime.activate import activate
from tpurun.runtime.machine import probe
from tpurun.storage import fileio
from tpurun.storage.rundir import (
    ADAPTER_SUFFIX,
    BEST_ADAPTER,
    BEST_MODEL,
    BEST_SHARDED,
    CHECKPOINTS,
    LATEST_WEIGHTS_PREFIX,
    SHARDED_SUFFIX,
    RunDir,
    state_file,
)
from tpurun.training.checkpoints import integrity, resume, sharded
from tpurun.training.model import build_model

CHECKPOINT_HELP = (
    "best (checkpoints/best.keras, a LoRA run's best.adapter.h5 or a model-parallel run's "
    "best.orbax, else the final model.keras or model.lora.h5), latest (the resume point), or a "
    ".keras / .weights.h5 / .adapter.h5 / .lora.h5 file or a sharded checkpoint's .orbax folder "
    "(a name in the run's checkpoints/ folder works too)"
)
_BESTS = (BEST_MODEL, BEST_ADAPTER, BEST_SHARDED)


@dataclass
class TrainedRun:
    """A run directory and the config it trained with (``config.yaml``)."""

    run: RunDir
    config: Config
    derived: dict  # config.yaml's derived values (backend, replicas, class names...)

    @property
    def class_names(self) -> list[str] | None:
        return self.derived.get("class_names")


@dataclass
class Checkpoint:
    path: str
    label: str  # how to name it in a report: "best", "latest (epoch 3)", the path


class Loaded(NamedTuple):
    """What :func:`tpurun.load` returns: ``model, spec = tpurun.load(RUN_DIR)``."""

    model: Any  # a keras.Model with the checkpoint's weights (a preset run's: the KerasHub task)
    spec: dict  # feature_spec(): how records decode into the model's inputs, the class names


def _local(path: str) -> str:
    path = str(path)
    return path if fileio.is_remote(path) else os.path.abspath(path)


def open_run(path: str) -> TrainedRun:
    """Read a run directory's ``config.yaml`` back into a config.

    Raises:
        TpurunError: not a run directory, or its config no longer validates.
    """
    run = RunDir(_local(path))
    raw = run.read_config()
    if raw is None:
        if not run.exists():
            raise TpurunError(
                f"{run.path}: no such run directory. Give the folder `tpurun train` made "
                "(<output.dir>/<name>, e.g. runs/my-experiment)."
            )
        raise TpurunError(
            f"{run.path}: no config.yaml there, so it is not a tpurun run directory (or its run "
            "stopped before the first step). Give the folder `tpurun train` made."
        )
    derived = raw.get("derived") or {}
    return TrainedRun(run, load_config(raw), derived if isinstance(derived, dict) else {})


def find_checkpoint(trained: TrainedRun, which: str = "best") -> Checkpoint:
    """The weights file ``--checkpoint`` names.

    Raises:
        TpurunError: no such checkpoint; the message lists the ones there are.
    """
    run = trained.run
    if which == "best":
        for name in _BESTS:
            if _committed(run, name):
                _check_whole(run, name)
                return Checkpoint(run.checkpoint(name), "best")
        final = run.model_file()
        if final is not None:
            name = fileio.basename(final)
            return Checkpoint(final, f"final ({name}; the run kept no best model)")
    elif which == "latest":
        point = resume.latest(run)
        if point is not None:
            epoch, step = point.position
            at = f"epoch {epoch}, step {step}" if step else f"end of epoch {epoch}"
            damaged = (
                f"; the newer one is damaged: {'; '.join(point.damaged)}" if point.damaged else ""
            )
            return Checkpoint(point.weights, f"latest ({at}{damaged})")
    else:
        for path in (which, run.checkpoint(which), run.file(which)):
            path = path.rstrip("/") or path
            folder = fileio.isdir(path)  # only a sharded checkpoint is a folder
            if fileio.exists(path) and (not folder or path.endswith(SHARDED_SUFFIX)):
                if path.endswith(".json"):  # a checkpoint's state file names its weights
                    return Checkpoint(resume.from_path(path).weights, path)
                return Checkpoint(_local(path), path)
    raise TpurunError(
        f"--checkpoint {which}: no such checkpoint in {run.path}. There: "
        f"{', '.join(available(run)) or 'none'}. Give {CHECKPOINT_HELP}."
    )


def available(run: RunDir) -> list[str]:
    """The checkpoints a run has, as ``--checkpoint`` takes them."""
    try:
        found = ["latest"] if resume.latest(run) is not None else []
    except resume.DamagedCheckpoint:
        found = []
    final = run.model_file()
    if final or any(_committed(run, name) for name in _BESTS):
        found.insert(0, "best")
    if fileio.isdir(run.checkpoints):
        for pattern in ("*.keras", f"*{ADAPTER_SUFFIX}", f"*{SHARDED_SUFFIX}"):
            found += [
                f"{CHECKPOINTS}/{name}"
                for name in run.checkpoint_files(pattern)
                if not name.startswith(LATEST_WEIGHTS_PREFIX) and _committed(run, name)
            ]
    return found + ([final] if final else [])


def _check_whole(run: RunDir, name: str) -> None:
    """Refuse a checkpoint that is not as its state file recorded it (a bad copy, a bit flip).

    Raises:
        TpurunError: naming the file, what is wrong and the other checkpoints.
    """
    state = fileio.read_json(run.checkpoint(state_file(name))) or {}
    wrong = integrity.problem(run.checkpoint(name), state.get("check"))
    if wrong is not None:
        raise TpurunError(
            f"--checkpoint best: {run.checkpoint(name)} is damaged: {wrong}. Give another: "
            f"{', '.join(c for c in available(run) if c not in ('best', f'{CHECKPOINTS}/{name}')) or 'none is there'}."
        )


def _committed(run: RunDir, name: str) -> bool:
    """Whether the checkpoint ``name`` is there, complete: a sharded folder counts once its state
    file is written (the commit point; a folder being rewritten has none)."""
    if not fileio.exists(run.checkpoint(name)):
        return False
    return not name.endswith(SHARDED_SUFFIX) or fileio.exists(run.checkpoint(state_file(name)))


# ------------------------------------------------------------------------------------- the model
def activate_for(trained: TrainedRun, machine: Any = None):
    """Set this process up as ``train`` would for this run (devices, precision, a mesh's
    distribution), in one process, on the backend it trained with where its config left the
    choice to ``auto`` and that backend can run here: the same model code then runs on the
    framework it was checkpointed from.

    A run with ``runtime.mesh`` gets its model axis, and a data axis of whatever devices this
    process has (``data: auto``): the model is built split as it trained, and a sharded
    checkpoint restores under any mesh.

    Raises:
        TpurunError: the environment makes this process one of several (a pod slice, SLURM):
            these commands run in one; or the model axis does not divide the devices here.
    """
    config, machine = trained.config, machine or probe()
    alone = {"num_processes": None, "coordinator": None, "process_id": None}
    if config.runtime.mesh is not None:
        alone["mesh"] = config.runtime.mesh.model_copy(update={"data": "auto"})
    config = config.model_copy(update={"runtime": config.runtime.model_copy(update=alone)})
    trained_on = trained.derived.get("backend")
    choice = None
    if config.runtime.backend == "auto" and trained_on in ("jax", "tensorflow"):
        runtime = config.runtime.model_copy(update={"backend": trained_on})
        with contextlib.suppress(TpurunError):  # not here: auto decides, as for train
            choice = choose_for(config.model_copy(update={"runtime": runtime}), machine)
    choice = choice or choose_for(config, machine)
    if choice.cluster.multi:
        raise TpurunError(
            f"this process is one of {choice.cluster.num_processes} ({choice.cluster.source}), and "
            "evaluate, predict and export run in one process: run them on one host with those "
            "variables unset, or on a single-host machine."
        )
    runtime = activate(choice, config.seed)
    mesh_layout.install(runtime, config)  # a mesh's layout, before the model is built
    return runtime


def build(trained: TrainedRun, checkpoint: Checkpoint, runtime: Any = None) -> Any:
    """The run's model, built by its factory in the runtime's scope, with the checkpoint's weights;
    for a preset run, the KerasHub task with its preprocessor (:func:`tpurun.infer.preset_task.build`).

    Raises:
        ModelError: the factory fails (a preset is gone), or the weights do not fit the model it
            builds now.
    """
    if preset_task.is_preset(trained.config):
        return preset_task.build(trained, checkpoint.path, runtime)
    keras = frameworks.keras()

    config = trained.config
    scope = runtime.scope() if runtime is not None else contextlib.nullcontext()
    with scope:
        # With the numbers it trained with, as config.yaml recorded them (normalize: true).
        model = build_model(
            config, keras.backend.backend(), trained.derived.get("normalization") or {}
        )
        if not model.built:  # a subclassed model: one call creates its variables
            model(sample_inputs(config.data, 1))
        if checkpoint.path.endswith(SHARDED_SUFFIX):
            sharded.load(model, checkpoint.path, trained.run.path, weights_only=True)
            return model
        with fileio.local_copy(checkpoint.path) as local:  # Keras reads gs:// only through TF
            try:
                model.load_weights(local)
            except Exception as exc:  # Keras raises ValueError, KeyError, OSError... for a misfit
                first = (str(exc).strip().splitlines() or [""])[0]
                raise ModelError(
                    f"{checkpoint.path}: cannot load it into the model {config.model.factory} "
                    f"builds: {type(exc).__name__}: {first}. Was the factory or model.kwargs "
                    "changed since training? The checkpoint only fits the model it was trained as."
                ) from None
    return model


def sample_inputs(data: DataConfig, n: int, seed: int | None = None) -> Any:
    """``n`` records' worth of model inputs shaped as the features decode: zeros, or with a seed,
    normal draws for float features (what ``export`` checks an artifact on without records)."""
    import numpy as np

    rng = np.random.default_rng(seed) if seed is not None else None
    arrays = {}
    for name in DataConfig.names(data.inputs):
        feature = data.features[name]
        shape, dtype = (n, *feature.shape), feat.decoded_dtype(feature)
        if dtype == "string":
            raise DataError(
                f"data.inputs '{name}' is a bytes feature: no sample of it can be made."
            )
        floating = np.issubdtype(np.dtype(dtype if dtype != "bfloat16" else "float32"), np.floating)
        if rng is not None and floating:
            arrays[name] = rng.normal(size=shape).astype("float32")
        else:
            arrays[name] = np.zeros(shape, dtype="float32" if dtype == "bfloat16" else dtype)
    return feat.select(arrays, data.inputs)


def feature_spec(data: DataConfig, class_names: Sequence[str] | None) -> dict:
    """How a record decodes into the model's inputs (and targets): the features it reads, their
    compression, and the label's class names. The export sidecar and :func:`tpurun.load` give it."""
    used = feat.used_features(data)
    return {
        "features": {n: f.model_dump(mode="json", exclude_none=True) for n, f in used.items()},
        "inputs": data.inputs,
        "targets": data.targets,
        "compression": data.compression,
        "class_names": list(class_names) if class_names else None,
    }


def load(path: str, checkpoint: str = "best", machine: Any = None) -> Loaded:
    """The run's model with a checkpoint's weights, and its feature spec (see :func:`tpurun.load`).

    The process is set up as the run's config says (backend, precision), without distributing
    the model over the devices: a notebook's own ``model.predict`` then runs as usual.
    """
    trained = open_run(path)
    found = find_checkpoint(trained, checkpoint)
    runtime = activate_for(trained, machine)
    runtime.release()
    model = build(trained, found)
    return Loaded(model, feature_spec(trained.config.data, trained.class_names))


# ------------------------------------------------------------------------------------ the records
@dataclass
class Records:
    """Record files to score, checked against the features the command reads."""

    files: list[str]  # sorted by name
    records: int
    compression: str  # "none" | "gzip"
    source: str  # the glob(s), for reports
    tokenized: dict | None = None  # what data write --tokenize recorded (tpurun.data.resolve)


def find_records(
    patterns: str | Sequence[str],
    features: Mapping[str, Any],
    key: str,
    resolve=None,
    run_config: Config | None = None,
) -> Records:
    """Expand ``patterns``, check their first record against ``features`` (only those the
    command reads: a test set has no targets), find damaged files and count the records.

    Args:
        key: what to call the glob in messages (``--data``, ``data.validation``).
        resolve: how a pattern becomes a path (the config's rule, for its own globs); relative
            local paths are otherwise read from the working directory.
        run_config: the run's config: a file that is not TFRecords is told to be written with
            the ``data write`` options of the run's training data.

    Raises:
        DataError: no file matches, files that are not TFRecords, damaged files, or records that
            do not match the features.
    """
    files = sorted(datafiles.expand(patterns, resolve, key))
    schemas = schema_lib.find_for(files)
    first = schemas.get(files[0], (None, None))[1] or {}
    compression = first.get("compression") or datafiles.detect_compression(files[0])
    try:
        checked = records.check_split(
            files, key, schemas, features, compression, skip_corrupt=False
        )
    except NotTFRecords as exc:
        written = training_schema(run_config) if run_config is not None else None
        raise exc.advised(written, key) from None
    source = patterns if isinstance(patterns, str) else " ".join(patterns)
    return Records(checked.files, checked.records, compression, source, tokenized_entry(schemas))


def training_schema(config: Config) -> dict | None:
    """The schema file of the run's training data (``data.train``), if it is still there."""
    try:
        files = datafiles.expand(config.data.train, path_resolver(config), "data.train")
        return next(iter(schema_lib.find_for(files[:1]).values()), (None, None))[1]
    except TpurunError:
        return None


def global_batch(config: Config, replicas: int) -> int:
    """The batch ``train`` fed per step on this many replicas (known to fit the devices)."""
    return batch_sizes(config, replicas)[1]


def first_record(found: Records) -> bytes:
    """The first serialized record of ``found`` (what a command checks before it reads the rest),
    read by the native reader: no TensorFlow."""
    compression = found.compression
    if compression == "auto":
        compression = detect_compression(found.files[0])
    framed = iter_records(found.files[0], compression)
    try:
        return next(framed)
    finally:
        framed.close()


def writable_output(path: str, key: str = "--output") -> str:
    """``path`` made absolute, its folder made; an output that cannot be written is refused
    before any work is done.

    Raises:
        TpurunError: a remote path, a folder in the way, or a folder that cannot be made or written.
    """
    if fileio.is_remote(str(path)):
        raise TpurunError(
            f"{key} {path}: this command writes local files; write it here, then copy it "
            "(gcloud storage cp -r)."
        )
    path = os.path.abspath(path)
    folder = existing = os.path.dirname(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise TpurunError(
            f"{key} {path}: cannot make its folder {folder}: {existing} is a file, "
            "not a folder. Choose another path."
        )
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise TpurunError(
            f"{key} {path}: cannot make its folder {folder}: {exc.strerror}. Choose another path."
        ) from None
    if not os.access(folder, os.W_OK):
        raise TpurunError(f"{key} {path}: {folder} is not writable. Choose another path.")
    return path
