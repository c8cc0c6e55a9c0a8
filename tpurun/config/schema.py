"""The experiment file's typed schema: every key, its type, default and one-line description.

Strict (unknown keys are errors) and framework-free; loading, line numbers and ``--set`` live in
:mod:`tpurun.config.loader`, the feature types in :mod:`tpurun.config.features`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tpurun.config.base import Auto, NamedObject, Section
from tpurun.config.features import Feature, FeatureRef

#: Keys tpurun writes into a run directory's config.yaml; ignored when that file is loaded again.
WRITTEN_KEYS = ("derived",)


# --------------------------------------------------------------------------------------- runtime
class RuntimeConfig(Section):
    backend: Literal["auto", "jax", "tensorflow"] = Field(
        "auto", description="Keras backend. auto: the fastest one that can run this config here."
    )
    accelerator: Literal["auto", "tpu", "gpu", "cpu"] = Field(
        "auto", description="auto: TPU, else GPUs, else CPU."
    )
    tpu: str = Field(
        "auto",
        min_length=1,
        description="TensorFlow TPU address: auto | local | <TPU name> | grpc://host:port.",
    )
    cpu_devices: int = Field(
        1, ge=1, le=512, description="Split the CPU into N devices to rehearse an N-core config."
    )
    precision: Literal["auto", "float32", "mixed_bfloat16", "mixed_float16"] = Field(
        "auto", description="auto: mixed_bfloat16 on TPUs, float32 elsewhere."
    )
    coordinator: str | None = Field(
        None,
        min_length=1,
        description="Several hosts: process 0's host:port (else KERAS_DISTRIBUTION_JOB_ADDRESSES; "
        "found by itself on a Cloud TPU pod).",
    )
    num_processes: int | None = Field(
        None, ge=1, description="Several hosts: how many processes train together (one per host)."
    )
    process_id: int | None = Field(
        None, ge=0, description="Several hosts: this process's number, 0 to num_processes - 1."
    )


# ----------------------------------------------------------------------------------------- model
class ModelConfig(Section):
    factory: str = Field(
        description='"path/to/file.py:function" or "package.module:function"; returns a Keras model.',
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Arguments for the factory.")
    optimizer: NamedObject = Field(
        default_factory=lambda: NamedObject(name="adam"),
        description="A Keras optimizer name or module:Class; other keys are its kwargs.",
    )
    loss: NamedObject | list[NamedObject] | dict[str, NamedObject] | None = Field(
        None,
        description="A Keras loss name, module:function, or {name: ..., kwarg: ...}; left out: "
        "the loss the factory compiled its model with.",
    )
    metrics: list[NamedObject] = Field(default_factory=list, description="Keras metrics.")

    @field_validator("factory")
    @classmethod
    def _import_path(cls, value: str) -> str:
        # A plain sentence instead of pydantic's regex.
        if not re.match(r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$", value):
            raise ValueError(
                'expected "path/to/file.py:function" or "package.module:function", the function '
                "that returns the model after the colon"
            )
        return value


# ------------------------------------------------------------------------------------------ data
class DataConfig(Section):
    train: str | list[str] = Field(description="TFRecord glob(s): local, gs:// or ram://.")
    validation: str | list[str] | None = Field(None, description="TFRecord glob(s) for validation.")
    kaggle_dataset: str | None = Field(
        None,
        min_length=1,
        description="A Kaggle dataset name: relative globs are read from its path (gs:// or /kaggle/input).",
    )
    features: dict[str, Feature] = Field(
        default_factory=dict,
        description="How to decode each record key (omitted: from the shards' schema file).",
    )
    inputs: FeatureRef = Field(description="Feature name, list, or {model_input: feature} map.")
    targets: FeatureRef = Field(description="Feature name, list, or {model_output: feature} map.")
    shuffle_buffer: int = Field(10000, ge=0, description="Records held for shuffling (0: off).")
    compression: Literal["auto", "none", "gzip"] = Field(
        "auto", description="TFRecord compression; auto: the schema's, else detected."
    )
    cache: str | None = Field(
        None,
        min_length=1,
        description="Cache the records read: 'memory', or a file path prefix (for datasets that fit).",
    )
    skip_corrupt: bool = Field(
        False,
        description="Skip a corrupt or truncated shard (counted and reported) instead of stopping.",
    )

    @staticmethod
    def names(ref: FeatureRef) -> list[str]:
        """The feature names an ``inputs`` / ``targets`` value refers to."""
        if isinstance(ref, str):
            return [ref]
        return list(ref.values()) if isinstance(ref, dict) else list(ref)


# ----------------------------------------------------------------------------------------- train
class LearningRateConfig(Section):
    base: float = Field(1e-3, gt=0, description="Learning rate tuned for base_batch_size.")
    base_batch_size: int | None = Field(
        None,
        ge=1,
        description="Batch size `base` was tuned for (unset: the global batch, no scaling).",
    )
    scaling: Literal["linear", "sqrt", "none"] = Field(
        "linear", description="lr = base x f(global_batch / base_batch_size)."
    )
    warmup_epochs: float = Field(0, ge=0, description="Linear warmup to the scaled LR, in epochs.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="After warmup.")


_DURATION = re.compile(
    r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*$"
)


def parse_duration(value: Any) -> float | None:
    """``8h45m``, ``90m``, ``30s`` or a number of seconds -> seconds."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        if value is not None and value <= 0:
            raise ValueError("expected a positive duration")
        return value
    if isinstance(value, str):
        try:
            return parse_duration(float(value))  # "90" or "0.5": seconds
        except ValueError:
            pass
    match = _DURATION.match(str(value))
    if not isinstance(value, str) or not value.strip() or not match:
        raise ValueError("expected a duration such as 8h45m, 90m, 30s, or a number of seconds")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError("expected a positive duration")
    return total


