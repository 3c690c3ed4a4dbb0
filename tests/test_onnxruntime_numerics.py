"""``Rounding.ONNXRUNTIME`` against onnxruntime's own outputs, tolerance zero.

The oracle, tests/fixtures/oracle/onnxruntime_ops.npz, holds onnxruntime's
results of one-operator QDQ graphs (scripts/make_ort_oracle.py; the tests
never import onnxruntime). Each operator is checked twice: the numerics
function, and the simulator running the command the compiler emits for it,
from serialized bytes and on a small SRAM that forces tiling. The MAC
array's output stage, which is not onnxruntime's float32 FMA chain, is
checked against exact fractions instead.

Where the tie-prone cases make a naive formula fail (the exact result rounded
half to even, a sequential float32 sum, numpy's float64 sigmoid), the test
says so, so a passing test is known to discriminate.
"""

import dataclasses
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

import reference_kernels as ref
from npu_backend.codegen.emit import StreamBuilder
from npu_backend.codegen.lower import lower_layer
from npu_backend.ops import op_def
from npu_backend.errors import UnsupportedOpError
from npu_backend.params import ElementwiseParams, LutParams, MeanParams, NpuOp, PoolParams
from simulator import (BufferKind, CommandStream, NumericsError, Opcode, Rounding, encode_stream, get_config,
                       run_stream)
from simulator import mlas, numerics, onnxruntime_numerics

ORACLE_PATH = Path(__file__).parent / "fixtures" / "oracle" / "onnxruntime_ops.npz"
BASE = get_config("npu-256")
TINY_SRAM = dataclasses.replace(BASE, sram_bytes=1024)
GRID = np.meshgrid(np.arange(-128, 128), np.arange(-128, 128), indexing="ij")
ORT = Rounding.ONNXRUNTIME


@pytest.fixture(scope="module")
def oracle():
    with np.load(ORACLE_PATH) as data:
        return dict(data)


def _run_lowered(p, inputs: dict, out_shape, config):
    """Lower one record with the compiler's emitter, serialize, run; the output and the run statistics."""
    sb = StreamBuilder(config)
    sources = [sb.add_buffer(name, BufferKind.INPUT, value.shape) for name, value in inputs.items()]
    dst = sb.add_buffer("ofm", BufferKind.OUTPUT, out_shape)
    lower_layer(sb, p, f"{p.op.value}_0", sources, dst)
    stream = CommandStream("layer", config, tuple(sb.buffers), tuple(sb.commands))
    outputs, stats = run_stream(encode_stream(stream), inputs, config)
    return outputs["ofm"], stats


# ---------------------------------------------------------------------------------------------- quantize / dequantize

def test_quantize_linear_divides_in_float32_and_rounds_half_to_even():
    values = np.array([0.5, 1.5, 2.5, -1.5, -2.5, 127.5, -129.5, 1e30, -1e30, 0.0], np.float32)
    assert onnxruntime_numerics.quantize_linear(values, 1.0, 0).tolist() == [0, 2, 2, -2, -2, 127, -128, 127, -128, 0]
    # the zero point is added after rounding: rint(-1.5) + 3 = 1, where rint(-1.5 + 3) would be 2
    assert onnxruntime_numerics.quantize_linear(np.float32(-1.5), 1.0, 3) == 1
    # a true float32 division: x / s is -127.49999, where x * (1 / s) rounds to -127.5 and then to -128
    x, s = np.float32(-5.4952497482299805), np.float32(0.0431)
    assert np.rint(x * (np.float32(1) / s)) == -128
    assert onnxruntime_numerics.quantize_linear(x, s, 0) == -127


def test_dequantize_linear_is_one_float32_product():
    q = np.arange(-128, 128)
    got = onnxruntime_numerics.dequantize_linear(q, 0.0431, 17)
    want = [ref.onnxruntime_dequantize(int(v), float(np.float32(0.0431)), 17) for v in q]
    assert got.dtype == np.float32 and got.tolist() == want


@pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), float("inf")])
def test_quantize_and_dequantize_refuse_bad_scales(scale):
    with pytest.raises(NumericsError, match="scale must be positive and finite"):
        onnxruntime_numerics.quantize_linear(np.zeros(2, np.float32), scale, 0)
    with pytest.raises(NumericsError, match="scale must be positive and finite"):
        onnxruntime_numerics.dequantize_linear(np.zeros(2, np.int8), scale, 0)


def _float32_nearest(value: Fraction) -> np.float32:
    """The float32 nearest to an exact value, ties to even (checked among the neighbours of a first guess)."""
    guess = np.float32(float(value))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(c.view(np.uint32)) & 1))


def test_fma32_rounds_once():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(2000).astype(np.float32), rng.standard_normal(2000).astype(np.float32)
    c = -(a.astype(np.float64) * b).astype(np.float32)      # c = -round(a*b): the exact residue remains
    got = mlas.fma32(a, b, c)
    want = [_float32_nearest(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)]
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    # a*b = 2**-24 - 2**-70 and c = 1 + 2**-23: the float64 sum is exactly a float32 midpoint, which would
    # round to even (1 + 2**-22); the exact value lies below it
    a, b, c = np.float32(2.0 ** -24 * (1 + 2.0 ** -23)), np.float32(1 - 2.0 ** -23), np.float32(1 + 2.0 ** -23)
    assert np.float32(float(a) * float(b) + float(c)) == np.float32(1 + 2.0 ** -22)
    assert mlas.fma32(a, b, c) == c


# ---------------------------------------------------------------------------------------------- ADD, SUB, MUL

BINARY = {"add": (np.add, NpuOp.ADD, Opcode.ADD), "sub": (np.subtract, NpuOp.SUBTRACT, Opcode.SUB),
          "mul": (np.multiply, NpuOp.MULTIPLY, Opcode.MUL)}
EXACT_MISSES_ON_TIE_CASE = {"add": 7188, "sub": 7211, "mul": 120}
"""What the exact real result rounded half to even gets wrong on each operator's tie-prone grid."""


def _binary_cases(oracle, op):
    for scales, zero_points, want in zip(oracle[f"{op}_scales"], oracle[f"{op}_zero_points"], oracle[f"{op}_outputs"]):
        (s1, s2, so), (z1, z2, zo) = (float(s) for s in scales), (int(z) for z in zero_points)
        yield (s1, z1, s2, z2, so, zo), want


@pytest.mark.parametrize("op", sorted(BINARY))
def test_elementwise_matches_onnxruntime_on_every_pair(oracle, op):
    ufunc = BINARY[op][0]
    for index, (qparams, want) in enumerate(_binary_cases(oracle, op)):
        got = onnxruntime_numerics.ort_elementwise(ufunc, GRID[0], GRID[1], *qparams)
        assert int((got != want).sum()) == 0, f"{op} case {index} {qparams}"
        if index == 0:
            s1, z1, s2, z2, so, zo = qparams
            exact = np.clip(np.rint(ufunc((GRID[0] - z1) * s1, (GRID[1] - z2) * s2) / so) + zo, -128, 127)
            assert int((exact != want).sum()) == EXACT_MISSES_ON_TIE_CASE[op]


@pytest.mark.parametrize("op", sorted(BINARY))
def test_independent_reference_matches_onnxruntime(oracle, op):
    """The loop-per-element float32 restatement agrees on a slice of every grid."""
    python_op = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}[op]
    for qparams, want in _binary_cases(oracle, op):
        rows = slice(100, 140)
        got = ref.onnxruntime_binary(python_op, GRID[0][rows].ravel().tolist(), GRID[1][rows].ravel().tolist(),
                                     *qparams, act=(-128, 127))
        assert got == want[rows].ravel().tolist()


