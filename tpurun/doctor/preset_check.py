"""Doctor's ``model.preset`` check: is the preset folder complete, and does the task fit it?

The files are read without Keras (:func:`tpurun.hub.preset.read`), so the check runs on any
machine. Where doctor has set its own process up (a config that trains on the CPU), the task class
is checked against the preset's backbone here too; elsewhere the ``model`` check, which builds the
model in a CPU child process, says so. A ``kaggle://`` or ``hf://`` handle is checked for a network
that reaches its hub.
"""

from __future__ import annotations

from typing import Any

from tpurun import frameworks
from tpurun.doctor.check import Check
from tpurun.errors import TpurunError
from tpurun.hub import preset as presets
from tpurun.hub.task import task_class

NAME = "model.preset"
FIX = "copy the whole preset folder, or fix model.preset / model.task as the message says"


def check_preset(cfg: Any) -> Check:
    if cfg.model.preset is None:
        return Check(NAME, "skip", "no model.preset: a factory builds the model")
    try:
        preset = presets.read(cfg)  # a handle: its hub reached, its configs fetched
        task = cfg.model.task or preset.default_task()
        checked = frameworks.backend() is not None  # doctor set this process up: KerasHub may come
        if checked:
            task = task_class(preset, cfg.model.task).__name__
    except TpurunError as exc:
        return Check(NAME, "fail", exc.message, FIX)
    data = {"location": preset.location, "remote": preset.remote, "backbone": preset.backbone,
            "saved_task": preset.saved_task, "task": task,
            "max_sequence_length": preset.max_sequence_length,
            "sequence_length": cfg.model.sequence_length}  # fmt: skip
    found = "reachable, its weights downloaded when train starts" if preset.remote else "complete"
    fit = "fits it" if checked else "is checked by the model check"
    length = cfg.model.sequence_length or "the preset's own"
    return Check(
        NAME,
        "ok",
        f"{preset.location}: {found} ({preset.backbone}, saved as "
        f"{preset.saved_task or 'a backbone'}); task {task} {fit}; sequence length "
        f"{length}",
        None,
        data,
    )


__all__ = ["check_preset"]
