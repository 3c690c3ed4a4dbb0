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


REQUANTIZERS = {  # (output zero point, act_min, act_max, output scale): no clamp, ReLU, ReLU6-like, a narrow one
    "full range": (-5, -128, 127, 0.1),
    "relu": (-128, -128, 127, 0.05),
    "relu6": (-128, -128, -128 + 60, 0.1),
    "clamp above zero": (10, 20, 100, 0.02),
    "tiny scale": (3, -128, 127, 40.0),  # right shifts: the nudge below 1/2 matters
}


@pytest.mark.parametrize("case", REQUANTIZERS)
@pytest.mark.parametrize("channels", [8, 24, 64])
def test_requantize_is_the_simulators_float64_stage(case, channels):
    from simulator.numerics import conv_multipliers, float64_requantizer

    zero_point, low, high, output_scale = REQUANTIZERS[case]
    rng = np.random.default_rng(channels)
    weight_scales = rng.uniform(0.001, 0.02, channels).astype(np.float32)
    multipliers, shifts = conv_multipliers(0.05, weight_scales, output_scale)
    requantizer = float64_requantizer(multipliers, shifts, zero_point, low, high,
                                      rng.integers(-5000, 5000, channels))
    limit = min(int(requantizer.limit), 2 ** 24 - 1)  # float32 sums are exact integers up to 2**24
    assert limit > 1000
    sums = rng.integers(-limit, limit + 1, (300, channels)).astype(np.float32)
    sums[0], sums[1] = limit, -limit  # the exact range's ends
    sums[2] = 0
    want = np.empty(sums.shape, np.int8)
    requantizer.apply(sums, want)
    got = np.full(sums.shape, 77, np.int8)
    kernels.requantize(sums, requantizer, got)
    np.testing.assert_array_equal(got, want)
    assert len(np.unique(want)) > 2  # the stage is exercised, not saturated to one value


def test_requantize_takes_whole_vectors_of_channels():
    assert kernels.requantize_applies(8) and kernels.requantize_applies(1000)
    assert not kernels.requantize_applies(10) and not kernels.requantize_applies(3)


def _order_sensitive(rng, shape) -> np.ndarray:
    """float32 values from 2**-40 to 2**40 in magnitude: their float64 total depends on the order of the
    additions (normal values of one scale would be exact in any order)."""
    return (rng.choice([-1.0, 1.0], shape) * np.exp2(rng.uniform(-40, 40, shape))).astype(np.float32)


def _row_by_row(values: np.ndarray) -> np.ndarray:
    rows = values.reshape(-1, values.shape[-1]).astype(np.float64)
    total = np.zeros(rows.shape[1])
    for row in rows:
        total += row
    return total


@pytest.mark.parametrize("clamp", [(-np.inf, np.inf), (0.0, np.inf), (0.0, 6.0)], ids=["none", "relu", "relu6"])
@pytest.mark.parametrize("shape", [(1, 8), (97, 16), (3, 5, 4, 96), (0, 24)])
def test_finish_rows_is_numpys_bias_totals_and_clamp(shape, clamp):
    """One pass: ``values + bias`` in float32, its float64 totals row after row, then numpy's clamp (a NaN stays
    NaN), bit for bit as numpy's three passes give them."""
    rng = np.random.default_rng(shape[-1] + len(shape))
    values = _order_sensitive(rng, shape)
    bias = rng.normal(0, 2, shape[-1]).astype(np.float32)
    if values.size:
        values.reshape(-1)[::7] = np.nan  # NaN past every clamp
        values.reshape(-1)[3::11] = 7.5
    want = values + bias
    want_totals = _row_by_row(want)
    want = np.clip(want, np.float32(clamp[0]), np.float32(clamp[1]))
    got = values.copy()
    bias.flags.writeable = False  # a read-only bias is copied, not refused
    totals = kernels.finish_rows(got, bias, *clamp)
    assert got.tobytes() == want.tobytes()
    np.testing.assert_array_equal(totals, want_totals)  # NaN where numpy's is
    assert totals[~np.isnan(totals)].tobytes() == want_totals[~np.isnan(want_totals)].tobytes()


