"""Doctor's ``libtpu_lock`` check: does a process hold the TPU, and which one?

libtpu takes a lock file when a process opens the TPU; a second process then cannot. The holder is
found from ``/proc/*/fd`` and asked of the lock itself (``F_GETLK`` and a non-blocking ``flock``),
acquiring nothing.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import os
import struct
from typing import Any

from tpurun.doctor.check import Check

NOTEBOOK_TRAP = (
    "if it is a notebook kernel: restart it, and do not import JAX/TensorFlow on the TPU in the "
    "kernel before `!tpurun train`; otherwise stop that process"
)


def open_holders(path: str, proc_root: str = "/proc") -> list[int]:
    """Pids with ``path`` open, from ``/proc/*/fd`` (only processes we may inspect)."""
    target = os.path.realpath(path)
    pids = []
    for fd_dir in glob.glob(f"{proc_root}/[0-9]*/fd"):
        try:
            links = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in links:
            try:
                if os.readlink(f"{fd_dir}/{fd}") == target:
                    pids.append(int(fd_dir.split("/")[-2]))
                    break
            except OSError:
                continue
    return sorted(set(pids))


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def _posix_lock_holder(fd: int) -> int | None:
    """The pid of a process holding a POSIX (fcntl/lockf) lock on fd, asked with F_GETLK.

    F_GETLK only asks: nothing is acquired, so nothing needs releasing.
    """
    # struct flock on Linux LP64: short type, short whence, off_t start, off_t len, pid_t pid.
    request = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    answer = fcntl.fcntl(fd, fcntl.F_GETLK, request)
    l_type, _, _, _, pid = struct.unpack("hhqqi4x", answer)
    return pid if l_type != fcntl.F_UNLCK else None


def _flock_held(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return True
        raise
    fcntl.flock(fd, fcntl.LOCK_UN)  # release at once
    return False


def find_lock_holder(path: str) -> tuple[bool, list[int]]:
    """Whether a process holds a lock on ``path``, and its pid(s) when they can be found."""
    holders = open_holders(path)
    if os.getpid() in holders:
        # This very process has it open (a kernel that touched the TPU): opening and closing the
        # file here would drop its POSIX lock, so leave it alone.
        return True, [os.getpid()]
    fd = os.open(path, os.O_RDONLY)
    try:
        posix_pid = _posix_lock_holder(fd)
        held = posix_pid is not None or _flock_held(fd)
    finally:
        os.close(fd)
    if not held:
        return False, []
    pids = [posix_pid] if posix_pid else []
    return True, pids + [p for p in holders if p not in pids]


def check_lock(lock_path: str) -> Check:
    if not os.path.exists(lock_path):
        return Check(
            "libtpu_lock",
            "ok",
            f"no {lock_path}: no process holds the TPU",
            None,
            {"path": lock_path, "exists": False, "held": False},
        )
    try:
        held, pids = find_lock_holder(lock_path)
    except OSError as exc:
        return Check(
            "libtpu_lock",
            "warn",
            f"{lock_path}: cannot inspect it: {exc.strerror}",
            "check who owns the file (ls -l); another user's process may hold the TPU",
            {"path": lock_path, "exists": True},
        )
    data: dict[str, Any] = {
        "path": lock_path, "exists": True, "held": held,
        "holders": [{"pid": p, "cmdline": cmdline(p)} for p in pids],
    }  # fmt: skip
    if not held:
        return Check(
            "libtpu_lock",
            "ok",
            f"{lock_path} exists but nobody holds it: a stale lock file, harmless",
            None,
            data,
        )
    if not pids:
        who = "a process this user cannot inspect"
    else:
        who = "; ".join(f"pid {h['pid']} ({h['cmdline'][:120]})" for h in data["holders"])
    if os.getpid() in pids:
        return Check(
            "libtpu_lock",
            "fail",
            f"this Python process holds the TPU ({lock_path})",
            "restart the kernel, and run `!tpurun train` before touching the TPU in it",
            data,
        )
    return Check(
        "libtpu_lock",
        "fail",
        f"the TPU is in use: {lock_path} is held by {who}",
        NOTEBOOK_TRAP,
        data,
    )
