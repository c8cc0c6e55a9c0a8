"""tpurun's version: one place, read by the package, the CLI and the build (pyproject.toml)."""

__version__ = "0.1.0"
