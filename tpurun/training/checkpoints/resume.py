"""Where a run continues from: finding a resume point, and refusing one that no longer fits.

A resume point is a JSON state file written by :class:`tpurun.training.checkpoints.checkpointer.Checkpointer` (the run's
``checkpoints/latest.json``, or the ``.json`` beside a best or pattern-named model) and the weights
file it names. This module reads them and compares what the checkpoint was trained with against
the config now; it imports no framework.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tpurun.errors import TpurunError
from tpurun.storage import fileio
from tpurun.storage.rundir import (
    CHECKPOINTS,
    LATEST_STATE,
    PREVIOUS_STATE,
    SHARDED_SUFFIX,
    RunDir,
    source_run,
    state_file,
)
from tpurun.training.checkpoints import integrity

# What a checkpoint is bound to: change one and the saved weights, optimizer state or data position
# no longer mean the same thing. Anything else (epochs, callbacks, learning rate, time limit, data
# files) may change between sessions. Gradient accumulation adds optimizer variables (the partial
# sums): Keras would skip loading an optimizer state of another length with a mere warning.
_ACCUMULATION = "train.gradient_accumulation_steps"
_BINDING = ("model.", "data.features", "data.inputs", "data.targets", "global_batch_size",
            "precision", _ACCUMULATION)  # fmt: skip


@dataclass
class ResumePoint:
    state: dict  # epoch (done), step (into the next), best, callbacks, metrics, identity...
    weights: str  # the weights file's path
    source: str  # what to call it in messages
    # Newer resume points that were passed over as damaged, as "<file>: <what is wrong>".
    damaged: list[str] = field(default_factory=list)

    @property
    def folder(self) -> str:
        return fileio.dirname(self.weights)

    @property
    def run(self) -> RunDir:
        """The run directory the checkpoint belongs to (its log is carried over on a resume)."""
        return source_run(self.folder)

    @property
    def position(self) -> tuple[int, int]:
        return int(self.state.get("epoch", 0)), int(self.state.get("step", 0))

    def where(self) -> str:
        epoch, step = self.position
        return f"epoch {epoch + 1}, step {step}" if step else f"epoch {epoch + 1}"

    def describe(self) -> str:
        return f"resuming at {self.where()} from {self.source}"

    def fallback_note(self) -> str | None:
        """One line for a resume from an older point because newer ones are damaged."""
        if not self.damaged:
            return None
        return (
            f"damaged: {'; '.join(self.damaged)}. Resuming from the previous resume point "
            f"({self.source}, {self.where()}); the log and TensorBoard are cut back to it."
        )


class DamagedCheckpoint(TpurunError):
    """A state file or the checkpoint it names is present but cannot be used."""


def _damaged(path: str, what: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"{path}: {what}")


def _from_state(path: str, source: str) -> ResumePoint | None:
    """The resume point a state file commits; None when the file does not exist.

    Raises:
        DamagedCheckpoint: the file is there but unreadable, or the checkpoint it names is
            missing or not as it was written (:mod:`.integrity`).
    """
    text = fileio.read_text_or_none(path)
    if text is None:
        return None
    try:
        state = json.loads(text)
    except ValueError:
        raise _damaged(path, "not valid JSON (truncated, or edited)") from None
    if not isinstance(state, dict) or "epoch" not in state or "weights" not in state:
        raise _damaged(path, "not a checkpoint state (no epoch or weights in it)")
    weights = fileio.join(fileio.dirname(path), state["weights"])
    wrong = integrity.problem(weights, state.get("check"))
    if wrong is not None:
        raise _damaged(weights, f"{wrong} (named by {fileio.basename(path)})")
    return ResumePoint(state, weights, source)


def latest(run: RunDir) -> ResumePoint | None:
    """The run's own resume point: ``latest.json``'s, or, when that one is damaged, the previous
    one (``previous.json``), with what was damaged in :attr:`ResumePoint.damaged`. None when the
    run has neither (it never saved one).

    Raises:
        DamagedCheckpoint: there is a resume point, and none of them is usable. Nothing on disk
            is changed: the message names the damaged files and the ways out.
    """
    damaged: list[str] = []
    for name in (LATEST_STATE, PREVIOUS_STATE):
        path = run.checkpoint(name)
        try:
            point = _from_state(path, path)
        except DamagedCheckpoint as exc:
            damaged.append(exc.message)
            continue
        if point is None:
            if name == LATEST_STATE and fileio.exists(run.checkpoint(PREVIOUS_STATE)):
                damaged.append(f"{path}: missing (previous.json is there)")
            continue
        point.damaged = damaged
        return point
    if not damaged:
        return None
    raise DamagedCheckpoint(
        f"cannot resume {run.path}: {'; '.join(damaged)}. No complete resume point is left, and "
        "nothing was changed. To go on from another checkpoint, pass --resume PATH (a "
        "checkpoint's .json state file such as checkpoints/best.json, or a weights file); to "
        "start over, pass --restart (the run is moved aside) or --output DIR (a new run "
        "directory)."
    )


def from_path(path: str) -> ResumePoint:
    """``--resume PATH``: a run directory, its checkpoints folder, a state file, a model file or a
    sharded checkpoint's folder (``.orbax``).

    A model file without a state file beside it (say, one from another tool) gives a warm start:
    its weights, from epoch 1.

    Raises:
        TpurunError: nothing to resume from at PATH, or what is there is damaged.
    """
    path = str(path).rstrip("/")
    if fileio.isdir(path) and not path.endswith(SHARDED_SUFFIX):
        inside = fileio.join(path, CHECKPOINTS)
        point = latest(source_run(inside if fileio.isdir(inside) else path))
        if point is not None:
            return point
    elif path.endswith(".json"):
        point = _from_state(path, path)
        if point is not None:
            return point
    elif fileio.exists(path):
        sidecar = fileio.join(fileio.dirname(path) or ".", state_file(fileio.basename(path)))
        point = _from_state(sidecar, path) if fileio.exists(sidecar) else None
        if point is not None and fileio.basename(point.weights) == fileio.basename(path):
            return point
        return ResumePoint({"epoch": 0, "step": 0, "warm_start": True}, path, path)
    raise TpurunError(
        f"--resume {path}: no checkpoint there. Give a run directory, its checkpoints folder, a "
        "checkpoint's .json state file, a .keras / .weights.h5 file (a LoRA run's: "
        ".adapter.h5, or its model.lora.h5 to start from), or a sharded checkpoint's .orbax folder."
    )


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"a.b.c": value}``; lists stay values."""
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


