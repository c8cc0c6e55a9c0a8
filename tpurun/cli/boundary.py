"""The command line's boundary: how exceptions, signals and ``--set`` slips become one message and
an exit code (the README's table). Only :mod:`tpurun.cli.app` uses it.

- :class:`TpurunError`: ``error: <its paragraph>``, exit 2 (an :class:`Interrupted` run: 3).
- A framework that is missing or fails its own import: exit 2, saying what to check.
- SIGINT or SIGTERM: exit 3 where ``train`` stops cleanly (:class:`StopSignals`); a second signal
  during training, or Ctrl-C in another command, 130.
- Anything else: exit 1, the traceback in a file whose path is printed.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import sys
import tempfile
import textwrap
import threading
import traceback
from pathlib import Path
from typing import Any

import typer

from tpurun.errors import (
    EXIT_AT_ONCE,
    EXIT_INTERRUPTED,
    EXIT_UNEXPECTED,
    EnvironmentSetupError,
    Interrupted,
    TpurunError,
)


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
    last = text.strip().splitlines()[-1]
    where = f"; the traceback is in {path}" if path else f"\n{text}"
    typer.echo(f"error: unexpected failure: {last}{where}", err=True)
    return typer.Exit(code=EXIT_UNEXPECTED)


_FRAMEWORKS = {"tensorflow": "TensorFlow", "keras": "Keras", "jax": "JAX", "jaxlib": "JAX"}


def _broken_framework(exc: BaseException) -> TpurunError | None:
    """A framework that is missing or fails its own import: the environment's fault (exit 2)."""
    importing = []
    tb = exc.__traceback__
    while tb is not None:  # the framework modules whose top-level code was running
        module = tb.tb_frame.f_globals.get("__name__", "")
        if tb.tb_frame.f_code.co_name == "<module>" and module.split(".")[0] in _FRAMEWORKS:
            importing.append(module.split(".")[0])
        tb = tb.tb_next
    missing = isinstance(exc, ImportError) and (exc.name or "").split(".")[0] in _FRAMEWORKS
    if not importing and not missing:
        return None
    name = _FRAMEWORKS[importing[0] if importing else exc.name.split(".")[0]]
    last = (str(exc).strip().splitlines() or [""])[-1]
    return EnvironmentSetupError(
        f"{name} cannot be imported ({type(exc).__name__}: {last}), and this command needs it. "
        f"Check it with `python -c 'import {(importing or [exc.name])[0]}'` in this environment; "
        "`tpurun doctor` lists the versions installed. Where no framework is installed, "
        "pip install 'tpurun[cpu]' (or [gpu], [tpu]); on Kaggle and Colab, keep the image's own."
    )


