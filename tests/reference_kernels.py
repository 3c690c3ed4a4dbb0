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
