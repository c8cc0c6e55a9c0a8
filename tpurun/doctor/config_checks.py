"""Checks of a config on this machine: the config, its data, the plan, output, model, advice."""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tpurun.doctor import Check, timed
from tpurun.errors import TpurunError
from tpurun.runtime import KERAS_19246, Machine

BYTES_PER_PARAM = 4  # float32 weights in a checkpoint
SLOTS = 3  # weights + two Adam moments
MODEL_TIMEOUT = 45.0  # seconds for the CPU child that builds the model and runs one step


def _globs(value: str | list[str] | None) -> list[str]:
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


def _size(path: str) -> int:
    import tensorflow as tf

    return int(tf.io.gfile.stat(path).length)


def check_config(cfg: Any) -> Check:
    data = {"name": cfg.name, "base_dir": str(cfg.base_dir), "config": cfg.to_dict()}
    return Check("config", "ok", f"valid ({cfg.name}; relative paths from {cfg.base_dir})", None,
                 data)  # fmt: skip


def check_split(cfg: Any, split: str, m: Machine, replicas: int | None) -> Check:
    """Files, bytes, the first record against the features, TPU-node reach, shard advice."""
    from tpurun.data import pipeline

    name = f"data.{split}"
    globs = [cfg.resolve_path(g) for g in _globs(getattr(cfg.data, split))]
    if not globs:
        return Check(name, "skip", f"no data.{split} set")
    files = pipeline.expand(globs)
    total = sum(_size(f) for f in files)
    data: dict[str, Any] = {"globs": globs, "files": len(files), "bytes": total}
    local = [g for g in globs if "://" not in g]
    if m.tpu_node and not m.tpu_vm and local:
        return Check(name, "fail", f"{local[0]} is a local path, and a TPU node cannot read this "
                     "machine's disk", "copy the data to gs:// (gsutil -m cp), or use a TPU VM",
                     data)  # fmt: skip
    if cfg.data.features:
        pipeline.check_first_record(files, cfg.data.features, cfg.data.compression)
        data["first_record"] = "matches data.features"
    found = f"{len(files)} file(s), {total / 1e6:.1f} MB; first record matches the features"
    if not cfg.data.features:
        found = f"{len(files)} file(s), {total / 1e6:.1f} MB (features from the schema file)"
    if split == "train" and replicas and len(files) < replicas:
        return Check(name, "warn", found + f"; fewer files than the {replicas} replicas",
                     f"write >= {replicas} shards (tpurun data write --shards {replicas * 4}) so "
                     "reads run in parallel", data)  # fmt: skip
    if split == "train" and len(files) == 1 and total > 100e6:
        return Check(name, "warn", found + "; one large file reads on one thread",
                     "write 16+ shards (tpurun data write --shards 16)", data)  # fmt: skip
    return Check(name, "ok", found, None, data)


def data_checks(cfg: Any, m: Machine, replicas: int | None) -> list[Check]:
    out = []
    for split in ("train", "validation"):

        def one(split=split):
            try:
                return check_split(cfg, split, m, replicas)
            except TpurunError as exc:
                return Check(
                    f"data.{split}",
                    "fail",
                    exc.message,
                    exc.hint or "fix the path or data.features as the message says",
                )

        out += timed(f"data.{split}", one)
    return out


def make_plan(cfg: Any, m: Machine, choice: Any, devices: dict) -> tuple[Any, Any, Any]:
    """The plan ``train`` would derive, the prepared runtime when it ran on this CPU, and the
    effective data section (features filled in from a schema).

    On the CPU this is :func:`tpurun.runner.prepare` itself. On an accelerator, activating it
    here would hold it (and the libtpu lock) in doctor's process, so the same pieces run without
    activation, with the replica count from the device probe.
    """
    from tpurun.plan import make_plan as plan_for

    if choice.accelerator == "cpu":
        from tpurun.runner import prepare

        prepared = prepare(cfg, machine=m)
        return prepared.plan, prepared, prepared.data
    from tpurun.data.resolve import resolve

    replicas = choice.replicas
    if replicas is None:
        replicas = devices.get("jax", {}).get("platforms", {}).get("tpu")
    if not replicas:
        raise TpurunError("the TPU core count is unknown (the device probe found no TPU core)")
    resolved = resolve(cfg)
    return plan_for(cfg, choice, replicas, resolved), None, resolved.data


