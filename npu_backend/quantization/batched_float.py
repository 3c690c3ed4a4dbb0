"""Convolution and matmul layers in float32 over a whole batch of calibration samples, with numpy's BLAS.

Calibration runs every weighted layer in float twice or more per sample (on the float model's activations, and
on its quantized inputs with dequantized weights). TVM's untuned CPU kernels take about 20 times longer than a
BLAS matrix multiply for the same convolution, so these layers are computed here, all samples at once: the
Relax operator's definition (``conv2d`` with its layouts, padding, strides, dilation and groups, or ``matmul``),
then the bias add and the clamp the layer fuses, each in float32 as TVM computes it; only the order of the
float32 additions inside a sum differs. The sums are the simulator's own (:mod:`simulator.macs`), applied to
float32 data. A layer outside what :func:`plan_weighted` recognises (other groupings, layouts or operators)
stays with TVM.

The batch is cut into chunks of a few samples (:data:`CHUNK_ELEMENTS`), computed on the worker threads
(:mod:`.parallel`). A chunk's values do not depend on the other chunks, but a flattened matrix multiply's do
depend on how many rows it has (OpenBLAS picks its kernels by shape), so the chunks are the same whatever the
number of threads: the results are too, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from threadpoolctl import threadpool_limits

from simulator.isa import Convolution, FeatureMap, Opcode
from simulator.macs import PREPARED_SUMS, centred_input, conv2d_operands

from ..relax_exprs import is_call
from .layers import Layer
from .observers import Batches
from . import buffers, depthwise, kernels, parallel
from .parallel import run_all

CHUNK_ELEMENTS = 1 << 20
"""Values per chunk when a batch is streamed through a consumer: buffers this small are reused by the allocator,
where whole-batch temporaries (hundreds of MB) would be fresh pages, faulted in on every pass. A weighted layer's
chunks hold this many of its inputs or of its outputs, whichever are more: chunked by its inputs alone, a 7x7
MobileNetV2 layer expanding 160 channels to 960 was one chunk of all 100 samples, on one thread."""


BLOCK_ELEMENTS = 1 << 18
"""Outputs per block of rows when a chunk's integer sums are read as they form (1 MiB of float32, read back from
the cache). Measured on a ranges-only MobileNetV2 calibration, in runs alternating with the unblocked code: 1 MiB
blocks 4.2-4.4 s against 4.7-5.1 s; 256 KiB blocks (a few dozen rows for wide layers, slower matrix products)
4.55 s against 4.08 s."""


def chunks(count: int, sample_size: int) -> list[slice]:
    """The samples of a batch, a few at a time: at most :data:`CHUNK_ELEMENTS` values a chunk (or one sample),
    in as few chunks as that allows, whose sizes differ by one sample at most, the larger first (100 samples of
    at most 83 are chunks of 50 and 50, not 83 and 17: the threads that share them finish together). Fixed by the
    batch and the sample size alone, never by the number of threads."""
    most = max(1, CHUNK_ELEMENTS // max(1, sample_size))
    parts = -(-count // most)
    if not parts:
        return []
    size, larger = divmod(count, parts)
    bounds = [k * size + min(k, larger) for k in range(parts + 1)]
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class WeightedPlan:
    """How to compute one weighted layer's sums with :mod:`simulator.macs`."""

    opcode: Opcode
    conv: Convolution | None
    channels_first: bool
    """Data layout NCHW: samples are transposed to NHWC and back."""
    weight_order: tuple[int, ...]
    """Transpose of the layer's weight to the opcode's ``[OC, KH, KW, IC]`` (depthwise: then ``[..., 0]``)."""

    def sums(self, x: np.ndarray, weight: np.ndarray, then=None, zero_point: int = 0, keep: bool = True,
             packed: kernels.Int8Weights | None = None) -> np.ndarray | tuple[np.ndarray | None, list]:
        """The layer's anchor (conv2d or matmul, before its bias) on ``x`` = ``[N, *input shape]``, float32; or on
        ``x - zero_point`` for an int8 ``x`` channels last, centred a chunk at a time as the chunk is summed (no
        float32 copy of the batch). With ``then``: also ``then``'s results on the sums in order, a chunk at a time
        (a row-wise layer's chunk a block of rows at a time, :func:`_row_blocks`), each called on the thread that
        formed the values, while they are in cache. ``keep=False`` (int8 inputs, with ``then``): ``then``'s
        results alone, the sums formed in a chunk's or a block's buffer and dropped (:meth:`int8_blocks` forms
        them again). ``packed``: the layer's weights as :meth:`int8_weights` gives them, whose row-wise int8
        sums then go through :func:`.kernels.int8_matmul`."""
        x, w = self._operands(x, weight)
        if zero_point and x.dtype != np.int8:
            raise ValueError("a zero point is subtracted from int8 inputs only")
        if x.dtype == np.int8 and self.channels_first:
            raise ValueError("int8 inputs are summed channels last")
        if not keep and (then is None or x.dtype != np.int8):
            raise ValueError("only the exact sums of int8 inputs are dropped, after their statistics are read")
        shape = self._out_shape(x, w)
        out = buffers.empty(shape, np.float32) if keep else None
        # int8 only: exact sums however the rows are cut. A float32 input here is an observation on dequantized
        # values, summed whole (the float model's pass, finished(), cuts its own blocks)
        matrix = self._row_matrix(w) if then is not None and x.dtype == np.int8 and self._row_wise(x) else None

        def chunk(part: slice):
            dest = out[part] if keep else None
            if matrix is not None:  # ``then`` on blocks of rows a cache holds, each right after its product
                return _row_blocks(x[part], matrix, dest, zero_point, lambda block, rows: then(block), packed)
            if dest is None:
                dest = buffers.empty((part.stop - part.start, *shape[1:]), np.float32)
            self._sums_into(x[part], w, dest, zero_point)
            return None if then is None else [then(dest)]

        results = run_all(chunk, chunks(len(x), max(x[0].size, math.prod(shape[1:]))))
        return out if then is None else (out, [r for parts in results for r in parts])

    def output_shape(self, x: np.ndarray, weight: np.ndarray) -> tuple[int, ...]:
        """The shape of :meth:`sums` of ``x``."""
        return self._out_shape(*self._operands(x, weight))

    def int8_weights(self, x: np.ndarray, weight: np.ndarray, zero_point: int) -> kernels.Int8Weights | None:
        """The layer's int8 ``weight`` packed for :func:`.kernels.int8_matmul`, by which the row-wise sums of the
        int8 input ``x`` less ``zero_point`` are formed (pass it to :meth:`sums` and :meth:`int8_blocks`); None
        where the kernel does not take them (not a row-wise layer, or :func:`.kernels.int8_weights`)."""
        x, w = self._operands(x, weight)
        if x.dtype != np.int8 or self.channels_first or not self._row_wise(x):
            return None
        return kernels.int8_weights(self._row_matrix(w), zero_point)

    def int8_blocks(self, x: np.ndarray, weight: np.ndarray, zero_point: int,
                    packed: kernels.Int8Weights | None = None):
        """The sums of int8 ``x`` (channels last: a chunk of a batch) less ``zero_point``, formed again, as
        ``(block, rows)``: ``[rows, channels]`` blocks of the flattened sums (:func:`_row_blocks`' blocks for a
        row-wise layer, else one block of them all), each valid until the next. Exact integers, so equal to
        :meth:`sums` however they are cut."""
        x, w = self._operands(x, weight)
        if x.dtype != np.int8 or self.channels_first:
            raise ValueError("only an int8 input's sums, channels last, are formed again")
        shape = self._out_shape(x, w)
        if self._row_wise(x):
            yield from _blocks_of_rows(x, self._row_matrix(w), zero_point, packed=packed)
            return
        dest = buffers.empty(shape, np.float32)
        self._sums_into(x, w, dest, zero_point)
        yield dest.reshape(-1, shape[-1]), slice(None)

    def _row_wise(self, x: np.ndarray) -> bool:
        """Whether each output row (a pixel's channels) is its input row times one matrix, channels last: a
        matmul, or a pointwise convolution (1x1, stride 1, no padding) of channels-last data."""
        if self.opcode == Opcode.FULLY_CONNECTED:
            return True
        conv = self.conv
        return (self.opcode == Opcode.CONV2D and not self.channels_first and conv.kernel == (1, 1)
                and conv.stride == (1, 1) and conv.padding == (0, 0, 0, 0) and x.flags.c_contiguous)

    def _row_matrix(self, w: np.ndarray) -> np.ndarray:
        """The ``[IC, OC]`` float32 matrix a row-wise layer multiplies each input row by: a dense layer's weight
        as it is, a pointwise convolution's the one matrix :func:`simulator.macs.conv2d_operands` makes of it."""
        if self.opcode == Opcode.FULLY_CONNECTED:
            return np.ascontiguousarray(w, np.float32)
        (matrix,) = conv2d_operands(w, self.conv, np.float32)
        return matrix

    def finished(self, layer: Layer, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None,
                 totals_only: bool = False):
        """(accumulator, output) of the layer on ``x``: its sums, plus the bias in its own shape, then the clamp,
        each chunk finished while its sums are in cache. The output is the accumulator itself when there is no
        clamp. ``totals_only``: :class:`ChannelTotals` of the accumulators instead of them, the clamp in place
        (no second batch-sized array is written)."""
        x, w = self._operands(x, weight)
        acc = buffers.empty(self._out_shape(x, w), np.float32)
        out = acc if layer.clamp is None or totals_only else buffers.empty_like(acc)
        # channels last (a model's NHWC, or an NCHW layer computed so, storage.py): the bias along the last axis
        b = _bias(layer, bias) if self.channels_first or bias is None else np.asarray(bias, np.float32).reshape(-1)
        others = (0, 1, 3, 4) if self.channels_first else tuple(range(acc.ndim - 1))  # all but the channel axis
        # a row-wise layer is finished a block of rows at a time, each right after its product, while in cache
        matrix = self._row_matrix(w) if x.dtype == np.float32 and self._row_wise(x) else None

        def finish(sums: np.ndarray, finished: np.ndarray | None):
            """``sums`` (the accumulators' rows, in place) plus the bias, clamped into ``finished`` (None: in
            place, the output being the accumulator); with ``totals_only``, the accumulators' per-channel totals,
            read between the two."""
            if not totals_only:
                finish_into(layer, sums, b, sums, sums if finished is None else finished)
                return None
            low, high = (-np.inf, np.inf) if layer.clamp is None else layer.clamp
            if not self.channels_first and b is not None and kernels.finish_rows_applies(sums, low, high):
                return kernels.finish_rows(sums, b, low, high)  # the three passes below, fused
            if b is not None:
                np.add(sums, b, out=sums)  # what finish_into adds, before its clamp
            totals = np.sum(sums, axis=others, dtype=np.float64) if self.channels_first else channel_totals(sums)
            if layer.clamp is not None:
                clamp_into(layer, sums, sums)
            return totals

        separate = out is not acc

        def chunk(part):
            if matrix is not None:
                flat = out[part].reshape(-1, out.shape[-1])
                return _row_blocks(x[part], matrix, acc[part], 0,
                                   lambda block, rows: finish(block, flat[rows] if separate else None))
            self._sums_into(x[part], w, acc[part])
            return [finish(acc[part], out[part] if separate else None)]

        parts = [p for block_parts in run_all(chunk, chunks(len(x), max(x[0].size, acc[0].size)))
                 for p in block_parts]
        if totals_only:
            channels = acc.shape[2] if self.channels_first else acc.shape[-1]
            return ChannelTotals(parts, acc.size // channels), out
        return acc, out

    def _operands(self, x, weight):
        x = np.asarray(x)
        if x.dtype != np.int8:
            x = x.astype(np.float32, copy=False)
        w = np.transpose(weight, self.weight_order) if self.conv is not None else np.asarray(weight, np.float32)
        return x, w

    def _out_shape(self, x: np.ndarray, w: np.ndarray) -> tuple[int, ...]:
        if self.conv is None:
            return (*x.shape[:-1], w.shape[-1])
        ofm = self.conv.ofm
        per_sample = (ofm.channels, ofm.height, ofm.width) if self.channels_first else (ofm.height, ofm.width,
                                                                                          ofm.channels)
        return (*x.shape[:2], *per_sample)

    def _sums_into(self, x: np.ndarray, w: np.ndarray, dest: np.ndarray, zero_point: int = 0) -> None:
        """One chunk's sums of ``x`` (float32, or int8 less ``zero_point``), written into ``dest`` (the chunk's
        rows of the batch's result)."""
        centring = x.dtype != np.float32
        if self.opcode == Opcode.FULLY_CONNECTED:
            rows = x.reshape(-1, x.shape[-1])
            if centring:
                rows = np.subtract(rows, np.float32(zero_point), out=buffers.empty(rows.shape), dtype=np.float32)
            np.matmul(rows, w, out=dest.reshape(-1, w.shape[-1]))
            return
        conv = self.conv
        if (self.channels_first and self.opcode == Opcode.CONV2D and conv.kernel == (1, 1)
                and conv.stride == (1, 1) and conv.padding == (0, 0, 0, 0)):
            # Pointwise in NCHW: W [OC, IC] @ x [IC, H*W] per sample, no transposes.
            n = x.shape[0]
            np.matmul(w.reshape(conv.ofm.channels, conv.ifm.channels), x.reshape(n, conv.ifm.channels, -1),
                      out=dest.reshape(n, conv.ofm.channels, -1))
            return
        if self.opcode == Opcode.DEPTHWISE_CONV2D:
            w = w[..., 0]
            if self.channels_first and depthwise.applies(conv):
                depthwise.depthwise_nchw_into(x, w, conv, dest)
                return
        nhwc = np.transpose(x, (0, 1, 3, 4, 2)) if self.channels_first else x
        operands, apply = PREPARED_SUMS[self.opcode]
        ofm = conv.ofm
        out = buffers.empty((*nhwc.shape[:-3], ofm.height, ofm.width, ofm.channels)) if self.channels_first else dest
        if self.opcode == Opcode.DEPTHWISE_CONV2D and kernels.depthwise_applies(conv.ifm.channels,
                                                                                   ofm.channels // conv.ifm.channels):
            # the einsum's sums, bit for bit, compiled; it centres and pads as it reads (no float32 copy)
            kernels.depthwise(nhwc, w, conv, out, zero_point)
        else:
            if centring or conv.padding != (0, 0, 0, 0) or not nhwc.flags.c_contiguous:
                padded = centred_input(nhwc, zero_point, conv.padding, np.float32, empty=buffers.empty)  # reused
            else:
                padded = nhwc  # a float32 pointwise layer's input as it is: nothing to centre, pad or gather
            apply(padded, operands(w, conv, np.float32), conv, out)
        if self.channels_first:
            dest[...] = np.transpose(out, (0, 1, 4, 2, 3))


@dataclass(frozen=True)
class ChannelTotals:
    """What the float model's pass keeps of a weighted layer's accumulators when only their totals are read (bias
    correction): per chunk of samples, in order, the float64 total of each output channel, taken while the chunk
    was in cache; and how many accumulators each channel has."""

    parts: list
    count: int

    @property
    def totals(self) -> np.ndarray:
        return np.sum(self.parts, axis=0)


FOLD_WIDTH = 2048
"""Values per row that a per-channel reduction reads (:func:`folded`)."""


def folded(values: np.ndarray) -> tuple[np.ndarray, int]:
    """Channels-last ``values`` as rows of ``copies`` whole pixels, about :data:`FOLD_WIDTH` values each, and
    ``copies``: numpy reduces ``[R, C]`` along its first axis one row of ``C`` values at a time, which for
    MobileNetV2's 16 to 32 channels is 7 to 13 times slower than over rows of 2048 (whose per-channel results are
    then reduced once more over the ``copies``)."""
    channels = values.shape[-1]
    rows = values.reshape(-1, channels)
    copies = max(1, FOLD_WIDTH // channels)
    while len(rows) % copies:
        copies -= 1
    return rows.reshape(len(rows) // copies, copies * channels), copies


def channel_totals(values: np.ndarray) -> np.ndarray:
    """Per channel (the last axis), the float64 total of ``values``: compiled, row after row
    (:func:`.kernels.channel_totals`), or over :func:`folded` rows (each of the ``copies`` columns down the rows,
    then the copies) where the kernel does not apply; a fixed order either way, whatever the thread count."""
    if kernels.channels_apply(values):
        return kernels.channel_totals(values)
    rows, copies = folded(values)
    return np.sum(rows, axis=0, dtype=np.float64).reshape(copies, values.shape[-1]).sum(axis=0)


def plan_weighted(layer: Layer) -> WeightedPlan | None:
    """The numpy plan of a conv2d (groups 1 or depthwise) or 2-D-weight matmul layer; None otherwise."""
    if layer.weight is None or len(layer.bindings) > (2 if layer.bias is not None else 1):
        return None
    call = layer.bindings[0].value
    if is_call(call, "relax.matmul"):
        if layer.weight.ndim != 2 or str(call.attrs.out_dtype or "float32") not in ("float32", "void", ""):
            return None
        return WeightedPlan(Opcode.FULLY_CONNECTED, None, False, (0, 1))
    if not is_call(call, "relax.nn.conv2d"):
        return None
    attrs = call.attrs
    data, kernel = str(attrs.data_layout), str(attrs.kernel_layout)
    if data not in ("NCHW", "NHWC") or str(attrs.out_layout or data) != data or sorted(kernel) != sorted("OIHW"):
        return None
    if str(attrs.out_dtype or "float32") not in ("float32", "void", ""):
        return None
    in_shape = [int(d) for d in call.args[0].ty.shape.values]
    out_shape = [int(d) for d in call.ty.shape.values]
    if in_shape[0] != 1:
        return None
    c_axis, h_axis, w_axis = data.index("C"), data.index("H"), data.index("W")
    channels, out_channels = in_shape[c_axis], out_shape[c_axis]
    groups = int(attrs.groups)
    order = tuple(kernel.index(a) for a in "OHWI")
    kh, kw = layer.weight.shape[kernel.index("H")], layer.weight.shape[kernel.index("W")]
    if groups == 1:
        opcode = Opcode.CONV2D
    elif groups == channels and layer.weight.shape[kernel.index("I")] == 1 and out_channels % channels == 0:
        opcode = Opcode.DEPTHWISE_CONV2D
    else:
        return None
    top, left, bottom, right = (int(p) for p in attrs.padding)
    conv = Convolution(ifm=FeatureMap(0, in_shape[h_axis], in_shape[w_axis], channels),
                       ofm=FeatureMap(0, out_shape[h_axis], out_shape[w_axis], out_channels),
                       weights_address=0, scale_bias_address=0, kernel=(kh, kw),
                       stride=tuple(int(s) for s in attrs.strides), dilation=tuple(int(d) for d in attrs.dilation),
                       padding=(top, left, bottom, right))
    return WeightedPlan(opcode, conv, data == "NCHW", order)


def _bias(layer: Layer, bias) -> np.ndarray | None:
    """The bias as float32 in its own shape (``[C]``, or ``[1, C, 1, 1]`` as ONNX's importer broadcasts it)."""
    return None if bias is None else np.asarray(bias, np.float32).reshape(layer.bias_shape)


def _row_blocks(x: np.ndarray, matrix: np.ndarray, dest: np.ndarray | None, zero_point: int, then,
                packed: kernels.Int8Weights | None = None) -> list:
    """``dest = (x - zero_point) @ matrix`` row-wise (an int8 ``x`` centred, a float32 one as it is),
    :data:`BLOCK_ELEMENTS` outputs at a time, ``then(block, rows)`` called on each block (the slice ``rows`` of
    ``dest``'s flattened rows) while it is in cache: a sample of an early MobileNetV2 layer is megabytes of sums,
    which each later pass (statistics; the float model's bias, totals and clamp) read back from memory, after
    BLAS had zeroed them there first.

    An int8 input's sums are exact integers, equal to those :meth:`WeightedPlan._sums_into` forms at once. A
    float32 block's products may round otherwise than the whole chunk's (OpenBLAS picks its kernels by the
    number of rows): the same float32 sums in another order, the same for any thread count (the blocks are cut
    from the chunks, which are fixed). Float32 inputs come from the float model's pass alone
    (:meth:`WeightedPlan.finished`); :meth:`WeightedPlan.sums` blocks int8 inputs only. ``dest=None``: each
    block in one reused buffer (:func:`_blocks_of_rows`). ``packed``: an int8 input's products by
    :func:`.kernels.int8_matmul` (the same exact sums)."""
    return [then(out, rows) for out, rows in _blocks_of_rows(x, matrix, zero_point, dest, packed)]


def _blocks_of_rows(x: np.ndarray, matrix: np.ndarray, zero_point: int, dest: np.ndarray | None = None,
                    packed: kernels.Int8Weights | None = None):
    """``(x - zero_point) @ matrix`` row-wise, :data:`BLOCK_ELEMENTS` outputs at a time, as ``(block, rows)``:
    each block is the slice ``rows`` of ``dest``'s flattened rows, or with no ``dest`` one buffer reused (valid
    until the next block). With ``packed`` (``matrix`` and ``zero_point`` packed, :func:`.kernels.int8_weights`)
    an int8 ``x`` goes through :func:`.kernels.int8_matmul`: no centred float32 copy, and int8 products in
    place of float32 ones, 1.4-2.2 times the rate of OpenBLAS's with the centring (MobileNetV2's pointwise shapes,
    one thread)."""
    rows_in = x.reshape(-1, x.shape[-1])
    step = max(1, BLOCK_ELEMENTS // matrix.shape[1])
    rows_out = (dest.reshape(-1, dest.shape[-1]) if dest is not None
                else np.empty((min(step, len(rows_in)), matrix.shape[1]), np.float32))
    by_kernel = packed is not None and x.dtype == np.int8
    centring = x.dtype != np.float32 and not by_kernel
    centred = np.empty((min(step, len(rows_in)), rows_in.shape[1]), np.float32) if centring else None
    for start in range(0, len(rows_in), step):
        rows = slice(start, min(start + step, len(rows_in)))
        block = rows_in[rows]
        out = rows_out[rows] if dest is not None else rows_out[:len(block)]
        if by_kernel:
            kernels.int8_matmul(block, packed, out)
            yield out, rows
            continue
        if centring:
            operand = centred[:len(block)]
            np.subtract(block, np.float32(zero_point), out=operand, dtype=np.float32)
        else:
            operand = block
        np.matmul(operand, matrix, out=out)
        yield out, rows


def finish_into(layer: Layer, sums: np.ndarray, bias: np.ndarray | None, acc: np.ndarray, out: np.ndarray) -> None:
    """``acc = sums + bias`` (float32), then ``out`` = the layer's clamp of ``acc`` (``out`` may be ``acc``)."""
    if bias is None:
        if acc is not sums:
            acc[...] = sums
    else:
        np.add(sums, bias, out=acc)
    if layer.clamp is None:
        if out is not acc:
            out[...] = acc
        return
    clamp_into(layer, acc, out)


def clamp_into(layer: Layer, values: np.ndarray, out: np.ndarray) -> None:
    """``out`` = the layer's fused clamp of ``values`` (float32 bounds; ReLU has no upper one)."""
    lo, hi = layer.clamp
    if hi == float("inf"):
        np.maximum(values, np.float32(lo), out=out)
    else:
        np.clip(values, np.float32(lo), np.float32(hi), out=out)


def one_blas_thread():
    """A context in which numpy's BLAS uses one thread (calibration's parallelism is its own: :mod:`.parallel`).

    Calibration makes thousands of mid-sized matrix multiplies; OpenBLAS hands each to its worker threads and
    waits for them, which costs more than it gains at these sizes and, when the cores are shared, stalls each
    call for a scheduler time slice (the pointwise convolutions of a MobileNetV2 took 25 times longer with two
    threads than with one on a loaded two-core machine). Its threads also sum in another order than one thread
    does, so its results would depend on the thread count.
    """
    return threadpool_limits(limits=1, user_api="blas")


class LayerSums:
    """A weighted layer's sums on its quantized inputs for one weight, and per output channel their extremes:
    what every bias tried with that weight is observed from (:meth:`observed`)."""

    def __init__(self, layer: Layer, sums: np.ndarray):
        self.sums = sums
        self.others = layer.batch_reduction(sums.ndim)
        self._extremes = None

    def observed(self, layer: Layer, bias: np.ndarray | None) -> Observation:
        return Observation(layer, self, bias)

    def channel_extremes(self) -> tuple[np.ndarray, np.ndarray]:
        """(min, max) of the sums per output channel, float32 ``[C]`` (computed once, chunk by chunk)."""
        if self._extremes is None:
            others = self.others
            parts = run_all(lambda part: (np.min(self.sums[part], axis=others), np.max(self.sums[part], axis=others)),
                            chunks(len(self.sums), self.sums[0].size))
            self._extremes = (np.minimum.reduce([p[0] for p in parts]), np.maximum.reduce([p[1] for p in parts]))
        return self._extremes


class Observation:
    """A weighted layer over the calibration set, for one weight and bias: its accumulators (sums plus bias) and
    outputs (clamped), read as calibration reads them; each read is a pass over the chunks on the workers.

    The accumulators' per-channel extremes need no pass at all: float32 addition of one number is monotone
    (``a <= b`` gives ``fl(a + c) <= fl(b + c)``), so the extreme accumulator of a channel is its extreme sum plus
    its bias.
    """

    def __init__(self, layer: Layer, sums: LayerSums, bias: np.ndarray | None):
        self.layer, self._sums, self._bias = layer, sums, _bias(layer, bias)
        self.shape, self.ndim = sums.sums.shape, sums.sums.ndim
        self._chunks = chunks(self.shape[0], sums.sums[0].size)

    def _accumulators(self, part: slice) -> np.ndarray:
        sums = self._sums.sums[part]
        return sums if self._bias is None else np.add(sums, self._bias, out=buffers.empty_like(sums))

    def accumulator_sums(self, samples: int | None = None) -> list[np.ndarray]:
        """Per chunk of the first ``samples`` samples (None: all), in order: the float64 sum of its accumulators
        per output channel."""
        others = self._sums.others
        parts = self._chunks if samples is None else chunks(samples, self._sums.sums[0].size)
        return run_all(lambda part: np.sum(self._accumulators(part), axis=others, dtype=np.float64), parts)

    def accumulator_extremes(self) -> tuple[np.ndarray, np.ndarray]:
        """(min, max) of the accumulators per output channel, float64: the sums' extremes plus the bias."""
        low, high = self._sums.channel_extremes()
        if self._bias is not None:
            bias = self._bias.reshape(-1)
            low, high = low + bias, high + bias
        return low.astype(np.float64), high.astype(np.float64)

    def outputs(self) -> Batches:
        """The layer's outputs over the calibration set, samples in order (see :meth:`output_batches`)."""
        return Batches(self.output_batches)

    def output_batches(self):
        """The layer's outputs, samples in order, as batches (:func:`finished_batches`)."""
        return finished_batches(self.shape, self._chunks, lambda part, rows: finish_into(
            self.layer, self._sums.sums[part], self._bias, rows, rows))


def finished_batches(shape: tuple[int, ...], parts: list[slice], finish):
    """Outputs ``[N, ...]`` of ``shape`` as batches ``[k, ...]``, samples in order, each valid until the next: a
    chunk per worker at a time, so that the consumer has samples for every worker too. ``finish(part, rows)``
    writes the chunk ``part``'s outputs into ``rows`` (float32), on a worker."""
    per_batch = max(1, parallel.WORKERS)
    samples = parts[0].stop - parts[0].start
    buffer = buffers.empty((min(shape[0], per_batch * samples), *shape[1:]), np.float32)
    for first in range(0, len(parts), per_batch):
        group = parts[first:first + per_batch]
        offset = group[0].start
        batch = buffer[:group[-1].stop - offset]
        run_all(lambda part, offset=offset, batch=batch: finish(part, batch[part.start - offset:part.stop - offset]),
                group)
        yield batch


class HostObservation:
    """:class:`Observation` of a layer TVM computes: its accumulators and outputs, one chunk of every sample."""

    def __init__(self, layer: Layer, accumulators: np.ndarray | None, outputs: np.ndarray):
        self._acc, self._out = accumulators, outputs
        if accumulators is not None:
            self.shape, self.ndim = accumulators.shape, accumulators.ndim
            self._others = layer.batch_reduction(accumulators.ndim)

    def accumulator_sums(self, samples: int | None = None) -> list[np.ndarray]:
        return [np.sum(self._acc[:samples], axis=self._others, dtype=np.float64)]

    def accumulator_extremes(self) -> tuple[np.ndarray, np.ndarray]:
        others = self._others
        return (np.min(self._acc, axis=others).astype(np.float64), np.max(self._acc, axis=others).astype(np.float64))

    def outputs(self) -> np.ndarray:
        return self._out
