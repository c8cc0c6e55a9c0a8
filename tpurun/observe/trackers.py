"""Experiment trackers (MLflow, W&B) behind one small interface, their SDKs imported only when
a run names them (``observe.trackers``).

A :class:`Tracker` starts (or resumes) a tracker run, takes the config as parameters once, each
epoch's metrics at a global step, and finishes with the way the session ended (:data:`ENDED`).
:class:`tpurun.observe.tracker_log.TrackerLog` drives them from the training loop and keeps a
tracker that fails from ever stopping it; :func:`end_open` ends its tracker runs when the session
ends, however it ends.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

from tpurun.config.observe_config import MlflowConfig, WandbConfig
from tpurun.errors import describe

#: What each tracker's SDK is installed with (pip).
INSTALL = {"mlflow": "mlflow-skinny", "wandb": "wandb"}

#: MLflow retries a server that does not answer for minutes (7 retries, backoff 2) and waits 120 s
#: for each answer: a training run tries it briefly instead, unless these are set already.
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


#: How each end of a session (``summary.json``'s status) is given to the trackers: MLflow's run
#: status, and W&B's exit code (tpurun's own: 0, 3 for a stop, which W&B also marks as preempted;
#: any other code W&B shows as failed). A session that stopped (a signal, ``train.time_limit``)
#: is not finished: its run goes on in the same tracker run when it is resumed.
ENDED = {
    "completed": ("FINISHED", 0),
    "stopped_early": ("FINISHED", 0),
    "interrupted": ("KILLED", 3),
    "nan": ("FAILED", 1),
    "failed": ("FAILED", 1),
}

#: What ends this process's tracker runs still open: each open
#: :class:`~tpurun.observe.tracker_log.TrackerLog`'s ``close``, called with the session's status.
_open: list[Callable[[str], None]] = []


def opened(close: Callable[[str], None]) -> None:
    """Register the tracker runs of a session, to be ended by :func:`end_open`."""
    if close not in _open:
        _open.append(close)


def closed(close: Callable[[str], None]) -> None:
    if close in _open:
        _open.remove(close)


def end_open(status: str) -> None:
    """End every tracker run of this process still open, as a session ended with ``status``
    (see :data:`ENDED`). :meth:`tpurun.training.ending.Ending.finish` calls it for every end of a
    session; a new session calls it first with ``failed`` for any left open."""
    for close in list(_open):
        close(status)


class Unavailable(Exception):
    """A tracker's SDK is not installed, or its store cannot be used; the text says the fix."""


