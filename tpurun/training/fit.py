"""Fitting, for :func:`tpurun.training.session.run`: datasets, model, callbacks, ``fit``, going on
after a resume or a NaN restore (:mod:`.restore` loads them).

Imports Keras inside its functions only: the runner imports this module before
:func:`tpurun.runtime.activate.activate` has chosen the backend. TensorFlow comes only with the
``tf_data`` reader (:mod:`tpurun.data.reader`).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpurun import frameworks
from tpurun.data import reader as readers
from tpurun.errors import DataError
from tpurun.hub import batches, lengths, mesh_layout
from tpurun.observe import curves, throughput
from tpurun.plan.plan import Plan
from tpurun.runtime import mesh, optimizer_split
from tpurun.runtime.memory_check import check_model
from tpurun.storage.summary import steady_rate
from tpurun.training import failures, schedule
from tpurun.training.job import TrainJob, TrainResult
from tpurun.training.loss_check import check_loss_fits
from tpurun.training.model import build_model, compile_model
from tpurun.training.monitored import apply_monitor_modes, resolve_monitors
from tpurun.training.normalize import for_session
from tpurun.training.restore import build_variables, restore_after_nan, resume
from tpurun.training.signals import Signalled, StopNow


def train(job: TrainJob) -> TrainResult:
    """Build datasets, model and callbacks; restore the resume point if any; fit to the end.

    With ``callbacks.on_nan: restore``, a NaN loss reloads the latest checkpoint with the learning
    rate cut, and training goes on from there (as Model Garden's loss recovery does).
    """
    prepared, reporter = job.prepared, job.reporter
    config = prepared.config
    # A mesh's layout, before any variable exists, and before a stream reads the distribution
    # that places its batches.
    mesh_layout.install(job.runtime, config)
    # A factory's batches take nothing from its model: its training stream starts reading (the
    # shuffle buffer's fill: 0.3-0.4 s of the NAIC-like run's start) while the model is built and
    # its initial weights compiled. A preset's waits for the preprocessing the model brings.
    # Whatever stops the session before a fit takes the stream (a model that fails to build, a
    # stop while starting) stops its threads too.
    with contextlib.ExitStack() as streams:

        def opened(datasets: tuple[_TrainingStreams, Any]) -> tuple[_TrainingStreams, Any]:
            streams.callback(datasets[0].close)
            return datasets

        datasets = opened(_datasets(job)) if config.model.preset is None else None
        model = _compiled_model(job)
        preprocessor, transform = batches.take_preprocessing(model, config, prepared.data.tokenized)
        lengths.say_truncation(model, preprocessor, prepared, reporter.message)
        datasets = datasets or opened(_datasets(job, transform))
        return _train(job, model, preprocessor, transform, *datasets)


def _train(job: TrainJob, model, preprocessor, transform, train_data, val_ds) -> TrainResult:
    """:func:`train` once the model and its datasets are made."""
    # lazy: both build on Keras, which this module is imported before (see its docstring)
    from tpurun.observe.callbacks import epoch_waits
    from tpurun.training.callbacks.build import build_callbacks

    prepared, run, reporter = job.prepared, job.run, job.reporter
    config, plan = prepared.config, prepared.plan
    callbacks, progress, control = build_callbacks(
        config, plan, run, reporter, job.stop, job.identity, sharded=job.runtime.sharded
    )
    checkpoint = control.checkpointer
    checkpoint.lr_shape = schedule.schedule_shape(config, plan)  # a resume may stretch it
    control.committed = _keep_summary_current(job, progress, checkpoint)
    inputs, batch_spec = _first_inputs(job, model, transform)
    _split_optimizer_state(job, model, inputs)  # before a resume assigns it, and the step compiles
    if job.point is not None:
        resume(job, model, inputs, checkpoint)
    first_writes = _once(_first_writes(job, model, control))
    measure = throughput.measuring(model, progress, batch_spec, prepared, reporter)
    begin = frameworks.keras().callbacks.LambdaCallback(on_train_begin=first_writes)
    callbacks = [begin, *callbacks, measure]  # measured after Progress timed the first step
    if job.stop.agree is None and job.stop.reason in ("SIGTERM", "SIGINT"):  # came while starting
        raise Signalled(job.stop.reason, after_training=False)  # no step ran: nothing to save
    reporter.start(plan, run.path, config.train.epochs, checkpoint.position[0])
    fitting = _Fitting(
        model,
        train_data,
        val_ds,
        callbacks,
        progress,
        checkpoint,
        # Under a tf.distribute strategy the validation set repeats and needs its step count;
        # elsewhere it is finite and Keras reads it to the end (see pipeline.make_dataset).
        val_steps=plan.validation_steps if job.runtime.strategy is not None else None,
    )
    restores: list[dict] = []
    with checkpoint.closing():  # sharded saves still in flight at the end: committed
        _fit_once(job, fitting)
        while restore_after_nan(job, model, inputs, checkpoint, restores):
            _fit_once(job, fitting)
    if preprocessor is not None:
        batches.attach(model, preprocessor)  # the saved model tokenises as the preset did
    return TrainResult(
        model=model,
        position=checkpoint.position,
        best=checkpoint.best_record,
        last_logs=checkpoint.last_logs,
        epoch_seconds=progress.epoch_seconds,
        epoch_rates=progress.epoch_rates,
        first_step_seconds=progress.first_step_seconds,
        nan_restores=restores,
        input_waits=epoch_waits(callbacks),
        throughput=throughput.steady(progress.step_cost, progress.epoch_throughput),
    )


def _keep_summary_current(job: TrainJob, progress, checkpoint) -> Callable[[int, dict], None]:
    """What each committed epoch writes into ``summary.json``, so that `tpurun runs` reads a
    resumed session as current as a fresh one: epochs done, the best value, the last metrics
    and the rate so far."""

    def committed(epochs_done: int, logs: dict) -> None:
        summary = job.summary
        summary.epochs_completed = epochs_done
        summary.final_metrics = {k: float(v) for k, v in logs.items()}
        if checkpoint.best_record is not None:
            summary.best = checkpoint.best_record
        if progress.epoch_rates:
            summary.examples_per_sec = round(steady_rate(progress.epoch_rates), 1)
        summary.throughput = throughput.steady(progress.step_cost, progress.epoch_throughput)
        job.run.write_summary(summary)

    return committed


@dataclass
class _Fitting:
    """What every ``fit`` of a session shares (a mid-epoch resume and a NaN restore fit again)."""

    model: Any
    train_data: Callable[[int, int], Any]  # (epoch, step) -> the training stream from there
    val_ds: Any  # None without a validation set
    callbacks: list
    progress: Any  # callbacks.progress.Progress
    checkpoint: Any  # checkpoints.Checkpointer
    val_steps: int | None = None


class _TrainingStreams:
    """This process's training stream from a position, as a function of (epoch, step): the
    batches an unbroken run would see, as Keras takes them from the run's reader
    (:func:`tpurun.data.reader.for_keras`).

    The stream from the session's first position (``first``) starts reading at once, in the
    background (:func:`tpurun.data.reader.read_ahead`), and is the one the first ``fit`` takes; a
    stream from another position (a NaN restore's) is made when asked for.
    """

    def __init__(self, make: Callable[[int, int], Any], first: tuple[int, int]):
        self._make = make
        self._ahead: tuple[tuple[int, int], Any] | None = (first, make(*first))
        readers.read_ahead(self._ahead[1])

    def __call__(self, epoch: int, step: int) -> Any:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            if ahead[0] == (epoch, step):
                return ahead[1]
            readers.close(ahead[1])
        return self._make(epoch, step)

    def close(self) -> None:
        """Stop the stream read ahead, if no ``fit`` took it (the fit closes its own)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            readers.close(ahead[1])


def _datasets(job: TrainJob, transform: Any = None) -> tuple[_TrainingStreams, Any]:
    """This process's training streams (:class:`_TrainingStreams`, the first reading already);
    and its validation set (None without one), as Keras takes it from the run's reader;
    ``transform``: see :func:`pipeline.make_dataset`."""
    prepared, runtime = job.prepared, job.runtime
    config, plan, reader = prepared.config, prepared.plan, prepared.reader
    batch = plan.per_process_batch_size
    share, val_share = prepared.train_share, prepared.validation_share

    def train_data(epoch: int, step: int):
        """This process's training stream from a position: the batches an unbroken run would see."""
        return readers.for_keras(
            readers.make_dataset(
                reader,
                share.files,
                config.data,
                batch,
                training=True,
                seed=config.seed,
                start_record=(epoch * plan.steps_per_epoch + step) * batch,
                records_per_pass=share.records,
                cache=readers.cache(config.data.cache, "train", reader),
                shard=share.shard,
                transform=transform,
            )
        )

    val_ds = None
    if val_share is not None:
        val_ds = readers.for_keras(
            readers.make_dataset(
                reader,
                val_share.files,
                config.data,
                batch,
                training=False,
                score_records=val_share.records,
                take_batches=plan.validation_steps,
                repeat_eval=runtime.strategy is not None,
                cache=readers.cache(config.data.cache, "validation", reader),
                shard=val_share.shard,
                transform=transform,
            )
        )
    first = _start(plan, job.point.position if job.point is not None else (0, 0))
    return _TrainingStreams(train_data, first), val_ds


def _compiled_model(job: TrainJob) -> Any:
    """The config's model, built and compiled in the runtime's scope."""
    config, plan = job.prepared.config, job.prepared.plan
    numbers = for_session(job.prepared, job.point, job.effective, job.reporter)
    with job.runtime.scope():
        model = build_model(config, plan.backend, numbers, job.prepared.data.train_files)
        mesh.check(job.runtime, model, config)  # before anything is compiled
        note = compile_model(model, config, plan)
    if note:
        job.reporter.message(note, "note")
    check_model(model, config, plan, job.runtime, job.reporter)  # before the first step compiles
    return model


def _first_inputs(job: TrainJob, model, transform: Any = None) -> Any:
    """The first batch's inputs, once its targets are checked against the model's loss, and the
    batches' element spec (the training step's cost is measured on it).

    Drawn from the training files as the fit's stream draws them (files shuffled, records
    shuffled), through a shuffle buffer of four batches instead of ``data.shuffle_buffer``: the
    fit fills the whole buffer once more right after (10,000 NAIC-like records: 0.3-0.4 s), and
    one batch to check needs no more mixing than that.
    """
    prepared = job.prepared
    config, share = prepared.config, prepared.train_share
    batch = prepared.plan.per_process_batch_size
    data = config.data.model_copy(
        update={"shuffle_buffer": min(config.data.shuffle_buffer, 4 * batch)}
    )
    ds = readers.make_dataset(
        prepared.reader,
        share.files,
        data,
        batch,
        training=True,
        seed=config.seed,
        records_per_pass=share.records,
        shard=share.shard,
        transform=transform,
    )
    try:
        first_batch = readers.first_batch(ds)
    except Exception as exc:
        if readers.damaged_record(exc):  # a damaged record before the first step
            raise failures.damaged_while_training(job.prepared, exc) from None
        raise
    check_loss_fits(model, config, first_batch[1])
    return first_batch[0], readers.element_spec(ds, first_batch)


def _split_optimizer_state(job: TrainJob, model, inputs) -> None:
    """The optimizer's state split over the data-parallel devices
    (:mod:`tpurun.runtime.optimizer_split`), its variables built for it."""
    devices = optimizer_split.devices_for(job.prepared.plan, job.prepared.config)
    if devices > 1:
        build_variables(model, inputs, job.runtime)
        optimizer_split.place(model, job.runtime, devices)


def _first_writes(job: TrainJob, model, control) -> Callable[..., None]:
    """The run's first writes, for Keras' first ``on_train_begin``."""
    config, run, point, checkpoint = job.prepared.config, job.run, job.point, control.checkpointer
    log = config.callbacks.csv_log.filename if config.callbacks.csv_log else None

    def on_train_begin(logs=None) -> None:
        # Keras has built the model and its metrics against the data by now (symbolic build): the
        # monitors can be checked, and the run's first writes made.
        apply_monitor_modes(resolve_monitors(model, config), checkpoint)
        if log is not None and point is not None:
            run.carry_log(point.run, log)
        if log is not None:  # rows past the resume point are redone; none at all on a fresh run
            if said := run.trim_log(log, point.position[0] if point is not None else 0):
                job.reporter.message(said, "warn")  # a damaged log: what was kept
        run.begin(job.effective, job.summary)
        curves.import_ahead(run)  # while the first step compiles: drawn at the end
        if config.callbacks.on_nan == "restore" and checkpoint.position == (0, 0):
            checkpoint.save_latest(model, 0, 0, "start")  # something to go back to before epoch 1

    return on_train_begin


def _fit_once(job: TrainJob, f: _Fitting) -> None:
    """Fit from the checkpoint's position to the last epoch (or a stop), its failures said as
    what to do about them (:mod:`tpurun.training.failures`)."""
    config, plan = job.prepared.config, job.prepared.plan
    try:
        _fit_from(
            f.model,
            f.train_data,
            f.val_ds,
            f.val_steps,
            plan,
            config.train.epochs,
            f.checkpoint,
            f.progress,
            f.callbacks,
        )
    except Exception as exc:
        # Under gradient accumulation `iterations` is computed (batches // N), no variable.
        updates = frameworks.keras().ops.convert_to_numpy(f.model.optimizer.iterations)
        first_step = int(updates) == 0
        said = failures.explain(exc, job.prepared, f.model, job.run.checkpoints, first_step)
        if said is None:
            raise
        raise said from None


def _once(fn):
    """``fn`` on its first call only (fit runs more than once per run)."""
    done = []

    def wrapper(*args, **kwargs):
        if not done:
            done.append(True)
            fn(*args, **kwargs)

    return wrapper


def _fit_from(
    model,
    train_data,
    val_ds,
    val_steps,
    plan: Plan,
    epochs: int,
    checkpoint,
    progress,
    callbacks: list,
) -> None:
    """Fit from the checkpoint's position to ``epochs``.

    Keras can only start at an epoch's beginning, so a mid-epoch resume first fits the rest of that
    epoch as a short epoch of its own (the callbacks count its steps from the resume point and
    restore its running metrics), then the remaining epochs.
    """
    epoch, step = _start(plan, checkpoint.position)
    progress.resume_at = checkpoint.resume_at = (epoch, step)
    if step:
        _fit(
            model,
            train_data(epoch, step),
            val_ds,
            val_steps,
            plan.steps_per_epoch - step,
            epoch + 1,
            epoch,
            callbacks,
        )
        if model.stop_training:
            return
        epoch += 1
    if epoch < epochs:
        _fit(
            model,
            train_data(epoch, 0),
            val_ds,
            val_steps,
            plan.steps_per_epoch,
            epochs,
            epoch,
            callbacks,
        )


def _start(plan: Plan, position: tuple[int, int]) -> tuple[int, int]:
    """Where a fit from a checkpoint's ``position`` (epoch, step) starts."""
    epoch, step = position
    if step >= plan.steps_per_epoch:  # the epoch got shorter since (more replicas, less data)
        return epoch + 1, 0
    # A changed steps_per_execution: the part of an execution is done again.
    return epoch, step - step % plan.steps_per_execution


def _fit(
    model, train_ds, val_ds, val_steps, steps: int, epochs: int, initial_epoch: int, callbacks: list
) -> Any:
    """``model.fit``, with data problems turned into clear errors, and a saved stop ended."""
    tf_errors = getattr(sys.modules.get("tensorflow"), "errors", None)  # loaded by tf_data only
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
        model.stop_training = True  # so that a resumed epoch's rest does not go on to the next
        return None
    except Exception as exc:
        if tf_errors is None or not isinstance(exc, tf_errors.InvalidArgumentError):
            raise
        first = (exc.message or str(exc)).strip().splitlines()[0]
        raise DataError(f"reading the training data failed: {first}") from None
    finally:
        readers.close(train_ds)  # the native reader's threads; the next fit reads afresh
