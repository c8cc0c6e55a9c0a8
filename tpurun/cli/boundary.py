"""The command line's boundary: how exceptions, signals and ``--set`` slips become one message and
an exit code (the README's table). Only the commands of :mod:`tpurun.cli` use it.

- :class:`TpurunError`: ``error: <its paragraph>``, exit 2 (an :class:`Interrupted` run: 3).
- A framework that is missing or fails its own import: exit 2, saying what to check.
- SIGINT or SIGTERM: exit 3 where ``train`` stops cleanly (a :class:`Signalled` before or after
  its training loop, :class:`Interrupted` inside it); a second signal during training, or Ctrl-C
  in another command, 130. What a signal means when is
  :class:`tpurun.training.signals.SignalRoute`'s; this module only says it.
- Anything else: exit 1, the traceback in a file whose path is printed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shlex
import shutil
import sys
import tempfile
import textwrap
import threading
import traceback
from pathlib import Path

import typer

from tpurun.errors import (
    EXIT_AT_ONCE,
    EXIT_INTERRUPTED,
    EXIT_UNEXPECTED,
    EnvironmentSetupError,
    Interrupted,
    TpurunError,
    describe,
)
from tpurun.training.signals import SIGNALS, Signalled, interrupt_in


# ------------------------------------------------------------------------------------------- --set
class SetCommand(typer.core.TyperCommand):
    """A command that catches ``--set KEY VALUE`` (a space for the ``=``) before Typer calls the
    VALUE an unexpected extra argument."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        _check_set_items(args)
        return super().parse_args(ctx, args)


def _check_set_items(args: list[str]) -> None:
    for i, arg in enumerate(args):
        if arg == "--":
            return
        if arg in ("--set", "-s"):
            item, following = (args[i + 1] if i + 1 < len(args) else "="), args[i + 2 : i + 3]
        elif arg.startswith("--set="):
            item, following = arg.removeprefix("--set="), args[i + 1 : i + 2]
        else:
            continue
        if "=" in item or item.startswith("-"):
            continue
        # The next word is the value a user meant, unless it is an option or the config file.
        meant = following[0] if following else ""
        if not meant or meant.startswith("-") or meant.endswith((".yaml", ".yml")):
            example = f"{item}=VALUE"
        else:
            example = shlex.quote(f"{item}={meant}")
        raise typer.BadParameter(
            f"takes KEY=VALUE as one argument, and '{item}' has no '='; "
            f"did you mean --set {example}?",
            param_hint="'--set'",
        )


# ------------------------------------------------------------------------------------- exit codes
def say(text: str) -> None:
    """A message on stderr. On a terminal, wrapped between words at its width, so a path is never
    cut in two; plain (a notebook, CI, a pipe: :func:`tpurun.display.lines.want_plain`), as it is."""
    from tpurun.display.reporter import want_plain

    if not want_plain(stream=sys.stderr):
        width = shutil.get_terminal_size().columns
        text = "\n".join(
            textwrap.fill(line, width, break_long_words=False, break_on_hyphens=False) or line
            for line in text.split("\n")
        )
    typer.echo(text, err=True)


def fail(exc: TpurunError) -> typer.Exit:
    label = "stopped" if isinstance(exc, Interrupted) else "error"
    say(f"{label}: {exc}")
    return typer.Exit(code=exc.exit_code)


def _unexpected(exc: Exception) -> typer.Exit:
    """Say where the traceback is: the run directory's ``error.log`` when the run wrote it there
    (``exc.tpurun_error_log``), else a temporary file written here."""
    text = traceback.format_exc()
    path = getattr(exc, "tpurun_error_log", None)
    if path is None:
        try:
            fd, name = tempfile.mkstemp(prefix="tpurun-error-", suffix=".log")
            os.close(fd)
            Path(name).write_text(text)
            path = name
        except OSError:
            path = None
    where = f"; the traceback is in {path}" if path else f"\n{text}"
    typer.echo(f"error: unexpected failure: {describe(exc)}{where}", err=True)
    return typer.Exit(code=EXIT_UNEXPECTED)


_FRAMEWORKS = {"tensorflow": "TensorFlow", "keras": "Keras", "jax": "JAX", "jaxlib": "JAX"}


