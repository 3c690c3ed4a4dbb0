"""Integer arithmetic of the NPU's output stage, bit-exact with TFLite's reference kernels.

This is the single definition of requantization used twice: the compiler calls
the multiplier functions to precompute per-channel (multiplier, shift) pairs,
and the simulator calls the requantize functions to execute them. The same
holds for the elementwise ADD, SUB and MUL. Its neighbours keep that rule for
the rest: :mod:`simulator.tables` (activation tables), :mod:`simulator.softmax`,
:mod:`simulator.resize` (bilinear resize), :mod:`simulator.onnxruntime_numerics` (``Rounding.ONNXRUNTIME``), all on the
gemmlowp primitives of :mod:`simulator.fixedpoint`.

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
  float32 division rounded half to even (:mod:`simulator.onnxruntime_numerics`). The
  elementwise, pooling and mean units and the look-up tables reproduce it bit
  for bit; the MAC array keeps its exact integer accumulator and rounds
  ``acc * scale`` half to even (:func:`requantize_float`), which differs from
  onnxruntime's float32 FMA chain only where the exact value lies within about
  1e-5 of a step from a .5 tie (a few outputs per 100,000).

Accumulators (:func:`narrow_accumulator`): the exact sum is written to a register of
``NpuConfig.accumulator_bits``; a value outside its range *overflows* and is wrapped (two's
complement, as TFLite's int32 accumulators do in practice) or saturated, as the configuration says.

Floats appear only where the reference uses them: TFLite turning float32
scales into a multiplier at preparation time, onnxruntime computing in float32.
"""

from __future__ import annotations

import math
from enum import IntEnum
from fractions import Fraction

import numpy as np

from . import fixedpoint
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


def split_q31(real_multiplier: float) -> tuple[int, int]:
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
    q_fixed, shift = split_q31(real_multiplier)
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


def batch_matmul_multiplier(input_scale, input2_scale, output_scale, rounding=Rounding.TFLITE_DOUBLE):
    """(multiplier, shift) of int8 BATCH_MATMUL, as TFLite's ``batch_matmul.cc`` ``Prepare``.

    It calls the same ``GetQuantizedConvolutionMultipler`` as FULLY_CONNECTED with the two activations
    as input and filter (scales multiplied in float32, divided in double), then ``QuantizeMultiplier``;
    its reference kernel (``reference_ops::BatchMatMul``) requantizes the int32 sum of centred products
    with ``MultiplyByQuantizedMultiplier``, as :func:`requantize` does.
    """
    multiplier, shift = fully_connected_multiplier(input_scale, input2_scale, output_scale, rounding)
    return int(multiplier[0]), int(shift[0])


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


def saturate_signed(values: np.ndarray, bits: int) -> np.ndarray:
    """int64 values clamped to the range of a ``bits``-wide two's-complement register."""
    return np.clip(np.asarray(values, dtype=np.int64), -(1 << (bits - 1)), (1 << (bits - 1)) - 1)


ACCUMULATOR_OVERFLOWS = {"wrap": wrap_signed, "saturate": saturate_signed}
"""What an accumulator register does with a value it cannot hold, by ``NpuConfig.accumulator_overflow``;
the stream's ``AccumulatorOverflow`` enum names the same modes in upper case."""


def narrow_accumulator(exact: np.ndarray, bits: int, overflow: str) -> tuple[np.ndarray, int]:
    """The ``bits``-wide accumulator register written with ``exact`` values, and how many overflowed.

    The adder tree feeding the register is exact; only the write-back narrows. An element overflows when
    its exact value lies outside [-2**(bits-1), 2**(bits-1) - 1]. ``"wrap"`` keeps the low ``bits`` bits
    (two's complement; the same as wrapping after every addition, since wrapping is a ring homomorphism),
    ``"saturate"`` clamps to the register's range. Partial sums are never observable, so the order of
    additions does not matter in either mode.
    """
    try:
        narrow = ACCUMULATOR_OVERFLOWS[overflow]
    except KeyError:
        raise NumericsError(f"unknown accumulator overflow {overflow!r}; known: "
                            f"{', '.join(ACCUMULATOR_OVERFLOWS)}") from None
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    exact = np.asarray(exact)
    if exact.size == 0 or (low <= exact.min() and exact.max() <= high):
        return exact, 0  # nothing to narrow: the register holds every value as it is (int64, or exact float64)
    exact = exact.astype(np.int64)
    overflowed = int(np.count_nonzero((exact < low) | (exact > high)))
    return narrow(exact, bits), overflowed


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
    if rounding == Rounding.TFLITE_DOUBLE:
        fast = _requantize_double_in_float64(acc, multiplier, shift, output_zero_point, act_min, act_max, out_dtype)
        if fast is not None:
            return fast
    scaled = multiply_by_quantized_multiplier(acc, multiplier, shift, rounding)
    return np.clip(scaled + int(output_zero_point), act_min, act_max).astype(out_dtype)


