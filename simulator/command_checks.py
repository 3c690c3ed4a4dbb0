"""One validator per opcode: the legality of a single command against a hardware configuration.

Each is a function of (stream, config, opcode, payload, where) raising
``StreamError`` with a one-line reason naming the command; the opcode table
(:mod:`simulator.opcodes`) says which one checks which opcode. A command that
passed cannot make its kernel index outside DRAM buffers or SRAM.
"""

from __future__ import annotations

import math

import numpy as np

from .config import NpuConfig
from .elementwise import unused_fields
from .errors import StreamError
from .isa import (DOUBLE_SCALE_ROUNDINGS, PACKED_RECORD, SCALE_BIAS_RECORDS, SCALE_RECORD, ActivationType, BufferKind,
                  CommandStream, Convolution, DmaCopy, Elementwise, FeatureMap, MatMul, MemorySpace, Opcode, Pooling,
                  Reduction, Resize, Softmax, TableLookup, WORD_RECORD, conv_output_size, scale_bias_bytes,
                  weight_shape)
from .numerics import INT32_MAX, Rounding
from .resize import ONE, ROUNDINGS


def _extent(offset: int, rows: int, stride: int, row_bytes: int) -> int:
    return offset + (rows - 1) * stride + row_bytes


def check_dma(stream: CommandStream, config: NpuConfig, opcode: Opcode, dma: DmaCopy, where: str) -> None:
    if dma.rows < 1 or dma.row_bytes < 1:
        raise StreamError(f"{where}: DMA must move at least one byte")
    if dma.rows > 1 and dma.dst_stride < dma.row_bytes:
        raise StreamError(f"{where}: DMA destination stride {dma.dst_stride} shorter than a row would overlap rows")
    if dma.rows > 1 and 0 < dma.src_stride < dma.row_bytes:
        raise StreamError(f"{where}: DMA source stride {dma.src_stride} must be 0 (a broadcast read) or at least "
                          f"a row")
    if (dma.src_space == MemorySpace.DRAM) == (dma.dst_space == MemorySpace.DRAM):
        raise StreamError(f"{where}: DMA must move between DRAM and SRAM")
    for side, space, buffer, offset, stride in (
            ("source", dma.src_space, dma.src_buffer, dma.src_offset, dma.src_stride),
            ("destination", dma.dst_space, dma.dst_buffer, dma.dst_offset, dma.dst_stride)):
        end = _extent(offset, dma.rows, stride, dma.row_bytes)
        if space == MemorySpace.SRAM:
            if end > config.sram_bytes:
                raise StreamError(f"{where}: DMA {side} ends at SRAM byte {end}, past {config.sram_bytes}")
            continue
        if not 0 <= buffer < len(stream.buffers):
            raise StreamError(f"{where}: DMA {side} names buffer {buffer}, which does not exist")
        buf = stream.buffers[buffer]
        if end > buf.size:
            raise StreamError(f"{where}: DMA {side} ends at byte {end} of {buf.name!r} ({buf.size} bytes)")
        if side == "destination" and buf.kind in (BufferKind.INPUT, BufferKind.CONSTANT):
            raise StreamError(f"{where}: DMA writes into {buf.kind.name} buffer {buf.name!r}")


