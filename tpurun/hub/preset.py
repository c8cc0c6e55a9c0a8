"""A KerasHub preset folder, read without Keras: where it is, whether it is complete, what it holds.

``save_to_preset`` writes a folder of JSON configs, weights and tokenizer assets
(``keras_hub/src/utils/preset_utils.py``, ``KerasPresetSaver``); ``from_preset`` reads it back and,
for a file that is missing, raises a ``FileNotFoundError`` deep inside the load. :func:`read` checks
the folder first and names the file, so ``train``, ``tpurun config`` and ``doctor`` all say the same
thing before anything heavy starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpurun.config import Config
from tpurun.config.schema import PRESET_HANDLES
from tpurun.errors import ModelError
from tpurun.hub import handles

# The files of a preset, as keras_hub/src/utils/preset_utils.py names them.
CONFIG = "config.json"  # the backbone
METADATA = "metadata.json"  # versions, parameter count, the tasks the backbone serves
WEIGHTS = "model.weights.h5"  # the backbone's weights
SHARDED_WEIGHTS = "model.weights.json"  # or this, naming the shards of a large backbone
TASK = "task.json"  # the task it was saved as (optional: a backbone alone has none)
PREPROCESSOR = "preprocessor.json"
TOKENIZER = "tokenizer.json"
CONVERTERS = ("image_converter.json", "audio_converter.json", "video_converter.json")
ASSETS = "assets"

#: Backbone config keys that bound the sequence length (learned position embeddings).
MAX_LENGTH_KEYS = ("max_sequence_length", "max_position_embeddings")

_WHOLE_FOLDER = (
    "Copy the whole preset folder again (config.json, metadata.json, model.weights.h5, the "
    "tokenizer's files under assets/), or attach the model again on Kaggle"
)


@dataclass
class Preset:
    """What a preset holds, as far as its files tell without Keras.

    Attributes:
        location: the folder (absolute) or the handle, as ``from_preset`` is given it.
        remote: a ``kaggle://`` or ``hf://`` handle (its configs fetched, not its weights).
        backbone: the backbone's class name (``GemmaBackbone``), from config.json.
        saved_task: the task class it was saved as (``GemmaCausalLM``), from task.json.
        tasks: the kinds of task its backbone serves (``CausalLM``), from metadata.json.
        backbone_config: the backbone's constructor arguments, from config.json.
        registered_name: the backbone's name in Keras' registry (``keras_hub>GemmaBackbone``).
    """

    location: str
    remote: bool = False
    backbone: str | None = None
    saved_task: str | None = None
    tasks: list[str] = field(default_factory=list)
    backbone_config: dict[str, Any] = field(default_factory=dict)
    registered_name: str | None = None

    @property
    def max_sequence_length(self) -> int | None:
        return max_sequence_length(self.backbone_config)

    def default_task(self) -> str:
        """The task to build when ``model.task`` is unset: the one the preset was saved as, else
        the only kind its backbone serves.

        Raises:
            ModelError: the preset names none, or several.
        """
        if self.saved_task:
            return self.saved_task
        if len(self.tasks) == 1:
            return self.tasks[0]
        kinds = ", ".join(self.tasks) if self.tasks else "none"
        raise ModelError(
            f"model.task: the preset {self.location} was saved without a task (no {TASK}), and "
            f"its backbone serves several kinds ({kinds}): set model.task to the one to fine-tune, "
            "e.g. a KerasHub class such as BertTextClassifier or the kind itself (TextClassifier)."
        )


def max_sequence_length(backbone_config: dict[str, Any]) -> int | None:
    """The longest sequence a backbone takes (its learned position embeddings), from its config;
    None where nothing bounds it (rotary position embeddings)."""
    for key in MAX_LENGTH_KEYS:
        value = backbone_config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def is_handle(value: str) -> bool:
    return value.startswith(PRESET_HANDLES)


def location(config: Config) -> str:
    """``model.preset`` as ``from_preset`` takes it: a handle as written, a folder made absolute
    from the config file's folder."""
    value = config.model.preset
    if value is None:
        raise ValueError("the config has no model.preset")
    return value if is_handle(value) else str(Path(config.resolve_path(value)).resolve())


def read(config: Config) -> Preset:
    """The config's preset, checked: a local folder must be complete.

    Raises:
        ModelError: no such folder, a file missing or unreadable (named), or a
            ``sequence_length`` over the backbone's maximum.
    """
    where = location(config)
    if is_handle(where):
        preset = read_handle(where)
    else:
        preset = read_folder(Path(where), config.model.preset)
    check_sequence_length(preset.backbone, preset.backbone_config, config.model.sequence_length)
    return preset


def read_handle(handle: str) -> Preset:
    """A ``kaggle://`` or ``hf://`` preset's configs, fetched where its hub can be reached (its
    weights and tokenizer files are fetched by ``from_preset``).

    Raises:
        ModelError: the hub cannot be reached, or the handle holds no KerasHub preset.
    """
    handles.check_reachable(handle)
    config = handles.fetch_json(handle, CONFIG)
    if config is None:
        raise ModelError(
            f"model.preset: {handle} has no {CONFIG}: it is not a KerasHub preset. Check the "
            "handle on the hub's page (kaggle://org/model/keras/variant[/version], hf://org/model)."
        )
    if "registered_name" not in config:  # a Transformers or timm checkpoint, converted on load
        return Preset(handle, remote=True, backbone=config.get("model_type"))
    metadata = handles.fetch_json(handle, METADATA) or {}
    task = handles.fetch_json(handle, TASK) or {}
    return Preset(
        handle,
        remote=True,
        backbone=config.get("class_name"),
        saved_task=task.get("class_name"),
        tasks=list(metadata.get("tasks") or []),
        backbone_config=dict(config.get("config") or {}),
        registered_name=config.get("registered_name"),
    )


