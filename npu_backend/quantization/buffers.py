"""Calibration's large batch arrays, reused from layer to layer instead of fresh pages each time.

Every layer of the walk makes arrays of the whole calibration batch (a MobileNetV2's first layers: 100 x 32 x
112 x 112 float32, 160 MB): the float model's sums and outputs, the sums on the quantized inputs, the dequantized
activations. An allocation that large is a fresh ``mmap`` each time (glibc's threshold stops at 32 MB), so the
first pass writing it faults in and zeroes every page: about a sixth of the calibration's CPU time went to the
kernel doing that. :func:`empty` hands out an array backed by a buffer an earlier, dead array of about the same
size used, and takes the buffer back when the array and every view of it are gone, so the values computed are
the same (the array is written before it is read, as ``np.empty``'s) and only the page faults go.

An array is handed out as a view of a base array made over a ``memoryview`` of the buffer: numpy collapses every
later view's base to that base array (the ``memoryview`` stops the collapse), so the base array lives exactly as
long as the last view of the buffer, and its finalizer returns the buffer then.
"""

from __future__ import annotations

import collections
import contextlib
import math
import threading
import weakref

import numpy as np

POOLED_BYTES = 2 << 20
"""Arrays from this size on (a huge page) come from the pool: the chunks the worker threads compute in are
reused too (glibc returns a thread arena's freed top to the system, so its next chunk faults again)."""
SLACK = 4
"""A free buffer serves requests down to a quarter of its size."""
FREE_LIMIT = 3 << 30
"""Bytes of free buffers kept; past it the least recently freed go back to the system."""

_free: list[np.ndarray] = []  # free buffers, least recently freed first
_returned: collections.deque = collections.deque()  # buffers whose arrays died, not yet filed into _free
_active = 0  # calibrations running (:func:`reuse`)
_lock = threading.Lock()


@contextlib.contextmanager
def reuse():
    """Inside the block, :func:`empty` reuses buffers; when the last such block ends they go back to the system
    (a finished calibration holds no memory)."""
    global _active
    with _lock:
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if not _active:
                _free.clear()
                _returned.clear()


def _take(nbytes: int) -> np.ndarray | None:
    """The smallest free buffer that holds ``nbytes`` and is at most :data:`SLACK` times larger: a network's
    tensors mostly shrink from layer to layer, so the first layers' buffers serve the later ones, but a chunk's
    temporary does not take a whole batch's buffer."""
    with _lock:
        _file_returned()
        fits = [k for k, raw in enumerate(_free) if nbytes <= raw.nbytes <= SLACK * nbytes]
        if not fits:
            return None
        return _free.pop(min(fits, key=lambda k: _free[k].nbytes))


def _give_back(raw: np.ndarray) -> None:
    """An array's finalizer: it runs wherever the garbage collector happens to run, possibly inside
    :func:`_take` on this very thread with the lock held, so it only queues the buffer (a deque's append is
    atomic) and waits on no lock: it files the queue only when the lock is free (else the holder files it), so
    the free list is trimmed to :data:`FREE_LIMIT` as buffers come back. Outside a calibration the buffer is
    simply let go."""
    if not _active:
        return
    _returned.append(raw)
    if _lock.acquire(blocking=False):
        try:
            _file_returned()
        finally:
            _lock.release()


def _file_returned() -> None:
    """Move the returned buffers to the free list, least recently freed first, keeping at most
    :data:`FREE_LIMIT` bytes (with the lock held)."""
    while _returned:
        raw = _returned.popleft()
        if _active:
            _free.append(raw)
    total = sum(r.nbytes for r in _free)
    while total > FREE_LIMIT:
        total -= _free.pop(0).nbytes


def empty(shape, dtype=np.float32) -> np.ndarray:
    """``np.empty(shape, dtype)``, C-contiguous; inside :func:`reuse`, its memory taken from a dead array's."""
    shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < POOLED_BYTES or not _active:
        return np.empty(shape, dtype)
    raw = _take(nbytes)
    if raw is None:
        raw = np.empty(nbytes, np.uint8)
    base = np.frombuffer(memoryview(raw), dtype=dtype, count=count)  # base: the memoryview (see module docstring)
    weakref.finalize(base, _give_back, raw)
    return base.reshape(shape)


def empty_like(array: np.ndarray) -> np.ndarray:
    """:func:`empty` of ``array``'s shape and type."""
    return empty(array.shape, array.dtype)
