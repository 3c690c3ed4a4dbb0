"""Calibration's planar depthwise convolution (npu_backend.quantization.depthwise) against the NHWC ``einsum`` it
replaces on NCHW batches, byte for byte, and the reused batch buffers (npu_backend.quantization.buffers)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from npu_backend.quantization import buffers, depthwise
from npu_backend.quantization.batched_float import WeightedPlan
from simulator.isa import Convolution, FeatureMap, Opcode
from simulator.macs import centred_input, depthwise_sums

RNG = np.random.default_rng(31)


def _conv(channels, size, stride, multiplier=1, dilation=1, kernel=3, padding=None) -> Convolution:
    pt, pl, pb, pr = padding if padding is not None else (dilation * (kernel // 2),) * 4
    oh = (size + pt + pb - dilation * (kernel - 1) - 1) // stride + 1
    ow = (size + 1 + pl + pr - dilation * (kernel - 1) - 1) // stride + 1  # width = size + 1: not square
    return Convolution(ifm=FeatureMap(0, size, size + 1, channels), ofm=FeatureMap(0, oh, ow, channels * multiplier),
                       weights_address=0, scale_bias_address=0, kernel=(kernel, kernel), stride=(stride, stride),
                       dilation=(dilation, dilation), padding=(pt, pl, pb, pr))


def _operands(conv: Convolution, samples: int = 3):
    x = (RNG.standard_normal((samples, 1, conv.ifm.channels, conv.ifm.height, conv.ifm.width)) * 3).astype(np.float32)
    x[x < -2] = 0.0
    x[x > 2.5] = -0.0
    kh, kw = conv.kernel
    weight = RNG.standard_normal((conv.ofm.channels, 1, kh, kw)).astype(np.float32)  # OIHW
    weight[0] = -0.0
    return x, weight


def test_einsum_sums_the_taps_in_row_major_order_with_two_roundings_from_zero():
    # The premise of the planar path: numpy's einsum kernel (simulator.macs.depthwise_apply) is tap by tap,
    # out = out + round(x * w), (ky, kx) row-major; another order or a fused multiply-add changes about half the sums.
    conv = _conv(24, 15, 2, kernel=5)
    x = (RNG.standard_normal((2, 15, 16, 24)) * 3).astype(np.float32)
    w = RNG.standard_normal((24, 5, 5)).astype(np.float32)
    padded = centred_input(x, 0, conv.padding, np.float32)
    want = np.zeros((2, conv.ofm.height, conv.ofm.width, 24), np.float32)
    for ky in range(5):
        for kx in range(5):
            window = padded[:, ky:ky + 2 * (conv.ofm.height - 1) + 1:2, kx:kx + 2 * (conv.ofm.width - 1) + 1:2]
            want += window * w[:, ky, kx]
    assert depthwise_sums(padded, w, conv).tobytes() == want.tobytes()


@pytest.mark.parametrize("conv", [
    _conv(8, 30, 1), _conv(8, 31, 2), _conv(5, 29, 3, kernel=5), _conv(6, 20, 1, multiplier=3),
    _conv(4, 21, 2, multiplier=2, dilation=2), _conv(7, 18, 1, dilation=2), _conv(5, 16, 2, padding=(0, 0, 1, 1)),
    _conv(5, 17, 1, padding=(2, 1, 0, 3)), _conv(3, 12, 1, padding=(0, 0, 0, 0)),
    _conv(3, 9, 2, kernel=1, padding=(0, 0, 0, 0))],
    ids=lambda c: f"s{c.stride[0]}d{c.dilation[0]}k{c.kernel[0]}m{c.ofm.channels // c.ifm.channels}p{c.padding}")
def test_planar_depthwise_sums_equal_the_nhwc_einsum_byte_for_byte(conv, monkeypatch):
    plan = WeightedPlan(Opcode.DEPTHWISE_CONV2D, conv, True, (0, 2, 3, 1))
    x, weight = _operands(conv)
    monkeypatch.setattr(depthwise, "PLANE_MIN", 1 << 40)
    want = plan.sums(x, weight)
    monkeypatch.setattr(depthwise, "PLANE_MIN", 0)
    monkeypatch.setattr(depthwise, "BLOCK_ELEMENTS", 700)  # several channel blocks per sample
    got = plan.sums(x, weight)
    assert got.tobytes() == want.tobytes()


def test_a_reused_buffer_is_handed_out_again_only_once_every_view_of_it_is_gone():
    size = buffers.POOLED_BYTES // 4
    with buffers.reuse():
        first = buffers.empty((2, size), np.float32)
        view = first[1][::3]
        address = first.__array_interface__["data"][0]
        del first
        gc.collect()
        other = buffers.empty((2, size), np.float32)
        assert other.__array_interface__["data"][0] != address  # the view still holds the first buffer
        view[...] = 7.0
        assert (view == 7.0).all()
        del view
        again = buffers.empty((size,), np.int32)  # a smaller request of another type
        assert again.__array_interface__["data"][0] == address
        assert again.flags.c_contiguous and again.flags.writeable and again.shape == (size,)
        del other, again
    assert buffers._regions == [] and not buffers._returned  # a finished calibration keeps nothing
    outside = buffers.empty((2, size), np.float32)
    assert outside.base is None  # plain arrays outside a calibration


def test_a_freed_buffer_serves_smaller_requests_in_pieces_that_merge_again():
    """A batch-sized buffer, once free, holds the next layers' smaller arrays side by side (each from the
    smallest hole that fits, page-aligned), and the pieces given back merge into the whole buffer again."""
    page = buffers.ALIGN
    with buffers.reuse():
        big = buffers.empty((4 * buffers.POOLED_BYTES,), np.uint8)
        start = big.__array_interface__["data"][0]
        del big
        gc.collect()
        first = buffers.empty((buffers.POOLED_BYTES + 1,), np.uint8)  # rounded up to whole pages
        second = buffers.empty((buffers.POOLED_BYTES // 4,), np.float64)
        assert first.__array_interface__["data"][0] == start
        assert second.__array_interface__["data"][0] == start + buffers.POOLED_BYTES + page
        (region,) = buffers._regions
        assert region.holes == [(3 * buffers.POOLED_BYTES + page, buffers.POOLED_BYTES - page)]
        del first
        gc.collect()
        third = buffers.empty((buffers.POOLED_BYTES // 4,), np.float32)  # the one hole of the two that holds it
        assert third.__array_interface__["data"][0] == start
        del second, third
        gc.collect()
        assert region.idle and len(buffers._regions) == 1  # merged back into one hole
        whole = buffers.empty((buffers.POOLED_BYTES,), np.float32)
        assert whole.__array_interface__["data"][0] == start and len(buffers._regions) == 1


def test_an_array_that_dies_while_the_pool_is_locked_does_not_deadlock(monkeypatch):
    """A pooled array's finalizer runs wherever the garbage collector runs: here inside _take, on the thread that
    holds the pool's lock (a cycle collected by an allocation there). It must only queue its buffer, which the
    next request then reuses; taking the lock there hung calibration. The test runs on a thread of its own with
    a lock of its own, so that the bug fails it instead of hanging the session."""
    import threading

    monkeypatch.setattr(buffers, "_lock", threading.Lock())
    original = buffers._file_returned

    def collect_inside_the_lock():
        gc.collect()  # the finalizer runs now, the lock held by this thread
        original()

    monkeypatch.setattr(buffers, "_file_returned", collect_inside_the_lock)
    size = buffers.POOLED_BYTES // 4
    result = {}

    def calibration():
        with buffers.reuse():
            first = buffers.empty((size,), np.float32)
            address = first.__array_interface__["data"][0]
            holder = [first]
            holder.append(holder)  # a reference cycle: only the collector frees it
            del first, holder
            again = buffers.empty((size,), np.float32)
            result["reused"] = again.__array_interface__["data"][0] == address  # queued, then filed and reused

    thread = threading.Thread(target=calibration, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the pool deadlocked on its own finalizer"
    assert result == {"reused": True}
