"""JAX's persistent compilation cache: a run compiles each program once per machine, not per launch.

On the JAX backend every launch compiles the training, evaluation and prediction steps again
(seconds on a CPU, minutes for a large model on a TPU), although a rerun, a resume after a
preemption or an ``evaluate`` of the same run compiles the very same programs. JAX can keep the
compiled executables on disk and load them instead; it does so only when a folder is set, and by
default only for compiles over a second. tpurun sets it up as MaxText does, before the first
compile (:func:`install`):

* the folder: ``runtime.compilation_cache`` (``auto``: ``JAX_COMPILATION_CACHE_DIR`` where set,
  else ``~/.cache/tpurun/jax``, or ``jax`` under ``$TPURUN_CACHE_DIR``; ``false``: off);
* every program is kept, however quick its compile (``jax_persistent_cache_min_compile_time_secs``
  0: on a CPU or for a small model each compile is well under a second, and together they are most
  of the start-up; measured in docs/benchmarks.md);
* the folder is not bounded, as JAX and MaxText leave it: JAX's own bound
  (``JAX_COMPILATION_CACHE_MAX_SIZE``, which needs filelock) scans every entry under a file lock at
  each write, and in a test suite sharing a folder of a few thousand entries between processes it
  held one command up for a minute. ``tpurun doctor`` says how large the folder is.

A JAX setting the user has set through its own environment variable
(``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS``, ``JAX_COMPILATION_CACHE_MAX_SIZE``) is left as
it is. JAX writes entries from process 0 only; the cache key covers the program, the devices, the
compile options and the JAX and XLA versions, so a stale entry is never loaded. An entry that
cannot be read is compiled again (JAX warns). The TensorFlow backend has no such cache.

A folder named in the config that cannot be made or written is refused before anything starts;
the ``auto`` folder that cannot is passed over with one line of warning: the cache saves time, the
run does not depend on it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from tpurun import frameworks
from tpurun.errors import EnvironmentSetupError
from tpurun.storage import fileio

_HITS = "/jax/compilation_cache/cache_hits"
_MISSES = "/jax/compilation_cache/cache_misses"


def default_folder(env: Mapping[str, str]) -> str:
    """``JAX_COMPILATION_CACHE_DIR``, else ``jax`` in tpurun's own cache (``~/.cache/tpurun/jax``,
    or under ``$TPURUN_CACHE_DIR``)."""
    return env.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(fileio.user_cache(), "jax")


def resolve(setting: str | bool, env: Mapping[str, str]) -> tuple[str | None, str | None]:
    """The folder for ``runtime.compilation_cache`` and a warning, if any.

    Returns:
        ``(folder, None)``; ``(None, None)`` when switched off; ``(None, warning)`` when the
        ``auto`` folder cannot be used.

    Raises:
        EnvironmentSetupError: a folder named in the config cannot be made or written.
    """
    if setting is False:
        return None, None
    named = setting not in (True, "auto")
    folder = str(setting) if named else default_folder(env)
    if "://" in folder:
        raise EnvironmentSetupError(
            f"runtime.compilation_cache: '{setting}' is not a local folder. JAX's compilation "
            "cache is kept on this machine's disk: name a local folder, or set it to auto."
        )
    folder = os.path.abspath(os.path.expanduser(folder))
    problem = _unwritable(Path(folder))
    if problem is None:
        return folder, None
    if named:
        raise EnvironmentSetupError(
            f"runtime.compilation_cache: cannot use '{folder}' ({problem}). Name a folder this "
            "user can write, set it to auto, or to false to compile afresh each time."
        )
    return None, f"the compilation cache is off: cannot use {folder} ({problem})"


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot hold the cache (made here if missing), or None."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return "a file of that name is in the way"
    except OSError as exc:
        return exc.strerror or str(exc)
    if not os.access(folder, os.W_OK | os.X_OK):
        return "not writable by this user"
    return None


def contents(folder: str) -> tuple[int, int]:
    """The programs kept in ``folder`` and their bytes (0, 0 for a folder not made yet)."""
    entries = [p for p in Path(folder).glob("*-cache") if p.is_file()]
    return len(entries), sum(p.stat().st_size for p in entries)


@dataclass
class Use:
    """What the cache did in this process: programs loaded from it (hits) and compiled (misses)."""

    folder: str | None = None
    hits: int = 0
    misses: int = 0
    _listening: bool = field(default=False, repr=False)

    def _count(self, event: str, **_: object) -> None:
        if event == _HITS:
            self.hits += 1
        elif event == _MISSES:
            self.misses += 1

    def reset(self, folder: str | None) -> None:
        """A new run in this process: its own counts."""
        self.folder, self.hits, self.misses = folder, 0, 0

    def as_dict(self) -> dict:
        return {"folder": self.folder, "loaded": self.hits, "compiled": self.misses}


#: This process's use of the cache (one per process: JAX's cache is process-wide).
use = Use()


def install(folder: str | None) -> None:
    """Point JAX at ``folder`` (None: no cache) for what it compiles from here on.

    JAX settles on its cache at its first compile; in a notebook kernel the next run may name
    another folder, or none, so JAX's cache is reset first (its public ``reset_cache``).
    """
    jax = frameworks.jax()

    frameworks.jax("experimental.compilation_cache.compilation_cache").reset_cache()
    use.reset(folder)
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_enable_compilation_cache", folder is not None)
    if folder is None:
        return
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if not use._listening:
        jax.monitoring.register_event_listener(use._count)
        use._listening = True
