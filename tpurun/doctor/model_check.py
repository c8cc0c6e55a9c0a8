"""Doctor's ``model`` check: build the config's model and run one training step on a real batch.

Where ``train`` would run on the CPU, the step runs here, in this process set up as ``train`` sets
its own (:func:`check_model`). Where it would use a TPU or GPU, the step runs in a CPU-only child
process (:func:`check_model_on_cpu`, the script :mod:`tpurun.doctor.scripts.model_step`), so doctor
never initialises, nor locks, the accelerator itself.
"""

from __future__ import annotations

import math
import time
from typing import Any

from tpurun.data import reader as readers
from tpurun.doctor.check import Check
from tpurun.doctor.child import Child, child_env
from tpurun.errors import ConfigError, TpurunError
from tpurun.hub import batches, mesh_layout
from tpurun.runtime import mesh
from tpurun.training.model import build_model, compile_model
from tpurun.training.monitored import resolve_monitors

BYTES_PER_PARAM = 4  # float32 weights in a checkpoint
SLOTS = 3  # weights + two Adam moments
MODEL_TIMEOUT = 45.0  # seconds for the CPU child that builds the model and runs one step
# What the child changes in the config: one CPU device, whatever train would use (with a model
# axis, as many as it has: see cpu_overrides).
CPU_OVERRIDES = ("runtime.accelerator=cpu", "runtime.cpu_devices=1")


def cpu_overrides(raw: dict[str, Any]) -> list[str]:
    """:data:`CPU_OVERRIDES` for the config ``raw``; with a model axis, a 1 x model mesh of as many
    simulated CPU devices: the layout is then checked on the model axis the run will have (an
    indivisible head count, a large weight left whole), each device holding a slice."""
    model = ((raw.get("runtime") or {}).get("mesh") or {}).get("model", 1)
    if not isinstance(model, int) or model <= 1:
        return list(CPU_OVERRIDES)
    return [CPU_OVERRIDES[0], f"runtime.cpu_devices={model}", "runtime.mesh.data=1"]


def _one_step(prepared: Any, runtime: Any) -> tuple[Any, dict[str, Any], float] | Check:
    """The model built in the runtime's scope and one step trained: (model, logs, seconds), or the
    failed check when the model does not fit the data."""
    cfg, plan = prepared.config, prepared.plan
    mesh_layout.install(runtime, cfg)  # as train builds it: split over a mesh, its layout checked
    with runtime.scope():
        model = build_model(cfg, plan.backend, data_files=prepared.data.train_files)
        mesh.check(runtime, model, cfg)
        compile_model(model, cfg, plan)
    # As train feeds a preset's task: tokenised in the pipeline, not again by the task.
    _, transform = batches.take_preprocessing(model, cfg, prepared.data.tokenized)
    ds = readers.make_dataset(
        prepared.reader,
        prepared.data.train_files,
        cfg.data,
        plan.global_batch_size,
        training=True,
        seed=cfg.seed,
        transform=transform,
    )
    batch = readers.as_numpy(readers.first_batch(ds))
    started = time.monotonic()
    try:
        x, y, *weights = batch
        logs = model.train_on_batch(x, y, *weights, return_dict=True)
    except ValueError as exc:
        first = str(exc).strip().splitlines()[0]
        return Check(
            "model",
            "fail",
            f"the model does not fit the data: {first}",
            "match the model's inputs/outputs to data.inputs / data.targets",
        )
    return model, logs, time.monotonic() - started


def check_model(prepared: Any, runtime: Any) -> tuple[Check, int | None]:
    """Build the model and run one training step on one real batch (in this process, activated)."""
    import numpy as np

    cfg, plan = prepared.config, prepared.plan
    try:
        stepped = _one_step(prepared, runtime)
        if isinstance(stepped, Check):
            return stepped, None
        model, logs, step = stepped
        resolve_monitors(model, cfg)  # the same check train makes before its first step
    except ConfigError as exc:  # a monitor, the mesh's layout, train.remat: the message names it
        return Check("model", "fail", exc.message, "change the config as the message says"), None
    except TpurunError as exc:
        return Check(
            "model", "fail", exc.message, "change the model or the config as the message says"
        ), None
    finally:
        runtime.release()
    params = int(model.count_params())
    trainable = sum(math.prod(v.shape) for v in model.trainable_weights)
    per_replica = params * BYTES_PER_PARAM * SLOTS
    loss = float(np.asarray(logs.get("loss", np.nan)))
    data = {"params": params, "trainable": trainable, "bytes_per_replica": per_replica, "loss": loss,
            "step_seconds": round(step, 3), "batch": plan.global_batch_size}  # fmt: skip
    frozen = f" ({trainable:,} trainable)" if trainable != params else ""
    finding = (
        f"{model.name}: {params:,} parameters{frozen}, ~{per_replica / 1e6:.1f} MB per replica "
        f"(weights + optimizer slots); one step on a batch of {plan.global_batch_size} "
        f"took {step:.2f} s, loss {loss:.4g}"
    )
    if not math.isfinite(loss):
        return Check("model", "fail", finding + ": the loss is not finite",
                     "check the inputs' values and lower train.learning_rate.base", data), params  # fmt: skip
    return Check("model", "ok", finding, None, data), params


def model_step_payload(cfg: Any) -> dict[str, Any]:
    """What the child is given: the config as a dict, and the folder its relative paths start in."""
    return {"config": cfg.to_dict(), "base_dir": str(cfg.base_dir)}


def from_answer(answer: dict[str, Any]) -> tuple[Check, int | None]:
    """The child's answer as the model check (and the parameter count, when the model was built)."""
    if "check" not in answer:
        status = "warn" if answer.get("timed_out") else "fail"
        return Check("model", status, f"the CPU model check failed: {answer.get('error')}",
                     "run `tpurun train` with --set runtime.accelerator=cpu to see the whole error"), None  # fmt: skip
    check = Check(**answer["check"])
    check.finding += " (checked on the CPU)"
    return check, answer["params"]


def check_model_on_cpu(cfg: Any, timeout: float) -> tuple[Check, int | None]:
    """The model step for a config that trains on an accelerator: in a CPU-only child process."""
    env = child_env({"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    child = Child.script("model_step", model_step_payload(cfg), timeout=timeout, env=env)
    return from_answer(child.result())


__all__ = ["BYTES_PER_PARAM", "MODEL_TIMEOUT", "SLOTS", "check_model", "check_model_on_cpu"]