@pytest.mark.parametrize("config", [BASE, TINY_SRAM], ids=["one_tile", "tiled"])
@pytest.mark.parametrize("op", sorted(BINARY))
def test_elementwise_kernel_matches_onnxruntime(oracle, op, config):
    _, npu_op, opcode = BINARY[op]
    (qparams, want), *_ = _binary_cases(oracle, op)   # the tie-prone case
    s1, z1, s2, z2, so, zo = qparams
    p = ElementwiseParams(op=npu_op, shape=(256, 256), input_scale=s1, input_zero_point=z1, input2_scale=s2,
                          input2_zero_point=z2, output_scale=so, output_zero_point=zo, clamp=(-128, 127),
                          rounding=ORT)
    x1, x2 = GRID[0].astype(np.int8), GRID[1].astype(np.int8)
    got, stats = _run_lowered(p, {"ifm": x1, "ifm2": x2}, (256, 256), config)
    np.testing.assert_array_equal(got, want)
    count = [c.opcode for c in stats.commands].count(opcode)
    assert count == 1 if config is BASE else count > 1


def test_elementwise_clamp_applies_after_quantization():
    x1, x2 = GRID[0].ravel(), GRID[1].ravel()
    clamped = onnxruntime_numerics.ort_elementwise(np.add, x1, x2, 0.02, -7, 0.031, 12, 0.045, 3, act_min=3, act_max=100)
    plain = onnxruntime_numerics.ort_elementwise(np.add, x1, x2, 0.02, -7, 0.031, 12, 0.045, 3)
    np.testing.assert_array_equal(clamped, np.clip(plain, 3, 100))


# ---------------------------------------------------------------------------------------------- pooling and mean

POOLS = ("avgpool_2x2_s2", "avgpool_3x3_s1_p1", "avgpool_3x3_s3_p1", "avgpool_whole_12x12")
GLOBALS = ("global_7x7", "global_12x12", "global_13x13")


def _pool_cases(oracle, name):
    for x, want, scales, zero_points in zip(oracle[f"{name}_input"], oracle[f"{name}_output"],
                                            oracle[f"{name}_scales"], oracle[f"{name}_zero_points"]):
        yield x, want, (float(scales[0]), int(zero_points[0]), float(scales[1]), int(zero_points[1]))


def _sequential_mean(x, si, zi, so, zo):
    """A plain float32 sum in row-major order: the order onnxruntime's global kernel does NOT use."""
    values = onnxruntime_numerics.dequantize_linear(x, si, zi).reshape(-1, x.shape[-1])
    total = np.zeros(values.shape[1], np.float32)
    for row in values:
        total = total + row
    return onnxruntime_numerics.quantize_linear(total / np.float32(values.shape[0]), so, zo)


@pytest.mark.parametrize("name", POOLS)
def test_avg_pool_matches_onnxruntime(oracle, name):
    kh, kw, sh, sw, *padding = (int(v) for v in oracle[f"{name}_geometry"])
    for x, want, qparams in _pool_cases(oracle, name):
        if (kh, kw) == x.shape[:2]:   # onnxruntime's global kernel: the MEAN unit's order
            got = onnxruntime_numerics.ort_mean(x, *qparams).reshape(want.shape)
        else:
            got = onnxruntime_numerics.ort_avg_pool(x, (kh, kw), (sh, sw), tuple(padding), *qparams)
            assert got.tolist() == ref.onnxruntime_avg_pool(x.tolist(), (kh, kw), (sh, sw), padding, *qparams)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", GLOBALS)
def test_global_average_matches_onnxruntime(oracle, name):
    sequential_misses = 0
    for x, want, qparams in _pool_cases(oracle, name):
        got = onnxruntime_numerics.ort_mean(x, *qparams)
        np.testing.assert_array_equal(got, want.reshape(-1))
        assert got.tolist() == ref.onnxruntime_global_average(x.tolist(), *qparams)
        sequential_misses += int((_sequential_mean(x, *qparams) != want.reshape(-1)).sum())
    if name == "global_12x12":
        assert sequential_misses > 0, "the oracle's tie-prone 12x12 tensors must tell the lane order apart"


