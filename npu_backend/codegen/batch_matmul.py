"""Tile program of BATCH_MATMUL: both operands are activations, moved by DMA like any feature map.

A tile is several whole batches, or one batch's right operand with a stripe of its left operand's rows;
either way both operands and the output are contiguous in DRAM, so each moves with one DMA command. The
right operand of a batch is loaded once, however many row stripes use it.
"""

from __future__ import annotations

from simulator.isa import Command, FeatureMap, MatMul, Opcode

from ..params import BatchMatMulParams
from ..tiling import MatMulPlan
from .emit import StreamBuilder


def emit_batch_matmul(sb: StreamBuilder, p: BatchMatMulParams, plan: MatMulPlan, prepared: tuple[int, int],
                      layer: str, sources: list[int], dst: int) -> None:
    src, src2 = sources
    multiplier, shift = prepared
    batches, rows, depth, columns = p.dims
    rhs = (columns, depth) if p.adj_y else (depth, columns)
    for b0 in range(0, batches, plan.batches):
        nb = min(plan.batches, batches - b0)
        sb.dma(layer, src2, b0 * depth * columns, plan.ifm2_address, nb * depth * columns)
        for r0 in range(0, rows, plan.rows):
            count = min(plan.rows, rows - r0)
            sb.dma(layer, src, (b0 * rows + r0) * depth, plan.ifm_address, nb * count * depth)
            op = MatMul(ifm=FeatureMap(plan.ifm_address, nb, count, depth),
                        ifm2=FeatureMap(plan.ifm2_address, nb, *rhs),
                        ofm=FeatureMap(plan.ofm_address, nb, count, columns),
                        input_zero_point=p.input_zero_point, input2_zero_point=p.input2_zero_point,
                        output_zero_point=p.output_zero_point, output_multiplier=multiplier, output_shift=shift,
                        act_min=p.clamp[0], act_max=p.clamp[1], rounding=p.rounding, adj_y=p.adj_y)
            sb.commands.append(Command(Opcode.BATCH_MATMUL, op, layer))
            sb.dma(layer, dst, (b0 * rows + r0) * columns, plan.ofm_address, nb * count * columns, to_sram=False)
