"""One training run: resolve, prepare the run directory, fit, and write what happened.

Prints nothing: progress goes to the injected :class:`~tpurun.console.Reporter`, problems are raised
as :class:`~tpurun.errors.TpurunError`, and the summary is returned.

(Named runner.py, not train.py: ``tpurun.train`` is the public function, and a submodule of that
name would replace it on the package once imported.)
"""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tpurun import __version__
from tpurun.config import Config, DataConfig
from tpurun.console import Reporter
from tpurun.errors import DataError, Interrupted, ModelError, TpurunError
from tpurun.fileio import read_json, save_atomically, write_json
from tpurun.plan import Plan, make_plan
from tpurun.runtime import Machine, Runtime, activate, choose, probe

SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
ERROR_LOG = "error.log"


@dataclass
class Prepared:
    """A config resolved against this machine and its data: everything but the model."""

    config: Config
    runtime: Runtime
    plan: Plan
    data: DataConfig  # the effective data section: features filled in, compression known


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
    for warning in plan.warnings:
        reporter.message(warning, "warn")
    return Prepared(config, runtime, plan, resolved.data)


def resolved_config(prepared: Prepared) -> dict[str, Any]:
    """The config as run, plus a ``derived`` section; loads back as a config.

    Defaults are filled in, and the data section is the effective one (features read from a schema
    file, compression detected), so the file describes the run on its own.
    """
    config = prepared.config.to_dict()
    config["data"] = prepared.data.model_dump(mode="json")
    return {**config, "derived": prepared.plan.to_dict()}


def _trim_csv(path: Path, epochs_done: int) -> None:
    """Keep the rows of the checkpointed epochs only, so a resume adds no duplicate row.

    Keras' CSVLogger numbers epochs from 0; ``epochs_done`` counts from 1.
    """
    if not path.exists():
        return
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    if not rows:
        return
    kept = [rows[0]] + [r for r in rows[1:] if r and r[0].isdigit() and int(r[0]) < epochs_done]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        csv.writer(f).writerows(kept)
    tmp.replace(path)


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


def _new_summary(
    plan: Plan, run_dir: Path, epochs: int, state: dict | None, previous: dict
) -> dict:
    initial_epoch = int(state["epoch"]) if state else 0
    best = {"monitor": plan.monitor, "value": None, "epoch": None}
    if state:
        best = {
            "monitor": state.get("monitor"),
            "value": state.get("best"),
            "epoch": state.get("best_epoch"),
        }
    resumes = list(previous.get("resumed_from_epoch", []))
    if initial_epoch and initial_epoch < epochs:
        resumes.append(initial_epoch)
    return {
        "status": "running",
        "epochs_completed": initial_epoch,
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
        "resumed_from_epoch": resumes,
        "run_dir": str(run_dir),
        "tpurun_version": __version__,
    }