@pytest.mark.parametrize("config", [BASE, TINY_SRAM], ids=["one_tile", "tiled"])
@pytest.mark.parametrize("name", POOLS)
def test_avg_pool_layer_matches_onnxruntime(oracle, name, config):
    """The compiler's emit_pool with the oracle's qparams; a whole-input window is emitted as a MEAN."""
    kh, kw, sh, sw, *padding = (int(v) for v in oracle[f"{name}_geometry"])
    for x, want, (si, zi, so, zo) in _pool_cases(oracle, name):
        p = PoolParams(op=NpuOp.AVG_POOL2D, ifm_shape=(1, *x.shape), ofm_shape=(1, *want.shape), kernel=(kh, kw),
                       strides=(sh, sw), padding=tuple(padding), rounding=ORT, input_scale=si, input_zero_point=zi,
                       output_scale=so, output_zero_point=zo)
        got, stats = _run_lowered(p, {"ifm": x[None]}, p.ofm_shape, config)
        np.testing.assert_array_equal(got[0], want)
        opcodes = {c.opcode for c in stats.commands} - {Opcode.DMA_COPY}
        assert opcodes == ({Opcode.MEAN} if (kh, kw) == x.shape[:2] else {Opcode.AVG_POOL2D})


@pytest.mark.parametrize("config", [BASE, TINY_SRAM], ids=["one_tile", "tiled"])
def test_mean_layer_matches_onnxruntime(oracle, config):
    for name in GLOBALS:
        for x, want, (si, zi, so, zo) in _pool_cases(oracle, name):
            p = MeanParams(op=NpuOp.MEAN, ifm_shape=(1, *x.shape), ofm_shape=(1, x.shape[-1]), input_scale=si,
                           input_zero_point=zi, output_scale=so, output_zero_point=zo, rounding=ORT)
            got, stats = _run_lowered(p, {"ifm": x[None]}, p.ofm_shape, config)
            np.testing.assert_array_equal(got.reshape(-1), want.reshape(-1))
            count = [c.opcode for c in stats.commands].count(Opcode.MEAN)
            assert count == 1 if config is BASE else count > 1


@pytest.mark.parametrize("case", [
    dict(ifm=(1, 11, 10, 12), kernel=(3, 3), strides=(2, 2), padding=(1, 0, 1, 1)),
    dict(ifm=(1, 15, 13, 9), kernel=(2, 4), strides=(1, 2), padding=(0, 1, 1, 2)),
    dict(ifm=(1, 16, 14, 10), kernel=(3, 3), strides=(3, 3), padding=(1, 1, 1, 1)),
], ids=["3x3_s2_asym", "2x4_s1x2", "3x3_s3_generic"])
def test_avg_pool_tiles_match_independent_reference(case):
    """Shapes beyond the oracle: row stripes and channel tiles keep MLAS's per-output order."""
    from simulator.isa import conv_output_size

    rng = np.random.default_rng(sum(case["ifm"]))
    _, h, w, c = case["ifm"]
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = case["kernel"], case["strides"], case["padding"]
    ofm = (1, conv_output_size(h, kh, sh, 1, pt, pb), conv_output_size(w, kw, sw, 1, pl, pr), c)
    x = rng.integers(-128, 128, case["ifm"], dtype=np.int8)
    si, zi = float(np.float32(0.0173)), -11                # output qparams = input's: tie-prone
    p = PoolParams(op=NpuOp.AVG_POOL2D, ifm_shape=case["ifm"], ofm_shape=ofm, kernel=case["kernel"],
                   strides=case["strides"], padding=case["padding"], clamp=(-100, 120), rounding=ORT,
                   input_scale=si, input_zero_point=zi, output_scale=si, output_zero_point=zi)
    want = ref.onnxruntime_avg_pool(x[0].tolist(), p.kernel, p.strides, p.padding, si, zi, si, zi, p.clamp)
    for config in (BASE, TINY_SRAM):
        got, stats = _run_lowered(p, {"ifm": x}, ofm, config)
        assert got[0].tolist() == want
    assert sum(cmd.opcode == Opcode.AVG_POOL2D for cmd in stats.commands) > 1