def check_plan(plan: Any) -> Check:
    data = plan.to_dict()
    finding = (
        f"{plan.replicas} replica(s) x {plan.per_core_batch_size} = global batch "
        f"{plan.global_batch_size}; LR {plan.learning_rate:g} (x{plan.learning_rate_factor:g}); "
        f"{plan.steps_per_epoch} steps/epoch, {plan.validation_steps} validation steps, "
        f"steps_per_execution {plan.steps_per_execution}"
    )
    return Check("plan", "ok", finding, None, data)


def check_model(prepared: Any) -> tuple[Check, int | None]:
    """Build the model and run one training step on one real batch (on this CPU)."""
    import keras
    import numpy as np

    from tpurun.data import pipeline
    from tpurun.model import build_model, compile_model

    cfg, plan, runtime = prepared.config, prepared.plan, prepared.runtime
    try:
        ds = pipeline.make_dataset(plan.train_files, prepared.data, plan.global_batch_size,
                                   training=True, seed=cfg.seed)  # fmt: skip
        x, y = next(iter(ds.take(1)))
        with runtime.scope():
            model = build_model(cfg, plan.backend)
            compile_model(model, cfg, plan)
        started = time.monotonic()
        try:
            # As numpy: every backend takes it (JAX cannot read tf.Tensors).
            x, y = keras.tree.map_structure(lambda t: t.numpy(), (x, y))
            logs = model.train_on_batch(x, y, return_dict=True)
        except ValueError as exc:
            first = str(exc).strip().splitlines()[0]
            return Check(
                "model",
                "fail",
                f"the model does not fit the data: {first}",
                "match the model's inputs/outputs to data.inputs / data.targets",
            ), None
        step = time.monotonic() - started
    except TpurunError as exc:
        return Check("model", "fail", exc.message, exc.hint or "fix the model section"), None
    finally:
        runtime.release()
    params = int(model.count_params())
    per_replica = params * BYTES_PER_PARAM * SLOTS
    loss = float(np.asarray(logs.get("loss", np.nan)))
    data = {"params": params, "bytes_per_replica": per_replica, "loss": loss,
            "step_seconds": round(step, 3), "batch": plan.global_batch_size}  # fmt: skip
    finding = (f"{model.name}: {params:,} parameters, ~{per_replica / 1e6:.1f} MB per replica "
               f"(weights + optimizer slots); one step on a batch of {plan.global_batch_size} "
               f"took {step:.2f} s, loss {loss:.4g}")  # fmt: skip
    if not math.isfinite(loss):
        return Check(
            "model",
            "fail",
            finding + ": the loss is not finite",
            "check the inputs' values and lower train.learning_rate.base",
            data,
        ), params
    return Check("model", "ok", finding, None, data), params


_MODEL_ON_CPU = """
import json, os
from dataclasses import asdict
from pathlib import Path
from tpurun.config import load_config
from tpurun.doctor.config_checks import check_model
from tpurun.runner import prepare
cfg = load_config(__CONFIG__, ["runtime.accelerator=cpu", "runtime.cpu_devices=1"])
cfg._base_dir = Path(__BASE_DIR__)
check, params = check_model(prepare(cfg))
print(__MARK__ + json.dumps({"check": asdict(check), "params": params}))
"""


