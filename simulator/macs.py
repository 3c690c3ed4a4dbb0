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
the choice is per command and never approximate. A reduction too long for float32
(a wide FULLY_CONNECTED) is also exact as float32 products over ranges of its input
channels, each below 2**24, added in float64 (:meth:`SumPlan.float32_chunks`).

The same argument covers the order of any summation, so DEPTHWISE_CONV2D sums its
taps with one ``einsum`` along whole output rows (:func:`depthwise_apply`), and a
prepared stream (:mod:`simulator.prepared`) keeps each command's weights converted
once (:class:`SumPlan`).

Inputs may carry leading batch axes (``[..., H, W, C]``): the batched runner
(:mod:`simulator.batch`) sums many samples' commands in one call.

Layout: CONV2D weights ``[OC, KH, KW, IC]``, DEPTHWISE_CONV2D ``[OC, KH, KW]``
(output channel ``o`` reads input channel ``o // multiplier``),
FULLY_CONNECTED ``[OC, IC]`` (:data:`simulator.isa.WEIGHT_LAYOUTS`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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


def centred_input(ifm: np.ndarray, input_zero_point: int, padding, dtype, empty=np.empty) -> np.ndarray:
    """``ifm - zp`` in ``dtype``, zero-padded ``(top, left, bottom, right)`` on its last-but-one two axes, in an
    array from ``empty(shape, dtype)`` (a caller may hand out reused memory: every element is written)."""
    pt, pl, pb, pr = padding
    *lead, h, w, c = ifm.shape
    x = empty((*lead, h + pt + pb, w + pl + pr, c), dtype)
    for border in (x[..., :pt, :, :], x[..., pt + h:, :, :], x[..., pt:pt + h, :pl, :], x[..., pt:pt + h, pl + w:, :]):
        border.fill(0)
    np.subtract(ifm, np.array(input_zero_point, dtype), out=x[..., pt:pt + h, pl:pl + w, :], casting="unsafe")
    return x


def _matmul(x: np.ndarray, matrix: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``x [..., K] @ matrix [K, M]`` as one BLAS call (a stacked ``@`` would multiply row block by row block),
    into ``out`` (contiguous, ``[..., M]``) if given."""
    rows = x.reshape(-1, x.shape[-1])
    if out is None:
        return (rows @ matrix).reshape(*x.shape[:-1], matrix.shape[-1])
    np.matmul(rows, matrix, out=out.reshape(rows.shape[0], matrix.shape[-1]))
    return out


def _window(x: np.ndarray, conv: Convolution, ky: int, kx: int) -> np.ndarray:
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    oh, ow = conv.ofm.height, conv.ofm.width
    y0, x0 = ky * dh, kx * dw
    return x[..., y0:y0 + (oh - 1) * sh + 1:sh, x0:x0 + (ow - 1) * sw + 1:sw, :]


def conv2d_operands(weights: np.ndarray, conv: Convolution, dtype) -> list[np.ndarray]:
    """CONV2D weights ``[OC, KH, KW, IC]`` as the matrices :func:`conv2d_apply` multiplies by, in ``dtype``: one
    ``[IC, OC]`` for a 1x1 kernel, one per tap from :data:`IM2COL_MAX_CHANNELS` input channels, else one
    ``[KH*KW*IC, OC]`` for the gathered taps."""
    oc, kh, kw, ic = weights.shape
    w = weights.astype(dtype)
    if kh * kw == 1:
        return [np.ascontiguousarray(w.reshape(oc, ic).T)]
    if ic >= IM2COL_MAX_CHANNELS:
        return [np.ascontiguousarray(w[:, ky, kx, :].T) for ky in range(kh) for kx in range(kw)]
    return [np.ascontiguousarray(w.reshape(oc, kh * kw * ic).T)]


def conv2d_apply(x: np.ndarray, matrices: list[np.ndarray], conv: Convolution, out: np.ndarray | None = None
                 ) -> np.ndarray:
    """CONV2D on a centred, padded input ``[..., Hp, Wp, IC]`` by :func:`conv2d_operands`' matrices, into ``out``
    (``[..., OH, OW, OC]`` in ``x``'s type) if given."""
    kh, kw = conv.kernel
    ic, oc = x.shape[-1], conv.ofm.channels
    lead = x.shape[:-3]
    oh, ow = conv.ofm.height, conv.ofm.width
    if out is None:
        out = np.empty((*lead, oh, ow, oc), x.dtype)
    if kh * kw == 1:
        return _matmul(_window(x, conv, 0, 0), matrices[0], out)
    if ic >= IM2COL_MAX_CHANNELS:
        for tap, matrix in enumerate(matrices):
            product = _matmul(_window(x, conv, *divmod(tap, kw)), matrix, None if tap else out)
            if tap:
                out += product
        return out
    flat = np.ascontiguousarray(x.reshape((-1, *x.shape[-3:])))
    result = out
    out = out.reshape((flat.shape[0], oh, ow, oc))
    step = max(1, IM2COL_MAX_ELEMENTS // (oh * ow * kh * kw * ic))
    for start in range(0, flat.shape[0], step):
        part = flat[start:start + step]
        taps = np.empty((part.shape[0], oh, ow, kh, kw, ic), x.dtype)
        _gather_taps(part, conv, taps)
        _matmul(taps.reshape(part.shape[0], oh, ow, kh * kw * ic), matrices[0], out[start:start + step])
    return result


def _gather_taps(x: np.ndarray, conv: Convolution, taps: np.ndarray) -> None:
    """The im2col of contiguous ``x [N, Hp, Wp, IC]`` into ``taps [N, OH, OW, KH, KW, IC]``: without column
    dilation a row's ``KW`` taps are one contiguous run of ``KW * IC`` inputs, so one strided copy does it."""
    n, _, _, ic = x.shape
    _, oh, ow, kh, kw, _ = taps.shape
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    if dw == 1:
        sample, line, pixel, item = x.strides
        view = np.lib.stride_tricks.as_strided(x, (n, oh, ow, kh, kw * ic), (sample, sh * line, sw * pixel, dh * line,
                                                                           item), writeable=False)
        np.copyto(taps.reshape(n, oh, ow, kh, kw * ic), view)
        return
    for ky in range(kh):
        for kx in range(kw):
            taps[:, :, :, ky, kx, :] = _window(x, conv, ky, kx)


def conv2d_sums(x: np.ndarray, weights: np.ndarray, conv: Convolution) -> np.ndarray:
    """CONV2D on a centred, padded input ``[..., Hp, Wp, IC]``: ``[..., OH, OW, OC]`` in ``x``'s type."""
    return conv2d_apply(x, conv2d_operands(weights, conv, x.dtype), conv)


def depthwise_operands(weights: np.ndarray, conv: Convolution, dtype) -> list[np.ndarray]:
    """DEPTHWISE_CONV2D weights ``[OC, KH, KW]`` as :func:`depthwise_apply` multiplies by them: ``[KH, KW, OW*OC]``,
    each tap's weights tiled ``OW`` times (one output row), in ``dtype``."""
    oc, kh, kw = weights.shape
    w = np.ascontiguousarray(weights.transpose(1, 2, 0)).astype(dtype)
    return [np.tile(w, (1, 1, conv.ofm.width))]


def depthwise_apply(x: np.ndarray, tiled: list[np.ndarray], conv: Convolution, out: np.ndarray | None = None
                    ) -> np.ndarray:
    """DEPTHWISE_CONV2D on a centred, padded input ``[..., Hp, Wp, IC]``: ``[..., OH, OW, OC]``.

    A row of the output (``OW * OC`` values, contiguous) is, for each tap, a contiguous run of the input row the
    tap reads, times the tap's weights tiled ``OW`` times (:func:`depthwise_operands`): one ``einsum`` over a
    strided view ``[OH, KH, KW, OW*OC]`` of the input sums the taps in one multiply-add pass each, along whole
    rows. With a column stride, each column tap's columns are first gathered into a contiguous copy.
    """
    oc = conv.ofm.channels
    multiplier = oc // x.shape[-1]
    if multiplier > 1:
        x = np.repeat(x, multiplier, axis=-1)
    lead = x.shape[:-3]
    x = np.ascontiguousarray(x.reshape((-1, *x.shape[-3:])))
    oh, ow = conv.ofm.height, conv.ofm.width
    result = np.empty((*lead, oh, ow, oc), x.dtype) if out is None else out
    flat = result.reshape((x.shape[0], oh, ow * oc))
    for n in range(x.shape[0]):
        gather, window = _depthwise_window(x[n], conv)
        gather()
        np.einsum("ykxj,kxj->yj", window, tiled[0], out=flat[n])
    return result


def _depthwise_window(x: np.ndarray, conv: Convolution):
    """(gather, window) for contiguous ``x [Hp, Wp, OC]``: ``window [OH, KH, KW, OW*OC]`` views, for every output
    row and tap, the contiguous run of inputs the tap multiplies, once ``gather()`` has run. Without a column
    stride a column tap is an offset of ``kx * dw`` pixels within the input row (nothing to gather); with one,
    ``gather`` copies each column tap's pixels into a buffer ``[KW, Hp, OW*OC]`` made here."""
    hp, wp, oc = x.shape
    kh, kw = conv.kernel
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    oh, ow = conv.ofm.height, conv.ofm.width
    row, item = ow * oc, x.dtype.itemsize
    if sw == 1:
        base, tap_stride = x.reshape(hp, wp * oc), dw * oc * item
        gather = nothing
    else:
        base = np.empty((kw, hp, row), x.dtype)
        columns = [x[:, kx * dw:kx * dw + (ow - 1) * sw + 1:sw, :] for kx in range(kw)]
        targets = [base[kx].reshape(hp, ow, oc) for kx in range(kw)]
        tap_stride = base.strides[0]

        def gather():
            for column, target in zip(columns, targets):
                np.copyto(target, column)
    line = base.strides[-2]
    window = np.lib.stride_tricks.as_strided(base, (oh, kh, kw, row), (sh * line, dh * line, tap_stride, item),
                                             writeable=False)
    return gather, window


def nothing() -> None:
    """A step with nothing to do (a gather or a sum that a plan shares with an earlier command)."""


def depthwise_input_size(conv: Convolution) -> int:
    """Elements of the buffer :func:`depthwise_input` lays its input out in."""
    pt, pl, pb, pr = conv.padding
    hp, c = conv.ifm.height + pt + pb, conv.ifm.channels
    if conv.stride[1] == 1:
        return hp * (conv.ifm.width + pl + pr) * c
    return conv.kernel[1] * hp * conv.ofm.width * c


def depthwise_input(ifm: np.ndarray, input_zero_point: int, conv: Convolution, buffer: np.ndarray
                    ) -> tuple[Callable[[], None], np.ndarray]:
    """(centre, window) for a DEPTHWISE_CONV2D without channel multiplier whose input ``ifm [H, W, C]`` is always
    the same array, laid out in ``buffer`` (flat, the sums' type, :func:`depthwise_input_size` elements or more,
    possibly shared with other commands): ``centre()`` writes ``ifm - zp`` there and zeroes the padding, and
    ``window`` is the ``[OH, KH, KW, OW*OC]`` view of it that :func:`depthwise_apply`'s ``einsum`` reads. With a
    column stride the centred values go straight to each column tap's gathered layout (:func:`_depthwise_window`),
    one subtraction per column tap instead of a padded copy and a gather."""
    pt, pl, pb, pr = conv.padding
    h, w, c = ifm.shape
    zero = buffer.dtype.type(input_zero_point)
    base = buffer[:depthwise_input_size(conv)]
    parts, zeros = [], []
    if conv.stride[1] == 1:
        x = base.reshape(h + pt + pb, w + pl + pr, c)
        zeros = [x[:pt], x[pt + h:], x[pt:pt + h, :pl], x[pt:pt + h, pl + w:]]
        parts.append(functools.partial(np.subtract, ifm, zero, out=x[pt:pt + h, pl:pl + w], casting="unsafe"))
        window = _depthwise_window(x, conv)[1]
    else:
        kh, kw = conv.kernel
        (sh, sw), (dh, dw) = conv.stride, conv.dilation
        oh, ow = conv.ofm.height, conv.ofm.width
        base = base.reshape(kw, h + pt + pb, ow * c)
        for kx in range(kw):
            first = kx * dw - pl  # input column of output column 0 for this tap
            lo = next((o for o in range(ow) if first + o * sw >= 0), ow)  # output columns inside the image
            hi = next((o for o in range(ow - 1, -1, -1) if first + o * sw < w), -1) + 1
            tap = base[kx].reshape(-1, ow, c)
            zeros += [tap[:pt], tap[pt + h:], tap[pt:pt + h, :lo], tap[pt:pt + h, max(hi, lo):]]
            if hi > lo:
                source = ifm[:, first + lo * sw:first + (hi - 1) * sw + 1:sw]
                parts.append(functools.partial(np.subtract, source, zero, out=tap[pt:pt + h, lo:hi], casting="unsafe"))
        line, item = base.strides[1], base.dtype.itemsize
        window = np.lib.stride_tricks.as_strided(base, (oh, kh, kw, ow * c), (sh * line, dh * line, base.strides[0],
                                                                             item), writeable=False)
    zeros = [z for z in zeros if z.size]

    def centre() -> None:
        for region in zeros:
            region.fill(0)
        for part in parts:
            part()

    return centre, window


def depthwise_sums(x: np.ndarray, weights: np.ndarray, conv: Convolution) -> np.ndarray:
    """DEPTHWISE_CONV2D on a centred, padded input ``[..., Hp, Wp, IC]``: ``[..., OH, OW, OC]``
    (output channel ``o`` reads input channel ``o // multiplier``; see :func:`depthwise_apply`)."""
    return depthwise_apply(x, depthwise_operands(weights, conv, x.dtype), conv)


def fully_connected_operands(weights: np.ndarray, conv: Convolution, dtype) -> list[np.ndarray]:
    """FULLY_CONNECTED weights ``[OC, IC]`` as one ``[IC, OC]`` matrix in ``dtype``."""
    return [np.ascontiguousarray(weights.astype(dtype).T)]


def fully_connected_apply(x: np.ndarray, matrices: list[np.ndarray], conv: Convolution,
                          out: np.ndarray | None = None) -> np.ndarray:
    """FULLY_CONNECTED: each row of the ``N x IC`` input against every output channel's weights."""
    return _matmul(x, matrices[0], out)


def fully_connected_sums(x: np.ndarray, weights: np.ndarray, conv: Convolution) -> np.ndarray:
    """FULLY_CONNECTED: each row of the ``N x IC`` input against every output channel's weights."""
    return fully_connected_apply(x, fully_connected_operands(weights, conv, x.dtype), conv)


SUMS = {Opcode.CONV2D: conv2d_sums, Opcode.DEPTHWISE_CONV2D: depthwise_sums,
        Opcode.FULLY_CONNECTED: fully_connected_sums}
"""How each MAC-array opcode sums its products."""

PREPARED_SUMS = {Opcode.CONV2D: (conv2d_operands, conv2d_apply),
                 Opcode.DEPTHWISE_CONV2D: (depthwise_operands, depthwise_apply),
                 Opcode.FULLY_CONNECTED: (fully_connected_operands, fully_connected_apply)}
"""Each MAC-array opcode's sums in two halves: its weights made into the arrays it multiplies by (once per
weights and type), and the sums of one input by them."""


class SumPlan:
    """The exact sums of one MAC-array command whose weights are the same in every run, prepared once.

    Holds the weights converted and laid out (:data:`PREPARED_SUMS`) for each exact type asked for, and the
    largest per-channel ``sum(|w|)``, which bounds the sums of any input with the input's largest ``|x - zp|``
    (module docstring), so the caller can choose the type without a pass over the weights.
    """

    def __init__(self, opcode: Opcode, conv: Convolution, weights: np.ndarray, shared: dict | None = None):
        self.opcode, self.conv = opcode, conv
        self.weights = np.array(weights, dtype=np.int8)
        self.shared = shared
        """A dict kept by the caller in which plans of equal weights and layout (the tiles of one layer) share their
        converted operands."""
        self.weight_bounds = np.abs(self.weights.reshape(self.weights.shape[0], -1).astype(np.int64)).sum(axis=1)
        """Per output channel ``sum(|w|)``: with the input's largest ``|x - zp|``, a bound on that channel's sums."""
        self.weight_bound = int(self.weight_bounds.max(initial=0))
        self._operands: dict[np.dtype, list[np.ndarray]] = {}

    @property
    def nbytes(self) -> int:
        """The weights and their operands (shared operands are counted by the caller's dict, ``"nbytes"``)."""
        own = 0 if self.shared is not None else sum(a.nbytes for ops in self._operands.values() for a in ops)
        return self.weights.nbytes + own

    def operands(self, dtype) -> list[np.ndarray]:
        """The weights as the arrays the sums in ``dtype`` multiply by (made on first use)."""
        operands = self._operands.get(dtype)
        if operands is None:
            key = (self.opcode, np.dtype(dtype), self.conv.kernel, self.conv.ofm.width, self.weights.shape,
                   self.weights.tobytes())
            operands = self.shared.get(key) if self.shared is not None else None
            if operands is None:
                operands = PREPARED_SUMS[self.opcode][0](self.weights, self.conv, dtype)
                if self.shared is not None:
                    self.shared[key] = operands
                    self.shared["nbytes"] = self.shared.get("nbytes", 0) + sum(a.nbytes for a in operands)
            self._operands[dtype] = operands
        return operands

    def bind_window(self, window: np.ndarray, out: np.ndarray) -> Callable[[], None]:
        """DEPTHWISE_CONV2D's sums of a :func:`depthwise_input` window into ``out`` (contiguous), as one call."""
        return functools.partial(np.einsum, "ykxj,kxj->yj", window, self.operands(window.dtype)[0],
                                 out=out.reshape(self.conv.ofm.height, -1))

    def float32_chunks(self, input_bound: int) -> list[slice] | None:
        """Ranges of a 1x1 CONV2D's or a FULLY_CONNECTED's reduction axis (its input channels) whose partial sums
        are exact in float32 for inputs with ``|x - zp| <= input_bound``: each range's ``input_bound * max_oc
        sum(|w|)`` stays below 2**24. A long reduction past float32's range is then a few float32 matrix
        products added in float64 (exact below 2**53) instead of one float64 product at half the speed. None where
        the layout is another or a single input channel already reaches 2**24."""
        if self.conv.kernel != (1, 1) or self.conv.stride != (1, 1) or self.opcode == Opcode.DEPTHWISE_CONV2D:
            return None
        magnitude = np.abs(self.weights.reshape(self.weights.shape[0], -1).astype(np.int64)) * input_bound
        chunks, start, total = [], 0, magnitude.shape[1]
        running = np.zeros(magnitude.shape[0], np.int64)
        for k in range(total):
            running += magnitude[:, k]
            if running.max() >= FLOAT32_EXACT:
                if k == start:
                    return None
                chunks.append(slice(start, k))
                start, running = k, magnitude[:, k].copy()
        chunks.append(slice(start, total))
        return chunks

    def bind_chunked(self, x: np.ndarray, out: np.ndarray, chunks: list[slice]) -> Callable[[], None]:
        """The sums of float32 ``x`` into float64 ``out`` by :meth:`float32_chunks`' ranges: a float32 product per
        range, each exact, added in float64."""
        matrix = self.operands(x.dtype)[0]
        rows = x.reshape(-1, x.shape[-1])
        total = out.reshape(rows.shape[0], -1)
        part = np.empty(total.shape, x.dtype)
        products = [functools.partial(np.matmul, rows[:, c], matrix[c], out=part) for c in chunks]

        def sums() -> None:
            products[0]()
            np.copyto(total, part)
            for product in products[1:]:
                product()
                np.add(total, part, out=total)

        return sums

    def bind_scaled(self, x: np.ndarray, out: np.ndarray, scale: np.ndarray, constant: np.ndarray
                    ) -> Callable[[], None]:
        """For a 1x1 CONV2D or a FULLY_CONNECTED: ``sums * scale + constant`` per output channel, in one float64
        product, into ``out`` (float64, ``[OH, OW, OC]``). ``x`` is ``[..., IC + 1]``, the centred input with a
        last channel of ones (the caller keeps it), and the weights, each channel's times its ``scale``, gain a
        last row, ``constant``. Exact where every term and partial sum is an integer multiple of the channel's
        step ``g`` below 2**53 of them, as :class:`simulator.numerics.Float64Requantizer` checks for its limit:
        then the output stage's multiply and add cost nothing, which pays where the product is cheap (few input
        channels)."""
        oc = self.weights.shape[0]
        scale, constant = np.broadcast_to(scale, (oc,)), np.broadcast_to(constant, (oc,))
        key = ("scaled", self.weights.tobytes(), scale.tobytes(), constant.tobytes())
        matrix = self.shared.get(key) if self.shared is not None else None
        if matrix is None:
            matrix = np.vstack([self.weights.reshape(self.weights.shape[0], -1).T.astype(np.float64) * scale,
                                constant[None]])
            if self.shared is not None:
                self.shared[key] = matrix
                self.shared["nbytes"] = self.shared.get("nbytes", 0) + matrix.nbytes
        rows = x.reshape(-1, x.shape[-1])
        return functools.partial(np.matmul, rows, matrix, out=out.reshape(rows.shape[0], -1))

    def bind(self, x: np.ndarray, out: np.ndarray) -> Callable[[], None]:
        """The sums of whatever the contiguous array ``x`` (a centred, padded input of one sample) holds, into
        ``out`` (``[OH, OW, OC]``, contiguous), as one call whose views, buffers and operands are made here: a
        prepared command reads and writes the same places on every run."""
        operands, conv = self.operands(x.dtype), self.conv
        oc = conv.ofm.channels
        if self.opcode == Opcode.DEPTHWISE_CONV2D:
            if oc != x.shape[-1]:  # a channel multiplier: the input is repeated on every call
                return lambda: depthwise_apply(x, operands, conv, out)
            gather, window = _depthwise_window(x, conv)
            rows = out.reshape(conv.ofm.height, -1)
            return lambda: (gather(), np.einsum("ykxj,kxj->yj", window, operands[0], out=rows))
        if conv.kernel == (1, 1) and conv.stride == (1, 1):  # FULLY_CONNECTED too: one matrix product
            rows = x.reshape(-1, x.shape[-1])
            return functools.partial(np.matmul, rows, operands[0], out=out.reshape(rows.shape[0], oc))
        if conv.kernel != (1, 1) and x.shape[-1] < IM2COL_MAX_CHANNELS:
            kh, kw = conv.kernel
            taps = np.empty((1, conv.ofm.height, conv.ofm.width, kh, kw, x.shape[-1]), x.dtype)
            rows, sample = taps.reshape(-1, kh * kw * x.shape[-1]), x[None]
            product = functools.partial(np.matmul, rows, operands[0], out=out.reshape(rows.shape[0], oc))
            return lambda: (_gather_taps(sample, conv, taps), product())
        return lambda: PREPARED_SUMS[self.opcode][1](x, operands, conv, out)

    def sums(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The sums of a centred, padded input ``x`` (:func:`centred_input`), in ``x``'s type (into ``out``, a
        contiguous ``[..., OH, OW, OC]`` of that type, if given)."""
        return PREPARED_SUMS[self.opcode][1](x, self.operands(x.dtype), self.conv, out)


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
