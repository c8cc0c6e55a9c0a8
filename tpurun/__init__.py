"""tpurun: a YAML-driven Keras 3 training runner for TPUs, GPUs and CPUs.

The public Python API. Nothing heavy is imported here: Keras fixes its backend at first import, and
tpurun must choose it first.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "load_config", "train"]


def load_config(source: Any, overrides: list[str] | tuple[str, ...] = ()):
    """Load and validate a config (a YAML path or a dict); see :func:`tpurun.config.load_config`."""
    from tpurun.config import load_config as _load

    return _load(source, overrides)


def train(
    config: Any,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    output: str | None = None,
    restart: bool = False,
    resume: str | None = None,
    verbose: bool = True,
) -> dict[str, Any]:
    """Train from a notebook cell and return the run's summary.

    Args:
        config: a path to a YAML config, a dict in the same form, or a loaded Config.
        overrides: ``"dotted.key=value"`` strings, as ``--set`` takes them.
        output: overrides ``output.dir``.
        restart: start over instead of resuming the run directory.
        resume: continue from this checkpoint instead (as ``--resume``).
        verbose: print plain progress lines (they read well in a notebook cell).

    Raises:
        tpurun.errors.TpurunError: a problem with the config, data, model or environment. If Keras
            was already imported in this kernel with another backend, the message says so.
    """
    from tpurun import runner
    from tpurun.config import Config
    from tpurun.console import PlainReporter, Reporter

    cfg = config if isinstance(config, Config) else load_config(config, overrides)
    reporter = PlainReporter() if verbose else Reporter()
    return runner.run(cfg, output=output, reporter=reporter, restart=restart, resume=resume)
