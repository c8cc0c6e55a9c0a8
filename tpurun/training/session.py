"""One training run: resolve, prepare the run directory, fit (:mod:`.fit`), and end it, writing what
happened (:mod:`.ending`).

Prints nothing: progress goes to the injected :class:`~tpurun.display.lines.Reporter`, problems are raised
as :class:`~tpurun.errors.TpurunError`, and the summary is returned.

(Named session.py, not train.py: ``tpurun.train`` is the public function, and a submodule of that
name would replace it on the package once imported.)
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from typing import Any

from tpurun._version import __version__
from tpurun.config import Config
from tpurun.display.reporter import Reporter
from tpurun.errors import EXIT_USER_ERROR, TpurunError
from tpurun.multihost.collectives import (
    agree_on_start,
    agree_on_stop,
    check_shared_folder,
    lost_peer,
    start_facts,
    sync_processes,
)
from tpurun.multihost.watchdog import Watchdog
from tpurun.observe import trackers
from tpurun.plan.prepare import Prepared, choose_for, prepare
from tpurun.runtime.activate import activate
from tpurun.runtime.machine import Machine, probe
from tpurun.storage import damaged
from tpurun.storage.rundir import SUMMARY, RunDir, now_iso, run_path
from tpurun.storage.summary import Summary
from tpurun.training import fit
from tpurun.training.checkpoints import resume as resume_lib
from tpurun.training.ending import Ending, conclude
from tpurun.training.job import TrainJob, TrainResult
from tpurun.training.signals import Signalled, Stop, stop_on_signals


def _inside(path: str, folder: str) -> bool:
    if "://" in path or "://" in folder:
        return path.startswith(folder.rstrip("/") + "/")
    return os.path.realpath(path).startswith(os.path.realpath(folder) + os.sep)


LOST_EXIT_DELAY_SECONDS = 2.0


def _on_lost(hosts, run: RunDir, summary: Summary):
    """What this process does once another is lost: say so, record it, and end at once. The main
    thread may be stuck in a collective, and JAX's own shutdown would wait for the lost process,
    then abort with a stack trace: so ``os._exit``."""

    def lost(message: str) -> None:
        summary.status = "failed"
        if run.begun:
            run.write_summary(summary)
        # The tracker runs end as failed meanwhile, if their servers answer in that time: an
        # exit that waits on them (MLflow's timeout is 10 s) would keep the cluster waiting.
        threading.Thread(target=trackers.end_open, args=("failed",), daemon=True).start()
        sys.stderr.write(f"error: process {hosts.process_id}: {message}\n")
        sys.stderr.flush()
        # This process ends because another did: let that one be seen to end first, so that
        # `tpurun launch` (or a cluster's scheduler) names the cause, not this consequence.
        time.sleep(LOST_EXIT_DELAY_SECONDS)
        os._exit(EXIT_USER_ERROR)

    return lost


def _unfinished_elsewhere(config: Config, run: RunDir) -> str | None:
    """The run directory this config would have beside it (``output.dir`` read from the config's
    folder), when that is not this run's and holds an unfinished run: the usual cause is running
    the same command from another working directory."""
    beside = RunDir(run_path(config.resolve_path(config.output.dir), config.name))
    if beside.path == run.path or run.exists():
        return None
    summary = beside.read_summary()
    return beside.path if summary and summary.get("status") != "completed" else None


def _new_summary(prepared: Prepared, run: RunDir, point, previous: dict) -> Summary:
    plan, data = prepared.plan, prepared.data
    state = point.state if point else {}
    best = {"monitor": plan.monitor, "value": None, "epoch": None}
    if state.get("best") is not None:
        best = {
            "monitor": state.get("monitor"),
            "value": state["best"],
            "epoch": state.get("best_epoch"),
        }
    return Summary(
        epochs_completed=int(state.get("epoch", 0)),
        epochs=prepared.config.train.epochs,
        backend=plan.backend,
        accelerator=plan.accelerator,
        distribution=plan.distribution,
        replicas=plan.replicas,
        precision=plan.precision,
        global_batch_size=plan.global_batch_size,
        per_core_batch_size=plan.per_core_batch_size,
        learning_rate=plan.learning_rate,
        steps_per_epoch=plan.steps_per_epoch,
        validation_steps=plan.validation_steps,
        steps_per_execution=plan.steps_per_execution,
        best=best,
        examples_per_sec=previous.get("examples_per_sec"),
        throughput=previous.get("throughput"),
        final_metrics=previous.get("final_metrics", {}),
        resumes=list(previous.get("resumes", [])),
        nan_restores=list(previous.get("nan_restores", [])),
        skipped_shards=[s.to_dict() for s in data.skipped],
        skipped_records=sum(s.records for s in data.skipped),
        run_dir=run.path,
        tpurun_version=__version__,
        processes=prepared.plan.num_processes,
        started=now_iso(),
    )


def run(
    config: Config,
    *,
    output: str | None = None,
    reporter: Reporter | None = None,
    restart: bool = False,
    resume: str | None = None,
    machine: Machine | None = None,
) -> dict[str, Any]:
    """Train a config end to end and return its summary (also written to ``summary.json``).

    Rerunning on the same run directory continues from its latest checkpoint, mid-epoch if that
    is where it was saved.

    Args:
        config: a validated config.
        output: overrides ``output.dir``.
        reporter: receives progress events; silent by default.
        restart: start over, moving an existing run directory aside instead of resuming it.
        resume: continue from this checkpoint (a run directory, a state file or a model file)
            instead of the run directory's own.
        machine: facts about the machine (tests inject them); probed when None.

    Raises:
        TpurunError: a problem with the config, the data, the model or the environment. An
            unexpected exception is raised as it is, after its traceback is written to the run
            directory's ``error.log`` (its path in the exception's ``tpurun_error_log``).
    """
    reporter = reporter or Reporter()
    started = time.monotonic()
    choice = choose_for(config, machine or probe())
    hosts = choice.cluster
    if not hosts.chief:
        reporter = Reporter()  # process 0 speaks for all; errors still reach stderr
    reporter.message(choice.summary, "note")
    runtime = activate(choice, config.seed)
    for warning in runtime.warnings:
        reporter.message(warning, "warn")
    output_dir = output or config.output.dir
    run_dir = RunDir(run_path(output_dir, config.name), writer=hosts.chief)
    try:
        if hosts.multi:
            check_shared_folder(output_dir, hosts)
        return _run(
            config,
            runtime,
            run_dir,
            reporter,
            started=started,
            output=output,
            restart=restart,
            resume=resume,
        )
    finally:
        run_dir.unlock()
        runtime.release()


def _run(
    config: Config,
    runtime,
    run: RunDir,
    reporter: Reporter,
    *,
    started: float,
    output: str | None,
    restart: bool,
    resume: str | None,
) -> dict[str, Any]:
    # Environment and data are checked before anything is written.
    prepared = prepare(config, runtime.choice, runtime.replicas)
    for warning in prepared.plan.warnings:
        reporter.message(warning, "warn")
    effective = prepared.effective()
    identity = resume_lib.identity(effective, prepared.plan, prepared.data.train_files)
    point = _given_point(resume, identity, run, restart)
    if point is None and not restart:
        point = _own_point(run)
        if point is not None:
            resume_lib.check_unchanged(point, identity)
    if prepared.plan.num_processes > 1:  # one config, resume point and data on every process
        agree_on_start(start_facts(effective, point), runtime.choice.cluster)
    if output is None:
        _warn_if_unfinished_elsewhere(config, run, reporter)
    _create(run, runtime, restart, reporter)
    # A damaged summary.json is said and copied aside; the new one is written from the checkpoints.
    previous, said = damaged.salvage_json(run.file(SUMMARY), keep=run.writer)
    if said is not None:
        reporter.message(f"{said} A new one is written from the checkpoints.", "warn")
    previous = previous or {}
    summary = _new_summary(prepared, run, point, previous)
    done, epochs = summary.epochs_completed, config.train.epochs
    if done > epochs or (done == epochs and run.has_model()):
        # (Exactly its epochs and no model.keras / model.lora.h5: the session that trained the
        # last one stopped before saving it; this one trains no epoch and saves it.)
        return _already_trained(run, summary, previous, reporter)
    _note_session(run, point, previous, effective, summary, reporter)
    limit = config.train.time_limit
    stop = Stop(
        deadline=started + limit if limit else None,
        agree=agree_on_stop if prepared.plan.num_processes > 1 else None,
    )
    job = TrainJob(prepared, runtime, run, point, identity, effective, summary, reporter, stop)
    ending = Ending(run, effective, summary, reporter, started)
    result = _train(job, ending)
    return conclude(job, result, ending)


def _own_point(run: RunDir):
    """The run's own resume point, found before anything is written: a run whose resume points
    are all damaged exits untouched (unless another session holds it: that is what to say)."""
    try:
        return resume_lib.latest(run)
    except resume_lib.DamagedCheckpoint:
        if run.is_locked():
            run.lock()  # raises: it names the session that holds the run
        raise


def _given_point(resume: str | None, identity: dict, run: RunDir, restart: bool):
    """``--resume``'s checkpoint, checked against this config; None without ``--resume``."""
    point = resume_lib.from_path(resume) if resume else None
    if point is not None:
        resume_lib.check_unchanged(point, identity)
        if restart and _inside(point.weights, run.path):
            raise TpurunError(
                f"--restart moves {run.path} aside, and --resume {resume} is inside it: pass one "
                "of them (to start over from that checkpoint, copy it out first)."
            )
    return point


