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
        "auto",
        description="The Keras backend. `auto`: the fastest installed backend that can run this config "
        "as written on the chosen accelerator: JAX wherever both could.",
    )
    accelerator: Literal["auto", "tpu", "gpu", "cpu"] = Field(
        "auto",
        description="`auto`: a TPU, else GPUs, else the CPU (one line says what was chosen and why). "
        "An accelerator named here but absent is an error; `cpu` trains on the CPU on purpose.",
    )
    tpu: str = Field(
        "auto",
        min_length=1,
        description="TensorFlow backend only: `auto` (`local` on a TPU VM, else `TPU_NAME`), `local`, "
        "a TPU name, or `grpc://host:port`.",
    )
    cpu_devices: int = Field(
        1,
        ge=1,
        le=512,
        description="On the CPU, split it into N devices (replicas), for either backend: an N-core TPU "
        "config then runs with the same replicas, global batch and scaled learning rate.",
    )
    precision: Literal["auto", "float32", "mixed_bfloat16", "mixed_float16"] = Field(
        "auto",
        description="`auto`: `mixed_bfloat16` on TPUs, `float32` elsewhere. `mixed_float16` is warned "
        "against on TPUs.",
    )
    coordinator: str | None = Field(
        None,
        min_length=1,
        description="Several hosts: process 0's `host:port`, the same on every process. Unset: "
        "`KERAS_DISTRIBUTION_JOB_ADDRESSES`; JAX finds it by itself on a Cloud TPU pod and under SLURM.",
    )
    num_processes: int | None = Field(
        None,
        ge=1,
        description="Several hosts: how many processes (one per host) train together. Unset: "
        "`KERAS_DISTRIBUTION_NUM_PROCESSES`, else a Cloud TPU pod's or SLURM's own variables.",
    )
    process_id: int | None = Field(
        None,
        ge=0,
        description="Several hosts: this process's number, 0 to `num_processes - 1` (0 on the "
        "coordinator). Unset: `KERAS_DISTRIBUTION_PROCESS_ID`, `TPU_WORKER_ID` or `SLURM_PROCID`.",
    )


# ----------------------------------------------------------------------------------------- model
class ModelConfig(Section):
    factory: str = Field(
        description="`path/to/file.py:function` or `package.module:function`: called with `kwargs` "
        "inside the distribution scope, it returns a Keras model.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments for the factory."
    )
    optimizer: NamedObject = Field(
        default_factory=lambda: NamedObject(name="adam"),
        description="A Keras optimizer name or `module:Class`, or `{name: ..., kwarg: ...}`: the other "
        "keys are its kwargs. The learning rate always comes from `train.learning_rate`.",
    )
    loss: NamedObject | list[NamedObject] | dict[str, NamedObject] | None = Field(
        None,
        description="A Keras loss name, `module:function`, `{name: ..., kwarg: ...}`, or a list / "
        "`{output: loss}` map for several outputs. Left out: the loss the factory compiled its model "
        "with (an error if it did not compile). Checked against the labels before training.",
    )
    metrics: list[NamedObject] = Field(
        default_factory=list,
        description="Keras metric names, `module:function`, or `{name: ..., kwarg: ...}`.",
    )

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
    train: str | list[str] = Field(
        description="A TFRecord glob or a list of globs: local (relative to the config file's folder), "
        "`gs://` or `ram://`."
    )
    validation: str | list[str] | None = Field(
        None,
        description="The same, for validation: read in order, never shuffled, every record scored "
        "exactly once per epoch.",
    )
    kaggle_dataset: str | None = Field(
        None,
        min_length=1,
        description="A Kaggle dataset name: relative globs are read from "
        "`KaggleDatasets().get_gcs_path(name)` (`gs://` on TPU nodes, `/kaggle/input/...` on TPU "
        "VMs). An error outside Kaggle.",
    )
    features: dict[str, Feature] = Field(
        default_factory=dict,
        description="How each record key decodes (see Feature types below). Left out, or for the keys "
        "it leaves out: from the `*.schema.json` that `tpurun data write` puts beside the shards.",
    )
    inputs: FeatureRef = Field(
        description="A feature name (the one model input), a list (the model's inputs in order), or a "
        "`{model_input: feature}` map (inputs by their `keras.Input` name)."
    )
    targets: FeatureRef = Field(
        description="The same, for the targets: a feature name, a list, or a "
        "`{model_output: feature}` map."
    )
    shuffle_buffer: int = Field(
        10000, ge=0, description="Training records held for shuffling (0: no record shuffle)."
    )
    compression: Literal["auto", "none", "gzip"] = Field(
        "auto",
        description="TFRecord compression. `auto`: the schema file's, else detected from the first "
        "file.",
    )
    cache: str | None = Field(
        None,
        min_length=1,
        description="`memory`, or a file path prefix: keep the records read after the first pass, for "
        "datasets that fit (decoding still runs). A file cache belongs to one run at a time; one left "
        "half-written by a killed run is cleared.",
    )
    skip_corrupt: bool = Field(
        False,
        description="A corrupt or truncated shard is skipped, counted, warned about and recorded in "
        "`summary.json`, instead of stopping with exit 2 (which names the file and the record "
        "offset).",
    )

    @staticmethod
    def names(ref: FeatureRef) -> list[str]:
        """The feature names an ``inputs`` / ``targets`` value refers to."""
        if isinstance(ref, str):
            return [ref]
        return list(ref.values()) if isinstance(ref, dict) else list(ref)


