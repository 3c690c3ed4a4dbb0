"""Per-operator DRAM-in/DRAM-out tile programs: the commands one layer becomes, DMA included.

Each ``emit_*`` receives the layer's record, the plan its operator's planner
chose (:mod:`npu_backend.tiling`) and the constants its preparation computed
(:mod:`npu_backend.prepare`), so the check that offloaded the layer and the
code that lowers it cannot disagree. Such a layer reads its input from DRAM and
writes its output to DRAM; within it the tiles are moved with explicit DMA
commands. The region scheduler (:mod:`npu_backend.codegen.schedule`) runs them
for layers without a row program (:mod:`npu_backend.codegen.programs`), giving
them the whole SRAM for their step, and for a whole region it cannot fit.
"""

from __future__ import annotations

import numpy as np

from simulator.config import NpuConfig
from simulator.isa import (Buffer, BufferKind, Command, DmaCopy, Elementwise, FeatureMap, MemorySpace,
                           Opcode, Reduction, Softmax, TableLookup)
from simulator.numerics import Rounding

from ..errors import UnsupportedOpError
from ..params import (ConcatParams, ConvParams, ElementwiseParams, LutParams, MeanParams, PadParams, PoolParams,
                      ReshapeParams, SliceParams, SoftmaxParams, TransposeParams)
from ..tiling import TilePlan, as_global_mean
from .programs import MacProgram, Operand, PoolProgram


class StreamBuilder:
    """Accumulates buffers and commands of one stream."""

    def __init__(self, config: NpuConfig):
        self.config = config
        self.buffers: list[Buffer] = []
        self.commands: list[Command] = []

    def add_buffer(self, name: str, kind: BufferKind, shape=(), dtype="int8", data: bytes = b"",
                   size: int | None = None) -> int:
        if size is None:
            size = len(data) if data else int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.buffers.append(Buffer(name, kind, size, dtype, tuple(int(d) for d in shape), data))
        return len(self.buffers) - 1

    def dma(self, layer: str, buffer: int, dram_offset: int, sram_address: int, row_bytes: int,
            rows: int = 1, dram_stride: int = 0, sram_stride: int = 0, to_sram: bool = True) -> None:
        dram = (MemorySpace.DRAM, buffer, dram_offset, dram_stride)
        sram = (MemorySpace.SRAM, -1, sram_address, sram_stride)
        (ss, sb, so, sst), (ds, db, do, dst) = (dram, sram) if to_sram else (sram, dram)
        self.commands.append(Command(Opcode.DMA_COPY, DmaCopy(ss, sb, so, ds, db, do, row_bytes, rows,
                                                              sst, dst), layer))

    def feature_dma(self, layer: str, buffer: int, pixel_start: int, pixels: int, channels: int,
                    channel_start: int, channel_count: int, sram_address: int, to_sram: bool,
                    element_bytes: int = 1) -> None:
        """Move ``pixels`` NHWC pixels, restricted to a channel range, between DRAM and SRAM (elements of
        ``element_bytes``: 2 for int16 activations)."""
        e = element_bytes
        offset = (pixel_start * channels + channel_start) * e
        if channel_count == channels:
            self.dma(layer, buffer, offset, sram_address, pixels * channels * e, to_sram=to_sram)
        else:
            self.dma(layer, buffer, offset, sram_address, channel_count * e, rows=pixels,
                     dram_stride=channels * e, sram_stride=channel_count * e, to_sram=to_sram)


def mac_program(opcode: Opcode):
    """The tile program of a MAC-array operator: constants, DMA and compute commands, tile by tile."""

    def emit(sb: StreamBuilder, p: ConvParams, plan: TilePlan, prepared, layer: str, sources: list[int],
             dst: int) -> None:
        _emit_mac(sb, opcode, p, plan, prepared, layer, sources, dst)

    emit.__doc__ = f"{opcode.name} layer, (output channels x output rows) tiles."
    return emit


