"""Calibration's integer sums (npu_backend.quantization.integer_sums) against what they replace.

A quantized convolution or matmul layer is no longer lowered and simulated during calibration: its exact sums are
formed once and its NPU outputs read from them through the simulator's own register and output stage, with the
region's own record. These tests hold the outputs to the simulated stream's, byte for byte and overflow for
overflow, in every layout, rounding and accumulator mode, and the observation's reads to the arrays they stand
for.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from float_models import float_conv_block, float_dense_chain
from npu_backend import QConfig
from npu_backend.quantization import _npu_config, batched_float, calibrate, integer_sums, kernels
from npu_backend.quantization.calibrate import _weights
from npu_backend.quantization.config import ROUNDINGS
from npu_backend.quantization.integer_sums import IntegerSums, exact_bound
from npu_backend.quantization.layers import cut_layers
from npu_backend.quantization.observers import int8_summary
from npu_backend.quantization.rewrite import TensorQ
from npu_backend.quantization.steps import LayerSpec, NpuLayer, centre_host
from npu_backend.quantization.batched_float import plan_weighted
from simulator.mac_plans import exact_float_path

RNG = np.random.default_rng(5)

LAYERS = {
    "pointwise NCHW": lambda: float_conv_block(RNG, "NCHW", "OIHW", 1, (1, 16, 6, 5), 24, k=1),
    "strided NCHW": lambda: float_conv_block(RNG, "NCHW", "OIHW", 1, (1, 3, 9, 8), 10, strides=[2, 2],
                                             padding=[1, 1, 1, 1]),
    "depthwise NCHW": lambda: float_conv_block(RNG, "NCHW", "OIHW", 8, (1, 8, 7, 7), 8, padding=[1, 1, 1, 1]),
    "depthwise x2 NHWC": lambda: float_conv_block(RNG, "NHWC", "HWOI", 4, (1, 7, 6, 4), 8,
                                                  padding=[1, 1, 1, 1]),
    "NHWC dilated": lambda: float_conv_block(RNG, "NHWC", "HWIO", 1, (1, 9, 8, 6), 10, padding=[1, 1, 1, 1],
                                             dilation=[2, 2]),
    "dense": lambda: float_dense_chain([RNG.normal(0, 0.3, (40, 12))]),
    # whole blocks of 16 channels and inputs in fours: the int8 product kernel's (where the CPU has VNNI)
    "pointwise 20 to 48 NHWC": lambda: float_conv_block(RNG, "NHWC", "HWIO", 1, (1, 5, 7, 20), 48, k=1),
    "dense 36 to 32": lambda: float_dense_chain([RNG.normal(0, 0.3, (36, 32))]),
}
INT8_PRODUCT = ("pointwise 20 to 48 NHWC", "dense 36 to 32")
CONFIGS = {
    "tflite": QConfig(),
    "onnxruntime": QConfig(rounding="onnxruntime"),
    "14-bit wrap": QConfig(accumulator_bits=14),
    "14-bit saturate": QConfig(accumulator_bits=14, accumulator_overflow="saturate"),
    "per-tensor": QConfig(per_channel=False),
    "power-of-two": QConfig(power_of_two=True, rounding="onnxruntime"),
}


def _layer_and_inputs(name, samples=6):
    (layer,), folded = cut_layers(LAYERS[name]()["main"])
    shape = [int(d) for d in layer.inputs[0].ty.shape.values]
    x = RNG.integers(-128, 128, (samples, *shape)).astype(np.int8)
    return layer, folded, x


def _npu_layer(name: str, config: QConfig, output_q=TensorQ(0.08, -7)):
    """A layer's NPU form for an input with qparams (0.05, 3), and its int8 inputs centred as calibration centres
    them: (layer, x, weights, npu layer, plan, centred input)."""
    layer, folded, x = _layer_and_inputs(name)
    input_q = TensorQ(0.05, 3)
    wq = _weights(layer, config, input_q)
    npu = NpuLayer(LayerSpec(layer, folded, [input_q], output_q, wq, {}), ROUNDINGS[config.rounding],
                   _npu_config(config))
    plan = plan_weighted(layer)
    return layer, x, wq, npu, plan, centre_host(x, input_q.zero_point, plan.channels_first)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", LAYERS)
def test_outputs_from_the_sums_are_the_simulated_streams(name, config, monkeypatch):
    config = CONFIGS[config]
    layer, x, wq, npu, plan, centred = _npu_layer(name, config,
                                                  TensorQ(0.08 if config.accumulator_bits == 32 else 0.5, -7))
    assert npu.on_npu and npu.mac is not None and npu.stream is None  # partitioned, not lowered
    assert centred.largest == max(abs(int(x.min()) - 3), abs(int(x.max()) - 3))
    monkeypatch.setattr(integer_sums, "STAGE_BLOCK", 7)  # many stage calls per chunk
    sums = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest)
    got, got_overflows = sums.npu_outputs(npu.mac)
    want, want_overflows = npu.run_batch([x])  # the region lowered to a stream and simulated
    assert got.shape == want.shape and got.tobytes() == want.tobytes()
    assert got_overflows == want_overflows
    if config.accumulator_bits == 14:
        assert want_overflows > 0  # the narrow register is exercised


@pytest.mark.parametrize("config", ["tflite", "14-bit wrap"])
@pytest.mark.parametrize("name", LAYERS)
def test_sums_formed_again_at_each_read_are_the_kept_sums(name, config, monkeypatch):
    """Large sums of few products are not kept but formed again whenever they are read (the output stage, the
    observation's outputs): every read equals the kept array's, byte for byte, and their statistics too."""
    config = CONFIGS[config]
    layer, x, wq, npu, plan, centred = _npu_layer(name, config,
                                                  TensorQ(0.08 if config.accumulator_bits == 32 else 0.5, -7))
    kept = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest)
    monkeypatch.setattr(integer_sums, "formed_again", lambda *args: True)
    monkeypatch.setattr(batched_float, "CHUNK_ELEMENTS", 50)  # several chunks, several blocks each
    monkeypatch.setattr(batched_float, "BLOCK_ELEMENTS", 37)
    again = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest)
    assert kept.kept and kept._kept is not None and not again.kept and again._kept is None
    assert len(again._chunks) > 1
    for a, b in zip(kept.channel_extremes(), again.channel_extremes()):
        assert np.array_equal(a, b)
    assert np.array_equal(kept.channel_totals(), again.channel_totals())
    (want, want_overflows), (got, got_overflows) = kept.npu_outputs(npu.mac), again.npu_outputs(npu.mac)
    assert got.tobytes() == want.tobytes() and got_overflows == want_overflows
    steps_ = (np.float32(0.05) * wq.scales).astype(np.float32)
    outputs = [np.concatenate([b.copy() for b in sums.observed(wq.bias, steps_).output_batches()])
               for sums in (kept, again)]
    assert outputs[0].tobytes() == outputs[1].tobytes()
    assert again.sums.tobytes() == kept.sums.tobytes()


@pytest.mark.skipif(not kernels._vnni(), reason="the int8 product needs AVX-512 VNNI")
@pytest.mark.parametrize("name", INT8_PRODUCT)
def test_the_int8_product_kernel_forms_the_same_sums(name, monkeypatch):
    """A row-wise layer whose weights the int8 product takes forms its sums with it (kept and formed again), the
    same sums as the float32 product of the centred input, statistics, totals and NPU outputs alike."""
    layer, x, wq, npu, plan, centred = _npu_layer(name, CONFIGS["tflite"])
    monkeypatch.setattr(batched_float, "BLOCK_ELEMENTS", 250)  # blocks of 5-7 rows: a register tile and rows left
    used = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest)
    assert used._packed is not None
    monkeypatch.setattr(integer_sums, "formed_again", lambda *args: True)
    again = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest)
    with pytest.MonkeyPatch.context() as no_vnni:  # these sums alone by the float32 product, read after too
        no_vnni.setattr(kernels, "_vnni", lambda: False)
        blas = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest)
    assert again._packed is not None and blas._packed is None
    for sums in (used, again):
        assert sums.sums.tobytes() == blas.sums.tobytes()
        for a, b in zip(sums.channel_extremes(), blas.channel_extremes()):
            assert np.array_equal(a, b)
        assert np.array_equal(sums.channel_totals(), blas.channel_totals())
        assert sums.npu_outputs(npu.mac)[0].tobytes() == blas.npu_outputs(npu.mac)[0].tobytes()


def test_only_large_sums_of_few_products_are_formed_again():
    def plan_of(name):
        (layer,), _ = cut_layers(LAYERS[name]()["main"])
        return plan_weighted(layer)

    large = (100, 112, 112, 96)  # 482 MB of float32
    pointwise, depthwise, dense = plan_of("pointwise NCHW"), plan_of("depthwise NCHW"), plan_of("dense")
    assert integer_sums.formed_again(pointwise, large, 16)
    assert integer_sums.formed_again(pointwise, large, integer_sums.FORMED_AGAIN_PRODUCTS)
    assert not integer_sums.formed_again(pointwise, large, integer_sums.FORMED_AGAIN_PRODUCTS + 1)
    assert integer_sums.formed_again(depthwise, large, 960)  # 9 products, whatever its channels
    assert not integer_sums.formed_again(plan_of("strided NCHW"), large, 4)  # 3 x 3 x 4 = 36 products
    assert integer_sums.formed_again(dense, (4, integer_sums.FORMED_AGAIN_BYTES // 16), 12)
    assert not integer_sums.formed_again(dense, (4, integer_sums.FORMED_AGAIN_BYTES // 16 - 1), 12)


def test_sums_formed_without_totals_keep_their_extremes_and_outputs():
    """Without bias correction nothing reads the per-channel totals, so they are not taken: the extremes and the
    NPU's outputs are the same, and asking for the totals is an error rather than a wrong number."""
    config = CONFIGS["tflite"]
    layer, x, wq, npu, plan, centred = _npu_layer("pointwise NCHW", config, TensorQ(0.08, -7))
    full = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest)
    lean = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest, totals=False)
    for a, b in zip(full.channel_extremes(), lean.channel_extremes()):
        np.testing.assert_array_equal(a, b)
    assert full.channel_totals().shape == (full.channels,)
    with pytest.raises(ValueError, match="without their totals"):
        lean.channel_totals()
    assert full.npu_outputs(npu.mac)[0].tobytes() == lean.npu_outputs(npu.mac)[0].tobytes()