def run(
    config: Config,
    *,
    output: str | None = None,
    reporter: Reporter | None = None,
    restart: bool = False,
    machine: Machine | None = None,
) -> dict[str, Any]:
    """Train a config end to end and return its summary (also written to ``summary.json``).

    Rerunning on the same run directory continues from its latest checkpoint.

    Args:
        config: a validated config.
        output: overrides ``output.dir``.
        reporter: receives progress events; silent by default.
        restart: start over, moving an existing run directory aside instead of resuming it.
        machine: facts about the machine (tests inject them); probed when None.

    Raises:
        TpurunError: a problem with the config, the data, the model or the environment.
    """
    reporter = reporter or Reporter()
    started = time.monotonic()
    # Environment and data are checked before anything is written.
    prepared = prepare(config, reporter, machine)
    plan, epochs = prepared.plan, config.train.epochs
    run_dir = _run_directory(Path(output or config.output.dir) / config.name, restart, reporter)
    ckpt_dir = run_dir / CHECKPOINTS

    from tpurun import callbacks as cbs  # imports keras: only after activate() chose the backend

    state = read_json(ckpt_dir / cbs.LATEST_STATE)
    if state and not (ckpt_dir / cbs.LATEST_WEIGHTS).exists():
        state = None
    previous = read_json(run_dir / SUMMARY) or {}
    summary = _new_summary(plan, run_dir, epochs, state, previous)
    if summary["epochs_completed"] >= epochs:
        reporter.message(
            f"{run_dir} has already trained {summary['epochs_completed']} epoch(s) of {epochs}; "
            "raise train.epochs to train further, or pass --restart to start over.",
            "note",
        )
        summary.update(status=previous.get("status", "completed"), seconds=previous.get("seconds"))
        reporter.finish(summary)
        return summary

    (run_dir / "config.yaml").write_text(
        "# Written by tpurun: the config as run, with defaults filled in, and the values derived\n"
        "# on this machine under `derived` (ignored when this file is loaded again).\n"
        + yaml.safe_dump(resolved_config(prepared), sort_keys=False)
    )

    def finish(status: str) -> dict[str, Any]:
        summary["status"] = status
        summary["seconds"] = round(time.monotonic() - started, 3)
        write_json(run_dir / SUMMARY, summary)
        return summary

    write_json(run_dir / SUMMARY, summary)
    limit = config.train.time_limit
    stop = cbs.Stop(deadline=started + limit if limit else None)
    try:
        with _stop_on_signals(stop):
            model, history, progress, checkpoint = _train(prepared, run_dir, state, reporter, stop)
    except TpurunError:
        finish("failed")
        raise
    except KeyboardInterrupt:
        finish("interrupted")
        raise
    except Exception:
        finish("failed")
        (run_dir / ERROR_LOG).write_text(traceback.format_exc())
        raise
    finally:
        prepared.runtime.release()

    # An epoch cut short (by a signal or a NaN) ran its callbacks but is not finished.
    done = summary["epochs_completed"] + len(history.epoch) - (1 if stop.cut_at else 0)
    summary["epochs_completed"] = done
    summary["epoch_seconds"] = [round(s, 3) for s in progress.epoch_seconds]
    summary["examples_per_sec"] = round(_examples_per_sec(progress.epoch_rates), 1)
    if progress.first_step_seconds is not None:
        summary["time_to_first_step"] = round(progress.first_step_seconds, 3)
    summary["final_metrics"] = {k: float(v[-1]) for k, v in history.history.items() if v}
    if checkpoint is not None:
        summary["best"] = {
            "monitor": checkpoint.monitor,
            "value": checkpoint.best,
            "epoch": checkpoint.best_epoch,
        }
    if stop.nan_at is not None:
        epoch, step = stop.nan_at
        finish("nan")
        raise TpurunError(
            f"training stopped at epoch {epoch}, step {step}: the loss became NaN or Inf. Likely "
            "causes: a learning rate too high for this global batch (lower train.learning_rate.base),"
            " float16 overflow (use mixed_bfloat16 or float32), or bad input values. The last good "
            f"checkpoint is in {ckpt_dir}."
        )
    if stop.reason is not None and done < epochs:  # a stop after the last step is just the end
        where = (
            f"epoch {done + 1}, step {stop.cut_at[1]}"
            if stop.cut_at
            else f"the end of epoch {done}"
        )
        if stop.cut_at:
            # Keep the partial epoch's progress; a resume reruns that epoch from these weights.
            save_atomically(str(ckpt_dir / cbs.LATEST_WEIGHTS), model.save_weights)
            latest = read_json(ckpt_dir / cbs.LATEST_STATE) or {"epoch": done}
            latest["interrupted"] = {
                "reason": stop.reason,
                "epoch": done + 1,
                "step": stop.cut_at[1],
            }
            write_json(ckpt_dir / cbs.LATEST_STATE, {**latest, "epoch": done})
        finish("interrupted")
        raise Interrupted(
            f"{stop.reason}: stopped at {where}; the checkpoint is saved in {ckpt_dir}. Run the same "
            "command again to continue."
        )
    save_atomically(str(run_dir / "model.keras"), model.save)
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