def read_folder(folder: Path, written: str | None = None) -> Preset:
    """Check a preset folder's files and read its configs.

    Args:
        folder: the folder, absolute.
        written: ``model.preset`` as the user wrote it, for the message.
    """
    _check_exists(folder, written or str(folder))
    config = _json(folder, CONFIG)
    if "registered_name" not in config:
        # A Transformers or timm checkpoint (KerasHub converts those as it loads them): its files
        # are theirs to check.
        return Preset(str(folder), backbone=config.get("model_type") or config.get("architecture"))
    metadata = _json(folder, METADATA)
    _check_weights(folder)
    task = _json(folder, TASK) if (folder / TASK).is_file() else {}
    _check_preprocessing(folder)
    return Preset(
        str(folder),
        backbone=config.get("class_name"),
        saved_task=task.get("class_name"),
        tasks=list(metadata.get("tasks") or []),
        backbone_config=dict(config.get("config") or {}),
        registered_name=config.get("registered_name"),
    )


def check_sequence_length(backbone: str | None, config: dict[str, Any], length: int | None) -> None:
    """Raises ModelError when ``length`` is over the longest sequence the backbone (its class name
    and config) takes."""
    longest = max_sequence_length(config)
    if length is not None and longest is not None and length > longest:
        raise ModelError(
            f"model.sequence_length: {length} is over the longest sequence {backbone} takes "
            f"({longest}, its position embeddings): set it to {longest} or less."
        )


def _check_exists(folder: Path, written: str) -> None:
    if folder.is_dir():
        return
    if folder.exists():
        raise ModelError(f"model.preset: {folder} is a file; give the folder the preset is in.")
    hint = ""
    if "/" not in written:
        hint = (
            f" '{written}' reads as a folder name: a KerasHub preset name is downloaded as a "
            f"Kaggle handle, kaggle://keras/<model>/keras/{written}, where there is a network."
        )
    raise ModelError(
        f"model.preset: no folder {folder} (relative paths start at the config file's folder).{hint} "
        "Give the folder a KerasHub preset was saved to (with config.json and model.weights.h5); "
        "on Kaggle, attach the model as an input (Add Input > Models) and give its folder under "
        "/kaggle/input."
    )


def _missing(folder: Path, name: str, why: str = "") -> ModelError:
    return ModelError(
        f"model.preset: {folder} has no {name}{why}: the preset is incomplete. {_WHOLE_FOLDER}."
    )


def _json(folder: Path, name: str) -> dict[str, Any]:
    path = folder / name
    if not path.is_file():
        raise _missing(folder, name)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(
            f"model.preset: {path} is not readable JSON ({exc}). {_WHOLE_FOLDER}."
        ) from None
    if not isinstance(data, dict):
        raise ModelError(f"model.preset: {path} is not a JSON object. {_WHOLE_FOLDER}.")
    return data


def _check_weights(folder: Path) -> None:
    if (folder / WEIGHTS).is_file():
        return
    if not (folder / SHARDED_WEIGHTS).is_file():
        raise _missing(folder, WEIGHTS, " (the backbone's weights)")
    weight_map = _json(folder, SHARDED_WEIGHTS).get("weight_map") or {}
    shards = set()
    for value in weight_map.values():
        shards.update(value if isinstance(value, list) else [value])
    for shard in sorted(shards):
        if not (folder / shard).is_file():
            raise _missing(folder, shard, f" (a shard {SHARDED_WEIGHTS} names)")


def _check_preprocessing(folder: Path) -> None:
    """The tokenizer's config and asset files, where the preset has a tokenizer."""
    if (folder / TOKENIZER).is_file():
        tokenizer = _json(folder, TOKENIZER)
    elif (folder / PREPROCESSOR).is_file():
        tokenizer = (_json(folder, PREPROCESSOR).get("config") or {}).get("tokenizer")
    elif any((folder / name).is_file() for name in CONVERTERS):
        return  # images, audio or video: converters have no asset files
    else:
        raise _missing(folder, TOKENIZER, " (nor preprocessor.json)")
    if not isinstance(tokenizer, dict):
        return
    settings = tokenizer.get("config") or {}
    subdir = str(settings.get("config_file") or TOKENIZER).split(".")[0]
    for name in _asset_names(settings):
        if not (folder / ASSETS / subdir / name).is_file():
            raise _missing(folder, f"{ASSETS}/{subdir}/{name}", " (the tokenizer's vocabulary)")


def _asset_names(settings: dict[str, Any]) -> list[str]:
    """The asset files a saved tokenizer loads, told from its config's keys (``get_config`` and
    ``file_assets`` in keras_hub/src/tokenizers/): SentencePiece's proto, a byte-pair vocabulary
    and merges, or a WordPiece vocabulary. Another kind is left to ``from_preset``."""
    if "proto" in settings:
        return ["vocabulary.spm"] if settings["proto"] is None else []
    if "unsplittable_tokens" in settings or "add_prefix_space" in settings:
        return ["vocabulary.json", "merges.txt"]
    if "vocabulary" in settings and "suffix_indicator" in settings:
        return ["vocabulary.txt"] if settings["vocabulary"] is None else []
    return []