def _emit_mac(sb: StreamBuilder, opcode: Opcode, p: ConvParams, plan: TilePlan, prepared, layer: str,
              sources: list[int], dst: int) -> None:
    """The layer's row program (:class:`~npu_backend.codegen.programs.MacProgram`) says what each tile
    computes and holds its constants; here every tile goes DRAM -> SRAM -> DRAM at the plan's addresses."""
    (src,) = sources
    program = MacProgram(opcode, p, prepared)
    g = program.g
    weights_c, table_c = program.constants
    weights = sb.add_buffer(f"{layer}.weights", BufferKind.CONSTANT, weights_c.shape, data=weights_c.data)
    scale_bias = sb.add_buffer(f"{layer}.scale_bias", BufferKind.CONSTANT, table_c.shape, table_c.dtype,
                               data=table_c.data)
    for c0 in range(0, g.out_channels, plan.channel_tile):
        ct = min(plan.channel_tile, g.out_channels - c0)
        sb.dma(layer, weights, c0 * weights_c.per_channel, plan.weights_address, ct * weights_c.per_channel)
        sb.dma(layer, scale_bias, c0 * table_c.per_channel, plan.scale_bias_address, ct * table_c.per_channel)
        in_c0, in_ct = (c0 // g.multiplier, ct // g.multiplier) if g.depthwise else (0, g.in_channels)
        for oy0 in range(0, g.out_height, plan.row_tile):
            oy1 = min(g.out_height, oy0 + plan.row_tile)
            window = program.window(0, oy0, oy1)
            if window.stop <= window.start:
                raise UnsupportedOpError(f"{layer}: output rows {oy0}..{oy1} read only padding")
            sb.feature_dma(layer, src, window.start * g.width, (window.stop - window.start) * g.width,
                           g.in_channels, in_c0, in_ct, plan.ifm_address, to_sram=True, element_bytes=g.element_bytes)
            sb.commands.append(program.command(layer, oy0, oy1, c0, ct, [Operand(plan.ifm_address, window)],
                                               plan.ofm_address, [plan.weights_address, plan.scale_bias_address]))
            sb.feature_dma(layer, dst, oy0 * g.out_width, (oy1 - oy0) * g.out_width, g.out_channels, c0, ct,
                           plan.ofm_address, to_sram=False, element_bytes=g.element_bytes)


def elementwise_program(opcode: Opcode):
    """The tile program of a binary elementwise operator (ADD, SUB, MUL) over flat chunks of both inputs.

    Its arithmetic fields come prepared (:func:`simulator.elementwise.elementwise_fields`). A constant
    second operand (``None`` among the sources) joins the stream as a constant buffer.
    """

    def emit(sb: StreamBuilder, p: ElementwiseParams, plan, fields: dict, layer: str, sources: list[int],
             dst: int) -> None:
        _emit_elementwise(sb, opcode, p, plan, fields, layer, sources, dst)

    emit.__doc__ = f"{opcode.name} over flat chunks of both inputs."
    return emit


def _emit_elementwise(sb: StreamBuilder, opcode: Opcode, p: ElementwiseParams, plan, fields: dict, layer: str,
                      sources: list[int], dst: int) -> None:
    src, src2 = sources
    if src2 is None:
        src2 = sb.add_buffer(f"{layer}.input2", BufferKind.CONSTANT, p.shape,
                             data=np.ascontiguousarray(p.input2_values, dtype=np.int8).tobytes())
    total, channels = int(np.prod(p.shape)), p.shape[-1]
    for start in range(0, total, plan.chunk):
        count = min(plan.chunk, total - start)
        for index, (buffer, address) in enumerate(((src, plan.ifm_address), (src2, plan.ifm2_address))):
            if index in p.broadcast:  # one value per channel: the same row read once per pixel of the chunk
                sb.dma(layer, buffer, 0, address, channels, rows=count // channels, dram_stride=0,
                       sram_stride=channels)
            else:
                sb.dma(layer, buffer, start, address, count)
        op = Elementwise(
            ifm=FeatureMap(plan.ifm_address, 1, count, 1), ifm2=FeatureMap(plan.ifm2_address, 1, count, 1),
            ofm=FeatureMap(plan.ofm_address, 1, count, 1), input_zero_point=p.input_zero_point,
            input2_zero_point=p.input2_zero_point, output_zero_point=p.output_zero_point, act_min=p.clamp[0],
            act_max=p.clamp[1], rounding=p.rounding, **fields)
        sb.commands.append(Command(opcode, op, layer))
        sb.dma(layer, dst, start, plan.ofm_address, count, to_sram=False)


def emit_softmax(sb: StreamBuilder, p: SoftmaxParams, plan, prepared, layer: str, sources: list[int],
                 dst: int) -> None:
    """Whole rows at a time: each row's maximum and sum of exponentials need all of it."""
    (src,) = sources
    multiplier, left_shift, diff_min = prepared
    depth, rows = p.shape[-1], int(np.prod(p.shape[:-1]))
    for r0 in range(0, rows, plan.rows):
        count = min(plan.rows, rows - r0)
        sb.dma(layer, src, r0 * depth, plan.ifm_address, count * depth)
        op = Softmax(ifm=FeatureMap(plan.ifm_address, 1, count, depth),
                     ofm=FeatureMap(plan.ofm_address, 1, count, depth), input_multiplier=multiplier,
                     input_left_shift=left_shift, diff_min=diff_min, output_zero_point=p.output_zero_point)
        sb.commands.append(Command(Opcode.SOFTMAX, op, layer))
        sb.dma(layer, dst, r0 * depth, plan.ofm_address, count * depth, to_sram=False)


def emit_mean(sb: StreamBuilder, p: MeanParams, plan, prepared, layer: str, sources: list[int], dst: int,
              clamp: tuple[int, int] = (-128, 127)) -> None:
    """Spatial mean, a channel tile at a time (each tile holds the whole height x width).

    TFLite roundings carry the multiplier (1 / count folded in);
    ``Rounding.ONNXRUNTIME`` carries the two float32 scales instead.
    """
    (src,) = sources
    _, height, width, channels = p.ifm_shape
    multiplier, shift = prepared
    scales = (dict(input_scale=p.input_scale, output_scale=p.output_scale)
              if p.rounding == Rounding.ONNXRUNTIME else {})
    for c0 in range(0, channels, plan.channel_tile):
        ct = min(plan.channel_tile, channels - c0)
        sb.feature_dma(layer, src, 0, height * width, channels, c0, ct, plan.ifm_address, to_sram=True)
        op = Reduction(ifm=FeatureMap(plan.ifm_address, height, width, ct), ofm=FeatureMap(plan.ofm_address, 1, 1, ct),
                       input_zero_point=p.input_zero_point, output_zero_point=p.output_zero_point,
                       multiplier=multiplier, shift=shift, act_min=clamp[0], act_max=clamp[1], rounding=p.rounding,
                       **scales)
        sb.commands.append(Command(Opcode.MEAN, op, layer))
        sb.feature_dma(layer, dst, 0, 1, channels, c0, ct, plan.ofm_address, to_sram=False)


def pool_program(opcode: Opcode):
    """The tile program of a pooling operator: (channel tile x row stripe) tiles, halos included, like a
    depthwise layer.

    An onnxruntime average pool carries its qparams (it requantizes its float
    average); one over the whole input is a MEAN (:func:`npu_backend.tiling.as_global_mean`).
    """

    def emit(sb: StreamBuilder, p: PoolParams, plan, prepared, layer: str, sources: list[int], dst: int) -> None:
        mean = as_global_mean(p)
        if mean is not None:
            emit_mean(sb, mean, plan, (0, 0), layer, sources, dst, clamp=p.clamp)
        else:
            _emit_pool(sb, opcode, p, plan, layer, sources, dst)

    emit.__doc__ = f"{opcode.name} in (channel tile x row stripe) tiles."
    return emit


def _emit_pool(sb: StreamBuilder, opcode: Opcode, p: PoolParams, plan: TilePlan, layer: str, sources: list[int],
               dst: int) -> None:
    """The layer's row program (:class:`~npu_backend.codegen.programs.PoolProgram`) says what each tile
    computes; here every tile goes DRAM -> SRAM -> DRAM at the plan's addresses."""
    (src,) = sources
    program = PoolProgram(opcode, p, None)
    g = program.g
    for c0 in range(0, g.out_channels, plan.channel_tile):
        ct = min(plan.channel_tile, g.out_channels - c0)
        for oy0 in range(0, g.out_height, plan.row_tile):
            oy1 = min(g.out_height, oy0 + plan.row_tile)
            window = program.window(0, oy0, oy1)
            sb.feature_dma(layer, src, window.start * g.width, (window.stop - window.start) * g.width,
                           g.in_channels, c0, ct, plan.ifm_address, to_sram=True)
            sb.commands.append(program.command(layer, oy0, oy1, c0, ct, [Operand(plan.ifm_address, window)],
                                               plan.ofm_address, []))
            sb.feature_dma(layer, dst, oy0 * g.out_width, (oy1 - oy0) * g.out_width, g.out_channels, c0, ct,
                           plan.ofm_address, to_sram=False)


def emit_reshape(sb: StreamBuilder, p: ReshapeParams, chunk: int, prepared, layer: str, sources: list[int],
                 dst: int) -> None:
    """A reshape moves the bytes unchanged; they pass through SRAM in chunks."""
    (src,) = sources
    total = int(np.prod(p.ifm_shape))
    for start in range(0, total, chunk):
        count = min(chunk, total - start)
        sb.dma(layer, src, start, 0, count)
        sb.dma(layer, dst, start, 0, count, to_sram=False)


def emit_lut(sb: StreamBuilder, p: LutParams, plan, table: np.ndarray, layer: str, sources: list[int],
             dst: int) -> None:
    """Load the operator's table once, then look up the input chunk by chunk."""
    (src,) = sources
    table = np.ascontiguousarray(table, dtype=np.int8)
    buffer = sb.add_buffer(f"{layer}.table", BufferKind.CONSTANT, table.shape, data=table.tobytes())
    sb.dma(layer, buffer, 0, plan.table_address, table.size)
    total = int(np.prod(p.shape))
    for start in range(0, total, plan.chunk):
        count = min(plan.chunk, total - start)
        sb.dma(layer, src, start, plan.ifm_address, count)
        op = TableLookup(ifm=FeatureMap(plan.ifm_address, 1, count, 1), ofm=FeatureMap(plan.ofm_address, 1, count, 1),
                         table_address=plan.table_address)
        sb.commands.append(Command(Opcode.LUT, op, layer))
        sb.dma(layer, dst, start, plan.ofm_address, count, to_sram=False)


def emit_concat(sb: StreamBuilder, p: ConcatParams, plan, prepared, layer: str, sources: list[int],
                dst: int) -> None:
    """Each input's rows go through SRAM into their slice of the output's rows (strided DMA)."""
    rows = int(np.prod(p.ofm_shape[:p.axis]))
    out_row = int(np.prod(p.ofm_shape[p.axis:]))
    for src, (row_bytes, chunk, offset) in zip(sources, plan):
        for r0 in range(0, rows, chunk):
            count = min(chunk, rows - r0)
            sb.dma(layer, src, r0 * row_bytes, 0, row_bytes, rows=count, dram_stride=row_bytes,
                   sram_stride=row_bytes)
            sb.dma(layer, dst, r0 * out_row + offset, 0, row_bytes, rows=count, dram_stride=out_row,
                   sram_stride=row_bytes, to_sram=False)


def emit_pad(sb: StreamBuilder, p: PadParams, stripe: int, prepared, layer: str, sources: list[int],
             dst: int) -> None:
    """Stripes of output rows: fill from a constant of pad values, drop the input rows in, store."""
    (src,) = sources
    _, height, width, channels = p.ifm_shape
    top, left, bottom, right = p.padding
    out_row, in_row = (width + left + right) * channels, width * channels
    fill = sb.add_buffer(f"{layer}.fill", BufferKind.CONSTANT, (stripe * out_row,),
                         data=np.full(stripe * out_row, p.pad_value, dtype=np.int8).tobytes())
    total_rows = height + top + bottom
    for r0 in range(0, total_rows, stripe):
        r1 = min(total_rows, r0 + stripe)
        sb.dma(layer, fill, 0, 0, (r1 - r0) * out_row)
        first, last = max(r0, top), min(r1, top + height)  # output rows that hold input rows
        if first < last:
            sb.dma(layer, src, (first - top) * in_row, (first - r0) * out_row + left * channels, in_row,
                   rows=last - first, dram_stride=in_row, sram_stride=out_row)
        sb.dma(layer, dst, r0 * out_row, 0, (r1 - r0) * out_row, to_sram=False)


def emit_transpose(sb: StreamBuilder, p: TransposeParams, chunk: int, prepared, layer: str, sources: list[int],
                   dst: int) -> None:
    """A 2-D transpose by strided DMA: the output is the source matrix's columns, one after another.

    Along the shorter side: with fewer rows, load whole rows and scatter each
    into a column of the output (one byte per DMA row, output stride = rows);
    with fewer columns, gather each column into SRAM and store them contiguously.
    """
    (src,) = sources
    rows, columns = p.matrix
    if rows <= columns:
        for r0 in range(0, rows, chunk):
            count = min(chunk, rows - r0)
            sb.dma(layer, src, r0 * columns, 0, count * columns)
            for r in range(r0, r0 + count):
                sb.dma(layer, dst, r, (r - r0) * columns, 1, rows=columns, dram_stride=rows, sram_stride=1,
                       to_sram=False)
    else:
        for c0 in range(0, columns, chunk):
            count = min(chunk, columns - c0)
            for c in range(c0, c0 + count):
                sb.dma(layer, src, c, (c - c0) * rows, 1, rows=rows, dram_stride=columns, sram_stride=1)
            sb.dma(layer, dst, c0 * rows, 0, count * rows, to_sram=False)


def emit_strided_slice(sb: StreamBuilder, p: SliceParams, stripe: int, prepared, layer: str, sources: list[int],
                       dst: int) -> None:
    """Gather output rows into SRAM with strided DMA (one transfer per row, or per pixel when channels
    are strided too), then store each stripe contiguously."""
    (src,) = sources
    _, height, width, channels = p.ifm_shape
    _, out_h, out_w, out_c = p.ofm_shape
    _, b_h, b_w, b_c = p.begin
    _, s_h, s_w, s_c = p.strides
    out_row = out_w * out_c
    for r0 in range(0, out_h, stripe):
        count = min(stripe, out_h - r0)
        for r in range(r0, r0 + count):
            first = ((b_h + r * s_h) * width + b_w) * channels + b_c
            if s_c == 1:
                sb.dma(layer, src, first, (r - r0) * out_row, out_c, rows=out_w, dram_stride=s_w * channels,
                       sram_stride=out_c)
            else:
                for w in range(out_w):
                    sb.dma(layer, src, first + w * s_w * channels, (r - r0) * out_row + w * out_c, 1, rows=out_c,
                           dram_stride=s_c, sram_stride=1)
        sb.dma(layer, dst, r0 * out_row, 0, count * out_row, to_sram=False)
