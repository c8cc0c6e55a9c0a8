"""How a training session ends: what the fit did recorded in the summary, the final model saved,
``curves.png`` drawn, and a NaN or a stop before the last epoch said as an error."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from tpurun.config import Config
from tpurun.display.reporter import Reporter
from tpurun.errors import Interrupted, TpurunError
from tpurun.observe import input_wait, trackers
from tpurun.observe.curves import save_curves
from tpurun.runtime import compile_cache
from tpurun.storage.rundir import CONFIG, LORA_MODEL, RunDir
from tpurun.storage.summary import Summary, steady_rate
from tpurun.training.checkpoints import adapter
from tpurun.training.final_model import custom_training_code, inference_saver, on_the_host
from tpurun.training.job import TrainJob, TrainResult


@dataclass
class Ending:
    """How a session ends in the run directory: its status and time in ``summary.json`` (with
    ``config.yaml``, if training never began to write), and ``curves.png``; then in its
    experiment trackers' runs (:func:`tpurun.observe.trackers.end_open`)."""

    run: RunDir
    effective: dict
    summary: Summary
    reporter: Reporter
    started: float  # time.monotonic() at the session's start

    def finish(self, status: str, at_once: bool = False) -> dict[str, Any]:
        """Record the end as ``status``; ``at_once`` (a second signal): the summary only, no
        curves.png and no tracker calls, which may wait on a server."""
        run, summary = self.run, self.summary
        summary.status = status
        summary.seconds = round(time.monotonic() - self.started, 3)
        if run.begun or status in ("completed", "stopped_early"):
            run.begin(self.effective, summary)
            run.write_summary(summary)
            if not at_once and status != "failed":
                _write_curves(run, self.reporter)
        if not at_once:
            trackers.end_open(status)  # last: the files are written whatever a tracker does
        return summary.to_dict()


def record(summary: Summary, result: TrainResult) -> None:
    """What the fit did, into the summary: epochs, timings, throughput, input wait, metrics, NaN
    restores."""
    summary.epochs_completed = result.position[0]
    summary.epoch_seconds = [round(s, 3) for s in result.epoch_seconds]
    summary.epoch_input_wait = input_wait.fractions(result.input_waits)
    wait = input_wait.overall(result.input_waits)
    summary.input_wait = None if wait is None else round(wait, 4)
    summary.examples_per_sec = round(steady_rate(result.epoch_rates), 1)
    if result.throughput is not None:
        summary.throughput = result.throughput
    if result.first_step_seconds is not None:
        summary.time_to_first_step = round(result.first_step_seconds, 3)
    if compile_cache.use.folder is not None:
        summary.compilation_cache = compile_cache.use.as_dict()
    summary.final_metrics = result.last_logs
    summary.nan_restores.extend(result.nan_restores)
    if result.best is not None:
        summary.best = result.best


def conclude(job: TrainJob, result: TrainResult, ending: Ending) -> dict[str, Any]:
    """The session's end: a NaN or a stop before the last epoch raises (its status written);
    otherwise the final model is saved and the summary returned."""
    config, run, summary, stop = job.prepared.config, job.run, job.summary, job.stop
    reporter, epochs = job.reporter, config.train.epochs
    done, step = result.position
    record(summary, result)
    if stop.nan_at is not None:
        ending.finish("nan")
        raise TpurunError(_nan_message(config, summary, stop.nan_at, result.position, run))
    if stop.reason is not None and done < epochs:  # a stop after the last step is just the end
        where = f"epoch {done + 1}, step {step}" if step else f"the end of epoch {done}"
        ending.finish("interrupted")
        raise Interrupted(
            f"{stop.reason}: stopped at {where}; the checkpoint is saved in {run.checkpoints}. Run "
            "the same command again to continue."
        )
    try:
        _save_final(run, result.model, reporter)
    except BaseException:
        # Recorded as failed, not left "running"; the save's own error is the one to say, even
        # where the summary cannot be written either (a full disk).
        with contextlib.suppress(Exception):
            ending.finish("failed")
        raise
    final = ending.finish("completed" if done >= epochs else "stopped_early")
    said = input_wait.verdict(result.input_waits, run.file(CONFIG))
    if said:
        reporter.message(*said)
    reporter.finish(final)
    return final


def _save_final(run: RunDir, model: Any, reporter: Reporter) -> None:
    """The run's final artifact: with LoRA, ``model.lora.h5`` (the adapter; the base is the
    preset's, which config.yaml names); else ``model.keras``, the whole model for inference."""
    if adapter.is_lora(model):
        run.save_model(lambda path: adapter.save_lora(model, path), LORA_MODEL)
        return
    with on_the_host(model):  # every process gathers; the writer writes
        run.save_model(inference_saver(model))
    custom = custom_training_code(model)
    if custom:
        reporter.message(
            f"model.keras is saved without its training setup ({', '.join(custom)}: your code), "
            "so plain keras.saving.load_model opens it anywhere, for inference; to train on, "
            "resume from the run's checkpoints.",
            "note",
        )


def _write_curves(run: RunDir, reporter: Reporter) -> None:
    """``curves.png`` from the run's log, at the end of every session; a picture never fails a
    run."""
    try:
        save_curves(run)
    except TpurunError as exc:  # matplotlib is not installed
        reporter.message(f"curves.png not written: {exc}", "note")
    except Exception as exc:
        reporter.message(f"curves.png not written: {type(exc).__name__}: {exc}", "warn")


def _nan_message(config: Config, summary: Summary, at: tuple, saved: tuple, run: RunDir) -> str:
    """What a NaN stop says: where, the likely causes, and the checkpoint it left, if any."""
    tried = (
        f" after {len(summary.nan_restores)} restore(s) (callbacks.max_nan_restores)"
        if config.callbacks.on_nan == "restore"
        else ""
    )
    if saved == (0, 0):
        kept = "No epoch finished, so there is no checkpoint to go back to."
    else:
        where = (
            f"epoch {saved[0] + 1}, step {saved[1]}" if saved[1] else f"the end of epoch {saved[0]}"
        )
        kept = (
            f"The last good checkpoint ({where}) is in {run.checkpoints}; callbacks.on_nan: "
            "restore reloads it with a lower learning rate and goes on."
        )
    return (
        f"training stopped at epoch {at[0]}, step {at[1]}: the loss became NaN or Inf{tried}. "
        "Likely causes: a learning rate too high for this global batch (lower "
        "train.learning_rate.base), float16 overflow (use mixed_bfloat16 or float32), or bad "
        f"input values (a partial last batch is ruled out: tpurun drops it). {kept}"
    )
