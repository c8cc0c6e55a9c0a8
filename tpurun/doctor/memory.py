"""Doctor's ``memory`` check: the run's estimate per device (as ``tpurun config`` shows it)
against the device this machine has, before ``train`` would find out by stopping.

The device's memory comes from the devices probe (the JAX child reports the first device's kind
and ``memory_stats()["bytes_limit"]``) unless ``runtime.device_memory`` sets it; a CPU has none.
A preset's model is built on the CPU without its weights (:func:`tpurun.hub.report.describe`);
a factory's model is checked by ``train`` itself, after it is built and before it compiles.
"""

from __future__ import annotations

from typing import Any

from tpurun.doctor.check import Check
from tpurun.errors import TpurunError
from tpurun.hub.report import describe
from tpurun.runtime.memory_check import device_limit, memory_lines, run_mesh

NAME = "memory"


def check_memory(cfg: Any, prepared: Any, devices: dict[str, Any]) -> Check:

    if cfg.model.preset is None:
        return Check(
            NAME,
            "skip",
            "a model.factory model: train checks its memory per device "
            "after building it, before compiling",
        )
    probe = devices.get("jax") or {}
    kinds = probe.get("kinds") or []
    platform = prepared.choice.accelerator
    on_device = platform != "cpu" and kinds
    limit = device_limit(
        cfg,
        kind=kinds[0] if on_device else None,
        reported=probe.get("bytes_limit") if on_device else None,
    )
    mesh = run_mesh(cfg, prepared.choice, prepared.plan)
    try:
        derived = describe(cfg, prepared.choice.backend, prepared.plan, mesh, limit)
    except TpurunError as exc:
        return Check(NAME, "fail", exc.message, "fix runtime.mesh / runtime.layout as it says")
    data = {key: derived.get(key) for key in ("mesh", "layout", "memory_per_device",
                                               "device_memory")}  # fmt: skip
    finding = "; ".join(memory_lines(derived))
    if limit is None:
        return Check(
            NAME,
            "ok",
            f"{finding} (no memory limit known on the {platform.upper()}: not checked)",
            None,
            data,
        )
    if derived["device_memory"]["fits"]:
        return Check(NAME, "ok", finding, None, data)
    found = derived["device_memory"].get("fixes")
    fix = (
        "what would fit: " + "; ".join(found)
        if found
        else "no single change fits (a larger model axis, train.remat, LoRA, bfloat16, a smaller "
        "batch): combine them, or use a device with more memory"
    )
    return Check(NAME, "fail", finding, fix, data)


__all__ = ["check_memory"]
