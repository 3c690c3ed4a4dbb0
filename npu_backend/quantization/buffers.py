"""Calibration's large batch arrays, reused from layer to layer instead of fresh pages each time.

Every layer of the walk makes arrays of the whole calibration batch (a MobileNetV2's first layers: 100 x 32 x
112 x 112 float32, 160 MB): the float model's sums and outputs, the sums on the quantized inputs, the dequantized
activations. An allocation that large is a fresh ``mmap`` each time (glibc's threshold stops at 32 MB), so the
first pass writing it faults in and zeroes every page: about a sixth of the calibration's CPU time went to the
kernel doing that (and on a virtual machine whose host takes freed memory back, 1 to 2 s per GB). :func:`empty`
hands out an array backed by a piece of a buffer earlier, dead arrays used (:class:`_Region`), and takes the piece
back when the array and every view of it are gone, so the values computed are the same (the array is written
before it is read, as ``np.empty``'s) and only the page faults go.

An array is handed out as a view of a base array made over a ``memoryview`` of the buffer: numpy collapses every
later view's base to that base array (the ``memoryview`` stops the collapse), so the base array lives exactly as
long as the last view of the piece, and its finalizer returns the piece then.

A region is mapped in small pages (:func:`_fresh`). numpy advises the kernel to back every array of 4 MB or more
with 2 MB huge pages, and on this project's virtual machines a huge page costs far more to fault in than its 512
small ones: 2.3-3.1 s per GB against 0.4-0.7 (512 MB touched once a page; the host seems to hand back the freed
guest memory a huge page needs, where small pages come from the guest's own recently freed ones), while a pass
over the array is as fast either way (0.06 s per 512 MB). A default MobileNetV2-224 calibration spent 1.35-1.44 s
of CPU in the kernel with huge-page regions, 0.42-0.57 s with small ones (fresh process, wall 4.3 s to 3.8 s).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import math
import mmap
import threading
import weakref

import numpy as np

POOLED_BYTES = 2 << 20
"""Arrays from this size on (a huge page) come from the pool: the chunks the worker threads compute in are
reused too (glibc returns a thread arena's freed top to the system, so its next chunk faults again)."""
ALIGN = 4096
"""Pieces of a region start on page boundaries (any dtype's alignment)."""
FREE_LIMIT = 3 << 30
"""Bytes of wholly free regions kept; past it the least recently freed go back to the system."""


class _Region:
    """One buffer of the pool, handed out in pieces: a request takes the smallest free hole that holds it (from
    the hole's start), and a piece given back merges with the holes beside it. Whole buffers handed out as they
    were had to be near a request's size (else a chunk's temporary took a batch's buffer), and a MobileNetV2's
    early tensors (161 MB, then 482 MB, then 181 MB) each found none that fitted: 1.36 GB of fresh memory for a
    calibration whose arrays never held more than 0.86 GB at once; in pieces, 1.00 GB."""

    __slots__ = ("raw", "holes", "freed")

    def __init__(self, nbytes: int):
        self.raw = _fresh(nbytes)
        self.holes: list[tuple[int, int]] = []  # free (offset, size), by offset, none touching another
        self.freed = 0

    @property
    def idle(self) -> bool:
        return self.holes == [(0, self.raw.nbytes)]

    def give_back(self, offset: int, size: int) -> None:
        k = bisect.bisect(self.holes, (offset, size))
        if k < len(self.holes) and offset + size == self.holes[k][0]:  # merge with the next hole
            size += self.holes.pop(k)[1]
        if k and sum(self.holes[k - 1]) == offset:  # and the previous one
            offset, before = self.holes.pop(k - 1)
            size += before
            k -= 1
        self.holes.insert(k, (offset, size))


def _fresh(nbytes: int) -> np.ndarray:
    """``nbytes`` of new memory for a region, advised to stay in small pages (module docstring) where the
    platform can say so, else numpy's own; the array keeps the mapping alive, and it is unmapped with the last
    view."""
    if not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.empty(nbytes, np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages refuses the advice: none needed
        mapping.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(mapping, np.uint8)


_regions: list[_Region] = []
_returned: collections.deque = collections.deque()  # (region, offset, size) of dead arrays, not yet filed
_active = 0  # calibrations running (:func:`reuse`)
_lock = threading.Lock()
_clock = itertools.count(1)


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
                _regions.clear()
                _returned.clear()


def _take(nbytes: int) -> tuple[_Region, int]:
    """A piece of ``nbytes`` (a multiple of :data:`ALIGN`): the smallest free hole that holds it, else a new
    region of exactly that size."""
    with _lock:
        _file_returned()
        best = None
        for region in _regions:
            for k, (offset, size) in enumerate(region.holes):
                if size >= nbytes and (best is None or size < best[0]):
                    best = (size, region, k)
        if best is not None:
            size, region, k = best
            offset = region.holes[k][0]
            if size == nbytes:
                del region.holes[k]
            else:
                region.holes[k] = (offset + nbytes, size - nbytes)
            return region, offset
    region = _Region(nbytes)  # outside the lock: np.empty may run the collector, whose finalizers queue
    with _lock:
        _regions.append(region)
    return region, 0


def _give_back(region: _Region, offset: int, size: int) -> None:
    """An array's finalizer: it runs wherever the garbage collector happens to run, possibly inside
    :func:`_take` on this very thread with the lock held, so it only queues the piece (a deque's append is
    atomic) and waits on no lock: it files the queue only when the lock is free (else the holder files it), so
    the regions are trimmed to :data:`FREE_LIMIT` as pieces come back. Outside a calibration the piece is simply
    let go."""
    if not _active:
        return
    _returned.append((region, offset, size))
    if _lock.acquire(blocking=False):
        try:
            _file_returned()
        finally:
            _lock.release()


def _file_returned() -> None:
    """Give the returned pieces back to their regions (those still in the pool), then let the least recently
    freed wholly free regions go past :data:`FREE_LIMIT` bytes (with the lock held)."""
    while _returned:
        region, offset, size = _returned.popleft()
        if _active and any(r is region for r in _regions):
            region.give_back(offset, size)
            region.freed = next(_clock)
    idle = sorted((r for r in _regions if r.idle), key=lambda r: r.freed)
    total = sum(r.raw.nbytes for r in idle)
    for region in idle:
        if total <= FREE_LIMIT:
            break
        total -= region.raw.nbytes
        _regions.remove(region)


def empty(shape, dtype=np.float32) -> np.ndarray:
    """``np.empty(shape, dtype)``, C-contiguous; inside :func:`reuse`, its memory a piece of a pooled region."""
    shape = tuple(int(d) for d in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < POOLED_BYTES or not _active:
        return np.empty(shape, dtype)
    size = -(-nbytes // ALIGN) * ALIGN
    region, offset = _take(size)
    # base: the memoryview (see module docstring); it keeps the region's memory alive while any view lives
    base = np.frombuffer(memoryview(region.raw)[offset:offset + nbytes], dtype=dtype, count=count)
    weakref.finalize(base, _give_back, region, offset, size)
    return base.reshape(shape)


def empty_like(array: np.ndarray) -> np.ndarray:
    """:func:`empty` of ``array``'s shape and type."""
    return empty(array.shape, array.dtype)
