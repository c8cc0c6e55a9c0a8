"""The run lock: one live run per run directory, on a local disk or in a bucket.

``run.lock`` says who holds the run (pid, host, since). How the lock is held differs:

- **Local folders**: an ``flock`` on the file. The kernel releases it when the holder dies, so a
  run killed with SIGKILL never blocks the next one.
- **Buckets** (``gs://``): an object store has no flock. The lock is the ``run.lock`` object
  itself, with a token and a **heartbeat** that the holder rewrites every
  :data:`HEARTBEAT_SECONDS`. A lock is live while its heartbeat is younger than
  :data:`STALE_SECONDS`; on the holder's own host, a holder whose process is gone is dead at once.
  A dead or stale lock is taken over.

  Taking a free lock creates the object with the create-only precondition
  (``ifGenerationMatch=0``, :func:`tpurun.storage.fileio.create_exclusively`): of runs that start
  together on a new run directory, exactly one creates it, and the others refuse. Taking over a
  dead or stale lock rewrites it: write ours, wait :data:`SETTLE_SECONDS`, read it back: whoever's
  token is there holds it, the other refuses. Each heartbeat reads the lock first, and a holder
  that finds another's token knows it lost the lock; its run directory then refuses to write
  (:class:`LockLost`). **The race window**, for takeovers only: two runs that both read the same
  dead lock and whose read-to-write gaps differ by more than :data:`SETTLE_SECONDS` can both
  believe they hold it, until the first heartbeat (at most :data:`HEARTBEAT_SECONDS` later) tells
  the earlier one that it lost. (Closing that window too takes a write conditional on the
  generation read, which gcsfs does not send: its only precondition is ``ifGenerationMatch=0``.)
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from typing import Any

from tpurun.errors import TpurunError
from tpurun.storage import fileio

HEARTBEAT_SECONDS = 30.0
STALE_SECONDS = 180.0  # six missed heartbeats
SETTLE_SECONDS = 1.0


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


class Busy(Exception):
    """Another live run holds the lock; ``holder`` is its record (may be empty)."""

    def __init__(self, holder: dict[str, Any]):
        super().__init__("busy")
        self.holder = holder


class LockLost(TpurunError):
    """Another run took this run directory's (remote) lock while this one was running."""


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # exists, someone else's (or unknowable: assume alive)
    return True


def heartbeat_age(holder: dict[str, Any], now: float | None = None) -> float | None:
    """Seconds since the holder's last heartbeat (None: no heartbeat recorded)."""
    beat = holder.get("heartbeat")
    if not isinstance(beat, (int, float)):
        return None
    return max(0.0, (time.time() if now is None else now) - beat)


def is_live(holder: dict[str, Any] | None) -> bool:
    """Whether a remote lock record belongs to a run that may still be running."""
    if not holder:
        return False
    if holder.get("host") == socket.gethostname() and not _pid_alive(holder.get("pid")):
        return False
    age = heartbeat_age(holder)
    return age is not None and age < STALE_SECONDS


def busy_error(run_dir: str, holder: dict[str, Any]) -> TpurunError:
    """What a run says when another holds ``run_dir``'s lock (``holder``: its record)."""
    if holder.get("damaged"):  # see RemoteLock.read
        return TpurunError(
            f"{run_dir}/run.lock is damaged (not a lock record), so tpurun cannot tell whether a "
            f"run holds it: it is taken over {STALE_SECONDS / 60:g} minutes after it was last "
            "written. Wait and rerun, or train this one elsewhere (--output DIR)."
        )
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    age = heartbeat_age(holder)
    alive = ""
    if age is not None:
        alive = (
            f"; its last heartbeat was {age:.0f} s ago, and a lock silent for "
            f"{STALE_SECONDS / 60:g} minutes is taken over"
        )
    return TpurunError(
        f"{run_dir} is in use by another tpurun run ({who}, since {holder.get('since', '?')}"
        f"{alive}); two runs would overwrite each other's checkpoints. Wait for it to finish "
        f"or stop it (kill {holder.get('pid', 'PID')}), or train this one elsewhere (--output "
        "DIR, or --set name=NEW_NAME)."
    )