@pytest.mark.parametrize("formed_again", [False, True])
@pytest.mark.parametrize("name", ["pointwise NCHW", "depthwise NCHW", "dense"])
def test_totals_of_the_leading_samples_are_those_samples_sums(name, formed_again, monkeypatch):
    """Bias correction compares the quantized accumulators with the float model's over the samples the float model
    ran on (QConfig.reference_samples): the totals of the first k samples are those of sums formed on them alone,
    exactly, kept or formed again, and the observation's totals count k samples' accumulators, bias included."""
    config = CONFIGS["tflite"]
    layer, x, wq, npu, plan, centred = _npu_layer(name, config, TensorQ(0.08, -7))
    if formed_again:
        monkeypatch.setattr(integer_sums, "formed_again", lambda *args: True)
        monkeypatch.setattr(batched_float, "CHUNK_ELEMENTS", 50)  # several chunks of the leading samples
    lead = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest, total_samples=4)
    alone = IntegerSums(layer, plan, centred.values[:4], wq.weight, 3, centred.largest)
    whole = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest)
    assert lead.kept is not formed_again and lead.total_samples == 4 and len(centred.values) == 6
    want = alone.channel_totals()
    assert np.array_equal(lead.channel_totals(), want)
    assert not np.array_equal(whole.channel_totals(), want)  # the other two samples count there
    assert lead.totalled == alone.per_channel  # every accumulator of the 4 samples, per channel
    steps_ = (np.float32(0.05) * wq.scales).astype(np.float32)
    (got,), (expected,) = lead.observed(wq.bias, steps_).accumulator_sums(4), \
        alone.observed(wq.bias, steps_).accumulator_sums()
    assert np.array_equal(got, expected)
    with pytest.raises(ValueError, match="totalled over 4 samples"):
        lead.observed(wq.bias, steps_).accumulator_sums(6)
    for count in (0, 7):  # of none, or of more samples than the sums hold: refused, not a wrong count
        with pytest.raises(ValueError, match=f"totals of {count} samples asked of sums of 6"):
            IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest, total_samples=count)


