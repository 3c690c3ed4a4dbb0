"""The simulator's fast exact paths against slow references, on values chosen to break them if they were wrong:
the MAC sums in float32/float64 (:mod:`simulator.macs`), the float64 requantization, the narrow accumulator's
early exit, the batched stream runner, and the quantizer's numpy float layers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm

import reference_kernels as ref
from layer_streams import layer_stream, random_params, weights_from_an_input
from npu_backend.params import NpuOp
from simulator import get_config, run_stream
from simulator.batch import _transpose_runs, run_stream_batch
from simulator.isa import Command, Convolution, DmaCopy, FeatureMap, MemorySpace, Opcode
from simulator.macs import FLOAT32_EXACT, FLOAT64_EXACT, exact_sums, sum_bound, sum_dtype
from simulator.numerics import _requantize_double_in_float64, narrow_accumulator, requantize

BASE = get_config("npu-256")


def _int64_sums(opcode, conv, ifm, weights):
    """The sums tap by tap in int64 (a different algorithm from the code under test, and exact)."""
    pt, pl, pb, pr = conv.padding
    x = np.pad(ifm.astype(np.int64) - conv.input_zero_point, ((pt, pb), (pl, pr), (0, 0)))
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel, conv.stride, conv.dilation
    oh, ow = conv.ofm.height, conv.ofm.width
    w = weights.astype(np.int64)
    if opcode == Opcode.FULLY_CONNECTED:
        return x @ w.T
    acc = np.zeros((oh, ow, conv.ofm.channels), np.int64)
    m = conv.ofm.channels // conv.ifm.channels
    for ky in range(kh):
        for kx in range(kw):
            win = x[ky * dh:ky * dh + (oh - 1) * sh + 1:sh, kx * dw:kx * dw + (ow - 1) * sw + 1:sw]
            if opcode == Opcode.DEPTHWISE_CONV2D:
                acc += np.repeat(win, m, axis=-1) * w[:, ky, kx]
            else:
                acc += np.einsum("hwc,oc->hwo", win, w[:, ky, kx, :])
    return acc


def _conv(opcode, h, w, ic, oc, kernel=(3, 3), stride=(1, 1), dilation=(1, 1), padding=(1, 1, 1, 1), zp=0):
    oh = (h + padding[0] + padding[2] - dilation[0] * (kernel[0] - 1) - 1) // stride[0] + 1
    ow = (w + padding[1] + padding[3] - dilation[1] * (kernel[1] - 1) - 1) // stride[1] + 1
    if opcode == Opcode.FULLY_CONNECTED:
        oh, ow, kernel, padding = h, w, (1, 1), (0, 0, 0, 0)
    return Convolution(FeatureMap(0, h, w, ic), FeatureMap(0, oh, ow, oc), 0, 0, kernel, stride, dilation, padding,
                       input_zero_point=zp)


def test_sum_types_switch_exactly_at_their_limits():
    assert sum_dtype(FLOAT32_EXACT - 1) == np.float32
    assert sum_dtype(FLOAT32_EXACT) == np.float64
    assert sum_dtype(FLOAT64_EXACT - 1) == np.float64
    assert sum_dtype(FLOAT64_EXACT) == np.int64
    x = np.array([[[-128]]], np.int8)
    assert sum_bound(x, 127, np.full((3, 1, 1, 1), -128, np.int8)) == 255 * 128


# 255 * 128 * 514 < 2**24 <= 255 * 128 * 515: the last float32 case and the first float64 one, all terms at
# full scale and one sign, so that every partial sum is as large as the bound allows; 4099 terms: past float32.
@pytest.mark.parametrize("channels", [514, 515, 4099])
def test_full_scale_sums_at_the_float32_limit_are_exact(channels):
    conv = _conv(Opcode.CONV2D, 2, 3, channels, 4, kernel=(1, 1), padding=(0, 0, 0, 0), zp=127)
    ifm = np.full((2, 3, channels), -128, np.int8)  # x - zp = -255 everywhere
    weights = np.full((4, 1, 1, channels), -128, np.int8)
    weights[1] = 127
    weights[2, ..., ::2] = 127  # alternating signs: large partial sums that cancel
    weights[3, ..., -1] = 1  # an odd total: a float32 sum past 2**24 would round it
    got = exact_sums(Opcode.CONV2D, conv, ifm, weights)
    np.testing.assert_array_equal(got, _int64_sums(Opcode.CONV2D, conv, ifm, weights))
    assert got[0, 0, 0] == 255 * 128 * channels


def test_the_bias_is_counted_in_the_type_of_the_sums():
    """255 * 128 * 514 fits float32; plus a bias of 1001 it does not (16,777,961 is odd and above 2**24)."""
    conv = _conv(Opcode.FULLY_CONNECTED, 1, 1, 514, 1, zp=127)
    ifm, weights = np.full((1, 1, 514), -128, np.int8), np.full((1, 514), -128, np.int8)
    assert exact_sums(Opcode.FULLY_CONNECTED, conv, ifm, weights).dtype == np.float32
    sums = exact_sums(Opcode.FULLY_CONNECTED, conv, ifm, weights, headroom=1001)
    assert sums.dtype == np.float64
    sums += np.int32(1001)
    assert int(sums[0, 0, 0]) == 255 * 128 * 514 + 1001 == 2 ** 24 + 745


@pytest.mark.parametrize("opcode,kernel,stride,dilation,multiplier", [
    (Opcode.CONV2D, (3, 3), (1, 1), (1, 1), 1), (Opcode.CONV2D, (3, 3), (2, 2), (1, 1), 1),
    (Opcode.CONV2D, (3, 2), (1, 2), (2, 1), 1), (Opcode.DEPTHWISE_CONV2D, (3, 3), (1, 1), (1, 1), 1),
    (Opcode.DEPTHWISE_CONV2D, (3, 3), (2, 2), (1, 1), 1), (Opcode.DEPTHWISE_CONV2D, (3, 3), (2, 1), (2, 2), 2),
    (Opcode.DEPTHWISE_CONV2D, (5, 5), (3, 3), (1, 1), 3), (Opcode.FULLY_CONNECTED, (1, 1), (1, 1), (1, 1), 1)])
def test_sums_equal_the_int64_reference_on_extreme_values(opcode, kernel, stride, dilation, multiplier):
    rng = np.random.default_rng(3)
    ic = 70 if opcode == Opcode.CONV2D else 5  # 70: tap by tap; the 3x2 kernel below 64 channels: gathered taps
    ic = 6 if kernel == (3, 2) else ic
    oc = ic * multiplier if opcode == Opcode.DEPTHWISE_CONV2D else 9
    conv = _conv(opcode, 11, 9, ic, oc, kernel, stride, dilation, (1, 2, 2, 1), zp=-128)
    ifm = rng.choice(np.array([-128, 127, 126, -127], np.int8), (11, 9, ic))
    shape = {Opcode.CONV2D: (oc, *kernel, ic), Opcode.DEPTHWISE_CONV2D: (oc, *kernel),
             Opcode.FULLY_CONNECTED: (oc, ic)}[opcode]
    weights = rng.choice(np.array([-128, 127, -127, 1], np.int8), shape)
    got = exact_sums(opcode, conv, ifm, weights)
    np.testing.assert_array_equal(got, _int64_sums(opcode, conv, ifm, weights))
    batch = np.stack([ifm, ifm[::-1, ::-1], -1 - ifm])  # leading batch axis: each sample as on its own
    got = exact_sums(opcode, conv, batch, weights)
    for n in range(3):
        np.testing.assert_array_equal(got[n], _int64_sums(opcode, conv, batch[n], weights))


def test_sums_match_the_pure_python_reference_with_padding_and_a_zero_point():
    rng = np.random.default_rng(4)
    conv = _conv(Opcode.CONV2D, 5, 4, 3, 2, (3, 3), (2, 1), (1, 2), (2, 1, 0, 2), zp=17)
    ifm = rng.integers(-128, 128, (5, 4, 3)).astype(np.int8)
    weights = rng.integers(-128, 128, (2, 3, 3, 3)).astype(np.int8)
    want = ref._conv2d_accumulators(ifm.tolist(), weights.tolist(), [0, 0], 17, (2, 1), (1, 2), (2, 1, 0, 2),
                                    depthwise=False)
    np.testing.assert_array_equal(exact_sums(Opcode.CONV2D, conv, ifm, weights), np.array(want))


# Accumulators that make the TFLite double rounding's two steps tie: with m = 2**30 the high multiply is acc / 2
# (odd acc: a tie), and the right shift then rounds again; extremes, and values around the float64 path's limit.
ACCUMULATORS = np.array([0, 1, -1, 2, -2, 3, -3, 5, -5, 7, -7, 255, -255, 257, -257, 1023, -1023, 1025, -1025,
                         2 ** 20 - 1, -(2 ** 20) + 1, 2 ** 21 + 1, -(2 ** 21) - 1, 2 ** 22 + 3, -(2 ** 22) - 3,
                         2 ** 31 - 1, -(2 ** 31)], np.int64)


@pytest.mark.parametrize("shift", [1, 0, -1, -2, -5, -12, -21, -22, -31])
@pytest.mark.parametrize("multiplier", [2 ** 30, 2 ** 31 - 1, 1518500250, 0])
def test_requantize_equals_the_integer_reference_on_ties_and_extremes(shift, multiplier):
    small = np.concatenate([ACCUMULATORS[np.abs(ACCUMULATORS) < 2 ** 20],
                            np.random.default_rng(shift & 0xff).integers(-2 ** 20 + 1, 2 ** 20, 500)])
    fast = _requantize_double_in_float64(small, multiplier, shift, 0, -128, 127, np.int8)
    assert (fast is None) == (shift < -22)  # else the float64 path runs: its limit covers 2**20 up to R = 22
    for acc in (small, ACCUMULATORS):  # all of them: too large for the float64 path, the integer one runs
        for zp, clamp in ((0, (-128, 127)), (-7, (-128, 127)), (100, (-20, 127))):
            got = requantize(acc, multiplier, shift, zp, *clamp)
            want = [min(max(ref.multiply_by_quantized_multiplier(int(a), multiplier, shift) + zp, clamp[0]),
                        clamp[1]) for a in acc]
            np.testing.assert_array_equal(got, np.array(want, np.int8))


def test_requantize_per_channel_on_a_batch_equals_the_reference():
    rng = np.random.default_rng(9)
    multiplier = rng.integers(2 ** 30, 2 ** 31, 6)
    shift = np.array([0, -1, -3, -8, -21, 2])
    acc = rng.integers(-2 ** 20, 2 ** 20, (4, 3, 6))
    got = requantize(acc, multiplier, shift, 3, -128, 127)
    want = np.vectorize(lambda a, m, s: min(max(ref.multiply_by_quantized_multiplier(int(a), int(m), int(s)) + 3,
                                                -128), 127))(acc, multiplier, shift)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mode", ["wrap", "saturate"])
def test_narrow_accumulator_counts_float_sums_at_and_past_the_register_limits(mode):
    inside = np.array([8191.0, -8192.0, 0.0])
    acc, overflows = narrow_accumulator(inside, 14, mode)
    assert overflows == 0 and np.array_equal(acc, inside)
    acc, overflows = narrow_accumulator(np.array([8192.0, -8193.0, 8191.0]), 14, mode)
    assert overflows == 2
    assert acc.tolist() == ([-8192, 8191, 8191] if mode == "wrap" else [8191, -8192, 8191])


@pytest.mark.parametrize("config", [BASE, dataclasses.replace(BASE, name="sram-4k", sram_bytes=4096),
                                    dataclasses.replace(BASE, name="acc14", accumulator_bits=14)],
                         ids=["npu-256", "tiled", "acc14-wrap"])
@pytest.mark.parametrize("op,kwargs", [
    (NpuOp.CONV2D, dict(ifm_shape=(1, 12, 10, 6), out_channels=20)),
    (NpuOp.DEPTHWISE_CONV2D, dict(ifm_shape=(1, 12, 10, 8), strides=(2, 2), multiplier=2)),
    (NpuOp.FULLY_CONNECTED, dict(ifm_shape=(3, 40), out_channels=7))])
def test_a_batched_run_equals_one_run_per_sample(config, op, kwargs):
    rng = np.random.default_rng(5)
    params = random_params(rng, op, **kwargs)
    stream = layer_stream(params, config)
    batch = rng.integers(-128, 128, (4, *params.ifm_shape)).astype(np.int8)
    batch[0] = 127  # full-scale sample: the narrow accumulator overflows on it
    outputs, stats = run_stream_batch(stream, {"ifm": batch}, config)
    singles = [run_stream(stream, {"ifm": x}, config) for x in batch]
    for n, (out, single) in enumerate(singles):
        np.testing.assert_array_equal(outputs["ofm"][n], out["ofm"])
    assert stats.total_overflows == sum(s.total_overflows for _, s in singles)
    assert [c.cycles for c in stats.commands] == [c.cycles for c in singles[0][1].commands]
    if config.accumulator_bits == 14 and op != NpuOp.DEPTHWISE_CONV2D:
        assert stats.total_overflows > 0


def test_weights_that_differ_between_samples_run_sample_by_sample():
    """A stream whose weights come from an input buffer: each sample's MAC command uses its own."""
    rng = np.random.default_rng(6)
    custom, _ = weights_from_an_input(rng, BASE)
    x = rng.integers(-128, 128, (3, 2, 16)).astype(np.int8)
    w = rng.integers(-127, 128, (3, 4, 16)).astype(np.int8)
    outputs, _ = run_stream_batch(custom, {"ifm": x, "w": w}, BASE)
    for n in range(3):
        single, _ = run_stream(custom, {"ifm": x[n], "w": w[n]}, BASE)
        np.testing.assert_array_equal(outputs["ofm"][n], single["ofm"])
    assert not np.array_equal(outputs["ofm"][0], run_stream(custom, {"ifm": x[0], "w": w[1]}, BASE)[0]["ofm"])