def check_convolution(stream: CommandStream, config: NpuConfig, opcode: Opcode, conv: Convolution,
                      where: str) -> None:
    for name, fmap in (("ifm", conv.ifm), ("ofm", conv.ofm)):
        if min(fmap.height, fmap.width, fmap.channels) < 1:
            raise StreamError(f"{where}: {name} dimensions must be positive")
    if not all(1 <= k <= config.max_kernel for k in conv.kernel):
        raise StreamError(f"{where}: kernel {conv.kernel} outside 1..{config.max_kernel}")
    if not all(1 <= s <= config.max_stride for s in conv.stride):
        raise StreamError(f"{where}: stride {conv.stride} outside 1..{config.max_stride}")
    if not all(1 <= d <= config.max_dilation for d in conv.dilation):
        raise StreamError(f"{where}: dilation {conv.dilation} outside 1..{config.max_dilation}")
    if any(p < 0 for p in conv.padding):
        raise StreamError(f"{where}: negative padding {conv.padding}")
    _check_conv_quantization(where, conv)
    if conv.act_min > conv.act_max:
        raise StreamError(f"{where}: act_min {conv.act_min} > act_max {conv.act_max}")
    pt, pl, pb, pr = conv.padding
    expected = (conv_output_size(conv.ifm.height, conv.kernel[0], conv.stride[0], conv.dilation[0], pt, pb),
                conv_output_size(conv.ifm.width, conv.kernel[1], conv.stride[1], conv.dilation[1], pl, pr))
    if (conv.ofm.height, conv.ofm.width) != expected:
        raise StreamError(f"{where}: ofm {conv.ofm.height}x{conv.ofm.width} does not match the "
                          f"window arithmetic ({expected[0]}x{expected[1]})")
    if opcode == Opcode.DEPTHWISE_CONV2D and conv.ofm.channels % conv.ifm.channels:
        raise StreamError(f"{where}: depthwise ofm channels {conv.ofm.channels} are not a multiple of the ifm's "
                          f"{conv.ifm.channels} (the channel multiplier)")
    if opcode == Opcode.FULLY_CONNECTED and (conv.kernel, conv.stride, conv.padding, conv.ifm.width) != (
            (1, 1), (1, 1), (0, 0, 0, 0), 1):
        raise StreamError(f"{where}: fully connected takes an Nx1 ifm, 1x1 kernel, no stride or padding")
    regions = {"ifm": (conv.ifm.address, conv.ifm.nbytes),
               "ofm": (conv.ofm.address, conv.ofm.nbytes),
               "weights": (conv.weights_address, int(np.prod(weight_shape(opcode, conv)))),
               "scale_bias": (conv.scale_bias_address, scale_bias_bytes(conv))}
    for name, (start, size) in regions.items():
        if start + size > config.sram_bytes:
            raise StreamError(f"{where}: {name} ends at SRAM byte {start + size}, past {config.sram_bytes}")
    if conv.scale_bias_record not in SCALE_BIAS_RECORDS:
        raise StreamError(f"{where}: scale/bias records of {conv.scale_bias_record} bytes; a record takes "
                          + " or ".join(f"{size} ({layout})" for size, layout in SCALE_BIAS_RECORDS.items()))
    double = conv.rounding in DOUBLE_SCALE_ROUNDINGS
    if conv.scale_bias_record != WORD_RECORD and double != (conv.scale_bias_record == SCALE_RECORD.itemsize):
        short = (SCALE_RECORD if double else PACKED_RECORD).itemsize
        raise StreamError(f"{where}: rounding {conv.rounding.name} takes 12- or {short}-byte scale/bias records, "
                          f"not {conv.scale_bias_record}")
    if conv.scale_bias_record == SCALE_RECORD.itemsize and not all(
            np.isfinite(s) and s > 0 for s in (conv.input_scale, conv.output_scale)):
        raise StreamError(f"{where}: {SCALE_RECORD.itemsize}-byte scale/bias records need positive finite input and "
                          f"output scales, not {conv.input_scale} and {conv.output_scale}")
    if conv.scale_bias_address % 4:
        raise StreamError(f"{where}: scale_bias table must be 4-byte aligned")
    ofm_start, ofm_size = regions["ofm"]
    for name in ("ifm", "weights", "scale_bias"):
        start, size = regions[name]
        if start < ofm_start + ofm_size and ofm_start < start + size:
            raise StreamError(f"{where}: ofm overlaps {name} in SRAM")


SIXTEEN_BY_EIGHT_ROUNDINGS = (Rounding.TFLITE_DOUBLE, Rounding.TFLITE_SINGLE)
"""Roundings a 16x8 convolution may name: both mean TFLite's int64 output stage (its builds share it)."""


