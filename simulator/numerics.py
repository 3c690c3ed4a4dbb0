"""Integer arithmetic of the NPU's output stage, bit-exact with TFLite's reference kernels.

This is the single definition of requantization used twice: the compiler calls
the multiplier functions to precompute per-channel (multiplier, shift) pairs,
and the simulator calls the requantize functions to execute them. The same
holds for the elementwise ADD, SUB and MUL and for SOFTMAX (``softmax_params``
for the compiler, ``softmax`` for the kernel, gemmlowp fixed point from
:mod:`simulator.fixedpoint`).

Conventions (those of tensorflow/lite/kernels/internal/common.h and
quantization_util.cc):

* A real multiplier M is represented as ``M = multiplier * 2**(shift - 31)`` with
  ``multiplier`` an int32 in [2**30, 2**31) (or 0) and ``shift`` a signed
  exponent: **shift > 0 is a left shift**, shift < 0 a right shift.
* ``Rounding.TFLITE_DOUBLE`` is TFLite's default build: a saturating rounding
  doubling high multiply (round half away from zero) followed by a rounding
  right shift (round half away from zero). ``Rounding.TFLITE_SINGLE`` is the
  ``TFLITE_SINGLE_ROUNDING`` build flag: one 64-bit multiply and one rounding
  shift (round half up). The ai-edge-litert wheels use the double variant.
* ``Rounding.FLOAT64`` is what TFLite's *reference* per-channel
  FULLY_CONNECTED does instead of fixed point: ``round(double(acc) * scale)``
  with ``scale = double(s_in) * double(s_w) / double(s_out)``, rounding half
  away from zero (C ``round``). The NPU's output stage offers it so that such
  layers stay bit-exact with the reference; it is selected per command.
* ``Rounding.ONNXRUNTIME`` reproduces onnxruntime's CPU execution of an ONNX
  QDQ graph (graph optimizations off): every DequantizeLinear -> float op ->
  QuantizeLinear chain in float32, in MLAS's operation order, quantized by a
  float32 division rounded half to even (:func:`quantize_linear`). The
  elementwise, pooling and mean units and the look-up tables reproduce it bit
  for bit; the MAC array keeps its exact integer accumulator and rounds
  ``acc * scale`` half to even (:func:`requantize_float`), which differs from
  onnxruntime's float32 FMA chain only where the exact value lies within about
  1e-5 of a step from a .5 tie (a few outputs per 100,000).

Floats appear only where the reference uses them: TFLite turning float32
scales into a multiplier at preparation time, onnxruntime computing in float32.
"""

from __future__ import annotations

import functools
import math
from enum import IntEnum
from fractions import Fraction

import numpy as np

from . import fixedpoint, mlas
from .errors import NumericsError

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1


class Rounding(IntEnum):
    """Requantization rounding variant; values are the stream's Rounding enum."""

    TFLITE_DOUBLE = 0
    TFLITE_SINGLE = 1
    FLOAT64 = 2
    ONNXRUNTIME = 3
    """onnxruntime's QDQ execution: float32 units in MLAS's operation order, quantization by float32
    division rounded half to even; MAC ops: exact accumulator times the double scale, rounded half to even."""


def _split_q31(real_multiplier: float) -> tuple[int, int]:
    """The frexp split of ``QuantizeMultiplier`` with no limit on the exponent (shift < -31 flushes to 0)."""
    if not math.isfinite(real_multiplier) or real_multiplier < 0:
        raise NumericsError(f"requantization multiplier must be finite and >= 0, got {real_multiplier}")
    if real_multiplier == 0.0:
        return 0, 0
    q, shift = math.frexp(real_multiplier)
    q_fixed = int(math.floor(q * (1 << 31) + 0.5))
    if q_fixed == (1 << 31):
        q_fixed //= 2
        shift += 1
    if shift < -31:
        return 0, 0
    return q_fixed, shift


def quantize_multiplier(real_multiplier: float, rounding: Rounding = Rounding.TFLITE_DOUBLE):
    """TFLite ``QuantizeMultiplier``: split a non-negative real into (multiplier, shift).

    ``frexp`` gives q in [0.5, 1); q * 2**31 is rounded half away from zero
    (``TfLiteRound``). Multipliers below about 2**-31 flush to zero as in TFLite.
    """
    q_fixed, shift = _split_q31(real_multiplier)
    if rounding == Rounding.TFLITE_SINGLE and shift > 30:
        return INT32_MAX, 30
    if shift > 30:
        raise NumericsError(f"requantization multiplier {real_multiplier} is too large (shift {shift} > 30)")
    return q_fixed, shift


def conv_multipliers(input_scale, weight_scales, output_scale, rounding=Rounding.TFLITE_DOUBLE):
    """Per-channel multipliers as TFLite ``PopulateConvolutionQuantizationParams`` makes them.

    Used by CONV_2D and DEPTHWISE_CONV_2D (and per-channel FULLY_CONNECTED): the
    product ``input_scale * weight_scale / output_scale`` is formed in double
    from the float32 scales.
    """
    s_in = float(np.float32(input_scale))
    s_out = float(np.float32(output_scale))
    if s_out <= 0 or s_in <= 0:
        raise NumericsError(f"scales must be positive, got input {s_in} and output {s_out}")
    pairs = [quantize_multiplier(s_in * float(np.float32(s_w)) / s_out, rounding)
             for s_w in np.atleast_1d(weight_scales)]
    return (np.array([p[0] for p in pairs], dtype=np.int32),
            np.array([p[1] for p in pairs], dtype=np.int32))


