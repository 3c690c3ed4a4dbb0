"""How far a region's makespan is from what its SRAM allows: the bound on a weight-streaming tail.

A region whose last layers move more weight bytes than they compute on (a classifier at batch 1) ends at
the DMA's pace. For every suffix of its layers (in order of their first compute command), with ``t0`` the
compute cycles of every layer before the suffix (the compute engine runs one command at a time, so the
suffix cannot start earlier) and ``D`` the cycles of the DMA commands that move the suffix's constants and
the region's outputs:

    makespan >= t0 + D - L / B + (the suffix's smallest compute command)

where ``L`` is the suffix's constant bytes already in SRAM at ``t0``, at most the SRAM. When every layer of
the suffix feeds the last one (directly or through others: a chain, as MobileNetV2's classifier tail), the
last tail is tighter: whichever constant load ends last, at least one command of the last layer runs after
it, so its smallest command replaces the suffix's. The script prints, for the suffix where the bound is
tightest: ``t0``, ``D``, the ``L`` the stream achieves (its suffix constants moved before ``t0``), the bound
for ``L`` = all SRAM and for ``L`` = a share of it, beside the makespan; and the same bound seen from the DMA
engine: its busy cycles in the stream, and the idle it cannot avoid while the layers before the suffix
compute (``t0``, less their own DMA, less the SRAM's worth of suffix constants). docs/cycle_model.md quotes it
for MobileNetV2-0.35-96 on npu-256.

    python bench/bench_tail_bound.py [--model PATH] [--preset npu-256] [--share 0.77]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import npu_backend
from npu_backend.codegen.lower import lower_module, npu_regions, region_graph
from simulator import BufferKind, Opcode, run_stream
from simulator.hazards import SRAM, accesses
from simulator.opcodes import Engine

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "tests" / "fixtures" / "tflite" / "mobilenet_v2_035_96.tflite"


def feeds_last(graph) -> dict[str, bool]:
    """Layer name -> whether the region's last layer reads its result, directly or through other layers."""
    readers: dict[str, list[str]] = {}
    producer = {layer.result.name: layer.name for layer in graph.layers}
    for layer in graph.layers:
        for operand in layer.operands:
            if operand is not None and operand.name in producer:
                readers.setdefault(producer[operand.name], []).append(layer.name)
    last = graph.layers[-1].name
    reaches = {last: True}
    for layer in reversed(graph.layers[:-1]):
        reaches[layer.name] = any(reaches.get(r, False) for r in readers.get(layer.name, ()))
    return reaches


def constant_readers(stream, stats) -> dict[int, str | None]:
    """Each DMA command's index -> the layer of the first compute command after it that reads the SRAM bytes it
    writes (the layer whose constants it moves; None if nothing reads them), from the stream's own accesses."""
    found: dict[int, str | None] = {}
    pending: list[tuple[int, int, int]] = []  # (DMA index, start, stop) of SRAM writes not yet read
    for index, (command, s) in enumerate(zip(stream.commands, stats.commands)):
        if command.opcode == Opcode.DMA_COPY:
            found[index] = None
            pending += [(index, a.start, a.stop) for a in accesses(command, stream.config)
                        if a.write and a.memory == SRAM]
            continue
        reads = [a for a in accesses(command, stream.config) if not a.write and a.memory == SRAM]
        still = []
        for dma, start, stop in pending:
            if any(a.start < stop and start < a.stop for a in reads):
                found[dma] = s.layer
            else:
                still.append((dma, start, stop))
        pending = still
    return found


def tail_bound(stream, stats, share: float, reaches: dict[str, bool]) -> dict:
    """The tightest suffix's figures (cycles), from the stream, its run and :func:`feeds_last`."""
    config = stream.config
    computes = [s for s in stats.commands if s.engine == Engine.COMPUTE]
    order = list(dict.fromkeys(s.layer for s in sorted(computes, key=lambda s: s.start)))
    compute_of = {layer: 0 for layer in order}
    smallest = {layer: None for layer in order}
    for s in computes:
        compute_of[s.layer] += s.cycles
        smallest[s.layer] = s.cycles if smallest[s.layer] is None else min(smallest[s.layer], s.cycles)
    readers = constant_readers(stream, stats)
    moves = []  # (layer the constants belong to or None for an output, cycles, end, bytes)
    for index, (command, s) in enumerate(zip(stream.commands, stats.commands)):
        if command.opcode != Opcode.DMA_COPY:
            continue
        p = command.payload
        if p.src_space == 0 and stream.buffers[p.src_buffer].kind == BufferKind.CONSTANT:
            owner = readers[index]
        elif p.dst_space == 0 and stream.buffers[p.dst_buffer].kind == BufferKind.OUTPUT:
            owner = None
        else:
            continue
        moves.append((owner, s.cycles, s.start, p.bytes_moved))
    busy = sum(s.cycles for s in stats.commands if s.engine != Engine.COMPUTE)
    best = None
    for first in range(len(order)):
        suffix = set(order[first:])
        t0 = sum(compute_of[layer] for layer in order[:first])
        mine = [m for m in moves if m[0] is None or m[0] in suffix]
        d = sum(m[1] for m in mine)
        chain = all(reaches.get(layer, False) for layer in suffix)
        tail = smallest[order[-1]] if chain else min(smallest[layer] for layer in suffix)
        full = t0 + d - config.sram_bytes / config.dram_bytes_per_cycle + tail
        if best is None or full > best["bound (L = SRAM)"]:
            start = min(s.start for s in computes if s.layer in suffix)
            loaded = sum(m[1] for m in mine if m[2] + m[1] <= start)
            best = {"suffix": f"{order[first]} .. {order[-1]} ({len(order) - first} layers)",
                    "t0 (compute before the suffix)": t0, "suffix starts in the stream": start,
                    "D (its DMA commands)": d, "commands": len(mine),
                    "bytes": sum(m[3] for m in mine), "L / B achieved (moved before it starts)": loaded,
                    "tail after the last load": f"{tail:,} ({'the last layer' if chain else 'the suffix'}'s "
                                                "smallest command)",
                    "bound (L = SRAM)": full,
                    f"bound (L = {share:.0%} of SRAM)": t0 + d - share * config.sram_bytes
                    / config.dram_bytes_per_cycle + tail,
                    "DMA engine busy (every command)": busy,
                    "  its idle before the suffix, at least": max(0.0, t0 - (busy - d) - config.sram_bytes
                                                                  / config.dram_bytes_per_cycle)}
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--preset", default="npu-256")
    parser.add_argument("--share", type=float, default=0.77, help="share of SRAM for the tail's constants")
    args = parser.parse_args()
    mod = npu_backend.partition_for_npu(npu_backend.load_model(args.model), preset=args.preset)
    regions = npu_regions(mod)
    for symbol, stream in lower_module(mod).items():
        reaches = feeds_last(region_graph(regions[symbol], symbol))
        inputs = {b.name: np.zeros(b.shape, b.dtype) for _, b in stream.buffers_of(BufferKind.INPUT)}
        _, stats = run_stream(stream, inputs)
        print(f"{args.model.name} on {args.preset}, region {symbol}: makespan {stats.total_cycles:,} cycles")
        for key, value in tail_bound(stream, stats, args.share, reaches).items():
            print(f"  {key:45s} {value:>12,.0f}" if not isinstance(value, str) else f"  {key:45s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
