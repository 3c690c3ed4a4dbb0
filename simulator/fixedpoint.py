"""gemmlowp fixed-point arithmetic, as TFLite's reference kernels use it.

Two users: the compiler (through :mod:`simulator.numerics`) fills the 256-entry
look-up tables of int8 LOGISTIC, TANH and HARD_SWISH by evaluating TFLite's own
fixed-point algorithm on every input, which makes the NPU's table look-up
bit-exact with the reference interpreter; and the simulator's SOFTMAX kernel
(``softmax.softmax``) runs exp, the reciprocal and the output rescale here.

Names and constants follow gemmlowp's fixedpoint.h; a raw value with ``b``
integer bits represents ``raw / 2**(31 - b)``. The scalar functions take and
return Python ints; the ``*_array`` functions are their element-wise numpy
forms on int64 arrays holding int32 values (one definition of the rounding,
used by ``numerics.multiply_by_quantized_multiplier`` too).
"""

from __future__ import annotations

import numpy as np

INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1


def wrap32(x: int) -> int:
    return ((x + (1 << 31)) & 0xFFFFFFFF) - (1 << 31)


def saturating_rounding_doubling_high_mul(a: int, b: int) -> int:
    if a == b == INT32_MIN:
        return INT32_MAX
    product = a * b
    nudge = (1 << 30) if product >= 0 else 1 - (1 << 30)
    total = product + nudge
    return total // (1 << 31) if total >= 0 else -((-total) // (1 << 31))


def rounding_divide_by_pot(x: int, exponent: int) -> int:
    mask = (1 << exponent) - 1
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if (x & mask) > threshold else 0)


def saturating_rounding_multiply_by_pot(x: int, exponent: int) -> int:
    if exponent < 0:
        return rounding_divide_by_pot(x, -exponent)
    threshold = (1 << (31 - exponent)) - 1
    if x > threshold:
        return INT32_MAX
    if x < -threshold:
        return INT32_MIN
    return wrap32(x << exponent)


def rounding_half_sum(a: int, b: int) -> int:
    total = a + b
    sign = 1 if total >= 0 else -1
    value = total + sign
    return value // 2 if value >= 0 else -((-value) // 2)


_mul = saturating_rounding_doubling_high_mul
ONE_Q0 = INT32_MAX          # gemmlowp's One() when there are no integer bits
ONE_Q2 = 1 << 29


def exp_on_interval_between_negative_one_quarter_and_0_excl(a: int) -> int:
    """exp(a) for a in [-1/4, 0), Q0 in and out: Taylor expansion around -1/8."""
    constant_term, one_third = 1895147668, 715827883
    x = wrap32(a + (1 << 28))
    x2 = _mul(x, x)
    x3 = _mul(x2, x)
    x4 = _mul(x2, x2)
    x4_over_4 = saturating_rounding_multiply_by_pot(x4, -2)
    poly = saturating_rounding_multiply_by_pot(wrap32(_mul(wrap32(x4_over_4 + x3), one_third) + x2), -1)
    return wrap32(constant_term + _mul(constant_term, wrap32(x + poly)))


_EXP_BARREL = ((-2, 1672461947), (-1, 1302514674), (0, 790015084), (1, 290630308), (2, 39332535),
               (3, 720401), (4, 242))
"""(exponent, Q0 raw of exp(-2**exponent)) of gemmlowp's barrel shifter."""


def exp_on_negative_values(a: int, integer_bits: int) -> int:
    """exp(a) for a <= 0 given with ``integer_bits``; result in Q0."""
    fractional_bits = 31 - integer_bits
    one_quarter = 1 << (fractional_bits - 2)
    a_mod_quarter_minus_one_quarter = wrap32((a & (one_quarter - 1)) - one_quarter)
    result = exp_on_interval_between_negative_one_quarter_and_0_excl(
        saturating_rounding_multiply_by_pot(a_mod_quarter_minus_one_quarter, integer_bits))
    remainder = wrap32(a_mod_quarter_minus_one_quarter - a)
    for exponent, multiplier in _EXP_BARREL:
        if integer_bits > exponent and remainder & (1 << (fractional_bits + exponent)):
            result = _mul(result, multiplier)
    if integer_bits > 5 and a < -(1 << (36 - integer_bits)):
        result = 0
    return ONE_Q0 if a == 0 else result


def _newton_reciprocal_of_half_denominator(a: int) -> int:
    """Newton-Raphson for 1 / ((1 + a) / 2) with a in (0, 1): Q2 result."""
    half_denominator = rounding_half_sum(a, ONE_Q0)
    x = wrap32(1515870810 + _mul(half_denominator, -1010580540))  # 48/17 - 32/17 * d
    for _ in range(3):
        one_minus_dx = wrap32(ONE_Q2 - _mul(half_denominator, x))
        x = wrap32(x + saturating_rounding_multiply_by_pot(_mul(x, one_minus_dx), 2))
    return x