def test_the_default_stage_takes_the_sums_as_they_are(monkeypatch):
    # TFLite's rounding with 32-bit accumulators: the simulator's float64 requantizer with the bias folded in reads
    # the sums themselves (no sums + bias array, no scans); the test above holds its bytes to the stream's
    taken = []
    monkeypatch.setattr(integer_sums, "exact_float_path",
                        lambda *args: taken.append(exact_float_path(*args)) or taken[-1])
    layer, x, wq, npu, plan, centred = _npu_layer("pointwise NCHW", QConfig())
    got, overflows = IntegerSums(layer, plan, centred.values, wq.weight, 3, centred.largest).npu_outputs(npu.mac)
    assert taken == [(True, True)] and overflows == 0
    assert got.tobytes() == npu.run_batch([x])[0].tobytes()


def test_a_record_that_is_not_these_sums_is_refused():
    layer, x, wq, npu, plan, centred = _npu_layer("pointwise NCHW", QConfig())
    other = wq.weight.copy()
    other.reshape(-1)[0] ^= 1
    assert IntegerSums(layer, plan, centred.values, other, 3, centred.largest).npu_outputs(npu.mac) is None
    assert IntegerSums(layer, plan, centred.values, wq.weight, 4, centred.largest).npu_outputs(npu.mac) is None