def test_avg_pool_without_qparams_is_refused():
    p = PoolParams(op=NpuOp.AVG_POOL2D, ifm_shape=(1, 4, 4, 2), ofm_shape=(1, 2, 2, 2), kernel=(2, 2),
                   strides=(2, 2), padding=(0, 0, 0, 0), rounding=ORT)
    with pytest.raises(UnsupportedOpError, match="needs its qparams"):
        _run_lowered(p, {"ifm": np.zeros(p.ifm_shape, np.int8)}, p.ofm_shape, BASE)


def test_max_pool_that_would_requantize_is_refused():
    p = PoolParams(op=NpuOp.MAX_POOL2D, ifm_shape=(1, 4, 4, 2), ofm_shape=(1, 2, 2, 2), kernel=(2, 2),
                   strides=(2, 2), padding=(0, 0, 0, 0), rounding=ORT, input_scale=0.1, input_zero_point=0,
                   output_scale=0.2, output_zero_point=0)
    with pytest.raises(UnsupportedOpError, match="cannot requantize"):
        _run_lowered(p, {"ifm": np.zeros(p.ifm_shape, np.int8)}, p.ofm_shape, BASE)
    same = dataclasses.replace(p, output_scale=0.1)
    x = np.arange(32, dtype=np.int8).reshape(p.ifm_shape)
    got, _ = _run_lowered(same, {"ifm": x}, p.ofm_shape, BASE)
    np.testing.assert_array_equal(got, x.reshape(1, 2, 2, 2, 2, 2).max(axis=(2, 4)))


# ---------------------------------------------------------------------------------------------- look-up tables

UNARY = {"sigmoid": (NpuOp.SIGMOID, 0.0), "tanh": (NpuOp.TANH, 0.0), "leakyrelu": (NpuOp.LEAKY_RELU, 0.1),
         "hardswish": (NpuOp.HARD_SWISH, 0.0), "identity": (NpuOp.REQUANTIZE, 0.0)}
NUMPY_FLOAT64 = {"sigmoid": lambda x: 1 / (1 + np.exp(-x)), "tanh": np.tanh}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_tables_match_onnxruntime(oracle, op):
    npu_op, alpha = UNARY[op]
    numpy_misses = 0
    for scales, zero_points, want in zip(oracle[f"{op}_scales"], oracle[f"{op}_zero_points"], oracle[f"{op}_tables"]):
        qparams = (float(scales[0]), int(zero_points[0]), float(scales[1]), int(zero_points[1]))
        p = LutParams(op=npu_op, shape=(256,), input_scale=qparams[0], input_zero_point=qparams[1],
                      output_scale=qparams[2], output_zero_point=qparams[3], alpha=alpha, rounding=ORT)
        np.testing.assert_array_equal(op_def(p.op).prepare(p), want, err_msg=f"{op} {qparams}")
        if op in NUMPY_FLOAT64:
            numpy_misses += int((onnxruntime_numerics.qdq_table(NUMPY_FLOAT64[op], *qparams) != want).sum())
    if op in NUMPY_FLOAT64:
        assert numpy_misses > 0, "the searched cases must tell MLAS's polynomial from numpy's function"


def test_table_runs_on_the_lut_unit(oracle):
    scales, zero_points, want = (oracle[f"sigmoid_{key}"][3] for key in ("scales", "zero_points", "tables"))
    p = LutParams(op=NpuOp.SIGMOID, shape=(1, 16, 16, 1), input_scale=float(scales[0]),
                  input_zero_point=int(zero_points[0]), output_scale=float(scales[1]),
                  output_zero_point=int(zero_points[1]), rounding=ORT)
    x = np.arange(-128, 128, dtype=np.int8).reshape(p.shape)
    got, _ = _run_lowered(p, {"ifm": x}, p.shape, BASE)
    np.testing.assert_array_equal(got.reshape(-1), want)