def _warn_if_unfinished_elsewhere(config: Config, run: RunDir, reporter: Reporter) -> None:
    elsewhere = _unfinished_elsewhere(config, run)
    if elsewhere:
        reporter.message(
            f"this config has an unfinished run in {elsewhere}, but output.dir "
            f"'{config.output.dir}' is relative to the working directory, so this run is "
            f"{run.path}. To continue that one, run from {os.path.dirname(os.path.dirname(elsewhere))}"
            f" or pass --output {os.path.dirname(elsewhere)}.",
            "warn",
        )


def _create(run: RunDir, runtime, restart: bool, reporter: Reporter) -> None:
    """Make the run directory (``--restart``: move the old one aside first) on every process."""
    aside = run.create(restart=restart)
    if runtime.choice.cluster.multi:  # process 0 made (or moved aside) the run directory
        sync_processes("tpurun: run directory ready")
    if aside:
        reporter.message(f"--restart: the previous run was moved to {aside}", "note")


def _already_trained(run: RunDir, summary: Summary, previous: dict, reporter: Reporter) -> dict:
    """A run that has trained its epochs already: say so, and return its summary as it was."""
    done, epochs = summary.epochs_completed, summary.epochs
    of = f"of {epochs}" if done <= epochs else f"(more than train.epochs: {epochs})"
    reporter.message(
        f"{run.path} has already trained {done} epoch(s) {of}; raise train.epochs to train "
        "further, or pass --restart to start over.",
        "note",
    )
    summary.status = previous.get("status", "completed")
    summary.seconds = previous.get("seconds")
    result = summary.to_dict()
    reporter.finish(result)
    return result


