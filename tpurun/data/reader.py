"""Which input pipeline reads the records, decided once (``data.reader``), and the calls that build
and read either one.

Two pipelines give the same batches from the same arguments: the native one
(:mod:`tpurun.data.native.pipeline`: numpy batches, no TensorFlow) and ``tf.data``
(:mod:`tpurun.data.pipeline`). :func:`choose` picks one for a run; ``train``, ``evaluate``,
``predict``, ``export``, ``data bench`` and ``doctor`` all ask it, and build their datasets
through :func:`make_dataset` / :func:`make_ordered_dataset` with its answer.

Imports no framework: TensorFlow only inside the ``tf_data`` branches.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tpurun.config import DataConfig
from tpurun.data import pipeline, schema_file
from tpurun.data.decode import used_features
from tpurun.data.native.framing import DamagedRecord
from tpurun.errors import EnvironmentSetupError
from tpurun.frameworks import HUB_EXTRA
from tpurun.storage import fileio

NATIVE = "native"
TF_DATA = "tf_data"
#: Why ``auto`` reads most records natively where TensorFlow is installed too (docs/benchmarks.md,
#: 2 idle cores): the native reader parsed raw floats 1.15-1.28x as fast as tf.data and decoded
#: 192x192 JPEGs 1.10x as fast (its decoding threads on every core), and each such run skips
#: TensorFlow's 4-5 s import. Token ids and strings (not measured) stay on tf.data: on 2 cores the
#: native reader, using one of them, parses token ids as fast (0.98-1.06x, 2026-11-27), but
#: tf.data's C++ parses on every core (1.6 of 2 here), so it pulls ahead wherever there are more
#: (a TPU VM has 96+).
NATIVE_MEASURED = (
    "no TensorFlow import (4-5 s), and as fast as tf.data on these records or close: "
    "benchmarks/input_pipeline.py"
)
TF_DATA_MEASURED = (
    "TensorFlow is installed, and tf.data parses token ids and strings on every core, the "
    "native reader on one: benchmarks/input_pipeline.py; data.reader: native reads them "
    "without it"
)
#: The longest int64 list still read natively by ``auto`` (labels, small id lists): token ids
#: (hundreds a record) are where tf.data's parse on every core counts.
SHORT_INT64 = 16


def measured_native(features: Any) -> bool:
    """Whether every feature in ``features`` (name -> spec) is of a kind ``auto`` reads natively
    where TensorFlow is installed (see :data:`NATIVE_MEASURED`): images, raw bytes, floats, and
    int64 lists of at most :data:`SHORT_INT64` values."""
    for feature in features.values():
        if (
            feature.type == "int64"
            and math.prod(getattr(feature, "shape", None) or [1]) <= SHORT_INT64
        ):
            continue
        if feature.type not in ("image", "raw", "float"):
            return False
    return True


@dataclass(frozen=True)
class Reader:
    """The pipeline a run reads its records with, and why."""

    name: str  # native | tf_data
    reason: str

    @property
    def summary(self) -> str:
        """``reader: native (TensorFlow is not installed)``."""
        return f"reader: {self.name} ({self.reason})"

    @property
    def native(self) -> bool:
        return self.name == NATIVE


def choose(
    setting: str,
    backend: str,
    tensorflow: bool,
    preprocessing: str | None = None,
    measured: bool = False,
) -> Reader:
    """The reader for ``data.reader: setting`` on ``backend``.

    Args:
        setting: ``auto``, ``native`` or ``tf_data``.
        backend: ``jax`` or ``tensorflow``.
        tensorflow: whether TensorFlow is installed.
        preprocessing: what a preset runs inside the pipeline: ``"text"`` (its tokenizer, on
            records not written with ``--tokenize``), ``"images"`` (its image converter), or
            None (nothing: a factory's model, or tokenised records).
        measured: every feature the model reads is of a kind ``auto`` reads natively where
            TensorFlow is installed (:func:`measured_native`).

    Raises:
        EnvironmentSetupError: the setting cannot run here; the message names the key and the
            way out.
    """
    if setting == TF_DATA and not tensorflow:
        raise EnvironmentSetupError(
            "data.reader: tf_data reads through tf.data, and TensorFlow is not installed here. "
            "Set data.reader: auto (the native reader needs no TensorFlow), or install it: "
            "pip install tensorflow-cpu."
        )
    if backend == "tensorflow":
        if setting == NATIVE:
            raise EnvironmentSetupError(
                "data.reader: native feeds the JAX backend only, and this run is on the "
                "TensorFlow backend. Set data.reader: auto (or tf_data), or runtime.backend: jax."
            )
        return Reader(TF_DATA, "the TensorFlow backend reads through tf.data")
    if setting == TF_DATA:
        return Reader(TF_DATA, "asked for in data.reader")
    if preprocessing is not None:
        if setting == "auto" and tensorflow:
            return Reader(TF_DATA, f"the preset's {_PREPROCESSOR[preprocessing]} runs in tf.data")
        raise _preprocessing_error(setting, preprocessing, tensorflow)
    if setting == NATIVE:
        return Reader(NATIVE, "asked for in data.reader")
    if not tensorflow:
        return Reader(NATIVE, "TensorFlow is not installed")
    return Reader(NATIVE, NATIVE_MEASURED) if measured else Reader(TF_DATA, TF_DATA_MEASURED)


def for_config(config: Any, choice: Any, preset_maps: bool = False) -> Reader:
    """:func:`choose` for an effective config (features known) on a runtime
    :class:`~tpurun.runtime.choice.Choice`: what ``train``, ``evaluate``, ``predict`` and ``doctor``
    ask. ``preset_maps``: the preset's preprocessor runs in the pipeline even on tokenised
    records (``predict`` maps it over the inputs)."""
    tensorflow = getattr(choice, "tensorflow", None) is not None
    preprocessing = preset_preprocessing(config, always=preset_maps)
    measured = measured_native(used_features(config.data))
    return choose(config.data.reader, choice.backend, tensorflow, preprocessing, measured)


_PREPROCESSOR = {"text": "tokenizer", "images": "image converter"}


def _preprocessing_error(
    setting: str, preprocessing: str, tensorflow: bool
) -> EnvironmentSetupError:
    """The one line for a preset whose preprocessing needs tf.data where it cannot have it."""
    why = (
        "and TensorFlow is not installed"
        if not tensorflow
        else "which data.reader: native does not run (set data.reader: auto)"
    )
    if preprocessing == "text":
        return EnvironmentSetupError(
            "model.preset: the preset's tokenizer runs inside the input pipeline and needs "
            f"tensorflow-text, {why}. Install the extra ({HUB_EXTRA}), or tokenise the records "
            "once (where TensorFlow is installed, if not here): tpurun data write SOURCE "
            "OUT_PREFIX --tokenize PRESET; token ids train without it."
        )
    return EnvironmentSetupError(
        "model.preset: the preset's image converter runs inside the tf.data pipeline, "
        f"{why}. Install the extra ({HUB_EXTRA})."
    )


def preset_preprocessing(config: Any, always: bool = False) -> str | None:
    """What of ``config``'s preset runs in the pipeline: ``"text"``, ``"images"`` or None (see
    :func:`choose`); ``always``: on tokenised records too. ``config`` is the effective one (its
    features known)."""
    data = config.data
    if config.model.preset is None or (schema_file.is_tokenized(data) and not always):
        return None
    types = {data.features[n].type for n in DataConfig.names(data.inputs) if n in data.features}
    return "images" if types == {"image"} else "text"


# -------------------------------------------------------------------------- building and reading
def make_dataset(reader: Reader, files: Sequence[str], data: Any, batch_size: int, **kwargs: Any):
    """The chosen pipeline's :func:`~tpurun.data.pipeline.make_dataset` (same arguments)."""
    if reader.native:
        # lazy: the native pipeline (~40 ms) stays off `tpurun config`'s path
        from tpurun.data.native import pipeline as native

        return native.make_dataset(files, data, batch_size, **kwargs)
    return pipeline.make_dataset(files, data, batch_size, **kwargs)


