"""Lowering of one NPU region (a ``Codegen="npu"`` function) to a command stream.

Every layer reads its input from DRAM and writes its output to DRAM (region
inputs/outputs, or scratch buffers between layers); within a layer the tiles
chosen by :mod:`.plan` are moved with explicit DMA commands. The qparams come
from the composite's ``npu.*`` attributes, never from its body.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from simulator import numerics
from simulator.config import NpuConfig, get_config
from simulator.isa import (Buffer, BufferKind, Command, CommandStream, Convolution, DmaCopy,
                           FeatureMap, MemorySpace, Opcode)

from ..errors import UnsupportedOpError
from ..params import ConvParams, NpuOp, from_attrs
from .plan import LayerGeometry, TilePlan, plan_layer

CONFIG_ATTR = "npu.preset"

OPCODE_OF_OP = {
    NpuOp.CONV2D: Opcode.CONV2D,
    NpuOp.DEPTHWISE_CONV2D: Opcode.DEPTHWISE_CONV2D,
    NpuOp.FULLY_CONNECTED: Opcode.FULLY_CONNECTED,
}


def output_multipliers(p: ConvParams):
    """Per-channel (multiplier, shift) exactly as TFLite prepares them for this operator."""
    if p.op == NpuOp.FULLY_CONNECTED and not p.per_channel:
        multiplier, shift = numerics.fully_connected_multiplier(
            p.input_scale, p.weight_scales[0], p.output_scale, p.rounding)
        return np.repeat(multiplier, p.out_channels), np.repeat(shift, p.out_channels)
    return numerics.conv_multipliers(p.input_scale, p.weight_scales, p.output_scale, p.rounding)


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
                    channel_start: int, channel_count: int, sram_address: int, to_sram: bool) -> None:
        """Move ``pixels`` NHWC pixels, restricted to a channel range, between DRAM and SRAM."""
        offset = pixel_start * channels + channel_start
        if channel_count == channels:
            self.dma(layer, buffer, offset, sram_address, pixels * channels, to_sram=to_sram)
        else:
            self.dma(layer, buffer, offset, sram_address, channel_count, rows=pixels,
                     dram_stride=channels, sram_stride=channel_count, to_sram=to_sram)


def emit_layer(sb: StreamBuilder, p: ConvParams, layer: str, src: int, dst: int) -> None:
    """Constants, DMA and compute commands of one layer, tile by tile."""
    g = LayerGeometry.of(p)
    plan: TilePlan = plan_layer(p, sb.config)
    multiplier, shift = output_multipliers(p)
    table = np.stack([p.bias.astype(np.int32), multiplier, shift], axis=1).astype("<i4")
    weights = sb.add_buffer(f"{layer}.weights", BufferKind.CONSTANT, p.weights.shape,
                            data=np.ascontiguousarray(p.weights, dtype=np.int8).tobytes())
    scale_bias = sb.add_buffer(f"{layer}.scale_bias", BufferKind.CONSTANT, table.shape, "int32",
                               data=table.tobytes())
    per_channel_weights = g.weight_bytes(1)
    opcode = OPCODE_OF_OP[p.op]
    for c0 in range(0, g.out_channels, plan.channel_tile):
        ct = min(plan.channel_tile, g.out_channels - c0)
        sb.dma(layer, weights, c0 * per_channel_weights, plan.weights_address, ct * per_channel_weights)
        sb.dma(layer, scale_bias, c0 * table.shape[1] * 4, plan.scale_bias_address, ct * table.shape[1] * 4)
        in_c0, in_ct = (c0, ct) if g.depthwise else (0, g.in_channels)
        for oy0 in range(0, g.out_height, plan.row_tile):
            oy1 = min(g.out_height, oy0 + plan.row_tile)
            iy0, iy1, pad_top, pad_bottom = g.input_rows(oy0, oy1)
            if iy1 <= iy0:
                raise UnsupportedOpError(f"{layer}: output rows {oy0}..{oy1} read only padding")
            sb.feature_dma(layer, src, iy0 * g.width, (iy1 - iy0) * g.width, g.in_channels, in_c0, in_ct,
                           plan.ifm_address, to_sram=True)
            conv = Convolution(
                ifm=FeatureMap(plan.ifm_address, iy1 - iy0, g.width, in_ct),
                ofm=FeatureMap(plan.ofm_address, oy1 - oy0, g.out_width, ct),
                weights_address=plan.weights_address, scale_bias_address=plan.scale_bias_address,
                kernel=g.kernel, stride=g.strides, dilation=g.dilation,
                padding=(pad_top, g.padding[1], pad_bottom, g.padding[3]),
                input_zero_point=p.input_zero_point, output_zero_point=p.output_zero_point,
                act_min=p.clamp[0], act_max=p.clamp[1], rounding=p.rounding)
            sb.commands.append(Command(opcode, conv, layer))
            sb.feature_dma(layer, dst, oy0 * g.out_width, (oy1 - oy0) * g.out_width, g.out_channels, c0, ct,
                           plan.ofm_address, to_sram=False)


def _shape_of(expr) -> tuple[int, ...]:
    return tuple(int(d) for d in expr.ty.shape.values)


def _region_outputs(func: relax.Function, bindings: dict) -> list:
    result = func.body.body
    if isinstance(bindings.get(result), relax.Tuple):
        result = bindings[result]
    return list(result.fields) if isinstance(result, relax.Tuple) else [result]


def lower_region(func: relax.Function, symbol: str) -> CommandStream:
    """Turn a merged NPU region into a command stream for the preset it was partitioned for."""
    config = get_config(str(func.attrs[CONFIG_ATTR]))
    sb = StreamBuilder(config)
    bindings = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    values: dict = {}
    for param in func.params:
        values[param] = sb.add_buffer(param.name, BufferKind.INPUT, _shape_of(param),
                                      str(param.ty.dtype))
    outputs = _region_outputs(func, bindings)
    for k, var in enumerate(outputs):
        if var in values:
            raise UnsupportedOpError("an NPU region cannot return its own input")
        values[var] = sb.add_buffer(f"output{k}", BufferKind.OUTPUT, _shape_of(var), str(var.ty.dtype))
    layer_index = 0
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, (relax.Function, relax.Tuple)):
                continue
            callee = bindings.get(value.op) if isinstance(value, relax.Call) else None
            if not isinstance(callee, relax.Function) or len(value.args) != 1:
                raise UnsupportedOpError(f"NPU region {symbol} holds a binding that is not a composite call")
            params = from_attrs(callee.attrs)
            layer = f"{params.op.value}_{layer_index}"
            layer_index += 1
            if binding.var not in values:
                values[binding.var] = sb.add_buffer(f"{layer}.ofm", BufferKind.SCRATCH, params.ofm_shape)
            emit_layer(sb, params, layer, values[value.args[0]], values[binding.var])
    return CommandStream(name=symbol, config=config.name, buffers=tuple(sb.buffers),
                         commands=tuple(sb.commands))


def npu_regions(mod: tvm.IRModule) -> dict[str, relax.Function]:
    """The ``Codegen="npu"`` functions of a partitioned module, by symbol."""
    return {str(func.attrs["global_symbol"]): func for func in mod.functions.values()
            if isinstance(func, relax.Function) and func.attrs is not None
            and func.attrs.get("Codegen") == "npu"}


def lower_module(mod: tvm.IRModule) -> dict[str, CommandStream]:
    """Command streams of every NPU region of a partitioned module (for ``npu compile``)."""
    return {symbol: lower_region(func, symbol) for symbol, func in npu_regions(mod).items()}