@pytest.mark.parametrize("layout,kernel_layout,groups,kwargs", [
    ("NCHW", "OIHW", 1, dict(strides=[2, 2], padding=[0, 1, 1, 0])),
    ("NCHW", "OIHW", 1, dict(strides=[1, 1], padding=[0, 0, 0, 0])),
    ("NCHW", "OIHW", 6, dict(strides=[2, 1], padding=[1, 1, 1, 1], dilation=[1, 2])),
    ("NHWC", "HWIO", 1, dict(strides=[1, 1], padding=[1, 1, 1, 1], dilation=[2, 2])),
    ("NHWC", "HWOI", 6, dict(strides=[2, 2], padding=[1, 1, 1, 1]))])
def test_numpy_float_layers_agree_with_tvm(layout, kernel_layout, groups, kwargs):
    from float_models import float_conv_block
    from npu_backend.quantization.layers import cut_layers
    from npu_backend.quantization.steps import FloatLayers

    rng = np.random.default_rng(8)
    channels, out = 6, 12 if groups > 1 else 10
    in_shape = (1, channels, 9, 8) if layout == "NCHW" else (1, 9, 8, channels)
    layer = cut_layers(float_conv_block(rng, layout, kernel_layout, groups, in_shape, out, **kwargs)["main"])[0][0]
    floats = FloatLayers([layer], {})
    assert floats.plans[layer.index] is not None
    samples = rng.normal(0, 1, (3, *in_shape)).astype(np.float32)
    acc, got = floats.run_batch(layer, [samples], layer.weight, layer.bias)
    tvm_layers = FloatLayers._compile([layer], {})
    for n in range(3):
        args = [tvm.runtime.tensor(samples[n]), tvm.runtime.tensor(layer.weight),
                tvm.runtime.tensor(layer.bias.reshape(layer.bias_shape))]
        want_acc, want = (t.numpy() for t in tvm_layers[f"layer_{layer.index}"](*args))
        np.testing.assert_allclose(acc[n], want_acc, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[n], want, rtol=1e-5, atol=1e-5)