@contextlib.contextmanager
def _stop_on_signals(stop):
    """SIGTERM or SIGINT (a notebook's stop button, Kaggle ending the session) stops training at
    the next step, with a checkpoint; a second signal stops at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return

    def handler(signum, frame):
        if stop.reason is not None:
            raise KeyboardInterrupt
        stop.reason = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _train(prepared: Prepared, run_dir: Path, state: dict | None, reporter: Reporter, stop):
    """Build datasets, model and callbacks; restore the latest checkpoint if any; fit."""
    from tpurun import callbacks as cbs
    from tpurun.data import pipeline
    from tpurun.model import build_model, compile_model

    config, plan, runtime = prepared.config, prepared.plan, prepared.runtime
    train_ds = pipeline.make_dataset(
        plan.train_files, prepared.data, plan.global_batch_size, training=True, seed=config.seed,
        cache=_cache(config, run_dir, "train"),
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
        config, plan, str(run_dir), reporter, stop
    )
    initial_epoch = int(state["epoch"]) if state else 0
    if state:
        weights = run_dir / CHECKPOINTS / cbs.LATEST_WEIGHTS
        _restore(model, train_ds, weights, runtime)
        if checkpoint is not None:
            checkpoint.best, checkpoint.best_epoch = state.get("best"), state.get("best_epoch")
        if config.callbacks.csv_log is not None:
            _trim_csv(run_dir / config.callbacks.csv_log.filename, initial_epoch)
        reporter.message(f"resuming at epoch {initial_epoch + 1} from {weights}", "note")
    reporter.start(plan, str(run_dir), config.train.epochs, initial_epoch)
    # Under a tf.distribute strategy the validation set repeats and needs its step count; elsewhere
    # it is finite and Keras reads it to the end (see pipeline.make_dataset).
    val_steps = plan.validation_steps if runtime.strategy is not None else None
    history = _fit(
        model, train_ds, val_ds, val_steps, plan, config.train.epochs, initial_epoch, callbacks
    )
    return model, history, progress, checkpoint


def _fit(
    model, train_ds, val_ds, val_steps, plan: Plan, epochs: int, initial_epoch: int, callbacks: list
) -> Any:
    """``model.fit``, with data and shape problems turned into clear errors."""
    import warnings

    import tensorflow as tf

    try:
        with warnings.catch_warnings():
            # The training stream repeats forever; only a finite validation set "runs out", on
            # purpose, at the end of each validation pass.
            warnings.filterwarnings("ignore", message="Your input ran out of data")
            return model.fit(
                train_ds,
                epochs=epochs,
                initial_epoch=initial_epoch,
                steps_per_epoch=plan.steps_per_epoch,
                validation_data=val_ds,
                validation_steps=val_steps,
                callbacks=callbacks,
                shuffle=False,  # the pipeline shuffles files and records itself
                verbose=0,
            )
    except (tf.errors.InvalidArgumentError, tf.errors.DataLossError) as exc:
        first = (exc.message or str(exc)).strip().splitlines()[0]
        raise DataError(f"reading the training data failed: {first}") from None
    except ValueError as exc:
        if model.optimizer is not None and int(model.optimizer.iterations.numpy()) > 0:
            raise
        # Before the first step, a ValueError is the model not fitting the data's shapes.
        first = str(exc).strip().splitlines()[0]
        raise ModelError(
            f"the model does not fit the data (data.inputs / data.targets): {first}"
        ) from None


def _restore(model, train_ds, weights: Path, runtime: Runtime) -> None:
    """Load the latest weights and optimizer state into the compiled model."""
    # Build the model and optimizer variables first so the optimizer state has somewhere to go.
    x, _ = next(iter(train_ds.take(1)))
    with runtime.scope():
        if not model.built:
            model(x)
        model.optimizer.build(model.trainable_variables)
        model.load_weights(str(weights))
