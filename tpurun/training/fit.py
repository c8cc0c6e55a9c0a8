"""Fitting, for :func:`tpurun.training.session.run`: datasets, model, callbacks, resume, ``fit``, NaN restore.

Imports Keras inside its functions only: the runner imports this module before
:func:`tpurun.runtime.activate.activate` has chosen the backend. TensorFlow comes only with the
``tf_data`` reader (:mod:`tpurun.data.reader`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tpurun import frameworks
from tpurun.config import Config
from tpurun.data import reader as readers
from tpurun.display.reporter import Reporter
from tpurun.errors import DataError, ModelError, describe
from tpurun.hub import batches, lengths, mesh_layout
from tpurun.observe import throughput
from tpurun.plan.plan import Plan
from tpurun.runtime.activate import ActiveRuntime
from tpurun.storage import fileio
from tpurun.storage.rundir import ADAPTER_SUFFIX, LORA_SUFFIX, SHARDED_SUFFIX, RunDir
from tpurun.storage.summary import Summary, steady_rate
from tpurun.training import failures, schedule
from tpurun.training.checkpoints import resume as resume_lib
from tpurun.training.signals import Signalled, Stop, StopNow

if TYPE_CHECKING:
    from tpurun.plan.prepare import Prepared
    from tpurun.training.checkpoints.resume import ResumePoint


@dataclass
class TrainJob:
    """What :func:`train` needs: the prepared config on an activated runtime, where to write, where
    to start, and the stop request it obeys."""

    prepared: Prepared
    runtime: ActiveRuntime
    run: RunDir
    point: ResumePoint | None  # where to continue from; None: epoch 1
    identity: dict  # what the checkpoints are bound to (resume.identity)
    effective: dict  # config.yaml's content
    summary: Summary  # written with config.yaml once Keras has checked the model against the data
    reporter: Reporter
    stop: Stop


@dataclass
class TrainResult:
    """How the fit ended: where, with which metrics, how fast. Why it ended is ``job.stop``."""

    model: Any
    position: tuple[int, int]  # (epochs done, steps into the next) of the last save
    best: dict | None  # {monitor, value, epoch}; None when callbacks.checkpoint is off
    last_logs: dict  # the last finished epoch's metrics
    epoch_seconds: list[float]
    epoch_rates: list[float]  # examples/s per epoch
    first_step_seconds: float | None
    nan_restores: list[dict] = field(default_factory=list)
    input_waits: list[tuple[float, float]] = field(default_factory=list)  # (waiting, training) s
    throughput: dict | None = None  # tokens/s, TFLOP/s a device, MFU: see observe.throughput


def train(job: TrainJob) -> TrainResult:
    """Build datasets, model and callbacks; restore the resume point if any; fit to the end.

    With ``callbacks.on_nan: restore``, a NaN loss reloads the latest checkpoint with the learning
    rate cut, and training goes on from there (as Model Garden's loss recovery does).
    """
    from tpurun.observe.callbacks import epoch_waits
    from tpurun.training import callbacks as cbs

    prepared, run, reporter = job.prepared, job.run, job.reporter
    config, plan = prepared.config, prepared.plan
    model = _compiled_model(job)
    preprocessor, transform = batches.take_preprocessing(model, config, prepared.data.tokenized)
    lengths.say_truncation(model, preprocessor, prepared, reporter.message)
    train_data, val_ds = _datasets(job, transform)
    callbacks, progress, control = cbs.build_callbacks(
        config, plan, run, reporter, job.stop, job.identity, sharded=job.runtime.sharded
    )
    checkpoint = control.checkpointer
    checkpoint.lr_shape = schedule.schedule_shape(config, plan)  # a resume may stretch it
    control.committed = _keep_summary_current(job, progress, checkpoint)
    inputs, batch_spec = _first_inputs(job, model, transform)
    if job.point is not None:
        _resume(job, model, inputs, checkpoint)
    first_writes = _once(_first_writes(job, model, control))
    measure = throughput.measuring(model, progress, batch_spec, prepared, reporter)
    begin = cbs.keras.callbacks.LambdaCallback(on_train_begin=first_writes)
    callbacks = [begin, measure, *callbacks]
    if job.stop.agree is None and job.stop.reason in ("SIGTERM", "SIGINT"):  # came while starting
        raise Signalled(job.stop.reason, after_training=False)  # no step ran: nothing to save
    reporter.start(plan, run.path, config.train.epochs, checkpoint.position[0])
    fitting = _Fitting(
        model, train_data, val_ds, callbacks, progress, checkpoint, inputs,
        # Under a tf.distribute strategy the validation set repeats and needs its step count;
        # elsewhere it is finite and Keras reads it to the end (see pipeline.make_dataset).
        val_steps=plan.validation_steps if job.runtime.strategy is not None else None,
    )  # fmt: skip
    restores: list[dict] = []
    with checkpoint.closing():  # sharded saves still in flight at the end: committed
        _fit_once(job, fitting)
        while _restore_after_nan(job, fitting, restores):
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
    progress: Any  # callbacks.Progress
    checkpoint: Any  # checkpoints.Checkpointer
    inputs: Any  # the first batch's inputs: they build the model before weights are loaded
    val_steps: int | None = None


def _datasets(job: TrainJob, transform: Any = None) -> tuple[Callable[[int, int], Any], Any]:
    """This process's training stream from a position, as a function of (epoch, step); and its
    validation set (None without one); ``transform``: see :func:`pipeline.make_dataset`. Both as
    Keras takes them from the run's reader (:func:`tpurun.data.reader.for_keras`)."""
    prepared, runtime = job.prepared, job.runtime
    config, plan, reader = prepared.config, prepared.plan, prepared.reader
    batch = plan.per_process_batch_size
    share, val_share = prepared.train_share, prepared.validation_share

    def train_data(epoch: int, step: int):
        """This process's training stream from a position: the batches an unbroken run would see."""
        return readers.for_keras(readers.make_dataset(
            reader, share.files, config.data, batch, training=True, seed=config.seed,
            start_record=(epoch * plan.steps_per_epoch + step) * batch, records_per_pass=share.records,
            cache=readers.cache(config.data.cache, "train", reader), shard=share.shard, transform=transform,
        ))  # fmt: skip

    val_ds = None
    if val_share is not None:
        val_ds = readers.for_keras(readers.make_dataset(
            reader, val_share.files, config.data, batch, training=False,
            score_records=val_share.records, take_batches=plan.validation_steps,
            repeat_eval=runtime.strategy is not None, cache=readers.cache(config.data.cache, "validation", reader),
            shard=val_share.shard, transform=transform,
        ))  # fmt: skip
    return train_data, val_ds


def _compiled_model(job: TrainJob) -> Any:
    """The config's model, built and compiled in the runtime's scope."""
    from tpurun.runtime import mesh
    from tpurun.training.model import build_model, compile_model
    from tpurun.training.normalize import for_session

    config, plan = job.prepared.config, job.prepared.plan
    numbers = for_session(job.prepared, job.point, job.effective, job.reporter)
    mesh_layout.install(job.runtime, config)  # a mesh's layout, before any variable exists
    with job.runtime.scope():
        model = build_model(config, plan.backend, numbers, job.prepared.data.train_files)
        mesh.check(job.runtime, model, config)  # before anything is compiled
        note = compile_model(model, config, plan)
    if note:
        job.reporter.message(note, "note")
    from tpurun.runtime.memory_check import check_model

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
    from tpurun.training.loss_check import check_loss_fits

    prepared = job.prepared
    config, share = prepared.config, prepared.train_share
    batch = prepared.plan.per_process_batch_size
    data = config.data.model_copy(
        update={"shuffle_buffer": min(config.data.shuffle_buffer, 4 * batch)}
    )
    ds = readers.make_dataset(prepared.reader, share.files, data, batch, training=True,
                              seed=config.seed, records_per_pass=share.records, shard=share.shard,
                              transform=transform)  # fmt: skip
    try:
        first_batch = readers.first_batch(ds)
    except Exception as exc:
        if readers.damaged_record(exc):  # a damaged record before the first step
            raise failures.damaged_while_training(job.prepared, exc) from None
        raise
    check_loss_fits(model, config, first_batch[1])
    return first_batch[0], readers.element_spec(ds, first_batch)


def _resume(job: TrainJob, model, inputs, checkpoint) -> None:
    """Load the resume point: weights, optimizer, callbacks' state, learning-rate scale."""
    point, config, plan = job.point, job.prepared.config, job.prepared.plan
    _restore(model, inputs, point.weights, job, str(point.source))
    checkpoint.restore(point.state, point.folder)
    checkpoint.restore_seed_states(model, point.state)
    configured = checkpoint.lr_shape
    epoch, step = point.position
    checkpoint.lr_shape, stretched = schedule.continued_shape(
        point.state.get("lr_shape"), configured, epoch * plan.steps_per_epoch + step,
        decays=config.train.learning_rate.schedule == "cosine",
    )  # fmt: skip
    _apply_lr_scale(model, config, plan, checkpoint.lr_scale, saved=checkpoint.lr_scale,
                    shape=checkpoint.lr_shape, rebuild=checkpoint.lr_shape != configured)  # fmt: skip
    if point.state.get("warm_start"):
        job.reporter.message(f"starting from the weights in {point.source} (no resume state "
                             "beside it: epoch 1, fresh optimizer position)", "note")  # fmt: skip
    else:
        job.reporter.message("; ".join(filter(None, [point.describe(), stretched])), "note")


def _first_writes(job: TrainJob, model, control) -> Callable[..., None]:
    """The run's first writes, for Keras' first ``on_train_begin``."""
    from tpurun.training import callbacks as cbs
    from tpurun.training.monitored import resolve_monitors

    config, run, point, checkpoint = job.prepared.config, job.run, job.point, control.checkpointer
    log = config.callbacks.csv_log.filename if config.callbacks.csv_log else None

    def on_train_begin(logs=None) -> None:
        # Keras has built the model and its metrics against the data by now (symbolic build): the
        # monitors can be checked, and the run's first writes made.
        cbs.apply_monitor_modes(resolve_monitors(model, config), control)
        if log is not None and point is not None:
            run.carry_log(point.run, log)
        if log is not None:  # rows past the resume point are redone; none at all on a fresh run
            if said := run.trim_log(log, point.position[0] if point is not None else 0):
                job.reporter.message(said, "warn")  # a damaged log: what was kept
        run.begin(job.effective, job.summary)
        if config.callbacks.on_nan == "restore" and checkpoint.position == (0, 0):
            checkpoint.save_latest(model, 0, 0, "start")  # something to go back to before epoch 1

    return on_train_begin


def _fit_once(job: TrainJob, f: _Fitting) -> None:
    """Fit from the checkpoint's position to the last epoch (or a stop), its failures said as
    what to do about them (:mod:`tpurun.training.failures`)."""
    config, plan = job.prepared.config, job.prepared.plan
    try:
        _fit_from(f.model, f.train_data, f.val_ds, f.val_steps, plan, config.train.epochs,
                  f.checkpoint, f.progress, f.callbacks)  # fmt: skip
    except Exception as exc:
        # Under gradient accumulation `iterations` is computed (batches // N), no variable.
        updates = frameworks.keras().ops.convert_to_numpy(f.model.optimizer.iterations)
        first_step = int(updates) == 0
        said = failures.explain(exc, job.prepared, f.model, job.run.checkpoints, first_step)
        if said is None:
            raise
        raise said from None


def _restore_after_nan(job: TrainJob, f: _Fitting, restores: list[dict]) -> bool:
    """After a NaN loss with ``callbacks.on_nan: restore`` and restores left: reload the latest
    checkpoint with the learning rate cut, and record it in ``restores``. Whether training goes
    on."""
    config, plan, stop, checkpoint = job.prepared.config, job.prepared.plan, job.stop, f.checkpoint
    if stop.nan_at is None or config.callbacks.on_nan != "restore":
        return False
    if len(restores) + len(job.summary.nan_restores) >= config.callbacks.max_nan_restores:
        return False
    checkpoint.finish()  # a sharded save from before the NaN, committed
    back = resume_lib.latest(job.run)
    if back is None:
        return False
    epoch, step = stop.nan_at
    scale = checkpoint.lr_scale * config.callbacks.nan_lr_factor  # cuts add up
    _restore(f.model, f.inputs, back.weights, job, back.source)
    checkpoint.restore(back.state, back.folder)  # its lr_scale: the one it was saved with
    _apply_lr_scale(f.model, config, plan, scale, saved=checkpoint.lr_scale,
                    shape=checkpoint.lr_shape)  # fmt: skip
    checkpoint.lr_scale = scale
    restores.append({"epoch": epoch, "step": step, "restored_to": list(back.position),
                     "lr_scale": checkpoint.lr_scale})  # fmt: skip
    job.reporter.message(
        f"NaN loss at epoch {epoch}, step {step}: {back.describe()} with the learning rate "
        f"x{checkpoint.lr_scale:g} (restore {len(restores) + len(job.summary.nan_restores)} "
        f"of {config.callbacks.max_nan_restores})",
        "warn",
    )
    stop.nan_at = None
    return True


def _once(fn):
    """``fn`` on its first call only (fit runs more than once per run)."""
    done = []

    def wrapper(*args, **kwargs):
        if not done:
            done.append(True)
            fn(*args, **kwargs)

    return wrapper


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


def _fit(model, train_ds, val_ds, val_steps, steps: int, epochs: int, initial_epoch: int,
         callbacks: list) -> Any:  # fmt: skip
    """``model.fit``, with data problems turned into clear errors, and a saved stop ended."""
    import sys
    import warnings

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


def _restore(model, inputs, weights: str, job: TrainJob, source: str) -> None:
    """Build the model and optimizer variables, then load the weights and optimizer state.

    A LoRA run's adapter checkpoint (or a ``.lora.h5`` to start from) goes into the model built
    from the preset with LoRA on: the base weights are the preset's.
    """
    from tpurun.training.checkpoints import adapter, sharded

    with job.runtime.scope():
        if not model.built:
            model(inputs)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        if weights.endswith(ADAPTER_SUFFIX):
            adapter.load(model, weights, source, preset=job.identity.get("model.preset"))
            return
        if weights.endswith(LORA_SUFFIX):
            adapter.load_lora(model, weights, source)
            return
        if weights.endswith(SHARDED_SUFFIX):  # restored under this run's mesh, whatever it was
            sharded.load(model, weights, source)
            return
        with fileio.local_copy(weights) as local:  # Keras reads gs:// only through TensorFlow
            try:
                model.load_weights(local)
            except Exception as exc:  # Keras raises ValueError, KeyError, OSError... for a misfit
                raise ModelError(f"{source}: cannot load {fileio.basename(weights)} into this "
                                 f"model: {describe(exc)}") from None  # fmt: skip


def _apply_lr_scale(
    model, config: Config, plan: Plan, scale: float, saved: float,
    shape: dict | None = None, rebuild: bool = False,
) -> None:  # fmt: skip
    """Run at ``scale`` x the configured learning rate (``on_nan: restore`` cuts it), on the
    schedule's ``shape`` (``rebuild``: a resume of another length stretched it). ``saved``: the
    checkpoint's scale. A plain rate is an optimizer variable, saved with it: multiplied by
    ``scale / saved``. A schedule is rebuilt and the step retraced (it is compiled into it)."""
    learning_rate = schedule.learning_rate_schedule(config, plan, scale, shape)
    if isinstance(learning_rate, float):
        if scale != saved:
            model.optimizer.learning_rate = float(model.optimizer.learning_rate) * scale / saved
    elif scale != 1.0 or rebuild:
        model.optimizer.learning_rate = learning_rate
        model.train_function = None
