"""The callback that logs a run to its experiment trackers (:mod:`tpurun.observe.trackers`).

What it promises: each epoch's metrics and figures at the global step (epochs done x steps per
epoch, TensorBoard's), the config (``config.yaml``'s) as parameters, the run directory's path, and
a resumed run continuing the same tracker run, its steps going on with none logged twice. The ids
and the last step logged are kept in the run directory's ``trackers.json``.

A tracker that cannot start, or fails later, never stops training: one line says what failed, and
that tracker is not called again in the session. Only ``observe.<name>.required: true`` makes a
tracker that cannot start an error (exit 2), before the first step.

The tracker runs end with the session, as it ended (:data:`tpurun.observe.trackers.ENDED`): a run
that completed is finished, one stopped by a signal or a time limit is killed (W&B: preempted),
one that failed or met a NaN has failed. A session that dies with its process (SIGKILL, out of
memory), or is stopped at once by a second signal, does not say so: its tracker run stays running
until a resume continues it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.display.reporter import Reporter
from tpurun.errors import EnvironmentSetupError, describe
from tpurun.observe import trackers
from tpurun.observe.tensorboard import epoch_figures
from tpurun.observe.trackers import Tracker, Unavailable, make
from tpurun.storage import damaged
from tpurun.storage.rundir import RunDir

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks

#: In the run directory: each tracker's run id, where it logs, and the last step it was given.
STATE = "trackers.json"


class TrackerLog(keras.callbacks.Callback):
    """Logs to ``config.observe.trackers``; made only for the process that writes the run
    directory, and placed where :class:`~tpurun.observe.tensorboard.TensorBoardLog` is (after
    ``Progress``, before ``RunControl``). The trackers start when it is made, before ``fit``."""

    def __init__(
        self,
        config: Config,
        run: RunDir,
        reporter: Reporter,
        *,
        steps_per_epoch: int,
        progress: Any = None,
        input_wait: Any = None,
    ):
        super().__init__()
        trackers.end_open("failed")  # a session of this process that never said how it ended
        self.run, self.reporter = run, reporter
        self.name = config.name
        self.steps_per_epoch = steps_per_epoch
        self.watch_nan = config.callbacks.on_nan != "ignore"
        self.progress, self.input_wait = progress, input_wait
        self.state: dict[str, dict] = self._read_state()
        self.required = {name: getattr(config.observe, name).required
                         for name in config.observe.trackers}  # fmt: skip
        self.trackers = [make(name, config.observe) for name in config.observe.trackers]
        self.active: list[Tracker] = []
        self.dropped: set[str] = set()  # failed: not called again in this session
        self.resumed: set[str] = set()
        self._params_logged = False
        self.open()

    # ------------------------------------------------------------------ starting and ending
    def open(self) -> None:
        """Start (or resume) every tracker; a required one that cannot start raises."""
        for tracker in self.trackers:
            self._start(tracker)
        if self.active:
            trackers.opened(self.close)

    def _start(self, tracker: Tracker) -> None:
        saved = self.state.get(tracker.name) or {}
        where = tracker.where()
        run_id = saved.get("run_id") if saved.get("where") == where else None
        try:
            started = tracker.start(run_id, name=self.name, run_dir=self.run.path)
            line = tracker.started_line()
        except Exception as exc:
            what = str(exc) if isinstance(exc, Unavailable) else describe(exc)
            if self.required.get(tracker.name):
                raise EnvironmentSetupError(
                    f"observe.trackers: {tracker.name} could not start: {what}. It is required "
                    f"(observe.{tracker.name}.required: true): fix it and run the same command "
                    f"again, or set observe.{tracker.name}.required: false to train without it "
                    "while it is down."
                ) from None
            self._say(f"{tracker.name} could not start ({what}); training goes on without it")
            self.dropped.add(tracker.name)
            return
        self.active.append(tracker)
        if started == run_id:
            self.resumed.add(tracker.name)
        else:
            self.state[tracker.name] = {"run_id": started, "where": where, "last_step": 0}
        if line:
            self.reporter.message(line, "note")

    def close(self, status: str) -> None:
        """End every tracker run still open as the session ended: ``status`` is its summary's
        (``completed``, ``interrupted``, ``failed``...; see :data:`trackers.ENDED`)."""
        trackers.closed(self.close)
        for tracker in list(self.active):
            self._call(tracker, "finishing", lambda t=tracker: t.finish(status))
        self.active = []

    def _say(self, text: str) -> None:
        self.reporter.message(f"observe.trackers: {text}", "warn")

    def _call(self, tracker: Tracker, what: str, call: Callable[[], Any]) -> bool:
        """``call()``; on a failure, one line, and the tracker is dropped for the session."""
        try:
            call()
        except Exception as exc:
            if tracker in self.active:
                self.active.remove(tracker)
            self.dropped.add(tracker.name)
            self._say(
                f"{tracker.name} failed {what} ({describe(exc)}); training goes on, "
                f"without {tracker.name} for the rest of this session"
            )
            return False
        return True

    # ------------------------------------------------------------------ state
    def _read_state(self) -> dict[str, dict]:
        """``trackers.json``'s content, empty where it is missing. A damaged one is named: the
        tracker runs it held cannot be continued, and new ones start."""
        path = self.run.file(STATE)
        data, problem = damaged.read_json(path)
        if problem:
            self._say(f"{path} is {problem}: its tracker runs cannot be continued; new ones start")
        return data if isinstance(data, dict) else {}

    def _write_state(self) -> None:
        if not self.state:
            return
        text = json.dumps(self.state, indent=1, sort_keys=True)

        def save(path: str) -> None:
            with open(path, "w") as f:
                f.write(text)

        self.run.write_file(STATE, save)

    # ------------------------------------------------------------------ hooks
    def on_train_begin(self, logs=None):
        if self._params_logged:
            return
        self._params_logged = True
        # The run's first writes (config.yaml) are made by now: the model fits the data.
        self._write_state()
        config = self.run.read_config() or {}
        for tracker in list(self.active):
            resumed = tracker.name in self.resumed
            self._call(
                tracker,
                "logging the config",
                lambda t=tracker, r=resumed: t.log_params(config, resumed=r),
            )

    def on_epoch_end(self, epoch, logs=None):
        logs = dict(logs or {})
        loss = logs.get("loss")
        if self.watch_nan and loss is not None and not math.isfinite(float(loss)):
            return  # not committed (RunControl): the epoch is redone or the run stops
        step = (epoch + 1) * self.steps_per_epoch
        metrics = {**_scalars(logs), **epoch_figures(self.progress, self.input_wait)}
        metrics["epoch"] = epoch + 1
        logged = False
        for tracker in list(self.active):
            saved = self.state[tracker.name]
            if step <= saved.get("last_step", 0):
                continue  # logged by a session that stopped before its checkpoint
            if self._call(
                tracker,
                f"logging epoch {epoch + 1}",
                lambda t=tracker: t.log_metrics(metrics, step),
            ):
                saved["last_step"] = step
                logged = True
        if logged:
            self._write_state()


def _scalars(logs: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in logs.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue  # a metric with several values
    return out
