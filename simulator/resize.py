"""TFLite's integer bilinear resize: the one definition the compiler and the RESIZE_BILINEAR kernel share.

Reproduces ``reference_ops::ResizeBilinearInteger`` (tensorflow/lite/kernels/internal/reference/
resize_bilinear.h), which TFLite's reference kernel runs for int8 (and int16): positions are fixed point
with ``FRACTION_BITS`` = 10 fractional bits, the four neighbours are weighted by products of 10-bit
fractions (20 bits in all) in 64-bit integers, and the sum is rounded back to an integer. It interpolates
the raw integers, so input and output share one scale and zero point. No float anywhere.

Positions (``ComputeInterpolationValuesInteger``): output index ``i`` samples input position
``s = i * step + offset``, with ``step = round(1024 * in / out)`` (``round(1024 * (in - 1) / (out - 1))``
with ``align_corners``) and ``offset = step / 2 - 512`` with ``half_pixel_centers``, else 0. It reads
rows ``lo = max(s / 1024, 0)`` and ``hi = min((s + 1023) / 1024, size - 1)``, C division truncating toward
zero, weighted ``1024 - (s - 1024 * lo)`` and ``s - 1024 * lo``. A tile whose first input row is ``r``
samples ``s - 1024 * r``: the same rows and weights (see :func:`tile_offset`).

Rounding of the 20-bit fraction: TFLite's default build (``Rounding.TFLITE_DOUBLE``) adds ``2**19`` with
the sign of the sum (half away from zero); ``TFLITE_SINGLE_ROUNDING`` (``Rounding.TFLITE_SINGLE``) adds
``2**19`` whatever the sign; both then divide truncating toward zero, and the result is cast to int8.
"""

from __future__ import annotations

import numpy as np

from .errors import NumericsError
from .numerics import Rounding

FRACTION_BITS = 10
ONE = 1 << FRACTION_BITS
"""An input pixel in position units."""
HALF = 1 << (2 * FRACTION_BITS - 1)
"""Half of the 20-bit product of two fractions: the rounding term."""
ROUNDINGS = (Rounding.TFLITE_DOUBLE, Rounding.TFLITE_SINGLE)
"""The two builds of TFLite's kernel; the float modes have no meaning here."""


def _c_div(a: np.ndarray, b: int) -> np.ndarray:
    """C++ integer division of int64 values by a positive constant: truncation toward zero."""
    quotient = np.abs(a) // b
    return np.where(a < 0, -quotient, quotient)


def bilinear_step(in_size: int, out_size: int, align_corners: bool) -> int:
    """TFLite's ``height_scale_10`` / ``width_scale_10``: input pixels per output pixel, 10-bit fixed point."""
    if in_size < 1 or out_size < 1:
        raise NumericsError(f"resize from {in_size} to {out_size} pixels: sizes must be positive")
    if align_corners and out_size > 1:
        return (ONE * (in_size - 1) + (out_size - 1) // 2) // (out_size - 1)
    return (ONE * in_size + out_size // 2) // out_size


def bilinear_offset(step: int, half_pixel_centers: bool) -> int:
    """Position of output index 0: ``step / 2 - 512`` with half-pixel centres (C division; step > 0), else 0."""
    return step // 2 - ONE // 2 if half_pixel_centers else 0


def source_rows(position: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi): the two input rows (or columns) a position reads, clamped into ``size`` as TFLite clamps."""
    position = np.asarray(position, dtype=np.int64)
    return np.maximum(_c_div(position, ONE), 0), np.minimum(_c_div(position + ONE - 1, ONE), size - 1)


def tile_offset(first_output: int, step: int, offset: int, first_input: int) -> int:
    """The offset of a tile whose outputs start at ``first_output`` and whose input rows start at
    ``first_input``: its positions are the image's, less ``first_input`` pixels."""
    return first_output * step + offset - ONE * first_input


def resize_bilinear(ifm: np.ndarray, out_height: int, out_width: int, step_h: int, step_w: int, offset_h: int,
                    offset_w: int, rounding: Rounding = Rounding.TFLITE_DOUBLE) -> np.ndarray:
    """int8 [out_height, out_width, C] from int8 ``ifm`` [H, W, C] (``ResizeBilinearInteger``, one image)."""
    if rounding not in ROUNDINGS:
        raise NumericsError(f"bilinear resize rounds as TFLite's kernel builds do, not {rounding.name}")
    height, width, _ = ifm.shape
    y = np.arange(out_height, dtype=np.int64) * step_h + offset_h
    x = np.arange(out_width, dtype=np.int64) * step_w + offset_w
    (y0, y1), (x0, x1) = source_rows(y, height), source_rows(x, width)
    fy, fx = (y - ONE * y0)[:, None, None], (x - ONE * x0)[None, :, None]
    values = ifm.astype(np.int64)
    total = ((values[y0][:, x0] * (ONE - fy) + values[y1][:, x0] * fy) * (ONE - fx)
             + (values[y0][:, x1] * (ONE - fy) + values[y1][:, x1] * fy) * fx)
    bias = np.where(total > 0, HALF, -HALF) if rounding == Rounding.TFLITE_DOUBLE else HALF
    return _c_div(total + bias, ONE * ONE).astype(np.int8)
