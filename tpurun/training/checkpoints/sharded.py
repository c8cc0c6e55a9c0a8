"""Sharded, asynchronous checkpoints of a model split over a device mesh (Orbax).

With a model axis no device, and in a pod slice no process, holds the whole model: Keras'
``.weights.h5`` savers would gather every weight to the host first. Here every process writes
its own shards of the variables into one Orbax folder (``latest-e<E>-s<S>.orbax``), and the write
runs in the background: :meth:`Saver.save` returns once the values are copied off the devices
(the next step may overwrite them), and training goes on while Orbax writes. All processes must
call it, in the same order (it is a collective).

The folder holds two items:

- ``state``: the variables, ``{"model": {"0000": array, ...}, "optimizer": {...}}``: every model
  weight (trainable and not) in ``model.weights`` order, every optimizer variable (slots,
  iterations, learning rate, gradient accumulators) in ``optimizer.variables`` order. By
  position, with the paths recorded beside them, as Keras' own savers and the adapter files key
  the optimizer: Keras numbers layers and optimizers per process (``dense_1``, ``adam_w_1``), so
  the same model can carry other paths in another session of the same process.
- ``variables``: JSON, the format, its version, and each variable's path, shape and dtype.

Seed states and metric sums stay in the JSON state file beside it (a few numbers, written by
:class:`~tpurun.training.checkpoints.checkpointer.Checkpointer`).

:func:`load` restores into the model as it is now, under the current mesh: the target of each
variable is its own shape, dtype and sharding, so a checkpoint written under a 2x4 mesh restores
under 4x2 or 8x1 (Orbax reads the slices each device needs). Every position is checked against
the model (path with Keras' per-process numbers taken out, shape, dtype) before anything is
assigned: Keras' ``set_state_tree`` would skip what it does not know without a word. With
``weights_only`` (``evaluate``, ``predict``, ``export``, ``tpurun.load``) it restores the model's
weights alone: the optimizer group stays on disk, unread.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from tpurun import frameworks
from tpurun.errors import EnvironmentSetupError, ModelError
from tpurun.storage import fileio

FORMAT = "tpurun-sharded"
VERSION = 1
GROUPS = ("model", "optimizer")


def _ocp() -> Any:
    """``orbax.checkpoint``, once JAX may be imported (:func:`tpurun.frameworks.jax`)."""
    frameworks.jax()
    try:
        import orbax.checkpoint as ocp
    except ImportError as exc:
        raise EnvironmentSetupError(
            "a model split over a mesh's model axis is checkpointed with Orbax, which is not "
            f"installed here ({exc}): pip install 'tpurun[sharded]'."
        ) from None
    return ocp


def _groups(model: Any, weights_only: bool = False) -> dict[str, list[Any]]:
    if weights_only:
        return {"model": list(model.weights)}
    optimizer = list(model.optimizer.variables) if model.optimizer is not None else []
    return {"model": list(model.weights), "optimizer": optimizer}


def _key(i: int) -> str:
    return f"{i:04d}"


def _dtype(variable: Any) -> str:
    return frameworks.keras().backend.standardize_dtype(variable.dtype)


def describe_variables(model: Any) -> dict[str, Any]:
    """The ``variables`` item: format, version, and per group each variable's path, shape, dtype."""
    return {
        "format": FORMAT,
        "version": VERSION,
        **{
            group: [[v.path, list(v.shape), _dtype(v)] for v in variables]
            for group, variables in _groups(model).items()
        },
    }


def state_tree(model: Any) -> dict[str, dict[str, Any]]:
    """The ``state`` item: each variable's array (sharded as it lies on the devices), by group
    and position."""
    return {
        group: {_key(i): v.value for i, v in enumerate(variables)}
        for group, variables in _groups(model).items()
    }


class Saver:
    """One run's Orbax writer: at most one save in flight (a new one waits for the last).

    A thread of its own waits for Orbax's background write, so that :meth:`done` can tell
    without blocking whether the folder is complete (Orbax's own wait is blocking only).
    """

    def __init__(self) -> None:
        self._checkpointer: Any = None
        self._watch: threading.Thread | None = None
        self._error: BaseException | None = None
        self.in_flight: str | None = None  # the folder being written, until :meth:`wait`

    def save(self, model: Any, path: str) -> None:
        """Start writing ``model``'s variables to the folder ``path`` (replaced if it exists: a
        save of an earlier session that was never committed). Returns once the values are off
        the devices; :meth:`wait` for the write to end."""
        ocp = _ocp()
        self.wait()
        if self._checkpointer is None:
            self._checkpointer = ocp.AsyncCheckpointer(ocp.CompositeCheckpointHandler())
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state_tree(model)),
            variables=ocp.args.JsonSave(describe_variables(model)),
        )
        self._checkpointer.save(path, args=args, force=True)
        self.in_flight = path
        self._watch = threading.Thread(
            target=self._wait_for_orbax, name="tpurun-sharded-save", daemon=True
        )
        self._watch.start()

    def _wait_for_orbax(self) -> None:
        try:
            self._checkpointer.wait_until_finished()
        except BaseException as exc:  # noqa: BLE001  (raised again by wait(), in the main thread)
            self._error = exc

    def done(self) -> bool:
        """Whether the save in flight (if any) is complete on every process: no waiting."""
        return self._watch is None or not self._watch.is_alive()

    def wait(self) -> str | None:
        """Wait until the save in flight is complete on every process; returns its folder (None:
        there was none).

        Raises:
            Exception: what Orbax raised writing it (the folder is then incomplete).
        """
        if self._watch is not None:
            self._watch.join()
            self._watch = None
        done, self.in_flight = self.in_flight, None
        error, self._error = self._error, None
        if error is not None:
            raise error
        return done

    def close(self) -> None:
        """Wait for the save in flight and stop Orbax's background work."""
        try:
            self.wait()
        finally:
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None