@pytest.mark.parametrize("clamp", [(-np.inf, np.inf), (0.0, np.inf), (-0.0, 6.0), (-6.0, 6.0), (6.0, 6.0)])
def test_finish_rows_clamps_special_values_as_numpy_does(clamp):
    """Infinities, signed zeros, values on a bound and next to it, NaN: as ``np.clip`` gives them (a zero's sign
    aside, on which numpy's own loops disagree)."""
    special = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 6.0, -6.0, np.nextafter(np.float32(6), 7),
                        np.nextafter(np.float32(6), 5), 7.5, -1.0, 3.4e38, -3.4e38, 1e-45, -1e-45, 2.0],
                       np.float32)
    values = np.tile(special, (3, 1)).reshape(6, 8)
    for bias in (np.zeros(8, np.float32), np.full(8, -0.0, np.float32)):
        got = values.copy()
        kernels.finish_rows(got, bias, *clamp)
        np.testing.assert_array_equal(got, np.clip(values + bias, np.float32(clamp[0]), np.float32(clamp[1])))


@pytest.mark.parametrize("clamp", [(0.0, np.nan), (np.nan, 6.0)])
def test_a_nan_bound_is_left_to_numpy(clamp):
    assert not kernels.finish_rows_applies(np.zeros((2, 8), np.float32), *clamp)
    assert kernels.finish_rows_applies(np.zeros((2, 8), np.float32), 0.0, 6.0)


@pytest.mark.parametrize("shape", [(1, 8), (1001, 16), (2, 3, 3, 160)])
def test_channel_totals_are_the_row_by_row_float64_sums(shape):
    values = _order_sensitive(np.random.default_rng(len(shape)), shape)
    want = _row_by_row(values)
    assert kernels.channel_totals(values).tobytes() == want.tobytes()
    assert want.tobytes() == values.reshape(-1, shape[-1]).astype(np.float64).sum(axis=0).tobytes()
    if shape[0] > 1000:  # the test sees the order: backwards, the same values total otherwise
        assert _row_by_row(values.reshape(-1, shape[-1])[::-1]).tobytes() != want.tobytes()


def test_the_channel_kernels_take_contiguous_writable_float32_in_whole_vectors():
    values = np.zeros((4, 16), np.float32)
    assert kernels.channels_apply(values)
    assert not kernels.channels_apply(np.zeros((4, 12), np.float32))  # not whole vectors
    assert not kernels.channels_apply(np.zeros((4, 16), np.float64))
    assert not kernels.channels_apply(np.zeros((8, 16), np.float32)[::2])  # strided
    values.flags.writeable = False
    assert not kernels.channels_apply(values)


@pytest.mark.parametrize("size", [1, 7, 8, 9, 100_003])
def test_energies_dequantize_as_the_host_does(size):
    """Against the host's own dequantized values the noise is exactly zero (each value dequantized bit for bit as
    the host does), and against a float reference both sums are numpy's float64 ones up to their order."""
    from npu_backend.quantization.rewrite import TensorQ
    from npu_backend.quantization.steps import dequantize_host

    rng = np.random.default_rng(size)
    q = TensorQ(0.0473, -7)
    values = rng.integers(-128, 128, size).astype(np.int8)
    exact = dequantize_host(values, q)
    signal, noise = kernels.energies(exact, values, q.scale, q.zero_point)
    assert noise == 0.0
    assert signal == pytest.approx(float(np.dot(exact.astype(np.float64), exact.astype(np.float64))), rel=1e-12)
    reference = (exact + rng.normal(0, 0.02, size)).astype(np.float32)
    signal, noise = kernels.energies(reference, values, q.scale, q.zero_point)
    wide = reference.astype(np.float64)
    difference = wide - exact.astype(np.float64)
    assert signal == pytest.approx(float(np.dot(wide, wide)), rel=1e-12)
    assert noise == pytest.approx(float(np.dot(difference, difference)), rel=1e-12)
    assert noise > 0


