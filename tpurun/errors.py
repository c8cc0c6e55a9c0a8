"""The errors tpurun raises on purpose.

Library code raises these with a plain sentence that names the key or file, what was found and what
to do; only ``cli.py`` turns them into ``error: ...`` and an exit code, with no traceback.
"""

from __future__ import annotations

import re

#: Exit codes, as documented in docs/exit-codes.md (``tpurun doctor`` exits 1 when a check fails).
EXIT_UNEXPECTED = 1
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 3
EXIT_AT_ONCE = 130  # a second signal: stop without saving (the shell's code for SIGINT)


class TpurunError(Exception):
    """A problem the user can fix: bad config, bad data, an environment that cannot run the config."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class ConfigError(TpurunError):
    """The config file, or a --set override, is invalid. ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        if len(self.problems) == 1:
            message = f"invalid config: {self.problems[0]}"
        else:
            lines = "\n".join(f"  {p}" for p in self.problems)
            message = f"invalid config ({len(self.problems)} problems):\n{lines}"
        super().__init__(message)


class DataError(TpurunError):
    """The data named by the config is missing, unreadable or does not match the features."""


class EnvironmentSetupError(TpurunError):
    """This machine or this Python process cannot run the config as written."""


class ModelError(TpurunError):
    """The model factory, optimizer, loss or metrics named by the config cannot be used."""


class Interrupted(TpurunError):
    """Training stopped on SIGTERM or SIGINT, after saving a checkpoint; rerunning continues."""

    exit_code = EXIT_INTERRUPTED


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Lines that say an exception happened without saying what (Keras wraps a layer's error in them).
_GENERIC = re.compile(r"^'?(Exception encountered( when calling [\w.]+\(\))?[.:]?|Traceback .*)$")


def describe(exc: BaseException, limit: int = 300) -> str:
    """``Type: first meaningful line`` of an exception, for one line of a message: its first line
    that is neither empty nor a wrapper's "Exception encountered", ANSI codes taken out, cut at
    ``limit`` characters."""
    text = _ANSI.sub("", str(exc)).strip()
    if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":  # a message quoted whole
        text = text[1:-1]
    lines = [line.strip() for line in text.splitlines()]
    meaningful = next((line for line in lines if line and not _GENERIC.match(line)), "")
    if len(meaningful) > limit:
        meaningful = meaningful[: limit - 3].rstrip() + "..."
    return f"{type(exc).__name__}: {meaningful}" if meaningful else type(exc).__name__