class LocalLock:
    """An ``flock`` on ``run.lock``, held for the life of the process (or until release)."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def is_locked(self) -> bool:
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        finally:
            os.close(fd)
        return False

    def acquire(self) -> None:
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise Busy(fileio.read_json(self.path) or {}) from None
        holder = (
            f'{{"pid": {os.getpid()}, "host": "{socket.gethostname()}", "since": "{now_iso()}"}}\n'
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def check(self) -> None:
        """Nothing to check: the kernel keeps an flock."""


class RemoteLock:
    """The ``run.lock`` object of a run directory in a bucket, kept alive by a heartbeat thread
    (see the module docstring for the protocol and its race window)."""

    def __init__(self, path: str):
        self.path = path
        self.token: str | None = None
        self.lost: dict[str, Any] | None = None  # the holder that took the lock from us
        self._record: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self.token is not None

    def read(self) -> dict[str, Any] | None:
        """The lock's record; None when there is no lock. A lock object that is there but not a
        record (a bad copy, a hand edit) is never read as "no lock": it stands for a holder that
        last beat when the object was written, so it is taken over only once that is stale."""
        try:
            text = fileio.read_text_or_none(self.path)
        except UnicodeDecodeError:
            text = ""  # not text: damaged
        if text is None:
            return None
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if isinstance(record, dict):
            return record
        return {"damaged": True, "heartbeat": fileio.mtime(self.path)}

    def is_locked(self) -> bool:
        return is_live(self.read())

    def acquire(self) -> None:
        current = self.read()  # None: there is no lock
        if is_live(current):
            raise Busy(current)
        token = uuid.uuid4().hex
        since = now_iso()
        self._record = {"pid": os.getpid(), "host": socket.gethostname(), "since": since,
                        "token": token}  # fmt: skip
        if current is None:
            try:
                fileio.create_exclusively(self.path, self._payload())
            except FileExistsError:  # another run created it since we looked
                raise Busy(self.read() or {}) from None
        else:  # a dead or stale holder's: taken over
            self._write()
            time.sleep(SETTLE_SECONDS)  # a writer that read it when we did has written by now
            back = self.read() or {}
            if back.get("token") != token:
                raise Busy(back)
        self.token, self.lost = token, None
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._beat, name="tpurun-lock-heartbeat", daemon=True
        )
        self._thread.start()
        # A process that ends holding the lock (a notebook kernel, a script that never unlocked)
        # releases it first, so that the next run need not wait for it to go stale.
        atexit.register(self.release)

    def _payload(self) -> bytes:
        return (json.dumps({**self._record, "heartbeat": time.time()}, indent=2) + "\n").encode()

    def _write(self) -> None:
        fileio.write_json(self.path, {**self._record, "heartbeat": time.time()})

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            if fileio.recently_unreachable():
                continue  # an outage: the run itself will stop or ride it out
            try:
                current = self.read() or {}
                if current.get("token") not in (None, self.token):
                    self.lost = current
                    return
                self._write()
            except Exception:  # storage down for a while: the run itself will say so
                continue

    def check(self) -> None:
        """Raise :class:`LockLost` when the heartbeat found another run's token in the lock."""
        if self.lost is not None:
            who = f"pid {self.lost.get('pid', '?')} on {self.lost.get('host', '?')}"
            raise LockLost(
                f"{fileio.dirname(self.path)}: another tpurun run ({who}, since "
                f"{self.lost.get('since', '?')}) took this run directory's lock while this run "
                "was using it; this run stops writing there so that the two do not overwrite each "
                "other's checkpoints. Let one of them finish, or give the other --output DIR."
            )

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if it is still ours (best effort: with storage
        unreachable, the lock is left to go stale, or to be taken over from this host)."""
        if self.token is None:
            return
        atexit.unregister(self.release)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        token, self.token = self.token, None
        if fileio.recently_unreachable():
            return  # from this host it is taken over at once; elsewhere once it goes stale
        with contextlib.suppress(Exception):
            if (self.read() or {}).get("token") == token:
                fileio.remove(self.path)


def make_lock(path: str) -> LocalLock | RemoteLock:
    return RemoteLock(path) if fileio.is_remote(path) else LocalLock(path)
