"""The ``callbacks`` section: checkpoints, the CSV log, TensorBoard, the LR plateau, early stopping,
what a NaN loss does, and the user's own callbacks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tpurun.config.base import NamedObject, Section

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
        "log.csv",
        description="The file name in the run directory: one row per finished epoch, its `epoch` column counted from 0 as Keras' CSVLogger does (everything else counts epochs from 1).",
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
        description="TensorBoard logs in the run directory, `<run>/train/` and `<run>/validation/` (see Seeing the training); `null` turns "
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