def make_ordered_dataset(
    reader: Reader, files: Sequence[str], compression: str, batch_size: int, **kwargs: Any
):
    """The chosen pipeline's :func:`~tpurun.data.pipeline.make_ordered_dataset` (same arguments)."""
    if reader.native:
        # lazy: the native pipeline (~40 ms) stays off `tpurun config`'s path
        from tpurun.data.native import pipeline as native

        return native.make_ordered_dataset(files, compression, batch_size, **kwargs)
    return pipeline.make_ordered_dataset(files, compression, batch_size, **kwargs)


def cache(setting: str | None, split: str, reader: Reader) -> str | None:
    """``data.cache`` as :func:`make_dataset` takes it for one split: "" keeps the records in
    memory, a path prefix on disk (its folder made; what a killed run left of a tf.data cache
    cleared)."""
    if setting is None:
        return None
    if setting == "memory":
        return ""
    prefix = f"{setting}-{split}"
    if reader.native:
        fileio.makedirs(fileio.dirname(prefix) or ".")
    else:
        fileio.clear_tf_cache_leftovers(prefix)
    return prefix


def first_batch(dataset: Any) -> Any:
    """The dataset's first batch (tensors from tf.data, numpy arrays from the native reader)."""
    if _is_native(dataset):
        iterator = dataset.iterate()
        try:
            return next(iterator)
        finally:
            iterator.close()
    return next(iter(dataset.take(1)))


