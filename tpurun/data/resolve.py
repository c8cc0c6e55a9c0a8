"""From a config's ``data`` section to concrete files, features, compression and record counts.

Shared by ``tpurun train``, ``tpurun config`` and ``tpurun data bench``; checks the data before
anything is written.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from tpurun.config import Config, DataConfig, reference_problems
from tpurun.data import pipeline
from tpurun.data import schema as schema_lib
from tpurun.errors import ConfigError, DataError


@dataclass
class ResolvedData:
    """The data a run reads: the effective ``data`` section (features filled, compression known)."""

    data: DataConfig
    train_files: list[str]
    validation_files: list[str]
    train_records: int
    validation_records: int | None
    counts_from: str  # "schema" | "counted"
    schema_files: list[str] = field(default_factory=list)


def kaggle_root(name: str) -> str:
    """The path of a Kaggle dataset: ``gs://...`` on TPU nodes, ``/kaggle/input/...`` on TPU VMs.

    Raises:
        DataError: outside a Kaggle notebook, where ``kaggle_datasets`` does not exist.
    """
    try:
        module = importlib.import_module("kaggle_datasets")
    except ImportError:
        raise DataError(
            f"data.kaggle_dataset: '{name}' needs the kaggle_datasets module, which only Kaggle "
            "notebooks have. Elsewhere, download the dataset and point data.train at its files."
        ) from None
    try:
        return str(module.KaggleDatasets().get_gcs_path(name)).rstrip("/")
    except Exception as exc:  # Kaggle's client raises its own types
        raise DataError(
            f"data.kaggle_dataset: Kaggle could not resolve '{name}': {exc}. Add the dataset to "
            "the notebook (Add Data); a private one on a TPU also needs the Google Cloud SDK add-on."
        ) from None


def _resolver(config: Config):
    name = config.data.kaggle_dataset
    if not name:
        return config.resolve_path
    root = kaggle_root(name)
    return lambda path: path if "://" in path or path.startswith("/") else f"{root}/{path}"


def _counts(files: list[str], schemas: dict, compression: str) -> tuple[int, bool]:
    listed = [schema_lib.record_count(schemas[f][1], f) if f in schemas else None for f in files]
    if files and all(n is not None for n in listed):
        return sum(listed), True
    return pipeline.count_records(files, compression), False


def resolve(config: Config) -> ResolvedData:
    """Expand globs, read schema files, check the first records and count.

    Raises:
        DataError: missing files, unreadable records, or records that do not match the features.
        ConfigError: features left out with no schema to fill them, or inputs/targets that name
            no feature.
    """
    data = config.data
    resolve_path = _resolver(config)
    train_files = pipeline.expand(data.train, resolve_path)
    val_files = pipeline.expand(data.validation, resolve_path) if data.validation else []
    schemas = schema_lib.find_for(train_files + val_files)
    first_schema = schemas.get(train_files[0], (None, None))[1]

    features = data.features
    if not features:
        if first_schema is None:
            raise ConfigError(
                [
                    f"data.features is left out, and no schema file beside {train_files[0]} "
                    "describes the records. Declare the features (`tpurun data inspect GLOB` "
                    "prints them), or write the data with `tpurun data write`."
                ]
            )
        features = first_schema["features"]
    compression = data.compression
    if compression == "auto":
        compression = (first_schema or {}).get("compression") or pipeline.detect_compression(
            train_files[0]
        )
    effective = DataConfig.model_validate(
        {**data.model_dump(mode="json"), "features": features, "compression": compression}
    )
    problems = reference_problems(effective)
    if problems:
        raise ConfigError(problems)

    pipeline.check_first_record(train_files, effective.features, compression)
    if val_files:
        pipeline.check_first_record(val_files, effective.features, compression)
    train_records, train_listed = _counts(train_files, schemas, compression)
    val_records, val_listed = (None, True)
    if val_files:
        val_records, val_listed = _counts(val_files, schemas, compression)
    return ResolvedData(
        data=effective,
        train_files=train_files,
        validation_files=val_files,
        train_records=train_records,
        validation_records=val_records,
        counts_from="schema" if train_listed and val_listed else "counted",
        schema_files=sorted({path for path, _ in schemas.values()}),
    )