def check_model_on_cpu(cfg: Any, timeout: float) -> tuple[Check, int | None]:
    """The model step for a config that trains on an accelerator: in a CPU-only child process, so
    doctor never initialises (or locks) the TPU or GPU itself."""
    from tpurun.doctor.probes import Child, _child_env, _code

    code = _code(_MODEL_ON_CPU, config=cfg.to_dict(), base_dir=str(cfg.base_dir))
    answer = Child(
        code, timeout, env=_child_env({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    ).result()
    if "check" not in answer:
        status = "warn" if answer.get("timed_out") else "fail"
        return Check("model", status, f"the CPU model check failed: {answer.get('error')}",
                     "run `tpurun train` with --set runtime.accelerator=cpu to see the whole error"), None  # fmt: skip
    check = Check(**answer["check"])
    check.finding += " (checked on the CPU)"
    return check, answer["params"]


def check_resume(cfg: Any, plan: Any, effective_data: Any) -> Check:
    """What ``tpurun train`` will do with the run directory: start, resume, or refuse to resume.

    ``plan`` and ``effective_data`` (the data section, features filled in) come from the plan check; None without one.
    """
    from tpurun import resume as resume_lib

    run_dir = Path(cfg.output.dir) / cfg.name
    point = resume_lib.latest(run_dir / resume_lib.CHECKPOINTS)
    if point is None:
        return Check("resume", "ok", f"no checkpoint in {run_dir}: training starts at epoch 1")
    data = {"state": str(point.source), "epoch": point.position[0], "step": point.position[1]}
    if plan is None:
        return Check("resume", "skip", f"{point.describe()}; not compared with the config (no "
                     "plan, see the plan check)", None, data)  # fmt: skip
    effective = {**cfg.to_dict(), "data": effective_data.model_dump(mode="json")}
    try:
        resume_lib.check_unchanged(point, resume_lib.identity(effective, plan))
    except TpurunError as exc:
        return Check("resume", "fail", exc.message, "undo the change, or train with --restart",
                     data)  # fmt: skip
    if point.position[0] >= cfg.train.epochs:
        return Check("resume", "ok", f"{run_dir} has finished its {cfg.train.epochs} epoch(s); "
                     "raise train.epochs to train further", None, data)  # fmt: skip
    return Check("resume", "ok", f"train will be {point.describe()}", None, data)


def check_output(cfg: Any, params: int | None) -> Check:
    out = cfg.output.dir
    data: dict[str, Any] = {"dir": out}
    path = Path(out).resolve()
    existing = path
    while not existing.exists():
        existing = existing.parent
    data["checked"] = str(existing)
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".tpurun-doctor-"):
            pass
    except OSError as exc:
        return Check("output", "fail", f"{existing} is not writable: {exc.strerror}",
                     "choose another folder with --output or output.dir", data)  # fmt: skip
    free = shutil.disk_usage(existing).free
    data["free_bytes"] = free
    estimate = params * BYTES_PER_PARAM * SLOTS if params else None
    data["checkpoint_bytes"] = estimate
    found = f"{path} is writable; {free / 1e9:.1f} GB free"
    if estimate:
        found += f", a checkpoint is ~{estimate / 1e6:.2f} MB"
        if free < 3 * estimate:  # latest + best + room to write the next one atomically
            return Check("output", "fail" if free < estimate else "warn",
                         found + ": not enough room for the checkpoints",
                         "free disk space, or point --output at a bigger disk", data)  # fmt: skip
    return Check("output", "ok", found, None, data)


def check_advice(cfg: Any, choice: Any, plan: Any) -> Check:
    notes: list[str] = []
    fixes: list[str] = []
    if plan is not None:
        per_core = plan.per_core_batch_size
        replicas = plan.replicas
    else:
        per_core = cfg.train.per_core_batch_size or 16
        replicas = choice.replicas if choice and choice.replicas else 1
    if per_core < 8 or per_core % 8:
        notes.append(f"per-core batch {per_core} is "
                     f"{'below 8' if per_core < 8 else 'not a multiple of 8'}")  # fmt: skip
        fixes.append("use a multiple of 8 per core; 128 per core is the TPU sweet spot")
    precision = choice.precision if choice else cfg.runtime.precision
    accelerator = choice.accelerator if choice else None
    if precision == "mixed_float16" and accelerator == "tpu":
        notes.append("mixed_float16 on a TPU")
        fixes.append("set runtime.precision: mixed_bfloat16")
    spe = cfg.train.steps_per_execution
    if choice and choice.backend == "tensorflow" and replicas > 1 and accelerator != "tpu":
        if spe == "auto":
            notes.append(f"steps_per_execution auto resolves to 1 on TensorFlow with {replicas} "
                         f"replicas ({KERAS_19246})")  # fmt: skip
            fixes.append("runtime.backend: jax runs several steps per execution here")
    elif plan is not None and plan.steps_per_execution == 1 and plan.steps_per_epoch > 1:
        notes.append("steps_per_execution 1: one host round trip per step")
        fixes.append("set train.steps_per_execution: auto (or 8-32) on a TPU")
    data = {"per_core_batch_size": per_core, "replicas": replicas, "precision": precision,
            "steps_per_execution": plan.steps_per_execution if plan else spe,
            "plan_warnings": list(plan.warnings) if plan else []}  # fmt: skip
    if plan is not None:
        for warning in plan.warnings:
            if warning not in notes and "per-core batch" not in warning:
                notes.append(warning)
    if not notes:
        return Check("advice", "ok", f"per-core batch {per_core} x {replicas} replica(s), "
                     f"{precision}, steps_per_execution {data['steps_per_execution']}: nothing to "
                     "change", None, data)  # fmt: skip
    return Check("advice", "warn", "; ".join(notes), fixes[0] if fixes else notes[0], data)


def run(cfg: Any, m: Machine, holder: list, devices: dict, with_model: bool) -> list[Check]:
    import os

    from tpurun.process import import_tensorflow

    choice = holder[0] if holder else None
    if choice is not None and choice.accelerator == "cpu" and "keras" not in sys.modules:
        # Set the process up as train would, before the data checks start TensorFlow: TF imports
        # Keras (fixing its backend) and fixes its CPU device count when it first runs an op.
        from tpurun.process import activate

        try:
            activate(choice, cfg.seed)
        except TpurunError:
            pass  # the plan check reports it
    elif choice is not None and "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = choice.backend  # never activate an accelerator here
    import_tensorflow()  # quietly, before the data checks import it
    checks = timed("config", lambda: check_config(cfg))
    replicas = choice.replicas if choice else None
    if choice and replicas is None:
        replicas = devices.get("jax", {}).get("platforms", {}).get("tpu")
    data = data_checks(cfg, m, replicas)
    checks += data
    plan = prepared = effective_data = None
    if choice is None:
        checks.append(Check("plan", "skip", "no runtime was chosen (see the choice check)"))
    elif any(c.status == "fail" for c in data):
        checks.append(Check("plan", "skip", "the data is not readable (see the data checks)"))
    else:

        def plan_check():
            nonlocal plan, prepared, effective_data
            try:
                plan, prepared, effective_data = make_plan(cfg, m, choice, devices)
            except TpurunError as exc:
                return Check("plan", "fail", exc.message, exc.hint or "fix the train section")
            return check_plan(plan)

        checks += timed("plan", plan_check)
    params = None
    if not with_model:
        checks.append(Check("model", "skip", "skipped (with_model=False)"))
    elif prepared is None:
        if plan is None:
            checks.append(Check("model", "skip", "no plan (see the plan check)"))
        else:

            def model_on_cpu():
                nonlocal params
                check, params = check_model_on_cpu(cfg, MODEL_TIMEOUT)
                return check

            checks += timed("model", model_on_cpu)
    else:

        def model_check():
            nonlocal params
            check, params = check_model(prepared)
            return check

        checks += timed("model", model_check)
    checks += timed("resume", lambda: check_resume(cfg, plan, effective_data))
    checks += timed("output", lambda: check_output(cfg, params))
    checks += timed("advice", lambda: check_advice(cfg, choice, plan))
    return checks


__all__ = ["run"]
