"""The opcode table: one record per opcode, the only place that says what each opcode is.

The encoder and decoder read the payload type and its schema slot from it, the
validator its legality rule, the machine its kernel and its cost. Nothing else
enumerates opcodes, so a new opcode is one row here plus its functions, and an
opcode without a row is a clean ``StreamError``, never a silent default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from . import command_checks as checks
from . import cycles, kernels
from .errors import StreamError
from .isa import (ActivationType, Convolution, DmaCopy, Elementwise, MatMul, Opcode, Pooling, Reduction, Resize,
                  Softmax, TableLookup)


class Engine(str, Enum):
    """A command queue of the machine: each takes its commands in stream order, and the engines run
    concurrently (:mod:`simulator.timeline`). The compute units share one queue: one operation at a
    time, as Ethos-U's NPU block runs them, while the DMA engine moves the next and previous tiles."""

    DMA = "dma"
    COMPUTE = "compute"


class Unit(str, Enum):
    """The unit that executes an opcode."""

    DMA = "dma"
    MAC_ARRAY = "mac_array"
    ELEMENTWISE = "elementwise"
    POOLING = "pooling"
    OUTPUT_STAGE = "output_stage"
    """Requantization, clamp and the look-up table: what a LUT command uses on its own."""
    SOFTMAX = "softmax"

    @property
    def engine(self) -> Engine:
        return Engine.DMA if self is Unit.DMA else Engine.COMPUTE


@dataclass(frozen=True)
class OpcodeDef:
    opcode: Opcode
    payload: type
    slot: str
    """Field of the schema's ``Command`` table that holds the payload."""
    unit: Unit
    validate: Callable
    """(stream, config, opcode, payload, where) -> None, raising ``StreamError``."""
    execute: Callable
    """(machine state, opcode, payload, config) -> int: the bit-exact kernel; it returns how many output
    elements overflowed their accumulator (0 for units without one)."""
    cost: Callable
    """(opcode, payload, config) -> :class:`simulator.cycles.CommandCost`."""
    since: tuple[int, int] | None = None
    """The command-stream format that introduced the opcode (no stream of an older format may hold it); None
    for the opcodes of the first formats, which every reader knows."""
    activations: frozenset = frozenset({ActivationType.INT8})
    """Element types its feature maps may have (format 2.3): int8 everywhere, int16 too for the 16x8 CONV2D."""


OPCODES: dict[Opcode, OpcodeDef] = {d.opcode: d for d in (
    OpcodeDef(Opcode.DMA_COPY, DmaCopy, "dma", Unit.DMA, checks.check_dma, kernels.run_dma, cycles.dma_cost),
    OpcodeDef(Opcode.CONV2D, Convolution, "conv", Unit.MAC_ARRAY, checks.check_convolution, kernels.run_conv2d,
              cycles.conv2d_cost, activations=frozenset(ActivationType)),
    OpcodeDef(Opcode.DEPTHWISE_CONV2D, Convolution, "conv", Unit.MAC_ARRAY, checks.check_convolution,
              kernels.run_depthwise_conv2d, cycles.depthwise_cost),
    OpcodeDef(Opcode.FULLY_CONNECTED, Convolution, "conv", Unit.MAC_ARRAY, checks.check_convolution,
              kernels.run_fully_connected, cycles.fully_connected_cost),
    OpcodeDef(Opcode.ADD, Elementwise, "elementwise", Unit.ELEMENTWISE, checks.check_elementwise,
              kernels.run_elementwise, cycles.elementwise_cost),
    OpcodeDef(Opcode.SUB, Elementwise, "elementwise", Unit.ELEMENTWISE, checks.check_elementwise,
              kernels.run_elementwise, cycles.elementwise_cost),
    OpcodeDef(Opcode.MUL, Elementwise, "elementwise", Unit.ELEMENTWISE, checks.check_elementwise,
              kernels.run_elementwise, cycles.elementwise_cost),
    OpcodeDef(Opcode.MEAN, Reduction, "reduction", Unit.MAC_ARRAY, checks.check_reduction, kernels.run_mean,
              cycles.mean_cost),
    OpcodeDef(Opcode.MAX_POOL2D, Pooling, "pooling", Unit.POOLING, checks.check_pooling, kernels.run_max_pool,
              cycles.pool_cost),
    OpcodeDef(Opcode.AVG_POOL2D, Pooling, "pooling", Unit.POOLING, checks.check_pooling, kernels.run_avg_pool,
              cycles.pool_cost),
    OpcodeDef(Opcode.LUT, TableLookup, "lut", Unit.OUTPUT_STAGE, checks.check_lut, kernels.run_lut, cycles.lut_cost),
    OpcodeDef(Opcode.SOFTMAX, Softmax, "softmax", Unit.SOFTMAX, checks.check_softmax, kernels.run_softmax,
              cycles.softmax_cost),
    OpcodeDef(Opcode.RESIZE_BILINEAR, Resize, "resize", Unit.POOLING, checks.check_resize,
              kernels.run_resize_bilinear, cycles.resize_bilinear_cost, since=(2, 2)),
    OpcodeDef(Opcode.BATCH_MATMUL, MatMul, "matmul", Unit.MAC_ARRAY, checks.check_matmul, kernels.run_batch_matmul,
              cycles.batch_matmul_cost, since=(2, 2)),
)}


def opcode_def(opcode: Opcode) -> OpcodeDef:
    """The record of ``opcode``; an opcode the table lacks is a stream this simulator cannot run."""
    try:
        return OPCODES[opcode]
    except KeyError:
        raise StreamError(f"opcode {getattr(opcode, 'name', opcode)} has no definition in the opcode table") from None


"""Payload type -> schema slot (several opcodes share a payload, never with different slots)."""
