"""Build a config's model and run one training step on the CPU (doctor's ``model`` check, for a
config that trains on a TPU or GPU).

Run by :func:`tpurun.doctor.model_check.check_model_on_cpu` as ``python -m
tpurun.doctor.scripts.model_step '{"config": {...}, "base_dir": "/path"}'``, in a child whose
environment hides the accelerators (JAX_PLATFORMS=cpu, CUDA_VISIBLE_DEVICES empty): the config is
set to one CPU device (as many as a model axis has: ``cpu_overrides``) and the process is set up
as ``train`` sets its own (:func:`tpurun.runtime.activate.activate`), then
:func:`tpurun.doctor.model_check.check_model` runs.

Answer: ``{"check": <the Check as a dict>, "params": int | None}``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from tpurun.doctor.child import payload, reply


def load(asked: dict[str, Any]) -> Any:
    """The config, on one CPU device, with relative paths from the folder the parent's were."""
    from tpurun.config import load_config
    from tpurun.doctor.model_check import cpu_overrides

    cfg = load_config(asked["config"], cpu_overrides(asked["config"]))
    cfg._base_dir = Path(asked["base_dir"])
    return cfg


def main() -> None:
    from tpurun.doctor.model_check import check_model
    from tpurun.plan.prepare import choose_for, prepare
    from tpurun.runtime.activate import activate

    cfg = load(payload())
    choice = choose_for(cfg)
    runtime = activate(choice, cfg.seed)
    check, params = check_model(prepare(cfg, choice, runtime.replicas), runtime)
    reply({"check": asdict(check), "params": params})


if __name__ == "__main__":
    main()