# ---------------------------------------------------------------------------------------------- MAC output stage

def _fraction_reference(accs, scales, zp, act):
    return [min(max(round(Fraction(int(a)) * Fraction(float(s))) + zp, act[0]), act[1])   # round(): half to even
            for a, s in zip(accs, scales)]


def test_mac_output_stage_is_exact_product_rounded_half_to_even():
    rng = np.random.default_rng(21)
    scales = numerics.float_scales(0.0123, rng.uniform(0.001, 0.05, 64).astype(np.float32), 0.071)
    accs = rng.integers(-60000, 60000, (500, 64))
    got = numerics.requantize_float(accs, scales, -3, -128, 127, Rounding.ONNXRUNTIME)
    want = [_fraction_reference(row, scales, -3, (-128, 127)) for row in accs]
    np.testing.assert_array_equal(got, want)


def test_mac_output_stage_ties():
    """Exact ties round to even (FLOAT64 rounds them away); near ties the double product rounds onto
    are decided by the exact product."""
    odd = np.arange(-21, 23, 2)
    half_even = numerics.requantize_float(odd, np.full(odd.shape, 0.5), 0, -128, 127, Rounding.ONNXRUNTIME)
    half_away = numerics.requantize_float(odd, np.full(odd.shape, 0.5), 0, -128, 127, Rounding.FLOAT64)
    np.testing.assert_array_equal(half_even, 2 * np.round(odd / 4))
    differ = (np.abs(odd) // 2) % 2 == 0                       # +-(k + 1/2) with k even: half away goes past k
    np.testing.assert_array_equal(half_even != half_away, differ)
    rng = np.random.default_rng(5)
    accs = rng.integers(3, 1 << 30, 4000) | 1
    targets = rng.integers(0, 100, 4000) + 0.5
    scales = targets / accs                                  # acc * scale is within a rounding of k + 1/2
    double_ties = accs * scales == targets
    exact = _fraction_reference(accs, scales, 0, (-1 << 40, 1 << 40))
    naive = np.rint(accs * scales)
    assert np.sum(double_ties & (naive != exact)) > 100      # the double product alone would be wrong there
    got = numerics.requantize_float(accs, scales, 0, -128, 127, Rounding.ONNXRUNTIME)
    np.testing.assert_array_equal(got, np.clip(exact, -128, 127))


def test_conv_layer_with_onnxruntime_rounding():
    """Through the compiler and the MAC array: power-of-two scales put exact ties on some channels."""
    from layer_streams import random_params, run_layer

    rng = np.random.default_rng(13)
    p = random_params(rng, NpuOp.CONV2D, (1, 7, 6, 3), out_channels=6)
    weight_scales = np.array([2 ** -4, 2 ** -5, 0.0071, 2 ** -3, 0.013, 2 ** -6], np.float32)
    p = dataclasses.replace(p, input_scale=2 ** -2, output_scale=2 ** -3, weight_scales=weight_scales,
                            weights=rng.integers(-1, 2, p.weights.shape).astype(np.int8),
                            bias=rng.integers(-50, 50, 6).astype(np.int32), rounding=ORT)
    x = rng.integers(-128, 128, p.ifm_shape, dtype=np.int8)
    want = ref.conv2d_onnxruntime(x[0].tolist(), p.weights.tolist(), p.bias.tolist(), p.input_scale,
                                  weight_scales.tolist(), p.output_scale, p.input_zero_point, p.output_zero_point,
                                  p.clamp, p.strides, p.dilation, p.padding)
    for config in (BASE, TINY_SRAM):
        got, _ = run_layer(p, config, x)
        np.testing.assert_array_equal(got[0], np.array(want, np.int8))
    tflite, _ = run_layer(dataclasses.replace(p, rounding=Rounding.FLOAT64), BASE, x)
    assert np.any(tflite != got), "ties must round differently from FLOAT64's half away from zero"