# ----------------------------------------------------------------------------------------- train
class LearningRateConfig(Section):
    base: float = Field(1e-3, gt=0, description="The learning rate tuned for `base_batch_size`.")
    base_batch_size: int | None = Field(
        None,
        ge=1,
        description="The batch size `base` was tuned for. Unset: the global batch, so no scaling.",
    )
    scaling: Literal["linear", "sqrt", "none"] = Field(
        "linear",
        description="lr = base x f(global batch / `base_batch_size`), f being the identity, the square "
        "root, or 1.",
    )
    warmup_epochs: float = Field(
        0,
        ge=0,
        description="Linear warmup to the scaled learning rate, in epochs (fractions allowed).",
    )
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="After the warmup: constant, or a cosine decay to 0 at the last step.",
    )


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
        10,
        ge=1,
        description="The first step traced, counted from this session's first step (the first "
        "execution compiles: start after it).",
    )
    steps: int = Field(
        5,
        ge=1,
        description="How many steps to trace (whole executions of `steps_per_execution` steps).",
    )


class TrainConfig(Section):
    per_core_batch_size: int | None = Field(
        None,
        ge=1,
        description="The batch per replica: global batch = this x replicas. 16 when neither this nor "
        "`global_batch_size` is given.",
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Instead of `per_core_batch_size` (not both): the global batch, which must divide "
        "by the replica count.",
    )
    epochs: int = Field(
        10, ge=1, description="Epochs to train, counted over every session of the run."
    )
    steps_per_epoch: int | Auto = Field(
        "auto",
        description="An integer, or `auto`: train records // global batch (counted once and cached).",
    )
    validation_steps: int | Auto = Field(
        "auto",
        description="An integer, or `auto`: every validation record once (the last batch is padded "
        "with records weighted 0).",
    )
    steps_per_execution: int | Auto = Field(
        "auto",
        description="Batches per device call. `auto`: the largest divisor of the epoch's steps up to "
        "32 (1 where keras#19246 applies). An epoch is rounded down to whole executions.",
    )
    learning_rate: LearningRateConfig = Field(
        default_factory=LearningRateConfig,
        description="The learning rate: its base, scaling with the global batch, warmup and schedule.",
    )
    time_limit: float | None = Field(
        None,
        description="Stop cleanly with a checkpoint after this long (`8h45m`, `90m`, `30s` or seconds; "
        "also `--time-limit`), before a session's deadline: exit 3, and rerunning continues.",
    )
    profile: ProfileConfig | None = Field(
        None,
        description="`{start_step: N, steps: M}` (also `--profile N:M`): trace steps N to N+M-1 of "
        "this session with the backend's profiler into `<run>/tensorboard/plugins/profile/`.",
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
    monitor: Monitor = Field(
        "auto",
        description="The metric the best model is chosen by. `auto`: `val_loss` with validation "
        "data, else `loss`. Checked against the compiled model's metrics before training.",
    )
    mode: Mode = Field(
        "auto",
        description="`auto`: from the metric itself (maximised for accuracy, AUC, `r2_score`, "
        "`pearson_correlation` and the like; a metric that does not say needs `mode`).",
    )
    save_best_only: bool = Field(
        True,
        description="Keep only improvements under `filename`; `false` keeps every epoch. The resume "
        "point is kept either way.",
    )
    filename: str | None = Field(
        None,
        description="Extra kept models in `checkpoints/`, e.g. `ep{epoch:03d}_loss{loss:.4f}.keras` "
        "(`{epoch}` and metric names; `.keras` or `.weights.h5`), each with its resume state.",
    )
    keep: int | None = Field(
        None, ge=1, description="Keep only the newest N files of `filename`. Unset: all."
    )
    every_steps: int | None = Field(
        None,
        ge=1,
        description="Also save the resume point every N training steps, mid-epoch (checked once per "
        "execution); a resume then starts at that step.",
    )
    every_minutes: float | None = Field(
        None,
        gt=0,
        description="Also save the resume point every N minutes, mid-epoch (`10` is a good start for "
        "long epochs on preemptible machines).",
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
    filename: str = Field(
        "log.csv", description="The file name in the run directory: one row per finished epoch."
    )
    append: bool = Field(
        True,
        exclude=True,  # only true is accepted: nothing to record
        description="As the NAIC recipe's `CSVLogger(append=True)`: a resumed run continues its log "
        "(rows after the resume point are dropped), a fresh run starts it empty. `false` is refused: "
        "for a new log, train with `--restart` or another `filename`.",
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
        description="Also log the epoch's running training loss every N steps (checked once per "
        "execution). `null`: per epoch only.",
    )


class ReduceLROnPlateauConfig(Section):
    monitor: Monitor = Field("auto", description="As for the checkpoint.")
    factor: float = Field(0.1, gt=0, lt=1, description="Multiply the learning rate by this.")
    patience: int = Field(10, ge=0, description="Epochs without improvement before a reduction.")
    min_lr: float = Field(0.0, ge=0, description="The learning rate's lower bound.")
    min_delta: float = Field(1e-4, ge=0, description="The smallest change that counts.")
    cooldown: int = Field(0, ge=0, description="Epochs to wait after a reduction.")
    mode: Mode = Field("auto", description="As for the checkpoint.")


class EarlyStoppingConfig(Section):
    monitor: Monitor = Field("auto", description="As for the checkpoint.")
    patience: int = Field(10, ge=0, description="Epochs without improvement before stopping.")
    min_delta: float = Field(0.0, ge=0, description="The smallest change that counts.")
    mode: Mode = Field("auto", description="As for the checkpoint.")
    restore_best_weights: bool = Field(
        False, description="As in Keras: end with the best epoch's weights."
    )


_ON_NAN_OF_TERMINATE = {True: "stop", False: "ignore"}


class CallbacksConfig(Section):
    checkpoint: CheckpointConfig | None = Field(
        default_factory=CheckpointConfig,
        description="The best and pattern-named models; `null` turns those off (the resume point is "
        "always kept, so a run can always be resumed).",
    )
    csv_log: CsvLogConfig | None = Field(
        default_factory=CsvLogConfig,
        description="The CSV log, appended and flushed each epoch; `null` turns it off.",
    )
    tensorboard: TensorBoardConfig | None = Field(
        default_factory=TensorBoardConfig,
        description="TensorBoard logs in `<run>/tensorboard/` (see Seeing the training); `null` turns "
        "them off.",
    )
    reduce_lr_on_plateau: ReduceLROnPlateauConfig | None = Field(
        None,
        description="Keras `ReduceLROnPlateau`; needs `schedule: constant` and no warmup.",
    )
    early_stopping: EarlyStoppingConfig | None = Field(None, description="Keras `EarlyStopping`.")
    on_nan: Literal["stop", "restore", "ignore"] = Field(
        "stop",
        description="A NaN or Inf loss, checked after every execution: `stop` (exit 2, naming the "
        "epoch and step; the last good checkpoint stays), `restore` (reload the last checkpoint, "
        "multiply the learning rate by `nan_lr_factor` and go on, at most `max_nan_restores` times), "
        "or `ignore`.",
    )
    terminate_on_nan: bool | None = Field(
        None,
        exclude=True,  # recorded as on_nan
        description="The NAIC recipe's `TerminateOnNaN`: `true` is `on_nan: stop`, `false` is "
        "`on_nan: ignore`; given with an `on_nan` that disagrees, it is an error.",
    )
    max_nan_restores: int = Field(
        3, ge=1, description="`on_nan: restore` gives up (and stops) after this many restores."
    )
    nan_lr_factor: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="`on_nan: restore` multiplies the learning rate by this at each restore (kept in "
        "the checkpoint for later sessions).",
    )
    extra: list[NamedObject] = Field(
        default_factory=list,
        description="User callbacks: `module:Class`, `path.py:Class`, or `{name: ..., kwarg: ...}`. "
        "A relative path in their kwargs is relative to the working directory.",
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
        "runs", description="The parent of the run directory `<dir>/<name>`: a local folder "
        "(relative to the working directory, as `--output` is) or `gs://bucket/path`. Several hosts "
        "need one they all see."
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
    name: str = Field(
        "run",
        description="The run's name: its directory is `<output.dir>/<name>`. Loaded from a file, it "
        "defaults to the file's stem.",
    )
    seed: int = Field(42, description="Seed for the weights, the shuffling and dropout.")
    runtime: RuntimeConfig = Field(
        default_factory=RuntimeConfig,
        description="Where and how to train: the backend, the accelerator, the precision, and several "
        "hosts.",
    )
    model: ModelConfig = Field(description="The model: its factory, and how it is compiled.")
    data: DataConfig = Field(
        description="The TFRecord files, how their records decode, and which features feed the model."
    )
    train: TrainConfig = Field(
        default_factory=TrainConfig,
        description="The batch size, epochs, steps, learning rate, time limit and profiling.",
    )
    callbacks: CallbacksConfig = Field(
        default_factory=CallbacksConfig,
        description="Checkpoints, logs, the learning-rate and stopping rules, and what a NaN does.",
    )
    output: OutputConfig = Field(
        default_factory=OutputConfig, description="Where the run directories go."
    )

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
