"""``tpurun launch -n N train CONFIG``: rehearse a multi-host run with N local processes.

Each process is the same ``tpurun`` command with the standard ``KERAS_DISTRIBUTION_*`` variables
(a loopback coordinator, its number, the count), exactly as a pod slice or GPU nodes run it; each
takes ``runtime.cpu_devices / N`` of the CPU's simulated devices. Process 0's output is passed
through; the others' errors are printed with their number. When one process dies, the others are
stopped at once, instead of each waiting for its watchdog. Imports no framework.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from tpurun.errors import EXIT_USER_ERROR, TpurunError

GRACE_SECONDS = 15.0  # how long the others get to stop cleanly after one died


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(stream, process_id: int) -> None:
    for line in iter(stream.readline, ""):
        sys.stderr.write(f"[process {process_id}] {line}")
        sys.stderr.flush()


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def launch(processes: int, args: Sequence[str], port: int | None = None) -> int:
    """Run ``tpurun ARGS`` as ``processes`` cooperating local processes; return the exit code.

    Raises:
        TpurunError: fewer than 2 processes, or no command to run.
    """
    if processes < 2:
        raise TpurunError(f"-n {processes}: launch takes at least 2 processes (1 is plain tpurun).")
    if not args or args[0] != "train":
        raise TpurunError("tpurun launch runs `train`: tpurun launch -n N train CONFIG [options].")
    address = f"127.0.0.1:{port or free_port()}"
    exe = [sys.executable, "-m", "tpurun", *args]
    children: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    for i in range(processes):
        env = {
            **os.environ,
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": address,
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(processes),
            "KERAS_DISTRIBUTION_PROCESS_ID": str(i),
        }
        if i:
            env["TPURUN_PLAIN"] = "1"
        children.append(
            subprocess.Popen(
                exe,
                env=env,
                stdout=None if i == 0 else subprocess.DEVNULL,
                stderr=None if i == 0 else subprocess.PIPE,
                text=True,
            )
        )
        if i:
            relays.append(
                threading.Thread(target=_relay, args=(children[i].stderr, i), daemon=True)
            )
            relays[-1].start()

    def forward(signum, frame):  # a SIGTERM to the launcher reaches every process
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _wait(children)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        # A process's last lines (its "stopped: ..." or error) may still be in the pipe when it
        # has exited: relay them before the launcher says anything more or exits.
        for relay in relays:
            relay.join(timeout=10)


def _wait(children: list[subprocess.Popen]) -> int:
    """Wait for all; when one fails while others run, stop the others and say which failed."""
    failed_at: dict[int, int] = {}  # process -> the poll at which it was first seen failed
    polls = 0
    while True:
        polls += 1
        codes = [c.poll() for c in children]
        if all(code is not None for code in codes):
            break
        for i, code in enumerate(codes):
            if code not in (None, 0, 3):
                failed_at.setdefault(i, polls)
        if failed_at and any(code is None for code in codes):
            # The others notice a dead process too and exit, with errors of their own: let
            # them, then name the cause: one killed by a signal, else the first seen to fail.
            time.sleep(1.0)
            codes = [c.poll() for c in children]
            for i, code in enumerate(codes):
                if code not in (None, 0, 3):
                    failed_at.setdefault(i, polls + 1)
            i = min(failed_at, key=lambda p: (codes[p] is None or codes[p] >= 0, failed_at[p], p))
            code = codes[i] if codes[i] is not None else children[i].returncode
            sys.stderr.write(
                f"tpurun launch: process {i} {_describe(code)}; stopping the others (they "
                "cannot go on without it). Rerun the same command to resume from the last "
                "checkpoint.\n"
            )
            _stop(children)
            return code if code > 0 else EXIT_USER_ERROR
        time.sleep(0.2)
    codes = [c.returncode for c in children]
    failed = [i for i, code in enumerate(codes) if code not in (0, 3)]
    # All ended before the launcher looked: still name the cause, as above.
    cause = min(failed, key=lambda p: (codes[p] >= 0, failed_at.get(p, polls + 1), p), default=None)
    if cause is not None and (codes[cause] < 0 or cause in failed_at):
        i, code = cause, codes[cause]
        sys.stderr.write(
            f"tpurun launch: process {i} {_describe(code)}; the others stopped too. Rerun the "
            "same command to resume from the last checkpoint.\n"
        )
    if all(code == 0 for code in codes):
        return 0
    nonzero = [code for code in codes if code != 0]
    return nonzero[0] if nonzero[0] > 0 else EXIT_USER_ERROR


def _stop(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for child in children:
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()  # stuck in a collective with the dead one
            child.wait()
