"""Taking up a checkpoint in the session's model: the resume point before the first ``fit``
(:func:`resume`), the latest one after a NaN loss with the learning rate cut
(:func:`restore_after_nan`), and the learning rate either runs at."""

from __future__ import annotations

from tpurun.config import Config
from tpurun.errors import ModelError, describe
from tpurun.plan.plan import Plan
from tpurun.storage import fileio
from tpurun.storage.rundir import ADAPTER_SUFFIX, LORA_SUFFIX, SHARDED_SUFFIX
from tpurun.training import schedule
from tpurun.training.checkpoints import adapter, sharded
from tpurun.training.checkpoints import resume as resume_lib
from tpurun.training.job import TrainJob


def resume(job: TrainJob, model, inputs, checkpoint) -> None:
    """Load the resume point: weights, optimizer, callbacks' state, learning-rate scale."""
    point, config, plan = job.point, job.prepared.config, job.prepared.plan
    load_weights(model, inputs, point.weights, job, str(point.source))
    checkpoint.restore(point.state, point.folder)
    checkpoint.restore_seed_states(model, point.state)
    configured = checkpoint.lr_shape
    epoch, step = point.position
    checkpoint.lr_shape, stretched = schedule.continued_shape(
        point.state.get("lr_shape"),
        configured,
        epoch * plan.steps_per_epoch + step,
        decays=config.train.learning_rate.schedule == "cosine",
    )
    apply_lr_scale(
        model,
        config,
        plan,
        checkpoint.lr_scale,
        saved=checkpoint.lr_scale,
        shape=checkpoint.lr_shape,
        rebuild=checkpoint.lr_shape != configured,
    )
    if point.state.get("warm_start"):
        job.reporter.message(
            f"starting from the weights in {point.source} (no resume state "
            "beside it: epoch 1, fresh optimizer position)",
            "note",
        )
    else:
        job.reporter.message("; ".join(filter(None, [point.describe(), stretched])), "note")


def restore_after_nan(job: TrainJob, model, inputs, checkpoint, restores: list[dict]) -> bool:
    """After a NaN loss with ``callbacks.on_nan: restore`` and restores left: reload the latest
    checkpoint with the learning rate cut, and record it in ``restores``. Whether training goes
    on."""
    config, plan, stop = job.prepared.config, job.prepared.plan, job.stop
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
    load_weights(model, inputs, back.weights, job, back.source)
    checkpoint.restore(back.state, back.folder)  # its lr_scale: the one it was saved with
    apply_lr_scale(model, config, plan, scale, saved=checkpoint.lr_scale, shape=checkpoint.lr_shape)
    checkpoint.lr_scale = scale
    restores.append(
        {
            "epoch": epoch,
            "step": step,
            "restored_to": list(back.position),
            "lr_scale": checkpoint.lr_scale,
        }
    )
    job.reporter.message(
        f"NaN loss at epoch {epoch}, step {step}: {back.describe()} with the learning rate "
        f"x{checkpoint.lr_scale:g} (restore {len(restores) + len(job.summary.nan_restores)} "
        f"of {config.callbacks.max_nan_restores})",
        "warn",
    )
    stop.nan_at = None
    return True


def build_variables(model, inputs, runtime) -> None:
    """Make the model's variables (called on ``inputs`` if not built yet) and its optimizer's,
    in ``runtime``'s scope, before the first ``fit`` would."""
    with runtime.scope():
        if not model.built:
            model(inputs)
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)


def load_weights(model, inputs, weights: str, job: TrainJob, source: str) -> None:
    """Build the model and optimizer variables, then load the weights and optimizer state.

    A LoRA run's adapter checkpoint (or a ``.lora.h5`` to start from) goes into the model built
    from the preset with LoRA on: the base weights are the preset's.
    """
    build_variables(model, inputs, job.runtime)
    with job.runtime.scope():
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
                raise ModelError(
                    f"{source}: cannot load {fileio.basename(weights)} into this "
                    f"model: {describe(exc)}"
                ) from None


def apply_lr_scale(
    model,
    config: Config,
    plan: Plan,
    scale: float,
    saved: float,
    shape: dict | None = None,
    rebuild: bool = False,
) -> None:
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