def _check_conv_quantization(where: str, conv: Convolution) -> None:
    """int8: zero points and clamp within int8. 16x8 (INT16 maps): int16 in and out, zero points 0 (TFLite's
    16x8 quantization is symmetric and its kernel adds no offsets), clamp within int16, a TFLite rounding."""
    if conv.ifm.dtype != conv.ofm.dtype:
        raise StreamError(f"{where}: ifm holds {conv.ifm.dtype.name} and ofm {conv.ofm.dtype.name}; a "
                          f"convolution keeps its element type")
    if conv.ifm.dtype == ActivationType.INT16:
        if conv.input_zero_point or conv.output_zero_point:
            raise StreamError(f"{where}: 16x8 zero points must be 0, got input {conv.input_zero_point} and output "
                              f"{conv.output_zero_point}")
        if conv.rounding not in SIXTEEN_BY_EIGHT_ROUNDINGS:
            raise StreamError(f"{where}: 16x8 requantizes with TFLite's int64 output stage; rounding "
                              f"{conv.rounding.name} does not exist for it")
        for name, fmap in (("ifm", conv.ifm), ("ofm", conv.ofm)):
            if fmap.address % 2:
                raise StreamError(f"{where}: INT16 {name} at SRAM byte {fmap.address} is not 2-byte aligned")
    info = np.iinfo(conv.ofm.numpy_dtype)
    for name, value in (("input_zero_point", conv.input_zero_point),
                        ("output_zero_point", conv.output_zero_point),
                        ("act_min", conv.act_min), ("act_max", conv.act_max)):
        if not info.min <= value <= info.max:
            raise StreamError(f"{where}: {name} {value} is outside {info.dtype}")


def _check_int8(where: str, **values: int) -> None:
    for name, value in values.items():
        if not -128 <= value <= 127:
            raise StreamError(f"{where}: {name} {value} is outside int8")


def _check_multiplier(where: str, name: str, multiplier: int, shift: int) -> None:
    if not 0 <= multiplier < (1 << 31) or not -31 <= shift <= 30:
        raise StreamError(f"{where}: {name} multiplier {multiplier} / shift {shift} out of range")


def _check_regions(config: NpuConfig, where: str, reads: dict[str, FeatureMap], ofm: FeatureMap) -> None:
    for name, fmap in {**reads, "ofm": ofm}.items():
        if min(fmap.height, fmap.width, fmap.channels) < 1:
            raise StreamError(f"{where}: {name} dimensions must be positive")
        if fmap.address + fmap.nbytes > config.sram_bytes:
            raise StreamError(f"{where}: {name} ends at SRAM byte {fmap.address + fmap.nbytes}, past "
                              f"{config.sram_bytes}")
    for name, fmap in reads.items():
        if fmap.address < ofm.address + ofm.nbytes and ofm.address < fmap.address + fmap.nbytes:
            raise StreamError(f"{where}: ofm overlaps {name} in SRAM")


ONNXRUNTIME_FIELDS = {
    Reduction: (("input_scale", "output_scale"), (), ("multiplier", "shift")),
    Pooling: (("input_scale", "output_scale"), ("input_zero_point", "output_zero_point"), ()),
}
"""Per payload: the float32 scales ``Rounding.ONNXRUNTIME`` computes with, its other fields, and the
fixed-point fields it leaves unused. Each mode's unused fields must be 0, so that no stream carries a
value nothing reads (elementwise payloads: :func:`simulator.elementwise.unused_fields`)."""


def _check_scales(where: str, payload, names) -> None:
    for name in names:
        value = getattr(payload, name)
        if not (math.isfinite(value) and value > 0):
            raise StreamError(f"{where}: ONNXRUNTIME {name} {value} must be positive and finite")


def _check_rounding_fields(where: str, payload) -> None:
    """ONNXRUNTIME: positive finite scales, fixed-point fields 0; other modes: ONNXRUNTIME's fields 0."""
    scales, others, fixed_point = ONNXRUNTIME_FIELDS[type(payload)]
    if payload.rounding == Rounding.ONNXRUNTIME:
        _check_scales(where, payload, scales)
        unused = [name for name in fixed_point if getattr(payload, name) != 0]
        if unused:
            raise StreamError(f"{where}: ONNXRUNTIME computes with the scales; {', '.join(unused)} must be 0")
    else:
        unused = [name for name in (*scales, *others) if getattr(payload, name) != 0]
        if unused:
            raise StreamError(f"{where}: only ONNXRUNTIME reads {', '.join(unused)}; they must be 0 "
                              f"with {payload.rounding.name}")


