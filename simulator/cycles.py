"""First-order cycle model: what each command costs, from the command alone.

Commands run back to back (no DMA/compute overlap yet). A MAC-array command
costs its issue overhead plus the larger of the array time and the output
stage time; the array processes ``mac_rows`` output channels times
``mac_cols`` reduction elements per cycle, so shapes that do not fill it pay
for the idle lanes. Depthwise convolution has no cross-channel reduction and
uses one column. A DMA costs its latency plus bytes over bandwidth.

16x8 CONV2D (int16 activations): the array's multipliers are 8 x 8 bits, so each
int16 activation takes two passes (low and high byte, summed shifted), doubling
the array time (``ActivationFormat.mac_passes``, as Ethos-U's 16-bit mode runs at
half rate); the MAC count is unchanged and the output stage still writes
``output_lanes`` elements per cycle. DMA time follows the bytes, twice as many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import NpuConfig
from .isa import (ACTIVATION_FORMATS, Convolution, DmaCopy, Elementwise, MatMul, MemorySpace, Opcode, Pooling,
                  Reduction, Resize, Softmax, TableLookup)


@dataclass(frozen=True)
class CommandCost:
    cycles: int
    macs: int = 0
    dram_read_bytes: int = 0
    dram_write_bytes: int = 0


def dma_cost(opcode: Opcode, dma: DmaCopy, config: NpuConfig) -> CommandCost:
    moved = dma.bytes_moved
    cycles = config.dram_latency_cycles + math.ceil(moved / config.dram_bytes_per_cycle)
    return CommandCost(cycles=cycles,
                       dram_read_bytes=moved if dma.src_space == MemorySpace.DRAM else 0,
                       dram_write_bytes=moved if dma.dst_space == MemorySpace.DRAM else 0)


def _mac_cost(conv: Convolution | MatMul, config: NpuConfig, macs: int, array_cycles: int) -> CommandCost:
    outputs = conv.ofm.height * conv.ofm.width * conv.ofm.channels
    output_cycles = math.ceil(outputs / config.output_lanes)
    return CommandCost(cycles=config.command_overhead_cycles + max(array_cycles, output_cycles), macs=macs)


def conv2d_cost(opcode: Opcode, conv: Convolution, config: NpuConfig) -> CommandCost:
    pixels = conv.ofm.height * conv.ofm.width
    taps = conv.kernel[0] * conv.kernel[1]
    macs = pixels * taps * conv.ifm.channels * conv.ofm.channels
    array = (pixels * taps * math.ceil(conv.ifm.channels / config.mac_cols)
             * math.ceil(conv.ofm.channels / config.mac_rows) * ACTIVATION_FORMATS[conv.ifm.dtype].mac_passes)
    return _mac_cost(conv, config, macs, array)


def depthwise_cost(opcode: Opcode, conv: Convolution, config: NpuConfig) -> CommandCost:
    pixels = conv.ofm.height * conv.ofm.width
    taps = conv.kernel[0] * conv.kernel[1]
    macs = pixels * taps * conv.ofm.channels
    return _mac_cost(conv, config, macs, pixels * taps * math.ceil(conv.ofm.channels / config.mac_rows))


def fully_connected_cost(opcode: Opcode, conv: Convolution, config: NpuConfig) -> CommandCost:
    batch = conv.ifm.height
    macs = batch * conv.ifm.channels * conv.ofm.channels
    array = batch * math.ceil(conv.ifm.channels / config.mac_cols) * math.ceil(conv.ofm.channels / config.mac_rows)
    return _mac_cost(conv, config, macs, array)


def batch_matmul_cost(opcode: Opcode, op: MatMul, config: NpuConfig) -> CommandCost:
    """Each row of each batch's left operand is one fully connected input against the right operand's N
    columns (read transposed or not at the same rate): mac_cols of the shared axis times mac_rows columns
    per cycle, as FULLY_CONNECTED."""
    batches, rows, depth = op.ifm.height, op.ifm.width, op.ifm.channels
    columns = op.ofm.channels
    macs = batches * rows * depth * columns
    array = batches * rows * math.ceil(depth / config.mac_cols) * math.ceil(columns / config.mac_rows)
    return _mac_cost(op, config, macs, array)


def elementwise_cost(opcode: Opcode, op: Elementwise, config: NpuConfig) -> CommandCost:
    """Elementwise unit (ADD, SUB, MUL): two input reads and one output write per element, output_lanes wide."""
    return CommandCost(cycles=config.command_overhead_cycles + math.ceil(op.ofm.size / config.output_lanes))


def mean_cost(opcode: Opcode, op: Reduction, config: NpuConfig) -> CommandCost:
    """The accumulators sum mac_rows channels per cycle; the output stage then rescales them."""
    pixels = op.ifm.height * op.ifm.width
    array = pixels * math.ceil(op.ifm.channels / config.mac_rows)
    return CommandCost(cycles=config.command_overhead_cycles + array
                       + math.ceil(op.ofm.channels / config.output_lanes))


def pool_cost(opcode: Opcode, op: Pooling, config: NpuConfig) -> CommandCost:
    """The pooling unit compares or adds one window tap of output_lanes channels per cycle."""
    taps = op.kernel_h * op.kernel_w
    pixels = op.ofm.height * op.ofm.width
    return CommandCost(cycles=config.command_overhead_cycles
                       + pixels * taps * math.ceil(op.ofm.channels / config.output_lanes))


BILINEAR_TAPS = 4
"""A bilinear output pixel is a 2x2 window of the input, each tap weighted."""


def resize_bilinear_cost(opcode: Opcode, op: Resize, config: NpuConfig) -> CommandCost:
    """The pooling unit takes the 2x2 window of each output pixel one weighted tap of output_lanes channels per
    cycle, as it takes a pooling window's taps."""
    pixels = op.ofm.height * op.ofm.width
    return CommandCost(cycles=config.command_overhead_cycles
                       + pixels * BILINEAR_TAPS * math.ceil(op.ofm.channels / config.output_lanes))


def lut_cost(opcode: Opcode, op: TableLookup, config: NpuConfig) -> CommandCost:
    """The output stage's table answers output_lanes look-ups per cycle."""
    return CommandCost(cycles=config.command_overhead_cycles + math.ceil(op.ofm.size / config.output_lanes))


SOFTMAX_RECIPROCAL_CYCLES = 8
"""Latency of one row's reciprocal of the sum (normalise, three Newton-Raphson steps), not overlapped."""


def softmax_cost(opcode: Opcode, op: Softmax, config: NpuConfig) -> CommandCost:
    """Three passes over each row, output_lanes channels per cycle: the maximum, exp and the running sum,
    then the rescale by the reciprocal; between the last two the row waits for its reciprocal."""
    rows = op.ifm.height * op.ifm.width
    per_row = 3 * math.ceil(op.ifm.channels / config.output_lanes) + SOFTMAX_RECIPROCAL_CYCLES
    return CommandCost(cycles=config.command_overhead_cycles + rows * per_row)