def _broken_framework(exc: BaseException) -> TpurunError | None:
    """A framework that is missing or fails its own import: the environment's fault (exit 2).
    When the failure is in another package the framework imports (matplotlib, say), that package
    is named as the cause, and the check suggested is for it."""
    importing, culprit = [], None
    tb = exc.__traceback__
    while tb is not None:  # the framework modules whose top-level code was running
        module = tb.tb_frame.f_globals.get("__name__", "")
        top = module.split(".")[0]
        if tb.tb_frame.f_code.co_name == "<module>" and top in _FRAMEWORKS:
            importing.append(top)
        elif importing and top and top not in _FRAMEWORKS and top not in ("importlib", "tpurun"):
            culprit = top  # the innermost package below the framework's import
        tb = tb.tb_next
    missing = isinstance(exc, ImportError) and (exc.name or "").split(".")[0] in _FRAMEWORKS
    if not importing and not missing:
        return None
    package = importing[0] if importing else exc.name.split(".")[0]
    name = _FRAMEWORKS[package]
    if culprit is not None:
        return EnvironmentSetupError(
            f"{name} cannot be imported: the {culprit} it imports failed ({describe(exc)}). The "
            f"cause is {culprit} or its settings, not {name}: check `python -c 'import {culprit}'`"
            " in this environment, with the same environment variables; `tpurun doctor` shows "
            "what it finds."
        )
    if package == "tensorflow" and missing:
        return EnvironmentSetupError(
            f"TensorFlow is not installed here ({describe(exc)}), and this needs it. tpurun "
            "trains on JAX without it (the native reader); what needs TensorFlow is its "
            "backend, data.reader: tf_data, export --format saved_model and KerasHub's "
            "tokenizers (tensorflow-text). Install it with "
            "pip install 'tpurun[tensorflow]' (or tensorflow-cpu), or change the config."
        )
    return EnvironmentSetupError(
        f"{name} cannot be imported ({describe(exc)}), and this command needs it. "
        f"Check it with `python -c 'import {package}'` in this environment; "
        "`tpurun doctor` lists the versions installed. Where no JAX is installed, "
        "pip install 'tpurun[cpu]' (or [gpu], [tpu]); on Kaggle and Colab, keep the image's own."
    )


def _interrupted(exc: KeyboardInterrupt, text: str) -> typer.Exit:
    if isinstance(exc, Signalled):
        say(f"stopped: {exc}")
        return typer.Exit(code=EXIT_INTERRUPTED)
    typer.echo(text, err=True)
    return typer.Exit(code=EXIT_AT_ONCE)


@contextlib.contextmanager
def exit_codes(interrupted: str = "interrupted", train: bool = False):
    """The one place errors become exit codes: 2 with a message, 1 with a traceback file.

    Heavy imports (TensorFlow, JAX, Keras) belong inside it, so a broken install is a message too.
    ``interrupted`` is what Ctrl-C prints (exit 130). The block is the command's span on the signal
    route (:meth:`tpurun.training.signals.SignalRoute.command`): a signal held since ``main()``
    started is delivered here, and ``train`` stops with exit 3 on a signal until its training loop
    takes them.
    """
    try:
        with SIGNALS.command(train):
            yield
    except TpurunError as exc:
        raise fail(exc) from None
    except KeyboardInterrupt as exc:
        raise _interrupted(exc, interrupted) from None
    except Exception as exc:
        stop = interrupt_in(exc)
        if stop is not None:
            raise _interrupted(stop, interrupted) from None
        broken = _broken_framework(exc)
        if broken is not None:
            raise fail(broken) from None
        raise _unexpected(exc) from None


# ------------------------------------------------------------------------------------------- exit
def end_process(code: int) -> None:
    """End the command's process with ``code``, as ``sys.exit`` would, only sooner.

    Once TensorFlow or JAX is loaded, the interpreter's own finalization (tearing down thousands
    of modules, then the frameworks' C++ destructors) takes 1.2-1.8 s on 2 cores after every file
    is written: an eighth of the quickstart. So Python's exit duties are done here, in its order
    (the other threads joined, ``atexit`` handlers run: the run lock's release, logging's flush,
    JAX's distributed shutdown; stdio flushed), and the process then ends at once. Without a
    framework loaded (``--help``, a config error) the exit is the ordinary one.
    """
    if not any(name in sys.modules for name in ("tensorflow", "jax")):
        sys.exit(code)
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # the handlers, last registered first, as a normal exit runs them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
