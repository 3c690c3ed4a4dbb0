"""Slow, independent reference of the NPU's integer operators, written from the TFLite spec.

Loop per output element, Python integers only, no numpy vectorization and no
import of ``simulator.numerics``: a second oracle beside the TFLite interpreter.
Follows tensorflow/lite/kernels/internal/common.h (default double rounding).

The ``onnxruntime_*`` functions are the same for onnxruntime's QDQ execution,
written from its source (quantize_linear.cc, MLAS pooling.cpp): float32
arithmetic as Python floats rounded to float32 after every operation (a
double sum, difference, product or quotient of two float32 values rounds to
the correctly rounded float32 result), a second oracle beside onnxruntime.
"""

from __future__ import annotations

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def _wrap32(v: int) -> int:
    return ((v + (1 << 31)) % (1 << 32)) - (1 << 31)


def saturating_rounding_doubling_high_mul(a: int, b: int) -> int:
    if a == b == INT32_MIN:
        return INT32_MAX
    ab = a * b
    nudge = (1 << 30) if ab >= 0 else (1 - (1 << 30))
    total = ab + nudge
    # C++ division truncates toward zero
    quotient = abs(total) // (1 << 31)
    return quotient if total >= 0 else -quotient


def rounding_divide_by_pot(x: int, exponent: int) -> int:
    mask = (1 << exponent) - 1
    remainder = x & mask
    threshold = (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if remainder > threshold else 0)


def multiply_by_quantized_multiplier(x: int, multiplier: int, shift: int) -> int:
    left = shift if shift > 0 else 0
    right = -shift if shift < 0 else 0
    return rounding_divide_by_pot(saturating_rounding_doubling_high_mul(_wrap32(x * (1 << left)), multiplier), right)


