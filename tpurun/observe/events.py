"""TensorBoard event files, written and trimmed without TensorFlow.

An event file is a TFRecord file (:mod:`tpurun.data.native.framing`) of ``Event`` protos, the
schema TensorFlow and TensorBoard use: TensorBoard's own generated messages where it is installed,
else tensorboardX's (a core dependency), the same on the wire. A file is named
as TensorFlow's summary writer names it, ``events.out.tfevents.<seconds>.<host>.<pid>.<n>.v2``,
and starts with the ``brain.Event:2`` version event.

Scalars are ``simple_value`` summaries, as tensorboardX (and PyTorch's writer) writes them; runs
begun before tpurun wrote its events without TensorFlow hold TensorFlow's tensor form. TensorBoard
reads both as the scalars plugin's, so such a run's curves carry on as one series.

A local file is written event by event, so a killed session keeps everything it wrote. A remote
one cannot be appended to: it is uploaded whole at each :meth:`EventFile.flush` (the epoch's end),
as TensorFlow's and tensorboardX's GCS writers do.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Mapping

try:
    # tensorboardX's package imports its optional GCS and S3 clients first, and
    # google-cloud-storage (which gcsfs installs) made that 0.2-0.3 s of every run's start-up;
    # TensorBoard's messages (the viz extra; on Colab's and Kaggle's images) take 0.02 s.
    from tensorboard.compat.proto import event_pb2, summary_pb2
except ImportError:
    from tensorboardX.proto import event_pb2, summary_pb2

from tpurun.data.native import framing
from tpurun.storage import fileio
from tpurun.storage.rundir import TENSORBOARD_SPLITS

SPLITS = TENSORBOARD_SPLITS
EVENTS_GLOB = "events.out.tfevents.*"
_numbers = itertools.count()  # the <n> of this process's file names


def event_files(folder: str) -> list[str]:
    """The event files of a run's TensorBoard folder, split by split, oldest name first."""
    found = []
    for split in SPLITS:
        found += fileio.glob(fileio.join(fileio.escape(fileio.join(folder, split)), EVENTS_GLOB))
    return found


class EventFile:
    """A new event file in ``folder``, made (with the folder) at once."""

    def __init__(self, folder: str):
        fileio.makedirs(folder)
        name = (
            f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_numbers)}.v2"
        )
        self.path = fileio.join(folder, name)
        self._remote = fileio.is_remote(self.path)
        self._written: list[bytes] = []  # remote: every framed event, uploaded whole
        self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self.flush()

    def _add(self, event: event_pb2.Event) -> None:
        framed = framing.frame(event.SerializeToString())
        if self._remote:
            self._written.append(framed)
            return
        # Opened for each event (tens of microseconds, a few times an epoch): nothing is held
        # open between a run's epochs, or after it in a notebook.
        with open(self.path, "ab") as f:
            f.write(framed)

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """One event holding ``values`` (tag: value) at ``step``."""
        summary = summary_pb2.Summary(
            value=[
                summary_pb2.Summary.Value(tag=tag, simple_value=float(value))
                for tag, value in values.items()
            ]
        )
        self._add(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        """Make what was written visible: a remote file is uploaded whole."""
        if not self._remote:
            return
        data = b"".join(self._written)

        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(data)

        fileio.save_atomically(self.path, write)

    def close(self) -> None:
        """Flush; nothing else is held."""
        self.flush()


def after_the_last_file(folder: str) -> None:
    """Wait, if need be, until a new event file's name sorts after every one there.

    A name starts ``events.out.tfevents.<seconds>.<host>.<pid>.<n>``, and TensorBoard reads a
    folder's files in name order, dropping the points of a step that comes after a later one. Two
    sessions in the same second (a quick rerun, a notebook, a test) compare on their pids and
    counters as text, which can put the later session's file first: so a session that would
    start a file in the same second as the newest one waits for the next.
    """
    newest = 0
    for path in event_files(folder):
        field = fileio.basename(path).split(".")[3:4]
        if field and field[0].isdigit():
            newest = max(newest, int(field[0]))
    while time.time() < newest + 1:
        time.sleep(min(1.0, newest + 1 - time.time()))


def trim_events(folder: str, last_step: int) -> int:
    """Drop the summaries with a step past ``last_step`` from every event file under ``folder``
    (a file left with none is removed). Returns how many events were dropped.

    Each changed file is rewritten whole and atomically (object stores cannot truncate). A file
    that ends in a damaged record (a session killed while writing it) keeps the events before
    the damage; what follows is dropped with it.
    """
    dropped = 0
    for path in event_files(folder):
        records, damaged = [], False
        try:
            records.extend(framing.iter_records(path))
        except framing.DamagedRecord:
            damaged = True
        kept, summaries = [], 0
        for record in records:
            event = event_pb2.Event.FromString(record)
            if event.HasField("summary") and event.step > last_step:
                continue
            kept.append(record)
            summaries += event.HasField("summary")
        if len(kept) == len(records) and not damaged:
            continue
        dropped += len(records) - len(kept)
        if not summaries:
            fileio.remove(path)
            continue
        fileio.save_atomically(path, lambda tmp, kept=kept: framing.write_records(tmp, kept))
    return dropped
