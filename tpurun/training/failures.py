"""What a failure inside ``fit`` means, said as what to do about it: a damaged shard (named), a
model that does not fit the data's shapes, storage gone mid-run, TensorFlow ops on the JAX backend,
a package a callback needs. Anything else stays the unexpected failure it is (exit 1)."""

from __future__ import annotations

import re
import sys
from typing import Any

from tpurun.config import Config, DataConfig
from tpurun.data import reader as readers
from tpurun.data import records
from tpurun.errors import DataError, ModelError, TpurunError, describe
from tpurun.plan.prepare import Prepared
from tpurun.storage import fileio, space
from tpurun.training.model import TF_OPS_ON_JAX, factory_imports_tensorflow


def explain(
    exc: Exception, prepared: Prepared, model: Any, checkpoints: str, first_step: bool
) -> TpurunError | None:
    """The error to raise instead of ``exc``, or None to let it through.

    Args:
        first_step: no training step has completed yet (building and compiling the model).
    """
    # TensorFlow's errors come from the tf_data reader, which has loaded it; without it, none.
    tf_errors = getattr(sys.modules.get("tensorflow"), "errors", None)
    config = prepared.config
    if readers.damaged_record(exc):  # the native reader's DamagedRecord, TF's DataLossError
        return damaged_while_training(prepared, exc)
    if isinstance(exc, ValueError):
        # Before the first step, a ValueError is the model not fitting the data's shapes.
        return ModelError(_misfit(exc, model, config)) if first_step else None
    remote = (fileio.StorageError,) + ((tf_errors.OpError,) if tf_errors is not None else ())
    if isinstance(exc, remote):  # a bucket failed mid-run
        return fileio.training_stopped(exc, checkpoints)
    if isinstance(exc, TpurunError):
        return None  # said already
    if space.is_disk_full(exc):  # a write of a library's own (TensorBoard's event files)
        return space.disk_full(getattr(exc, "filename", None) or fileio.dirname(checkpoints))
    if first_step and prepared.plan.backend == "jax" and factory_imports_tensorflow(config):
        # Keras builds the model on a first batch (JAX arrays): TensorFlow ops fail there,
        # wrapped in errors that do not name them.
        return ModelError(
            f"the model failed before its first step ({describe(exc)}). {TF_OPS_ON_JAX}"
        )
    missing = _missing_package(exc)
    if missing is None:
        return None
    extra = ", ".join(spec.name for spec in config.callbacks.extra)
    used_by = f" (callbacks.extra: {extra})" if extra else ""
    return TpurunError(
        f"training stopped: a package is not installed: {missing}{used_by}. Install it "
        "(pip install ...), or leave out what needs it. Nothing after the last checkpoint "
        "was lost; rerunning continues."
    )


def _missing_package(exc: BaseException) -> str | None:
    """The "No module named ..." behind an exception, if a missing package caused it (TF's
    TBNotInstalledError, raised mid-fit by Keras' TensorBoard callback, wraps one)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ImportError):
            return str(exc)
        # __context__ even when suppressed: Keras re-raises callback errors "from None" to
        # shorten their tracebacks, which hides the cause.
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def damaged_while_training(prepared: Prepared, exc: Exception) -> DataError:
    """A damaged record met while training (TF's DataLossError does not say which file it was
    reading; the native reader's DamagedRecord does, and the same scan confirms it): find the
    damaged files, and say what to do."""
    files = prepared.data.train_files + prepared.data.validation_files
    found = records.find_corrupt(files, prepared.config.data.compression)
    if not found:
        first = (getattr(exc, "message", "") or str(exc)).strip().splitlines()[0]
        return DataError(f"reading the training data failed: {first}")
    if not prepared.config.data.skip_corrupt:
        return records.corrupt_error(found)
    # Damaged after the run checked it (a copy still in progress?). The verdict is remembered, so
    # the rerun leaves the file out.
    return DataError(
        f"{found[0].path}: damaged while training ({found[0].problem()}). Run the same command "
        "again: data.skip_corrupt leaves it out, and training continues from the last checkpoint."
    )


def _misfit(exc: Exception, model, config: Config) -> str:
    """Keras' shape error in one line: the line that names shapes (its first often says only
    "Exception encountered when calling Functional.call()"), and the output/target counts."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [
        line for line in lines
        if re.search(r"shape|arity|expected", line, re.I) and not line.startswith("Exception encountered")
    ]  # fmt: skip
    detail = (named or lines or [type(exc).__name__])[0]
    outputs = len(getattr(model, "outputs", None) or [])
    targets = len(DataConfig.names(config.data.targets))
    counts = ""
    if outputs and outputs != targets:
        counts = f" The model has {outputs} outputs and data.targets names {targets} feature(s)."
    return f"the model does not fit the data (data.inputs / data.targets): {detail}{counts}"