#: What decides the order of the training records (the data stream), recorded as ``stream.*`` in
#: a checkpoint's identity. At an epoch's end a change is harmless (the next epoch is a new
#: pass); mid-epoch the rest of the epoch would come from another order, replaying some records
#: and skipping others, so a change there is refused.
_STREAM_LABELS = {
    "stream.seed": "seed",
    "stream.shuffle_buffer": "data.shuffle_buffer",
    "stream.cache": "data.cache",
    "stream.train_files": "the training files (data.train)",
    "stream.train_records": "the training records",
    "stream.processes": "the number of processes sharing the files",
    # The two readers read files in the same order but shuffle records with their own generators.
    "stream.reader": "the reader (data.reader)",
}


def _digest(files: Sequence[str]) -> str:
    """A short digest of the training files' names, in order (the list itself can be long)."""
    names = "\n".join(fileio.basename(f) for f in files)
    return f"{len(files)} files, {hashlib.sha256(names.encode()).hexdigest()[:12]}"


def identity(config: dict, plan: Any, train_files: Sequence[str] = ()) -> dict[str, Any]:
    """What a checkpoint is bound to, as dotted keys (see ``_BINDING``), and what decides its
    data stream (``stream.*``, checked mid-epoch only).

    Args:
        config: the effective config as plain data (features filled in from a schema).
        plan: the run's :class:`~tpurun.plan.plan.Plan` (global batch size, precision).
        train_files: the training files, expanded, in the order the pipeline takes them.
    """
    derived = {"global_batch_size": plan.global_batch_size, "precision": plan.precision}
    flat = flatten({**config, **derived})
    if flat.get(_ACCUMULATION) == 1:  # the default, which checkpoints from before it leave out
        del flat[_ACCUMULATION]
    bound = {k: v for k, v in flat.items() if any(k.startswith(b) for b in _BINDING)}
    stream = {
        "seed": config.get("seed"),
        "shuffle_buffer": flat.get("data.shuffle_buffer"),
        "cache": flat.get("data.cache") is not None,
        "train_files": _digest(train_files),
        "train_records": flat.get("derived.train_records"),
        "processes": getattr(plan, "num_processes", 1),
        "reader": getattr(plan, "reader", None),
    }
    return {**bound, **{f"stream.{k}": v for k, v in stream.items()}}


