"""Slow, independent reference of the NPU's integer operators, written from the TFLite spec.

Loop per output element, Python integers only, no numpy vectorization and no
import of ``simulator.numerics``: a second oracle beside the TFLite interpreter.
Follows tensorflow/lite/kernels/internal/common.h (default double rounding).
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


def conv2d(x, w, bias, mult, shift, in_zp, out_zp, act, stride, dilation, padding, depthwise=False):
    """x: [H][W][C] ints; w: [OC][KH][KW][IC] (depthwise: [C][KH][KW]); padding (t, l, b, r)."""
    h, wd = len(x), len(x[0])
    oc_count = len(w)
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
                            acc += (x[iy][ix][oc] - in_zp) * w[oc][ky][kx]
                        else:
                            for ic in range(len(x[0][0])):
                                acc += (x[iy][ix][ic] - in_zp) * w[oc][ky][kx][ic]
                acc += bias[oc]
                value = multiply_by_quantized_multiplier(acc, mult[oc], shift[oc]) + out_zp
                out[oy][ox][oc] = min(max(value, act[0]), act[1])
    return out


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


def add(x1, x2, s1, zp1, s2, zp2, s_out, zp_out, act):
    """TFLite reference int8 ADD, element by element, parameters prepared as in add.cc."""
    left_shift = 20
    twice_max = 2.0 * max(s1, s2)
    m1, sh1 = quantize_multiplier(s1 / twice_max)
    m2, sh2 = quantize_multiplier(s2 / twice_max)
    mo, sho = quantize_multiplier(twice_max / ((1 << left_shift) * s_out))
    out = []
    for a, b in zip(x1, x2):
        a_scaled = multiply_by_quantized_multiplier((a - zp1) * (1 << left_shift), m1, sh1)
        b_scaled = multiply_by_quantized_multiplier((b - zp2) * (1 << left_shift), m2, sh2)
        value = multiply_by_quantized_multiplier(a_scaled + b_scaled, mo, sho) + zp_out
        out.append(min(max(value, act[0]), act[1]))
    return out


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