def fully_connected_multiplier(input_scale, weight_scale, output_scale, rounding=Rounding.TFLITE_DOUBLE):
    """Per-tensor FULLY_CONNECTED multiplier as TFLite ``GetQuantizedConvolutionMultipler``.

    Unlike convolution, TFLite multiplies the input and weight scales in
    float32 before widening to double; the two can differ in the last bit.
    """
    product = float(np.float32(input_scale) * np.float32(weight_scale))
    s_out = float(np.float32(output_scale))
    if s_out <= 0 or product <= 0:
        raise NumericsError("fully connected scales must be positive")
    multiplier, shift = quantize_multiplier(product / s_out, rounding)
    return np.array([multiplier], dtype=np.int32), np.array([shift], dtype=np.int32)


ADD_LEFT_SHIFT = 20
"""Headroom bits TFLite's int8 ADD gives both inputs before rescaling (add.cc)."""


def _common_scale_multipliers(op: str, input_scale, input2_scale, output_scale, rounding):
    """(m1, s1, m2, s2, m_out, s_out) of int8 ADD and SUB, whose ``Prepare`` functions compute them alike.

    Both inputs are brought to twice the larger input scale; the output
    multiplier undoes that and the ``ADD_LEFT_SHIFT`` headroom. TFLite forms
    ``twice_max`` and ``(1 << 20) * s_out`` in float32 (both exact: powers of
    two) and the three ratios in double. All three go through
    ``QuantizeMultiplierSmallerThanOneExp`` in the kernels' output stage,
    which cannot shift left: a multiplier that is, or rounds to, 1 or more is
    refused here (TFLite aborts on it, or for SUB's output shifts by a
    negative amount, which is undefined behaviour).
    """
    s1, s2, so = (float(np.float32(s)) for s in (input_scale, input2_scale, output_scale))
    if not min(s1, s2, so) > 0 or not math.isfinite(max(s1, s2, so)):
        raise NumericsError(f"{op} scales must be positive and finite")
    twice_max = 2.0 * max(s1, s2)
    reals = (s1 / twice_max, s2 / twice_max, twice_max / ((1 << ADD_LEFT_SHIFT) * so))
    if reals[2] >= 1.0:
        raise NumericsError(f"{op} output multiplier {reals[2]:.3g} must be below 1 (output scale too small)")
    pairs = [quantize_multiplier(r, rounding) for r in reals]
    if pairs[2][1] > 0:
        raise NumericsError(f"{op} output multiplier {reals[2]!r} rounds up to 1 (output scale too small)")
    return tuple(v for pair in pairs for v in pair)


def add_multipliers(input_scale, input2_scale, output_scale, rounding=Rounding.TFLITE_DOUBLE):
    """(m1, s1, m2, s2, m_out, s_out) as TFLite's int8 ADD ``Prepare`` (add.cc) computes them."""
    return _common_scale_multipliers("ADD", input_scale, input2_scale, output_scale, rounding)


def sub_multipliers(input_scale, input2_scale, output_scale, rounding=Rounding.TFLITE_DOUBLE):
    """(m1, s1, m2, s2, m_out, s_out) as TFLite's int8 SUB ``PrepareGeneralSubOp`` (sub.cc) computes them.

    The same expressions as ADD's, same float/double mix and the same left
    shift of 20; only an output multiplier above 1 differs (SUB's Prepare
    accepts it, its kernel then cannot apply it), and both refuse it here.
    """
    return _common_scale_multipliers("SUB", input_scale, input2_scale, output_scale, rounding)


def mul_multiplier(input_scale, input2_scale, output_scale, rounding=Rounding.TFLITE_DOUBLE):
    """(multiplier, shift) of int8 MUL as TFLite's mul.cc ``Prepare`` computes them.

    ``input1->params.scale * input2->params.scale / output->params.scale`` is
    float32 arithmetic (the product and the quotient each rounded to float32)
    before QuantizeMultiplier widens it to double; the shift may be positive.
    """
    s1, s2, so = (np.float32(s) for s in (input_scale, input2_scale, output_scale))
    if not min(s1, s2, so) > 0 or not np.isfinite(max(s1, s2, so)):
        raise NumericsError("MUL scales must be positive and finite")
    with np.errstate(over="ignore", under="ignore"):
        real = np.float32(np.float32(s1 * s2) / so)
    return quantize_multiplier(float(real), rounding)