def save(model: Any, path: str) -> None:
    """A synchronous save (the write done on return), for tests and one-off copies."""
    saver = Saver()
    try:
        saver.save(model, path)
    finally:
        saver.close()


def _plain(path: str) -> str:
    """A variable path without Keras' per-process numbering: ``dense_3/kernel`` -> ``dense/kernel``."""
    return re.sub(r"_\d+(?=/|$)", "", path)


def misfits(saved: dict[str, Any], model: Any, weights_only: bool = False) -> list[str]:
    """What differs between a checkpoint's recorded variables and the model's, one phrase each
    (``weights_only``: the model's weights alone, not its optimizer's variables)."""
    out = []
    for group, variables in _groups(model, weights_only).items():
        recorded = saved.get(group) or []
        for i, variable in enumerate(variables):
            if i >= len(recorded):
                out.append(f"{variable.path} missing from the checkpoint")
                continue
            path, shape, dtype = recorded[i]
            now = (list(variable.shape), _dtype(variable))
            if _plain(path) != _plain(variable.path):
                out.append(f"{group} variable {i}: {path} in the checkpoint, {variable.path} here")
            elif (shape, dtype) != now:
                out.append(
                    f"{variable.path}: {dtype}{shape} in the checkpoint, {now[1]}{now[0]} here"
                )
        out += [f"{p[0]} not in the model" for p in recorded[len(variables) :]]
    return out


def read_variables(path: str) -> dict[str, Any]:
    """The ``variables`` item of the checkpoint folder ``path``."""
    ocp = _ocp()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
        found = reader.restore(path, args=ocp.args.Composite(variables=ocp.args.JsonRestore()))
    return dict(found["variables"] or {})


def load(model: Any, path: str, source: str, weights_only: bool = False) -> None:
    """Restore a sharded checkpoint into ``model`` (built, its optimizer built) under the current
    mesh, every variable checked first.

    Args:
        weights_only: restore the model's weights alone (``evaluate``, ``predict``, ``export``,
            ``tpurun.load``): its optimizer need not be built, and the checkpoint's optimizer
            state is not read.

    Raises:
        ModelError: the folder is no tpurun sharded checkpoint, or it does not fit the model
            (naming the variables that differ).
    """
    ocp = _ocp()
    jax = frameworks.jax()
    name = fileio.basename(path)
    try:
        saved = read_variables(path)
    except (OSError, ValueError, KeyError, FileNotFoundError) as exc:
        raise ModelError(
            f"{source}: {name} is not a readable sharded checkpoint ({exc})."
        ) from None
    if saved.get("format") != FORMAT:
        raise ModelError(
            f"{source}: {name} is not a tpurun sharded checkpoint (no '{FORMAT}' mark)."
        )
    if int(saved.get("version", 0)) > VERSION:
        raise ModelError(
            f"{source}: {name} was written by a newer tpurun (sharded format "
            f"{saved['version']}); upgrade tpurun to resume from it."
        )
    problems = misfits(saved, model, weights_only)
    if problems:
        more = f" and {len(problems) - 4} more" if len(problems) > 4 else ""
        advice = (
            "A checkpoint only fits the model it was trained as (the same factory or preset, "
            "model.task, model.kwargs and model.lora): give one this run saved (--checkpoint "
            "best, latest, or a folder in its checkpoints/)"
            if weights_only
            else "It was saved from another model, optimizer or gradient accumulation: resume "
            "with the config it was trained with, or pass --restart to start over"
        )
        raise ModelError(
            f"{source}: {name} does not fit this model ({'; '.join(problems[:4])}{more}). {advice}."
        )
    groups = _groups(model, weights_only)
    target = {
        group: {
            _key(i): jax.ShapeDtypeStruct(tuple(v.shape), v.value.dtype, sharding=v.value.sharding)
            for i, v in enumerate(variables)
        }
        for group, variables in groups.items()
    }
    if weights_only:  # the optimizer's group stays on disk
        restore = ocp.args.PyTreeRestore(
            item=target,
            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True,
        )
    else:
        restore = ocp.args.StandardRestore(target)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as reader:
        found = reader.restore(path, args=ocp.args.Composite(state=restore))
    for group, variables in groups.items():
        for i, variable in enumerate(variables):
            variable.assign(found["state"][group][_key(i)])
