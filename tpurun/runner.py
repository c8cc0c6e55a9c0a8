"""One training run: resolve, prepare the run directory, fit, and write what happened.

Prints nothing: progress goes to the injected :class:`~tpurun.console.Reporter`, problems are raised
as :class:`~tpurun.errors.TpurunError`, and the summary is returned.

(Named runner.py, not train.py: ``tpurun.train`` is the public function, and a submodule of that
name would replace it on the package once imported.)
"""

from __future__ import annotations

import os
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tpurun import __version__
from tpurun import resume as resume_lib
from tpurun.config import Config, DataConfig
from tpurun.console import Reporter
from tpurun.errors import DataError, Interrupted, ModelError, TpurunError
from tpurun.fileio import read_json, save_atomically, write_json
from tpurun.plan import Plan, make_plan
from tpurun.runtime import Machine, Runtime, activate, choose, probe
from tpurun.stopping import Stop, StopNow, stop_on_signals

SUMMARY = "summary.json"
MODEL = "model.keras"
CHECKPOINTS = "checkpoints"
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
        (path / CHECKPOINTS).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TpurunError(
            f"output.dir: cannot create {path}: {exc.strerror}. Choose another with --output."
        ) from None
    if not os.access(path, os.W_OK):
        raise TpurunError(f"output.dir: {path} is not writable. Choose another with --output.")
    return path