def _interrupt_in(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The interrupt behind an error, if any (NumPy turns one inside its import into an
    ImportError, which is not a broken install)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


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
    ``interrupted`` is what Ctrl-C prints (exit 130). A signal held since ``main()`` started
    (:data:`START_UP`) is delivered here: ``train`` stops with exit 3, the others as Ctrl-C.
    """
    try:
        START_UP.release(train)
        yield
    except TpurunError as exc:
        raise fail(exc) from None
    except KeyboardInterrupt as exc:
        raise _interrupted(exc, interrupted) from None
    except Exception as exc:
        stop = _interrupt_in(exc)
        if stop is not None:
            raise _interrupted(stop, interrupted) from None
        broken = _broken_framework(exc)
        if broken is not None:
            raise fail(broken) from None
        raise _unexpected(exc) from None


# ---------------------------------------------------------------------------------------- signals
class Signalled(KeyboardInterrupt):
    """SIGINT or SIGTERM while ``train`` was outside its training loop."""

    def __init__(self, name: str, after_training: bool):
        super().__init__(name)
        self.name, self.after_training = name, after_training

    def __str__(self) -> str:
        if self.after_training:
            return (
                f"{self.name} after the last step, while the run was being saved; its checkpoint "
                "is kept. Run the same command again to finish."
            )
        return (
            f"{self.name} before training started: no step ran, nothing is lost. Run the same "
            "command again to train."
        )


class StartUpSignals:
    """SIGINT and SIGTERM from ``main()`` until a command's :func:`exit_codes` takes them.

    Typer takes a few tenths of a second to build the commands. A signal then ended ``train`` with
    exit 130 or a traceback instead of exit 3, and when the process started with SIGINT ignored (a
    background job of a script, which inherits that) a SIGINT then was lost: StopSignals, coming
    later, took SIGINT over, and the run trained to its end and exited 0. Held here, it is
    delivered once the command starts. The interpreter's own start and ``tpurun.cli.app``'s imports
    (about a tenth of a second) come before any of tpurun's code can hold anything.
    """

    def __init__(self) -> None:
        self.pending: str | None = None
        self._original: dict[int, Any] = {}

    def hold(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._original = {sig: signal.signal(sig, self._hold) for sig in StopSignals.SIGNALS}

    def _hold(self, signum: int, frame: Any) -> None:
        if self.pending is not None:
            raise KeyboardInterrupt  # a second one: at once
        self.pending = signal.Signals(signum).name

    def release(self, train: bool) -> None:
        """Put the handlers back and deliver a held signal: exit 3 for ``train``; SIGINT as Ctrl-C
        elsewhere (or not at all, when the process started with it ignored), SIGTERM's default."""
        original, self._original = self._original, {}
        for sig, old in original.items():
            signal.signal(sig, old)
        held, self.pending = self.pending, None
        if held is None:
            return
        if train:  # StopSignals takes both signals over, as it does when nothing was held
            raise Signalled(held, after_training=False)
        if held == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
        elif original.get(signal.SIGINT) is not signal.SIG_IGN:
            raise KeyboardInterrupt


START_UP = StartUpSignals()  # cli.main() holds; exit_codes() releases


class StopSignals:
    """SIGINT and SIGTERM outside the training loop stop ``train`` with exit 3, as inside it.

    The loop's own handler (:func:`tpurun.training.signals.stop_on_signals`) replaces this one while it
    runs. Without this one, Ctrl-C during start-up exits 130 and SIGTERM ends the process without
    a word. A signal that arrives during an import waits for the import to finish: an extension
    module stopped mid-initialisation prints a traceback and reports a broken install.
    ``reporter``, once set, tells whether training has started (its ``started``).

    The exception a handler raises lands wherever the main thread is, and that can be Python code
    a framework's C++ called (TensorFlow's ``nest.flatten`` building a dataset, seen): there it
    came out as an unrelated error (a bare TypeError: exit 1, "unexpected failure"), or it could
    be cleared and lost. So the signal stays pending until it surfaces: an unrelated error that
    leaves the block after it is the signal (exit 3); if none does, training takes it over
    (:meth:`hand_over`) and stops at its first step.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.pending: str | None = None
        self.reporter: Any = None
        self._previous: dict[int, Any] = {}
        self._raised: Signalled | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        if signal.SIGALRM in self._previous:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        raised, self._raised = self._raised, None
        if raised is not None and exc is not None and _interrupt_in(exc) is None:
            if not isinstance(exc, TpurunError):  # a framework turned the signal into this
                raise Signalled(raised.name, raised.after_training) from exc

    def hand_over(self) -> str | None:
        """Training takes the signals over: the signal not acted on yet, if any, is its own now."""
        held, self.pending, self._raised = self.pending, None, None
        return held

    def _handle(self, signum: int, frame: Any) -> None:
        if signum != signal.SIGALRM:
            self.pending = signal.Signals(signum).name
        if self.pending is None:
            return
        if signal.getsignal(signal.SIGINT) != self._handle:  # training took the signals over
            os.kill(os.getpid(), signal.Signals[self.pending])
            self.pending = None
        elif _importing(frame):
            if signal.SIGALRM not in self._previous:
                self._previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, self._handle)
            signal.setitimer(signal.ITIMER_REAL, 0.05)  # look again once the import is done
        else:
            self._raised = Signalled(self.pending, bool(getattr(self.reporter, "started", False)))
            raise self._raised


def _importing(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False