def one_over_one_plus_x_for_x_in_0_1(a: int) -> int:
    return saturating_rounding_multiply_by_pot(_newton_reciprocal_of_half_denominator(a), 1)


def one_minus_x_over_one_plus_x_for_x_in_0_1(a: int) -> int:
    return saturating_rounding_multiply_by_pot(wrap32(_newton_reciprocal_of_half_denominator(a) - ONE_Q2), 2)


def logistic(a: int, integer_bits: int) -> int:
    """gemmlowp::logistic: Q(integer_bits) in, Q0 out."""
    if a == 0:
        return 1 << 30
    positive = one_over_one_plus_x_for_x_in_0_1(exp_on_negative_values(-abs(a), integer_bits))
    return positive if a > 0 else wrap32(ONE_Q0 - positive)


def tanh(a: int, integer_bits: int) -> int:
    """gemmlowp::tanh: Q(integer_bits) in, Q0 out."""
    if a == 0:
        return 0
    magnitude = one_minus_x_over_one_plus_x_for_x_in_0_1(exp_on_negative_values(-abs(a), integer_bits + 1))
    return wrap32(-magnitude) if a < 0 else magnitude


INT16_MIN, INT16_MAX = -(1 << 15), (1 << 15) - 1


def _saturate16(x: int) -> int:
    return min(max(x, INT16_MIN), INT16_MAX)


def saturating_rounding_doubling_high_mul_16(a: int, b: int) -> int:
    """gemmlowp's int16 SaturatingRoundingDoublingHighMul."""
    if a == b == INT16_MIN:
        return INT16_MAX
    product = a * b
    total = product + ((1 << 14) if product >= 0 else 1 - (1 << 14))
    return total // (1 << 15) if total >= 0 else -((-total) // (1 << 15))


def saturating_doubling_high_mul_16(a: int, b: int) -> int:
    """TFLite hard_swish.h's non-rounding int16 variant (it cancels the rounding bias)."""
    if a == b == INT16_MIN:
        return INT16_MAX
    product = a * b
    return product // (1 << 15) if product >= 0 else -((-product) // (1 << 15))


def downscale_multiplier_to_int16(multiplier: int) -> int:
    """TFLite DownScaleInt32ToInt16Multiplier: round a Q31 multiplier to Q15."""
    if multiplier >= INT32_MAX - (1 << 15):
        return INT16_MAX
    return (multiplier + (1 << 15)) >> 16


def hard_swish(input_value: int, reluish_multiplier: int, reluish_exponent: int, output_multiplier: int,
               output_exponent: int) -> int:
    """reference_ops::HardSwish for one centred int8 input; returns the value before the output offset."""
    hires = wrap32(input_value * (1 << 7))
    preshift_output = saturating_rounding_doubling_high_mul_16(hires, output_multiplier)
    reluish = hires
    if reluish_exponent > 0:
        reluish = _saturate16(reluish * (1 << (reluish_exponent - 1)))
    reluish = saturating_rounding_doubling_high_mul_16(reluish, reluish_multiplier)
    if reluish_exponent > 0:
        reluish = _saturate16(reluish * 2)
    if reluish_exponent < 0:
        reluish = rounding_divide_by_pot(reluish, -reluish_exponent)
    reluish = (reluish + (1 << 15)) >> 1
    preshift = saturating_doubling_high_mul_16(reluish, preshift_output)
    return rounding_divide_by_pot(preshift, -output_exponent)


def saturating_rounding_doubling_high_mul_array(a, b) -> np.ndarray:
    """Element-wise SaturatingRoundingDoublingHighMul: high word of 2ab, nudged to round half away from zero.

    The only overflow, INT32_MIN * INT32_MIN, saturates to INT32_MAX.
    """
    a, b = np.broadcast_arrays(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))
    product = a * b
    total = product + np.where(product >= 0, np.int64(1 << 30), np.int64(1 - (1 << 30)))
    high = np.where(total >= 0, total >> 31, -((-total) >> 31))  # C++ division truncates toward zero
    return np.where((a == INT32_MIN) & (b == INT32_MIN), np.int64(INT32_MAX), high)


def rounding_divide_by_pot_array(x, exponent) -> np.ndarray:
    """Element-wise RoundingDivideByPOT: arithmetic shift right by 0..31, rounding half away from zero."""
    x, exponent = np.broadcast_arrays(np.asarray(x, dtype=np.int64), np.asarray(exponent, dtype=np.int64))
    mask = (np.int64(1) << exponent) - 1
    threshold = (mask >> 1) + (x < 0)
    return (x >> exponent) + ((x & mask) > threshold)


def count_leading_zeros_32(x) -> np.ndarray:
    """Element-wise ``__builtin_clz`` of positive values below 2**32 (TFLite's CountLeadingZeros)."""
    value = np.asarray(x, dtype=np.int64).copy()
    floor_log2 = np.zeros_like(value)
    for bits in (16, 8, 4, 2, 1):
        step = np.where(value >= (np.int64(1) << bits), bits, 0)
        floor_log2 += step
        value >>= step
    return 31 - floor_log2
