"""The run directory: every file name in it, the lock, and every read and write (the summary's type
is in :mod:`tpurun.storage.summary`).

One run directory belongs to one run at a time (:meth:`RunDir.lock`), and one process of that run
writes it: a :class:`RunDir` made with ``writer=False`` (every process of a multi-host run but the
chief) reads like any other and writes nothing. Imports no framework; file operations go through
:mod:`tpurun.storage.fileio`, so the same code serves ``gs://`` paths.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tpurun.errors import TpurunError
from tpurun.storage import damaged, fileio, runlock, space
from tpurun.storage.summary import Summary

CONFIG = "config.yaml"
SUMMARY = "summary.json"
MODEL = "model.keras"
# A LoRA run's final artifact instead of MODEL: KerasHub's `save_lora_weights` file (the adapter
# only); config.yaml names the preset, task, LoRA rank/alpha and sequence length to rebuild it.
LORA_MODEL = "model.lora.h5"
ERROR_LOG = "error.log"
LOCK = "run.lock"
CHECKPOINTS = "checkpoints"
LATEST_STATE = "latest.json"  # in CHECKPOINTS: the resume point's commit record
PREVIOUS_STATE = "previous.json"  # in CHECKPOINTS: the resume point before, kept for a damaged one
BEST_MODEL = "best.keras"  # in CHECKPOINTS
BEST_ADAPTER = "best.adapter.h5"  # in CHECKPOINTS, instead of BEST_MODEL in a LoRA run
LATEST_WEIGHTS_PREFIX = "latest-"  # in CHECKPOINTS: latest-e<E>-s<S>.weights.h5 (.adapter.h5)
WEIGHTS_SUFFIX = ".weights.h5"  # Keras' weights and optimizer state
# A LoRA run's checkpoints: the trainable variables, the optimizer's and the seed states, not the
# frozen base (tpurun.training.checkpoints.adapter).
ADAPTER_SUFFIX = ".adapter.h5"
LORA_SUFFIX = ".lora.h5"  # KerasHub's adapter file (`Backbone.save_lora_weights` insists on it)
# A model split over a mesh's model axis: each checkpoint is a folder every process writes its
# shards into (Orbax; tpurun.training.checkpoints.sharded), with the same names otherwise.
SHARDED_SUFFIX = ".orbax"
BEST_SHARDED = "best.orbax"  # in CHECKPOINTS, instead of BEST_MODEL with a model axis
EARLY_STOPPING_WEIGHTS = "early_stopping_best.npz"  # in CHECKPOINTS
# TensorBoard's event folders (train/, validation/) and profiles (plugins/profile/) sit in the run
# directory itself, so that `tensorboard --logdir runs` names a run's curves <run>/train and
# <run>/validation. Runs made before kept them in a tensorboard/ folder, and go on doing so.
TENSORBOARD_SPLITS = ("train", "validation")
LEGACY_TENSORBOARD = "tensorboard"
CURVES = "curves.png"
_WEIGHT_SUFFIXES = (WEIGHTS_SUFFIX, ADAPTER_SUFFIX, LORA_SUFFIX, SHARDED_SUFFIX, ".keras", ".h5")


def run_path(output_dir: str, name: str) -> str:
    """Where a run lives: ``<output.dir>/<name>``, absolute (the one place this is computed).

    A relative ``output.dir`` is relative to the working directory, as ``--output`` is: on Kaggle
    the config often sits in read-only ``/kaggle/input`` while runs belong in the working folder.
    """
    path = fileio.join(str(output_dir), name)
    return path if fileio.is_remote(path) else os.path.abspath(path)


def state_file(weights_name: str) -> str:
    """The state file beside a best or pattern-named model: ``best.keras`` -> ``best.json``."""
    for suffix in _WEIGHT_SUFFIXES:
        if weights_name.endswith(suffix):
            return weights_name[: -len(suffix)] + ".json"
    return weights_name + ".json"


def latest_weights_name(epochs_done: int, step: int, suffix: str = WEIGHTS_SUFFIX) -> str:
    """The resume point's weights file at a position; ``suffix``: :data:`ADAPTER_SUFFIX` in a
    LoRA run."""
    return f"{LATEST_WEIGHTS_PREFIX}e{epochs_done:04d}-s{step:07d}{suffix}"


now_iso = runlock.now_iso


class RunDir:
    """One run directory. Reads always work; writes happen only when ``writer`` is true."""

    def __init__(self, path: str, *, writer: bool = True):
        self.path = str(path)
        self.writer = writer
        self._lock = runlock.make_lock(self.file(LOCK))
        self.begun = False
        self._made = False  # create() made the folder: nothing was in it before this session

    def __repr__(self) -> str:
        return f"RunDir({self.path!r}, writer={self.writer})"

    def file(self, *names: str) -> str:
        return fileio.join(self.path, *names)

    @property
    def checkpoints(self) -> str:
        return self.file(CHECKPOINTS)

    def checkpoint(self, name: str) -> str:
        return self.file(CHECKPOINTS, name)

    # ------------------------------------------------------------------ reads
    def exists(self) -> bool:
        return fileio.isdir(self.path)

    def read_summary(self) -> dict | None:
        """``summary.json``'s data; None when it is missing or damaged (:meth:`summary_state`)."""
        return self.summary_state()[0]

    def summary_state(self) -> tuple[dict | None, str | None]:
        """``summary.json``'s data, and what is wrong with it if it is there but unreadable."""
        return damaged.read_json(self.file(SUMMARY))

    def read_config(self) -> dict | None:
        """The ``config.yaml`` a previous session wrote, or None if missing or unreadable."""
        import yaml

        try:
            data = yaml.safe_load(fileio.read_text_or_none(self.file(CONFIG)) or "")
        except (OSError, ValueError, yaml.YAMLError):
            return None
        return data if isinstance(data, dict) else None

    def log_name(self) -> str | None:
        """The CSV log's file name as the run's ``config.yaml`` set it (None: the log was off)."""
        callbacks = (self.read_config() or {}).get("callbacks") or {}
        if "csv_log" in callbacks and callbacks["csv_log"] is None:
            return None
        return (callbacks.get("csv_log") or {}).get("filename", "log.csv")

    def model_file(self) -> str | None:
        """The final artifact's path: ``model.lora.h5`` (a LoRA run) or ``model.keras``; None
        before the run saved one."""
        for name in (LORA_MODEL, MODEL):
            if fileio.exists(self.file(name)):
                return self.file(name)
        return None

    def has_model(self) -> bool:
        """Whether the run saved its final artifact (either kind): its last session finished."""
        return self.model_file() is not None

    def checkpoint_files(self, pattern: str = "*") -> list[str]:
        """File names in ``checkpoints/`` matching a glob pattern, oldest first."""
        paths = fileio.glob(fileio.join(fileio.escape(self.checkpoints), pattern))
        paths.sort(key=lambda p: (fileio.mtime(p), p))  # names break a tie of mtimes
        return [fileio.basename(p) for p in paths]

    def status(self, summary: Mapping[str, Any] | None = None) -> str:
        """The summary's status, except that a run recorded as running whose lock nobody holds has
        died (SIGKILL, a crashed VM; in a bucket: its lock's heartbeat stopped, or its process is
        gone from this host): it can never say so itself. ``summary``: one already read."""
        summary = (self.read_summary() if summary is None else summary) or {}
        status = summary.get("status", "unknown")
        if status == "running" and not self.is_locked():
            return "died"
        return status

    # ------------------------------------------------------------------ the lock
    def is_locked(self) -> bool:
        """Whether a live process holds this run's lock: locally, the kernel drops a dead one's
        flock; in a bucket, a lock whose heartbeat stopped (see :mod:`tpurun.storage.runlock`) is not."""
        return self._lock.held or self._lock.is_locked()

    def lock(self) -> None:
        """Hold this run directory for the life of the process (or until :meth:`unlock`).

        ``run.lock`` says who holds it. Locally it is an ``flock``, so a run killed with SIGKILL
        never blocks the next one; in a bucket it is an object with a heartbeat
        (:mod:`tpurun.storage.runlock`), taken over once its holder is dead or silent.

        Raises:
            TpurunError: another live process holds it; the message names its pid, host and start.
        """
        if not self.writer or self._lock.held:
            return
        try:
            self._lock.acquire()
        except runlock.Busy as busy:
            raise runlock.busy_error(self.path, busy.holder) from None

    def unlock(self) -> None:
        """Release the lock. A folder this session made and never began (the run failed before
        its first write: a config, data or model problem) is removed too, so that a mistake
        leaves no run behind in ``tpurun runs``."""
        untouched = self._made and not self.begun and self._lock.held
        self._made = False
        if untouched and not fileio.is_remote(self.path):
            # Under the lock, so that no other run can take the folder meanwhile; only when it
            # holds nothing else (an unexpected failure's error.log stays, and the run with it).
            with contextlib.suppress(OSError):
                if sorted(os.listdir(self.path)) == [CHECKPOINTS, LOCK]:
                    os.rmdir(self.checkpoints)
                    os.remove(self.file(LOCK))
                    os.rmdir(self.path)
        self._lock.release()
        if untouched and fileio.is_remote(self.path):
            with contextlib.suppress(Exception):  # best effort: it holds no object but a marker
                if not fileio.glob(fileio.join(fileio.escape(self.checkpoints), "*")):
                    fileio.remove(self.checkpoints)

    @contextlib.contextmanager
    def locked(self) -> Iterator[RunDir]:
        self.lock()
        try:
            yield self
        finally:
            self.unlock()

    # ------------------------------------------------------------------ writes
    def create(self, *, restart: bool = False) -> str | None:
        """Make the folder (and ``checkpoints/``) and take its lock; with ``restart``, first move
        an existing run aside. Returns where the old run went, if it moved.

        Raises:
            TpurunError: the folder cannot be made or written, or another run holds it.
        """
        if not self.writer:
            return None
        aside = None
        if restart and self.exists():
            with self.locked():  # refuse to move a live run
                aside = f"{self.path.rstrip('/')}-{time.strftime('%Y%m%d-%H%M%S')}"
                fileio.rename(self.path, aside)
                if fileio.is_remote(aside):  # the lock object moved along (a folder's objects do)
                    fileio.remove(fileio.join(aside, LOCK))
        made = not self.exists()
        try:
            fileio.makedirs(self.checkpoints)
        except OSError as exc:
            raise TpurunError(
                f"output.dir: cannot create {self.path}: {exc.strerror}. Choose another with --output."
            ) from None
        if not fileio.is_remote(self.path) and not os.access(self.path, os.W_OK):
            raise TpurunError(
                f"output.dir: {self.path} is not writable. Choose another with --output."
            )
        self.lock()
        self._made = made or aside is not None
        return aside

    def _writing(self) -> bool:
        """Whether this RunDir writes; raises :class:`~tpurun.storage.runlock.LockLost` when another run
        took its (remote) lock."""
        if self.writer:
            self._lock.check()
        return self.writer

    def _write_text(self, name: str, text: str) -> None:
        if self._writing():
            fileio.write_text(self.file(name), text)

    def write_config(self, effective: Mapping[str, Any]) -> None:
        import yaml

        self._write_text(
            CONFIG,
            "# Written by tpurun: the config as run, with defaults filled in, and the values derived\n"
            "# on this machine under `derived` (ignored when this file is loaded again).\n"
            + yaml.safe_dump(dict(effective), sort_keys=False),
        )

    def begin(self, effective: Mapping[str, Any], summary: Summary) -> None:
        """The run's first writes, ``config.yaml`` and ``summary.json``, once (later calls do
        nothing). Made only once Keras has checked the model against the data, so that a config,
        model or data problem leaves an earlier run directory as it was."""
        if not self.begun:
            self.begun = True
            self.write_config(effective)
            self.write_summary(summary)

    def write_summary(self, summary: Summary) -> None:
        """Write ``summary.json``. A failed run's summary is written on a best-effort basis: with
        the bucket unreachable (the likely reason it failed), the error that stopped the run is
        the one to report, promptly."""
        if not self._writing():
            return
        summary.pid, summary.host, summary.updated = os.getpid(), socket.gethostname(), now_iso()
        if summary.status != "failed":
            fileio.write_json(self.file(SUMMARY), summary.to_dict())
        elif not fileio.recently_unreachable():  # a full disk: the error to report, too
            with contextlib.suppress(fileio.StorageError, space.DiskFull):
                fileio.write_json(self.file(SUMMARY), summary.to_dict())

    def write_error(self, text: str) -> str | None:
        """Keep an unexpected failure's traceback; returns the file's path (None: not written,
        on a full disk too: the caller keeps it in the temporary folder)."""
        if self.writer and self.exists():
            with contextlib.suppress(space.DiskFull):
                self._write_text(ERROR_LOG, text)
                return self.file(ERROR_LOG)
        return None

    def _save(self, path: str, save: Callable[[str], Any]) -> None:
        if self._writing():
            fileio.save_atomically(path, save)
        elif not self.writer:
            # Keras' savers gather every variable to the host, a collective across processes:
            # the others must save too, or process 0 waits forever. Their copy is thrown away.
            with tempfile.TemporaryDirectory(prefix="tpurun-not-chief-") as tmp:
                save(os.path.join(tmp, fileio.basename(path)))

    def write_eval(self, name: str, result: Mapping[str, Any]) -> str | None:
        """``eval-<name>.json``: a ``tpurun evaluate`` result. Returns its path (None: not
        written, on a process that does not write)."""
        if not self._writing():
            return None
        path = self.file(f"eval-{name}.json")
        fileio.write_json(path, dict(result))
        return path

    def write_file(self, name: str, save: Callable[[str], Any]) -> str | None:
        """A file in the run directory written by ``save(path)`` atomically (``curves.png``);
        returns its path (None: not written, on a process that does not write)."""
        if not self._writing():
            return None
        fileio.save_atomically(self.file(name), save)
        return self.file(name)

    def tensorboard_parts(self) -> tuple[str, ...]:
        """Where the TensorBoard logs go, as names under the run directory: none (the run
        directory itself), or ``tensorboard/`` for a run that began with it."""
        legacy = self.file(LEGACY_TENSORBOARD)
        return (LEGACY_TENSORBOARD,) if self.exists() and fileio.isdir(legacy) else ()

    def add_file(self, local: str, *names: str) -> str | None:
        """Copy a local file to ``names`` in the run directory, folders made (a profile trace);
        returns its path (None: not written)."""
        if not self._writing():
            return None
        target = self.file(*names)
        fileio.makedirs(fileio.dirname(target))
        fileio.copy(local, target)
        return target

    def save_model(self, save: Callable[[str], Any], name: str = MODEL) -> None:
        """The final artifact (``model.keras``; ``model.lora.h5`` in a LoRA run), written by
        ``save(path)`` atomically."""
        self._save(self.file(name), save)

    def save_checkpoint(self, name: str, save: Callable[[str], Any]) -> None:
        self._save(self.checkpoint(name), save)

    def save_sharded(self, name: str, save: Callable[[str], Any]) -> None:
        """A sharded checkpoint (a folder): ``save(path)`` runs on every process, each writing its
        own shards (a collective); the writer checks its lock first."""
        self._writing()
        save(self.checkpoint(name))

    def write_checkpoint_state(self, name: str, state: Mapping[str, Any]) -> None:
        if self._writing():
            fileio.write_json(self.checkpoint(name), dict(state))

    def remove_checkpoint(self, name: str) -> None:
        """Remove a checkpoint file, or folder (a sharded one, or what a killed save of one left)."""
        if self._writing():
            path = self.checkpoint(name)
            if name.endswith(".json") or not fileio.isdir(path):
                fileio.remove(path)
            else:
                fileio.remove_tree(path)

    # ------------------------------------------------------------------ the CSV log
    def _read_rows(self, filename: str) -> list[list[str]]:
        return damaged.log_rows(self.file(filename))[0]

    def _write_rows(self, filename: str, rows: list[list[Any]]) -> None:
        out = io.StringIO()
        csv.writer(out, lineterminator="\n").writerows(rows)
        self._write_text(filename, out.getvalue())

    def append_log(self, filename: str, epoch: int, logs: Mapping[str, Any]) -> None:
        """One row for a finished epoch (0-based ``epoch``, as Keras' CSVLogger numbers them).

        The file is rewritten whole and atomically each epoch (it holds one short row per epoch):
        a kill never leaves half a row, and the same code serves object stores, which cannot
        append. Columns are the first row's: ``epoch`` and the metric names, sorted.
        """
        if not self.writer:
            return
        rows = self._read_rows(filename)
        header = rows[0] if rows else ["epoch", *sorted(logs)]
        if not rows:
            rows = [header]
        rows.append([epoch, *(_csv_value(logs.get(key, "NA")) for key in header[1:])])
        self._write_rows(filename, rows)

    def trim_log(self, filename: str, epochs_done: int) -> str | None:
        """Keep the rows of the checkpointed epochs only, so a resume adds no duplicate row.

        Rows number epochs from 0; ``epochs_done`` counts from 1. A damaged log keeps its rows up
        to the damage, and a copy of it whole (:mod:`.damaged`); returns what to say about it.
        """
        rows, said = damaged.salvage_log(self.file(filename), keep=self.writer)
        kept = rows[:1] + [r for r in rows[1:] if int(r[0]) < epochs_done]
        if said is not None or len(kept) != len(rows):
            self._write_rows(filename, kept)
        return said

    def carry_log(self, source: RunDir, filename: str) -> None:
        """Resuming from another run directory (say, last session's read-only output): start this
        run's log from that run's, so the log stays whole."""
        if not self.writer or source.path.rstrip("/") == self.path.rstrip("/"):
            return
        if fileio.exists(source.file(filename)) and not fileio.exists(self.file(filename)):
            fileio.copy(source.file(filename), self.file(filename))

    def read_log(self, filename: str) -> list[dict[str, str]]:
        """The CSV log's rows as dicts (for summaries and listings)."""
        rows = self._read_rows(filename)
        return [dict(zip(rows[0], r, strict=False)) for r in rows[1:]] if rows else []


def _csv_value(value: Any) -> Any:
    """As Keras' CSVLogger writes a value: lists quoted as ``"[a, b]"``, numbers as they are."""
    if isinstance(value, str):
        return value
    if hasattr(value, "__len__") and not getattr(value, "ndim", 1) == 0:
        return f"[{', '.join(map(str, value))}]"
    return float(value) if hasattr(value, "item") else value


def source_run(folder: str) -> RunDir:
    """The run directory a checkpoints folder (or a run directory itself) belongs to."""
    folder = str(folder).rstrip("/")
    return RunDir(fileio.dirname(folder) if fileio.basename(folder) == CHECKPOINTS else folder)
