"""Loading an experiment file: strict YAML with line numbers, ``--set`` overrides, and every
problem reported at once with ``file:line``, the dotted key, what was received and what is allowed.
"""

from __future__ import annotations

import difflib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from tpurun.config.features import FeatureOptions
from tpurun.config.schema import WRITTEN_KEYS, Config, DataConfig
from tpurun.errors import ConfigError


# ---------------------------------------------------------------------------------------- loading
class _Located:
    """Where each key of a YAML document (or a --set override) came from.

    ``source`` is the file's path, or "" for a config given as a dict: its problems then start
    with the key (ConfigError's "invalid config: " already says what was invalid).
    """

    def __init__(self, source: str):
        self.source = source
        self.lines: dict[tuple, int] = {}
        self.overrides: dict[tuple, str] = {}

    def at(self, path: tuple) -> str:
        """The prefix of a problem with ``path``: ``"exp.yaml:12: "``, ``"--set k=v: "`` or ``""``."""
        for n in range(len(path), -1, -1):
            if path[:n] in self.overrides:
                return f"--set {self.overrides[path[:n]]}: "
        below = [item for key, item in self.overrides.items() if key[: len(path)] == path]
        if path and below:  # a --set that wrote inside this key made it what it is
            return f"--set {below[-1]}: "
        for n in range(len(path), -1, -1):
            if path[:n] in self.lines:
                return f"{self.source}:{self.lines[path[:n]]}: "
        return f"{self.source}: " if self.source else ""