def _note_session(
    run: RunDir, point, previous: dict, effective: dict, summary: Summary, reporter: Reporter
) -> None:
    """What this session follows: a session that died, what changed since, where it resumes."""
    if previous.get("status") == "running":  # we hold the lock now: that session died
        reporter.message(
            f"the previous session (pid {previous.get('pid', '?')} on {previous.get('host', '?')}) "
            "ended without a word: killed, or its machine stopped.",
            "note",
        )
    if point is None:
        return
    if point.fallback_note():
        reporter.message(point.fallback_note(), "warn")
    previous_config = run.read_config()
    changes = resume_lib.changed_settings(previous_config, effective)
    if changes:
        reporter.message("changed since the last session: " + "; ".join(changes[:6]), "note")
    data_changes = resume_lib.changed_data(previous_config, effective)
    if data_changes:
        reporter.message(
            "the data changed since the last session: " + "; ".join(data_changes), "warn"
        )
    epoch, step = point.position
    summary.resumes.append({"epoch": epoch, "step": step, "from": point.source, "time": now_iso()})


def _train(job: TrainJob, ending: Ending) -> TrainResult:
    """:func:`fit.train` in the signal route's training phase (and, on several hosts, under the
    watchdog); a failure leaves its status, and an unexpected one its traceback in ``error.log``."""
    hosts = job.runtime.choice.cluster
    lost = _on_lost(hosts, job.run, job.summary)
    watchdog = Watchdog(hosts, lost) if hosts.multi else contextlib.nullcontext()
    try:
        with stop_on_signals(job.stop), watchdog:
            return fit.train(job)
    except TpurunError:
        ending.finish("failed")
        raise
    except KeyboardInterrupt as exc:
        # A signal outside the training loop (Signalled) stops cleanly; a second one, at once.
        ending.finish("interrupted", at_once=not isinstance(exc, Signalled))
        raise
    except Exception as exc:
        if hosts.multi and lost_peer(exc):
            lost(
                f"another process is gone (a collective failed: {str(exc).splitlines()[0][:160]})"
                ": killed, out of memory, or its machine stopped. Rerun the same command on every "
                "host to resume from the last checkpoint."
            )
        ending.finish("failed")
        exc.tpurun_error_log = job.run.write_error(traceback.format_exc())
        raise