def check_elementwise(stream: CommandStream, config: NpuConfig, opcode: Opcode, op: Elementwise,
                      where: str) -> None:
    _check_regions(config, where, {"ifm": op.ifm, "ifm2": op.ifm2}, op.ofm)
    if not op.ifm.size == op.ifm2.size == op.ofm.size:
        raise StreamError(f"{where}: elementwise operands hold different element counts")
    _check_int8(where, input_zero_point=op.input_zero_point, input2_zero_point=op.input2_zero_point,
                output_zero_point=op.output_zero_point, act_min=op.act_min, act_max=op.act_max)
    if op.act_min > op.act_max:
        raise StreamError(f"{where}: act_min {op.act_min} > act_max {op.act_max}")
    if op.rounding == Rounding.ONNXRUNTIME:
        _check_scales(where, op, ("input_scale", "input2_scale", "output_scale"))
    if not 0 <= op.left_shift <= 24:
        raise StreamError(f"{where}: left_shift {op.left_shift} outside 0..24")
    for name in ("input", "input2", "output"):
        _check_multiplier(where, name, getattr(op, f"{name}_multiplier"), getattr(op, f"{name}_shift"))
    why, unused = unused_fields(opcode, op)
    if unused:
        raise StreamError(f"{where}: {why}; {', '.join(unused)} must be 0")


def check_reduction(stream: CommandStream, config: NpuConfig, opcode: Opcode, op: Reduction,
                    where: str) -> None:
    _check_regions(config, where, {"ifm": op.ifm}, op.ofm)
    if (op.ofm.height, op.ofm.width, op.ofm.channels) != (1, 1, op.ifm.channels):
        raise StreamError(f"{where}: mean ofm must be 1x1x{op.ifm.channels}")
    _check_int8(where, input_zero_point=op.input_zero_point, output_zero_point=op.output_zero_point,
                act_min=op.act_min, act_max=op.act_max)
    if op.act_min > op.act_max:
        raise StreamError(f"{where}: act_min {op.act_min} > act_max {op.act_max}")
    _check_rounding_fields(where, op)
    _check_multiplier(where, "mean", op.multiplier, op.shift)


def check_pooling(stream: CommandStream, config: NpuConfig, opcode: Opcode, op: Pooling, where: str) -> None:
    _check_regions(config, where, {"ifm": op.ifm}, op.ofm)
    kernel, stride = (op.kernel_h, op.kernel_w), (op.stride_h, op.stride_w)
    padding = (op.pad_top, op.pad_left, op.pad_bottom, op.pad_right)
    if not all(1 <= k <= config.max_pool_kernel for k in kernel):
        raise StreamError(f"{where}: pool kernel {kernel} outside 1..{config.max_pool_kernel}")
    if not all(1 <= s <= config.max_stride for s in stride):
        raise StreamError(f"{where}: stride {stride} outside 1..{config.max_stride}")
    if any(p < 0 for p in padding) or max(padding[0], padding[2]) >= kernel[0] or max(padding[1], padding[3]) >= kernel[1]:
        raise StreamError(f"{where}: padding {padding} must be non-negative and smaller than the window")
    expected = (conv_output_size(op.ifm.height, kernel[0], stride[0], 1, padding[0], padding[2]),
                conv_output_size(op.ifm.width, kernel[1], stride[1], 1, padding[1], padding[3]))
    if (op.ofm.height, op.ofm.width, op.ofm.channels) != (*expected, op.ifm.channels):
        raise StreamError(f"{where}: ofm does not match the window arithmetic ({expected[0]}x{expected[1]})")
    _check_int8(where, act_min=op.act_min, act_max=op.act_max, input_zero_point=op.input_zero_point,
                output_zero_point=op.output_zero_point)
    if op.act_min > op.act_max:
        raise StreamError(f"{where}: act_min {op.act_min} > act_max {op.act_max}")
    if opcode == Opcode.AVG_POOL2D:
        _check_rounding_fields(where, op)


def check_lut(stream: CommandStream, config: NpuConfig, opcode: Opcode, op: TableLookup, where: str) -> None:
    table = FeatureMap(op.table_address, 1, config.lut_entries, 1)
    _check_regions(config, where, {"ifm": op.ifm, "table": table}, op.ofm)
    if op.ifm.size != op.ofm.size:
        raise StreamError(f"{where}: look-up ifm and ofm hold different element counts")