def _byte_dma(src_offset, dst_offset, rows=6, src_stride=4, dst_stride=1, src=MemorySpace.DRAM,
              dst=MemorySpace.SRAM):
    return Command(Opcode.DMA_COPY, DmaCopy(src, 0, src_offset, dst, 0, dst_offset, 1, rows, src_stride, dst_stride))


def test_only_channel_by_channel_transposes_between_two_memories_are_fused():
    transpose = [_byte_dma(c, 100 + 6 * c) for c in range(4)]  # 4 channels of 6 pixels, NHWC -> planes
    assert _transpose_runs(transpose) == {0: 4}
    back = [_byte_dma(6 * c, c, src=MemorySpace.SRAM, dst=MemorySpace.DRAM, src_stride=1, dst_stride=4)
            for c in range(4)]
    assert _transpose_runs(back) == {0: 4}
    assert _transpose_runs([_byte_dma(c, 100) for c in range(4)]) == {}  # every DMA writes the same bytes
    assert _transpose_runs([_byte_dma(c, 100 + 3 * c) for c in range(4)]) == {}  # destinations interleave
    sram_to_sram = [_byte_dma(c, 100 + 6 * c, src=MemorySpace.SRAM) for c in range(4)]
    assert _transpose_runs(sram_to_sram) == {}  # a later DMA could read what an earlier one wrote
    uneven = transpose[:2] + [_byte_dma(3, 100 + 18)]
    assert _transpose_runs(uneven) == {0: 2}


