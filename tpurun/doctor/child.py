"""Doctor's child processes, both ends: starting a probe and reading its answer (:class:`Child`),
and, inside the probe, reading what it was asked and answering (:func:`payload`, :func:`reply`).

Anything that could block or take an accelerator (JAX/TF device discovery, the TPU, GCS) runs as
a module of :mod:`tpurun.doctor.scripts` in a Python process of its own, with a timeout:

- a child that initialises JAX or TensorFlow on a TPU takes the libtpu lock and gives it back when
  it exits, so ``!tpurun doctor`` followed by ``!tpurun train`` works, and one that hangs is killed;
- its environment is fixed before it starts, so JAX and TensorFlow read the variables meant for the
  probe (JAX_PLATFORMS, XLA_FLAGS, TF's GCS retries) at their first import, whatever this process
  has imported or set already.

The protocol: the parent runs ``python -m tpurun.doctor.scripts.NAME PAYLOAD``, PAYLOAD being one
JSON argument. ``-m`` finds tpurun by the same rules as this process did (the current directory,
PYTHONPATH, site-packages), so the child runs this very tpurun. The child prints its answer as one
line, :data:`MARK` then a JSON object; the parent reads the last such line. A child that prints
none (it crashed) is reported by the last error line of its output and its exit code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from tpurun import frameworks

MARK = "@@tpurun-doctor@@"
SCRIPTS = "tpurun.doctor.scripts"


# ------------------------------------------------------------------------------------ the parent
def child_env(extra: Mapping[str, str] | None = None, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment for a child: without KERAS_BACKEND (a child imports no Keras
    unless it chooses a backend itself) and the variables in ``drop``, with TensorFlow's C++
    notices down to warnings, and ``extra`` on top."""
    env = {k: v for k, v in os.environ.items() if k not in drop and k != "KERAS_BACKEND"}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", frameworks.TF_LOG_LEVEL)
    env.update(extra or {})
    return env


def last_error_line(text: str) -> str:
    """The line of a child's output that most likely says what went wrong (at most 300 chars)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1].strip()[:300]


def parse_answer(out: str, err: str, returncode: int | None) -> dict[str, Any]:
    """A finished child's answer: the JSON of the last :data:`MARK` line on stdout, or
    ``{"error": ...}`` naming the last error line (of stderr, else stdout) and the exit code."""
    answer = None
    for line in out.splitlines():
        if line.startswith(MARK):
            answer = json.loads(line[len(MARK) :])
    if answer is None:
        return {"error": last_error_line(err or out) + f" (exit {returncode})"}
    return answer


class Child:
    """A Python child process, started at once, that answers with a :data:`MARK` line.

    Args:
        args: the interpreter's arguments (``["-m", module, ...]``; :meth:`script` builds them).
        timeout: seconds from the start until :meth:`result` kills the child.
        env: the child's whole environment (default :func:`child_env`).
    """

    def __init__(self, args: Sequence[str], timeout: float, env: dict[str, str] | None = None):
        self.timeout = timeout
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env or child_env(),
        )
        self._result: dict[str, Any] | None = None

    @classmethod
    def script(
        cls,
        name: str,
        payload: Mapping[str, Any] | None = None,
        *,
        timeout: float,
        env: dict[str, str] | None = None,
    ) -> Child:
        """Start ``python -m tpurun.doctor.scripts.<name> '<payload as JSON>'``."""
        return cls(["-m", f"{SCRIPTS}.{name}", json.dumps(dict(payload or {}))], timeout, env)

    def result(self) -> dict[str, Any]:
        """The child's JSON answer, or ``{"error": ..., "timed_out": bool}``; always returns."""
        if self._result is not None:
            return self._result
        left = max(0.1, self.timeout - (time.monotonic() - self.started))
        try:
            out, err = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            self._result = {"error": f"timed out after {self.timeout:g} s", "timed_out": True}
        else:
            self._result = parse_answer(out, err, self.proc.returncode)
        # The child's own time when it reports one: it ran alongside other checks.
        self._result.setdefault("seconds", round(time.monotonic() - self.started, 3))
        return self._result


# ------------------------------------------------------------------------------------- the child
def payload() -> dict[str, Any]:
    """What the parent asked (a script's ``main()`` calls it): the JSON argument, or ``{}``."""
    return json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}


def answer_line(answer: Mapping[str, Any]) -> str:
    """The line a child prints as its answer."""
    return MARK + json.dumps(dict(answer))


def reply(answer: Mapping[str, Any]) -> None:
    """Print the answer (flushed: the parent may kill the child any moment after)."""
    print(answer_line(answer), flush=True)


__all__ = [
    "MARK", "SCRIPTS", "Child", "answer_line", "child_env", "last_error_line", "parse_answer",
    "payload", "reply",
]  # fmt: skip
