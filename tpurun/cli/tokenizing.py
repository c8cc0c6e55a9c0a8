"""How ``tpurun data write`` tokenises: its ``--tokenize`` options, or a preset config's keys
(``--config``: ``model.preset``, ``model.sequence_length``, ``data.packing``,
``data.chat_template``), so records are written as the run that reads them will check them.
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tpurun.errors import DataError, ModelError, TpurunError

_OPTIONS = ("--tokenize", "--sequence-length", "--chat-template", "--packing")
#: What a message about an option says of the config's key it came from.
_KEYS = {"--tokenize:": "model.preset:", "--sequence-length:": "model.sequence_length:",
         "--packing:": "data.packing:", "Leave --packing out": "Set data.packing: false",
         "--chat-template applies": "data.chat_template applies"}  # fmt: skip


class Tokenizing:
    """The tokenising a ``data write`` asked for: none, its options', or its config's.

    Raises:
        TpurunError: options that need ``--tokenize`` without it, options beside ``--config``,
            a config without a preset.
        ConfigError: a config or chat template that does not load.
    """

    def __init__(
        self,
        preset: str | None,
        sequence_length: int | None,
        chat_template: str | None,
        packing: bool,
        config: str | None,
    ):
        given = dict(
            zip(_OPTIONS, (preset, sequence_length, chat_template, packing or None), strict=True)
        )
        self.config = None
        if config is not None:
            self._from_config(config, [option for option, v in given.items() if v is not None])
            return
        for option, value in list(given.items())[1:]:
            if value is not None and preset is None:
                raise TpurunError(
                    f"{option}: applies with --tokenize PRESET (it works on the preset's tokens); "
                    "add it, or leave it out. Without it the text is stored as it is."
                )
        self.preset, self.sequence_length, self.packing = preset, sequence_length, packing
        self.template = None
        if chat_template is not None:
            from tpurun.config.chat_config import load_template

            self.template = load_template(chat_template)

    def _from_config(self, path: str, also: list[str]) -> None:
        from tpurun.config import load_config
        from tpurun.config.chat_config import config_template

        if also:
            raise TpurunError(
                f"--config {path}: takes the preset, sequence length, packing and chat template "
                f"from the config, and {', '.join(also)} was given too. Set it in the config "
                f"(model.preset, model.sequence_length, data.packing, data.chat_template), or "
                "leave --config out."
            )
        self.config = load_config(path)
        if self.config.model.preset is None:
            raise TpurunError(
                f"--config {path}: its model is a factory (no model.preset), and --config "
                "tokenises with a preset's tokenizer. Leave --config out to store the text as it "
                "is; the factory's own layers read it."
            )
        self.preset = self.config.resolve_path(self.config.model.preset)
        self.sequence_length = self.config.model.sequence_length
        self.packing = bool(self.config.data.packing)
        self.template = config_template(self.config)

    def mapper(self) -> Callable[[Any], Any] | None:
        """What turns the opened source into token records; None to store it as it is."""
        if self.preset is None:
            return None
        # KerasHub's tokenizer (on the CPU) is loaded before the source is read: data/ never
        # imports hub/, the command wires them.
        from tpurun.hub.tokenize import mapper

        if self.config is None:
            return mapper(self.preset, self.sequence_length, self.template, self.packing)
        # With --config, refusals name the config's keys (at load, and as the source is read).
        return _keyed(
            _keyed(mapper)(self.preset, self.sequence_length, self.template, self.packing)
        )

    def unnamed(self, report: Any) -> list[str]:
        """With ``--config``: a line for each split written that the config's ``data.train`` or
        ``data.validation`` does not name (the run would not read these records)."""
        if self.config is None:
            return []
        lines = []
        for split, key in (("train", "train"), ("all", "train"), ("validation", "validation")):
            shards = [path for path, _, _ in report.splits.get(split, [])]
            globs = getattr(self.config.data, key)
            globs = [globs] if isinstance(globs, str) else list(globs or [])
            wanted = [_local(self.config.resolve_path(g)) for g in globs]
            if shards and not any(fnmatch.fnmatch(_local(s), g) for s in shards for g in wanted):
                stem = shards[0].rsplit("-", 3)[0]
                if "://" not in stem:
                    stem = os.path.relpath(Path(stem).resolve(), self.config.base_dir)
                lines.append(
                    f"data.{key} in the config ({', '.join(globs) or 'not set'}) does not name "
                    f"the {'' if split == 'all' else split + ' '}records written here: set "
                    f"data.{key}: {stem}-*.tfrecord there."
                )
        return lines


def _keyed(call: Callable) -> Callable:
    """``call`` with its refusals naming the config's keys where they name the options."""

    def keyed(*args: Any) -> Any:
        try:
            return call(*args)
        except (ModelError, DataError) as exc:
            message = str(exc)
            for option, key in _KEYS.items():
                message = message.replace(option, key, 1)
            raise type(exc)(message) from None

    return keyed


def _local(path: str) -> str:
    return path if "://" in path else str(Path(path).resolve())