def check_softmax(stream: CommandStream, config: NpuConfig, opcode: Opcode, op: Softmax, where: str) -> None:
    _check_regions(config, where, {"ifm": op.ifm}, op.ofm)
    ifm, ofm = (op.ifm.height, op.ifm.width, op.ifm.channels), (op.ofm.height, op.ofm.width, op.ofm.channels)
    if ofm != ifm:
        raise StreamError(f"{where}: softmax ofm {'x'.join(map(str, ofm))} must have the ifm's shape "
                          f"{'x'.join(map(str, ifm))}")
    _check_int8(where, output_zero_point=op.output_zero_point)
    if not 0 <= op.input_multiplier < (1 << 31) or not 0 <= op.input_left_shift <= 31:
        raise StreamError(f"{where}: softmax input multiplier {op.input_multiplier} / left shift "
                          f"{op.input_left_shift} out of range")
    if op.diff_min > 0:
        raise StreamError(f"{where}: softmax diff_min {op.diff_min} must be <= 0 (the row maximum always counts)")
    if min(-op.diff_min, 255) << op.input_left_shift > 1 << 31:
        raise StreamError(f"{where}: softmax diff_min {op.diff_min} shifted left by {op.input_left_shift} "
                          f"overflows int32")


def _check_rounding(where: str, rounding: Rounding) -> None:
    if rounding not in ROUNDINGS:
        raise StreamError(f"{where}: rounding {rounding.name} is not one of TFLite's fixed-point builds "
                          f"({', '.join(r.name for r in ROUNDINGS)})")


def check_resize(stream: CommandStream, config: NpuConfig, opcode: Opcode, op: Resize, where: str) -> None:
    """Every position sampled lies in the tile: the first above -1 pixel (TFLite's lowest is -1/2), the last
    one's lower row inside the ifm, and every position plus one pixel within int32."""
    _check_regions(config, where, {"ifm": op.ifm}, op.ofm)
    if op.ofm.channels != op.ifm.channels:
        raise StreamError(f"{where}: resize ofm has {op.ofm.channels} channels, the ifm {op.ifm.channels}")
    _check_rounding(where, op.rounding)
    for axis, step, offset, out_size, in_size in (("h", op.step_h, op.offset_h, op.ofm.height, op.ifm.height),
                                                  ("w", op.step_w, op.offset_w, op.ofm.width, op.ifm.width)):
        last = offset + (out_size - 1) * step
        if step < 0:
            raise StreamError(f"{where}: resize step_{axis} {step} is negative")
        if offset <= -ONE:
            raise StreamError(f"{where}: resize offset_{axis} {offset} is not above {-ONE} (one pixel before the ifm)")
        if last // ONE > in_size - 1 or last + ONE - 1 > INT32_MAX:
            raise StreamError(f"{where}: resize position {last} (1/{ONE} pixels) of the last output along {axis} "
                              f"lies past the ifm's {in_size} pixels")


def check_matmul(stream: CommandStream, config: NpuConfig, opcode: Opcode, op: MatMul, where: str) -> None:
    _check_regions(config, where, {"ifm": op.ifm, "ifm2": op.ifm2}, op.ofm)
    batches, rows, depth = op.ifm.height, op.ifm.width, op.ifm.channels
    columns = op.ofm.channels
    rhs = (batches, columns, depth) if op.adj_y else (batches, depth, columns)
    shapes = {"ifm2": ((op.ifm2.height, op.ifm2.width, op.ifm2.channels), rhs),
              "ofm": ((op.ofm.height, op.ofm.width, op.ofm.channels), (batches, rows, columns))}
    for name, (got, want) in shapes.items():
        if got != want:
            raise StreamError(f"{where}: matmul {name} is {'x'.join(map(str, got))}, the ifm "
                              f"{batches}x{rows}x{depth} needs {'x'.join(map(str, want))}")
    _check_int8(where, input_zero_point=op.input_zero_point, input2_zero_point=op.input2_zero_point,
                output_zero_point=op.output_zero_point, act_min=op.act_min, act_max=op.act_max)
    if op.act_min > op.act_max:
        raise StreamError(f"{where}: act_min {op.act_min} > act_max {op.act_max}")
    _check_rounding(where, op.rounding)
    _check_multiplier(where, "output", op.output_multiplier, op.output_shift)
