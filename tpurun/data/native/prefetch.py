"""Background work for the native pipeline: read ahead in a thread, parse in a few more, in order.

:class:`Prefetched` runs a source iterator (reading, checking CRCs, shuffling, grouping records
into batches: pure Python, so one thread) in a background thread, and maps each item through
``fn`` (parsing and decoding) either in that same thread (``workers=0``) or in a pool of
``workers`` threads, keeping results in the source's order, at most ``depth`` of them ahead of
the consumer. Threads, not processes: the batches are numpy arrays that a process would have to
copy back, and the work that matters most (protobuf parsing in upb, Pillow's decoding, zlib,
CRC32C) runs in C, partly outside the GIL.

An error in the source or in ``fn`` is raised by the ``next()`` that reaches it, as it is (a
:class:`~tpurun.data.native.framing.DamagedRecord` names its file and record). Closing the
iterator, or dropping it, stops its threads.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_POLL_SECONDS = 0.1  # how often a blocked producer looks whether the consumer has gone


class _End:
    """The source is exhausted (``error`` None) or failed with ``error``."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


def _done(value: Any) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


def _produce(
    source: Iterator,
    fn: Callable,
    pool: ThreadPoolExecutor | None,
    out: queue.Queue,
    stop: threading.Event,
) -> None:
    """The background thread: ``source`` through ``fn`` into ``out`` until its end or ``stop``.
    Holds no reference to the :class:`Prefetched`, so dropping that stops it."""

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    end = _End()
    try:
        for item in source:
            future = pool.submit(fn, item) if pool is not None else _done(fn(item))
            if not put(future):
                return
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there
        end = _End(exc)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()
    put(end)


def _stop(stop: threading.Event, pool: ThreadPoolExecutor | None) -> None:
    stop.set()
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


class Prefetched:
    """``fn(item)`` for each item of ``source``, computed ahead in background threads, in order.

    Args:
        source: the items, read in a background thread.
        fn: what each item becomes.
        workers: threads running ``fn`` (0: the background thread runs it after reading).
        depth: results kept ready ahead of the consumer.
    """

    def __init__(
        self, source: Iterator, fn: Callable[[Any], Any], workers: int = 0, depth: int = 2
    ):
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop_event = threading.Event()
        pool = None
        if workers > 0:
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tpurun-parse")
        self._finalizer = weakref.finalize(self, _stop, self._stop_event, pool)
        self._finished = False
        self._thread = threading.Thread(
            target=_produce,
            args=(source, fn, pool, self._queue, self._stop_event),
            name="tpurun-input",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> Prefetched:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if isinstance(item, _End):
            self.close()
            if item.error is not None:
                raise item.error
            raise StopIteration
        try:
            return item.result()
        except BaseException:
            self.close()
            raise

    @property
    def thread(self) -> threading.Thread:
        """The reading thread (it ends once closed, after the item in hand)."""
        return self._thread

    def close(self) -> None:
        """Stop the background threads; later ``next()`` calls end the iteration."""
        self._finished = True
        self._finalizer()
        while True:  # unblock a producer waiting to put
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
