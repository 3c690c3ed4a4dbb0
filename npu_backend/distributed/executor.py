"""Run a job's tasks in this process or as Ray tasks, and hand the results back in task order.

The only module that imports Ray. A *job* is a picklable object with ``run(task) -> dict`` (a JSON-able
result); a *task* has ``index`` and ``units`` (what a progress bar counts). With Ray the job goes once into the
object store and every task is a Ray task holding a reference to it, at most ``workers`` in flight, each
result collected as it finishes (and saved, with a resume directory) and placed at its task's index: the
returned list is the serial run's, whoever computed what. A worker process that dies mid-task (killed,
out of memory, a crashed native library) is replaced by Ray and the task run again (``max_retries``); a task
that raises is not retried, its error ends the run.

By default a local Ray is started with one worker per CPU of this machine and shut down afterwards; an
``address`` connects to a running cluster instead, and a Ray already initialized by the caller is used as it is.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import NpuError

RETRIES = 3
"""Times Ray runs a task again after the worker process running it died."""

INSTALL_HINT = "pip install 'npu-backend[distributed]'"
WORKER_ENV = {"TVM_NUM_THREADS": "1"}
"""One thread per worker: the workers are the parallelism. TVM reads this when its thread pool starts (at the
first parallel kernel, after the task arrived), so it is set in the worker, not as a Ray runtime environment
(which costs seconds at start-up); Ray itself gives its workers ``OMP_NUM_THREADS=1``, which keeps numpy's
BLAS to one thread (on a busy 2-core machine its spinning threads made the simulator 3x slower here)."""


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


@dataclass(frozen=True)
class Placement:
    """Where tasks run: ``workers == 0`` is this process; ``note`` tells the user about a fallback."""

    workers: int | None
    address: str | None = None
    note: str | None = None

    @property
    def in_process(self) -> bool:
        return self.workers == 0

    def describe(self) -> str:
        if self.in_process:
            return "in this process"
        if self.address is not None:
            return f"on the Ray cluster at {self.address}" + (f", {self.workers} workers" if self.workers else "")
        return f"{self.workers or os.cpu_count()} Ray workers on this machine"


def plan_placement(workers: int | None = None, address: str | None = None) -> Placement:
    """``workers``: None for one per CPU (of this machine, or of the cluster at ``address``), 0 for this process
    without Ray, N for N Ray workers. Without Ray installed the work runs in this process, with a note."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 0):
        raise NpuError(f"workers must be a non-negative integer, got {workers!r}")
    if workers == 0:
        if address is not None:
            raise NpuError("workers=0 runs in this process: it cannot be combined with a cluster address")
        return Placement(0)
    if not ray_available():
        if address is not None:
            raise NpuError(f"connecting to a Ray cluster needs Ray: {INSTALL_HINT}")
        return Placement(0, note=f"Ray is not installed: running serially in this process ({INSTALL_HINT} "
                                 "to spread the work over every core or a cluster)")
    return Placement(workers, address)


def _run_task(job, task) -> dict:
    """What a Ray worker runs: the job's own ``run``; the worker's environment limits native thread pools."""
    for key, value in WORKER_ENV.items():
        os.environ.setdefault(key, value)
    return job.run(task)


def run_tasks(job, tasks: Sequence, placement: Placement, store=None,
              progress: Callable[[int, int], None] | None = None) -> list[dict]:
    """Results of ``job.run(task)`` for every task, in task order.

    ``store`` (a :class:`~npu_backend.distributed.shards.ShardStore`) supplies results finished by an earlier
    run and keeps new ones; ``progress(done, total)`` is called with the units done so far, first with those
    already finished.
    """
    results = store.finished(len(tasks)) if store is not None else {}
    total = sum(t.units for t in tasks)
    done = sum(tasks[i].units for i in results)
    if progress is not None:
        progress(done, total)
    pending = [t for t in tasks if t.index not in results]

    def finish(task, result):
        nonlocal done
        results[task.index] = result
        if store is not None:
            store.save(task.index, result)
        done += task.units
        if progress is not None:
            progress(done, total)

    if pending:
        if placement.in_process:
            for task in pending:
                finish(task, job.run(task))
        else:
            _run_on_ray(job, pending, placement, finish)
    return [results[t.index] for t in tasks]


def _run_on_ray(job, pending: list, placement: Placement, finish) -> None:
    import ray

    started = not ray.is_initialized()
    if started:
        local = {} if placement.address else {"num_cpus": placement.workers, "include_dashboard": False}
        ray.init(address=placement.address, logging_level=logging.ERROR, log_to_driver=False, **local)
    remote = ray.remote(_run_task).options(num_cpus=1, max_retries=RETRIES, retry_exceptions=False)
    limit = placement.workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
    in_flight: dict = {}
    try:
        job_ref = ray.put(job)
        queue = list(pending)
        while queue or in_flight:
            while queue and len(in_flight) < limit:
                task = queue.pop(0)
                in_flight[remote.remote(job_ref, task)] = task
            ready, _ = ray.wait(list(in_flight), num_returns=1)
            task = in_flight.pop(ready[0])
            finish(task, _result(ray, ready[0], task))
    finally:
        for ref in in_flight:
            ray.cancel(ref)
        if started:
            ray.shutdown()


def _result(ray, ref, task) -> dict:
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        raise cause if isinstance(cause, BaseException) else NpuError(f"task {task.index} failed: {exc}") from None
    except ray.exceptions.WorkerCrashedError:
        raise NpuError(f"task {task.index}: its worker process died {RETRIES + 1} times; giving up") from None
