"""Stopping early and cleanly: SIGINT and SIGTERM (Ctrl-C, a notebook's stop button, preemption, a
session ending), the time limit, and, with several processes, the stop they all agree on.

One route, :data:`SIGNALS` (a :class:`SignalRoute`), takes both signals from the command line's
first moment to its end, and says what a signal means by the phase the process is in:

================  ======================================  ===================================
phase             from -> to                              a signal
================  ======================================  ===================================
``OFF``           not installed                           the process's own handlers
``HOLDING``       ``hold()`` (``main()``) -> a command    held; a second one: at once (130)
``STARTING``      ``command(train=True)`` -> fit loop     :class:`Signalled` once it can
                                                          surface: exit 3, nothing lost
``TRAINING``      ``training(stop)``, the fit loop        ``stop.reason``: saved at the next
                                                          step, exit 3; a second: at once
``SAVING``        the fit loop's end -> the command's     as ``STARTING``, said as "after
                                                          the last step"
================  ======================================  ===================================

Any other command steps aside when it starts (``HOLDING -> OFF``): SIGINT is Ctrl-C
(``KeyboardInterrupt``, exit 130) and SIGTERM its default, as for any program. A command's end is
``OFF`` again. ``main()`` installs the route; the Python API (:func:`tpurun.train`), a test or a
direct :func:`tpurun.training.session.run` installs it for the call when it is not installed, and
only from the main thread (the only one that can take signals; elsewhere the deadline alone stops).

A signal's :class:`Stop` is the request the training loop reads:
:class:`tpurun.training.callbacks.run_control.RunControl` asks :meth:`Stop.agreed` once per execution (the
signal, the deadline, and with several processes what every process was asked:
:func:`tpurun.multihost.collectives.agree_on_stop`), saves the resume point at that step and ends
``fit``; the session then raises :class:`~tpurun.errors.Interrupted` (exit 3).

The route lives here, in ``training/``, and not in ``cli/``: the session enters ``TRAINING`` and
the Python API uses the route without a command line, and neither may import ``cli/``; the command
line's boundary (:mod:`tpurun.cli.boundary`) only turns what this raises into exit codes. Imports no
framework: ``main()`` imports it before anything else.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tpurun.errors import TpurunError

HANDLED = (signal.SIGINT, signal.SIGTERM)
_RECHECK = 0.05  # seconds: how often a signal waiting for an import looks again


class StopNow(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by ``RunControl`` once a stop mid-epoch is saved: it ends ``fit`` at once,
    skipping the validation pass Keras would otherwise run first (a preempted VM has seconds)."""


# ----------------------------------------------------------------------------------- the request
@dataclass
class Stop:
    """Why training stops early: the one request a signal, the time limit and a NaN loss set, and
    that several processes agree on.

    ``agree`` is :func:`tpurun.multihost.collectives.agree_on_stop` when several processes train
    together (None alone): a signal or the deadline can reach any one process, but every process
    must stop (and save) at the same step, since a save is a collective.
    """

    reason: str | None = None  # SIGTERM, SIGINT or train.time_limit: stop at the next step
    deadline: float | None = None  # time.monotonic() at which train.time_limit runs out
    nan_at: tuple[int, int] | None = None  # (epoch, step) of a NaN or Inf loss
    agree: Callable[[str | None, bool], tuple[str | None, bool]] | None = None

    def requested(self, now: float) -> bool:
        """Whether this process was asked to stop: a signal came, or the time limit has run out."""
        if self.reason is None and self.deadline is not None and now >= self.deadline:
            self.reason = "train.time_limit"
        return self.reason is not None

    def agreed(self, now: float, save_by_clock: bool = False) -> tuple[bool, bool]:
        """Whether to stop, and whether a clock-timed save (``every_minutes``) is due, as every
        process sees it. With several processes this is a collective: every process calls it at
        the same step, and all stop (or save) if any one was asked."""
        requested = self.requested(now)
        if self.agree is None:
            return requested, save_by_clock
        agreed, save_by_clock = self.agree(self.reason, save_by_clock)
        # A signal can land during the exchange (its handler runs between the exchange's Python
        # lines): it was not sent, so this process does not stop alone; it keeps the reason and
        # sends it at the next step. Assigning the answer over it would lose the signal.
        if self.reason is None:
            self.reason = agreed
        return agreed is not None, save_by_clock


