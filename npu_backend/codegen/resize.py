"""Tile programs of the two resizes: nearest by DMA alone, bilinear on the pooling unit.

Nearest (a whole-factor upscale) never computes: a strided load writes every input pixel to every
``f_w``-th pixel of an SRAM row (one load per horizontal repeat), and a strided store writes each widened
row to every ``f_h``-th output row (one store per vertical repeat), so a stripe costs ``f_w + f_h`` DMA
commands whatever its size. Bilinear loads the input rows an output stripe reads (full width, a channel
tile) and runs one RESIZE_BILINEAR command on them, whose offsets place the tile in the image.
"""

from __future__ import annotations

from simulator.isa import Command, FeatureMap, Opcode, Resize
from simulator.resize import tile_offset

from ..params import ResizeBilinearParams, ResizeNearestParams
from ..tiling import ResizePlan, bilinear_input_rows
from .emit import StreamBuilder


def emit_resize_nearest(sb: StreamBuilder, p: ResizeNearestParams, stripe: int, prepared, layer: str,
                        sources: list[int], dst: int) -> None:
    """Stripes of input rows (images of a batch stacked), widened by strided loads, stored by strided stores."""
    (src,) = sources
    batch, height, width, channels = p.ifm_shape
    repeat_h, repeat_w = p.factors
    out_row = width * repeat_w * channels
    rows = batch * height
    for r0 in range(0, rows, stripe):
        count = min(stripe, rows - r0)
        for k in range(repeat_w):  # input pixel j of the stripe lands on SRAM pixel repeat_w * j + k
            sb.dma(layer, src, r0 * width * channels, k * channels, channels, rows=count * width,
                   dram_stride=channels, sram_stride=repeat_w * channels)
        for k in range(repeat_h):  # widened row i of the stripe is output row repeat_h * (r0 + i) + k
            sb.dma(layer, dst, (repeat_h * r0 + k) * out_row, 0, out_row, rows=count, dram_stride=repeat_h * out_row,
                   sram_stride=out_row, to_sram=False)


def emit_resize_bilinear(sb: StreamBuilder, p: ResizeBilinearParams, plan: ResizePlan, steps, layer: str,
                         sources: list[int], dst: int) -> None:
    """Per image, channel tile and output row stripe: load the input rows it reads, resize, store."""
    (src,) = sources
    batch, height, width, channels = p.ifm_shape
    _, out_height, out_width, _ = p.ofm_shape
    step_h, step_w, offset_h, offset_w = steps
    for b in range(batch):
        for c0 in range(0, channels, plan.channel_tile):
            ct = min(plan.channel_tile, channels - c0)
            for oy0 in range(0, out_height, plan.row_tile):
                oy1 = min(out_height, oy0 + plan.row_tile)
                iy0, iy1 = bilinear_input_rows(p, steps, oy0, oy1)
                sb.feature_dma(layer, src, (b * height + iy0) * width, (iy1 - iy0) * width, channels, c0, ct,
                               plan.ifm_address, to_sram=True)
                op = Resize(ifm=FeatureMap(plan.ifm_address, iy1 - iy0, width, ct),
                            ofm=FeatureMap(plan.ofm_address, oy1 - oy0, out_width, ct), step_h=step_h,
                            step_w=step_w, offset_h=tile_offset(oy0, step_h, offset_h, iy0), offset_w=offset_w,
                            rounding=p.rounding)
                sb.commands.append(Command(Opcode.RESIZE_BILINEAR, op, layer))
                sb.feature_dma(layer, dst, (b * out_height + oy0) * out_width, (oy1 - oy0) * out_width, channels,
                               c0, ct, plan.ofm_address, to_sram=False)
