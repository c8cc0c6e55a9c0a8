"""The experiment file: its typed schema (:mod:`.schema`, with :mod:`.base`, :mod:`.features`,
:mod:`.train_config` and :mod:`.callbacks_config`), its loading (:mod:`.loader`), and the reference
page generated from it (:mod:`.reference`).

Nothing here imports TensorFlow, JAX or Keras, so ``tpurun --help`` and validation answer at once.
Values that need the machine or the data (replicas, global batch, scaled learning rate, steps) are
derived later, in :mod:`tpurun.plan.plan`.
"""

from tpurun.config.base import NamedObject, Section
from tpurun.config.callbacks_config import (
    CallbacksConfig,
    CheckpointConfig,
    CsvLogConfig,
    EarlyStoppingConfig,
    ReduceLROnPlateauConfig,
)
from tpurun.config.features import (
    BytesFeature,
    CategoryFeature,
    Feature,
    FeatureOptions,
    FeatureRef,
    FloatFeature,
    ImageFeature,
    Int64Feature,
    RawDType,
    RawFeature,
    TextFeature,
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
    Config,
    DataConfig,
    ModelConfig,
    OutputConfig,
    RuntimeConfig,
)
from tpurun.config.train_config import LearningRateConfig, TrainConfig, parse_duration

__all__ = [
    "WRITTEN_KEYS", "BytesFeature", "CallbacksConfig", "CategoryFeature", "FeatureOptions", "CheckpointConfig", "Config", "CsvLogConfig",
    "DataConfig", "EarlyStoppingConfig", "Feature", "FeatureRef", "FloatFeature", "ImageFeature",
    "Int64Feature", "LearningRateConfig", "ModelConfig", "NamedObject", "OutputConfig", "RawDType",
    "RawFeature", "ReduceLROnPlateauConfig", "RuntimeConfig", "Section", "TextFeature", "TrainConfig",
    "apply_overrides", "load_config", "parse_duration", "parse_override", "reference_problems",
    "validate",
]  # fmt: skip
