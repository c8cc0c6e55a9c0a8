"""A chat template given by hand, for a preset whose family has no chat format in tpurun:
``tpurun data write CHAT.jsonl OUT --tokenize PRESET --chat-template TEMPLATE.yaml``, or a
config's ``data.chat_template`` (the file, or the mapping inline).

The file is three strings, each with one ``{content}``, the turn's text::

    user: "<|user|>\\n{content}<|end|>\\n"
    assistant: "<|assistant|>\\n{content}<|end|>\\n"
    system: "<|system|>\\n{content}<|end|>\\n"   # optional

A marker in them written as ``<...>`` or ``<|...|>`` becomes the vocabulary's one token for it,
where the vocabulary has one (a turn's content never does: text a user wrote cannot turn into a
control token). The loss counts an assistant turn's content and the rest of its template after it
(the end marker), nothing of the user's or the system's turns.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator

from tpurun.config.base import Section
from tpurun.errors import ConfigError

CONTENT = "{content}"


class ChatTemplate(Section):
    user: str = Field(description="A user turn, with one `{content}`.")
    assistant: str = Field(
        description="An assistant turn, with one `{content}`; the loss counts the content and "
        "what follows it (the end marker)."
    )
    system: str | None = Field(
        None,
        description="A system turn (the first turn only), with one `{content}`. Left out: the "
        "system text goes before the first user turn's content, a blank line between.",
    )

    @field_validator("user", "assistant", "system")
    @classmethod
    def _one_content(cls, value: str | None) -> str | None:
        if value is not None and value.count(CONTENT) != 1:
            raise ValueError(
                f"{value!r} has {value.count(CONTENT)} `{CONTENT}`; a turn's template holds "
                "exactly one, where the turn's text goes"
            )
        return value


def load_template(path: str, where: str | None = None) -> ChatTemplate:
    """The template file at ``path``; ``where`` names it in messages (``--chat-template PATH``).

    Raises:
        ConfigError: a file that cannot be read, is not a YAML mapping, or is not a template
            (each problem with its key).
    """
    where = where or f"--chat-template {path}"
    try:
        found = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError([f"{where}: cannot read it ({exc.strerror or exc})."]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"{where}: not valid YAML ({exc})."]) from None
    if not isinstance(found, dict):
        raise ConfigError(
            [
                f"{where}: expected a mapping of `user`, `assistant` and optionally `system` "
                f"templates, each with one {CONTENT}; found {type(found).__name__}."
            ]
        )
    try:
        return ChatTemplate.model_validate(found)
    except ValidationError as exc:
        raise ConfigError(
            [
                f"{where}: {'.'.join(str(p) for p in e['loc']) or 'template'}: {e['msg']}"
                for e in exc.errors()
            ]
        ) from None


def config_template(config: Any) -> ChatTemplate | None:
    """A config's ``data.chat_template``: the file it names (relative to the config's folder)
    read, or the mapping given inline; None where it has none.

    Raises:
        ConfigError: as :func:`load_template`, naming the key.
    """
    given = config.data.chat_template
    if isinstance(given, str):
        return load_template(config.resolve_path(given), f"data.chat_template: {given}")
    return given