@pytest.mark.parametrize("name", ["strided NCHW", "NHWC dilated", "dense"])
@pytest.mark.parametrize("large_bias", [False, True], ids=["float32", "float64"])
def test_the_observation_reads_what_its_outputs_hold(name, large_bias):
    layer, _, x = _layer_and_inputs(name)
    plan = plan_weighted(layer)
    weight = RNG.integers(-127, 128, layer.weight.shape).astype(np.int8)
    centred = centre_host(x, -5, plan.channels_first)
    sums = IntegerSums(layer, plan, centred.values, weight, -5, centred.largest)
    channels = sums.channels
    bias = RNG.integers(-3000, 3000, channels)
    if large_bias:  # past float32's exact range: sums + bias are formed in float64
        bias[0] = (1 << 24) - sums.bound // 2
    assert sums.exact_with(bias) is not large_bias
    steps_ = RNG.uniform(1e-4, 1e-3, channels).astype(np.float32)
    observed = sums.observed(bias, steps_)
    exact = sums.sums.astype(np.float64) + bias  # channels last
    others = tuple(range(exact.ndim - 1))
    low, high = observed.accumulator_extremes()
    assert np.array_equal(low, exact.min(axis=others) * steps_.astype(np.float64))
    assert np.array_equal(high, exact.max(axis=others) * steps_.astype(np.float64))
    (totals,) = observed.accumulator_sums()
    assert np.array_equal(totals, exact.sum(axis=others) * steps_.astype(np.float64))
    outputs = np.concatenate([b.copy() for b in observed.output_batches()])
    if large_bias:
        expected = (exact * steps_.astype(np.float64)).astype(np.float32)
    else:
        expected = exact.astype(np.float32) * steps_
    if layer.clamp is not None:
        expected = np.clip(expected, np.float32(layer.clamp[0]), np.float32(layer.clamp[1]))
    assert outputs.tobytes() == expected.astype(np.float32).tobytes()
    assert observed.output_extremes() == (float(outputs.min()), float(outputs.max()))


