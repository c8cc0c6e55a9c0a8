"""The config's ``data.packing`` and ``data.chat_template`` against the records' schema file.

Both are done when the records are written (``tpurun data write SOURCE OUT_PREFIX --config
CONFIG`` reads them from the config), so a run checks what its records were written with, before
anything is loaded: records written otherwise than the config says would train silently on
unpacked data, or in another chat format than the one ``predict`` renders.
"""

from __future__ import annotations

from typing import Any

from tpurun.config.chat_config import ChatTemplate, config_template
from tpurun.config.schema import Config
from tpurun.data import schema_file
from tpurun.errors import DataError

_REWRITE = "`tpurun data write SOURCE OUT_PREFIX --config CONFIG --overwrite`"


def check(config: Config, tokenized: dict[str, Any] | None) -> None:
    """Refuse records whose packing or chat format is not the config's.

    Args:
        config: the config, with the data section resolved (features filled in).
        tokenized: the records' schema file's ``tokenized`` entry (with ``schema``, its path);
            None for records that hold text, or token ids written without a schema file.

    Raises:
        ConfigError: a ``data.chat_template`` file that cannot be read.
        DataError: records written otherwise than the config says, naming the rewrite.
    """
    data = config.data
    template = config_template(config)
    if data.packing is None and template is None:
        return
    if not schema_file.is_tokenized(data):
        key = "data.packing: true" if data.packing else "data.chat_template"
        if data.packing is False and template is None:
            return  # text records are one example each
        raise DataError(
            f"{key}: applies to token records, and data.train holds text that the preprocessor "
            f"tokenises as it reads. Write token ids as the config says with {_REWRITE} (it "
            "takes the preset, sequence length, packing and chat template from the config), "
            "then set data.train and data.validation to its OUT_PREFIX-train-*.tfrecord and "
            "OUT_PREFIX-validation-*.tfrecord."
        )
    if tokenized is None:
        return  # token ids without a schema file: nothing records how they were written
    where = tokenized.get("schema", "data.train")
    packed = tokenized.get("packing") is not None
    if data.packing is not None and data.packing != packed:
        how = "packed, several examples a record" if packed else "one example a record"
        raise DataError(
            f"data.packing: {str(data.packing).lower()}, and the records of {where} were written "
            f"{how}. Write them again with {_REWRITE}, or set data.packing: "
            f"{str(packed).lower()} (or leave it out) to train on them as they are."
        )
    if template is not None:
        _check_chat(template, tokenized.get("chat"), where)


def _check_chat(template: ChatTemplate, chat: dict[str, Any] | None, where: str) -> None:
    if chat is None:
        raise DataError(
            f"data.chat_template: the records of {where} hold no conversations (they were "
            "written from prompt and response, or text). Leave data.chat_template out, or write "
            f"chat data (lines of 'messages') with {_REWRITE}."
        )
    written = {key: chat.get(key) for key in ("user", "assistant", "system")}
    if written != template.model_dump():
        differ = [key for key, value in template.model_dump().items() if written[key] != value]
        turns = " and ".join(differ) + (" turns differ" if len(differ) > 1 else " turn differs")
        raise DataError(
            f"data.chat_template: the records of {where} were written in the "
            f"{chat.get('format')} chat format, whose {turns} from the config's (written: "
            f"{', '.join(f'{k}: {written[k]!r}' for k in differ)}). Write them "
            f"again with {_REWRITE}, or leave data.chat_template out to train them as written."
        )
