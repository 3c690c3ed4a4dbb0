"""First-order cycle model: what each command costs, from the command alone.

Each engine runs its commands one after the other; the DMA engine and the compute
units overlap (:mod:`simulator.timeline`). A MAC-array command costs its issue
overhead plus the larger of the array time and the output stage time; the output
stage writes ``output_lanes`` elements per cycle. The array time is a number of
*folds* (one set of weights held in the array while every output pixel streams
through) times the pixels streamed per fold plus ``fold_fill_cycles``, at least the
``mac_cols`` cycles a fold's weights take to enter the array. The array
sums ``mac_cols`` reduction elements for each of ``mac_rows`` output channels per
cycle; what fills those lanes is the dataflow of each opcode:

* CONV2D: the reduction is the whole kernel window, ``k_h * k_w * K`` (the feeder
  packs the im2col row of each pixel into the columns, a tap boundary no lane
  boundary), so a 3-channel first layer fills ``ceil(27 / C)`` column passes, not
  nine; output channels on the rows.
* DEPTHWISE_CONV2D (``parallel_depthwise``): one channel per row, its kernel taps
  across the columns; without it (a systolic array whose rows share their inputs)
  one channel at a time on one row.
* FULLY_CONNECTED and BATCH_MATMUL: the input depth on the columns, the output
  channels on the rows, one row of the input streamed per cycle.

Shapes that do not fill the array pay for the idle lanes (the ``ceil`` terms). A
DMA costs its latency plus bytes over bandwidth. docs/cycle_model.md states every
formula and its limits.

16x8 CONV2D (int16 activations): the array's multipliers are 8 x 8 bits, so each
int16 activation takes two passes (low and high byte, summed shifted), doubling
the streaming time (``ActivationFormat.mac_passes``, as Ethos-U's 16-bit mode runs at
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
    fixed_cycles: int = 0
    """The part of ``cycles`` a command pays whatever its size: a DMA's latency, a compute command's issue
    overhead (what tells a layer bound by overhead from one bound by its work)."""


def _issued(config: NpuConfig, work: int, macs: int = 0) -> CommandCost:
    """A compute command: its issue overhead, then ``work`` cycles."""
    return CommandCost(cycles=config.command_overhead_cycles + work, macs=macs,
                       fixed_cycles=config.command_overhead_cycles)


def dma_cost(opcode: Opcode, dma: DmaCopy, config: NpuConfig) -> CommandCost:
    moved = dma.bytes_moved
    cycles = config.dram_latency_cycles + math.ceil(moved / config.dram_bytes_per_cycle)
    return CommandCost(cycles=cycles,
                       dram_read_bytes=moved if dma.src_space == MemorySpace.DRAM else 0,
                       dram_write_bytes=moved if dma.dst_space == MemorySpace.DRAM else 0,
                       fixed_cycles=config.dram_latency_cycles)


def _mac_cost(conv: Convolution | MatMul, config: NpuConfig, macs: int, array: int) -> CommandCost:
    """Issue overhead, then the array and the output stage under it: the slower of the two."""
    outputs = conv.ofm.height * conv.ofm.width * conv.ofm.channels
    output_cycles = math.ceil(outputs / config.output_lanes)
    return _issued(config, max(array, output_cycles), macs)


def array_cycles(folds: int, streamed: int, config: NpuConfig) -> int:
    """``folds`` sets of weights, each streaming ``streamed`` input vectors through the array (one a cycle)
    plus its ``fold_fill_cycles``. A fold never lasts less than the ``mac_cols`` cycles its weights take to
    enter the array (one weight per row per cycle): double-buffered weights hide the next fold's load only
    under a fold at least that long, so a layer of few pixels (a fully connected one: one) is bound by its
    weights, as every weight is used that few times."""
    return folds * max(streamed + config.fold_fill_cycles, config.mac_cols)


def conv2d_cost(opcode: Opcode, conv: Convolution, config: NpuConfig) -> CommandCost:
    """The whole window is the reduction: ceil(k_h*k_w*K / C) column passes times ceil(N / R) row passes,
    each streaming every output pixel (twice for int16 activations)."""
    pixels = conv.ofm.height * conv.ofm.width
    window = conv.kernel[0] * conv.kernel[1] * conv.ifm.channels
    macs = pixels * window * conv.ofm.channels
    folds = math.ceil(window / config.mac_cols) * math.ceil(conv.ofm.channels / config.mac_rows)
    streamed = pixels * ACTIVATION_FORMATS[conv.ifm.dtype].mac_passes
    return _mac_cost(conv, config, macs, array_cycles(folds, streamed, config))


def depthwise_cost(opcode: Opcode, conv: Convolution, config: NpuConfig) -> CommandCost:
    """Channels on the rows (R at a time, or one with ``parallel_depthwise`` off), each channel's kernel
    taps across the columns: ceil(k_h*k_w / C) passes per group of channels, each streaming every pixel."""
    pixels = conv.ofm.height * conv.ofm.width
    taps = conv.kernel[0] * conv.kernel[1]
    channels = conv.ofm.channels
    macs = pixels * taps * channels
    groups = math.ceil(channels / config.mac_rows) if config.parallel_depthwise else channels
    folds = math.ceil(taps / config.mac_cols) * groups
    return _mac_cost(conv, config, macs, array_cycles(folds, pixels, config))


def fully_connected_cost(opcode: Opcode, conv: Convolution, config: NpuConfig) -> CommandCost:
    """ceil(K / C) x ceil(N / R) folds, each streaming the M input rows."""
    batch = conv.ifm.height
    macs = batch * conv.ifm.channels * conv.ofm.channels
    folds = math.ceil(conv.ifm.channels / config.mac_cols) * math.ceil(conv.ofm.channels / config.mac_rows)
    return _mac_cost(conv, config, macs, array_cycles(folds, batch, config))


def batch_matmul_cost(opcode: Opcode, op: MatMul, config: NpuConfig) -> CommandCost:
    """Each row of each batch's left operand is one fully connected input against the right operand's N
    columns (read transposed or not at the same rate): mac_cols of the shared axis times mac_rows columns
    per cycle, as FULLY_CONNECTED, each batch with folds of its own right operand."""
    batches, rows, depth = op.ifm.height, op.ifm.width, op.ifm.channels
    columns = op.ofm.channels
    macs = batches * rows * depth * columns
    folds = batches * math.ceil(depth / config.mac_cols) * math.ceil(columns / config.mac_rows)
    return _mac_cost(op, config, macs, array_cycles(folds, rows, config))


def elementwise_cost(opcode: Opcode, op: Elementwise, config: NpuConfig) -> CommandCost:
    """Elementwise unit (ADD, SUB, MUL): two input reads and one output write per element, output_lanes wide."""
    return _issued(config, math.ceil(op.ofm.size / config.output_lanes))


def mean_cost(opcode: Opcode, op: Reduction, config: NpuConfig) -> CommandCost:
    """The accumulators sum mac_rows channels per cycle; the output stage then rescales them."""
    pixels = op.ifm.height * op.ifm.width
    array = pixels * math.ceil(op.ifm.channels / config.mac_rows)
    return _issued(config, array + math.ceil(op.ofm.channels / config.output_lanes))


def pool_cost(opcode: Opcode, op: Pooling, config: NpuConfig) -> CommandCost:
    """The pooling unit compares or adds one window tap of output_lanes channels per cycle."""
    taps = op.kernel_h * op.kernel_w
    pixels = op.ofm.height * op.ofm.width
    return _issued(config, pixels * taps * math.ceil(op.ofm.channels / config.output_lanes))


BILINEAR_TAPS = 4
"""A bilinear output pixel is a 2x2 window of the input, each tap weighted."""


def resize_bilinear_cost(opcode: Opcode, op: Resize, config: NpuConfig) -> CommandCost:
    """The pooling unit takes the 2x2 window of each output pixel one weighted tap of output_lanes channels per
    cycle, as it takes a pooling window's taps."""
    pixels = op.ofm.height * op.ofm.width
    return _issued(config, pixels * BILINEAR_TAPS * math.ceil(op.ofm.channels / config.output_lanes))


def lut_cost(opcode: Opcode, op: TableLookup, config: NpuConfig) -> CommandCost:
    """The output stage's table answers output_lanes look-ups per cycle."""
    return _issued(config, math.ceil(op.ofm.size / config.output_lanes))


SOFTMAX_RECIPROCAL_CYCLES = 8
"""Latency of one row's reciprocal of the sum (normalise, three Newton-Raphson steps), not overlapped."""


def softmax_cost(opcode: Opcode, op: Softmax, config: NpuConfig) -> CommandCost:
    """Three passes over each row, output_lanes channels per cycle: the maximum, exp and the running sum,
    then the rescale by the reciprocal; between the last two the row waits for its reciprocal."""
    rows = op.ifm.height * op.ifm.width
    per_row = 3 * math.ceil(op.ifm.channels / config.output_lanes) + SOFTMAX_RECIPROCAL_CYCLES
    return _issued(config, rows * per_row)
