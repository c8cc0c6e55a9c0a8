"""The run's resume point, and the best and pattern-named models.

``checkpoints/latest.json`` is the resume point: it names the weights file it goes with (weights and
optimizer state) and records the position (epochs done, steps into the next), the best value, the
state of the stateful callbacks, and, mid-epoch, the running metric sums. It is written last, after
its weights, and replaced atomically, so it always names a complete file: a kill at any instant
leaves the previous resume point intact.

Weights are written by Keras' ``.keras`` / ``.weights.h5`` savers, which copy the variables to the
host and write from there, so a TPU never has to reach the local disk. A LoRA run writes adapter
checkpoints instead (:mod:`.adapter`: ``latest-e<E>-s<S>.adapter.h5``, ``best.adapter.h5``, a
pattern-named file's suffix made ``.adapter.h5``): what trains and the optimizer state, not the
frozen base again; the same commit order and pruning. Every file goes through
:class:`~tpurun.storage.rundir.RunDir`, which writes only on the process that writes.

With a model axis (``sharded``) no process holds the whole model: each checkpoint is an Orbax folder
(:mod:`.sharded`: ``latest-e<E>-s<S>.orbax``, ``best.orbax``, a pattern-named file's suffix made
``.orbax``) that every process writes its shards into, in the background. Its state file is written
once the folder is complete on every process (:meth:`Checkpointer.poll` at each step, the next
save, the end of ``fit``): until then the previous ``latest.json`` stands, so the commit order is
today's. A stop (SIGTERM, the time limit) waits for the save in flight, saves, and waits for that
one too. A LoRA run under a mesh keeps its adapter files: they hold only what trains (the LoRA
kernels, which no layout rule splits, and their optimizer slots), megabytes that gathering costs
nothing, and they keep the preset fingerprint that refuses other base weights.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tpurun.errors import TpurunError
from tpurun.storage import fileio
from tpurun.storage.rundir import (
    ADAPTER_SUFFIX,
    BEST_ADAPTER,
    BEST_MODEL,
    BEST_SHARDED,
    LATEST_STATE,
    LATEST_WEIGHTS_PREFIX,
    PREVIOUS_STATE,
    SHARDED_SUFFIX,
    WEIGHTS_SUFFIX,
    RunDir,
    latest_weights_name,
    state_file,
)
from tpurun.training.checkpoints import adapter, integrity
from tpurun.training.checkpoints.sharded import Saver
from tpurun.training.monitored import improved

#: Saves that may finish in the background; any other reason (a stop, the start) waits for its save.
BACKGROUND = ("every_steps", "every_minutes", "epoch")


def seed_states(model: Any) -> list[Any]:
    """The model's variables that are not weights: its seed generators' states (a Dropout
    layer's), which draw the masks. Keras' ``.weights.h5`` leaves them out (a SeedGenerator is
    not saved), so a resume would draw other masks than the unbroken run: the state file keeps
    them (a few integers each)."""
    weights = {id(w) for w in model.weights}
    return [v for v in model.non_trainable_variables if id(v) not in weights]


def sharded_name(name: str) -> str:
    """A checkpoint file name as a run with a model axis writes it: ``best.keras`` ->
    ``best.orbax``."""
    for suffix in (SHARDED_SUFFIX, WEIGHTS_SUFFIX, ADAPTER_SUFFIX, ".keras", ".h5"):
        if name.endswith(suffix):
            return name[: -len(suffix)] + SHARDED_SUFFIX
    return name + SHARDED_SUFFIX


def step_offset(resume_at: tuple[int, int], epoch: int) -> int:
    """Steps already done in (0-based) ``epoch`` before this ``fit`` began: a mid-epoch resume."""
    return resume_at[1] if epoch == resume_at[0] else 0


class Checkpointer:
    """Saves and restores the run's position; driven by :class:`tpurun.training.callbacks.run_control.RunControl`.

    ``mode`` (``min``/``max``) may be left None until the compiled model says which way the
    monitored metric improves (see :func:`tpurun.training.monitored.resolve_monitors`).
    ``sharded``: the model is split over a mesh's model axis (its checkpoints are Orbax folders).
    """

    def __init__(
        self,
        run: RunDir,
        *,
        steps_per_epoch: int,
        monitor: str,
        mode: str | None,
        save_best: bool = True,
        save_best_only: bool = True,
        filename: str | None = None,
        keep: int | None = None,
        every_steps: int | None = None,
        every_minutes: float | None = None,
        stateful: Sequence[Any] = (),
        identity: Mapping[str, Any] | None = None,
        sharded: bool = False,
    ):
        self.run = run
        self.steps_per_epoch = steps_per_epoch
        self.monitor = monitor
        self.mode = mode
        self.save_best = save_best
        self.save_best_only = save_best_only
        self.filename = filename
        self.keep = keep
        self.every_steps = every_steps
        self.every_seconds = every_minutes * 60 if every_minutes else None
        self.stateful = {type(c).__name__: c for c in stateful}
        self.identity = dict(identity or {})
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.resume_at = (0, 0)  # (epochs done, steps into the next) where this fit starts
        self.position = (0, 0)  # the same, as of the last save
        self.lr_scale = 1.0  # on_nan: restore cuts the learning rate; kept for later sessions
        # The schedule's warmup end and decay length in batches (training.schedule): a resume of
        # another length stretches it, and later sessions go on with the stretched one.
        self.lr_shape: dict | None = None
        self.last_logs: dict[str, float] = {}  # the last finished epoch's metrics
        self.metrics_state: list | None = None  # running metric sums to restore mid-epoch
        self._last_save = (0, time.monotonic())  # (global step, time)
        self._lora: bool | None = None  # whether the model has LoRA on: known at the first save
        self._preset: dict | None = None  # the preset record adapter files carry
        self.sharded = sharded
        # Sharded saves in flight, one writer each for the resume point and for the best and
        # pattern-named models, with what commits each once it is complete.
        self._savers = {"latest": Saver(), "models": Saver()} if sharded else {}
        self._pending: dict[str, Callable[[], None]] = {}
        # The last resume point committed (as written to latest.json): it becomes previous.json
        # when the next one is committed.
        self._committed: dict | None = None

    # ------------------------------------------------------------------ resume
    def restore(self, state: Mapping[str, Any], folder: str) -> None:
        """Take up a saved state: best value, callback counters, metric sums, position. A state
        of this run's own checkpoints folder is kept as the previous resume point of the next."""
        own = fileio.join(folder, "") == fileio.join(self.run.checkpoints, "")
        self._committed = dict(state) if own and "weights" in state else None
        self.best, self.best_epoch = state.get("best"), state.get("best_epoch")
        for name, saved in (state.get("callbacks") or {}).items():
            callback = self.stateful.get(name)
            if callback is not None:  # else: no longer configured, a harmless change
                callback.restore_state(saved, folder)
        self.resume_at = self.position = (int(state["epoch"]), int(state.get("step", 0)))
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.last_logs = dict(state.get("logs") or {})
        self.metrics_state = state.get("metrics") if self.resume_at[1] else None
        self._last_save = (self._global_step(*self.resume_at), time.monotonic())

    def restore_seed_states(self, model: Any, state: Mapping[str, Any]) -> None:
        """The dropout layers' random state as it was saved (none in older checkpoints)."""
        saved = state.get("seed_states")
        variables = seed_states(model)
        if saved is not None and len(saved) == len(variables):
            for variable, value in zip(variables, saved, strict=True):
                variable.assign(np.asarray(value, dtype=variable.dtype))

    def restore_metrics(self, model: Any, epoch: int) -> None:
        """At a resumed epoch's start (Keras has just reset the metrics), go on from the saved
        running sums, so the epoch's log row is the whole epoch's."""
        if self.metrics_state is None or epoch != self.resume_at[0]:
            return
        variables = model.metrics_variables
        if len(variables) == len(self.metrics_state):
            for variable, value in zip(variables, self.metrics_state, strict=True):
                if tuple(variable.shape) == np.shape(value):
                    variable.assign(np.asarray(value, dtype=variable.dtype))
        self.metrics_state = None

    def _global_step(self, epochs_done: int, step: int) -> int:
        return epochs_done * self.steps_per_epoch + step

    def steps_before(self, epoch: int) -> int:
        """Steps already done in (0-based) ``epoch`` before this ``fit`` began (a mid-epoch
        resume): what the observing callbacks, below training, count an epoch's steps from."""
        return step_offset(self.resume_at, epoch)

    def due(self, epochs_done: int, step: int) -> str | None:
        """Whether a mid-epoch save is due (``every_steps`` / ``every_minutes``), and why."""
        last_step, last_time = self._last_save
        if (
            self.every_steps
            and self._global_step(epochs_done, step) - last_step >= self.every_steps
        ):
            return "every_steps"
        if self.every_seconds and time.monotonic() - last_time >= self.every_seconds:
            return "every_minutes"
        return None

    # ------------------------------------------------------------------ saving
    def state(self, model: Any, epochs_done: int, step: int, reason: str) -> dict:
        """The resume state at this position (writing early stopping's best weights if they
        changed, since the state names their file)."""
        callbacks = {name: c.save_state(self.run) for name, c in self.stateful.items()}
        state = {
            "epoch": epochs_done,
            "step": step,
            "reason": reason,
            "monitor": self.monitor,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "callbacks": callbacks,
            "lr_scale": self.lr_scale,
            "lr_shape": self.lr_shape,
            "logs": self.last_logs,
            "identity": self.identity,
            "time": time.time(),
        }
        if step:
            state["metrics"] = [np.asarray(v).tolist() for v in model.metrics_variables]
        if self.adapter_files(model):  # an adapter file holds the seed states itself
            state["preset"] = self._preset
        else:
            state["seed_states"] = [np.asarray(v).tolist() for v in seed_states(model)]
        return state

    def adapter_files(self, model: Any) -> bool:
        """Whether this run's checkpoints are adapter files (LoRA on); the preset's record is
        taken with the answer, once."""
        if self._lora is None:
            self._lora = adapter.is_lora(model)
            if self._lora:
                self._preset = adapter.preset_record(self.identity.get("model.preset"), model)
        return self._lora

    def _writer(self, model: Any, name: str):
        """How to write the checkpoint file ``name``: by its suffix."""
        if name.endswith(ADAPTER_SUFFIX):
            return lambda path: adapter.save(model, path, self._preset)
        return model.save_weights if name.endswith(WEIGHTS_SUFFIX) else model.save

    def _write(self, model: Any, name: str, then: Callable[[], None], saver: str) -> None:
        """Write checkpoint ``name``, then ``then()`` (its state file, pruning): at once for a
        file; for a sharded folder, once Orbax has finished it on every process (``saver``:
        which of the two writers, each with at most one save in flight)."""
        if not name.endswith(SHARDED_SUFFIX):
            self.run.save_checkpoint(name, self._writer(model, name))
            then()
            return
        self._commit(saver, block=True)  # the writer's previous save, before it starts again
        # A folder of that name (the last best; a save never committed) goes first, by tpurun:
        # Orbax's own replacing asks google-cloud-storage about the bucket's layout.
        self.run.remove_checkpoint(name)
        self.run.save_sharded(name, lambda path: self._savers[saver].save(model, path))
        self._pending[saver] = then

    def _commit(self, saver: str, block: bool) -> None:
        """Commit ``saver``'s save in flight if it is complete (``block``: wait for it)."""
        if saver not in self._pending or not (block or self._savers[saver].done()):
            return
        then = self._pending.pop(saver)
        self._savers[saver].wait()  # raises what went wrong: then the folder is not committed
        then()

    def poll(self) -> None:
        """Commit the sharded saves that finished meanwhile (each step: does not wait)."""
        for saver in list(self._pending):
            self._commit(saver, block=False)

    def finish(self) -> None:
        """Wait for the sharded saves in flight and commit them (the end of a ``fit``, a stop)."""
        for saver in list(self._pending):
            self._commit(saver, block=True)

    @contextlib.contextmanager
    def closing(self) -> Iterator[None]:
        """The session's fits: at the end, :meth:`finish` and Orbax's background work stopped;
        after a failure, quietly (the failure is the error to report), complete saves committed."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self._close()
            raise
        self._close()

    def _close(self) -> None:
        self.finish()
        for saver in self._savers.values():
            saver.close()

    def save_latest(
        self,
        model: Any,
        epochs_done: int,
        step: int,
        reason: str,
        state: dict | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Weights first, under a new name; then ``latest.json`` naming them; then old weights go.

        ``state``: this position's :meth:`state`, when the caller has it already. ``then``: what
        to do once committed. A sharded save for a reason not in :data:`BACKGROUND` (a stop)
        waits to be committed.
        """
        suffix = WEIGHTS_SUFFIX
        if self.adapter_files(model):
            suffix = ADAPTER_SUFFIX
        elif self.sharded:
            suffix = SHARDED_SUFFIX
        name = latest_weights_name(epochs_done, step, suffix)
        state = {**(state or self.state(model, epochs_done, step, reason)), "weights": name}

        def commit() -> None:
            committed = {**state, "check": self._fingerprint(name)}
            if self._committed is not None:  # kept, in case the new one is found damaged
                self.run.write_checkpoint_state(PREVIOUS_STATE, self._committed)
            self.run.write_checkpoint_state(LATEST_STATE, committed)  # the commit point
            keep = {name} | ({self._committed["weights"]} if self._committed else set())
            self._committed = committed
            # Only the writer prunes: another process listing the folder while process 0
            # deletes from it would stat a file that is gone. A killed sharded save's leftover
            # folder (``<name>.orbax-checkpoint-tmp-<n>``) matches the pattern too.
            for old in (
                self.run.checkpoint_files(f"{LATEST_WEIGHTS_PREFIX}e*") if self.run.writer else ()
            ):
                if old not in keep:
                    self.run.remove_checkpoint(old)
            if then is not None:
                then()

        self._write(model, name, commit, "latest")
        if reason not in BACKGROUND:
            self.finish()
        self.position = (epochs_done, step)
        self._last_save = (self._global_step(epochs_done, step), time.monotonic())

    def _save_model(self, model: Any, name: str, state: dict, prune: bool = False) -> None:
        """A best or pattern-named model, with its state beside it, so ``--resume`` can use it;
        ``prune``: then keep the newest ``keep`` of the pattern. A sharded folder of the same
        name is replaced: its state file goes first, so that none names a folder being written."""
        if name.endswith(SHARDED_SUFFIX):
            self._commit("models", block=True)  # the last best may still be on its way
            self.run.remove_checkpoint(state_file(name))

        def commit() -> None:
            check = self._fingerprint(name)
            self.run.write_checkpoint_state(
                state_file(name), {**state, "weights": name, "check": check}
            )
            if prune:
                self._prune(model)

        self._write(model, name, commit, "models")

    def _fingerprint(self, name: str) -> dict[str, Any]:
        """The committed checkpoint ``name``'s fingerprint (:mod:`.integrity`), on the writer."""
        return integrity.fingerprint(self.run.checkpoint(name)) if self.run.writer else {}

    def _named(self, model: Any, name: str) -> str:
        """A configured file name as this run writes it (a LoRA run: an adapter file; with a
        model axis: a sharded folder)."""
        if self.adapter_files(model):
            return adapter.adapter_name(name)
        return sharded_name(name) if self.sharded else name

    def _prune(self, model: Any) -> None:
        """Keep the newest ``keep`` files of the filename pattern (found by a glob, so files of
        earlier, resumed sessions count too). Only the writer prunes."""
        if not self.run.writer:
            return
        pattern = self._named(model, re.sub(r"\{[^}]*\}", "*", self.filename))
        files = [
            f for f in self.run.checkpoint_files(pattern)
            if not f.startswith(LATEST_WEIGHTS_PREFIX)
            and f not in (BEST_MODEL, BEST_ADAPTER, BEST_SHARDED)
        ]  # fmt: skip
        for old in files[: -self.keep]:
            self.run.remove_checkpoint(old)
            self.run.remove_checkpoint(state_file(old))

    def epoch_end(
        self,
        model: Any,
        epoch: int,
        logs: Mapping[str, Any],
        then: Callable[[], None] | None = None,
    ) -> None:
        """A finished epoch: the best model if it improved, a pattern-named one, the resume point;
        ``then``: what to do once the resume point is committed."""
        self.last_logs = {k: float(v) for k, v in logs.items()}
        better = self.save_best and improved(float(logs[self.monitor]), self.best, self.mode)
        if better:
            self.best, self.best_epoch = float(logs[self.monitor]), epoch + 1
        state = self.state(model, epoch + 1, 0, "epoch")  # one state for every file it writes
        if better:
            self._save_model(model, self._named(model, BEST_MODEL), state)
        if self.filename and (better or not self.save_best_only):
            try:
                name = self._named(model, self.filename.format(epoch=epoch + 1, **logs))
            except (KeyError, IndexError, ValueError) as exc:
                raise TpurunError(
                    f"callbacks.checkpoint.filename '{self.filename}': cannot fill it in ({exc}); "
                    f"it may use {{epoch}} and the metrics {', '.join(sorted(logs))}."
                ) from None
            self._save_model(model, name, state, prune=bool(self.keep))
        self.save_latest(model, epoch + 1, 0, "epoch", state, then)

    @property
    def best_record(self) -> dict[str, Any] | None:
        if not self.save_best:
            return None
        return {"monitor": self.monitor, "value": self.best, "epoch": self.best_epoch}
