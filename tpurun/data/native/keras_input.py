"""The native pipeline's batches as Keras' ``fit``, ``evaluate`` and ``predict`` take them.

A ``keras.utils.PyDataset`` with one worker: Keras then asks for batch 0, 1, 2... in its own
thread, and each answer is the next batch of an iteration of :class:`~tpurun.data.native.pipeline.Batches`,
already prepared by its background threads. Keras' own workers would run ``__getitem__`` in a
pool, for datasets that can fetch any batch at random; a shuffle buffer cannot. A request out of
order (a validation pass starting again at batch 0) starts a fresh iteration there.

Imports Keras at module level: import it once the process is set up (see :mod:`tpurun.frameworks`).
"""

from __future__ import annotations

from typing import Any

from tpurun import frameworks
from tpurun.data.native.pipeline import Batches

keras = frameworks.keras()  # the process is set up: see tpurun.frameworks


class KerasBatches(keras.utils.PyDataset):
    """:class:`Batches` for Keras: finite (``num_batches``) or endless (None)."""

    def __init__(self, batches: Batches):
        super().__init__(workers=1, use_multiprocessing=False)
        self.batches = batches
        self._iterator: Any = None
        self._next = 0

    @property
    def num_batches(self) -> int | None:
        return self.batches.num_batches

    def __len__(self) -> int:
        if self.batches.num_batches is None:
            raise TypeError("an endless stream of batches has no length")
        return self.batches.num_batches

    def __getitem__(self, index: int) -> Any:
        if self._iterator is None or index != self._next:
            self.close()
            self._iterator = self.batches.iterate(skip_batches=index)
        self._next = index + 1
        try:
            return next(self._iterator)
        except StopIteration:
            raise IndexError(f"batch {index} is past the end of the data") from None

    def close(self) -> None:
        """Stop the background threads of the current iteration."""
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None


def for_keras(batches: Batches) -> KerasBatches:
    return KerasBatches(batches)
