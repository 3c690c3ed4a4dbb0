"""A load that waits for part of its SRAM loads the rest first: a pass over a finished command list.

The DMA engine takes its commands in stream order, so a load whose destination is still read by a compute
command waits for that command to end, and every load after it waits too, while most of its bytes may be
free already. At the end of MobileNetV2-0.35-96's head, a classifier tile of 21 KB was placed over the
6 KB of constants the layer before the classifier's suffix still read: the DMA engine idled 2,000 cycles.

Such a load is split by destination bytes: the pieces clear of every command it waits for go first, in
its place, and the pieces over bytes still in use follow them. The pieces move exactly the bytes the load
moved, between the same addresses, so the stream computes what it did; the dependencies are derived again
(:func:`simulator.hazards.dependencies`), so each piece waits only for what touches its own bytes. Each
extra piece pays a DMA latency, so a split is kept only when the makespan shrinks.
"""

from __future__ import annotations

import dataclasses

from simulator.config import NpuConfig
from simulator.hazards import accesses
from simulator.isa import Command, DmaCopy, MemorySpace
from simulator.opcodes import Engine

from .reorder import _Timing

TRIALS = 8
"""Splits timed at most per stream (each times the whole stream again), latest waiting load first."""


def _pieces(load: DmaCopy, busy: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The destination byte ranges of ``load`` (offsets into it) clear of ``busy`` SRAM ranges, and the rest."""
    start, stop = load.dst_offset, load.dst_offset + load.row_bytes
    cuts = sorted({start, stop} | {min(max(x, start), stop) for a, b in busy for x in (a, b)})
    free, taken = [], []
    for a, b in zip(cuts, cuts[1:]):
        inside = any(x < b and a < y for x, y in busy)
        (taken if inside else free).append((a - start, b - start))
    merge = lambda ranges: [r for r in ranges if r[0] < r[1]]  # noqa: E731
    return merge(free), merge(taken)


def split_waiting_loads(commands: list[Command], config: NpuConfig) -> list[Command]:
    """The commands with each constant load that waits for a compute command still reading part of its
    destination split so that its free bytes load first, the rest in the order its bytes free, where that
    shortens the makespan (dependencies not yet derived: the caller derives them, as for any command list)."""
    commands = list(commands)
    timing = _Timing(commands, config)
    best, starts, ends, deps, critical = timing.run(list(range(len(commands))))
    tried: set[int] = set()
    for _ in range(TRIALS):
        split = None
        for p in sorted(range(len(commands)), key=lambda q: starts[q]):
            command = commands[p]
            load = command.payload
            if id(command) in tried or not critical[p] or not isinstance(load, DmaCopy) \
                    or load.dst_space != MemorySpace.SRAM or load.rows != 1:
                continue
            previous = next((q for q in range(p - 1, -1, -1) if timing.engines[q] == Engine.DMA), None)
            free = 0 if previous is None else ends[previous]
            waits = [q for q in deps[p] if ends[q] > free]
            if starts[p] <= free or not waits:
                continue
            tried.add(id(command))
            busy = [(a.start, a.stop, ends[q]) for q in waits for a in accesses(commands[q], config)
                    if a.memory[0] == MemorySpace.SRAM]
            clear, taken = _pieces(load, [(a, b) for a, b, _ in busy])
            if not clear or not taken:
                continue
            base = load.dst_offset
            freed = lambda r: max(e for a, b, e in busy if a < base + r[1] and base + r[0] < b)  # noqa: E731
            pieces = [dataclasses.replace(command, payload=dataclasses.replace(
                load, src_offset=load.src_offset + a, dst_offset=base + a, row_bytes=b - a), deps=None)
                for a, b in clear + sorted(taken, key=freed)]
            split = commands[:p] + pieces + commands[p + 1:]
            break
        if split is None:
            break
        trial = _Timing(split, config)
        span, *rest = trial.run(list(range(len(split))))
        if span < best:
            commands, timing, best = split, trial, span
            starts, ends, deps, critical = rest
    return commands
