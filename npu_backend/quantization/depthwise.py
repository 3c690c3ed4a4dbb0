"""A float32 depthwise convolution on NCHW planes, equal bit for bit to :mod:`simulator.macs`' NHWC one.

:func:`simulator.macs.depthwise_apply` sums a sample's taps with one ``einsum`` along whole NHWC output rows; on an
NCHW batch (ONNX models) that costs a transpose of the input and one of the output, and, with a column stride, a
gather per column tap. Here the taps are summed on the NCHW planes themselves, a block of channels at a time.

Why the values are the same: numpy's ``einsum`` kernel forms ``out + a * b`` with two roundings (its float loops
use no fused multiply-add), taking the taps in row-major order ``(ky, kx)`` from an output of zeros
(``tests/test_quantize_depthwise.py`` holds it to that). So does this module: ``tmp = w * x`` then
``out = out + tmp``, tap by tap, in the same order, from ``+0.0``. The taps that fall in the padding add
``w * 0 = ±0``, which changes no value: an output that starts at ``+0.0`` never becomes ``-0.0`` (a sum is
``-0.0`` only if both terms are), and ``y + (±0) = y`` for any other ``y``. Padding is therefore either skipped
(:func:`_strided_taps`) or read from a zero border (:func:`_flat_taps`), whichever is faster.
"""

from __future__ import annotations

import numpy as np

from simulator.isa import Convolution

BLOCK_ELEMENTS = 1 << 16
"""Values per working array (a block of channels of one sample): the input block, the products and the sums stay
in the core's cache across the taps."""
PLANE_MIN = 32 * 32
"""Output planes from this size on are summed here; smaller ones, with many channels, make long NHWC rows that the
``einsum`` walks faster than the short planes here."""


def applies(conv: Convolution) -> bool:
    """Whether :func:`depthwise_nchw_into` is the faster way for this depthwise convolution."""
    return conv.ofm.height * conv.ofm.width >= PLANE_MIN


def depthwise_nchw_into(x: np.ndarray, w: np.ndarray, conv: Convolution, dest: np.ndarray) -> None:
    """Depthwise sums of ``x [N, 1, C, H, W]`` float32 by ``w [OC, KH, KW]`` into ``dest [N, 1, OC, OH, OW]``
    (contiguous); output channel ``o`` reads input channel ``o // (OC / C)``."""
    if conv.stride == (1, 1):
        _flat_taps(x, w, conv, dest)
    else:
        _strided_taps(x, w, conv, dest)


def _valid(first: int, step: int, size: int, count: int) -> tuple[int, int]:
    """The outputs ``[lo, hi)`` whose input ``first + o * step`` lies in ``[0, size)``."""
    lo = min(count, 0 if first >= 0 else -(first // step))
    hi = 0 if first > size - 1 else min(count, (size - 1 - first) // step + 1)
    return lo, max(lo, hi)


def _strided_taps(x: np.ndarray, w: np.ndarray, conv: Convolution, dest: np.ndarray) -> None:
    """Each tap over the outputs whose input lies inside the image (the padding skipped), strided views of the
    planes: no padded copy, no gather."""
    n, _, c, h, width = x.shape
    m = w.shape[0] // c
    kh, kw = conv.kernel
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    pt, pl, _, _ = conv.padding
    oh, ow = conv.ofm.height, conv.ofm.width
    taps = []
    for ky in range(kh):
        y0 = ky * dh - pt
        ylo, yhi = _valid(y0, sh, h, oh)
        for kx in range(kw):
            x0 = kx * dw - pl
            xlo, xhi = _valid(x0, sw, width, ow)
            if ylo < yhi and xlo < xhi:
                taps.append((ky, kx, slice(ylo, yhi), slice(xlo, xhi),
                             slice(y0 + ylo * sh, y0 + (yhi - 1) * sh + 1, sh),
                             slice(x0 + xlo * sw, x0 + (xhi - 1) * sw + 1, sw)))
    planes = x.reshape(n, c, 1, h, width)
    out = dest.reshape(n, c, m, oh, ow)
    weights = w.reshape(c, m, kh, kw)
    block = max(1, BLOCK_ELEMENTS // (m * oh * ow))
    products = np.empty((block, m, oh, ow), np.float32)
    for s in range(n):
        for c0 in range(0, c, block):
            c1 = min(c, c0 + block)
            sums = out[s, c0:c1]
            sums.fill(0)
            for ky, kx, rows, cols, in_rows, in_cols in taps:
                region = sums[:, :, rows, cols]
                product = products[:c1 - c0, :, :rows.stop - rows.start, :cols.stop - cols.start]
                np.multiply(planes[s, c0:c1, :, in_rows, in_cols], weights[c0:c1, :, ky, kx, None, None], out=product)
                np.add(region, product, out=region)


def _flat_taps(x: np.ndarray, w: np.ndarray, conv: Convolution, dest: np.ndarray) -> None:
    """Stride 1: a block of planes copied into a zero border, each flattened with its padded row pitch, so that a
    tap is one contiguous run (the columns past the output's width are computed and dropped)."""
    n, _, c, h, width = x.shape
    m = w.shape[0] // c
    kh, kw = conv.kernel
    dh, dw = conv.dilation
    pt, pl, pb, pr = conv.padding
    oh, ow = conv.ofm.height, conv.ofm.width
    hp, wp = h + pt + pb, width + pl + pr
    length = oh * wp - (kw - 1) * dw  # the last row's columns past the output end before the padded plane does
    weights = w.reshape(c, m, kh, kw)
    block = max(1, BLOCK_ELEMENTS // (m * oh * wp))
    padded = np.zeros((block, hp * wp), np.float32)
    inner = padded.reshape(block, hp, wp)[:, pt:pt + h, pl:pl + width]
    wide = np.empty((block, m, oh * wp), np.float32)
    products = np.empty((block, m, length), np.float32)
    out = dest.reshape(n, c, m, oh, ow)
    for s in range(n):
        for c0 in range(0, c, block):
            k = min(c, c0 + block) - c0
            np.copyto(inner[:k], x[s, 0, c0:c0 + k])
            sums, product = wide[:k, :, :length], products[:k]
            for tap in range(kh * kw):
                ky, kx = divmod(tap, kw)
                start = ky * dh * wp + kx * dw
                np.multiply(padded[:k, None, start:start + length], weights[c0:c0 + k, :, ky, kx, None], out=product)
                np.add(sums if tap else np.float32(0), product, out=sums)
            np.copyto(out[s, c0:c0 + k], wide[:k].reshape(k, m, oh, wp)[..., :ow])
