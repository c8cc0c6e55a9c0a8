"""The config reference page, generated from the schema's own field descriptions.

The page (``docs/config-reference.md``) is committed so that it reads on GitHub; a test checks it
against the schema, so the two cannot disagree::

    python -m tpurun.config.reference                                   # print the page
    python -m tpurun.config.reference --write docs/config-reference.md  # regenerate it
    python -m tpurun.config.reference --check docs/config-reference.md  # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tpurun.config.base import NamedObject
from tpurun.config.features import Feature, FeatureOptions
from tpurun.config.schema import Config

PAGE = "docs/config-reference.md"
REGENERATE = f"python -m tpurun.config.reference --write {PAGE}"

_INTRO = f"""\
# Config reference

<!-- Generated from the descriptions in tpurun/config/schema.py, features.py and base.py by
     `{REGENERATE}`. Edit those, not this page. -->

Every key of the experiment file, its default and what it means. This page is generated from the
schema tpurun validates configs with, so the two cannot disagree; [The config](config.md) shows how
the keys work together.

A dotted key is a path through the YAML file: `train.learning_rate.base: 0.002` is written

```yaml
train:
  learning_rate:
    base: 0.002
```

and `--set train.learning_rate.base=0.002` overrides it on the command line. A section whose
default is *on* is switched off with `null` (`callbacks.tensorboard: null`); one whose default is
*off* is switched on by giving it (`callbacks.early_stopping: {{patience: 5}}`, or `{{}}` for its
defaults).
"""


def _union_args(annotation: Any) -> tuple[Any, ...]:
    """The members of a union (``A | B`` or ``Optional[A]``), or the annotation alone."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _section(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The config section a field holds (None for a value), and whether it may be ``null``."""
    args = _union_args(annotation)
    nullable = type(None) in args
    for arg in args:
        if isinstance(arg, type) and issubclass(arg, BaseModel) and arg is not NamedObject:
            return arg, nullable
    return None, nullable


def _choices(annotation: Any) -> list[Any]:
    """The allowed values when a field is a choice (``Literal``, or an optional one), else []."""
    values = []
    for arg in _union_args(annotation):
        if arg is type(None):
            continue
        if typing.get_origin(arg) is not Literal:
            return []
        values.extend(typing.get_args(arg))
    return values


def _code(value: Any) -> str:
    """A value as the YAML a user would write, in a code span."""
    if isinstance(value, NamedObject):
        value = value.model_dump()
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, (list, dict)):
        text = json.dumps(value)
    else:
        text = str(value)
    return f"`{text}`"


def _default(field: FieldInfo, is_section: bool) -> str:
    """The default as a reader wants it: `required`, on/off for a section, or the YAML value."""
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if is_section:
        return "off" if value is None else "on"
    return "none" if value is None else _code(value)


def _meaning(field: FieldInfo) -> str:
    text = field.description or ""
    choices = _choices(field.annotation)
    if len(choices) > 1:
        text += " Choices: " + ", ".join(_code(c) for c in choices) + "."
    return text.replace("|", "\\|").strip()


def _rows(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str, str]]:
    """(key, default, meaning) for every key of ``model``, nested sections walked, in order."""
    rows = []
    for name, field in model.model_fields.items():
        section, nullable = _section(field.annotation)
        key = prefix + name
        if section is None:
            rows.append((key, _default(field, False), _meaning(field)))
            continue
        if nullable:
            rows.append((key, _default(field, True), _meaning(field)))
        else:
            rows.append((key, "", _meaning(field)))
        rows.extend(_rows(section, key + "."))
    return rows


def _table(rows: list[tuple[str, str, str]]) -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {meaning} |" for key, default, meaning in rows]
    return "\n".join(lines) + "\n"


def _feature_types() -> str:
    """A section per feature type of ``data.features``: how it is stored and decoded, its keys."""
    parts = [
        "## Feature types\n",
        "`data.features` maps each feature's name to how its record key decodes, `type` picking "
        "the kind (`x: {type: raw, dtype: float32, shape: [1024]}`). Records are "
        "`tf.train.Example`s, laid out as Kaggle's public TFRecord datasets are. Before training, "
        "the first record of each split is checked against the declared features: a missing key, a "
        "wrong kind, or a raw byte length that does not fit the shape is an exit-2 error naming the "
        "feature, the file, what was declared and what the record holds.\n",
    ]
    union = typing.get_args(Feature)[0]
    for member in typing.get_args(union):
        model = typing.get_args(member)[0]  # Annotated[Model, Tag(...)]
        if model is FeatureOptions:
            continue
        type_field = model.model_fields["type"]
        (name,) = typing.get_args(type_field.annotation)
        rows = [row for row in _rows(model) if row[0] != "type"]
        parts.append(f"### `type: {name}`\n")
        parts.append((type_field.description or "") + "\n")
        parts.append(_table(rows))
    parts.append("### An entry without `type`\n")
    parts.append(
        "Options over the schema file's entry of the same name, merged when the data is read: "
        "`x: {normalize: true}` is the schema's `x` (its type and shape) with `normalize: true`. "
        "Its keys are those of the feature types above; the schema file must describe the feature, "
        "and the options must fit its type.\n"
    )
    return "\n".join(parts)


def reference_markdown() -> str:
    """The whole reference page: a table per config section, then the feature types."""
    parts = [_INTRO]
    top = []
    sections = []
    for name, field in Config.model_fields.items():
        section, _ = _section(field.annotation)
        if section is None:
            top.append((name, _default(field, False), _meaning(field)))
        else:
            sections.append((name, field, section))
    parts.append("## Top level\n")
    parts.append(_table(top))
    for name, field, section in sections:
        parts.append(f"## `{name}`\n")
        parts.append(_meaning(field) + "\n")
        parts.append(_table(_rows(section, name + ".")))
    parts.append(_feature_types())
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    """Print the page, write it (``--write PATH``), or check a written one (``--check PATH``)."""
    parser = argparse.ArgumentParser(prog="python -m tpurun.config.reference", description=__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", help="write the page to PATH")
    group.add_argument("--check", metavar="PATH", help="exit 1 if PATH differs from the schema")
    args = parser.parse_args(argv)
    page = reference_markdown()
    if args.write:
        Path(args.write).write_text(page)
    elif args.check:
        path = Path(args.check)
        if not path.exists() or path.read_text() != page:
            print(f"{path} is out of date with the config schema; regenerate it with: {REGENERATE}")
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
