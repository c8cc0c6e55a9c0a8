"""Batch arrays used again once every batch made of them is dropped.

The native pipeline makes each batch in its own thread, and the consumer drops it on another
(Keras' training thread, or a loop over the batches). glibc's malloc serves a thread other than
the main one from an arena of its own, and a large block freed there from another thread goes
back to the system, to be faulted in page by page for the next batch: reading raw floats
(``benchmarks/input_pipeline.py``, 1,024 records of 4 kB a batch) took 188 page faults and 3.2 ms
a batch through the pipeline's thread, against 1 fault and 2.7 ms with its arrays used again.

An array is handed out again only when nothing else holds it: a view of it, a batch still in use
or JAX's zero-copy alias of it each hold a reference, and its count is checked (CPython's). Where
reference counts are not exact enough for that (a free-threaded Python), every array is fresh.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

#: Arrays of one shape and dtype kept for use again: the batches in flight at once (the prefetched
#: ones, the one in Keras' hands, the one being made) fit with room to spare.
KEEP = 8
_COUNTED = getattr(sys, "_is_gil_enabled", lambda: True)()


class BatchArrays:
    """Empty arrays for batches, each one used again once nothing but this holds it. Each thread
    has its own arrays, so parse workers never share one."""

    def __init__(self, keep: int = KEEP):
        self._keep = keep if _COUNTED else 0
        self._local = threading.local()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """An array of ``shape`` and ``dtype`` whose values are left as they are: a kept one that
        nothing else holds any longer, else a fresh one (kept, while fewer than ``keep`` are)."""
        kept = self._local.__dict__.setdefault("kept", {})
        arrays = kept.setdefault((tuple(shape), np.dtype(dtype)), [])
        for i in range(len(arrays)):
            if sys.getrefcount(arrays[i]) == 2:  # the list's reference and the argument's
                return arrays[i]
        array = np.empty(shape, dtype)
        if len(arrays) < self._keep:
            arrays.append(array)
        return array

    def cast(self, array: np.ndarray, dtype: Any) -> np.ndarray:
        """A copy of ``array`` as ``dtype``, in an array of this pool: ``array.astype(dtype)``
        (values cast as it casts them, unchecked)."""
        out = self.empty(array.shape, dtype)
        np.copyto(out, array, casting="unsafe")
        return out