def _conv2d_accumulators(x, w, bias, in_zp, stride, dilation, padding, depthwise):
    """Exact int accumulators [OH][OW][OC] (bias included): x [H][W][C], w [OC][KH][KW][IC] or, depthwise,
    [OC][KH][KW] with OC = m * C: output channel oc reads input channel oc // m (TFLite's depth multiplier)."""
    h, wd = len(x), len(x[0])
    oc_count = len(w)
    multiplier = oc_count // len(x[0][0])
    kh, kw = len(w[0]), len(w[0][0])
    span_h, span_w = dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1
    oh = (h + padding[0] + padding[2] - span_h) // stride[0] + 1
    ow = (wd + padding[1] + padding[3] - span_w) // stride[1] + 1
    out = [[[0] * oc_count for _ in range(ow)] for _ in range(oh)]
    for oy in range(oh):
        for ox in range(ow):
            for oc in range(oc_count):
                acc = 0
                for ky in range(kh):
                    for kx in range(kw):
                        iy = oy * stride[0] - padding[0] + ky * dilation[0]
                        ix = ox * stride[1] - padding[1] + kx * dilation[1]
                        if not (0 <= iy < h and 0 <= ix < wd):
                            continue  # padding holds the zero point: contributes 0
                        if depthwise:
                            acc += (x[iy][ix][oc // multiplier] - in_zp) * w[oc][ky][kx]
                        else:
                            for ic in range(len(x[0][0])):
                                acc += (x[iy][ix][ic] - in_zp) * w[oc][ky][kx][ic]
                out[oy][ox][oc] = acc + bias[oc]
    return out


def conv2d(x, w, bias, mult, shift, in_zp, out_zp, act, stride, dilation, padding, depthwise=False):
    """x: [H][W][C] ints; w: [OC][KH][KW][IC] (depthwise: [C][KH][KW]); padding (t, l, b, r)."""
    accs = _conv2d_accumulators(x, w, bias, in_zp, stride, dilation, padding, depthwise)
    return [[[min(max(multiply_by_quantized_multiplier(acc, mult[oc], shift[oc]) + out_zp, act[0]), act[1])
              for oc, acc in enumerate(pixel)] for pixel in row] for row in accs]


def multiply_by_quantized_multiplier_int64(x: int, multiplier: int, shift: int) -> int:
    """TFLite's ``MultiplyByQuantizedMultiplier(int64_t x, ...)`` (internal/common.cc): the multiplier rounded to
    16 bits, then one arithmetic shift right by ``15 - shift`` after adding half a step; the low 32 bits."""
    reduced = (multiplier + (1 << 15)) >> 16 if multiplier < 0x7FFF0000 else 0x7FFF
    total_shift = 15 - shift
    return _wrap32((x * reduced + (1 << (total_shift - 1))) >> total_shift)  # Python's >> floors, as C++'s does


def conv2d_16x8(x, w, bias, mult, shift, act, stride, dilation, padding):
    """TFLite's reference_integer_ops::ConvPerChannel for int16 input and an int64 bias: exact accumulator,
    no zero points (16x8 is symmetric), the int64 output stage, the clamp. Arguments as :func:`conv2d`."""
    accs = _conv2d_accumulators(x, w, bias, 0, stride, dilation, padding, False)
    return [[[min(max(multiply_by_quantized_multiplier_int64(acc, mult[oc], shift[oc]), act[0]), act[1])
              for oc, acc in enumerate(pixel)] for pixel in row] for row in accs]


def conv2d_onnxruntime(x, w, bias, s_in, w_scales, s_out, in_zp, out_zp, act, stride, dilation, padding,
                       depthwise=False):
    """The NPU's ONNXRUNTIME convolution: the exact accumulator times the double scale
    ``s_in * s_w / s_out`` (float32 scales widened), rounded half to even, computed with fractions."""
    from fractions import Fraction

    accs = _conv2d_accumulators(x, w, bias, in_zp, stride, dilation, padding, depthwise)
    scales = [Fraction(float(s_in) * float(s_w) / float(s_out)) for s_w in w_scales]
    return [[[min(max(round(Fraction(acc) * scales[oc]) + out_zp, act[0]), act[1])  # round(): half to even
              for oc, acc in enumerate(pixel)] for pixel in row] for row in accs]


def fully_connected(x, w, bias, mult, shift, in_zp, out_zp, act):
    """x: [N][IC]; w: [OC][IC]."""
    out = []
    for row in x:
        values = []
        for oc, weights in enumerate(w):
            acc = sum((v - in_zp) * wv for v, wv in zip(row, weights)) + bias[oc]
            value = multiply_by_quantized_multiplier(acc, mult[oc], shift[oc]) + out_zp
            values.append(min(max(value, act[0]), act[1]))
        out.append(values)
    return out


def quantize_multiplier(real: float) -> tuple[int, int]:
    """TFLite QuantizeMultiplier, restated independently (frexp, round half away, 2**31 fix-up)."""
    if real == 0:
        return 0, 0
    import math

    q, shift = math.frexp(real)
    q_fixed = int(math.floor(q * 2**31 + 0.5))
    if q_fixed == 2**31:
        q_fixed, shift = q_fixed // 2, shift + 1
    if shift < -31:
        return 0, 0
    return q_fixed, shift


def conv_multipliers(s_in: float, w_scales, s_out: float, per_tensor_fully_connected: bool = False):
    """Per-channel (multiplier, shift) as TFLite prepares them, restated from its kernel_util.cc.

    CONV_2D / DEPTHWISE_CONV_2D / per-channel FULLY_CONNECTED (PopulateConvolutionQuantizationParams):
    ``double(s_in) * double(s_w) / double(s_out)`` per channel. Per-tensor FULLY_CONNECTED
    (GetQuantizedConvolutionMultipler): the product ``s_in * s_w`` is taken in float32 first, then
    divided in double. Each real multiplier then goes through :func:`quantize_multiplier`.
    Scales are float32 values.
    """
    import numpy as np

    pairs = []
    for s_w in w_scales:
        if per_tensor_fully_connected:
            real = float(np.float32(s_in) * np.float32(s_w)) / float(np.float32(s_out))
        else:
            real = float(np.float32(s_in)) * float(np.float32(s_w)) / float(np.float32(s_out))
        pairs.append(quantize_multiplier(real))
    return [m for m, _ in pairs], [e for _, e in pairs]


def _add_or_sub(sign: int, x1, x2, s1, zp1, s2, zp2, s_out, zp_out, act):
    """TFLite reference int8 ADD (sign 1) or SUB (sign -1), element by element. SUB prepares exactly as ADD
    (sub.cc PrepareGeneralSubOp, add.cc Prepare) and subtracts the rescaled inputs (reference/sub.h).
    Scales are float32 values."""
    left_shift = 20
    twice_max = 2.0 * max(s1, s2)
    m1, sh1 = quantize_multiplier(s1 / twice_max)
    m2, sh2 = quantize_multiplier(s2 / twice_max)
    mo, sho = quantize_multiplier(twice_max / ((1 << left_shift) * s_out))
    out = []
    for a, b in zip(x1, x2):
        a_scaled = multiply_by_quantized_multiplier((a - zp1) * (1 << left_shift), m1, sh1)
        b_scaled = multiply_by_quantized_multiplier((b - zp2) * (1 << left_shift), m2, sh2)
        value = multiply_by_quantized_multiplier(a_scaled + sign * b_scaled, mo, sho) + zp_out
        out.append(min(max(value, act[0]), act[1]))
    return out


def add(x1, x2, s1, zp1, s2, zp2, s_out, zp_out, act):
    return _add_or_sub(1, x1, x2, s1, zp1, s2, zp2, s_out, zp_out, act)


def sub(x1, x2, s1, zp1, s2, zp2, s_out, zp_out, act):
    return _add_or_sub(-1, x1, x2, s1, zp1, s2, zp2, s_out, zp_out, act)


def mean_hw(x, s_in, zp_in, s_out, zp_out):
    """TFLite reference int8 MEAN over height and width (QuantizedMeanOrSum); x is [H][W][C]."""
    h, w, c = len(x), len(x[0]), len(x[0][0])
    count = h * w
    multiplier, shift = quantize_multiplier(s_in / s_out)
    k = min(count.bit_length() - 1, 32, 31 + shift)
    multiplier, shift = (multiplier << k) // count, shift - k
    out = []
    for ch in range(c):
        total = sum(x[i][j][ch] for i in range(h) for j in range(w)) - zp_in * count
        value = multiply_by_quantized_multiplier(total, multiplier, shift) + zp_out
        out.append(min(max(value, -128), 127))
    return out


def fully_connected_float(x, w, bias, s_in, w_scales, s_out, in_zp, out_zp, act):
    """TFLite reference per-channel FULLY_CONNECTED: requantization in double with C round()."""
    import math

    out = []
    for row in x:
        values = []
        for oc, weights in enumerate(w):
            acc = sum((v - in_zp) * wv for v, wv in zip(row, weights)) + bias[oc]
            product = float(acc) * (s_in * w_scales[oc] / s_out)
            rounded = math.trunc(product)  # C round(): half away from zero
            if abs(product - rounded) >= 0.5:
                rounded += 1 if product > 0 else -1
            values.append(min(max(rounded + out_zp, act[0]), act[1]))
        out.append(values)
    return out


def pool(x, kind, kernel, stride, padding, act=(-128, 127)):
    """TFLite reference int8 MaxPool / AveragePool: only inputs inside the image count."""
    h, w, c = len(x), len(x[0]), len(x[0][0])
    oh = (h + padding[0] + padding[2] - kernel[0]) // stride[0] + 1
    ow = (w + padding[1] + padding[3] - kernel[1]) // stride[1] + 1
    out = [[[0] * c for _ in range(ow)] for _ in range(oh)]
    for oy in range(oh):
        for ox in range(ow):
            for ch in range(c):
                values = [x[iy][ix][ch]
                          for iy in range(oy * stride[0] - padding[0], oy * stride[0] - padding[0] + kernel[0])
                          for ix in range(ox * stride[1] - padding[1], ox * stride[1] - padding[1] + kernel[1])
                          if 0 <= iy < h and 0 <= ix < w]
                if kind == "max":
                    value = max(values)
                else:
                    acc, n = sum(values), len(values)
                    value = int((acc + n // 2) / n) if acc > 0 else -int((n // 2 - acc) / n)
                out[oy][ox][ch] = min(max(value, act[0]), act[1])
    return out


def _float32(value: float) -> float:
    """Round a double to the nearest float32 (what a C++ float expression stores)."""
    import struct

    return struct.unpack("f", struct.pack("f", value))[0]


def _clamp(value: int, act) -> int:
    return min(max(value, act[0]), act[1])


def mul(x1, x2, s1, zp1, s2, zp2, s_out, zp_out, act):
    """TFLite reference int8 MUL, element by element (reference/integer_ops/mul.h MulElementwise).

    mul.cc forms ``s1 * s2 / s_out`` in float32: both operations rounded to float32.
    """
    mult, shift = quantize_multiplier(_float32(_float32(s1 * s2) / s_out))
    return [_clamp(multiply_by_quantized_multiplier((a - zp1) * (b - zp2), mult, shift) + zp_out, act)
            for a, b in zip(x1, x2)]


# gemmlowp fixed point (fixedpoint.h), restated from its definitions: a raw int32 with b integer bits
# stands for raw / 2**(31 - b); "+" wraps, "*" is the rounding doubling high multiply.

def _exp_constant(value: float) -> int:
    """A Q0 constant as gemmlowp's GEMMLOWP_CHECKED_FIXEDPOINT_CONSTANT holds it: round(value * 2**31)."""
    import math

    return int(math.floor(value * 2 ** 31 + 0.5))


def _saturating_rounding_multiply_by_pot(x: int, exponent: int) -> int:
    if exponent <= 0:
        return rounding_divide_by_pot(x, -exponent)
    threshold = (1 << (31 - exponent)) - 1
    if x > threshold:
        return INT32_MAX
    if x < -threshold:
        return INT32_MIN
    return x * (1 << exponent)


def _exp_near_minus_one_eighth(a: int) -> int:
    """exp(a) for a in [-1/4, 0) (Q0 in and out): Taylor expansion around -1/8 to the fourth order."""
    import math

    srdhm = saturating_rounding_doubling_high_mul
    exp_minus_eighth, one_third = _exp_constant(math.exp(-1 / 8)), _exp_constant(1 / 3)
    x = _wrap32(a + (1 << 28))  # a + 1/8
    x2 = srdhm(x, x)
    x3 = srdhm(x2, x)
    x4 = srdhm(x2, x2)
    x4_over_4 = _saturating_rounding_multiply_by_pot(x4, -2)
    tail = _saturating_rounding_multiply_by_pot(_wrap32(srdhm(_wrap32(x4_over_4 + x3), one_third) + x2), -1)
    return _wrap32(exp_minus_eighth + srdhm(exp_minus_eighth, _wrap32(x + tail)))


def exp_on_negative_values(a: int, integer_bits: int) -> int:
    """gemmlowp exp_on_negative_values: a <= 0 with ``integer_bits``, result Q0."""
    import math

    fractional_bits = 31 - integer_bits
    quarter = 1 << (fractional_bits - 2)
    a_mod_quarter_minus_quarter = _wrap32((a & (quarter - 1)) - quarter)
    result = _exp_near_minus_one_eighth(_saturating_rounding_multiply_by_pot(a_mod_quarter_minus_quarter,
                                                                             integer_bits))
    remainder = _wrap32(a_mod_quarter_minus_quarter - a)  # a multiple of 1/4, the part still to apply
    for exponent in range(-2, 5):  # multiply by exp(-2**exponent) for each bit set in the remainder
        if integer_bits > exponent and remainder & (1 << (fractional_bits + exponent)):
            result = saturating_rounding_doubling_high_mul(result, _exp_constant(math.exp(-2.0 ** exponent)))
    if integer_bits > 5 and a < -(1 << (fractional_bits + 5)):  # below -32: zero
        result = 0
    return INT32_MAX if a == 0 else result


def one_over_one_plus_x_for_x_in_0_1(a: int) -> int:
    """gemmlowp: 1 / (1 + a) for a in [0, 1) (Q0), by three Newton-Raphson steps on the half denominator (Q2)."""
    srdhm = saturating_rounding_doubling_high_mul
    half_denominator = (a + INT32_MAX + 1) // 2  # RoundingHalfSum(a, 1): a non-negative sum, plus one, halved
    x = _wrap32(int(48 / 17 * 2 ** 29 + 0.5) + srdhm(half_denominator, -int(32 / 17 * 2 ** 29 + 0.5)))
    for _ in range(3):
        one_minus = _wrap32((1 << 29) - srdhm(half_denominator, x))
        x = _wrap32(x + _saturating_rounding_multiply_by_pot(srdhm(x, one_minus), 2))
    return _saturating_rounding_multiply_by_pot(x, 1)  # x / 2 in Q1 read as Q0: times 2


def softmax_params(s_in: float, beta: float = 1.0) -> tuple[int, int, int]:
    """TFLite SoftmaxPrepare (int8, kReference): PreprocessSoftmaxScaling(beta, s_in, 5) and
    diff_min = -CalculateInputRadius(5, left_shift, 31). Scales are float32 values."""
    import math

    real = min(beta * s_in * (1 << 26), (1 << 31) - 1.0)
    if real <= 1.0:
        raise ValueError("TFLite aborts: QuantizeMultiplierGreaterThanOne of a multiplier <= 1")
    multiplier, left_shift = quantize_multiplier(real)
    return multiplier, left_shift, -math.floor(31 * (1 << 26) / (1 << left_shift))


def softmax(rows, s_in, beta=1.0, zp_out=-128):
    """TFLite reference int8 SOFTMAX (reference_ops::Softmax), one row of ``rows`` at a time, element by element."""
    multiplier, left_shift, diff_min = softmax_params(s_in, beta)

    def exp_of(diff: int) -> int:
        rescaled = saturating_rounding_doubling_high_mul(_wrap32(diff * (1 << left_shift)), multiplier)
        return exp_on_negative_values(rescaled, 5)  # Q5.26 in, Q0 out

    out = []
    for row in rows:
        row_max = max(row)
        total = 0  # Q12.19
        for value in row:
            if value - row_max >= diff_min:
                total = _wrap32(total + rounding_divide_by_pot(exp_of(value - row_max), 12))
        # GetReciprocal(total, 12): normalise the sum to [1, 2), 1 / (1 + fraction), bits above 1 kept aside.
        headroom_plus_one = 32 - total.bit_length()
        num_bits_over_unit = 12 - headroom_plus_one
        reciprocal = one_over_one_plus_x_for_x_in_0_1(((total << headroom_plus_one) % (1 << 32)) - (1 << 31))
        exponent = num_bits_over_unit + 31 - 8
        if not 0 <= exponent <= 31:
            raise ValueError("TFLite aborts: output shift outside 0..31")
        values = []
        for value in row:
            if value - row_max >= diff_min:
                probability = rounding_divide_by_pot(
                    saturating_rounding_doubling_high_mul(reciprocal, exp_of(value - row_max)), exponent)
                values.append(min(max(probability + zp_out, -128), 127))
            else:
                values.append(zp_out)
        out.append(values)
    return out


# onnxruntime's QDQ execution (Rounding.ONNXRUNTIME), restated from quantize_linear.cc and MLAS pooling.cpp.

def onnxruntime_dequantize(q: int, scale: float, zp: int) -> float:
    """DequantizeLinear: float(int32(q) - zp) * scale, one float32 rounding."""
    return _float32(float(q - zp) * scale)


def onnxruntime_quantize(value: float, scale: float, zp: int) -> int:
    """QuantizeLinear: float32 division, clamp in float, round half to even (Python's round), then + zp."""
    v = min(max(_float32(value / scale), float(-128 - zp)), float(127 - zp))
    return round(v) + zp


def onnxruntime_binary(op, x1, x2, s1, zp1, s2, zp2, s_out, zp_out, act):
    """Add / Sub / Mul of dequantized inputs in float32 (``op`` on two floats), quantized, clamped."""
    return [_clamp(onnxruntime_quantize(_float32(op(onnxruntime_dequantize(a, s1, zp1),
                                                    onnxruntime_dequantize(b, s2, zp2))), s_out, zp_out), act)
            for a, b in zip(x1, x2)]


def _column_sum(dq, ix: int, y0: int, y1: int) -> float:
    """MLAS's column sum of rows y0..y1-1 (top to bottom, from the first); padding columns are 0.0."""
    if not 0 <= ix < len(dq[0]):
        return 0.0
    total = dq[y0][ix]
    for iy in range(y0 + 1, y1):
        total = _float32(total + dq[iy][ix])
    return total


def onnxruntime_avg_pool(x, kernel, stride, padding, s_in, zp_in, s_out, zp_out, act=(-128, 127)):
    """AveragePool (count_include_pad=0) as MlasPool2DVectorKernel sums; x is [H][W][C].

    Per output row: each input column summed over the window's valid rows, top
    to bottom, starting from the first; per output, its window's column sums
    (padding columns 0.0) added left to right from the window's first column;
    divided by the count of valid inputs. Width strides over 2 or windows over
    32 take MlasPool2DKernel: one sum from 0.0 over the valid window, row-major.
    """
    h, w, c = len(x), len(x[0]), len(x[0][0])
    (kh, kw), (sh, sw), (pt, pl, pb, pr) = kernel, stride, padding
    oh, ow = (h + pt + pb - kh) // sh + 1, (w + pl + pr - kw) // sw + 1
    vector = max(kh, kw) <= 32 and sw <= 2
    out = [[[0] * c for _ in range(ow)] for _ in range(oh)]
    for ch in range(c):
        dq = [[onnxruntime_dequantize(x[iy][ix][ch], s_in, zp_in) for ix in range(w)] for iy in range(h)]
        for oy in range(oh):
            y0, y1 = max(oy * sh - pt, 0), min(oy * sh - pt + kh, h)
            for ox in range(ow):
                x0, x1 = max(ox * sw - pl, 0), min(ox * sw - pl + kw, w)
                if vector:
                    start = ox * sw - pl
                    acc = _column_sum(dq, start, y0, y1)
                    for ix in range(start + 1, start + kw):
                        acc = _float32(acc + _column_sum(dq, ix, y0, y1))
                else:
                    acc = 0.0
                    for iy in range(y0, y1):
                        for ix in range(x0, x1):
                            acc = _float32(acc + dq[iy][ix])
                average = _float32(acc / float((y1 - y0) * (x1 - x0)))
                out[oy][ox][ch] = _clamp(onnxruntime_quantize(average, s_out, zp_out), act)
    return out


def onnxruntime_global_average(x, s_in, zp_in, s_out, zp_out, act=(-128, 127)):
    """GlobalAveragePool as MlasPoolGlobalKernel on x86; x is [H][W][C], the result [C].

    Four lane sums from 0.0 (lane j: elements j, j+4, ... of the row-major
    H*W values) while four remain, reduced (l0 + l2) + (l1 + l3), then the
    leftovers one by one, divided by H*W.
    """
    h, w, c = len(x), len(x[0]), len(x[0][0])
    out = []
    for ch in range(c):
        values = [onnxruntime_dequantize(x[iy][ix][ch], s_in, zp_in) for iy in range(h) for ix in range(w)]
        body = len(values) - len(values) % 4
        lanes = [0.0] * 4
        for i in range(0, body, 4):
            lanes = [_float32(lane + v) for lane, v in zip(lanes, values[i:i + 4])]
        total = _float32(_float32(lanes[0] + lanes[2]) + _float32(lanes[1] + lanes[3]))
        for v in values[body:]:
            total = _float32(total + v)
        out.append(_clamp(onnxruntime_quantize(_float32(total / float(len(values))), s_out, zp_out), act))
    return out


def _c_div(a: int, b: int) -> int:
    """C++ integer division: truncation toward zero."""
    quotient = abs(a) // abs(b)
    return quotient if (a >= 0) == (b > 0) else -quotient


def resize_bilinear(x, out_h, out_w, align_corners=False, half_pixel_centers=False, single_rounding=False):
    """TFLite reference int8 RESIZE_BILINEAR (reference_ops::ResizeBilinearInteger, resize_bilinear.h) of one
    image x [H][W][C]: 10-bit fixed-point positions, four 20-bit weights, int64 sum, rounded (default build:
    half away from zero; TFLITE_SINGLE_ROUNDING: + 2**19 whatever the sign), then truncated."""
    h, w, c = len(x), len(x[0]), len(x[0][0])

    def scale_10(size, out):
        if align_corners and out > 1:
            return _c_div((1 << 10) * (size - 1) + _c_div(out - 1, 2), out - 1)
        return _c_div((1 << 10) * size + _c_div(out, 2), out)

    def interpolation(value, scale, size):  # ComputeInterpolationValuesInteger
        scaled = value * scale + _c_div(scale, 2) - (1 << 9) if half_pixel_centers else value * scale
        return scaled, max(_c_div(scaled, 1 << 10), 0), min(_c_div(scaled + (1 << 10) - 1, 1 << 10), size - 1)

    sy, sx = scale_10(h, out_h), scale_10(w, out_w)
    out = [[[0] * c for _ in range(out_w)] for _ in range(out_h)]
    for oy in range(out_h):
        input_y, y0, y1 = interpolation(oy, sy, h)
        for ox in range(out_w):
            input_x, x0, x1 = interpolation(ox, sx, w)
            dy, dx = input_y - (1 << 10) * y0, input_x - (1 << 10) * x0
            for ch in range(c):
                total = (x[y0][x0][ch] * ((1 << 10) - dy) * ((1 << 10) - dx) + x[y1][x0][ch] * dy * ((1 << 10) - dx)
                         + x[y0][x1][ch] * ((1 << 10) - dy) * dx + x[y1][x1][ch] * dy * dx)
                rounding = (1 << 19) if single_rounding or total > 0 else -(1 << 19)
                out[oy][ox][ch] = _c_div(total + rounding, 1 << 20)
    return out


def batch_matmul(lhs, rhs, lhs_zp, rhs_zp, multiplier, shift, out_zp, adj_y=False):
    """TFLite reference int8 BATCH_MATMUL (reference_ops::BatchMatMul): lhs [B][M][K] times rhs [B][K][N]
    (adj_y: rhs [B][N][K], transposed), int32 sums of centred products, MultiplyByQuantizedMultiplier,
    output zero point, int8 clamp."""
    out = []
    for a, b in zip(lhs, rhs):
        columns = b if adj_y else [list(col) for col in zip(*b)]
        out.append([[min(max(multiply_by_quantized_multiplier(
            _wrap32(sum((u - lhs_zp) * (v - rhs_zp) for u, v in zip(row, col))), multiplier, shift) + out_zp,
            -128), 127) for col in columns] for row in a])
    return out