FLOAT64_REQUANTIZE_PRODUCTS = 1 << 52
"""|acc * 2**left_shift * multiplier| below this: :func:`requantize`'s float64 path is exact."""
FLOAT64_REQUANTIZE_MAX_RIGHT_SHIFT = 21
"""Right shifts up to this keep the float64 path's rounding offsets within its 53 bits."""
REQUANTIZE_BLOCK = 1 << 15
"""Accumulators the float64 path requantizes at a time (256 KiB of float64: an L2-sized block)."""


def _requantize_double_in_float64(acc, multiplier, shift, output_zero_point, act_min, act_max, out_dtype):
    """``Rounding.TFLITE_DOUBLE`` requantization in eight float64 passes, exactly; None where it cannot be exact.

    With ``F = (x << L) * m`` (no int32 wrap: checked) the high multiply is ``h = floor(F / 2**31 + 1/2)``
    (``(F + 2**30) >> 31``; for ``F < 0`` gemmlowp's nudge ``1 - 2**30`` and truncation give the same floor, and
    the saturating case needs ``m = -2**31``, impossible). The rounding shift by ``R >= 1`` is
    ``floor((h + 2**(R-1) - [h < 0]) / 2**R)``, and ``floor((floor(t) + c) / D) = floor((t + c) / D)`` for
    integer ``c`` and ``D``, so the result is one floor: ``floor(F / 2**(31+R) + 2**-(1+R) + 1/2 - [F < -2**30] /
    2**R)`` (for ``R = 0``: ``floor(F / 2**31 + 1/2)``). ``F / 2**(31+R)`` is ``x`` times the per-channel
    ``m / 2**(31+R-L)``, an integer times a power of two; it and the sum with the offset are exact while
    ``|F| < 2**52`` and ``R <= 21`` (all values then lie on a grid of ``2**-(31+R)`` within 53 bits).
    """
    x = np.asarray(acc)
    m = np.asarray(multiplier, dtype=np.int64)
    s = np.asarray(shift, dtype=np.int64)
    _check_multipliers(m, s)
    if x.size == 0:
        return None
    left, right = np.maximum(s, 0), np.maximum(-s, 0)
    largest = max(abs(int(x.max())), abs(int(x.min())))
    shifted = largest << int(left.max())
    if (shifted > INT32_MAX or shifted * int(m.max()) >= FLOAT64_REQUANTIZE_PRODUCTS
            or int(right.max()) > FLOAT64_REQUANTIZE_MAX_RIGHT_SHIFT):
        return None
    scale = m * np.exp2((left - right - 31).astype(np.float64))
    half = -np.exp2((-1 - right).astype(np.float64))
    offset = -half + np.where(right > 0, 0.5, 0.0)
    negative = np.where(right > 0, np.exp2(-right.astype(np.float64)), 0.0)
    # In blocks that stay in cache, into buffers allocated once: fresh large temporaries cost more than the math.
    channels = x.shape[-1] if x.ndim else 1
    rows = x.reshape(-1, channels)
    out = np.empty(rows.shape, out_dtype)
    step = max(1, REQUANTIZE_BLOCK // channels)
    u = np.empty((min(step, rows.shape[0]), channels))
    below, w = np.empty(u.shape, bool), np.empty(u.shape)
    for start in range(0, rows.shape[0], step):
        block = rows[start:start + step]
        v, mask, w = u[:block.shape[0]], below[:block.shape[0]], w[:block.shape[0]]
        np.multiply(block, scale, out=v, casting="unsafe")
        np.less(v, half, out=mask)
        v += offset
        np.multiply(mask, negative, out=w)
        v -= w
        np.floor(v, out=v)
        v += int(output_zero_point)
        np.clip(v, act_min, act_max, out=v)
        out[start:start + step] = v
    return out.reshape(x.shape)


INT64_SHIFT_RANGE = (-31, 7)
"""Shifts TFLite's int64 ``MultiplyByQuantizedMultiplier`` accepts (it asserts ``shift >= -31 && shift < 8``)."""

INT64_ACCUMULATOR_RANGE = (-(1 << 47), (1 << 47) - 1)
"""The input domain TFLite's int64 ``MultiplyByQuantizedMultiplier`` asserts: ``-(1 << 47) <= x < (1 << 47)``."""


def multiply_by_quantized_multiplier_int64(acc, multiplier, shift):
    """TFLite ``MultiplyByQuantizedMultiplier(int64_t x, int32_t m, int shift)`` (internal/common.cc), vectorized.

    The output stage of TFLite's 16x8 kernels, which is not the int32 function on a wider input: the
    multiplier is first rounded to 16 bits, ``(m + 2**15) >> 16`` (``0x7FFF`` once m >= 0x7FFF0000), and
    the product shifted right once by ``15 - shift`` after adding half of its last step, i.e. rounded half
    up (toward +inf) where the int32 path rounds half away from zero twice; the two can differ by one.
    TFLite's ``TFLITE_SINGLE_ROUNDING`` flag selects between two identical bodies of it, so there is one
    variant. The result is the low 32 bits (TFLite's cast to int32_t). Refuses what TFLite asserts against:
    a negative multiplier, a shift outside ``INT64_SHIFT_RANGE``, an accumulator outside
    ``INT64_ACCUMULATOR_RANGE`` (inside it the product with a 16-bit multiplier stays below 2**62, exact in int64).
    """
    x = np.asarray(acc, dtype=np.int64)
    m = np.asarray(multiplier, dtype=np.int64)
    s = np.asarray(shift, dtype=np.int64)
    low, high = INT64_SHIFT_RANGE
    if np.any(m < 0) or np.any(m > INT32_MAX):
        raise NumericsError("requantization multiplier must be an int32 >= 0")
    if np.any(s < low) or np.any(s > high):
        bad = int(s[(s < low) | (s > high)].reshape(-1)[0])
        raise NumericsError(f"16x8 requantization shift {bad} is outside [{low}, {high}]")
    if np.any(x < INT64_ACCUMULATOR_RANGE[0]) or np.any(x > INT64_ACCUMULATOR_RANGE[1]):
        raise NumericsError("16x8 accumulator outside [-2**47, 2**47), the domain of TFLite's int64 requantization")
    reduced = np.where(m < 0x7FFF0000, (m + (1 << 15)) >> 16, 0x7FFF)
    total_shift = 15 - s
    return wrap_signed((x * reduced + (np.int64(1) << (total_shift - 1))) >> total_shift, 32)


def requantize_16x8(acc, multiplier, shift, output_zero_point, act_min, act_max):
    """Output stage of TFLite's 16x8 convolution (reference_integer_ops::ConvPerChannel, int16 input):
    int64 requantization (:func:`multiply_by_quantized_multiplier_int64`), zero point (0 in TFLite, which
    adds none), clamp to [act_min, act_max] within int16."""
    info = np.iinfo(np.int16)
    if not info.min <= act_min <= act_max <= info.max:
        raise NumericsError(f"activation clamp [{act_min}, {act_max}] is outside int16")
    scaled = multiply_by_quantized_multiplier_int64(acc, multiplier, shift)
    return np.clip(scaled + int(output_zero_point), act_min, act_max).astype(np.int16)


def conv_multipliers_16x8(input_scale, weight_scales, output_scale):
    """Per-channel (multiplier, shift) of a 16x8 convolution: TFLite prepares them as for int8
    (:func:`conv_multipliers`, in double); its int64 output stage then takes only shifts up to 7, i.e.
    real multipliers below 2**7 (TFLite asserts; the NPU refuses the layer)."""
    multiplier, shift = conv_multipliers(input_scale, weight_scales, output_scale)
    if np.any(shift > INT64_SHIFT_RANGE[1]):
        raise NumericsError(f"16x8 requantization multiplier s_in * s_w / s_out needs shift {int(shift.max())}, "
                            f"but TFLite's int64 output stage takes at most {INT64_SHIFT_RANGE[1]}")
    return multiplier, shift


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
