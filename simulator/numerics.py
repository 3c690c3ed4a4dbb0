"""Integer arithmetic of the NPU's output stage, bit-exact with TFLite's reference kernels.

This is the single definition of requantization used twice: the compiler calls
the multiplier functions to precompute per-channel (multiplier, shift) pairs,
and the simulator calls the requantize functions to execute them.

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

Floats appear only where TFLite uses them: turning float32 scales into a
multiplier at preparation time.
"""

from __future__ import annotations

import math
from enum import IntEnum

import numpy as np

from .errors import NumericsError

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1


class Rounding(IntEnum):
    """Requantization rounding variant; values are the stream's Rounding enum."""

    TFLITE_DOUBLE = 0
    TFLITE_SINGLE = 1
    FLOAT64 = 2


def quantize_multiplier(real_multiplier: float, rounding: Rounding = Rounding.TFLITE_DOUBLE):
    """TFLite ``QuantizeMultiplier``: split a non-negative real into (multiplier, shift).

    ``frexp`` gives q in [0.5, 1); q * 2**31 is rounded half away from zero
    (``TfLiteRound``). Multipliers below about 2**-31 flush to zero as in TFLite.
    """
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


def add_multipliers(input_scale, input2_scale, output_scale, rounding=Rounding.TFLITE_DOUBLE):
    """(m1, s1, m2, s2, m_out, s_out) as TFLite's int8 ADD ``Prepare`` computes them.

    Both inputs are brought to twice the larger input scale; the output
    multiplier undoes that and the ``ADD_LEFT_SHIFT`` headroom.
    """
    s1, s2, so = (float(np.float32(s)) for s in (input_scale, input2_scale, output_scale))
    if min(s1, s2, so) <= 0:
        raise NumericsError("ADD scales must be positive")
    twice_max = 2.0 * max(s1, s2)
    reals = (s1 / twice_max, s2 / twice_max, twice_max / ((1 << ADD_LEFT_SHIFT) * so))
    if reals[2] >= 1.0:
        raise NumericsError(f"ADD output multiplier {reals[2]:.3g} must be below 1 (output scale too small)")
    pairs = [quantize_multiplier(r, rounding) for r in reals]
    return tuple(v for pair in pairs for v in pair)


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


def _truncating_shift_right(values: np.ndarray, bits: int) -> np.ndarray:
    """C++ integer division by 2**bits, which rounds toward zero."""
    return np.where(values >= 0, values >> bits, -((-values) >> bits))


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
    right = np.maximum(-s, 0)
    # SaturatingRoundingDoublingHighMul: the only overflow is INT32_MIN * INT32_MIN.
    product = x * m
    nudge = np.where(product >= 0, np.int64(1 << 30), np.int64(1 - (1 << 30)))
    high = _truncating_shift_right(product + nudge, 31)
    high = np.where((x == INT32_MIN) & (m == INT32_MIN), INT32_MAX, high)
    # RoundingDivideByPOT: round half away from zero.
    mask = (np.int64(1) << right) - 1
    remainder = high & mask
    threshold = (mask >> 1) + (high < 0)
    return (high >> right) + (remainder > threshold)


def requantize(acc, multiplier, shift, output_zero_point, act_min, act_max,
               rounding=Rounding.TFLITE_DOUBLE, out_dtype=np.int8):
    """Output stage: rescale accumulators, add the output zero point, clamp, narrow."""
    info = np.iinfo(out_dtype)
    if not info.min <= act_min <= act_max <= info.max:
        raise NumericsError(f"activation clamp [{act_min}, {act_max}] is outside {np.dtype(out_dtype).name}")
    scaled = multiply_by_quantized_multiplier(acc, multiplier, shift, rounding)
    return np.clip(scaled + int(output_zero_point), act_min, act_max).astype(out_dtype)


def elementwise_add(x1, x2, zp1, zp2, zp_out, m1, s1, m2, s2, m_out, s_out, left_shift, act_min, act_max,
                    rounding=Rounding.TFLITE_DOUBLE):
    """TFLite reference int8 ``AddElementwise`` on whole arrays."""
    a = wrap_signed((np.asarray(x1, np.int64) - zp1) << left_shift, 32)
    b = wrap_signed((np.asarray(x2, np.int64) - zp2) << left_shift, 32)
    total = wrap_signed(multiply_by_quantized_multiplier(a, m1, s1, rounding)
                        + multiply_by_quantized_multiplier(b, m2, s2, rounding), 32)
    return requantize(total, m_out, s_out, zp_out, act_min, act_max, rounding)


def float_scales(input_scale, weight_scales, output_scale) -> np.ndarray:
    """Per-channel double scales of ``Rounding.FLOAT64``, in TFLite's operation order."""
    s_in, s_out = float(np.float32(input_scale)), float(np.float32(output_scale))
    if s_in <= 0 or s_out <= 0:
        raise NumericsError("scales must be positive")
    return np.array([s_in * float(np.float32(s)) / s_out for s in np.atleast_1d(weight_scales)], dtype=np.float64)


def requantize_float(acc, scales, output_zero_point, act_min, act_max, out_dtype=np.int8):
    """``Rounding.FLOAT64`` output stage: C ``round`` of acc * scale, then zero point and clamp."""
    if not np.all(np.isfinite(scales)) or np.any(np.asarray(scales) < 0):
        raise NumericsError("float requantization scales must be finite and non-negative")
    product = np.asarray(acc, dtype=np.int64).astype(np.float64) * scales
    if not np.all(np.abs(product) < 2.0 ** 62):
        raise NumericsError("float requantization overflows: scale too large for the accumulators")
    truncated = np.trunc(product)
    rounded = truncated + np.where(np.abs(product - truncated) >= 0.5, np.sign(product), 0.0)
    scaled = wrap_signed(rounded.astype(np.int64), 32)
    return np.clip(scaled + int(output_zero_point), act_min, act_max).astype(out_dtype)


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
    from . import fixedpoint

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
    from . import fixedpoint

    return _activation_table(input_scale, input_zero_point, fixedpoint.logistic, 31 - 8, -128)


def tanh_table(input_scale, input_zero_point) -> np.ndarray:
    """int8 TANH of every input -128..127, as reference_integer_ops::Tanh computes it.

    TFLite fixes the output qparams at scale 1/128, zero point 0.
    """
    from . import fixedpoint

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
    from . import fixedpoint

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
