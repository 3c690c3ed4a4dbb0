"""onnxruntime's QDQ arithmetic (``Rounding.ONNXRUNTIME``), reproduced bit for bit in numpy.

onnxruntime runs a QDQ graph literally (graph optimizations off): every
DequantizeLinear -> float op -> QuantizeLinear chain in float32 with MLAS's
kernels, in MLAS's operation order, quantizing by a float32 division rounded
half to even. The elementwise, pooling and mean units and the look-up tables
follow that exactly (measured against onnxruntime 1.32 on x86 with FMA3:
tests/fixtures/oracle/onnxruntime_ops.npz); the MAC array does not (see
:func:`simulator.numerics.requantize_float`).
"""

from __future__ import annotations

import functools

import numpy as np

from . import mlas
from .errors import NumericsError


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
