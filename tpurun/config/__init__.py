"""The experiment file: its typed schema (:mod:`.schema`, with :mod:`.base` and :mod:`.features`)
and its loading (:mod:`.loader`).

Nothing here imports TensorFlow, JAX or Keras, so ``tpurun --help`` and validation answer at once.
Values that need the machine or the data (replicas, global batch, scaled learning rate, steps) are
derived later, in :mod:`tpurun.runtime.plan`.
"""

from tpurun.config.base import NamedObject, Section
from tpurun.config.features import (
    BytesFeature,
    Feature,
    FeatureRef,
    FloatFeature,
    ImageFeature,
    Int64Feature,
    RawDType,
    RawFeature,
)
from tpurun.config.loader import (
    apply_overrides,
    load_config,
    parse_override,
    reference_problems,
    validate,
)
from tpurun.config.schema import (
    WRITTEN_KEYS,
    CallbacksConfig,
    CheckpointConfig,
    Config,
    CsvLogConfig,
    DataConfig,
    EarlyStoppingConfig,
    LearningRateConfig,
    ModelConfig,
    OutputConfig,
    ReduceLROnPlateauConfig,
    RuntimeConfig,
    TrainConfig,
    parse_duration,
)

__all__ = [
    "WRITTEN_KEYS", "BytesFeature", "CallbacksConfig", "CheckpointConfig", "Config", "CsvLogConfig",
    "DataConfig", "EarlyStoppingConfig", "Feature", "FeatureRef", "FloatFeature", "ImageFeature",
    "Int64Feature", "LearningRateConfig", "ModelConfig", "NamedObject", "OutputConfig", "RawDType",
    "RawFeature", "ReduceLROnPlateauConfig", "RuntimeConfig", "Section", "TrainConfig",
    "apply_overrides", "load_config", "parse_duration", "parse_override", "reference_problems",
    "validate",
]  # fmt: skip