@pytest.mark.parametrize("name", list(LAYERS))
def test_int8_inputs_are_centred_chunk_by_chunk_as_they_are_summed(name, monkeypatch):
    """centre_host keeps the int8 bytes (channels last) and the sums subtract the zero point a chunk at a time:
    the same sums as a float32 batch centred beforehand, and the largest |x - zp| of the bytes."""
    from npu_backend.quantization import batched_float

    monkeypatch.setattr(batched_float, "CHUNK_ELEMENTS", 300)  # several chunks
    layer, _, x = _layer_and_inputs(name, samples=5)
    plan = dataclasses.replace(plan_weighted(layer), channels_first=False)
    centred = centre_host(x, -9, plan_weighted(layer).channels_first)
    assert centred.values.dtype == np.int8 and centred.zero_point == -9
    assert centred.largest == int(np.abs(x.astype(np.int64) + 9).max())
    weight = RNG.integers(-127, 128, layer.weight.shape).astype(np.float32)
    want = plan.sums(centred.values.astype(np.float32) + np.float32(9), weight)
    got = plan.sums(centred.values, weight, zero_point=-9)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("name", list(LAYERS))
def test_statistics_read_as_the_sums_form_see_every_sum_once_in_order(name, monkeypatch):
    """A row-wise layer (pointwise channels last, dense) forms its sums a block of rows at a time and hands each
    block to ``then`` while it is in cache; the others a chunk at a time. Either way the sums are those formed
    without ``then``, and ``then``'s results, in order, cover each of them once."""
    from npu_backend.quantization import batched_float

    monkeypatch.setattr(batched_float, "CHUNK_ELEMENTS", 300)  # several chunks
    monkeypatch.setattr(batched_float, "BLOCK_ELEMENTS", 48)  # several blocks a chunk (and a last short one)
    layer, _, x = _layer_and_inputs(name, samples=5)
    plan = dataclasses.replace(plan_weighted(layer), channels_first=False)
    centred = centre_host(x, 7, plan_weighted(layer).channels_first)
    weight = RNG.integers(-127, 128, layer.weight.shape).astype(np.float32)
    want = plan.sums(centred.values, weight, zero_point=7)
    got, seen = plan.sums(centred.values, weight, then=lambda block: block.copy(), zero_point=7)
    assert got.tobytes() == want.tobytes()
    channels = want.shape[-1]  # the results, in order, hold every sum once
    assert np.concatenate([b.reshape(-1, channels) for b in seen]).tobytes() == want.tobytes()
    chunk_count = len(batched_float.chunks(len(x), x[0].size))
    if name in ("pointwise NCHW", "dense", *INT8_PRODUCT):  # row-wise (a pointwise layer is summed channels last)
        assert len(seen) > chunk_count
    else:
        assert len(seen) == chunk_count
    # float32 inputs are never cut into blocks (BLAS may round a block's products otherwise): a chunk each
    floats = (centred.values.astype(np.float32) - 7) / 8
    plain = plan.sums(floats, weight / 16)
    got, seen = plan.sums(floats, weight / 16, then=lambda block: block.copy())
    assert got.tobytes() == plain.tobytes() and len(seen) == chunk_count


@pytest.mark.parametrize("shape", [(2, 7, 5, 16), (3, 11, 13, 24), (1, 1, 97, 3), (4, 9, 9, 2048), (1, 1, 1, 5)])
def test_folded_channel_statistics_are_the_plain_reductions(shape):
    """The per-channel min, max and total read the chunk as rows of several pixels (fewer, longer rows for numpy's
    reduction): the same values as reducing [R, C] along R, at any row count (a prime one folds nothing)."""
    sums = RNG.integers(-(1 << 20), 1 << 20, shape).astype(np.float32)
    rows = sums.reshape(-1, shape[-1])
    low, high, totals = integer_sums._channel_statistics(sums)
    assert np.array_equal(low, rows.min(axis=0)) and np.array_equal(high, rows.max(axis=0))
    assert totals.dtype == np.float64 and np.array_equal(totals, rows.astype(np.int64).sum(axis=0))


