"""Tiling and SRAM planning of one layer: the one answer to "does it fit, and how?".

It sits below the pattern table and the codegen: the legality check asks an
operator's planner whether the layer can be tiled at all, and the lowering
receives the same plan.

Elementwise additions are planned as flat chunks of elements (two inputs and
the output in SRAM at once); spatial means as channel tiles holding the whole
height x width of those channels.


A layer runs as tiles: a range of output channels (the weights and scale/bias
rows for them stay in SRAM) times a stripe of output rows (the input rows it
needs, halo included, are loaded per stripe). ``plan_layer`` picks the largest
tile that fits the configuration's SRAM, preferring all output channels at
once (weights are then fetched exactly once). The same function answers the
pattern check's "can this be tiled at all?".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simulator.config import NpuConfig
from simulator.isa import ACTIVATION_FORMATS, WORD_RECORD, conv_output_size
from simulator.numerics import Rounding
from simulator.resize import ONE, source_rows

from .errors import UnsupportedOpError
from .params import (ElementwiseParams, ConcatParams, ConvParams, LutParams, MeanParams, NpuOp, PadParams,
                     PoolParams, ReshapeParams, SliceParams, SoftmaxParams, TransposeParams)
from .params import BatchMatMulParams, ResizeBilinearParams, ResizeNearestParams
from .prepare import resize_bilinear_steps


@dataclass(frozen=True)
class LayerGeometry:
    """A layer seen as an NHWC image operator (fully connected: N x 1 x IC, 1x1 kernel;
    pooling: per-channel like depthwise, without weights)."""

    height: int
    width: int
    in_channels: int
    out_height: int
    out_width: int
    out_channels: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    dilation: tuple[int, int]
    padding: tuple[int, int, int, int]
    depthwise: bool
    has_weights: bool = True
    element_bytes: int = 1
    """Bytes per input and output element: 1, or 2 for int16 activations (16x8)."""

    @classmethod
    def of(cls, p: ConvParams | PoolParams) -> "LayerGeometry":
        if isinstance(p, PoolParams):
            _, h, w, c = p.ifm_shape
            _, oh, ow, _ = p.ofm_shape
            return cls(h, w, c, oh, ow, c, p.kernel, p.strides, (1, 1), p.padding, True, has_weights=False)
        if p.op == NpuOp.FULLY_CONNECTED:
            batch, in_channels = p.ifm_shape
            return cls(batch, 1, in_channels, batch, 1, p.out_channels, (1, 1), (1, 1), (1, 1),
                       (0, 0, 0, 0), False)
        _, h, w, c = p.ifm_shape
        _, oh, ow, oc = p.ofm_shape
        return cls(h, w, c, oh, ow, oc, p.kernel, p.strides, p.dilation, p.padding,
                   p.op == NpuOp.DEPTHWISE_CONV2D, element_bytes=ACTIVATION_FORMATS[p.activation_type].dtype.itemsize)

    def input_rows(self, out_start: int, out_stop: int) -> tuple[int, int, int, int]:
        """(first input row, stop row, tile pad top, tile pad bottom) feeding output rows."""
        first = out_start * self.strides[0] - self.padding[0]
        last = (out_stop - 1) * self.strides[0] - self.padding[0] + self.dilation[0] * (self.kernel[0] - 1)
        start, stop = max(0, first), min(self.height, last + 1)
        return start, stop, start - first, last + 1 - stop

    @property
    def multiplier(self) -> int:
        """Output channels per input channel of a depthwise layer (its channel multiplier); 1 otherwise."""
        return self.out_channels // self.in_channels if self.depthwise else 1

    def weight_bytes(self, channels: int) -> int:
        if not self.has_weights:
            return 0
        per_channel = self.kernel[0] * self.kernel[1] * (1 if self.depthwise else self.in_channels)
        return channels * per_channel

    def scale_bias_bytes(self, channels: int) -> int:
        return channels * WORD_RECORD if self.has_weights else 0


@dataclass(frozen=True)
class TilePlan:
    """Chosen tile sizes and the SRAM address of each operand region."""

    channel_tile: int
    row_tile: int
    weights_address: int
    scale_bias_address: int
    ifm_address: int
    ofm_address: int
    sram_used: int


def _align(value: int, config: NpuConfig) -> int:
    return (value + config.sram_align - 1) // config.sram_align * config.sram_align


def _align_down(value: int, config: NpuConfig) -> int:
    return value // config.sram_align * config.sram_align


def _layout(g: LayerGeometry, channels: int, rows: int, config: NpuConfig) -> TilePlan:
    in_rows = (rows - 1) * g.strides[0] + g.dilation[0] * (g.kernel[0] - 1) + 1
    in_channels = channels // g.multiplier if g.depthwise else g.in_channels
    sizes = (g.weight_bytes(channels), g.scale_bias_bytes(channels),
             min(in_rows, g.height) * g.width * in_channels * g.element_bytes,
             rows * g.out_width * channels * g.element_bytes)
    addresses, cursor = [], 0
    for size in sizes:
        addresses.append(cursor)
        cursor = _align(cursor + size, config)
    return TilePlan(channels, rows, *addresses, sram_used=cursor)


def plan_layer(p: ConvParams | PoolParams, config: NpuConfig) -> TilePlan:
    """Largest (channel tile, row tile) whose operands fit in SRAM; raises if none does."""
    g = LayerGeometry.of(p)
    expected_w = conv_output_size(g.width, g.kernel[1], g.strides[1], g.dilation[1], g.padding[1], g.padding[3])
    expected_h = conv_output_size(g.height, g.kernel[0], g.strides[0], g.dilation[0], g.padding[0], g.padding[2])
    if (expected_h, expected_w) != (g.out_height, g.out_width):
        raise UnsupportedOpError("output shape does not follow from the window arithmetic")
    splits, m = 1, g.multiplier  # a depthwise tile holds whole groups of m outputs of one input channel
    while True:
        channels = math.ceil(g.out_channels / splits / m) * m
        low, high, best = 1, g.out_height, None
        while low <= high:  # SRAM use grows with rows: binary search the largest stripe
            mid = (low + high) // 2
            plan = _layout(g, channels, mid, config)
            if plan.sram_used <= config.sram_bytes:
                best, low = plan, mid + 1
            else:
                high = mid - 1
        if best is not None:
            return best
        if channels == m:
            raise UnsupportedOpError(f"one output row of one channel needs more than the "
                                     f"{config.sram_bytes}-byte SRAM, so the layer cannot be tiled")
        splits *= 2


def as_global_mean(p: PoolParams) -> MeanParams | None:
    """An onnxruntime average pool whose window is the whole input (stride 1, no padding), as a MEAN.

    MLAS runs it with its global kernel (four lane sums), not the windowed one,
    so it is lowered as the MEAN unit's onnxruntime mean, which sums in that order.
    """
    _, height, width, _ = p.ifm_shape
    if not (p.op == NpuOp.AVG_POOL2D and p.rounding == Rounding.ONNXRUNTIME and tuple(p.kernel) == (height, width)
            and tuple(p.strides) == (1, 1) and not any(p.padding)):
        return None
    return MeanParams(op=NpuOp.MEAN, ifm_shape=p.ifm_shape, ofm_shape=p.ofm_shape, input_scale=p.input_scale,
                      input_zero_point=p.input_zero_point, output_scale=p.output_scale,
                      output_zero_point=p.output_zero_point, rounding=p.rounding)


def plan_pool(p: PoolParams, config: NpuConfig) -> "TilePlan | MeanPlan":
    """A pooling layer tiles like a depthwise one, except onnxruntime's global average (a MEAN)."""
    mean = as_global_mean(p)
    return plan_mean(mean, config) if mean is not None else plan_layer(p, config)