def _index_lines(node: yaml.Node, path: tuple, located: _Located, problems: list[str]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: set = set()
        for key_node, value_node in node.value:
            key = key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                dotted = ".".join(map(str, (*path, key)))
                problems.append(f"{located.source}:{line}: duplicate key '{dotted}'")
            seen.add(key)
            located.lines[(*path, key)] = line
            _index_lines(value_node, (*path, key), located, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            located.lines[(*path, i)] = item.start_mark.line + 1
            _index_lines(item, (*path, i), located, problems)


def _parse_yaml(text: str, source: str) -> tuple[dict, _Located]:
    located = _Located(source)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError([f"{where}: not valid YAML: {problem}"]) from None
    if data is None:
        raise ConfigError([f"{source}: the file is empty"])
    if not isinstance(data, dict):
        raise ConfigError(
            [f"{source}:1: expected a mapping of keys at the top, got {type(data).__name__}"]
        )
    problems: list[str] = []
    _index_lines(node, (), located, problems)
    if problems:
        raise ConfigError(problems)
    return data, located


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value``; the value is read as YAML (so 3 is an int and [1, 2] a list)."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(
            [f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. train.epochs=3"]
        )
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        # A list, a mapping or a quoted string that does not parse is a mistake, not a string;
        # anything else (`*.tfrecord`, `a: b: c`) stays the text as written.
        if raw.lstrip().startswith(("[", "{", '"', "'")):
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError(
                [
                    f"--set {item}: the value starts like a YAML {_flow_kind(raw)} but does not parse "
                    f"({problem}); close it, or quote the whole value to pass it as text"
                ]
            ) from None
        value = raw
    return key.strip().split("."), value


def _flow_kind(raw: str) -> str:
    return {"[": "list", "{": "mapping"}.get(raw.lstrip()[0], "quoted string")


def apply_overrides(data: dict, overrides: list[str], located: _Located) -> None:
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[keys[-1]] = value
        located.overrides[tuple(keys)] = item


def _model_at(loc: tuple, data: Any) -> tuple[type[BaseModel] | None, tuple]:
    """Walk the schema along a pydantic error location.

    Returns the model class found at that location, and the location with pydantic's union tags
    removed, so that it matches the keys the user wrote.
    """
    cls: Any = Config
    path: list = []
    for part in loc:
        if isinstance(data, dict) and part in data:
            path.append(part)
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            path.append(part)
            data = data[part]
        # else: a union tag such as 'raw' or 'int' that the user never wrote; it still narrows `cls`.
        cls = _descend(cls, part)
    return _single_model(cls), tuple(path)


def _single_model(tp: Any) -> type[BaseModel] | None:
    """The model a type stands for: itself, or the one model inside ``Optional[...]``/``list[...]``."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    models = [a for a in _flatten(tp) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 else None


def _descend(cls: Any, part: Any) -> Any:
    if isinstance(cls, type) and issubclass(cls, BaseModel):
        field = cls.model_fields.get(part) if isinstance(part, str) else None
        return field.annotation if field is not None else cls
    for arg in _flatten(cls):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            type_field = arg.model_fields.get("type")
            if type_field is not None and typing.get_args(type_field.annotation) == (part,):
                return arg
            if getattr(arg, "TAG", None) == part:  # a feature entry without type
                return arg
    return _single_model(cls) or cls


def _flatten(tp: Any) -> list:
    """All types inside Optional/Union/list/dict/Annotated."""
    args = typing.get_args(tp)
    if not args:
        return [tp]
    out: list = []
    for arg in args:
        out.extend(_flatten(arg))
    return out


def _format_error(err: dict, data: dict, located: _Located) -> str:
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        parent_cls, parent_path = _model_at(loc[:-1], data)
        key = loc[-1]
        dotted = ".".join(map(str, (*parent_path, key)))
        allowed = sorted(parent_cls.model_fields) if parent_cls else []
        close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else f"; allowed here: {', '.join(allowed)}"
        return f"{located.at((*parent_path, key))}unknown key '{dotted}'{hint}"
    if kind == "missing":
        _, parent = _model_at(loc[:-1], data)
        dotted = ".".join(map(str, (*parent, loc[-1])))
        return f"{located.at(parent)}'{dotted}' is required but missing"
    _, path = _model_at(loc, data)
    dotted = ".".join(map(str, path)) or "(top level)"
    at = located.at(path)
    if kind == "union_tag_invalid":
        tags = [t.strip(" '") for t in err["ctx"]["expected_tags"].split(",")]
        tags = [t for t in tags if t != FeatureOptions.TAG]  # an entry without type, not a type
        tag = str(err["ctx"]["tag"])
        close = difflib.get_close_matches(tag, tags, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(tags)}"
        return f"{located.at((*path, 'type'))}{dotted}.type: unknown feature type '{tag}'; {hint}"
    if kind == "union_tag_not_found":
        tags = ", ".join(_feature_types(loc))
        return f"{at}{dotted}: 'type' is required, one of: {tags}"
    msg = err["msg"].removeprefix("Value error, ")
    received = err.get("input")
    if isinstance(received, (dict, list)) and len(repr(received)) > 60:
        return f"{at}{dotted}: {msg}"
    return f"{at}{dotted}: {msg}; received {received!r}"


def _feature_types(loc: tuple) -> list[str]:
    """The ``type`` tags the union at ``loc`` accepts (``raw``, ``int64``, ...)."""
    cls: Any = Config
    for part in loc:
        cls = _descend(cls, part)
    members = [a for a in _flatten(cls) if isinstance(a, type) and issubclass(a, BaseModel)]
    return [typing.get_args(m.model_fields["type"].annotation)[0] for m in members
            if "type" in m.model_fields]  # fmt: skip


def _cross_checks(config: Config, located: _Located) -> list[str]:
    """Rules that span sections: feature references, LR plateau versus a schedule."""
    problems = []
    lr = config.train.learning_rate
    if config.callbacks.reduce_lr_on_plateau is not None and (
        lr.schedule != "constant" or lr.warmup_epochs > 0
    ):
        problems.append(
            f"{located.at(('callbacks', 'reduce_lr_on_plateau'))}callbacks.reduce_lr_on_plateau cannot change a scheduled learning rate "
            f"(train.learning_rate.schedule: {lr.schedule}, warmup_epochs: {lr.warmup_epochs:g}); "
            "use schedule: constant with warmup_epochs: 0, or set reduce_lr_on_plateau: null"
        )
    # data.inputs / data.targets are checked once the data is resolved (data.resolve): features
    # left out, or a partial list, are completed from the schema file beside the shards. A
    # factory's model needs both named; a preset's may take them from the features.
    if config.model.preset is not None:
        for name, feature in config.data.features.items():
            if (
                getattr(feature, "type", None) == "image"
                and feature.scale
                and "scale" in feature.model_fields_set
            ):
                problems.append(
                    f"{located.at(('data', 'features', name, 'scale'))}data.features.{name}.scale: "
                    "a preset's image converter scales the pixels itself, from 0..255, as the "
                    "model was pretrained; remove scale (tpurun feeds a preset 0..255)"
                )
            if getattr(feature, "normalize", False):
                problems.append(
                    f"{located.at(('data', 'features', name, 'normalize'))}data.features.{name}"
                    ".normalize: a preset's own preprocessor prepares its inputs (normalize puts "
                    "a layer in front of a factory's model); remove it"
                )
    if config.model.factory is not None:
        for key in ("inputs", "targets"):
            if getattr(config.data, key) is None:
                problems.append(f"{located.at(('data',))}'data.{key}' is required but missing")
    return problems


def reference_problems(data: DataConfig, at=lambda path: "") -> list[str]:
    """``inputs`` and ``targets`` must name declared features.

    ``at(path)`` gives each problem's prefix (a file's line); none for features read from a schema.
    """
    problems = []
    declared = list(data.features)
    for key in ("inputs", "targets"):
        for name in DataConfig.names(getattr(data, key)):
            if name not in data.features:
                close = difflib.get_close_matches(name, declared, n=1)
                hint = (
                    f"did you mean '{close[0]}'?" if close else f"declared: {', '.join(declared)}"
                )
                problems.append(
                    f"{at(('data', key))}data.{key}: '{name}' is not a declared feature; {hint}"
                )
    return problems


def validate(data: dict, located: _Located, base_dir: Path | None = None) -> Config:
    """Validate plain data into a Config, reporting every problem at once."""
    data = {k: v for k, v in data.items() if k not in WRITTEN_KEYS}
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems = list(dict.fromkeys(_format_error(e, data, located) for e in exc.errors()))
        raise ConfigError(problems) from None
    problems = _cross_checks(config, located)
    if problems:
        raise ConfigError(problems)
    if base_dir is not None:
        config._base_dir = base_dir
    return config


def _missing_file(path: Path) -> str:
    """What a config path that is not a file says, with the file meant when one is close: the
    other YAML suffix, or a near name in the same folder."""
    if path.exists():
        return f"{path}: not a file"
    folder = path.parent if str(path.parent) else Path(".")
    twin = path.with_suffix({".yml": ".yaml", ".yaml": ".yml"}.get(path.suffix, ".yaml"))
    if twin.is_file():
        return f"{path}: no such file; did you mean {twin}?"
    if folder.is_dir():
        configs = {p.stem: p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml")}
        close = difflib.get_close_matches(path.stem, list(configs), n=1)
        if close:
            return f"{path}: no such file; did you mean {folder / configs[close[0]]}?"
    return f"{path}: no such file"


def load_config(source: str | Path | dict, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Load and validate a config file (or a dict), applying ``--set`` style overrides.

    Args:
        source: path to a YAML file, or the config as a dict (relative paths then resolve from the
            current directory).
        overrides: ``"dotted.key=value"`` strings; values are read as YAML.

    Raises:
        ConfigError: listing every problem, each with ``file:line`` (or ``--set KEY``) and the key.
    """
    if isinstance(source, dict):
        import copy

        data, located, base_dir = copy.deepcopy(source), _Located(""), Path.cwd()
        data.setdefault("name", "run")
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError([_missing_file(path)])
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError([f"{path}: cannot read it: {exc}"]) from None
        data, located = _parse_yaml(text, str(path))
        base_dir = path.resolve().parent
        # A run directory's own config.yaml names the run; otherwise the file's stem does.
        if "name" not in data:
            data["name"] = path.stem
    apply_overrides(data, list(overrides), located)
    return validate(data, located, base_dir)
