"""Doctor's ``compilation_cache`` check: where JAX keeps this config's compiled programs, and how
much the folder holds (see :mod:`tpurun.runtime.compile_cache`)."""

from __future__ import annotations

import os
from typing import Any

from tpurun.data.advice import format_bytes
from tpurun.doctor.check import Check
from tpurun.errors import TpurunError
from tpurun.runtime import compile_cache


def check_compilation_cache(setting: bool | str, choice: Any) -> Check:
    """Where JAX keeps compiled programs for this config (runtime.compilation_cache), and how much
    it holds: a rerun or resume loads them instead of compiling again."""
    if choice is None or choice.backend != "jax":
        return Check("compilation_cache", "skip", "only the JAX backend keeps compiled programs")
    try:
        folder, warning = compile_cache.resolve(setting, os.environ)
    except TpurunError as exc:
        return Check("compilation_cache", "fail", exc.message,
                     "set runtime.compilation_cache to a folder this user can write, or auto")  # fmt: skip
    if warning is not None:
        return Check("compilation_cache", "warn", warning,
                     "set TPURUN_CACHE_DIR or runtime.compilation_cache to a writable folder")  # fmt: skip
    if folder is None:
        return Check("compilation_cache", "ok", "off (runtime.compilation_cache: false): "
                     "each launch compiles afresh")  # fmt: skip
    programs, size = compile_cache.contents(folder)
    return Check(
        "compilation_cache",
        "ok",
        f"{folder}: {programs} compiled program(s), {format_bytes(size)}; a launch loads the "
        "programs it finds there instead of compiling them",
        None,
        {"folder": folder, "programs": programs, "bytes": size},
    )