def test_an_nchw_model_with_layout_transposes_runs_batched_as_per_sample():
    import npu_backend
    from npu_backend.codegen.lower import lower_module
    from simulator.isa import BufferKind

    mod = npu_backend.load_model("tests/fixtures/onnx/conv_relu_per_channel_asymmetric.onnx")
    (stream,) = lower_module(npu_backend.partition_for_npu(mod)).values()
    assert _transpose_runs(stream.commands)  # the NCHW <-> NHWC transposes are there, and fused
    (index, buf), = stream.buffers_of(BufferKind.INPUT)
    batch = np.random.default_rng(7).integers(-128, 128, (5, *buf.shape)).astype(buf.dtype)
    outputs, _ = run_stream_batch(stream, {buf.name: batch})
    for n in range(5):
        single, _ = run_stream(stream, {buf.name: batch[n]})
        for name, value in single.items():
            np.testing.assert_array_equal(outputs[name][n], value)


def test_host_quantize_and_dequantize_in_blocks_equal_the_whole_array_formulas():
    from npu_backend.quantization.rewrite import TensorQ
    from npu_backend.quantization.steps import HOST_BLOCK, dequantize_host, quantize_host

    rng = np.random.default_rng(10)
    x = (rng.standard_normal((3, HOST_BLOCK // 2 + 7)) * 6).astype(np.float32)  # blocks end mid-sample
    x[0, :8] = [0.5, 1.5, -0.5, -2.5, 1e9, -1e9, 0.0, 0.025]  # ties (half to even) and clipping
    for q in (TensorQ(0.05, -3), TensorQ(0.013, 127), TensorQ(1.0, 0)):
        want = np.clip(np.rint(x / np.float32(q.scale)) + q.zero_point, -128, 127).astype(np.int8)
        np.testing.assert_array_equal(quantize_host(x, q), want)
        back = ((want.astype(np.int32) - q.zero_point).astype(np.float32) * np.float32(q.scale)).astype(np.float32)
        np.testing.assert_array_equal(dequantize_host(want, q), back)
