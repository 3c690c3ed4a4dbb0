"""Tile programs: what one layer computes, stripe by stripe, without deciding where anything lives.

A row program sees every operand as rows of a feature map (``MapShape``: height x width x channels,
NHWC with batch 1; a fully connected input of ``batch x channels`` is ``batch x 1 x channels``). It
answers two questions, and nothing else:

- which input rows (halo and padding included) output rows ``o0 .. o1 - 1`` read
  (:meth:`RowProgram.window`), and
- the compute command for those rows and a range of output channels, once the scheduler has said at
  which SRAM addresses its operands are (:meth:`RowProgram.command`).

Where data lives (DRAM, a stripe buffer, a feature map kept whole in SRAM), in what order stripes run
and what is prefetched is the region scheduler's business (:mod:`npu_backend.codegen.schedule`).
Operators without a row program (reshape, concat, softmax, ...) keep their DRAM-in/DRAM-out tile
programs of :mod:`npu_backend.codegen.emit`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.isa import (WORD_RECORD, Command, Convolution, Elementwise, FeatureMap, Opcode, Pooling,
                           Reduction, SCALE_RECORD, pack_scale_bias, pack_scale_records, scale_bias_record)
from simulator.numerics import Rounding

from ..params import ConvParams, ElementwiseParams, MeanParams, NpuOp, NpuParams, PoolParams
from ..tiling import LayerGeometry, as_global_mean


@dataclass(frozen=True)
class MapShape:
    """A feature map seen as rows: ``height`` rows of ``width x channels`` elements of ``itemsize`` bytes."""

    height: int
    width: int
    channels: int
    itemsize: int = 1

    @property
    def row_bytes(self) -> int:
        return self.width * self.channels * self.itemsize

    @property
    def nbytes(self) -> int:
        return self.height * self.row_bytes

    @classmethod
    def of(cls, shape: tuple[int, ...], itemsize: int = 1) -> "MapShape | None":
        """NHWC with batch 1, or ``batch x channels`` (a fully connected operand); ``None`` otherwise."""
        if len(shape) == 4 and shape[0] == 1:
            return cls(shape[1], shape[2], shape[3], itemsize)
        if len(shape) == 2:
            return cls(shape[0], 1, shape[1], itemsize)
        return None


@dataclass(frozen=True)
class Window:
    """Input rows ``start .. stop - 1`` feed an output stripe, with ``pad_top``/``pad_bottom`` rows of padding."""

    start: int
    stop: int
    pad_top: int = 0
    pad_bottom: int = 0


@dataclass(frozen=True)
class Constant:
    """A constant operand kept in SRAM while the layer runs; ``per_channel`` bytes per output channel when the
    layer can be split by output channels (its rows are in output-channel order), else 0."""

    role: str
    data: bytes
    shape: tuple[int, ...]
    dtype: str
    per_channel: int


@dataclass(frozen=True)
class Operand:
    """Where the scheduler put one input of a tile: its SRAM address (of the window's first row) and window."""

    address: int
    window: Window


class RowProgram:
    """Base of the row programs; ``inputs`` are the shapes of the layer's (non-constant) inputs, in order."""

    out: MapShape
    inputs: tuple[MapShape, ...]
    constants: tuple[Constant, ...] = ()
    splits_channels: bool = False
    """Output channels may be computed in tiles (each reads every input channel): convolution, fully connected."""

    def window(self, operand: int, o0: int, o1: int) -> Window:
        raise NotImplementedError

    def command(self, layer: str, o0: int, o1: int, c0: int, ct: int, ifms: list[Operand], ofm_address: int,
                constants: list[int]) -> Command:
        raise NotImplementedError

    @property
    def halo_free(self) -> bool:
        """Output row r reads input row r alone (elementwise, 1x1 stride-1): striping never recomputes."""
        return all(self.window(i, 0, 1) == Window(0, 1) and self.inputs[i].height == self.out.height
                   for i in range(len(self.inputs)))


class WindowedProgram(RowProgram):
    """A layer whose output rows read a kernel window of input rows (its ``g``: :class:`LayerGeometry`)."""

    g: LayerGeometry

    def window(self, operand: int, o0: int, o1: int) -> Window:
        return Window(*self.g.input_rows(o0, o1))


class MacProgram(WindowedProgram):
    """CONV2D, DEPTHWISE_CONV2D and FULLY_CONNECTED: weights and the scale/bias table stay in SRAM.

    ``packed``: the table in the rounding's short records (:func:`simulator.isa.scale_bias_record`: 9 bytes, a
    quarter fewer to move, or 8 for a float64 scale, a third fewer); else the three words every format reads."""

    def __init__(self, opcode: Opcode, p: ConvParams, prepared, packed: bool = False):
        self.opcode, self.p, self.g = opcode, p, LayerGeometry.of(p)
        g, e = self.g, self.g.element_bytes
        self.out = MapShape(g.out_height, g.out_width, g.out_channels, e)
        self.inputs = (MapShape(g.height, g.width, g.in_channels, e),)
        multiplier, shift = prepared
        table = np.stack([p.bias.astype(np.int32), multiplier, shift], axis=1).astype("<i4")
        self.table = table
        """The three words per output channel the output stage reads (:func:`simulator.isa.scale_bias_words`),
        whatever record the constant is packed in."""
        self.record = scale_bias_record(p.rounding) if packed else WORD_RECORD
        weights = np.ascontiguousarray(p.weights, dtype=np.int8)
        words = self.record == WORD_RECORD
        if self.record == SCALE_RECORD.itemsize:  # the output stage forms the float64 scales from the float32 ones
            records = pack_scale_records(table[:, 0], p.weight_scales)
            self.scales = (p.input_scale, p.output_scale)
        else:
            records, self.scales = pack_scale_bias(table, self.record), (0.0, 0.0)
        self.constants = (Constant("weights", weights.tobytes(), weights.shape, "int8", g.weight_bytes(1)),
                          Constant("scale_bias", records, table.shape if words else (len(table) * self.record,),
                                   "int32" if words else "uint8", self.record))
        self.splits_channels = not g.depthwise

    def command(self, layer, o0, o1, c0, ct, ifms, ofm_address, constants):
        g, p = self.g, self.p
        (ifm,) = ifms
        w = ifm.window
        in_ct = ct // g.multiplier if g.depthwise else g.in_channels
        conv = Convolution(
            ifm=FeatureMap(ifm.address, w.stop - w.start, g.width, in_ct, p.activation_type),
            ofm=FeatureMap(ofm_address, o1 - o0, g.out_width, ct, p.activation_type),
            weights_address=constants[0], scale_bias_address=constants[1], kernel=g.kernel, stride=g.strides,
            dilation=g.dilation, padding=(w.pad_top, g.padding[1], w.pad_bottom, g.padding[3]),
            input_zero_point=p.input_zero_point, output_zero_point=p.output_zero_point,
            act_min=p.clamp[0], act_max=p.clamp[1], rounding=p.rounding, scale_bias_record=self.record,
            input_scale=self.scales[0], output_scale=self.scales[1])
        return Command(self.opcode, conv, layer)


class PoolProgram(WindowedProgram):
    """MAX_POOL2D and AVG_POOL2D (windowed; onnxruntime's global average is a MEAN and has no row program)."""

    def __init__(self, opcode: Opcode, p: PoolParams, prepared):
        self.opcode, self.p, self.g = opcode, p, LayerGeometry.of(p)
        g = self.g
        self.out = MapShape(g.out_height, g.out_width, g.out_channels)
        self.inputs = (MapShape(g.height, g.width, g.in_channels),)

    def command(self, layer, o0, o1, c0, ct, ifms, ofm_address, constants):
        g, p = self.g, self.p
        (ifm,) = ifms
        w = ifm.window
        qparams = (dict(rounding=p.rounding, input_scale=p.input_scale, input_zero_point=p.input_zero_point,
                        output_scale=p.output_scale, output_zero_point=p.output_zero_point)
                   if self.opcode == Opcode.AVG_POOL2D and p.rounding == Rounding.ONNXRUNTIME else {})
        op = Pooling(ifm=FeatureMap(ifm.address, w.stop - w.start, g.width, ct),
                     ofm=FeatureMap(ofm_address, o1 - o0, g.out_width, ct), kernel_h=g.kernel[0],
                     kernel_w=g.kernel[1], stride_h=g.strides[0], stride_w=g.strides[1], pad_top=w.pad_top,
                     pad_left=g.padding[1], pad_bottom=w.pad_bottom, pad_right=g.padding[3], act_min=p.clamp[0],
                     act_max=p.clamp[1], **qparams)
        return Command(self.opcode, op, layer)


class ElementwiseProgram(RowProgram):
    """ADD, SUB and MUL of two same-shaped activations: output row r reads row r of both."""

    def __init__(self, opcode: Opcode, p: ElementwiseParams, fields: dict, shape: MapShape):
        self.opcode, self.p, self.fields = opcode, p, fields
        self.out = shape
        self.inputs = (shape, shape)

    def window(self, operand: int, o0: int, o1: int) -> Window:
        return Window(o0, o1)

    def command(self, layer, o0, o1, c0, ct, ifms, ofm_address, constants):
        p, count = self.p, (o1 - o0) * self.out.width * self.out.channels
        a, b = ifms
        op = Elementwise(
            ifm=FeatureMap(a.address, 1, count, 1), ifm2=FeatureMap(b.address, 1, count, 1),
            ofm=FeatureMap(ofm_address, 1, count, 1), input_zero_point=p.input_zero_point,
            input2_zero_point=p.input2_zero_point, output_zero_point=p.output_zero_point, act_min=p.clamp[0],
            act_max=p.clamp[1], rounding=p.rounding, **self.fields)
        return Command(self.opcode, op, layer)


class MeanProgram(RowProgram):
    """Spatial MEAN (and onnxruntime's global average pool) over all channels at once: one output row that
    reads every input row."""

    def __init__(self, p: MeanParams, prepared, clamp: tuple[int, int]):
        _, height, width, channels = p.ifm_shape
        self.p, self.prepared, self.clamp = p, prepared, clamp
        self.out = MapShape(1, 1, channels)
        self.inputs = (MapShape(height, width, channels),)

    def window(self, operand: int, o0: int, o1: int) -> Window:
        return Window(0, self.inputs[0].height)

    def command(self, layer, o0, o1, c0, ct, ifms, ofm_address, constants):
        p, shape = self.p, self.inputs[0]
        multiplier, shift = self.prepared
        scales = (dict(input_scale=p.input_scale, output_scale=p.output_scale)
                  if p.rounding == Rounding.ONNXRUNTIME else {})
        op = Reduction(ifm=FeatureMap(ifms[0].address, shape.height, shape.width, ct),
                       ofm=FeatureMap(ofm_address, 1, 1, ct), input_zero_point=p.input_zero_point,
                       output_zero_point=p.output_zero_point, multiplier=multiplier, shift=shift,
                       act_min=self.clamp[0], act_max=self.clamp[1], rounding=p.rounding, **scales)
        return Command(Opcode.MEAN, op, layer)


def _mean(p: MeanParams, prepared, sources: list, packed: bool) -> MeanProgram | None:
    if len(p.ifm_shape) != 4 or p.ifm_shape[0] != 1:
        return None
    return MeanProgram(p, prepared, (-128, 127))


def _mac(opcode: Opcode):
    def build(p: ConvParams, prepared, sources: list, packed: bool) -> MacProgram | None:
        shapes = (p.ifm_shape, p.ofm_shape)
        if any(MapShape.of(tuple(s)) is None for s in shapes):
            return None
        return MacProgram(opcode, p, prepared, packed)
    return build


def _pool(opcode: Opcode):
    def build(p: PoolParams, prepared, sources: list, packed: bool) -> RowProgram | None:
        if MapShape.of(tuple(p.ifm_shape)) is None:
            return None
        mean = as_global_mean(p)
        if mean is not None:  # onnxruntime's global average: the MEAN unit, as its DRAM program does
            return MeanProgram(mean, (0, 0), p.clamp)
        return PoolProgram(opcode, p, prepared)
    return build


def _elementwise(opcode: Opcode):
    def build(p: ElementwiseParams, fields: dict, sources: list, packed: bool) -> ElementwiseProgram | None:
        shape = MapShape.of(tuple(p.shape))
        if p.broadcast or shape is None or any(s is None for s in sources):
            return None  # a constant or per-channel operand keeps the flat-chunk program
        return ElementwiseProgram(opcode, p, fields, shape)
    return build


ROW_PROGRAMS = {
    NpuOp.CONV2D: _mac(Opcode.CONV2D),
    NpuOp.DEPTHWISE_CONV2D: _mac(Opcode.DEPTHWISE_CONV2D),
    NpuOp.FULLY_CONNECTED: _mac(Opcode.FULLY_CONNECTED),
    NpuOp.MAX_POOL2D: _pool(Opcode.MAX_POOL2D),
    NpuOp.AVG_POOL2D: _pool(Opcode.AVG_POOL2D),
    NpuOp.MEAN: _mean,
    NpuOp.ADD: _elementwise(Opcode.ADD),
    NpuOp.SUBTRACT: _elementwise(Opcode.SUB),
    NpuOp.MULTIPLY: _elementwise(Opcode.MUL),
}
"""Operators with a row program, each built from (params, prepared constants, sources, ``packed``: MAC tables in
packed records); the others run their DRAM-in/DRAM-out tile program whole."""


def row_program(p: NpuParams, prepared, sources: list, packed: bool = False) -> RowProgram | None:
    """The row program of a layer, or ``None`` when its operator (or this instance of it) has none;
    ``packed``: a MAC layer's scale/bias table in packed records (:class:`MacProgram`)."""
    build = ROW_PROGRAMS.get(p.op)
    return None if build is None else build(p, prepared, sources, packed)


def channel_tile(program: RowProgram, budget: int, lanes: int) -> int:
    """Most output channels (a multiple of ``lanes`` when more than that) whose constants fit ``budget`` bytes."""
    per_channel = sum(c.per_channel for c in program.constants)
    most = max(1, budget // max(1, per_channel))
    if most >= program.out.channels:
        return program.out.channels
    return max(1, most // lanes * lanes) if most >= lanes else most


def tiles(total: int, tile: int) -> list[tuple[int, int]]:
    return [(start, min(tile, total - start)) for start in range(0, total, tile)]
