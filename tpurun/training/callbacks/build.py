"""build_callbacks: the callback list ``fit`` gets, in the order Keras calls them, and the user's
own (``callbacks.extra``)."""

from __future__ import annotations

from typing import Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.display.reporter import Reporter
from tpurun.errors import TpurunError
from tpurun.observe.callbacks import observers
from tpurun.plan.plan import Plan
from tpurun.storage.rundir import RunDir
from tpurun.training.callbacks.early_stopping import EarlyStopping
from tpurun.training.callbacks.exact_validation import ExactValidation
from tpurun.training.callbacks.progress import Progress
from tpurun.training.callbacks.reduce_lr_on_plateau import ReduceLROnPlateau
from tpurun.training.callbacks.run_control import RunControl
from tpurun.training.checkpoints.checkpointer import Checkpointer
from tpurun.training.monitored import monitors
from tpurun.training.signals import Stop
from tpurun.training.token_loss import TokenLoss
from tpurun.training.user_code import import_object

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


def build_callbacks(
    config: Config,
    plan: Plan,
    run: RunDir,
    reporter: Reporter,
    stop: Stop,
    identity: dict,
    sharded: bool = False,
) -> tuple[list[Any], Progress, RunControl]:
    """The callback list for ``fit``, plus the two tpurun reads results from.

    The resume point is always kept (``callbacks.checkpoint: null`` only turns off the best and
    pattern-named models): a run directory can always be resumed. ``sharded``: the model is
    split over a mesh's model axis (``ActiveRuntime.sharded``): its checkpoints are too.
    """
    cb = config.callbacks
    progress = Progress(reporter, plan)
    stateful = _stateful(config)
    extra = [_user_callback(spec, config) for spec in cb.extra]
    checkpointer = _checkpointer(config, plan, run, stateful, identity, sharded)
    control = RunControl(
        run,
        checkpointer,
        stop,
        steps_per_epoch=plan.steps_per_epoch,
        watch_nan=cb.on_nan != "ignore",
        log=cb.csv_log.filename if cb.csv_log else None,
    )
    first = []
    if plan.validation_steps:
        fed = plan.validation_steps * plan.global_batch_size
        first.append(ExactValidation(plan.validation_scored, fed, reporter))
    if config.model.preset is not None:  # a causal LM's loss per token (keras_hub is there)
        first.append(TokenLoss())
    seen = observers(  # input wait, TensorBoard, a profile, the learning rate
        config, plan, run, reporter, progress=progress, checkpointer=checkpointer
    )
    return [
        *first, *seen.before_progress, progress, *seen.after_progress, *stateful, *extra,
        *seen.last, control,
    ], progress, control  # fmt: skip


def _stateful(config: Config) -> list[Any]:
    """The callbacks whose counters a checkpoint keeps: ReduceLROnPlateau, EarlyStopping."""
    cb, monitor = config.callbacks, monitors(config)
    stateful: list[Any] = []
    if cb.reduce_lr_on_plateau is not None:
        r = cb.reduce_lr_on_plateau
        stateful.append(
            ReduceLROnPlateau(
                monitor=monitor["reduce_lr_on_plateau"][0],
                factor=r.factor,
                patience=r.patience,
                min_lr=r.min_lr,
                min_delta=r.min_delta,
                cooldown=r.cooldown,
                mode=r.mode,
            )
        )
    if cb.early_stopping is not None:
        e = cb.early_stopping
        stateful.append(
            EarlyStopping(
                monitor=monitor["early_stopping"][0],
                patience=e.patience,
                min_delta=e.min_delta,
                mode=e.mode,
                restore_best_weights=e.restore_best_weights,
                total_epochs=config.train.epochs,
            )
        )
    return stateful


def _checkpointer(
    config: Config, plan: Plan, run: RunDir, stateful: list[Any], identity: dict, sharded: bool
) -> Checkpointer:
    """The run's checkpointer, as ``callbacks.checkpoint`` sets it (None: the resume point only)."""
    ck = config.callbacks.checkpoint
    return Checkpointer(
        run,
        steps_per_epoch=plan.steps_per_epoch,
        monitor=plan.monitor,
        mode=None,  # settled by monitored.resolve_monitors from the compiled model
        save_best=ck is not None,
        save_best_only=ck.save_best_only if ck else True,
        filename=ck.filename if ck else None,
        keep=ck.keep if ck else None,
        every_steps=ck.every_steps if ck else None,
        every_minutes=ck.every_minutes if ck else None,
        stateful=stateful,
        identity=identity,
        sharded=sharded,
    )


def _user_callback(spec: Any, config: Config) -> Any:
    """One ``callbacks.extra`` entry, made from its class and kwargs; a Keras callback or refused."""
    cls = import_object(spec.name, config.base_dir, "callbacks.extra")
    try:
        callback = cls(**spec.kwargs)
    except Exception as exc:
        raise TpurunError(f"callbacks.extra '{spec.name}': {type(exc).__name__}: {exc}") from None
    if not isinstance(callback, keras.callbacks.Callback):
        raise TpurunError(
            f"callbacks.extra '{spec.name}' made a {type(callback).__name__}, not a "
            "keras.callbacks.Callback."
        )
    return callback
