"""The native pipeline's batches as Keras' ``fit``, ``evaluate`` and ``predict`` take them.

A ``keras.utils.PyDataset`` with one worker and no processes, which Keras reads on the training
thread itself (its enqueuer threads start only for more workers): it asks for batch 0, 1, 2...,
and each answer is the next batch of an iteration of
:class:`~tpurun.data.native.pipeline.Batches`, already prepared by its background thread.
Keras' workers would run ``__getitem__`` in a pool, for datasets that can fetch any batch at
random; a shuffle buffer cannot. A request out of order (a validation pass starting again at
batch 0) starts a fresh iteration there.

That background thread also puts each batch on the devices, split as Keras' distribution splits
it (``get_data_layout``), so that the batches waiting there (``PREFETCH_BATCHES``) are ready and
Keras' own placing of them on the training thread finds them in place. Under a distribution Keras
places each batch only when the step asks for it, on that thread. Without one (a single device),
on an accelerator, Keras places one batch ahead, on that thread, and uncommitted
(``jax.device_put`` with no device): the thread does the same earlier, since a committed batch
beside the uncommitted variables would have the steps compiled again (see
:func:`tpurun.runtime.activate.activate`). Not on a CPU, where Keras passes the arrays as they
are, and not with several processes: Keras assembles the global batch from each process's share
itself. At the process's exit, those threads are stopped before JAX takes its devices down (its
own exit handler), so that none places a batch on a device being taken down.

Imports Keras at module level: import it once the process is set up (see :mod:`tpurun.frameworks`).
"""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from tpurun import frameworks
from tpurun.data.native.pipeline import Batches

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks
jax = frameworks.jax()

#: How long the exit waits for a thread to finish the batch it is placing (milliseconds, as a rule).
_EXIT_WAIT_SECONDS = 5.0
_PLACING: weakref.WeakSet = weakref.WeakSet()  # the KerasBatches whose threads place batches
_PLACING_THREADS: weakref.WeakSet = weakref.WeakSet()  # their threads, while they run


class KerasBatches(keras.utils.PyDataset):
    """:class:`Batches` for Keras: finite (``num_batches``) or endless (None)."""

    def __init__(self, batches: Batches):
        super().__init__(workers=1, use_multiprocessing=False)
        self.batches = batches
        # Read here, on the training thread: Keras keeps its distribution per thread.
        self._place = _placer(keras.distribution.distribution())
        self._iterator: Any = None
        self._next = 0
        self._first: Any = None  # batch 0, until batch 1 is asked for
        if self._place is not None:
            _PLACING.add(self)

    @property
    def num_batches(self) -> int | None:
        return self.batches.num_batches

    def __len__(self) -> int:
        if self.batches.num_batches is None:
            raise TypeError("an endless stream of batches has no length")
        return self.batches.num_batches

    def __getitem__(self, index: int) -> Any:
        if index == 0 and self._next == 1 and self._first is not None:
            # Keras' first fit takes batch 0 to build the model's metrics symbolically, then
            # starts over: batch 0 again, not the stream read afresh (its shuffle buffer too).
            return self._first
        if self._iterator is None or index != self._next:
            self._start(index)
        self._next = index + 1
        try:
            batch = next(self._iterator)
        except StopIteration:
            raise IndexError(f"batch {index} is past the end of the data") from None
        self._first = batch if index == 0 else None
        return batch

    def read_ahead(self) -> None:
        """Start reading from batch 0 now, in the background, for Keras' first request: a
        training stream fills its shuffle buffer while the model is built and compiled."""
        if self._iterator is None:
            self._start(0)

    def _start(self, index: int) -> None:
        """A fresh iteration, from batch ``index``."""
        self.close()
        self._iterator = self.batches.iterate(skip_batches=index, then=self._place)
        self._next = index
        if self._place is not None:
            _PLACING_THREADS.add(self._iterator.thread)

    def close(self) -> None:
        """Stop the background threads of the current iteration."""
        self._first = None
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None


def _on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


def _placer(distribution: Any) -> Callable[[Any], Any] | None:
    """What puts a batch's arrays on the devices as ``distribution`` lays them out, or, without
    one, on the one accelerator uncommitted, as Keras would; None where Keras passes the batches
    on as they are (no distribution on a CPU) or places them itself (several processes)."""
    if jax.process_count() > 1 or (distribution is None and not _on_accelerator()):
        return None
    shardings: dict[tuple[int, ...], Any] = {}

    def sharding(shape: tuple[int, ...]) -> Any:
        if distribution is None:
            return None  # the default device, uncommitted
        if shape not in shardings:
            shardings[shape] = distribution.get_data_layout(shape).backend_layout
        return shardings[shape]

    def place(array: Any) -> Any:
        if not isinstance(array, np.ndarray) or array.dtype == object:
            return array  # strings stay on the host, as Keras leaves them
        return jax.device_put(array, sharding(array.shape))

    return lambda batch: keras.tree.map_structure(place, batch)


@atexit.register  # after JAX's own handler (JAX is imported first), so run before it
def _stop_placing() -> None:
    """Stop every thread that places batches (those of iterations closed already, the training
    stream's at the fit's end, included), and let each finish the one in hand."""
    for batches in list(_PLACING):
        batches.close()
    for thread in list(_PLACING_THREADS):
        thread.join(_EXIT_WAIT_SECONDS)


def for_keras(batches: Batches) -> KerasBatches:
    return KerasBatches(batches)