def _show(value: Any) -> str:
    text = "unset" if value is None else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_unchanged(point: ResumePoint, now: dict[str, Any]) -> None:
    """Refuse a resume whose checkpoint was trained with another model, features or batch, or,
    mid-epoch, another data stream.

    Raises:
        TpurunError: naming each change, with what was and what is.
    """
    saved = point.state.get("identity")
    if not saved:
        return  # a warm start: nothing recorded to compare
    bound = {k for k in set(saved) | set(now) if not k.startswith("stream.")}
    changed = sorted(k for k in bound if saved.get(k) != now.get(k))
    if changed:
        shown = "; ".join(f"{k}: {_show(saved.get(k))} -> {_show(now.get(k))}" for k in changed[:4])
        more = f" (and {len(changed) - 4} more)" if len(changed) > 4 else ""
        raise TpurunError(
            f"cannot resume from {point.source}: the config changed in a way the checkpoint cannot "
            f"follow ({shown}{more}). A checkpoint only fits the model, features, batch size, "
            "gradient accumulation and precision it was trained with. Undo the change, pass "
            "--restart to start over (the old run is moved aside), or give the changed config "
            "another name."
        )
    if point.position[1]:
        _check_stream(point, saved, now)


def _check_stream(point: ResumePoint, saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Mid-epoch: refuse a change to what orders the records (only what the checkpoint recorded:
    older ones recorded none)."""
    changed = [k for k in _STREAM_LABELS if k in saved and saved[k] != now.get(k)]
    if not changed:
        return
    shown = "; ".join(
        f"{_STREAM_LABELS[k]}: {_show(saved[k])} -> {_show(now.get(k))}" for k in changed
    )
    epoch, step = point.position
    boundary = _epoch_end(point)
    back = (
        f"resume from the end of epoch {boundary[1]} with --resume {boundary[0]} (that epoch's "
        "steps since are trained again), "
        if boundary
        else ""
    )
    raise TpurunError(
        f"cannot resume from {point.source} at epoch {epoch + 1}, step {step}: what orders the "
        f"training records changed ({shown}). The rest of that epoch would come in another "
        "order, replaying some records and skipping others. Undo the change to finish the epoch "
        f"as it began (then change it: an epoch's end takes it), {back}or pass --restart to "
        "start over."
    )


def _epoch_end(point: ResumePoint) -> tuple[str, int] | None:
    """The newest epoch-end checkpoint kept beside a mid-epoch one: (its state file, epochs done)."""
    found = []
    for name in (PREVIOUS_STATE, "best.json"):
        path = fileio.join(point.folder, name)
        with contextlib.suppress(DamagedCheckpoint):
            other = _from_state(path, path)
            if other is not None and other.position[1] == 0 and other.position[0] > 0:
                found.append((other.position[0], path))
    if not found:
        return None
    epochs, path = max(found)
    return path, epochs


def changed_settings(previous: dict | None, now: dict) -> list[str]:
    """Harmless changes since the last session (``epochs: 10 -> 20``), for one line of output."""
    if not previous:
        return []
    before, after = flatten(previous), flatten(now)
    return [
        f"{k}: {_show(before.get(k))} -> {_show(after.get(k))}"
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k) and not k.startswith("derived.")
    ]


_DATA_FACTS = (
    ("train_records", "training records"),
    ("steps_per_epoch", "steps per epoch"),
    ("validation_records", "validation records"),
    ("validation_steps", "validation steps"),
    ("train_files", "training files"),
    ("validation_files", "validation files"),
)


def changed_data(previous: dict | None, now: dict) -> list[str]:
    """What changed in the data since the last session (``training records: 4000 -> 4500``), from
    the ``derived`` sections of the two configs: rewritten data is announced, not silent."""
    before = (previous or {}).get("derived") or {}
    after = now.get("derived") or {}
    if not before:
        return []
    return [
        f"{label}: {_show(before.get(key))} -> {_show(after.get(key))}"
        for key, label in _DATA_FACTS
        if before.get(key) != after.get(key)
    ]