# ---------------------------------------------------------------------------------- the route
class Phase(enum.Enum):
    """Where the process is, which says what a signal means (the module's table)."""

    OFF = "off"
    HOLDING = "holding"
    STARTING = "starting"
    TRAINING = "training"
    SAVING = "saving"


class Signalled(KeyboardInterrupt):
    """SIGINT or SIGTERM while ``train`` was outside its training loop: exit 3 in one line."""

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


class SignalRoute:
    """SIGINT and SIGTERM, from the first moment to the agreed stop; see the module's table.

    ``HOLDING``: Typer takes a few tenths of a second to build the commands. A signal then is held
    and delivered when the command starts, so ``train`` stops with exit 3 and its one line as it
    does later in start-up. ``train`` takes SIGINT whatever the process inherited, so one held
    while the process has SIGINT ignored (a background job of a script inherits that) stops it
    too; any other command keeps ignoring it. The interpreter's own start and
    ``tpurun.cli.app``'s imports (about a tenth of a second) come before any of tpurun's code can
    hold anything.

    Every transition sets the handler again (:meth:`_enter`), and ``OFF`` puts back the handlers
    ``HOLDING`` found: no phase swaps handlers with another.

    ``STARTING`` and ``SAVING`` raise :class:`Signalled` where the main thread is, with two
    exceptions to how a handler's exception usually lands:

    - Inside an import, the signal waits for the import to finish (looked at again every
      ``_RECHECK`` s, through SIGALRM): an extension module stopped mid-initialisation prints a
      traceback and reports a broken install.
    - The main thread can be in Python code that a framework's C++ called (TensorFlow's
      ``nest.flatten``, building a dataset, is): the exception then comes out as an unrelated error
      (a bare TypeError would be exit 1, "unexpected failure"), or is cleared and lost. So the
      signal stays pending until it surfaces: an unrelated error that ends the command after it is
      re-read as the signal (exit 3; a :class:`~tpurun.errors.TpurunError` stays itself); if none
      does, ``TRAINING`` takes it as its stop reason and stops at its first step.
    """

    def __init__(self) -> None:
        self.phase = Phase.OFF
        self.pending: str | None = None  # a signal not acted on yet
        self.stop: Stop | None = None  # TRAINING's request
        self._raised: Signalled | None = None  # what STARTING or SAVING raised, to re-read errors
        self._original: dict[int, Any] = {}  # the handlers to put back
        self._alarm: tuple[Any, tuple[float, float], float] | None = None  # SIGALRM's, while taken

    # ------------------------------------------------------------------------- transitions
    def hold(self) -> None:
        """``OFF -> HOLDING``: ``main()``, before Typer builds the commands."""
        self._install()

    @contextlib.contextmanager
    def command(self, train: bool) -> Iterator[None]:
        """A command's span: ``HOLDING -> STARTING`` for ``train`` (the command line's, or
        :func:`tpurun.train`), ``HOLDING -> OFF`` for any other; ``OFF`` at its end.

        A signal held since ``main()`` is delivered here: ``train`` stops with :class:`Signalled`
        (exit 3); elsewhere SIGINT is Ctrl-C (or nothing, when the process started with it
        ignored) and SIGTERM its default.
        """
        if not _main_thread() or self.phase not in (Phase.OFF, Phase.HOLDING):
            yield  # another thread, or inside a command already: that one owns the route
            return
        if not train:
            self._step_aside()
            yield
            return
        self._install()
        try:
            self._enter(Phase.STARTING)
            if self.pending is not None:
                raise self._signalled()
            yield
        except Exception as exc:
            raised, self._raised = self._raised, None
            if (
                raised is not None
                and interrupt_in(exc) is None
                and not isinstance(exc, TpurunError)
            ):
                raise Signalled(raised.name, raised.after_training) from exc  # it became this
            raise
        finally:
            self._uninstall()

    @contextlib.contextmanager
    def training(self, stop: Stop) -> Iterator[None]:
        """The fit loop: ``STARTING -> TRAINING -> SAVING``. The signal ``STARTING`` could not act
        on (one waiting for an import, one a framework swallowed) becomes ``stop``'s reason."""
        if not _main_thread():
            yield  # no handler here: the deadline alone stops
            return
        mine = self.phase is Phase.OFF and self._install()
        before, outer = self.phase, self.stop
        self._stop_rechecking()
        self.stop = stop
        self._enter(Phase.TRAINING)
        held, self.pending, self._raised = self.pending, None, None
        if held is not None and stop.reason is None:
            stop.reason = held
        try:
            yield
        finally:
            if mine:
                self._uninstall()
            else:
                self.stop = outer
                self._enter(Phase.SAVING if before is Phase.STARTING else before)

    # ------------------------------------------------------------------------------ handler
    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGALRM:  # looking again at a signal that waited for an import
            if self.pending is None or self.phase not in (Phase.STARTING, Phase.SAVING):
                return
        elif self.phase is Phase.HOLDING:
            if self.pending is not None:
                raise KeyboardInterrupt  # a second one: at once
            self.pending = signal.Signals(signum).name
            return
        elif self.phase is Phase.TRAINING and self.stop is not None:
            if self.stop.reason is not None:
                raise KeyboardInterrupt  # a second one (or one after the time limit): at once
            self.stop.reason = signal.Signals(signum).name
            return
        else:
            self.pending = signal.Signals(signum).name
        if _importing(frame):
            self._recheck_soon()
        else:
            self._stop_rechecking()
            raise self._signalled()

    def _signalled(self) -> Signalled:
        self._raised = Signalled(self.pending or "", after_training=self.phase is Phase.SAVING)
        return self._raised

    # --------------------------------------------------------------------------- handlers
    def _enter(self, phase: Phase) -> None:
        """A transition: the new phase, and both signals taken again. A framework can take a
        signal from under Python, at C level, where Python's table still names this handler
        (JAX's distributed runtime takes SIGTERM for its preemption notice when it starts);
        setting the handler again takes the signal back."""
        self.phase = phase
        if self._original:
            for sig in HANDLED:
                signal.signal(sig, self._handle)

    def _install(self) -> bool:
        """Take SIGINT and SIGTERM (``HOLDING``), from the main thread only; whether it did."""
        if self.phase is not Phase.OFF or not _main_thread():
            return False
        self.phase = Phase.HOLDING
        self._original = {sig: signal.signal(sig, self._handle) for sig in HANDLED}
        return True

    def _uninstall(self) -> dict[int, Any]:
        """Put the handlers back (``OFF``); the ones it put back."""
        self._stop_rechecking()
        original, self._original = self._original, {}
        for sig, old in original.items():
            signal.signal(sig, old)
        self.phase, self.pending, self.stop, self._raised = Phase.OFF, None, None, None
        return original

    def _step_aside(self) -> None:
        """``HOLDING -> OFF`` for a command other than ``train``, delivering a held signal as the
        process's own handlers would have."""
        held = self.pending
        original = self._uninstall()
        if held == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
        elif held == "SIGINT" and original.get(signal.SIGINT) is not signal.SIG_IGN:
            raise KeyboardInterrupt

    def _recheck_soon(self) -> None:
        """Look at a pending signal again in ``_RECHECK`` s, through SIGALRM, taken meanwhile."""
        if self._alarm is None:
            handler = signal.signal(signal.SIGALRM, self._handle)
            self._alarm = (handler, signal.getitimer(signal.ITIMER_REAL), time.monotonic())
        signal.setitimer(signal.ITIMER_REAL, _RECHECK)

    def _stop_rechecking(self) -> None:
        """Give SIGALRM back, with what was left of its timer (pytest-timeout's, for one)."""
        if self._alarm is None:
            return
        (handler, (delay, interval), since), self._alarm = self._alarm, None
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if delay:
            left = max(delay - (time.monotonic() - since), 0.001)
            signal.setitimer(signal.ITIMER_REAL, left, interval)


SIGNALS = SignalRoute()  # installed by main() (cli.app), or for a call by tpurun.train()


def stop_on_signals(stop: Stop) -> contextlib.AbstractContextManager[None]:
    """The fit loop's phase on :data:`SIGNALS`: SIGTERM or SIGINT stops training at the next step,
    with a checkpoint; a second signal stops at once."""
    return SIGNALS.training(stop)


def interrupt_in(exc: BaseException | None) -> KeyboardInterrupt | None:
    """The interrupt behind an error, if any (NumPy turns one inside its import into an
    ImportError, which is not a broken install)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _importing(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False
