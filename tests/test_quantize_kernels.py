"""The compiled loops of :mod:`npu_backend.quantization.kernels` against numpy's definitions of the same counts."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from npu_backend.quantization import kernels


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 4099])
def test_byte_counts_are_bincounts_at_every_remainder(size):
    values = np.random.default_rng(size).integers(-128, 128, size).astype(np.int8)
    counts = kernels.byte_counts(values)
    assert counts.dtype == np.int64 and counts.shape == (256,)
    np.testing.assert_array_equal(counts, np.bincount(values.view(np.uint8), minlength=256))


def test_byte_counts_of_unaligned_and_strided_views():
    base = np.random.default_rng(1).integers(-128, 128, (64, 33)).astype(np.int8)
    for view in (base.reshape(-1)[1:], base.reshape(-1)[3:-5], base[:, 1:], base.T):
        np.testing.assert_array_equal(kernels.byte_counts(view),
                                      np.bincount(np.ascontiguousarray(view).reshape(-1).view(np.uint8),
                                                  minlength=256))


def test_byte_counts_of_one_level_and_of_the_extremes():
    for level in (-128, -1, 0, 127):
        counts = kernels.byte_counts(np.full(1001, level, np.int8))
        assert counts[level % 256] == 1001 and counts.sum() == 1001


def test_byte_counts_from_threads_at_once():
    """Worker threads call the kernel side by side (and may be the first to compile it)."""
    kernels._compiled.pop("byte_counts", None)
    arrays = [np.random.default_rng(k).integers(-128, 128, 100_000).astype(np.int8) for k in range(4)]
    results = [None] * len(arrays)

    def count(k):
        results[k] = kernels.byte_counts(arrays[k])

    threads = [threading.Thread(target=count, args=(k,)) for k in range(len(arrays))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for values, counts in zip(arrays, results):
        np.testing.assert_array_equal(counts, np.bincount(values.view(np.uint8), minlength=256))