def _depthwise_case(channels, size, stride, dilation=1, kernel=3, padding=None, samples=2, seed=0):
    from simulator.isa import Convolution, FeatureMap

    pt, pl, pb, pr = padding if padding is not None else (dilation * (kernel // 2),) * 4
    oh = (size + pt + pb - dilation * (kernel - 1) - 1) // stride + 1
    ow = (size + 2 + pl + pr - dilation * (kernel - 1) - 1) // stride + 1  # width = size + 2: not square
    conv = Convolution(ifm=FeatureMap(0, size, size + 2, channels), ofm=FeatureMap(0, oh, ow, channels),
                       weights_address=0, scale_bias_address=0, kernel=(kernel, kernel), stride=(stride, stride),
                       dilation=(dilation, dilation), padding=(pt, pl, pb, pr))
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((samples, size, size + 2, channels)) * 3).astype(np.float32)
    x[x < -2] = 0.0
    x[x > 2.5] = -0.0  # signed zeros: a sum of products starts at +0.0 as numpy's does
    w = rng.standard_normal((channels, kernel, kernel)).astype(np.float32)
    w[0] = -0.0
    return conv, x, w


needs_x86 = pytest.mark.skipif(not kernels.depthwise_applies(8, 1), reason="the depthwise kernel needs x86's -fma")


@needs_x86
@pytest.mark.parametrize("channels, size, stride, dilation, kernel, padding", [
    (8, 12, 1, 1, 3, None), (16, 13, 2, 1, 3, None), (24, 11, 2, 1, 3, (0, 0, 1, 1)), (13, 10, 1, 1, 3, None),
    (3, 9, 1, 1, 3, None), (40, 15, 3, 1, 5, None), (8, 14, 1, 2, 3, None), (19, 12, 2, 2, 3, (2, 1, 0, 3)),
    (8, 7, 1, 1, 1, (0, 0, 0, 0))],
    ids=lambda v: str(v))
def test_depthwise_is_the_einsum_bit_for_bit(channels, size, stride, dilation, kernel, padding):
    """Float32 sums in numpy's order and rounding (no fused multiply-add), every stride, dilation, kernel size,
    a channel count that is not whole vectors, and signed zeros."""
    from simulator.macs import centred_input, depthwise_sums

    conv, x, w = _depthwise_case(channels, size, stride, dilation, kernel, padding)
    padded = centred_input(x, 0, conv.padding, np.float32)
    out = np.empty((len(x), conv.ofm.height, conv.ofm.width, channels), np.float32)
    kernels.depthwise(x, w, conv, out)  # the unpadded input: the kernel pads as it reads
    assert out.tobytes() == depthwise_sums(padded, w, conv).tobytes()
    # int8 input, centred by its zero point as it is read: the padded float32 copy's sums, bit for bit
    q = np.clip(np.round(x * 40), -128, 127).astype(np.int8)
    kernels.depthwise(q, w, conv, out, zero_point=-5)
    assert out.tobytes() == depthwise_sums(centred_input(q, -5, conv.padding, np.float32), w, conv).tobytes()


def test_the_depthwise_interior_is_every_output_whose_taps_miss_the_padding():
    """The outputs the kernel reads unchecked, against every output's taps, for sizes that leave no interior,
    one output, or all of them."""
    for size, kernel, stride, dilation, before, after in [(12, 3, 1, 1, 1, 1), (13, 3, 2, 1, 1, 1), (5, 3, 1, 3, 2, 2),
                                                          (2, 5, 1, 1, 2, 2), (9, 1, 1, 1, 0, 0), (11, 3, 2, 2, 0, 3),
                                                          (7, 3, 3, 1, 4, 0), (1, 3, 1, 1, 1, 1)]:
        outputs = (size + before + after - (kernel - 1) * dilation - 1) // stride + 1
        inside = [o for o in range(outputs)
                  if all(0 <= o * stride - before + k * dilation < size for k in range(kernel))]
        first, end = kernels._inner(size, outputs, kernel, stride, dilation, before)
        assert list(range(first, end)) == inside, (size, kernel, stride, dilation, before, after)


@needs_x86
def test_depthwise_sums_of_integers_are_exact():
    from simulator.macs import centred_input

    conv, _, _ = _depthwise_case(32, 16, 2, samples=3)
    rng = np.random.default_rng(5)
    x = rng.integers(-128, 128, (3, 16, 18, 32)).astype(np.int8)
    w = rng.integers(-127, 128, (32, 3, 3)).astype(np.int8)
    out = np.empty((3, conv.ofm.height, conv.ofm.width, 32), np.float32)
    kernels.depthwise(x, w.astype(np.float32), conv, out, zero_point=-7)
    assert "depthwise_3x3_integers_16" in kernels._compiled  # exact in any order: compiled with FMA, 16 lanes
    wide = centred_input(x, -7, conv.padding, np.int64)
    with pytest.raises(ValueError, match="int8 inputs only"):
        kernels.depthwise(x.astype(np.float32), w.astype(np.float32), conv, out, zero_point=-7)
    with pytest.raises(ValueError, match="int8 or float32"):
        kernels.depthwise(x.astype(np.int16), w.astype(np.float32), conv, out)
    frozen = x.copy()
    frozen.setflags(write=False)  # DLPack refuses a read-only view: the kernel reads a copy
    again = np.empty_like(out)
    kernels.depthwise(frozen[:, :, ::-1][:, :, ::-1], w.astype(np.float32), conv, again, zero_point=-7)
    assert again.tobytes() == out.tobytes()
    want = np.zeros(out.shape, np.int64)
    for ky in range(3):
        for kx in range(3):
            window = wide[:, ky:ky + 2 * (conv.ofm.height - 1) + 1:2, kx:kx + 2 * (conv.ofm.width - 1) + 1:2]
            want += window * w[:, ky, kx]
    np.testing.assert_array_equal(out.astype(np.int64), want)


def test_depthwise_is_for_one_input_channel_per_output_and_two_channels_or_more():
    assert not kernels.depthwise_applies(8, 2)
    assert kernels.depthwise_applies(8, 1) == kernels.depthwise_applies(2, 1) == (kernels._NO_FMA is not None)
    assert not kernels.depthwise_applies(1, 1)  # numpy's einsum sums a single channel's taps in another order


@needs_x86
def test_one_channel_goes_to_the_einsum_whose_order_the_kernel_does_not_follow():
    """The reason for the rule above, measured: a one-channel depthwise convolution's einsum adds its taps in
    another order than the kernel, so some float32 sums differ in their last bits."""
    from simulator.macs import centred_input, depthwise_sums

    from simulator.isa import Convolution, FeatureMap

    conv = Convolution(ifm=FeatureMap(0, 4, 13, 1), ofm=FeatureMap(0, 3, 12, 1), weights_address=0,
                       scale_bias_address=0, kernel=(5, 5), stride=(2, 1), dilation=(1, 1), padding=(2, 1, 1, 2))
    differing = 0
    for seed in range(10):
        rng = np.random.default_rng(seed)
        x = (rng.standard_normal((1, 4, 13, 1)) * 100).astype(np.float32)
        padded = centred_input(x, 0, conv.padding, np.float32)
        w = rng.standard_normal((1, 5, 5)).astype(np.float32)
        out = np.empty((1, 3, 12, 1), np.float32)
        kernels.depthwise(x, w, conv, out)
        differing += out.tobytes() != depthwise_sums(padded, w, conv).tobytes()
    assert differing


def test_compiling_a_kernel_keeps_no_frame_of_its_caller():
    """TVMScript's parser keeps the defining code's stack in reference cycles; a kernel compiled at first use must
    not keep the caller's frames (a calibration layer's batch-sized arrays) alive until the cyclic collector
    runs, nor hide a compilation error."""
    import gc
    import weakref

    class Marker:
        pass

    def caller():
        marker = Marker()  # a local of a frame on the stack that asks for the kernel
        kernels._kernel("test_depthwise_1x2", lambda: kernels._depthwise_func(1, 2, "float32"))
        return weakref.ref(marker)

    kernels._compiled.pop("test_depthwise_1x2", None)
    gc.disable()
    try:
        ref = caller()
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()
        kernels._compiled.pop("test_depthwise_1x2", None)

    def broken():
        raise ValueError("no such kernel")

    with pytest.raises(ValueError, match="no such kernel"):
        kernels._kernel("test_broken", broken)
    assert "test_broken" not in kernels._compiled


@pytest.mark.skipif(not kernels.integer_statistics_applies(np.zeros((1, 8), np.float32)),
                    reason="the compiled statistics need AVX-512")
@pytest.mark.parametrize("rows, channels", [(1, 8), (3, 16), (4, 24), (7, 96), (1001, 16), (64, 960)])
def test_integer_statistics_are_numpys_min_max_and_totals(rows, channels):
    """The integer sums' per-channel extremes and float64 totals in one compiled pass: every row counted, whatever
    the rows left over by the interleaved accumulators, bit for bit."""
    values = np.random.default_rng(rows).integers(-2 ** 23, 2 ** 23, (rows, channels)).astype(np.float32)
    low, high, totals = kernels.integer_statistics(values, totals=True)
    np.testing.assert_array_equal(low, values.min(axis=0))
    np.testing.assert_array_equal(high, values.max(axis=0))
    np.testing.assert_array_equal(totals, values.astype(np.float64).sum(axis=0))
    assert low.dtype == high.dtype == np.float32 and totals.dtype == np.float64
    alone = kernels.integer_statistics(values, totals=False)
    assert len(alone) == 2 and np.array_equal(alone[0], low) and np.array_equal(alone[1], high)
    assert not kernels.integer_statistics_applies(np.ascontiguousarray(values[:, :channels - 1]))  # not whole vectors
    assert not kernels.integer_statistics_applies(values[:0])


@pytest.mark.parametrize("avx512", [True, False])
def test_exact_kernels_use_avx512_only_where_the_cpu_has_it(monkeypatch, avx512):
    """The kernels exact in any order are compiled with every feature of the CPU, but AVX-512 only where the
    running CPU has it (its flags, not its model's name: a virtual machine may hide it); the others never use FMA."""
    targets = {}
    monkeypatch.setattr(kernels, "_avx512", lambda: avx512)
    monkeypatch.setattr(kernels.kernel_cache, "compiled", lambda name, module, target: targets.setdefault(name, target))
    kernels._compile("exact", kernels._requantize_func, any_order=True)
    kernels._compile("rounded", kernels._energies_func)
    exact, rounded = (list(targets[n].attrs.get("mattr", [])) for n in ("exact", "rounded"))
    if kernels._NO_FMA is None:
        assert exact == rounded == []
    else:
        assert exact == ([] if avx512 else ["-avx512f"]) and rounded == kernels._NO_FMA


needs_vnni = pytest.mark.skipif(not kernels._vnni(), reason="the int8 product needs AVX-512 VNNI")


@needs_vnni
@pytest.mark.parametrize("rows, depth, channels", [
    (1, 4, 16), (3, 12, 16), (4, 16, 64), (5, 20, 48), (9, 36, 80), (13, 96, 144), (0, 8, 32), (37, 1280, 16)])
def test_int8_matmul_is_the_float32_product_of_the_centred_input(rows, depth, channels):
    """Every row tile and channel block, with the rows, blocks and input groups left over by the register tile
    (4 rows, 4 blocks of 16 channels, 4 groups of 4 inputs chained), against the float32 product the sums were
    formed by before: equal where every sum is an integer below 2**24, as the integer sums' are."""
    rng = np.random.default_rng(rows * 1000 + depth + channels)
    for zero_point in (-128, -5, 0, 127):
        x = rng.integers(-128, 128, (rows, depth)).astype(np.int8)
        w = rng.integers(-128, 128, (depth, channels)).astype(np.float32)
        out = np.full((rows, channels), np.nan, np.float32)
        kernels.int8_matmul(x, kernels.int8_weights(w, zero_point), out)
        np.testing.assert_array_equal(out, (x.astype(np.float32) - np.float32(zero_point)) @ w)


@needs_vnni
def test_int8_matmul_at_the_extremes():
    """The largest products of both signs: x = -128 or 127 less a zero point of 127 or -128, w = -128 or 127."""
    depth, channels = 64, 32
    for x_value, zero_point, w_value in [(-128, 127, -128), (127, -128, 127), (-128, 127, 127), (127, -128, -128)]:
        x = np.full((6, depth), x_value, np.int8)
        w = np.full((depth, channels), w_value, np.float32)
        out = np.empty((6, channels), np.float32)
        kernels.int8_matmul(x, kernels.int8_weights(w, zero_point), out)
        assert (out == depth * (x_value - zero_point) * w_value).all()
    wide = np.zeros((6, 2 * channels), np.float32)
    with pytest.raises(ValueError, match="contiguous"):  # a view that reshaping would copy: never written
        kernels.int8_matmul(x, kernels.int8_weights(w, zero_point), wide[:, :channels])
    assert not wide.any()


def test_int8_weights_only_where_the_kernel_takes_them(monkeypatch):
    w = np.random.default_rng(0).integers(-128, 128, (8, 32)).astype(np.float32)
    monkeypatch.setattr(kernels, "_vnni", lambda: True)
    packed = kernels.int8_weights(w, 3)
    assert packed.depth == 8 and packed.channels == 32 and packed.packed.dtype == np.int8
    np.testing.assert_array_equal(packed.correction.reshape(-1), (128 + 3) * w.astype(np.int64).sum(axis=0))
    # channel n's inputs 4q..4q+3 sit together, as the byte dot product reads them
    assert list(packed.packed[1, 1, 4 * 5:4 * 5 + 4]) == list(w[4:8, 16 + 5].astype(np.int8))
    assert kernels.int8_weights(w[:6], 3) is None  # inputs not a multiple of 4
    assert kernels.int8_weights(w[:, :24], 3) is None  # channels not whole blocks of 16
    assert kernels.int8_weights(w + 0.5, 3) is None  # not integers
    assert kernels.int8_weights(np.where(w > 100, 128.0, w).astype(np.float32), 3) is None  # past int8
    monkeypatch.setattr(kernels, "_vnni", lambda: False)
    assert kernels.int8_weights(w, 3) is None  # a machine without VNNI


def test_the_int8_product_is_compiled_with_the_features_it_was_checked_for(monkeypatch):
    targets = {}
    monkeypatch.setattr(kernels.kernel_cache, "compiled", lambda name, module, target: targets.setdefault(name, target))
    kernels._compile("vnni", kernels._int8_matmul_func, any_order=True, features=("+avx512vnni", "+avx512bw"))
    assert list(targets["vnni"].attrs.get("mattr", []))[-2:] == ["+avx512vnni", "+avx512bw"]
