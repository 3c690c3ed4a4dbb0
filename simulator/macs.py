"""The MAC array's exact sums, computed fast: ``sum((x - input_zero_point) * w)`` per output element.

The sums are exact integers whatever arithmetic computes them, as long as that
arithmetic never rounds. Every partial sum a BLAS kernel forms (in any order,
blocked, with or without fused multiply-add) is the sum of a subset of the
products, so its magnitude is at most the *bound* ``max|x - zp| * max_oc
sum(|w_oc|)`` (padding holds the zero point and adds 0). Every product and
partial sum is an integer, so each is represented exactly, and each floating
operation is exact, in float32 while the bound is below 2**24 and in float64
while it is below 2**53 (:func:`sum_dtype`; the bias the output stage adds is
counted in the bound, so the accumulator stays in that type). int8 layers are nearly always in
float32's range (an int8 layer reaches 2**24 only past about 520 full-scale
terms per output); int16 activations usually take float64. Past 2**53
(impossible for legal int8 and 16x8 kernels, kept for safety) the sums are formed
in int64. The bound is computed from the command's actual input and weights, so
the choice is per command and never approximate.

Inputs may carry leading batch axes (``[..., H, W, C]``): the batched runner
(:mod:`simulator.batch`) sums many samples' commands in one call.

Layout: CONV2D weights ``[OC, KH, KW, IC]``, DEPTHWISE_CONV2D ``[OC, KH, KW]``
(output channel ``o`` reads input channel ``o // multiplier``),
FULLY_CONNECTED ``[OC, IC]`` (:data:`simulator.isa.WEIGHT_LAYOUTS`).
"""

from __future__ import annotations

import numpy as np

from .isa import Convolution, Opcode

FLOAT32_EXACT = 1 << 24
"""Integers up to this magnitude are exact in float32 (24-bit significand)."""
FLOAT64_EXACT = 1 << 53
"""Integers up to this magnitude are exact in float64 (53-bit significand)."""

IM2COL_MAX_CHANNELS = 64
"""A CONV2D with fewer input channels than this gathers its taps into one matrix multiply (K = KH*KW*IC);
wider ones multiply tap by tap (each already a good BLAS shape), so the gathered copy is never large."""
IM2COL_MAX_ELEMENTS = 1 << 24
"""Gathered-tap matrices are built for this many elements at a time (64 MiB of float32)."""
DEPTHWISE_BLOCK = 1 << 14
"""Elements of output the depthwise kernel accumulates at a time: with the input window, an L2-sized block."""


def sum_bound(ifm: np.ndarray, input_zero_point: int, weights: np.ndarray) -> int:
    """``max|x - zp| * max_oc sum(|w_oc|)``: no partial sum of any output element exceeds it in magnitude."""
    if ifm.size == 0 or weights.size == 0:
        return 0
    largest = max(abs(int(ifm.max()) - input_zero_point), abs(int(ifm.min()) - input_zero_point))
    per_channel = np.abs(weights.reshape(weights.shape[0], -1).astype(np.int64)).sum(axis=1)
    return largest * int(per_channel.max())


def sum_dtype(bound: int) -> np.dtype:
    """The narrowest type in which sums bounded by ``bound`` are formed without rounding."""
    if bound < FLOAT32_EXACT:
        return np.dtype(np.float32)
    if bound < FLOAT64_EXACT:
        return np.dtype(np.float64)
    return np.dtype(np.int64)


def centred_input(ifm: np.ndarray, input_zero_point: int, padding, dtype) -> np.ndarray:
    """``ifm - zp`` in ``dtype``, zero-padded ``(top, left, bottom, right)`` on its last-but-one two axes."""
    pt, pl, pb, pr = padding
    *lead, h, w, c = ifm.shape
    x = np.zeros((*lead, h + pt + pb, w + pl + pr, c), dtype)
    np.subtract(ifm, np.array(input_zero_point, dtype), out=x[..., pt:pt + h, pl:pl + w, :], casting="unsafe")
    return x


def _matmul(x: np.ndarray, matrix: np.ndarray) -> np.ndarray:
    """``x [..., K] @ matrix [K, M]`` as one BLAS call (a stacked ``@`` would multiply row block by row block)."""
    return (x.reshape(-1, x.shape[-1]) @ matrix).reshape(*x.shape[:-1], matrix.shape[-1])


def _window(x: np.ndarray, conv: Convolution, ky: int, kx: int) -> np.ndarray:
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    oh, ow = conv.ofm.height, conv.ofm.width
    y0, x0 = ky * dh, kx * dw
    return x[..., y0:y0 + (oh - 1) * sh + 1:sh, x0:x0 + (ow - 1) * sw + 1:sw, :]