def _new_summary(plan: Plan, run_dir: Path, epochs: int, point, previous: dict) -> dict:
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
        "skipped_shards": [],
        "skipped_records": 0,
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
    identity = resume_lib.identity(effective, {"global_batch_size": plan.global_batch_size,
                                               "precision": plan.precision})  # fmt: skip
    point = resume_lib.from_path(resume) if resume else None
    if point is not None:
        resume_lib.check_unchanged(point, identity)
    run_dir = _run_directory(Path(output or config.output.dir) / config.name, restart, reporter)
    ckpt_dir = run_dir / CHECKPOINTS
    if point is None:
        point = resume_lib.latest(ckpt_dir)
        if point is not None:
            resume_lib.check_unchanged(point, identity)
    previous = read_json(run_dir / SUMMARY) or {}
    summary = _new_summary(plan, run_dir, epochs, point, previous)
    summary["skipped_shards"] = [s.to_dict() for s in prepared.skipped]
    summary["skipped_records"] = sum(s.records for s in prepared.skipped)
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
        before = yaml.safe_load(config_file.read_text()) if config_file.exists() else None
        changes = resume_lib.changed_settings(before, effective)
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
        config_file.write_text(
            "# Written by tpurun: the config as run, with defaults filled in, and the values derived\n"
            "# on this machine under `derived` (ignored when this file is loaded again).\n"
            + yaml.safe_dump(effective, sort_keys=False)
        )
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
            model, progress, checkpoint = _train(
                prepared, run_dir, point, identity, reporter, stop, summary, begin
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
            f"input values. The last good checkpoint is in {ckpt_dir}; callbacks.on_nan: restore "
            "reloads it with a lower learning rate and goes on."
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


def _cache(config: Config, run_dir: Path, split: str) -> str | None:
    """``data.cache`` for one split: "" keeps records in memory, a path prefix on disk."""
    cache = config.data.cache
    if cache is None:
        return None
    if cache == "memory":
        return ""
    Path(cache).parent.mkdir(parents=True, exist_ok=True)
    return f"{cache}-{split}"


def _train(
    prepared: Prepared, run_dir: Path, point, identity: dict, reporter: Reporter, stop: Stop,
    summary: dict, begin,
):  # fmt: skip
    """Build datasets, model and callbacks; restore the resume point if any; fit to the end.

    With ``callbacks.on_nan: restore``, a NaN loss reloads the latest checkpoint with the learning
    rate cut, and training goes on from there (as Model Garden's loss recovery does).
    """
    import tensorflow as tf

    from tpurun import callbacks as cbs
    from tpurun.data import pipeline
    from tpurun.model import build_model, compile_model

    config, plan, runtime = prepared.config, prepared.plan, prepared.runtime

    def train_data(epoch: int, step: int):
        """The training stream from a position: the same batches an unbroken run would see."""
        return pipeline.make_dataset(
            plan.train_files, prepared.data, plan.global_batch_size, training=True,
            seed=config.seed, start_record=(epoch * plan.steps_per_epoch + step) * plan.global_batch_size,
            records_per_pass=plan.train_records, cache=_cache(config, run_dir, "train"),
        )  # fmt: skip

    val_ds = None
    if plan.validation_files:
        val_ds = pipeline.make_dataset(
            plan.validation_files, prepared.data, plan.global_batch_size, training=False,
            take_batches=plan.validation_steps, repeat_eval=runtime.strategy is not None,
            cache=_cache(config, run_dir, "validation"),
        )  # fmt: skip
    with runtime.scope():
        model = build_model(config, plan.backend)
        compile_model(model, config, plan)
    callbacks, progress, checkpoint = cbs.build_callbacks(
        config, plan, str(run_dir), reporter, stop, identity
    )

    def sample():
        return next(iter(train_data(0, 0).take(1)))[0]

    log = run_dir / config.callbacks.csv_log.filename if config.callbacks.csv_log else None
    if point is not None:
        _restore(model, sample, point.weights, runtime, str(point.source))
        checkpoint.restore(point.state, str(point.folder))
        _apply_lr_scale(model, config, plan, checkpoint.lr_scale, reset_float=False)
        if point.state.get("warm_start"):
            reporter.message(f"starting from the weights in {point.source} (no resume state beside "
                             "it: epoch 1, fresh optimizer position)", "note")  # fmt: skip
        else:
            reporter.message(point.describe(), "note")

    def on_train_begin(logs=None) -> None:
        # Keras has checked model and data against each other by now (symbolic build): write.
        if log is not None and point is not None:
            resume_lib.carry_log(point, run_dir, log.name)
        if log is not None:  # rows past the resume point are redone; none at all on a fresh run
            resume_lib.trim_csv(log, point.position[0] if point is not None else 0)
        begin()
        if config.callbacks.on_nan == "restore" and checkpoint.position == (0, 0):
            checkpoint.save_latest(0, 0, "start")  # something to go back to before epoch 1

    once = _once(on_train_begin)
    callbacks = [cbs.keras.callbacks.LambdaCallback(on_train_begin=once), *callbacks]
    reporter.start(plan, str(run_dir), config.train.epochs, checkpoint.position[0])
    # Under a tf.distribute strategy the validation set repeats and needs its step count; elsewhere
    # it is finite and Keras reads it to the end (see pipeline.make_dataset).
    val_steps = plan.validation_steps if runtime.strategy is not None else None
    while True:
        try:
            _fit_from(model, train_data, val_ds, val_steps, plan, config.train.epochs, checkpoint,
                      progress, callbacks)  # fmt: skip
        except tf.errors.DataLossError as exc:
            raise _damaged_while_training(prepared, exc) from None
        except ValueError as exc:
            if int(model.optimizer.iterations.numpy()) > 0:
                raise
            # Before the first step, a ValueError is the model not fitting the data's shapes.
            raise ModelError(_misfit(exc, model, config)) from None
        restores = summary["nan_restores"]
        if stop.nan_at is None or config.callbacks.on_nan != "restore":
            break
        if len(restores) >= config.callbacks.max_nan_restores:
            break
        back = resume_lib.latest(run_dir / CHECKPOINTS)
        if back is None:
            break
        epoch, step = stop.nan_at
        _restore(model, sample, back.weights, runtime, back.source)
        checkpoint.restore(back.state, str(back.folder))
        checkpoint.lr_scale *= config.callbacks.nan_lr_factor
        _apply_lr_scale(model, config, plan, checkpoint.lr_scale, reset_float=True)
        restores.append({"epoch": epoch, "step": step, "restored_to": list(back.position),
                         "lr_scale": checkpoint.lr_scale})  # fmt: skip
        reporter.message(
            f"NaN loss at epoch {epoch}, step {step}: {back.describe()} with the learning rate "
            f"x{checkpoint.lr_scale:g} (restore {len(restores)} of "
            f"{config.callbacks.max_nan_restores})",
            "warn",
        )
        stop.nan_at = stop.cut_at = None
    return model, progress, checkpoint


def _once(fn):
    """``fn`` on its first call only (fit runs more than once per run)."""
    done = []

    def wrapper(*args, **kwargs):
        if not done:
            done.append(True)
            fn(*args, **kwargs)

    return wrapper


def _damaged_while_training(prepared: Prepared, exc: Exception) -> DataError:
    """TF's DataLossError does not say which file it was reading: find it, and say what to do."""
    from tpurun.data import pipeline

    files = prepared.plan.train_files + prepared.plan.validation_files
    found = pipeline.find_corrupt(files, prepared.data.compression)
    if not found:
        first = (getattr(exc, "message", "") or str(exc)).strip().splitlines()[0]
        return DataError(f"reading the training data failed: {first}")
    if not prepared.data.skip_corrupt:
        return pipeline.corrupt_error(found)
    # Damaged after the run checked it (a copy still in progress?). The verdict is remembered, so
    # the rerun leaves the file out.
    return DataError(
        f"{found[0].path}: damaged while training ({found[0].problem()}). Run the same command "
        "again: data.skip_corrupt leaves it out, and training continues from the last checkpoint."
    )


def _fit_from(model, train_data, val_ds, val_steps, plan: Plan, epochs: int, checkpoint, progress,
              callbacks: list) -> None:  # fmt: skip
    """Fit from the checkpoint's position to ``epochs``.

    Keras can only start at an epoch's beginning, so a mid-epoch resume first fits the rest of that
    epoch as a short epoch of its own (the callbacks count its steps from the resume point and
    restore its running metrics), then the remaining epochs.
    """
    epoch, step = checkpoint.position
    spe = plan.steps_per_execution
    if step >= plan.steps_per_epoch:  # the epoch got shorter since (more replicas, less data)
        epoch, step = epoch + 1, 0
    step -= step % spe  # a changed steps_per_execution: redo the part of an execution
    progress.resume_at = checkpoint.resume_at = (epoch, step)
    if step:
        _fit(model, train_data(epoch, step), val_ds, val_steps, plan.steps_per_epoch - step,
             epoch + 1, epoch, callbacks)  # fmt: skip
        if model.stop_training:
            return
        epoch += 1
    if epoch < epochs:
        _fit(model, train_data(epoch, 0), val_ds, val_steps, plan.steps_per_epoch, epochs, epoch,
             callbacks)  # fmt: skip


def _misfit(exc: Exception, model, config: Config) -> str:
    """Keras' shape error in one line: the line that names shapes (its first often says only
    "Exception encountered when calling Functional.call()"), and the output/target counts."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [
        line for line in lines
        if re.search(r"shape|arity|expected", line, re.I) and not line.startswith("Exception encountered")
    ]  # fmt: skip
    detail = (named or lines or [type(exc).__name__])[0]
    outputs = len(getattr(model, "outputs", None) or [])
    targets = len(DataConfig.names(config.data.targets))
    counts = ""
    if outputs and outputs != targets:
        counts = f" The model has {outputs} outputs and data.targets names {targets} feature(s)."
    return f"the model does not fit the data (data.inputs / data.targets): {detail}{counts}"


def _fit(model, train_ds, val_ds, val_steps, steps: int, epochs: int, initial_epoch: int,
         callbacks: list) -> Any:  # fmt: skip
    """``model.fit``, with data problems turned into clear errors, and a saved stop ended."""
    import warnings

    import tensorflow as tf

    try:
        with warnings.catch_warnings():
            # A finite validation set "runs out", on purpose, at the end of each validation pass.
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            return model.fit(
                train_ds,
                epochs=epochs,
                initial_epoch=initial_epoch,
                steps_per_epoch=steps,
                validation_data=val_ds,
                validation_steps=val_steps,
                callbacks=callbacks,
                shuffle=False,  # the pipeline shuffles files and records itself
                verbose=0,
            )
    except StopNow:
        # A stop mid-epoch, saved: Keras (JAX) left its last step's state unsynced; write it to
        # the variables now, or a later sync would overwrite what a NaN restore loads into them.
        getattr(model, "jax_state_sync", lambda: None)()
        return None
    except tf.errors.InvalidArgumentError as exc:
        first = (exc.message or str(exc)).strip().splitlines()[0]
        raise DataError(f"reading the training data failed: {first}") from None


def _restore(model, sample, weights: Path | None, runtime: Runtime, source: str) -> None:
    """Build the model and optimizer variables, then load the weights and optimizer state."""
    with runtime.scope():
        if not model.built:
            model(sample())
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        if weights is None:
            return
        try:
            model.load_weights(str(weights))
        except Exception as exc:  # Keras raises ValueError, KeyError, OSError... for a misfit file
            raise ModelError(
                f"{source}: cannot load {weights.name} into this model: {type(exc).__name__}: "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            ) from None


def _apply_lr_scale(model, config: Config, plan: Plan, scale: float, reset_float: bool) -> None:
    """Cut the learning rate after a NaN restore (``scale`` = nan_lr_factor ** restores).

    A schedule is rebuilt, scaled, and the step function retraced (the schedule is compiled into
    it). A plain learning rate is an optimizer variable saved with the checkpoint: it already holds
    the cut when resumed, and is cut once more, relative to the checkpoint's, after a restore.
    """
    from tpurun.model import learning_rate_schedule

    if scale == 1.0:
        return
    schedule = learning_rate_schedule(config, plan, scale)
    if isinstance(schedule, float):
        if reset_float:
            model.optimizer.learning_rate = float(model.optimizer.learning_rate) * (
                config.callbacks.nan_lr_factor
            )
        return
    model.optimizer.learning_rate = schedule
    model.train_function = None
