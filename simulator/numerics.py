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

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
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
    weights = np.atleast_1d(np.asarray(weight_scales, np.float32)).astype(np.float64)  # exact widening
    return quantize_multipliers(s_in * weights / s_out, rounding)


def quantize_multipliers(reals: np.ndarray, rounding: Rounding = Rounding.TFLITE_DOUBLE
                         ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize_multiplier` of every element of a float64 array, as int32 (multipliers, shifts): a
    per-channel layer has hundreds, and the pattern check, the codegen and calibration each ask for them. Every
    step is exact in float64 (``frexp``; ``q * 2**31`` scales by a power of two; adding 0.5 to a number below
    2**31 and flooring), so the values are the scalar function's."""
    reals = np.asarray(reals, np.float64)
    bad = ~np.isfinite(reals) | (reals < 0)
    if bad.any():
        split_q31(float(reals[bad][0]))  # raises NumericsError with the scalar's message
    q, shift = np.frexp(reals)
    q_fixed = np.floor(q * float(1 << 31) + 0.5).astype(np.int64)
    carried = q_fixed == (1 << 31)
    q_fixed = np.where(carried, q_fixed // 2, q_fixed)
    shift = np.where(carried, shift + 1, shift).astype(np.int64)
    flushed = (reals == 0.0) | (shift < -31)
    q_fixed, shift = np.where(flushed, 0, q_fixed), np.where(flushed, 0, shift)
    large = shift > 30
    if large.any():
        if rounding != Rounding.TFLITE_SINGLE:
            quantize_multiplier(float(reals[large][0]), rounding)  # raises NumericsError with its message
        q_fixed, shift = np.where(large, INT32_MAX, q_fixed), np.where(large, 30, shift)
    return q_fixed.astype(np.int32), shift.astype(np.int32)


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
               rounding=Rounding.TFLITE_DOUBLE, out_dtype=np.int8, largest: int | None = None):
    """Output stage: rescale accumulators, add the output zero point, clamp, narrow. ``largest``: ``max|acc|``
    (or a bound of it) when the caller knows it, instead of a scan."""
    info = np.iinfo(out_dtype)
    if not info.min <= act_min <= act_max <= info.max:
        raise NumericsError(f"activation clamp [{act_min}, {act_max}] is outside {np.dtype(out_dtype).name}")
    if rounding == Rounding.TFLITE_DOUBLE:
        fast = _requantize_double_in_float64(acc, multiplier, shift, output_zero_point, act_min, act_max, out_dtype,
                                             largest)
        if fast is not None:
            return fast
    scaled = multiply_by_quantized_multiplier(acc, multiplier, shift, rounding)
    return np.clip(scaled + int(output_zero_point), act_min, act_max).astype(out_dtype)


FLOAT64_EXACT_UNITS = 1 << 53
"""Integer multiples of a power of two are exact in float64 below this many of them (53-bit significand)."""
TILED = (False, True, True)
"""Which of (scale, constant, nudge) :meth:`Float64Requantizer.bind` tiles to a whole block: the additions gain
most from a same-shape operand, and a stream's tiles are read on every run, so the multiply keeps its row..."""
TILE_SCALE_BELOW = 64
"""...except for fewer channels than this, where a row is too short a loop for the multiply too."""
REQUANTIZE_BLOCK = 1 << 15
"""Accumulators the float64 path requantizes at a time (256 KiB of float64): large blocks spend fewer calls,
and the tiled constants (:meth:`Float64Requantizer.bind`) of one block stay small."""


@dataclass(frozen=True)
class Float64Requantizer:
    """``Rounding.TFLITE_DOUBLE`` requantization of one set of channels, folded into float64 constants once.

    Exactly TFLite's ``MultiplyByQuantizedMultiplier`` (plus bias, zero point and clamp) for every
    accumulator ``|acc| <= limit``, in five float64 passes (eight where the clamp lets negative values
    through): ``w = acc * scale + constant``, ``w -= nudge`` where ``w < 1/2``, clamp, floor, add the zero
    point. Why it is exact: with ``F = ((acc + bias) << L) * m`` (no int32 wrap: ``limit`` sees to it) the high
    multiply is ``h = floor(F / 2**31 + 1/2)`` (``(F + 2**30) >> 31``; for ``F < 0`` gemmlowp's nudge
    ``1 - 2**30`` and truncation give the same floor, and the saturating case needs ``m = -2**31``,
    impossible). The rounding shift by ``R >= 1`` is ``floor((h + 2**(R-1) - [h < 0]) / 2**R)``, and
    ``floor((floor(t) + c) / D) = floor((t + c) / D)`` for integer ``c`` and ``D``, so the result is one floor,
    ``floor(F / 2**(31+R) + 2**-(1+R) + 1/2 - [F < -2**30] / 2**R)`` (for ``R = 0``: ``floor(F / 2**31 + 1/2)``),
    and ``F < -2**30`` is ``w < 1/2``. Every value on the way is an integer multiple of ``g = 2**(L-R-31)``
    (``scale = m * g``), so each float64 operation is exact while the multiples stay below 2**53: ``limit`` is
    the largest ``|acc|`` for which they do in every channel (negative: none). The floor of a value already
    clamped to the output range, plus the zero point, is a small integer: exact too.
    """

    scale: np.ndarray
    """Per channel ``m * 2**(L-R-31)``."""
    constant: np.ndarray
    """Per channel ``bias * scale + 2**-(1+R) [R > 0] + 1/2``."""
    nudge: np.ndarray | None
    """Per channel ``2**-R [R > 0]``, subtracted below 1/2; None when the clamp makes it irrelevant (every
    value below 1/2 floors to at most 0, and the clamp's low end, ``act_min - zero_point``, is at least 0) or
    no channel shifts right."""
    low: float
    high: float
    """The clamp relative to the zero point: ``act_min - zero_point``, ``act_max - zero_point``."""
    zero_point: int
    limit: int
    limits: np.ndarray | None = None
    """Per channel, the largest ``|acc|`` that channel is exact for (``limit`` is their minimum; -1: none)."""
    folded_limits: np.ndarray | None = None
    """The same with ``zero_point + 128`` added to :attr:`constant` too, for an int8 output (:meth:`bind`'s
    ``fold``): the values then stay non-negative, so truncation is the floor even without a clamp at 0."""

    def apply(self, acc: np.ndarray, out: np.ndarray, work: np.ndarray | None = None) -> None:
        """Requantize exact integer accumulators ``acc [..., C]`` (any numeric type) into ``out`` (a signed integer
        array of the same shape, e.g. an SRAM view); the caller has checked ``max|acc| <= limit``. ``work``: a
        float64 scratch of at least :meth:`work_size` elements to use instead of allocating one."""
        self.bind(acc, out, work)()

    @staticmethod
    def work_size(channels: int) -> int:
        """Float64 scratch elements :meth:`bind` needs for ``channels`` channels: two blocks."""
        return 2 * max(REQUANTIZE_BLOCK, channels)

    def bind(self, acc: np.ndarray, out: np.ndarray, work: np.ndarray | None = None,
             tiles: dict | None = None, scaled: bool = False, fold: bool = False) -> Callable[[], None]:
        """:meth:`apply` on whatever the arrays ``acc`` and ``out`` hold, as one call whose block views are made
        here (a prepared command requantizes the same places on every run). With ``tiles`` (a dict the caller
        keeps), the per-channel constants are tiled to a whole block once, shared by binds of equal constants:
        numpy runs a same-shape operation as one loop, where broadcasting a row runs one loop per row.
        ``scaled``: ``acc`` (float64, overwritten) already holds ``acc * scale + constant``, exactly (a product
        that folded them in, :meth:`simulator.macs.SumPlan.bind_scaled`); the rest of the stage runs on it.
        ``fold`` (an int8 ``out`` whose caller has checked ``max|acc|`` against :attr:`folded_limits`): the constant
        also carries ``zero_point + 128`` (already in ``acc`` when ``scaled``), so that a clamp that lets negative
        values through also ends in the truncating cast to unsigned, then ``+ 128`` modulo 256, instead of a floor
        and a cast of signed values."""
        relu = self.low >= 0
        fold = fold and not relu and out.dtype == np.int8
        offset = self.zero_point + 128 if fold else 0
        if scaled:
            return self._bind_scaled(acc, out, offset)
        channels = acc.shape[-1] if acc.ndim else 1
        rows, dst = acc.reshape(-1, channels), out.reshape(-1, channels)
        # A clamp that keeps only values >= 0 (a fused ReLU) makes truncation the floor: the float64 value is cast
        # to the unsigned type of the same width and the zero point added there, modulo 2**bits (the result lies in
        # the output type, so its bits are right).
        if relu or offset:
            dst = dst.view(_UNSIGNED[dst.dtype.itemsize])
        count = rows.shape[0]
        step = max(1, REQUANTIZE_BLOCK // channels)
        # In blocks that stay in cache, into buffers allocated once: fresh large temporaries cost more than the math.
        size = min(step, count) * channels
        if work is None:
            work = np.empty(2 * size)
        w_all, b_all = work[:size].reshape(-1, channels), work[size:2 * size].reshape(-1, channels)
        m_all = np.empty((min(step, count), channels), bool) if self.nudge is not None else None
        blocks = []
        for start in range(0, count, step):
            n = min(step, count - start)
            blocks.append((rows[start:start + n], dst[start:start + n], w_all[:n],
                           (b_all[:n], m_all[:n]) if self.nudge is not None else None))
        zero = self._zero(dst, relu, offset)
        constants = (self.scale, self.constant + offset if offset else self.constant, self.nudge)
        if tiles is not None:
            rows_per_block = min(step, count)
            key = tuple(a.tobytes() if a is not None else None for a in constants)
            rows, full = tiles.get(key, (0, None))
            if rows < rows_per_block:  # one tile per set of constants, the largest any block needs
                old = sum(a.nbytes for a in full if a is not None) if full is not None else 0
                full = tuple(None if a is None else np.ascontiguousarray(
                    np.broadcast_to(a, (rows_per_block, channels))) if tiled else a
                    for a, tiled in zip(constants, (channels < TILE_SCALE_BELOW, *TILED[1:])))
                tiles[key] = rows_per_block, full
                tiles["nbytes"] = tiles.get("nbytes", 0) + sum(a.nbytes for a in full if a is not None) - old
            constants = lambda n: tuple(None if a is None else a[:n] if a.ndim == 2 else a for a in full)
        else:
            constants = functools.partial(lambda c, n: c, constants)
        block = self._unsigned_block if relu or offset else self._block
        # np.clip's Python wrapper costs more than its loop on a small block; two ufuncs cost less there.
        clamp = _clamp if size >= SMALL_BLOCK else _clamp_small
        low, high, threshold = np.float64(self.low + offset), np.float64(self.high + offset), np.float64(0.5 + offset)
        calls = [functools.partial(block, *b, zero, *constants(b[0].shape[0]), clamp, low, high, threshold)
                 for b in blocks]
        if len(calls) == 1:
            return calls[0]
        return lambda: [call() for call in calls] and None

    def _zero(self, dst: np.ndarray, relu: bool, offset: int):
        """What the last step adds: the zero point modulo 2**bits to an unsigned result (``relu``), 128 to a folded
        one (``offset``: zero point and 128 are already in), the zero point to a floored one."""
        if offset:
            return dst.dtype.type(128)
        return dst.dtype.type(self.zero_point % (1 << (8 * dst.itemsize))) if relu else self.zero_point

    def _bind_scaled(self, values: np.ndarray, out: np.ndarray, offset: int) -> Callable[[], None]:
        channels = values.shape[-1]
        rows, dst = values.reshape(-1, channels), out.reshape(-1, channels)
        relu = self.low >= 0
        if relu or offset:
            dst = dst.view(_UNSIGNED[dst.dtype.itemsize])
        below = (np.empty(rows.shape), np.empty(rows.shape, bool)) if self.nudge is not None else None
        clamp = _clamp if rows.size >= SMALL_BLOCK else _clamp_small
        block = self._unsigned_block if relu or offset else self._block
        return functools.partial(block, rows, dst, rows, below, self._zero(dst, relu, offset), None, None, self.nudge,
                                 clamp, np.float64(self.low + offset), np.float64(self.high + offset),
                                 np.float64(0.5 + offset))

    @staticmethod
    def _clamped(rows, w, below, scale, constant, nudge, clamp, low, high, threshold) -> None:
        """Into ``w``: the rows scaled and offset (when ``scale`` is given), nudged down by ``nudge`` below
        ``threshold`` (when ``below`` is given), clamped; what both blocks share before their floor."""
        if scale is not None:
            np.multiply(rows, scale, out=w)
            np.add(w, constant, out=w)
        if below is not None:
            amount, mask = below
            np.less(w, threshold, out=mask)
            np.multiply(mask, nudge, out=amount)
            np.subtract(w, amount, out=w)
        clamp(w, low, high)

    @staticmethod
    def _unsigned_block(rows, dst, w, below, zero, scale, constant, nudge, clamp, low, high, threshold) -> None:
        """A clamp at or above 0: the truncating cast to unsigned is the floor; then ``zero`` modulo 2**bits."""
        Float64Requantizer._clamped(rows, w, below, scale, constant, nudge, clamp, low, high, threshold)
        np.copyto(dst, w, casting="unsafe")
        np.add(dst, zero, out=dst)

    @staticmethod
    def _block(rows, dst, w, below, zero, scale, constant, nudge, clamp, low, high, threshold) -> None:
        Float64Requantizer._clamped(rows, w, below, scale, constant, nudge, clamp, low, high, threshold)
        np.floor(w, out=w)
        np.add(w, zero, out=dst, casting="unsafe")


SMALL_BLOCK = 1 << 13
"""Blocks below this many elements clamp with two ufuncs instead of ``np.clip``."""


def _clamp(w: np.ndarray, low, high) -> None:
    w.clip(low, high, out=w)


def _clamp_small(w: np.ndarray, low, high) -> None:
    np.maximum(w, low, out=w)
    np.minimum(w, high, out=w)


_UNSIGNED = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32), 8: np.dtype(np.uint64)}
"""The unsigned type of each width, for :meth:`Float64Requantizer.apply`'s truncating cast."""


def float64_requantizer(multiplier, shift, output_zero_point: int, act_min: int, act_max: int,
                        bias=None) -> Float64Requantizer:
    """The :class:`Float64Requantizer` of per-channel (or scalar) multipliers and shifts, bias folded in.

    Refuses invalid multipliers and shifts as :func:`multiply_by_quantized_multiplier` does. The exactness
    bound is computed in int64 from the terms' sizes in units of ``g`` (module docstring of the class).
    """
    m = np.atleast_1d(np.asarray(multiplier, dtype=np.int64))
    s = np.atleast_1d(np.asarray(shift, dtype=np.int64))
    _check_multipliers(m, s)
    m, s = np.broadcast_arrays(m, s)
    b = np.zeros(m.shape, np.int64) if bias is None else np.asarray(bias, dtype=np.int64)
    m, s, b = np.broadcast_arrays(m, s, b)
    left, right = np.maximum(s, 0), np.maximum(-s, 0)
    # In units of g = 2**(L-R-31): an accumulator's term |acc| * m, the bias's |bias| * m, the offsets
    # 2**-(1+R) [R > 0] + 1/2 and the nudge 2**-R [R > 0] (exponents >= 0: L <= 30, and R > 0 means L = 0).
    offset_units = (np.where(right > 0, np.int64(1) << np.maximum(30 - left, 0), 0)
                    + (np.int64(1) << (30 + right - left)))
    nudge_units = np.where(right > 0, np.int64(1) << np.maximum(31 - left, 0), 0)
    big = np.abs(b).astype(np.float64) * m.astype(np.float64) >= 2.0 ** 62
    bias_units = np.where(big, 0, np.abs(b) * np.where(big, 0, m))
    room = FLOAT64_EXACT_UNITS - 1 - bias_units - offset_units - nudge_units
    per_channel = np.where(m > 0, room // np.maximum(m, 1), np.iinfo(np.int64).max)
    per_channel = np.minimum(per_channel, (INT32_MAX >> left) - np.abs(b))  # TFLite's int32 (acc << L) never wraps
    per_channel = np.where(big | (room < 0), -1, per_channel)
    limit = int(per_channel.min())
    # zero_point + 128 (an int8 output's offset to unsigned) in units of g, where it fits in int64 at all.
    fold_exponent = 31 + right - left
    offset = abs(int(output_zero_point) + 128)
    fits = fold_exponent + max(offset, 1).bit_length() < 62
    fold_units = np.where(fits, np.int64(offset) << np.where(fits, fold_exponent, 0), 0)
    folded_room = room - fold_units
    folded = np.where(m > 0, folded_room // np.maximum(m, 1), np.iinfo(np.int64).max)
    folded = np.minimum(folded, (INT32_MAX >> left) - np.abs(b))
    folded = np.where(big | ~fits | (folded_room < 0), -1, folded)
    scale = m * np.exp2((left - right - 31).astype(np.float64))
    constant = b * scale + np.where(right > 0, np.exp2((-1 - right).astype(np.float64)), 0.0) + 0.5
    nudge = np.where(right > 0, np.exp2(-right.astype(np.float64)), 0.0)
    relevant = act_min - output_zero_point < 0 and np.any(right > 0)
    return Float64Requantizer(scale, constant, nudge if relevant else None, float(act_min - output_zero_point),
                              float(act_max - output_zero_point), int(output_zero_point), limit, per_channel, folded)


def largest_magnitude(values: np.ndarray) -> int:
    """``max |values|`` as a Python int (0 for an empty array)."""
    if values.size == 0:
        return 0
    return max(abs(int(values.max())), abs(int(values.min())))


@functools.lru_cache(maxsize=256)
def _cached_requantizer(multiplier: bytes, shift: bytes, output_zero_point: int, act_min: int, act_max: int):
    return float64_requantizer(np.frombuffer(multiplier, np.int64), np.frombuffer(shift, np.int64), output_zero_point,
                               act_min, act_max)


def _requantize_double_in_float64(acc, multiplier, shift, output_zero_point, act_min, act_max, out_dtype,
                                  largest=None):
    """``Rounding.TFLITE_DOUBLE`` requantization by a :class:`Float64Requantizer`; None where it cannot be exact.

    A stream's commands requantize with the same numbers on every run: their plans are kept (a few hundred)."""
    x = np.asarray(acc)
    m, s = np.asarray(multiplier, np.int64), np.asarray(shift, np.int64)
    if m.ndim > 1 or s.ndim > 1:
        return None
    plan = _cached_requantizer(m.tobytes(), s.tobytes(), int(output_zero_point), int(act_min), int(act_max))
    if x.size == 0 or plan.scale.ndim != 1 or (largest_magnitude(x) if largest is None else largest) > plan.limit:
        return None
    out = np.empty(x.shape, out_dtype)
    plan.apply(x, out)
    return out


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


@dataclass(frozen=True)
class Float64ScaleRequantizer:
    """``Rounding.FLOAT64`` requantization of one set of channels (:func:`requantize_float`), checked once.

    For accumulators with ``|acc| <= limit`` the double product ``acc * scale`` is below 2**31 in magnitude,
    so its rounding, half away from zero, needs no int32 wrap and cannot overflow: ``trunc`` of the product,
    plus one step away from zero where the (exactly computed) fractional part reaches 1/2.
    """

    scales: np.ndarray
    zero_point: int
    act_min: int
    act_max: int
    limit: int

    def apply(self, acc: np.ndarray, out: np.ndarray) -> None:
        """``acc [..., C]``: exact integer accumulators in a float type (bias added); ``out``: int8 of that shape."""
        product = np.multiply(acc, self.scales, dtype=np.float64)
        rounded = np.trunc(product)
        fraction = product - rounded  # exact: the fractional part of a double
        rounded += fraction >= 0.5
        rounded -= fraction <= -0.5
        rounded += self.zero_point
        np.clip(rounded, self.act_min, self.act_max, out=rounded)
        np.copyto(out, rounded, casting="unsafe")


def float64_scale_requantizer(scales, output_zero_point: int, act_min: int, act_max: int) -> Float64ScaleRequantizer:
    """The :class:`Float64ScaleRequantizer` of per-channel double scales (refused as :func:`requantize_float` does)."""
    scales = np.atleast_1d(np.asarray(scales, dtype=np.float64))
    if not np.all(np.isfinite(scales)) or np.any(scales < 0):
        raise NumericsError("float requantization scales must be finite and non-negative")
    largest = float(scales.max(initial=0.0))
    limit = INT32_MAX if largest == 0 else int((2.0 ** 31 - 2) / largest / (1 + 2.0 ** -40))
    return Float64ScaleRequantizer(scales, int(output_zero_point), int(act_min), int(act_max), limit)


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