def conv2d_sums(x: np.ndarray, weights: np.ndarray, conv: Convolution) -> np.ndarray:
    """CONV2D on a centred, padded input ``[..., Hp, Wp, IC]``: ``[..., OH, OW, OC]`` in ``x``'s type."""
    oc, kh, kw, ic = weights.shape
    w = weights.astype(x.dtype)
    lead = x.shape[:-3]
    oh, ow = conv.ofm.height, conv.ofm.width
    if kh * kw == 1:
        return _matmul(_window(x, conv, 0, 0), w.reshape(oc, ic).T)
    if ic >= IM2COL_MAX_CHANNELS:
        acc = np.zeros((*lead, oh, ow, oc), x.dtype)
        for ky in range(kh):
            for kx in range(kw):
                acc += _matmul(_window(x, conv, ky, kx), w[:, ky, kx, :].T)
        return acc
    flat = x.reshape((-1, *x.shape[-3:]))
    out = np.empty((flat.shape[0], oh, ow, oc), x.dtype)
    step = max(1, IM2COL_MAX_ELEMENTS // (oh * ow * kh * kw * ic))
    matrix = w.reshape(oc, kh * kw * ic).T
    for start in range(0, flat.shape[0], step):
        part = flat[start:start + step]
        taps = np.empty((part.shape[0], oh, ow, kh, kw, ic), x.dtype)
        for ky in range(kh):
            for kx in range(kw):
                taps[:, :, :, ky, kx, :] = _window(part, conv, ky, kx)
        out[start:start + step] = _matmul(taps.reshape(part.shape[0], oh, ow, kh * kw * ic), matrix)
    return out.reshape((*lead, oh, ow, oc))


def depthwise_sums(x: np.ndarray, weights: np.ndarray, conv: Convolution) -> np.ndarray:
    """DEPTHWISE_CONV2D on a centred, padded input ``[..., Hp, Wp, IC]``: ``[..., OH, OW, OC]``.

    Each tap is one multiply-add over whole output rows: a row of the output (``OW * OC`` values) is a
    contiguous slice of the input row's column phase ``(kx * dilation) % stride``, and the tap's weights,
    tiled ``OW`` times, multiply it elementwise. Blocks of :data:`DEPTHWISE_BLOCK` outputs stay in cache
    across the taps.
    """
    oc, kh, kw = weights.shape
    multiplier = oc // x.shape[-1]
    if multiplier > 1:
        x = np.repeat(x, multiplier, axis=-1)
    lead = x.shape[:-3]
    x = x.reshape((-1, *x.shape[-3:]))
    batch, hp, wp, _ = x.shape
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    oh, ow = conv.ofm.height, conv.ofm.width
    row = ow * oc
    phases = [np.ascontiguousarray(x[:, :, p::sw, :]).reshape(batch, hp, -1) if sw > 1 else x.reshape(batch, hp, -1)
              for p in range(sw)]
    w = weights.astype(x.dtype)
    taps = [(ky * dh, phases[(kx * dw) % sw], (kx * dw) // sw * oc, np.tile(w[:, ky, kx], ow))
            for ky in range(kh) for kx in range(kw)]
    out = np.empty((batch, oh, row), x.dtype)
    rows = max(1, DEPTHWISE_BLOCK // row)
    if rows >= oh:  # whole samples per block
        blocks = [(slice(b, min(batch, b + max(1, rows // oh))), 0, oh)
                  for b in range(0, batch, max(1, rows // oh))]
    else:
        blocks = [(slice(b, b + 1), r, min(oh, r + rows)) for b in range(batch) for r in range(0, oh, rows)]
    scratch = np.empty((max(1, rows // oh) if rows >= oh else 1, min(rows, oh), row), x.dtype)
    for samples, r0, r1 in blocks:
        acc = out[samples, r0:r1]
        tmp = scratch[:acc.shape[0], :acc.shape[1]]
        for k, (y0, phase, col, tiled) in enumerate(taps):
            window = phase[samples, y0 + r0 * sh:y0 + (r1 - 1) * sh + 1:sh, col:col + row]
            if k == 0:
                np.multiply(window, tiled, out=acc)
            else:
                np.multiply(window, tiled, out=tmp)
                acc += tmp
    return out.reshape((*lead, oh, ow, oc))


def fully_connected_sums(x: np.ndarray, weights: np.ndarray, conv: Convolution) -> np.ndarray:
    """FULLY_CONNECTED: each row of the ``N x IC`` input against every output channel's weights."""
    return _matmul(x, weights.astype(x.dtype).T)


SUMS = {Opcode.CONV2D: conv2d_sums, Opcode.DEPTHWISE_CONV2D: depthwise_sums,
        Opcode.FULLY_CONNECTED: fully_connected_sums}
"""How each MAC-array opcode sums its products."""


def exact_sums(opcode: Opcode, conv: Convolution, ifm: np.ndarray, weights: np.ndarray,
               headroom: int = 0, dtype=None) -> np.ndarray:
    """The exact ``sum((x - zp) * w)`` of every output element of a MAC-array command.

    ``ifm``: the input tile ``[..., H, W, IC]`` (int8 or int16, any leading batch axes); ``weights``: the
    opcode's int8 layout. Computed and returned in the narrowest exact type for this command's bound plus
    ``headroom`` (module docstring), so that adding integers up to ``headroom`` in magnitude (the bias) stays
    exact in it; or in ``dtype``, which the caller has chosen from a bound that covers these values.
    """
    if dtype is None:
        dtype = sum_dtype(sum_bound(ifm, conv.input_zero_point, weights) + headroom)
    x = centred_input(ifm, conv.input_zero_point, conv.padding, dtype)
    return SUMS[opcode](x, weights, conv)
