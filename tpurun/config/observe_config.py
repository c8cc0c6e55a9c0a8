"""The ``observe`` section: the experiment trackers a run also logs to (MLflow, W&B).

TensorBoard, the CSV log and the curves are on by default and live under ``callbacks``; a tracker
is a service outside the run directory, named here. Each tracker's options default to that
tracker's own environment variables, so a machine set up for MLflow or W&B needs no more than
``observe.trackers: [mlflow]``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from tpurun.config.base import Section

#: The trackers tpurun logs to.
TRACKERS = ("mlflow", "wandb")

REQUIRED_DESCRIPTION = (
    "true: a tracker that cannot start (not installed, unreachable, refused) stops the run at its "
    "start with exit 2. false: one line says so and training goes on without it."
)


class MlflowConfig(Section):
    tracking_uri: str | None = Field(
        None,
        description="Where MLflow keeps runs: a server (`http://host:5000`), `databricks`, or a "
        "local folder (`mlruns`, relative to the working directory, or `file:/path/mlruns`: "
        "mlflow-skinny's only local store; a SQLite file needs the full `mlflow` package). null: `MLFLOW_TRACKING_URI`, else "
        "MLflow's default.",
    )
    experiment: str | None = Field(
        None,
        description="The experiment's name (made if missing). null: `MLFLOW_EXPERIMENT_NAME`, else "
        "`MLFLOW_EXPERIMENT_ID`, else MLflow's `Default`.",
    )
    required: bool = Field(False, description=REQUIRED_DESCRIPTION)


class WandbConfig(Section):
    project: str | None = Field(
        None, description="The W&B project. null: `WANDB_PROJECT`, else W&B's default."
    )
    entity: str | None = Field(
        None, description="The W&B user or team. null: `WANDB_ENTITY`, else your default entity."
    )
    mode: Literal["online", "offline", "disabled"] | None = Field(
        None,
        description="`offline` writes the run's files locally, with no network and no account "
        "(upload them later with `wandb sync`). null: `WANDB_MODE`, else online.",
    )
    required: bool = Field(False, description=REQUIRED_DESCRIPTION)


class ObserveConfig(Section):
    trackers: list[Literal["mlflow", "wandb"]] = Field(
        default_factory=list,
        description="Experiment trackers that also get each epoch's metrics (at the global step, "
        "as in TensorBoard), the config as parameters and the run directory's path; a resumed "
        "run continues the same tracker run. Only process 0 logs.",
    )
    mlflow: MlflowConfig = Field(
        default_factory=MlflowConfig, description="MLflow's options, used when `trackers` names it."
    )
    wandb: WandbConfig = Field(
        default_factory=WandbConfig,
        description="Weights & Biases' options, used when `trackers` names it.",
    )

    @field_validator("trackers")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} named more than once; name each tracker once")
        return value