class ProfileConfig(Section):
    start_step: int = Field(
        10, ge=1, description="The first step traced, counted from this session's first step."
    )
    steps: int = Field(5, ge=1, description="How many steps to trace.")


class TrainConfig(Section):
    per_core_batch_size: int | None = Field(
        None, ge=1, description="Batch per replica; global batch = this x replicas (default 16)."
    )
    global_batch_size: int | None = Field(
        None, ge=1, description="Alternative to per_core_batch_size; must divide by replicas."
    )
    epochs: int = Field(10, ge=1, description="Epochs to train.")
    steps_per_epoch: int | Auto = Field("auto", description="auto: train records // global batch.")
    validation_steps: int | Auto = Field(
        "auto", description="auto: validation records // global batch."
    )
    steps_per_execution: int | Auto = Field(
        "auto", description="Batches per device call; auto picks an integer for this backend."
    )
    learning_rate: LearningRateConfig = Field(default_factory=LearningRateConfig)
    time_limit: float | None = Field(
        None,
        description="Stop cleanly, with a checkpoint, after this long: '8h45m', '90m', or seconds.",
    )
    profile: ProfileConfig | None = Field(
        None,
        description="Trace some steps with the backend's profiler into <run>/tensorboard (also "
        "--profile START:STEPS).",
    )

    @field_validator("time_limit", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        return parse_duration(value)

    @field_validator("steps_per_epoch", "validation_steps", "steps_per_execution", mode="before")
    @classmethod
    def _auto_or_positive(cls, value: Any) -> Any:
        # One clear message instead of pydantic's one-per-union-member.
        if value == "auto" or (
            isinstance(value, int) and not isinstance(value, bool) and value >= 1
        ):
            return value
        raise ValueError("expected 'auto' or an integer >= 1")

    @model_validator(mode="after")
    def _one_batch_size(self) -> TrainConfig:
        if self.per_core_batch_size is not None and self.global_batch_size is not None:
            raise ValueError("give per_core_batch_size or global_batch_size, not both")
        return self


# ------------------------------------------------------------------------------------- callbacks
Monitor = str
Mode = Literal["auto", "min", "max"]


class CheckpointConfig(Section):
    monitor: Monitor = Field("auto", description="auto: val_loss with validation data, else loss.")
    mode: Mode = "auto"
    save_best_only: bool = Field(True, description="Keep only improved models (plus latest).")
    filename: str | None = Field(
        None, description="Pattern for kept models, e.g. 'ep{epoch:03d}-{val_loss:.4f}.keras'."
    )
    keep: int | None = Field(
        None, ge=1, description="Keep only the newest N files of `filename` (unset: all)."
    )
    every_steps: int | None = Field(
        None, ge=1, description="Also save the latest checkpoint every N steps, mid-epoch."
    )
    every_minutes: float | None = Field(
        None, gt=0, description="Also save the latest checkpoint every N minutes, mid-epoch."
    )

    @field_validator("filename")
    @classmethod
    def _suffix(cls, value: str | None) -> str | None:
        if value is not None and not value.endswith((".keras", ".weights.h5", ".h5")):
            raise ValueError("must end in .keras (whole model) or .weights.h5 (weights only)")
        if value is not None and ("/" in value or "\\" in value):
            raise ValueError("a file name, without folders (files go in <run>/checkpoints/)")
        return value


class CsvLogConfig(Section):
    filename: str = Field("log.csv", description="File name in the run directory.")
    append: bool = Field(
        True,
        exclude=True,  # only true is accepted: nothing to record
        description="true (the seeds' CSVLogger(append=True)): a resumed run continues its log.",
    )

    @field_validator("append")
    @classmethod
    def _always_appended(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "false cannot be honoured: a run's log holds each epoch once, so a resumed run "
                "continues it (a fresh run starts it empty). To start a new log, train with "
                "--restart (the old run directory is moved aside) or another "
                "callbacks.csv_log.filename; or remove the key"
            )
        return value


class TensorBoardConfig(Section):
    loss_every_steps: int | None = Field(
        100,
        ge=1,
        description="Also log the training loss every N steps (checked once per execution); "
        "null: per epoch only.",
    )


class ReduceLROnPlateauConfig(Section):
    monitor: Monitor = "auto"
    factor: float = Field(0.1, gt=0, lt=1)
    patience: int = Field(10, ge=0)
    min_lr: float = Field(0.0, ge=0)
    min_delta: float = Field(1e-4, ge=0)
    cooldown: int = Field(0, ge=0)
    mode: Mode = "auto"


class EarlyStoppingConfig(Section):
    monitor: Monitor = "auto"
    patience: int = Field(10, ge=0)
    min_delta: float = Field(0.0, ge=0)
    mode: Mode = "auto"
    restore_best_weights: bool = False


_ON_NAN_OF_TERMINATE = {True: "stop", False: "ignore"}


class CallbacksConfig(Section):
    checkpoint: CheckpointConfig | None = Field(default_factory=CheckpointConfig)
    csv_log: CsvLogConfig | None = Field(default_factory=CsvLogConfig)
    tensorboard: TensorBoardConfig | None = Field(
        default_factory=TensorBoardConfig,
        description="TensorBoard logs in <run>/tensorboard; null turns them off.",
    )
    reduce_lr_on_plateau: ReduceLROnPlateauConfig | None = None
    early_stopping: EarlyStoppingConfig | None = None
    on_nan: Literal["stop", "restore", "ignore"] = Field(
        "stop",
        description="On a NaN/Inf loss: stop; restore the last checkpoint with a lower LR; or ignore.",
    )
    terminate_on_nan: bool | None = Field(
        None,
        exclude=True,  # recorded as on_nan
        description="The seeds' TerminateOnNaN: true is on_nan: stop, false is on_nan: ignore.",
    )
    max_nan_restores: int = Field(3, ge=1, description="on_nan: restore at most this many times.")
    nan_lr_factor: float = Field(
        0.5, gt=0, lt=1, description="on_nan: restore multiplies the learning rate by this."
    )
    extra: list[NamedObject] = Field(
        default_factory=list, description="User callbacks: 'module:Class' or {name: ..., kwargs}."
    )

    @model_validator(mode="before")
    @classmethod
    def _on_nan_from_terminate(cls, value: Any) -> Any:
        # The seed key stands in for on_nan when on_nan is not given; both given must agree.
        if not isinstance(value, dict) or value.get("terminate_on_nan") is None:
            return value
        try:
            flag = TypeAdapter(bool).validate_python(value["terminate_on_nan"])
        except ValidationError:
            return value  # the field reports it
        return {"on_nan": _ON_NAN_OF_TERMINATE[flag], **value}

    @field_validator("terminate_on_nan")
    @classmethod
    def _agrees_with_on_nan(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        on_nan = info.data.get("on_nan")
        if value is not None and on_nan is not None and on_nan != _ON_NAN_OF_TERMINATE[value]:
            raise ValueError(
                f"disagrees with callbacks.on_nan: {on_nan} (terminate_on_nan: {str(value).lower()}"
                f" means on_nan: {_ON_NAN_OF_TERMINATE[value]}); keep one of the two keys"
            )
        return value


class OutputConfig(Section):
    dir: str = Field(
        "runs", description="Run directory = <dir>/<name>: a local folder (relative to the cwd) "
        "or gs://bucket/path."
    )  # fmt: skip

    @field_validator("dir")
    @classmethod
    def _local_or_gcs(cls, value: str) -> str:
        # TensorFlow's file system reads and writes gs:// itself; other schemes need plugins
        # (tensorflow-io) that tpurun does not test.
        if "://" in value and not value.startswith("gs://"):
            raise ValueError(
                f"'{value}': a local folder or a Google Cloud Storage path (gs://bucket/runs); "
                f"'{value.split('://')[0]}://' is not supported"
            )
        if value.startswith("gs://") and not value[5:].split("/")[0]:
            raise ValueError(f"'{value}': name the bucket, e.g. gs://my-bucket/runs")
        return value


# ---------------------------------------------------------------------------------------- config
class Config(Section):
    name: str = Field("run", description="Run name; defaults to the config file's stem.")
    seed: int = Field(42, description="Seed for weights, shuffling and dropout.")
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    model: ModelConfig
    data: DataConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    callbacks: CallbacksConfig = Field(default_factory=CallbacksConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @field_validator("name")
    @classmethod
    def _folder_name(cls, value: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", value):
            raise ValueError(
                "use letters, digits, '.', '_' and '-' (it becomes the run directory's name), "
                "starting with a letter or digit"
            )
        return value

    # Where relative paths (factory file, data globs) are resolved from: the config file's folder.
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    def resolve_path(self, path: str) -> str:
        """A local path relative to the config file's folder; remote URLs are left alone."""
        if "://" in path or Path(path).is_absolute():
            return path
        return str(self._base_dir / path)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data, in the form a user writes it."""
        return self.model_dump(mode="json")