@dataclass(frozen=True)
class ElementwisePlan:
    chunk: int
    ifm_address: int
    ifm2_address: int
    ofm_address: int


@dataclass(frozen=True)
class MeanPlan:
    channel_tile: int
    ifm_address: int
    ofm_address: int


def plan_elementwise(p: ElementwiseParams, config: NpuConfig) -> ElementwisePlan:
    """Largest element chunk such that both inputs and the output fit side by side; whole pixels when an
    operand is a per-channel vector, which is replicated over the chunk's pixels."""
    total = math.prod(p.shape)
    chunk = min(total, _align_down(config.sram_bytes // 3, config))
    if p.broadcast:
        channels = p.shape[-1]
        chunk = min(total, config.sram_bytes // 3 // channels * channels)
    if chunk < 1:
        raise UnsupportedOpError(f"the {config.sram_bytes}-byte SRAM cannot hold three elementwise operands"
                                 + (" of a whole pixel each" if p.broadcast else ""))
    stride = _align(chunk, config)
    return ElementwisePlan(chunk, 0, stride, 2 * stride)


@dataclass(frozen=True)
class SoftmaxPlan:
    rows: int
    """Rows (softmax vectors) per chunk."""
    ifm_address: int
    ofm_address: int


def plan_softmax(p: SoftmaxParams, config: NpuConfig) -> SoftmaxPlan:
    """Most whole rows whose input and output fit side by side (a row is never split: its sum needs all of it)."""
    depth, rows = p.shape[-1], math.prod(p.shape[:-1])
    chunk = min(rows, (config.sram_bytes // 2 - config.sram_align) // depth)
    if chunk < 1:
        raise UnsupportedOpError(f"a softmax row of {depth} elements and its output do not fit the "
                                 f"{config.sram_bytes}-byte SRAM")
    return SoftmaxPlan(chunk, 0, _align(chunk * depth, config))


def plan_mean(p: MeanParams, config: NpuConfig) -> MeanPlan:
    """Most channels whose whole spatial extent (plus one output byte each) fits in SRAM."""
    _, height, width, channels = p.ifm_shape
    tile = min(channels, (config.sram_bytes - config.sram_align) // (height * width + 1))
    if tile < 1:
        raise UnsupportedOpError(f"one {height}x{width} channel does not fit the {config.sram_bytes}-byte SRAM, "
                                 "so the mean cannot be tiled")
    return MeanPlan(tile, 0, _align(tile * height * width, config))


def plan_copy(p: ReshapeParams, config: NpuConfig) -> int:
    """Bytes per DMA chunk of a reshape, which moves the tensor unchanged through SRAM."""
    return min(math.prod(p.ifm_shape), config.sram_bytes)


@dataclass(frozen=True)
class LutPlan:
    chunk: int
    table_address: int
    ifm_address: int
    ofm_address: int


INT8_TABLE_ENTRIES = 256
"""An int8 input indexes a table of 256 entries."""


def plan_lut(p: LutParams, config: NpuConfig) -> LutPlan:
    """The table, then input and output chunks of equal size."""
    if config.lut_entries != INT8_TABLE_ENTRIES:
        raise UnsupportedOpError(f"an int8 table needs {INT8_TABLE_ENTRIES} entries; {config.name}'s look-up "
                                 f"table has {config.lut_entries}")
    table = _align(config.lut_entries, config)
    chunk = min(math.prod(p.shape), _align_down((config.sram_bytes - table) // 2, config))
    if chunk < 1:
        raise UnsupportedOpError(f"the {config.sram_bytes}-byte SRAM cannot hold a look-up table and its operands")
    return LutPlan(chunk, 0, table, table + _align(chunk, config))


def plan_concat(p: ConcatParams, config: NpuConfig) -> list[tuple[int, int, int]]:
    """Per input: (row bytes, rows per chunk, byte offset of its slice in an output row).

    A row is everything after ``axis`` for one index before it: each input's rows
    land side by side in the output's rows.
    """
    inner = math.prod(p.ofm_shape[p.axis + 1:])
    plans, offset = [], 0
    for extent in p.extents:
        row_bytes = extent * inner
        if row_bytes > config.sram_bytes:
            raise UnsupportedOpError(f"a {row_bytes}-byte concat row does not fit the {config.sram_bytes}-byte SRAM")
        plans.append((row_bytes, config.sram_bytes // row_bytes, offset))
        offset += row_bytes
    return plans


def plan_pad(p: PadParams, config: NpuConfig) -> int:
    """Output rows per stripe: a stripe is filled with the pad value, then the input rows land inside it."""
    _, height, width, channels = p.ifm_shape
    out_row = (width + p.padding[1] + p.padding[3]) * channels
    rows = config.sram_bytes // out_row
    if rows < 1:
        raise UnsupportedOpError(f"a {out_row}-byte padded row does not fit the {config.sram_bytes}-byte SRAM")
    return min(rows, height + p.padding[0] + p.padding[2])


def plan_transpose(p: TransposeParams, config: NpuConfig) -> int:
    """Whole source rows (scatter) or columns (gather) per SRAM load, whichever side is shorter."""
    rows, columns = p.matrix
    line = max(rows, columns)
    if line > config.sram_bytes:
        raise UnsupportedOpError(f"a {line}-byte transpose line does not fit the {config.sram_bytes}-byte SRAM")
    return min(min(rows, columns), config.sram_bytes // line)


def plan_slice(p: SliceParams, config: NpuConfig) -> int:
    """Output rows gathered into SRAM per store."""
    _, _, width, channels = p.ofm_shape
    rows = config.sram_bytes // (width * channels)
    if rows < 1:
        raise UnsupportedOpError(f"a {width * channels}-byte output row does not fit the {config.sram_bytes}-byte SRAM")
    return min(rows, p.ofm_shape[1])


def plan_resize_nearest(p: ResizeNearestParams, config: NpuConfig) -> int:
    """Input rows per stripe: each is widened in SRAM into a whole output row, which is then stored once per
    vertical repeat (images of a batch stack: input row r feeds output rows r * f_h ... r * f_h + f_h - 1)."""
    batch, height, _, channels = p.ifm_shape
    out_row = p.ofm_shape[2] * channels
    rows = config.sram_bytes // out_row
    if rows < 1:
        raise UnsupportedOpError(f"a {out_row}-byte upscaled row does not fit the {config.sram_bytes}-byte SRAM")
    return min(rows, batch * height)


@dataclass(frozen=True)
class ResizePlan:
    channel_tile: int
    row_tile: int
    """Output rows per tile."""
    ifm_address: int
    ofm_address: int


def bilinear_input_rows(p: ResizeBilinearParams, steps: tuple, out_start: int, out_stop: int) -> tuple[int, int]:
    """(first, stop) input rows that output rows ``out_start`` .. ``out_stop - 1`` read (positions grow with
    the row, so the first row's lower and the last row's upper neighbour bound them)."""
    step_h, _, offset_h, _ = steps
    lo, hi = source_rows([out_start * step_h + offset_h, (out_stop - 1) * step_h + offset_h], p.ifm_shape[1])
    return int(lo[0]), int(hi[1]) + 1


def _bilinear_span(rows: int, step: int, height: int) -> int:
    """Most input rows any ``rows`` consecutive outputs read: their positions span (rows - 1) * step, and
    the rows around both ends add at most two."""
    return min(height, -(-(rows - 1) * step // ONE) + 2)


def plan_resize_bilinear(p: ResizeBilinearParams, config: NpuConfig) -> ResizePlan:
    """Largest (channel tile, output row stripe) whose input rows (full width) and output rows fit in SRAM,
    preferring all channels at once."""
    _, height, width, channels = p.ifm_shape
    _, out_height, out_width, _ = p.ofm_shape
    step_h = resize_bilinear_steps(p)[0]
    splits = 1
    while True:
        tile = math.ceil(channels / splits)
        low, high, best = 1, out_height, None
        while low <= high:  # SRAM use grows with rows: binary search the largest stripe
            mid = (low + high) // 2
            ofm_address = _align(_bilinear_span(mid, step_h, height) * width * tile, config)
            if ofm_address + mid * out_width * tile <= config.sram_bytes:
                best, low = ResizePlan(tile, mid, 0, ofm_address), mid + 1
            else:
                high = mid - 1
        if best is not None:
            return best
        if tile == 1:
            raise UnsupportedOpError(f"the input rows of one output row of one channel and that row need more "
                                     f"than the {config.sram_bytes}-byte SRAM, so the resize cannot be tiled")
        splits *= 2


@dataclass(frozen=True)
class MatMulPlan:
    batches: int
    """Batches per tile: several whole ones, or one split into row stripes of the left operand."""
    rows: int
    """Rows of the left operand (and of the output) per tile."""
    ifm_address: int
    ifm2_address: int
    ofm_address: int


def _matmul_layout(p: BatchMatMulParams, batches: int, rows: int, config: NpuConfig) -> tuple[MatMulPlan, int]:
    _, _, depth, columns = p.dims
    addresses, cursor = [], 0
    for size in (batches * rows * depth, batches * depth * columns, batches * rows * columns):
        addresses.append(cursor)
        cursor = _align(cursor + size, config)
    return MatMulPlan(batches, rows, *addresses), cursor


def plan_batch_matmul(p: BatchMatMulParams, config: NpuConfig) -> MatMulPlan:
    """Most whole batches (both operands and the output) that fit in SRAM; else one batch's right operand
    whole with the most rows of the left operand beside it. Raises when one row does not fit."""
    batches, rows, _, _ = p.dims

    def fits(tile_batches: int, tile_rows: int) -> bool:
        return _matmul_layout(p, tile_batches, tile_rows, config)[1] <= config.sram_bytes

    if fits(1, rows):
        most = max(b for b in range(1, batches + 1) if fits(b, rows))
        return _matmul_layout(p, most, rows, config)[0]
    stripe = max((r for r in range(1, rows) if fits(1, r)), default=0)
    if stripe < 1:
        _, _, depth, columns = p.dims
        raise UnsupportedOpError(f"one batch's {depth}x{columns} right operand, a row of the left operand and a "
                                 f"row of the output need more than the {config.sram_bytes}-byte SRAM")
    return _matmul_layout(p, 1, stripe, config)[0]
