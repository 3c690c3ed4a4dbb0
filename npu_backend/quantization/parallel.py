"""Calibration's numpy work on every core: independent tasks shared by the calling thread and a pool, results in
order.

Numpy releases the GIL inside its loops and BLAS calls, so threads run its kernels side by side. Each task
computes exactly what the sequential code computes on the same slice (a chunk of samples, one sample), and the
caller combines the results in the sequential order, so nothing depends on how many threads ran them: the
quantized model is the same bit for bit with one worker or many (``tests/test_quantize_speed_paths.py``).

BLAS itself stays on one thread per call (:func:`npu_backend.quantization.batched_float.one_blas_thread`): OpenBLAS
splits a multiply between its threads in ways that change the order of the float32 additions, so its results
would differ in the last bits from one thread's, and with them the observed ranges.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait


def _cores() -> int:
    """The cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


MAX_DEFAULT_WORKERS = 8
"""The default's ceiling: each share of a simulator batch decodes and validates its stream again (Python, one
thread at a time), and a layer's numpy work is a few tasks per sample chunk, so more threads gain little."""
WORKERS = max(1, int(os.environ.get("NPU_QUANTIZE_THREADS", 0)) or min(_cores(), MAX_DEFAULT_WORKERS))
"""Threads calibration's numpy work runs on (``NPU_QUANTIZE_THREADS``; default: every core, at most
:data:`MAX_DEFAULT_WORKERS`)."""

TVM_LOCK = threading.RLock()
"""Held by every TVM build calibration makes (a layer's NPU module, the float layers' VM): TVM's ``BlockBuilder``
keeps one stack of builders for all threads, so two builds at once corrupt each other (a layer built beside the
walk, :mod:`.predicted`, once broke TVM's ONNX importer this way)."""

_state = threading.local()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (its size, the pool)
_pool_lock = threading.Lock()


def _mark_worker() -> None:
    _state.worker = True


def _helpers(size: int, drain: Callable, count: int) -> list[Future]:
    """``count`` runs of ``drain`` submitted to the pool of ``size`` threads (made, or remade for another size,
    here). Under the lock: the calibration's main thread and the float model's pass both submit, and one must not
    shut down the pool the other is submitting to. A replaced pool still runs what it was given."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != size:
            previous = _pool
            _pool = (size, ThreadPoolExecutor(max_workers=size, thread_name_prefix="npu-quantize",
                                              initializer=_mark_worker))
            if previous is not None:
                previous[1].shutdown(wait=False)  # its threads end once idle
        return [_pool[1].submit(drain) for _ in range(count)]


def run_all(task: Callable, items: Iterable) -> list:
    """``[task(item) for item in items]``, the tasks shared between the caller and ``WORKERS - 1`` pool threads.

    Each thread takes the next item until none is left, so the calling thread works too and a slow task holds
    up no other. A pool thread busy with another caller's tasks helps once it is free, if anything is left; a
    helper that has not started when the caller runs out of items is withdrawn, not waited for. Inline when
    there is one worker or one item, and on a pool thread or the deferred thread (a task there never waits for
    the pool it runs on). An exception is raised here after every task ended (the first item's that failed).
    """
    items = list(items)
    workers = WORKERS  # read once: workers() may change it on another thread meanwhile
    if workers < 2 or len(items) < 2 or getattr(_state, "worker", False):
        return [task(item) for item in items]
    results: list = [None] * len(items)
    errors: list = []
    order = itertools.count()  # next() on a count is atomic under the GIL

    def drain() -> None:
        while (k := next(order)) < len(items):
            try:
                results[k] = task(items[k])
            except BaseException as error:  # noqa: BLE001 - re-raised by the caller below
                errors.append((k, error))

    helpers = _helpers(workers - 1, drain, min(workers - 1, len(items) - 1))
    drain()
    wait([h for h in helpers if not h.cancel()])  # one not started would find nothing left
    if errors:
        raise min(errors, key=lambda e: e[0])[1]
    return results


def spawn(target: Callable, name: str) -> threading.Thread:
    """Start ``target()`` on a daemon thread of its own: a pipeline stage that runs beside the calibration and
    shares the pool with it (:func:`run_all`), so that up to ``WORKERS + 1`` threads compute at once. The float
    model's pass is one: the walk waits for it at the first layers, the largest, and with the stage's chunks
    inline on its own thread a core idled meanwhile."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def workers(count: int):
    """Run calibration on ``count`` threads inside the block (benchmarks and tests compare 1 with many)."""
    global WORKERS
    previous, WORKERS = WORKERS, max(1, int(count))
    try:
        yield
    finally:
        WORKERS = previous


class Deferred:
    """Work whose results the walk reads only when it ends (each layer's SQNR and output summary, for the
    report), on a thread of its own. The walk's main thread spends part of every layer alone, building the
    layer's NPU module in Python; deferred work fills that time on the other cores instead of adding to the
    walk. At most ``limit`` tasks are pending at once (a task holds a layer's outputs until it has run), and
    with one worker a task runs at once on the caller's thread. Each task computes what it would have computed
    in place, so the results do not depend on when it runs."""

    def __init__(self, limit: int = 2):
        self._executor = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="npu-quantize-deferred",
                                             initializer=_mark_worker) if WORKERS > 1 else None)
        self._slots = threading.BoundedSemaphore(limit)

    def submit(self, task: Callable, *args) -> Future:
        if self._executor is None:
            future: Future = Future()
            try:
                future.set_result(task(*args))
            except BaseException as error:  # noqa: BLE001 - raised where the result is read, as on the thread
                future.set_exception(error)
            return future
        self._slots.acquire()
        future = self._executor.submit(task, *args)
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def close(self, cancel: bool = False) -> None:
        """Wait for every task (their results stay in their futures); ``cancel``: drop those not started."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=cancel)