def test_the_exact_bound_counts_the_largest_channel_and_the_bias():
    weight = np.array([[[[1, -2], [3, 0]]], [[[-4, 4], [4, -4]]]], np.int8)  # [O=2, I=1, 2, 2]: 6 and 16
    assert exact_bound(10, weight, 0, None) == 160
    assert exact_bound(10, weight, 0, np.array([5, -9])) == 169


def test_the_int8_summary_is_the_histogram_of_the_dequantized_levels():
    values = np.concatenate([RNG.integers(-128, 128, 9999), [-128, 127]]).astype(np.int8)  # odd: a lone byte
    scale, zero_point = 0.25, -3
    summary = int8_summary(values, scale, zero_point, -31.5, 33.0)
    real = (values.astype(np.float64) - zero_point) * scale
    assert summary["count"] == values.size
    assert summary["min"] == -31.5 and summary["max"] == 33.0
    assert summary["mean"] == pytest.approx(real.mean(), rel=1e-12)
    assert summary["std"] == pytest.approx(real.std(), rel=1e-12)
    # a percentile lies within half a level of the values' own percentile
    for q in (1.0, 50.0, 99.0):
        assert abs(summary[f"p{q:g}"] - np.percentile(real, q)) <= scale
    assert int8_summary(np.zeros(0, np.int8), 1.0, 0, 0.0, 0.0) == {"count": 0}


def test_calibrating_an_nchw_model_lowers_no_mac_region(monkeypatch):
    built, read = [], []
    build, outputs = NpuLayer._build, IntegerSums.npu_outputs
    monkeypatch.setattr(NpuLayer, "_build", lambda self: (built.append(self), build(self))[1])
    monkeypatch.setattr(IntegerSums, "npu_outputs", lambda self, mac: (read.append(mac), outputs(self, mac))[1])
    model = float_conv_block(RNG, "NCHW", "OIHW", 1, (1, 3, 9, 8), 10, strides=[2, 2], padding=[1, 1, 1, 1])
    result = calibrate(model, RNG.normal(0, 1, (5, 3, 9, 8)).astype(np.float32))
    assert len(read) == 1 and not built
    test = RNG.normal(0, 1, (2, 3, 9, 8)).astype(np.float32)
    simulated = result.simulate(test)
    assert len(read) == 2 and not built  # the simulation reads the same way
    assert all(np.isfinite(s[0]).all() for s in simulated)


def test_the_int8_range_bounds_the_sums_and_the_input_is_read_only_when_a_bias_needs_it(monkeypatch):
    """A layer's sums are bounded first by the int8 range's largest |x - zp| (no pass over the input); where a
    bias would not fit under that bound, the input's own largest is read, once, and may let it fit: the sums are
    then still read exactly, never simulated for want of a tighter bound."""
    layer, folded, _ = _layer_and_inputs("pointwise NCHW")
    plan = plan_weighted(layer)
    x = RNG.integers(-7, 14, (4, *[int(d) for d in layer.inputs[0].ty.shape.values])).astype(np.int8)
    centred = centre_host(x, 3, plan.channels_first)
    assert centred.most == 131 and "largest" not in centred.__dict__  # 3 - (-128); nothing read yet
    weight = np.full(layer.weight.shape, 127, np.int8)  # 16 inputs: sums of magnitude up to 16 * 127 * |x - zp|
    bias = np.full(24, 2 ** 24 - 40_000, np.int64)  # fits beside 10 * 2032, not beside 131 * 2032
    reads = []

    def exact_largest():
        reads.append(1)
        return centred.largest

    sums = IntegerSums(layer, plan, centred.values, weight, 3, centred.most, exact_largest=exact_largest)
    assert sums.exact_with(None) and not reads  # the int8 range's bound suffices: the input is not read
    assert sums.exact_with(bias) and reads == [1] and centred.largest == 10
    assert sums.exact_with(bias) and reads == [1]  # the tight bound is kept
    loose = IntegerSums(layer, plan, centred.values, weight, 3, centred.most)
    assert not loose.exact_with(bias)  # without the input's own largest the bias would not fit
    assert sums.sums.tobytes() == loose.sums.tobytes()  # the bound chooses paths, never values
