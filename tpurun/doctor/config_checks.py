"""Checks of a config on this machine: the config, its data, the plan, output, model, advice."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from tpurun import frameworks
from tpurun.data import files as datafiles
from tpurun.data import records
from tpurun.data.resolve import path_resolver
from tpurun.doctor.cache_check import check_compilation_cache
from tpurun.doctor.check import Check, timed
from tpurun.doctor.memory import check_memory
from tpurun.doctor.model_check import (
    BYTES_PER_PARAM,
    MODEL_TIMEOUT,
    SLOTS,
    check_model,
    check_model_on_cpu,
)
from tpurun.doctor.preset_check import check_preset
from tpurun.errors import TpurunError
from tpurun.plan.prepare import prepare
from tpurun.runtime.activate import activate
from tpurun.runtime.choice import KERAS_19246
from tpurun.runtime.machine import Machine
from tpurun.storage import fileio
from tpurun.storage.fileio import StorageError
from tpurun.storage.rundir import RunDir, run_path
from tpurun.training.checkpoints import resume as resume_lib


def _globs(value: str | list[str] | None) -> list[str]:
    if not value:
        return []
    return [value] if isinstance(value, str) else list(value)


def _size(path: str) -> int:
    return fileio.size(path)


def check_reader(reader: Any) -> Check:
    """What ``train`` will read the records with, and why: the reader :func:`tpurun.plan.prepare.prepare`
    chose (:func:`tpurun.data.reader.choose`, the very call train makes)."""
    return Check(
        "reader",
        "ok",
        f"{reader.name} ({reader.reason})",
        None,
        {"reader": reader.name, "reason": reader.reason},
    )


def _plan_fix(exc: TpurunError) -> str:
    """What to change for a plan that failed: the section its message names."""
    for key in ("data.reader", "model.preset"):
        if exc.message.startswith(key):
            return f"change {key} or the environment as the message says"
    for key in ("data.packing", "data.chat_template"):  # the records' write (records_check)
        if exc.message.startswith(key):
            return f"write the records as {key} says (the command above), or change {key}"
    return "fix the train section"


def check_config(cfg: Any) -> Check:
    data = {"name": cfg.name, "base_dir": str(cfg.base_dir), "config": cfg.to_dict()}
    return Check(
        "config", "ok", f"valid ({cfg.name}; relative paths from {cfg.base_dir})", None, data
    )


def check_split(cfg: Any, split: str, m: Machine, replicas: int | None) -> Check:
    """Files, bytes, the first record against the features, TPU-node reach, shard advice.

    Paths are resolved as ``train`` resolves them (``resolve.path_resolver``: data.kaggle_dataset's
    root when set, else the config file's folder), so both read the same files.
    """
    name = f"data.{split}"
    patterns = _globs(getattr(cfg.data, split))
    if not patterns:
        return Check(name, "skip", f"no data.{split} set")
    rule = path_resolver(cfg)
    globs = [rule(g) for g in patterns]
    files = datafiles.expand(patterns, rule, key=name)
    total = sum(_size(f) for f in files)
    data: dict[str, Any] = {"globs": globs, "files": len(files), "bytes": total}
    local = [g for g in globs if "://" not in g]
    if m.tpu_node and not m.tpu_vm and local:
        return Check(
            name,
            "fail",
            f"{local[0]} is a local path, and a TPU node cannot read this machine's disk",
            "copy the data to gs:// (gsutil -m cp), or use a TPU VM",
            data,
        )
    if cfg.data.features:
        records.check_first_record(files, cfg.data.features, cfg.data.compression)
        data["first_record"] = "matches data.features"
    found = f"{len(files)} file(s), {total / 1e6:.1f} MB; first record matches the features"
    if not cfg.data.features:
        found = f"{len(files)} file(s), {total / 1e6:.1f} MB (features from the schema file)"
    rewrite = "write the data again from its source (CSV, arrays or images)"
    if split == "train" and replicas and len(files) < replicas:
        return Check(
            name,
            "warn",
            found + f"; fewer files than the {replicas} replicas",
            f"{rewrite} as a multiple of {replicas} shards, so that every replica reads "
            f"its own: `tpurun data write SOURCE OUT_PREFIX --shard-multiple {replicas}`",
            data,
        )
    if split == "train" and len(files) == 1 and total > 100e6:
        return Check(
            name,
            "warn",
            found + "; one large file reads on one thread",
            f"{rewrite} as 8 or more shards of about 150 MB: "
            "`tpurun data write SOURCE OUT_PREFIX --shard-mb 150 --shard-multiple 8`",
            data,
        )
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
                    "fix the path or data.features as the message says",
                )

        out += timed(f"data.{split}", one)
    return out


def _replicas(choice: Any, devices: dict) -> int:
    """The replica count train would get, without activating an accelerator here: the choice's,
    or the TPU core count from the device probe (which ran in a child process)."""
    replicas = choice.replicas or devices.get("jax", {}).get("platforms", {}).get("tpu")
    if not replicas:
        raise TpurunError("the TPU core count is unknown (the device probe found no TPU core)")
    return replicas


def check_plan(plan: Any) -> Check:
    data = plan.to_dict()
    finding = (
        f"{plan.replicas} replica(s) x {plan.per_core_batch_size} = global batch "
        f"{plan.global_batch_size}; LR {plan.learning_rate:g} (x{plan.learning_rate_factor:g}); "
        f"{plan.steps_per_epoch} steps/epoch, {plan.validation_steps} validation steps, "
        f"steps_per_execution {plan.steps_per_execution}"
    )
    return Check("plan", "ok", finding, None, data)


def check_resume(cfg: Any, prepared: Any) -> Check:
    """What ``tpurun train`` will do with the run directory: start, resume, or refuse to resume.

    ``prepared`` comes from the plan check; None without one.
    """
    run_dir = run_path(cfg.output.dir, cfg.name)
    run = RunDir(run_dir)
    try:
        locked, point = run.is_locked(), resume_lib.latest(run)
    except StorageError as exc:  # the gcs.reachable check says why, and what to do
        return Check("resume", "skip", f"cannot read {run_dir}: {exc.message}")
    except resume_lib.DamagedCheckpoint as exc:
        return Check(
            "resume",
            "fail",
            exc.message,
            "pass --resume PATH, or start over with --restart or --output DIR",
        )
    if locked:
        return Check(
            "resume",
            "warn",
            f"{run_dir} is being trained right now by another process",
            "wait for it to finish, or train this config elsewhere (--output)",
        )
    if point is None:
        return Check("resume", "ok", f"no checkpoint in {run_dir}: training starts at epoch 1")
    data = {"state": str(point.source), "epoch": point.position[0], "step": point.position[1]}
    if prepared is None:
        return Check(
            "resume",
            "skip",
            f"{point.describe()}; not compared with the config (no plan, see the plan check)",
            None,
            data,
        )
    try:
        resume_lib.check_unchanged(
            point,
            resume_lib.identity(prepared.effective(), prepared.plan, prepared.data.train_files),
        )
    except TpurunError as exc:
        return Check(
            "resume", "fail", exc.message, "undo the change, or train with --restart", data
        )
    if point.position[0] >= cfg.train.epochs:
        return Check(
            "resume",
            "ok",
            f"{run_dir} has finished its {cfg.train.epochs} epoch(s); "
            "raise train.epochs to train further",
            None,
            data,
        )
    if point.damaged:
        return Check(
            "resume",
            "warn",
            f"train will be {point.describe()}: {point.fallback_note()}",
            None,
            data,
        )
    return Check("resume", "ok", f"train will be {point.describe()}", None, data)


def check_output(cfg: Any, params: int | None) -> Check:
    """Whether the run directory's folder can be written, with room for the checkpoints.

    A bucket is not written from here: the GCS probe writes and deletes a test object there, in a
    child process with a timeout (``gcs.reachable``), so doctor never waits on storage itself.
    """
    out = cfg.output.dir
    data: dict[str, Any] = {"dir": out}
    if out.startswith("gs://"):
        data["run_dir"] = run_path(out, cfg.name)
        return Check(
            "output",
            "skip",
            f"{data['run_dir']} is in a bucket: gcs.reachable writes "
            "and deletes a test object in it",
            None,
            data,
        )
    path = Path(out).resolve()
    existing = path
    while not existing.exists():
        existing = existing.parent
    data["checked"] = str(existing)
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".tpurun-doctor-"):
            pass
    except OSError as exc:
        return Check(
            "output",
            "fail",
            f"{existing} is not writable: {exc.strerror}",
            "choose another folder with --output or output.dir",
            data,
        )
    free = shutil.disk_usage(existing).free
    data["free_bytes"] = free
    estimate = params * BYTES_PER_PARAM * SLOTS if params else None
    data["checkpoint_bytes"] = estimate
    found = f"{path} is writable; {free / 1e9:.1f} GB free"
    if estimate:
        found += f", a checkpoint is ~{estimate / 1e6:.2f} MB"
        if free < 3 * estimate:  # latest + best + room to write the next one atomically
            return Check(
                "output",
                "fail" if free < estimate else "warn",
                found + ": not enough room for the checkpoints",
                "free disk space, or point --output at a bigger disk",
                data,
            )
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
        notes.append(
            f"per-core batch {per_core} is {'below 8' if per_core < 8 else 'not a multiple of 8'}"
        )
        fixes.append("use a multiple of 8 per core; 128 per core is the TPU sweet spot")
    precision = choice.precision if choice else cfg.runtime.precision
    accelerator = choice.accelerator if choice else None
    if precision == "mixed_float16" and accelerator == "tpu":
        notes.append("mixed_float16 on a TPU")
        fixes.append("set runtime.precision: mixed_bfloat16")
    spe = cfg.train.steps_per_execution
    if choice and choice.backend == "tensorflow" and replicas > 1 and accelerator != "tpu":
        if spe == "auto":
            notes.append(
                f"steps_per_execution auto resolves to 1 on TensorFlow with {replicas} "
                f"replicas ({KERAS_19246})"
            )
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
        return Check(
            "advice",
            "ok",
            f"per-core batch {per_core} x {replicas} replica(s), "
            f"{precision}, steps_per_execution {data['steps_per_execution']}: nothing to "
            "change",
            None,
            data,
        )
    return Check("advice", "warn", "; ".join(notes), fixes[0] if fixes else notes[0], data)


def run(cfg: Any, m: Machine, holder: list, devices: dict, with_model: bool) -> list[Check]:
    choice = holder[0] if holder else None
    runtime = activation_error = None
    if choice is not None and choice.accelerator == "cpu":
        # Set the process up as train would, before the data checks start TensorFlow: TF imports
        # Keras (fixing its backend) and fixes its CPU device count when it first runs an op.
        try:
            runtime = activate(choice, cfg.seed)
        except TpurunError as exc:
            activation_error = exc  # the plan check reports it
    elif choice is not None and "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = choice.backend  # never activate an accelerator here
    if m.tensorflow and (
        cfg.data.reader == "tf_data" or (choice and choice.backend == "tensorflow")
    ):
        frameworks.tensorflow()  # quietly, before anything else imports it (the native reader never does)
    checks = timed("config", lambda: check_config(cfg))
    if cfg.model.preset is not None:
        checks += timed("model.preset", lambda: check_preset(cfg))
    replicas = choice.replicas if choice else None
    if choice and replicas is None:
        replicas = devices.get("jax", {}).get("platforms", {}).get("tpu")
    data = data_checks(cfg, m, replicas)
    checks += data
    prepared = None
    if choice is None:
        checks.append(Check("plan", "skip", "no runtime was chosen (see the choice check)"))
    elif any(c.status == "fail" for c in data):
        checks.append(Check("plan", "skip", "the data is not readable (see the data checks)"))
    else:

        def plan_check():
            nonlocal prepared
            try:
                if activation_error is not None:
                    raise activation_error
                prepared = prepare(
                    cfg, choice, runtime.replicas if runtime else _replicas(choice, devices)
                )
            except TpurunError as exc:
                return Check("plan", "fail", exc.message, _plan_fix(exc))
            return check_plan(prepared.plan)

        checks += timed("plan", plan_check)
        if prepared is not None:
            checks.append(check_reader(prepared.reader))
    checks.append(check_compilation_cache(cfg.runtime.compilation_cache, choice))
    params = None
    if not with_model:
        checks.append(Check("model", "skip", "skipped (with_model=False)"))
    elif prepared is None:
        checks.append(Check("model", "skip", "no plan (see the plan check)"))
    else:

        def model_check():
            nonlocal params
            if runtime is not None:
                check, params = check_model(prepared, runtime)
            else:
                check, params = check_model_on_cpu(cfg, MODEL_TIMEOUT)
            return check

        checks += timed("model", model_check)
    if prepared is not None and with_model:
        checks += timed("memory", lambda: check_memory(cfg, prepared, devices))
    plan = prepared.plan if prepared else None
    checks += timed("resume", lambda: check_resume(cfg, prepared))
    checks += timed("output", lambda: check_output(cfg, params))
    checks += timed("advice", lambda: check_advice(cfg, choice, plan))
    return checks


__all__ = ["run"]