def mean_multiplier(input_scale, output_scale, count: int, rounding=Rounding.TFLITE_DOUBLE):
    """Multiplier of an int8 MEAN over ``count`` elements, 1/count folded in.

    TFLite ``QuantizedMeanOrSum``: QuantizeMultiplier(s_in / s_out), then the
    multiplier is scaled up by 2**k (k = floor(log2(count)), at most 32 and at
    most 31 + shift) and divided by ``count`` in integers, the shift lowered by k.
    """
    if count <= 0:
        raise NumericsError("MEAN over an empty axis")
    multiplier, shift = quantize_multiplier(float(np.float32(input_scale)) / float(np.float32(output_scale)),
                                            rounding)
    k = min(count.bit_length() - 1, 32, 31 + shift)
    return int((multiplier << k) // count), shift - k


def wrap_signed(values: np.ndarray, bits: int) -> np.ndarray:
    """Two's-complement wrap of int64 values to ``bits`` (what a hardware adder does)."""
    values = np.asarray(values, dtype=np.int64)
    if bits >= 64:
        return values
    half = np.int64(1) << np.int64(bits - 1)
    return ((values + half) & ((half << np.int64(1)) - 1)) - half


def _check_multipliers(multiplier: np.ndarray, shift: np.ndarray) -> None:
    if np.any(multiplier < 0):
        raise NumericsError("requantization multiplier must be non-negative")
    if np.any(shift < -31) or np.any(shift > 30):
        bad = int(shift[(shift < -31) | (shift > 30)][0])
        raise NumericsError(f"requantization shift {bad} is outside [-31, 30]")


def multiply_by_quantized_multiplier(acc, multiplier, shift, rounding=Rounding.TFLITE_DOUBLE):
    """TFLite ``MultiplyByQuantizedMultiplier`` on int32 accumulators, vectorized.

    ``multiplier`` and ``shift`` broadcast against ``acc`` (per channel: last axis).
    """
    x = np.asarray(acc, dtype=np.int64)
    m = np.broadcast_to(np.asarray(multiplier, dtype=np.int64), x.shape)
    s = np.broadcast_to(np.asarray(shift, dtype=np.int64), x.shape)
    _check_multipliers(np.asarray(multiplier), np.asarray(shift))
    if rounding == Rounding.TFLITE_SINGLE:
        total_shift = 31 - s
        result = (x * m + (np.int64(1) << (total_shift - 1))) >> total_shift
        return wrap_signed(result, 32)
    # x * (1 << left_shift) is an int32 product in TFLite; it wraps in practice.
    x = wrap_signed(x << np.maximum(s, 0), 32)
    high = fixedpoint.saturating_rounding_doubling_high_mul_array(x, m)
    return fixedpoint.rounding_divide_by_pot_array(high, np.maximum(-s, 0))


def requantize(acc, multiplier, shift, output_zero_point, act_min, act_max,
               rounding=Rounding.TFLITE_DOUBLE, out_dtype=np.int8):
    """Output stage: rescale accumulators, add the output zero point, clamp, narrow."""
    info = np.iinfo(out_dtype)
    if not info.min <= act_min <= act_max <= info.max:
        raise NumericsError(f"activation clamp [{act_min}, {act_max}] is outside {np.dtype(out_dtype).name}")
    scaled = multiply_by_quantized_multiplier(acc, multiplier, shift, rounding)
    return np.clip(scaled + int(output_zero_point), act_min, act_max).astype(out_dtype)


def _rescale_and_combine(sign: int, x1, x2, zp1, zp2, zp_out, m1, s1, m2, s2, m_out, s_out, left_shift, act_min,
                         act_max, rounding):
    """ADD (sign +1) and SUB (sign -1): both inputs shifted left and rescaled, combined in int32, requantized."""
    a = wrap_signed((np.asarray(x1, np.int64) - zp1) << left_shift, 32)
    b = wrap_signed((np.asarray(x2, np.int64) - zp2) << left_shift, 32)
    total = wrap_signed(multiply_by_quantized_multiplier(a, m1, s1, rounding)
                        + sign * multiply_by_quantized_multiplier(b, m2, s2, rounding), 32)
    return requantize(total, m_out, s_out, zp_out, act_min, act_max, rounding)


def elementwise_add(x1, x2, zp1, zp2, zp_out, m1, s1, m2, s2, m_out, s_out, left_shift, act_min, act_max,
                    rounding=Rounding.TFLITE_DOUBLE):
    """TFLite reference int8 ``AddElementwise`` on whole arrays."""
    return _rescale_and_combine(1, x1, x2, zp1, zp2, zp_out, m1, s1, m2, s2, m_out, s_out, left_shift, act_min,
                                act_max, rounding)


def elementwise_sub(x1, x2, zp1, zp2, zp_out, m1, s1, m2, s2, m_out, s_out, left_shift, act_min, act_max,
                    rounding=Rounding.TFLITE_DOUBLE):
    """TFLite reference int8 ``SubElementwise`` (reference/sub.h) on whole arrays: ``raw_sub = scaled1 - scaled2``."""
    return _rescale_and_combine(-1, x1, x2, zp1, zp2, zp_out, m1, s1, m2, s2, m_out, s_out, left_shift, act_min,
                                act_max, rounding)


def elementwise_mul(x1, x2, zp1, zp2, zp_out, multiplier, shift, act_min, act_max, rounding=Rounding.TFLITE_DOUBLE):
    """TFLite reference int8 ``MulElementwise`` (reference/integer_ops/mul.h) on whole arrays.

    ``clamp(zp_out + MultiplyByQuantizedMultiplier((x1 - zp1) * (x2 - zp2)))``;
    the product of two centred int8 values is below 2**16 and never wraps.
    """
    product = (np.asarray(x1, np.int64) - zp1) * (np.asarray(x2, np.int64) - zp2)
    return requantize(product, multiplier, shift, zp_out, act_min, act_max, rounding)


def float_scales(input_scale, weight_scales, output_scale) -> np.ndarray:
    """Per-channel double scales of ``Rounding.FLOAT64`` and ``Rounding.ONNXRUNTIME``, in TFLite's operation order.

    ``double(s_in) * double(s_w) / double(s_out)`` from the float32 scales.
    """
    s_in, s_out = float(np.float32(input_scale)), float(np.float32(output_scale))
    if s_in <= 0 or s_out <= 0:
        raise NumericsError("scales must be positive")
    return np.array([s_in * float(np.float32(s)) / s_out for s in np.atleast_1d(weight_scales)], dtype=np.float64)


def _round_half_even_exact(acc: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The exact product ``acc * scale`` (int64 times double) rounded half to even, as int64.

    The double product rounds to the same integer except where it is a .5
    tie (an exact tie stays one; an inexact product can round onto one) or
    the accumulator exceeds 2**53; those few are redone with fractions.
    """
    product = acc.astype(np.float64) * scales
    rounded = np.rint(product).astype(np.int64)
    redo = (np.abs(product - np.trunc(product)) == 0.5) | (np.abs(acc) >= 1 << 53)
    for index in zip(*np.nonzero(redo)):
        rounded[index] = round(Fraction(int(acc[index])) * Fraction(float(scales[index])))
    return rounded


def requantize_float(acc, scales, output_zero_point, act_min, act_max, rounding=Rounding.FLOAT64,
                     out_dtype=np.int8):
    """Output stage of the double-scale modes: ``acc * scale`` rounded to an integer, zero point, clamp.

    ``Rounding.FLOAT64`` (TFLite's reference per-channel FULLY_CONNECTED):
    C ``round`` of the double product, half away from zero.
    ``Rounding.ONNXRUNTIME``: the exact product of the integer accumulator
    and the double scale rounded half to even, onnxruntime's rounding; what
    onnxruntime rounds is its float32 FMA chain, which differs from the exact
    value only near ties (see the module docstring).
    """
    if rounding not in (Rounding.FLOAT64, Rounding.ONNXRUNTIME):
        raise NumericsError(f"{Rounding(rounding).name} is not a double-scale rounding")
    scales = np.asarray(scales, dtype=np.float64)
    if not np.all(np.isfinite(scales)) or np.any(scales < 0):
        raise NumericsError("float requantization scales must be finite and non-negative")
    acc = np.asarray(acc, dtype=np.int64)
    scales = np.broadcast_to(scales, acc.shape)
    product = acc.astype(np.float64) * scales
    if not np.all(np.abs(product) < 2.0 ** 62):
        raise NumericsError("float requantization overflows: scale too large for the accumulators")
    if rounding == Rounding.ONNXRUNTIME:
        rounded = _round_half_even_exact(acc, scales)
    else:
        truncated = np.trunc(product)
        rounded = (truncated + np.where(np.abs(product - truncated) >= 0.5, np.sign(product), 0.0)).astype(np.int64)
    scaled = wrap_signed(rounded, 32)
    return np.clip(scaled + int(output_zero_point), act_min, act_max).astype(out_dtype)


def _ort_scale(scale, what: str) -> np.float32:
    value = np.float32(scale)
    if not (np.isfinite(value) and value > 0):
        raise NumericsError(f"{what} scale must be positive and finite, got {scale}")
    return value


def _check_clamp(act_min: int, act_max: int) -> None:
    if not -128 <= act_min <= act_max <= 127:
        raise NumericsError(f"activation clamp [{act_min}, {act_max}] is outside int8")


def dequantize_linear(q, scale, zero_point) -> np.ndarray:
    """onnxruntime DequantizeLinear (MlasDequantizeLinear): ``float32(int32(q) - zero_point) * float32(scale)``.

    The subtraction is an integer one and exact in float32; the product is
    the one float32 rounding. (``q * s - zp * s`` would round differently.)
    """
    centred = np.asarray(q, dtype=np.int32) - np.int32(zero_point)
    with np.errstate(over="ignore"):   # a scale near float32's maximum overflows to inf, as in onnxruntime
        return centred.astype(np.float32) * _ort_scale(scale, "dequantization")


def quantize_linear(values, scale, zero_point) -> np.ndarray:
    """onnxruntime QuantizeLinear to int8 (MlasQuantizeLinear, every x86 kernel alike).

    ``v = float32(x) / float32(scale)``, a true IEEE float32 division (not a
    multiply by ``1 / scale``, which differs near ties); ``v`` clamped in float
    to ``[-128 - zp, 127 - zp]``; rounded half to even (``cvtps2dq`` under the
    default MXCSR); ``zp`` added after rounding (adding it first would change
    which neighbour is even).
    """
    zp = int(zero_point)
    if not -128 <= zp <= 127:
        raise NumericsError(f"quantization zero point {zp} is outside int8")
    with np.errstate(over="ignore"):
        ratio = np.asarray(values, dtype=np.float32) / _ort_scale(scale, "quantization")
    if np.any(np.isnan(ratio)):
        raise NumericsError("cannot quantize NaN")
    clamped = np.clip(ratio, np.float32(-128 - zp), np.float32(127 - zp))
    return (np.rint(clamped).astype(np.int32) + zp).astype(np.int8)


ORT_BINARY_OPS = (np.add, np.subtract, np.multiply)
"""The float32 operations of ONNX Add, Sub and Mul (Eigen's element-wise float ops: one rounding each)."""


def ort_elementwise(op, x1, x2, input_scale, input_zero_point, input2_scale, input2_zero_point, output_scale,
                    output_zero_point, act_min=-128, act_max=127) -> np.ndarray:
    """onnxruntime's QDQ Add / Sub / Mul: ``Q(op(DQ(x1), DQ(x2)))`` in float32, then the activation clamp.

    ``op`` is ``np.add``, ``np.subtract`` or ``np.multiply``. Measured against
    onnxruntime on every int8 pair: 0 differences, while the exact real result
    rounded half to even differs on up to 11% of pairs when the scales make
    exact ties (the float32 roundings before the division break them).
    """
    if op not in ORT_BINARY_OPS:
        raise NumericsError(f"{op!r} is not one of onnxruntime's elementwise float ops")
    _check_clamp(act_min, act_max)
    with np.errstate(over="ignore", invalid="ignore"):   # inf saturates; NaN is refused by quantize_linear
        result = op(dequantize_linear(x1, input_scale, input_zero_point),
                    dequantize_linear(x2, input2_scale, input2_zero_point))
    return np.clip(quantize_linear(result, output_scale, output_zero_point), act_min, act_max).astype(np.int8)


MLAS_VECTOR_POOL_MAX_KERNEL = 32
MLAS_VECTOR_POOL_MAX_STRIDE_W = 2
MLAS_VECTOR_POOL_MAX_ROW = 2048 - 3
"""MlasPool picks its vector kernel for windows up to 32, a width stride of 1 or 2 and padded rows that fit its
2048-float reduction buffer (less 3 floats of over-read); anything else takes the generic kernel."""


def _ort_pool_sums(values: np.ndarray, kernel, stride, out_shape) -> np.ndarray:
    """float32 window sums of a zero-padded [H, W, C] map in MLAS's order (see :func:`ort_avg_pool`)."""
    (kh, kw), (sh, sw), (oh, ow) = kernel, stride, out_shape

    def kernel_row(ky: int) -> np.ndarray:      # [OH, Wp, C]: row ky of every output row's window
        return values[ky:ky + (oh - 1) * sh + 1:sh]

    def kernel_column(rows: np.ndarray, kx: int) -> np.ndarray:     # [OH, OW, C]
        return rows[:, kx:kx + (ow - 1) * sw + 1:sw]

    if (max(kh, kw) <= MLAS_VECTOR_POOL_MAX_KERNEL and sw <= MLAS_VECTOR_POOL_MAX_STRIDE_W
            and values.shape[1] <= MLAS_VECTOR_POOL_MAX_ROW):
        column_sums = kernel_row(0)
        for ky in range(1, kh):
            column_sums = column_sums + kernel_row(ky)
        total = kernel_column(column_sums, 0)
        for kx in range(1, kw):
            total = total + kernel_column(column_sums, kx)
        return total
    total = np.zeros((oh, ow, values.shape[2]), np.float32)
    for ky in range(kh):
        for kx in range(kw):
            total = total + kernel_column(kernel_row(ky), kx)
    return total


def ort_avg_pool(x, kernel, stride, padding, input_scale, input_zero_point, output_scale, output_zero_point,
                 act_min=-128, act_max=127) -> np.ndarray:
    """onnxruntime's QDQ AveragePool (count_include_pad=0) of an int8 [H, W, C] map, bit for bit.

    ``padding`` is (top, left, bottom, right). The dequantized map is summed
    in float32 in the order of ``MlasPool2DVectorKernel``: for each output
    row, every column is summed over the window's rows top to bottom, then
    each output adds its window's column sums left to right; windows over 32,
    or a width stride over 2, take ``MlasPool2DKernel``'s single row-major
    sum instead. Padding adds +0.0, which changes no sum. The sum is divided
    (float32 division) by the number of inputs inside the image, then
    quantized. A window that is the whole input (stride 1, no padding) is
    onnxruntime's global kernel instead: :func:`ort_mean`.

    Measured against onnxruntime: 0 differences; the exact average rounded
    half to even differs on 1-5% of outputs when input and output qparams are
    equal (counts of 2, 4, 6 make exact ties that float32 summation breaks).
    """
    _check_clamp(act_min, act_max)
    values = dequantize_linear(x, input_scale, input_zero_point)
    if values.ndim != 3:
        raise NumericsError(f"average pool takes an [H, W, C] map, got shape {values.shape}")
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = kernel, stride, padding
    height, width = values.shape[:2]
    oh, ow = (height + pt + pb - kh) // sh + 1, (width + pl + pr - kw) // sw + 1
    if min(kh, kw, sh, sw) < 1 or min(padding) < 0 or max(pt, pb) >= kh or max(pl, pr) >= kw or min(oh, ow) < 1:
        raise NumericsError(f"average pool window {kernel}, stride {stride}, padding {padding} does not fit "
                            f"{height}x{width}")
    padded = np.pad(values, ((pt, pb), (pl, pr), (0, 0)))
    with np.errstate(over="ignore", invalid="ignore"):
        total = _ort_pool_sums(padded, (kh, kw), (sh, sw), (oh, ow))
    oy, ox = np.arange(oh) * sh - pt, np.arange(ow) * sw - pl
    valid_rows = np.minimum(oy + kh, height) - np.maximum(oy, 0)
    valid_cols = np.minimum(ox + kw, width) - np.maximum(ox, 0)
    count = (valid_rows[:, None] * valid_cols[None, :]).astype(np.float32)[:, :, None]
    average = total / count
    return np.clip(quantize_linear(average, output_scale, output_zero_point), act_min, act_max).astype(np.int8)


def ort_mean(x, input_scale, input_zero_point, output_scale, output_zero_point, act_min=-128,
             act_max=127) -> np.ndarray:
    """onnxruntime's QDQ GlobalAveragePool of an int8 [H, W, C] map: int8 [C], bit for bit.

    ``MlasPoolGlobalKernel`` on x86: the H*W dequantized values of a channel,
    in row-major order, go to four float32 lane sums (lane j adds elements
    j, j+4, j+8, ... in turn, from 0.0) while four remain; the lanes reduce
    as ``(l0 + l2) + (l1 + l3)`` (``MlasReduceAddFloat32x4``); the
    ``H*W mod 4`` leftover elements are added one by one; the float32 sum is
    divided by ``float(H*W)`` and quantized. (ARM's pairwise reduce,
    ``(l0 + l1) + (l2 + l3)``, is not modelled.) Measured: 0 differences; a
    sequential sum or the exact mean differ on ties (e.g. 12x12).
    """
    _check_clamp(act_min, act_max)
    values = dequantize_linear(x, input_scale, input_zero_point)
    if values.ndim != 3 or values.shape[0] * values.shape[1] == 0:
        raise NumericsError(f"mean takes a non-empty [H, W, C] map, got shape {values.shape}")
    flat = values.reshape(-1, values.shape[2])
    count = flat.shape[0]
    body = count - count % 4
    lanes = np.zeros((4, flat.shape[1]), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for start in range(0, body, 4):
            lanes = lanes + flat[start:start + 4]
        total = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3])
        for index in range(body, count):
            total = total + flat[index]
        average = total / np.float32(count)
    return np.clip(quantize_linear(average, output_scale, output_zero_point), act_min, act_max).astype(np.int8)


def qdq_table(function, input_scale, input_zero_point, output_scale, output_zero_point) -> np.ndarray:
    """int8 table (index q + 128) of onnxruntime's ``QuantizeLinear(f(DequantizeLinear(q)))``.

    ``function`` receives the 256 dequantized float32 inputs as a float64
    array (exactly) and returns the float op's outputs; they are rounded to
    float32 and quantized (:func:`quantize_linear`). A float64 numpy function
    is onnxruntime's result except where MLAS's own float32 algorithm is off
    by an ulp near a rounding boundary (about 4 entries in a million for
    sigmoid and tanh); :mod:`simulator.mlas` ports those algorithms exactly.
    """
    inputs = dequantize_linear(np.arange(-128, 128), input_scale, input_zero_point)
    with np.errstate(over="ignore"):
        outputs = np.asarray(function(inputs.astype(np.float64)), dtype=np.float64).astype(np.float32)
    if outputs.shape != (256,):
        raise NumericsError(f"table function returned shape {outputs.shape}, expected (256,)")
    return quantize_linear(outputs, output_scale, output_zero_point)


def qdq_leaky_relu_table(input_scale, input_zero_point, output_scale, output_zero_point, alpha) -> np.ndarray:
    """int8 table of onnxruntime's QDQ LeakyRelu: ``x >= 0 ? x : float32(alpha) * x`` in float32.

    The product is a float32 one; a float64 ``alpha * x`` rounded afterwards
    differs in a few entries per million.
    """
    return qdq_table(functools.partial(mlas.leaky_relu, alpha=alpha), input_scale, input_zero_point,
                     output_scale, output_zero_point)


LUT_INPUT_INTEGER_BITS = 4
"""TFLite's int8 LOGISTIC and TANH rescale inputs to Q4 (activations.cc, kInputIntegerBits)."""


def _lut_input_rescale(input_scale: float):
    """(multiplier, left shift, radius) as TFLite's sigmoid/tanh Prepare computes them."""
    real = float(np.float32(input_scale)) * float(1 << (31 - LUT_INPUT_INTEGER_BITS))
    if real <= 1.0:
        raise NumericsError(f"LOGISTIC/TANH input scale {input_scale} is too small for the Q4 rescale")
    multiplier, shift = quantize_multiplier(real)
    max_rescaled = ((1 << LUT_INPUT_INTEGER_BITS) - 1) * (1 << (31 - LUT_INPUT_INTEGER_BITS)) / (1 << shift)
    return multiplier, shift, int(math.floor(max_rescaled))


def _activation_table(input_scale, input_zero_point, function, output_shift: int, output_offset: int):
    multiplier, shift, radius = _lut_input_rescale(input_scale)
    table = np.empty(256, dtype=np.int8)
    for index, value in enumerate(range(-128, 128)):
        centred = value - int(input_zero_point)
        if centred <= -radius:
            out = -128
        elif centred >= radius:
            out = 127
        else:
            q4 = int(multiply_by_quantized_multiplier(np.array([centred]), multiplier, shift)[0])
            raw = function(q4, LUT_INPUT_INTEGER_BITS)
            out = fixedpoint.rounding_divide_by_pot(raw, output_shift) + output_offset
        table[index] = min(max(out, -128), 127)
    return table


def logistic_table(input_scale, input_zero_point) -> np.ndarray:
    """int8 LOGISTIC of every input -128..127, as reference_integer_ops::Logistic computes it.

    TFLite fixes the output qparams at scale 1/256, zero point -128.
    """
    return _activation_table(input_scale, input_zero_point, fixedpoint.logistic, 31 - 8, -128)


def tanh_table(input_scale, input_zero_point) -> np.ndarray:
    """int8 TANH of every input -128..127, as reference_integer_ops::Tanh computes it.

    TFLite fixes the output qparams at scale 1/128, zero point 0.
    """
    return _activation_table(input_scale, input_zero_point, fixedpoint.tanh, 31 - 7, 0)


def requantize_table(input_scale, input_zero_point, output_scale, output_zero_point,
                     rounding=Rounding.TFLITE_DOUBLE) -> np.ndarray:
    """int8 -> int8 requantization (TFLite QUANTIZE with an int8 input) of every input -128..127.

    reference_ops::Requantize: multiplier from double(s_in) / double(s_out),
    ``MultiplyByQuantizedMultiplier(x - z_in) + z_out``, saturated to int8.
    """
    multiplier, shift = quantize_multiplier(float(np.float32(input_scale)) / float(np.float32(output_scale)),
                                            rounding)
    values = np.arange(-128, 128, dtype=np.int64) - int(input_zero_point)
    return requantize(values, multiplier, shift, output_zero_point, -128, 127, rounding)


def leaky_relu_table(input_scale, input_zero_point, output_scale, output_zero_point, alpha) -> np.ndarray:
    """int8 LEAKY_RELU of every input -128..127, as reference_ops::QuantizeLeakyRelu computes it.

    TFLite's Prepare forms both multipliers in float32 (``s_in * alpha / s_out``
    and ``s_in / s_out``) before QuantizeMultiplier widens them to double.
    """
    s_in, s_out, a = np.float32(input_scale), np.float32(output_scale), np.float32(alpha)
    alpha_m, alpha_s = quantize_multiplier(float(np.float32(np.float32(s_in * a) / s_out)))
    ident_m, ident_s = quantize_multiplier(float(np.float32(s_in / s_out)))
    values = np.arange(-128, 128, dtype=np.int64) - int(input_zero_point)
    scaled = np.where(values >= 0, multiply_by_quantized_multiplier(values, ident_m, ident_s),
                      multiply_by_quantized_multiplier(values, alpha_m, alpha_s))
    return np.clip(scaled + int(output_zero_point), -128, 127).astype(np.int8)


def hard_swish_table(input_scale, input_zero_point, output_scale, output_zero_point) -> np.ndarray:
    """int8 HARD_SWISH of every input -128..127, as reference_ops::HardSwish computes it.

    Prepare works in float32: the input on a "hires" scale s_in / 128, rescaled
    to the output and to the "reluish" scale 3 / 32768, each multiplier then
    quantized to Q31 and rounded down to Q15.
    """
    hires = np.float32(np.float32(1.0 / 128.0) * np.float32(input_scale))
    output_m, output_e = quantize_multiplier(float(np.float32(hires / np.float32(output_scale))))
    reluish_m, reluish_e = quantize_multiplier(float(np.float32(hires / np.float32(3.0 / 32768.0))))
    if output_e > 0:
        raise NumericsError("HARD_SWISH output scale is below the input scale / 128")
    output_m16 = fixedpoint.downscale_multiplier_to_int16(output_m)
    reluish_m16 = fixedpoint.downscale_multiplier_to_int16(reluish_m)
    table = [fixedpoint.hard_swish(v - int(input_zero_point), reluish_m16, reluish_e, output_m16, output_e)
             + int(output_zero_point) for v in range(-128, 128)]
    return np.clip(np.array(table), -128, 127).astype(np.int8)


SOFTMAX_DIFF_INTEGER_BITS = 5
"""Integer bits of the rescaled input differences fed to exp (softmax.h, kScaledDiffIntegerBits: Q5.26)."""
SOFTMAX_ACCUMULATION_INTEGER_BITS = 12
"""Integer bits of the sum of exponentials (softmax.h, kAccumulationIntegerBits: Q12.19)."""
_SOFTMAX_MAX_SUM = 1 << (31 - SOFTMAX_ACCUMULATION_INTEGER_BITS + 9)
"""Raw Q12.19 sum of 512: from there the output shift exceeds 31 and TFLite's kernel aborts."""


def softmax_params(input_scale, beta=1.0) -> tuple[int, int, int]:
    """(input_multiplier, input_left_shift, diff_min) as TFLite's SoftmaxPrepare computes them for int8 (kReference).

    ``PreprocessSoftmaxScaling``: the real multiplier ``beta * s_in * 2**26`` (in
    double, from the float32 beta and scale) is capped at ``2**31 - 1`` and
    split by ``QuantizeMultiplierGreaterThanOne`` (double-rounding build: the
    left shift reaches 31 for large scales, where only the row maximum keeps a
    non-zero exponential). ``diff_min = -floor(31 * 2**26 / 2**left_shift)``
    (``CalculateInputRadius(5, left_shift, 31)``): input differences below it
    are left out of the sum and output as zero probability.

    TFLite aborts the process (``TFLITE_CHECK_GT(multiplier, 1.)``) when
    ``beta * s_in * 2**26 <= 1``, i.e. input scales at or below ``2**-26 / beta``;
    that raises ``NumericsError`` here.
    """
    s_in, b = float(np.float32(input_scale)), float(np.float32(beta))
    if not (math.isfinite(s_in) and s_in > 0 and math.isfinite(b) and b > 0):
        raise NumericsError(f"SOFTMAX input scale and beta must be positive and finite, got {input_scale}, {beta}")
    real = min(b * s_in * (1 << (31 - SOFTMAX_DIFF_INTEGER_BITS)), (1 << 31) - 1.0)
    if not real > 1.0:
        raise NumericsError(f"SOFTMAX input scale {s_in:g} times beta {b:g} is at most 2**-26: TFLite's "
                            f"PreprocessSoftmaxScaling aborts (its input multiplier must exceed 1)")
    multiplier, left_shift = _split_q31(real)
    radius = ((1 << SOFTMAX_DIFF_INTEGER_BITS) - 1) * (1 << (31 - SOFTMAX_DIFF_INTEGER_BITS)) / (1 << left_shift)
    return multiplier, left_shift, -int(math.floor(radius))


@functools.lru_cache(maxsize=64)
def _softmax_exponentials(input_multiplier: int, input_left_shift: int, diff_min: int) -> np.ndarray:
    """Q0 exp of every int8 row difference -255..0 (index diff + 255), 0 where the difference is below diff_min.

    Per element of reference_ops::Softmax: ``MultiplyByQuantizedMultiplierGreaterThanOne``
    (``x * (1 << left_shift)`` wraps as an int32 product, then the rounding
    doubling high multiply) gives a Q5.26 value for gemmlowp's exp_on_negative_values.
    """
    table = np.zeros(256, dtype=np.int64)
    for diff in range(max(diff_min, -255), 1):
        rescaled = fixedpoint.saturating_rounding_doubling_high_mul(
            fixedpoint.wrap32(diff << input_left_shift), input_multiplier)
        table[diff + 255] = fixedpoint.exp_on_negative_values(rescaled, SOFTMAX_DIFF_INTEGER_BITS)
    table.flags.writeable = False
    return table


def softmax(x, input_multiplier: int, input_left_shift: int, diff_min: int, output_zero_point: int = -128):
    """int8 softmax of every row of ``x`` [rows, depth], bit-exact with reference_ops::Softmax (int8 in and out).

    Per row: the maximum; exp (Q0) of each difference to it that is at least
    ``diff_min``; their sum rescaled to Q12.19 (``Rescale<12>``, a rounding
    shift) and added in int32; ``GetReciprocal`` of the sum (normalised to
    [1, 2), gemmlowp's Newton-Raphson ``one_over_one_plus_x_for_x_in_0_1``,
    ``num_bits_over_unit`` integer bits above 1); each probability is the
    rounding doubling high product of reciprocal and exp, divided by
    ``2**(num_bits_over_unit + 23)`` rounding half away from zero, plus the
    output zero point (TFLite: -128, the int8 minimum) and saturated to int8.
    Left-out differences output the zero point. Parameters come from
    :func:`softmax_params`; this is the double-rounding build. Parameters
    whose shifted differences would overflow int32 raise ``NumericsError``.

    TFLite's kernel aborts when a row's sum of exponentials reaches 512 (only
    possible with 512 or more channels), the output shift then exceeding 31:
    that raises ``NumericsError``.
    """
    rows = np.asarray(x)
    if rows.ndim != 2 or rows.shape[1] < 1:
        raise NumericsError(f"softmax takes [rows, depth] with depth >= 1, got shape {rows.shape}")
    rows = rows.astype(np.int64)
    if rows.size and (rows.min() < -128 or rows.max() > 127):
        raise NumericsError("softmax input is outside int8")
    if not 0 <= input_multiplier <= INT32_MAX or not 0 <= input_left_shift <= 31 or diff_min > 0:
        raise NumericsError(f"softmax parameters out of range: multiplier {input_multiplier}, left shift "
                            f"{input_left_shift}, diff_min {diff_min} (need diff_min <= 0)")
    if not -128 <= output_zero_point <= 127:
        raise NumericsError(f"softmax output zero point {output_zero_point} is outside int8")
    if min(-diff_min, 255) << input_left_shift > 1 << 31:
        raise NumericsError(f"softmax diff_min {diff_min} with left shift {input_left_shift} overflows int32 "
                            f"(softmax_params keeps -diff_min << left_shift within 31 * 2**26)")
    if rows.size == 0:
        return np.zeros(rows.shape, dtype=np.int8)
    diff = rows - rows.max(axis=1, keepdims=True)
    included = diff >= diff_min
    exps = _softmax_exponentials(int(input_multiplier), int(input_left_shift), int(diff_min))[diff + 255]
    # Rescale<12>: Q0 to Q12.19 is a rounding shift right by 12 bits; the int32 sum cannot wrap below 512.
    sums = np.where(included, fixedpoint.rounding_divide_by_pot_array(exps, SOFTMAX_ACCUMULATION_INTEGER_BITS),
                    0).sum(axis=1)
    if np.any(sums >= _SOFTMAX_MAX_SUM):
        raise NumericsError("a SOFTMAX row's sum of exponentials reaches 512 (output shift above 31): "
                            "TFLite's reference kernel aborts on it")
    headroom_plus_one = fixedpoint.count_leading_zeros_32(sums)
    num_bits_over_unit = SOFTMAX_ACCUMULATION_INTEGER_BITS - headroom_plus_one
    sum_minus_one = ((sums << headroom_plus_one) & 0xFFFFFFFF) - (1 << 31)  # the sum in [1, 2), less 1, as Q0
    unique_sums, where = np.unique(sum_minus_one, return_inverse=True)
    reciprocal = np.array([fixedpoint.one_over_one_plus_x_for_x_in_0_1(int(v)) for v in unique_sums],
                          dtype=np.int64)[where.reshape(-1)]
    probability = fixedpoint.rounding_divide_by_pot_array(
        fixedpoint.saturating_rounding_doubling_high_mul_array(reciprocal[:, None], exps),
        (num_bits_over_unit + 31 - 8)[:, None])
    return np.clip(np.where(included, probability, 0) + int(output_zero_point), -128, 127).astype(np.int8)


def lut_populate(function, input_scale, input_zero_point, output_scale, output_zero_point) -> np.ndarray:
    """int8 table of TFLite's ``LUTPopulateInt8`` (kernels/internal/common.h), used by its int8 EXP (and ELU, GELU).

    In float32: ``dequantized = s_in * (q - z_in)``, ``transformed = f(dequantized)``,
    ``round(transformed * (1 / s_out))`` half away from zero (``std::round``), plus
    ``z_out``, saturated. ``function`` is evaluated in float64 and rounded to
    float32, i.e. the correctly rounded float function, as glibc's ``expf`` is.
    """
    s_in, s_out = np.float32(input_scale), np.float32(output_scale)
    if not (np.isfinite(s_in) and np.isfinite(s_out) and s_in > 0 and s_out > 0):
        raise NumericsError("table scales must be positive and finite")
    dequantized = s_in * (np.arange(-128, 128) - int(input_zero_point)).astype(np.float32)
    with np.errstate(over="ignore"):
        transformed = np.asarray(function(dequantized.astype(np.float64)), dtype=np.float64).astype(np.float32)
        scaled = (transformed * (np.float32(1.0) / s_out)).astype(np.float64)
    rounded = np.where(np.isfinite(scaled), np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), np.sign(scaled) * 256)
    return np.clip(rounded + int(output_zero_point), -128, 127).astype(np.int8)


def tflite_gelu(x) -> np.ndarray:
    """TFLite's ``GeluTransform`` in float32: ``0.5f * x * erfc(x * float(-sqrt(1/2)))``.

    Older TFLite wrote ``0.5f * x * (1 + erf(x * M_SQRT1_2))`` in double; both give
    the same table on every entry of the fixture tests/fixtures/tflite/gelu.npz.
    """
    x32 = np.asarray(x, dtype=np.float32)
    scaled = x32 * np.float32(-math.sqrt(0.5))
    complement = np.array([math.erfc(float(v)) for v in scaled.ravel()], dtype=np.float32).reshape(scaled.shape)
    return (np.float32(0.5) * x32 * complement).astype(np.float64)


def tflite_gelu_tanh(x) -> np.ndarray:
    """TFLite's ``GeluTransformApproximate``, all float32:
    ``0.5f * x * (1 + tanh(float(sqrt(2/pi)) * (x + 0.044715f * x * x * x)))``."""
    x32 = np.asarray(x, dtype=np.float32)
    inner = x32 + np.float32(0.044715) * x32 * x32 * x32
    t = np.tanh((np.float32(math.sqrt(2.0 / math.pi)) * inner).astype(np.float64)).astype(np.float32)
    return (np.float32(0.5) * x32 * (np.float32(1.0) + t)).astype(np.float64)
