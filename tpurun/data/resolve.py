"""From a config's ``data`` section to concrete files, features, compression and record counts.

Shared by ``tpurun train``, ``tpurun config`` and ``tpurun data bench``; checks the data before
anything is written.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tpurun.config import Config, DataConfig, reference_problems
from tpurun.data import categories, records, sniff
from tpurun.data import files as datafiles
from tpurun.data import schema_file as schema_lib
from tpurun.errors import ConfigError, DataError


@dataclass
class ResolvedData:
    """The data a run reads: the effective ``data`` section (features filled, compression known).

    With data.skip_corrupt, damaged files are left out of the file lists and the counts, and
    listed in ``skipped``.
    """

    data: DataConfig
    train_files: list[str]
    validation_files: list[str]
    train_records: int
    validation_records: int | None
    counts_from: str  # "schema" | "counted"
    schema_files: list[str] = field(default_factory=list)
    skipped: list[records.CorruptShard] = field(default_factory=list)
    class_names: list[str] | None = None  # from the schema file (an image folder, a text label)
    train_counts: list[int] = field(default_factory=list)  # records per file, as train_files
    validation_counts: list[int] = field(default_factory=list)
    # Records written with --tokenize: the schema file's entry (what they were tokenised with) and
    # its path under "schema"; None for records of text, numbers or images.
    tokenized: dict[str, Any] | None = None
    # What the start line says of the data (categories' values that get the out-of-vocabulary id).
    warnings: list[str] = field(default_factory=list)


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


def path_resolver(config: Config) -> datafiles.PathRule:
    """How a data path of ``config`` becomes a file path: from data.kaggle_dataset's root when it
    is set, else from the config file's folder. Absolute and ``scheme://`` paths stay as they are.

    Raises:
        DataError: data.kaggle_dataset is set outside Kaggle, or Kaggle cannot resolve it.
    """
    name = config.data.kaggle_dataset
    if not name:
        return datafiles.PathRule(str(config.base_dir), "the config file's folder")
    return datafiles.PathRule(kaggle_root(name), f"data.kaggle_dataset '{name}''s folder")


def resolve(config: Config) -> ResolvedData:
    """Expand globs, read schema files, fill in the features, then check and count each split.

    Each split goes through ``records.check_split``: damaged files, the first record, the counts.

    Raises:
        DataError: missing files, unreadable, corrupt or truncated records (with data.skip_corrupt:
            only when every file of a split is), or records that do not match the features.
        ConfigError: features left out with no schema to fill them, or inputs/targets that name
            no feature.
    """
    data = config.data
    resolve_path = path_resolver(config)
    train_files = datafiles.expand(data.train, resolve_path, "data.train")
    val_files = (
        datafiles.expand(data.validation, resolve_path, "data.validation")
        if data.validation
        else []
    )
    schemas = schema_lib.find_for(train_files + val_files)
    schema_path, first_schema = schemas.get(train_files[0], (None, None))

    effective = _effective(config, train_files[0], first_schema, schema_path)
    compression = effective.compression

    checked = {}
    for split, files in (("train", train_files), ("validation", val_files)):
        with _named(first_schema, f"data.{split}"):
            if files:
                checked[split] = records.check_split(
                    files,
                    split,
                    schemas,
                    effective.features,
                    compression,
                    skip_corrupt=data.skip_corrupt,
                )
    train, validation = checked["train"], checked.get("validation")
    return ResolvedData(
        data=effective,
        train_files=train.files,
        validation_files=validation.files if validation else [],
        train_records=train.records,
        validation_records=validation.records if validation else None,
        counts_from="schema" if all(c.from_schema for c in checked.values()) else "counted",
        schema_files=sorted({path for path, _ in schemas.values()}),
        skipped=[shard for c in checked.values() for shard in c.skipped],
        class_names=(first_schema or {}).get("class_names"),
        train_counts=train.counts,
        validation_counts=validation.counts if validation else [],
        tokenized=tokenized_entry(schemas),
        warnings=categories.warnings(effective, first_schema),
    )


def _effective(
    config: Config, first_file: str, first_schema: dict | None, schema_path: str | None
) -> DataConfig:
    """The ``data`` section a run reads: the features declared, the rest from the schema file of
    ``first_file`` (the first training file), the compression known, and a preset's images
    unscaled and its inputs and targets filled in.

    Raises:
        DataError: no features anywhere, and the first file is not TFRecords.
        ConfigError: no features anywhere, or inputs/targets that name no feature.
    """
    data = config.data
    # Declared features override the schema's (see categories.completed); the rest come from it.
    declared = categories.completed(
        data.model_dump(mode="json")["features"], first_schema, schema_path, first_file
    )
    features = {**(first_schema or {}).get("features", {}), **declared}
    if not features:
        _first_is_tfrecords(first_file, data.compression)
        raise ConfigError(
            [
                f"data.features is left out, and no schema file beside {first_file} "
                "describes the records. Declare the features (`tpurun data inspect GLOB` "
                "prints them), or write the data with `tpurun data write SOURCE OUT_PREFIX`."
            ]
        )
    compression = data.compression
    if compression == "auto":
        compression = (first_schema or {}).get("compression") or datafiles.detect_compression(
            first_file
        )
    if config.model.preset is not None:
        # KerasHub's image converters take pixels as 0..255 and scale them as the model was
        # pretrained: a preset's images are fed unscaled (the config refuses `scale: true`).
        features = {name: {**f, "scale": False} if f.get("type") == "image" else f
                    for name, f in features.items()}  # fmt: skip
    inputs, targets = data.inputs, data.targets
    if inputs is None or targets is None:  # a preset's: the config checked a factory names both
        inputs, targets = preset_refs(features, inputs, targets)
    effective = DataConfig.model_validate(
        {
            **data.model_dump(mode="json"),
            "features": features,
            "compression": compression,
            "inputs": inputs,
            "targets": targets,
        }
    )
    problems = reference_problems(effective)
    if problems:
        raise ConfigError(problems)
    return effective


def _first_is_tfrecords(path: str, compression: str) -> None:
    """A CSV or JSONL file given as data.train has no schema file either: say what it is,
    rather than that its schema is missing."""
    with _named(None, "data.train"):
        records.check_first_record([path], {}, compression)


@contextlib.contextmanager
def _named(schema: dict | None, key: str) -> Iterator[None]:
    """A file of ``key`` that is not TFRecords is said to be, with the ``data write`` options of
    the training data (``schema``, its schema file) where they are known."""
    try:
        yield
    except sniff.NotTFRecords as exc:
        raise exc.advised(schema, key) from None


def tokenized_entry(schemas: dict[str, tuple[str, dict]]) -> dict[str, Any] | None:
    """What the records were tokenised with, the same for every schema file (train and
    validation), with the first file's path; None when they hold no token ids.

    Raises:
        DataError: schema files that disagree (records tokenised differently, or not at all).
    """
    found = {path: schema.get(schema_lib.TOKENIZED) for path, schema in schemas.values()}
    entries = {json.dumps(entry, sort_keys=True) for entry in found.values()}
    if len(entries) > 1:
        described = "; ".join(
            f"{path}: "
            + (f"{e['task']} at {e['sequence_length']} tokens" if e else "not tokenised")
            for path, e in found.items()
        )
        raise DataError(
            f"data.train / data.validation: the records were not all written alike ({described}). "
            "Write every split with the same `tpurun data write --tokenize PRESET "
            "--sequence-length N`, or all without --tokenize."
        )
    path, entry = next(iter(found.items()), (None, None))
    return {**entry, "schema": path} if entry else None


#: Feature types a pretrained model takes as its inputs (its preprocessor turns them into numbers).
_PRESET_INPUT_TYPES = ("text", "image")


def preset_refs(features: dict[str, dict], inputs: Any, targets: Any) -> tuple[Any, Any]:
    """A preset's ``data.inputs`` and ``data.targets``, where the config leaves them out (see
    their descriptions): ``prompt`` and ``response`` are a causal LM's prompt and answer; one
    text feature alone is text a causal LM learns whole; otherwise the text and image features
    are the inputs and the one feature left is the target. Tokenised records feed their token
    features to the model, and it learns their one feature left (a label), or the token ids
    themselves where that is a causal LM's ``weights``.

    Raises:
        ConfigError: the features do not say which is which.
    """
    if inputs is None and targets is None and {"prompt", "response"} <= set(features):
        return "prompt", "response"
    if inputs is None and (features.get("token_ids") or {}).get("type") == "int64":
        return _token_refs(features, targets)
    kinds = {name: f.get("type") for name, f in features.items()}
    if inputs is None:
        found = [name for name, kind in kinds.items() if kind in _PRESET_INPUT_TYPES]
        inputs = found[0] if len(found) == 1 else found or None
    if targets is None and inputs is not None:
        rest = [name for name in kinds if name not in DataConfig.names(inputs)]
        if len(rest) == 1:
            targets = rest[0]
        elif not rest and isinstance(inputs, str) and kinds[inputs] == "text":
            targets = inputs  # a causal LM learns the text itself
    if inputs is None or targets is None:
        described = ", ".join(f"{name} ({kind})" for name, kind in kinds.items())
        raise ConfigError(
            [
                f"data.inputs / data.targets: left out, and the features ({described}) do not "
                "say which feeds the model and which it learns. Set both: `inputs: prompt` and "
                "`targets: response` for a causal LM, `inputs: text` and `targets: label` for a "
                "classifier."
            ]
        )
    return inputs, targets


def _token_refs(features: dict[str, dict], targets: Any) -> tuple[Any, Any]:
    """Tokenised records' inputs (their token features, by the names the task takes) and
    targets (``{token_ids, weights}`` for a causal LM, else the one feature left)."""
    inputs = {name: name for name in schema_lib.TOKEN_INPUTS if name in features}
    if targets is None:
        rest = [name for name in features if name not in inputs]
        if rest == ["weights"]:
            targets = {"token_ids": "token_ids", "weights": "weights"}
        elif len(rest) == 1:
            targets = rest[0]
        else:
            raise ConfigError(
                [
                    f"data.targets: left out, and the tokenised records hold {', '.join(rest) or 'nothing'} "
                    "beside their token ids: set data.targets to the label the model learns."
                ]
            )
    return inputs, targets