def as_numpy(batch: Any) -> Any:
    """A batch as numpy arrays, from either reader: what every backend takes (JAX cannot read
    ``tf.Tensor`` values)."""
    import numpy as np

    if isinstance(batch, dict):
        return {key: as_numpy(value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(as_numpy(value) for value in batch)
    return batch.numpy() if hasattr(batch, "numpy") else np.asarray(batch)


def element_spec(dataset: Any, batch: Any) -> Any:
    """The batches' structure, shapes and dtypes: ``tf.data``'s element spec, or the native
    reader's :class:`~tpurun.data.native.pipeline.ArraySpec` tree made from ``batch``."""
    if _is_native(dataset):
        # lazy: the native pipeline (~40 ms) stays off `tpurun config`'s path
        from tpurun.data.native.pipeline import spec_of

        return spec_of(batch)
    return dataset.element_spec


def for_keras(dataset: Any) -> Any:
    """What Keras' ``fit``/``evaluate`` take: a ``tf.data.Dataset`` as it is, the native reader's
    batches as a ``keras.utils.PyDataset`` (import only once the process is set up)."""
    if dataset is None or not _is_native(dataset):
        return dataset
    from tpurun.data.native.keras_input import for_keras as native_for_keras  # lazy: Keras

    return native_for_keras(dataset)


def read_ahead(dataset: Any) -> None:
    """Start a native dataset's Keras form reading its first batches in the background now;
    nothing for tf.data (Keras starts its iterator at the first step)."""
    start = getattr(dataset, "read_ahead", None)
    if start is not None:
        start()


def close(dataset: Any) -> None:
    """Stop the background threads of a native dataset (or of its Keras form); nothing for tf.data."""
    stop = getattr(dataset, "close", None)
    if stop is not None and (_is_native(dataset) or hasattr(dataset, "batches")):
        stop()


def damaged_record(exc: BaseException) -> bool:
    """Whether ``exc`` is a damaged TFRecord met while reading: the native reader's
    ``DamagedRecord``, or TensorFlow's ``DataLossError`` (checked only where TensorFlow is loaded:
    it raised nothing otherwise)."""
    if isinstance(exc, DamagedRecord):
        return True
    tf = sys.modules.get("tensorflow")
    errors = getattr(tf, "errors", None)
    return errors is not None and isinstance(exc, errors.DataLossError)


def _is_native(dataset: Any) -> bool:
    # lazy: the native pipeline (~40 ms) stays off `tpurun config`'s path
    from tpurun.data.native.pipeline import Batches

    return isinstance(dataset, Batches)
