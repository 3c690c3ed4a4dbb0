"""TFLite's int8 SOFTMAX (reference kernel): gemmlowp fixed point over each row.

``softmax_params`` is what the compiler precomputes, ``softmax`` what the
softmax unit executes.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import fixedpoint
from .errors import NumericsError
from .numerics import INT32_MAX, split_q31


SOFTMAX_DIFF_INTEGER_BITS = 5
"""Integer bits of the rescaled input differences fed to exp (softmax.h, kScaledDiffIntegerBits: Q5.26)."""
SOFTMAX_ACCUMULATION_INTEGER_BITS = 12
"""Integer bits of the sum of exponentials (softmax.h, kAccumulationIntegerBits: Q12.19)."""
_SOFTMAX_MAX_SUM = 1 << (31 - SOFTMAX_ACCUMULATION_INTEGER_BITS + 9)
"""Raw Q12.19 sum of 512: from there the output shift exceeds 31 and TFLite's kernel aborts."""


SOFTMAX_OUTPUT = (1.0 / 256, -128)
"""(scale, zero point): TFLite's int8 SOFTMAX exists only with this output."""


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
    multiplier, left_shift = split_q31(real)
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
