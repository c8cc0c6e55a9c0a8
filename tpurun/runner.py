"""One training run: resolve, prepare the run directory, fit, and write what happened.

Prints nothing: progress goes to the injected :class:`~tpurun.console.Reporter`, problems are raised
as :class:`~tpurun.errors.TpurunError`, and the summary is returned.

(Named runner.py, not train.py: ``tpurun.train`` is the public function, and a submodule of that
name would replace it on the package once imported.)
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tpurun import __version__, training
from tpurun import resume as resume_lib
from tpurun.config import Config, DataConfig
from tpurun.console import Reporter
from tpurun.errors import Interrupted, TpurunError
from tpurun.fileio import read_json, save_atomically, write_json
from tpurun.plan import Plan, make_plan
from tpurun.process import Runtime, activate
from tpurun.runtime import Machine, choose, probe
from tpurun.stopping import Stop, stop_on_signals

SUMMARY = "summary.json"
MODEL = "model.keras"
ERROR_LOG = "error.log"


@dataclass
class Prepared:
    """A config resolved against this machine and its data: everything but the model."""

    config: Config
    runtime: Runtime
    plan: Plan
    data: DataConfig  # the effective data section: features filled in, compression known
    skipped: list = field(default_factory=list)  # corrupt shards left out (data.skip_corrupt)


def prepare(
    config: Config, reporter: Reporter | None = None, machine: Machine | None = None
) -> Prepared:
    """Choose the runtime, set the process up, find and check the data, derive the plan."""
    from tpurun.data.resolve import resolve

    reporter = reporter or Reporter()
    choice = choose(config.runtime, config.train.steps_per_execution, machine or probe())
    reporter.message(choice.summary, "note")
    runtime = activate(choice, config.seed)
    resolved = resolve(config)
    plan = make_plan(config, choice, runtime.replicas, resolved)
    skipped = resolved.skipped
    for warning in plan.warnings + [s.describe() for s in skipped]:
        reporter.message(warning, "warn")
    return Prepared(config, runtime, plan, resolved.data, skipped)


def resolved_config(prepared: Prepared) -> dict[str, Any]:
    """The config as run, plus a ``derived`` section; loads back as a config.

    Defaults are filled in, and the data section is the effective one (features read from a schema
    file, compression detected), so the file describes the run on its own.
    """
    config = prepared.config.to_dict()
    config["data"] = prepared.data.model_dump(mode="json")
    return {**config, "derived": prepared.plan.to_dict()}


def _read_yaml(path: Path) -> dict | None:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def _examples_per_sec(rates: list[float]) -> float:
    # The first epoch includes compilation; leave it out when there is more than one.
    steady = rates[1:] or rates
    return sum(steady) / len(steady) if steady else 0.0


def _run_directory(path: Path, restart: bool, reporter: Reporter) -> Path:
    if restart and path.exists():
        aside = path.with_name(f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}")
        path.rename(aside)
        reporter.message(f"--restart: the previous run was moved to {aside}", "note")
    try:
        (path / resume_lib.CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TpurunError(
            f"output.dir: cannot create {path}: {exc.strerror}. Choose another with --output."
        ) from None
    if not os.access(path, os.W_OK):
        raise TpurunError(f"output.dir: {path} is not writable. Choose another with --output.")
    return path


def _new_summary(prepared: Prepared, run_dir: Path, point, previous: dict) -> dict:
    plan, epochs = prepared.plan, prepared.config.train.epochs
    state = point.state if point else {}
    best = {"monitor": plan.monitor, "value": None, "epoch": None}
    if state.get("best") is not None:
        best = {
            "monitor": state.get("monitor"),
            "value": state["best"],
            "epoch": state.get("best_epoch"),
        }
    return {
        "status": "running",
        "epochs_completed": int(state.get("epoch", 0)),
        "epochs": epochs,
        "backend": plan.backend,
        "accelerator": plan.accelerator,
        "distribution": plan.distribution,
        "replicas": plan.replicas,
        "precision": plan.precision,
        "global_batch_size": plan.global_batch_size,
        "per_core_batch_size": plan.per_core_batch_size,
        "learning_rate": plan.learning_rate,
        "steps_per_epoch": plan.steps_per_epoch,
        "validation_steps": plan.validation_steps,
        "steps_per_execution": plan.steps_per_execution,
        "best": best,
        "examples_per_sec": previous.get("examples_per_sec"),
        "seconds": None,
        "time_to_first_step": None,
        "epoch_seconds": [],
        "final_metrics": previous.get("final_metrics", {}),
        "resumes": list(previous.get("resumes", [])),
        "nan_restores": list(previous.get("nan_restores", [])),
        "skipped_shards": [s.to_dict() for s in prepared.skipped],
        "skipped_records": sum(s.records for s in prepared.skipped),
        "run_dir": str(run_dir),
        "tpurun_version": __version__,
    }


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
        TpurunError: a problem with the config, the data, the model or the environment.
    """
    reporter = reporter or Reporter()
    started = time.monotonic()
    # Environment and data are checked before anything is written.
    prepared = prepare(config, reporter, machine)
    plan, epochs = prepared.plan, config.train.epochs
    effective = resolved_config(prepared)
    identity = resume_lib.identity(effective, plan)
    run_path = Path(output or config.output.dir) / config.name
    point = resume_lib.from_path(resume) if resume else None
    if point is not None:
        resume_lib.check_unchanged(point, identity)
        if restart and point.weights.resolve().is_relative_to(run_path.resolve()):
            raise TpurunError(
                f"--restart moves {run_path} aside, and --resume {resume} is inside it: pass one "
                "of them (to start over from that checkpoint, copy it out first)."
            )
    run_dir = _run_directory(run_path, restart, reporter)
    ckpt_dir = run_dir / resume_lib.CHECKPOINTS
    if point is None:
        point = resume_lib.latest(ckpt_dir)
        if point is not None:
            resume_lib.check_unchanged(point, identity)
    previous = read_json(run_dir / SUMMARY) or {}
    summary = _new_summary(prepared, run_dir, point, previous)
    if summary["epochs_completed"] >= epochs and (run_dir / MODEL).exists():
        reporter.message(
            f"{run_dir} has already trained {summary['epochs_completed']} epoch(s) of {epochs}; "
            "raise train.epochs to train further, or pass --restart to start over.",
            "note",
        )
        summary.update(status=previous.get("status", "completed"), seconds=previous.get("seconds"))
        reporter.finish(summary)
        return summary

    config_file = run_dir / "config.yaml"
    if point is not None:
        changes = resume_lib.changed_settings(_read_yaml(config_file), effective)
        if changes:
            reporter.message("changed since the last session: " + "; ".join(changes[:6]), "note")
        epoch, step = point.position
        summary["resumes"].append(
            {"epoch": epoch, "step": step, "from": point.source, "time": time.strftime("%FT%T%z")}
        )
    begun = False

    def begin() -> None:
        """The run's first writes, made once Keras has checked that the model fits the data: a
        config, model or data problem found before that leaves the run directory as it was."""
        nonlocal begun
        if begun:
            return
        begun = True
        text = (
            "# Written by tpurun: the config as run, with defaults filled in, and the values derived\n"
            "# on this machine under `derived` (ignored when this file is loaded again).\n"
            + yaml.safe_dump(effective, sort_keys=False)
        )
        save_atomically(str(config_file), lambda tmp: Path(tmp).write_text(text))
        write_json(run_dir / SUMMARY, summary)

    def finish(status: str) -> dict[str, Any]:
        summary["status"] = status
        summary["seconds"] = round(time.monotonic() - started, 3)
        if begun or status in ("completed", "stopped_early"):
            begin()
            write_json(run_dir / SUMMARY, summary)
        return summary

    limit = config.train.time_limit
    stop = Stop(deadline=started + limit if limit else None)
    try:
        with stop_on_signals(stop):
            model, progress, checkpoint = training.train(
                prepared, run_dir, point, identity, reporter, stop, summary["nan_restores"], begin
            )
    except TpurunError:
        finish("failed")
        raise
    except KeyboardInterrupt:
        finish("interrupted")
        raise
    except Exception:
        finish("failed")
        (run_dir / ERROR_LOG).write_text(traceback.format_exc())  # new information: always kept
        raise
    finally:
        prepared.runtime.release()

    done, step = checkpoint.position
    summary["epochs_completed"] = done
    summary["epoch_seconds"] = [round(s, 3) for s in progress.epoch_seconds]
    summary["examples_per_sec"] = round(_examples_per_sec(progress.epoch_rates), 1)
    if progress.first_step_seconds is not None:
        summary["time_to_first_step"] = round(progress.first_step_seconds, 3)
    summary["final_metrics"] = checkpoint.last_logs
    if checkpoint.save_best:
        summary["best"] = {
            "monitor": checkpoint.monitor,
            "value": checkpoint.best,
            "epoch": checkpoint.best_epoch,
        }
    if stop.nan_at is not None:
        epoch, nan_step = stop.nan_at
        finish("nan")
        tried = (
            f" after {len(summary['nan_restores'])} restore(s) (callbacks.max_nan_restores)"
            if config.callbacks.on_nan == "restore"
            else ""
        )
        raise TpurunError(
            f"training stopped at epoch {epoch}, step {nan_step}: the loss became NaN or Inf{tried}. "
            "Likely causes: a learning rate too high for this global batch (lower "
            "train.learning_rate.base), float16 overflow (use mixed_bfloat16 or float32), or bad "
            "input values (a partial last batch is ruled out: tpurun drops it). The last good "
            f"checkpoint is in {ckpt_dir}; callbacks.on_nan: restore reloads it with a lower "
            "learning rate and goes on."
        )
    if stop.reason is not None and done < epochs:  # a stop after the last step is just the end
        where = f"epoch {done + 1}, step {step}" if step else f"the end of epoch {done}"
        finish("interrupted")
        raise Interrupted(
            f"{stop.reason}: stopped at {where}; the checkpoint is saved in {ckpt_dir}. Run the same "
            "command again to continue."
        )
    save_atomically(str(run_dir / MODEL), model.save)
    result = finish("completed" if done >= epochs else "stopped_early")
    reporter.finish(result)
    return result