class Tracker:
    """One experiment tracker. Every method may raise: the caller turns that into one line."""

    name = ""

    def where(self) -> str:
        """Where its runs go (a store, a project): a run id is resumed only in the same place."""
        raise NotImplementedError

    def start(self, run_id: str | None, *, name: str, run_dir: str) -> str:
        """Start a tracker run, or resume ``run_id``; returns the run's id."""
        raise NotImplementedError

    def log_params(self, config: Mapping[str, Any], *, resumed: bool) -> None:
        """The resolved config (nested), once per session."""
        raise NotImplementedError

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        raise NotImplementedError

    def finish(self, status: str) -> None:
        """End the run as a session that ended with ``status`` (a key of :data:`ENDED`)."""
        raise NotImplementedError

    def started_line(self) -> str | None:
        """One line to say where the run is, once started (None: nothing worth saying)."""
        return None


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> ``{"a.b.c": value}``; lists stay values."""
    if not isinstance(data, Mapping):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


# ------------------------------------------------------------------------------------ MLflow
_MLFLOW_NAME = re.compile(r"[^/\w.\- ]")  # the characters MLflow refuses in a key


def _mlflow_key(key: str) -> str:
    return _MLFLOW_NAME.sub("_", key)[:250]  # MAX_ENTITY_KEY_LENGTH


def _mlflow_value(value: Any, limit: int = 6000) -> str:  # MAX_PARAM_VAL_LENGTH
    text = "null" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _local_folder(uri: str | None) -> bool:
    """A folder store: a path or a ``file:`` URI (not ``sqlite:``, ``http:``, ``databricks``)."""
    if uri is None:
        return False
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
    return scheme is None or scheme.group(1) == "file" or len(scheme.group(1)) == 1  # C:\...


class MlflowTracker(Tracker):
    """MLflow through ``MlflowClient`` (no fluent API state): the run is tagged with the run
    directory (``tpurun.run_dir``), and a resume reopens the same run id."""

    name = "mlflow"

    def __init__(self, options: MlflowConfig):
        self.options = options
        self.uri = options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.client: Any = None
        self.run_id = ""

    def where(self) -> str:
        return f"{self.uri or 'default'} {self._experiment_name() or ''}".strip()

    def _experiment_name(self) -> str | None:
        return self.options.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME")

    def _client(self) -> Any:
        for key, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if _local_folder(self.uri):
            # mlflow-skinny's only local store: MLflow 3 refuses a folder unless this is set
            # ("maintenance mode"); naming a folder in the config is the user's choice of it.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        try:
            import mlflow
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise Unavailable(
                f"cannot import mlflow ({describe(exc)}): pip install mlflow-skinny"
            ) from None
        uri = self.uri or mlflow.get_tracking_uri()  # MLflow 3's default: sqlite:///mlflow.db
        if uri.startswith("sqlite:"):
            try:
                import sqlalchemy  # noqa: F401
            except ImportError:
                raise Unavailable(
                    f"its store is {uri} (SQLite), which needs the full mlflow package "
                    "(pip install mlflow); or set observe.mlflow.tracking_uri to a folder "
                    "(file:mlruns) or a server"
                ) from None
        return MlflowClient(tracking_uri=uri)

    def _experiment_id(self) -> str:
        name = self._experiment_name()
        if name is None:
            return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"  # MLflow's Default
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def start(self, run_id: str | None, *, name: str, run_dir: str) -> str:
        self.client = self._client()
        if run_id:
            self.client.update_run(run_id, status="RUNNING")  # raises if the store lacks it
            self.run_id = run_id
        else:
            run = self.client.create_run(
                self._experiment_id(), run_name=name, tags={"tpurun.run_dir": run_dir}
            )
            self.run_id = run.info.run_id
        return self.run_id

    def started_line(self) -> str | None:
        experiment = self.client.get_run(self.run_id).info.experiment_id
        return f"mlflow: run {self.run_id} in experiment {experiment} of {self.client.tracking_uri}"

    def log_params(self, config: Mapping[str, Any], *, resumed: bool) -> None:
        from mlflow.entities import Param, RunTag

        flat = {_mlflow_key(k): _mlflow_value(v) for k, v in flatten(config).items()}
        before = self.client.get_run(self.run_id).data.params if resumed else {}
        # MLflow never changes a logged parameter: a value changed on a resume is a tag.
        params = [Param(k, v) for k, v in flat.items() if k not in before]
        tags = [
            RunTag(_mlflow_key(f"resumed_with.{k}"), _mlflow_value(v, 8000))
            for k, v in flat.items()
            if k in before and before[k] != v
        ]
        for i in range(0, max(len(params), len(tags)), 100):  # MAX_PARAMS_TAGS_PER_BATCH
            self.client.log_batch(self.run_id, params=params[i : i + 100], tags=tags[i : i + 100])

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_mlflow_key(k), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def finish(self, status: str) -> None:
        self.client.set_terminated(self.run_id, ENDED[status][0])


# --------------------------------------------------------------------------------------- W&B
class WandbTracker(Tracker):
    """Weights & Biases: the config as the run's config, metrics at ``step=`` the global step, the
    run directory as ``tpurun.run_dir`` in the config. Its files go into the run directory
    (``wandb/``) when that is local and ``WANDB_DIR`` is unset; a resume reopens the run id
    (``resume="allow"``; offline, each session is a folder of its own with that id, and
    ``wandb sync`` puts them together)."""

    name = "wandb"

    def __init__(self, options: WandbConfig):
        self.options = options
        self.run: Any = None

    def where(self) -> str:
        entity = self.options.entity or os.environ.get("WANDB_ENTITY") or ""
        return f"{entity}/{self.options.project or os.environ.get('WANDB_PROJECT') or ''}"

    def start(self, run_id: str | None, *, name: str, run_dir: str) -> str:
        try:
            import wandb
        except ImportError as exc:
            raise Unavailable(f"cannot import wandb ({describe(exc)}): pip install wandb") from None
        folder = None
        if "://" not in run_dir and not os.environ.get("WANDB_DIR"):
            folder = run_dir
        # console="off": W&B would otherwise wrap stdout and stderr (the live view's), and
        # silent: its banner lines; started_line says what matters.
        settings = wandb.Settings(console="off", silent=True)
        self.run = wandb.init(
            project=self.options.project,
            entity=self.options.entity,
            mode=self.options.mode,
            id=run_id,
            resume="allow" if run_id else None,
            name=name,
            dir=folder,
            config={"tpurun.run_dir": run_dir},
            settings=settings,
            reinit="create_new",
        )
        return self.run.id

    def started_line(self) -> str | None:
        if self.run.offline:
            folder = os.path.dirname(self.run.dir)  # <...>/wandb/offline-run-<time>-<id>
            return f"wandb: offline run {self.run.id} in {folder}; upload it with `wandb sync {folder}`"
        url = getattr(self.run, "url", None)
        return f"wandb: run {self.run.id} at {url}" if url else None

    def log_params(self, config: Mapping[str, Any], *, resumed: bool) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def finish(self, status: str) -> None:
        code = ENDED[status][1]
        if status == "interrupted":
            self.run.mark_preempting()  # stopped to be resumed: W&B's "preempted"
        self.run.finish(exit_code=code)


def make(name: str, observe: Any) -> Tracker:
    """The tracker ``observe.trackers`` names, with its options from ``observe.<name>``."""
    return {"mlflow": MlflowTracker, "wandb": WandbTracker}[name](getattr(observe, name))
