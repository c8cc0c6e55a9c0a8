"""The errors tpurun raises on purpose.

Library code raises these with a plain sentence that names the key or file, what was found and what
to do; only ``cli.py`` turns them into ``error: ...`` and an exit code, with no traceback.
"""

from __future__ import annotations

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
