"""Evaluation and sweeps on a local Ray cluster (2 CPUs, started once for this module): the same results as the
serial run, bit for bit, also when a worker process is killed mid-run or a run is resumed.

Every Ray test lives here, so the cluster starts once; the `test` extra installs Ray, so CI runs them.
"""

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import ray.cloudpickle

import npu_backend
from conftest import FIXTURES
from npu_backend.distributed.evaluation import EvalJob, plan_evaluation, summarize
from npu_backend.distributed.executor import run_tasks
from npu_backend.errors import NpuError

DIGITS = FIXTURES / "digits"
MODEL = DIGITS / "cnn_tflite_ptq.tflite"
DATA = DIGITS / "digits_split.npz"
SETTINGS = dict(key="test", labels="test_labels", limit=64, shard_size=8)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def serial():
    return npu_backend.evaluate(MODEL, DATA, workers=0, **SETTINGS)


def test_two_workers_equal_the_serial_run_bit_for_bit(local_ray, serial):
    distributed = npu_backend.evaluate(MODEL, DATA, workers=2, **SETTINGS)
    assert distributed == serial  # every per-sample record (digests of the outputs included), in order
    assert distributed.to_json() == serial.to_json()


@dataclass(frozen=True)
class CrashOnce:
    """The evaluation job, except that the worker running shard 3 the first time dies on the spot."""

    job: EvalJob
    marker: str

    def run(self, shard):
        if shard.index == 3 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os._exit(1)
        return self.job.run(shard)


def test_a_worker_killed_mid_run_is_retried_by_ray(local_ray, serial, tmp_path):
    job, shards, dataset, placement, _ = plan_evaluation(MODEL, DATA, workers=2, **SETTINGS)
    marker = tmp_path / "crashed"
    done = []
    results = run_tasks(CrashOnce(job, str(marker)), shards, placement, progress=lambda d, t: done.append(d))
    victim = int(marker.read_text())
    assert victim != os.getpid()
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)  # the worker process is gone
    assert summarize(job, results, dataset.labels) == serial
    assert done[-1] == 64 and len(done) == 1 + len(shards)  # each shard counted once


def test_resumed_run_equals_an_uninterrupted_one(local_ray, serial, tmp_path):
    def interrupt(done, total):
        if done >= 24:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        npu_backend.evaluate(MODEL, DATA, workers=2, resume=tmp_path, progress=interrupt, **SETTINGS)
    kept = len(list(tmp_path.glob("task-*.json")))
    assert 3 <= kept < 8
    first = []
    resumed = npu_backend.evaluate(MODEL, DATA, workers=2, resume=tmp_path, progress=lambda d, t: first.append(d),
                                   **SETTINGS)
    assert resumed == serial and first[0] == 8 * kept


@dataclass(frozen=True)
class Refuses:
    def run(self, task):
        raise NpuError(f"task {task.index} refused")


def test_an_error_in_a_task_ends_the_run_with_its_own_message(local_ray):
    _, shards, _, placement, _ = plan_evaluation(MODEL, DATA, workers=2, **SETTINGS)
    with pytest.raises(NpuError, match=r"^task \d refused$"):
        run_tasks(Refuses(), shards, placement)


def test_sweep_on_ray_equals_the_serial_sweep(local_ray):
    models = [MODEL, DIGITS / "mobilenet_tflite_ptq.tflite"]
    presets = ["npu-256", "npu-1024", "npu-tiny"]
    serial = npu_backend.sweep(models, presets, workers=0)
    distributed = npu_backend.sweep(models, presets, workers=2)
    assert distributed.figures() == serial.figures() and len(serial.rows) == 6
