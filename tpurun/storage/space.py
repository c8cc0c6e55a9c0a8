"""A full disk, said as what it is: which file could not be written, the space it needs, the
space left, and that the last complete checkpoint is kept.

Every file of a run directory is written under a temporary name and renamed
(:func:`tpurun.storage.fileio.save_atomically`), so a write that runs out of space leaves the
previous version whole; this module turns the ``OSError`` (``ENOSPC``, or a quota's ``EDQUOT``,
however deep a library wrapped it: h5py and Keras do) into one message.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil

from tpurun.errors import TpurunError

_FULL = (errno.ENOSPC, errno.EDQUOT)
_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "errno = 28")
_PAGE = 4096  # a file system's block: the least a new file takes


class DiskFull(TpurunError):
    """A local write ran out of space (or quota)."""


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, is a full disk."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL:
            return True
        if any(text in str(exc) for text in _FULL_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _size(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def needed(path: str, partial: int = 0) -> int:
    """About what writing ``path`` takes: the larger of the file it replaces, the newest file of
    its kind beside it (a checkpoint's new name: ``latest-e2-s0.weights.h5`` after ``-e1-``), and
    what was written of it before the disk filled up."""
    sizes = [partial]
    if os.path.isfile(path):
        sizes.append(os.path.getsize(path))
    folder, name = os.path.split(path)
    stem, dot, extension = name.partition(".")
    if "-" in stem:  # a checkpoint's position in its name: its predecessors are the same kind
        kind = f"{stem.split('-', 1)[0]}-*{dot}{extension}"
        sizes += [os.path.getsize(p) for p in glob.glob(os.path.join(glob.escape(folder), kind))]
    return max(sizes)


def check_room(path: str) -> None:
    """Refuse, before it starts, a write that would not fit: one that needs more than the space
    left (what :func:`needed` estimates from the files it follows), with a page to spare. h5py,
    which writes Keras' ``.weights.h5`` and ``.keras`` files, takes a full disk mid-write badly
    (measured: the process dies with SIGSEGV in its cleanup), so the common case, a checkpoint
    the size of the last one, is said before it begins.

    Raises:
        DiskFull: naming the path, the space needed and the space left.
    """
    need = needed(path)
    if need and shutil.disk_usage(_existing(path)).free < need + _PAGE:
        raise disk_full(path)


def _existing(path: str) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    return folder


def disk_full(path: str, partial: int = 0) -> DiskFull:
    """The error for a write of ``path`` that ran out of space."""
    free = shutil.disk_usage(_existing(path)).free
    need = needed(path, partial)
    about = f" It needs about {_size(need)}; {_size(free)} is free there." if need else ""
    return DiskFull(
        f"no space left on the disk writing {path}.{about} Nothing written before is lost: the "
        "file it would replace, and the last complete checkpoint, are kept. Free some space (or "
        "give the run more with --output DIR on a larger disk, after moving the run there), then "
        "run the same command again to continue."
    )
