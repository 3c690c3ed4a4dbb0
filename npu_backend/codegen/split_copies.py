"""A DMA that waits for part of its SRAM moves the rest first: a pass over a finished command list.

The DMA engine takes its commands in stream order, so a load whose destination a compute command still
reads waits for that command to end, and every DMA after it waits too, while most of its bytes may be free
already. At the end of MobileNetV2-0.35-96's head, a classifier tile of 21 KB was placed over the 6 KB of
constants the layer before the classifier's suffix still read: the DMA engine idled 2,000 cycles. A store
likewise waits for the last command writing any of its bytes: the region's output (the classifier's 1,000
scores) waited for its last tile, then moved all 1,000 bytes.

Such a copy is split by its SRAM bytes: the pieces clear of every command it waits for go first, in its
place, and the pieces over bytes still in use follow, in the order those bytes free. The pieces move exactly
the bytes the copy moved, between the same addresses, so the stream computes what it did; the dependencies
are derived again (:func:`simulator.hazards.dependencies`), so each piece waits only for what touches its own
bytes. Each extra piece pays a DMA latency, so a split is kept only when the makespan shrinks.
"""

from __future__ import annotations

import dataclasses

from simulator.config import NpuConfig
from simulator.hazards import accesses
from simulator.isa import Command, DmaCopy, MemorySpace
from simulator.opcodes import Engine

from .reorder import StreamTiming

TRIALS = 8
"""Splits timed at most per stream (each times the whole stream again): copies on the critical path that wait,
the earliest first."""


def _sram_offset(copy: DmaCopy) -> int:
    """Where the copy's bytes are in SRAM (its destination for a load, its source for a store)."""
    return copy.dst_offset if copy.dst_space == MemorySpace.SRAM else copy.src_offset


def _pieces(copy: DmaCopy, busy: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The byte ranges of ``copy`` (offsets into it) whose SRAM bytes are clear of the ``busy`` SRAM ranges, and
    the rest."""
    start = _sram_offset(copy)
    stop = start + copy.row_bytes
    cuts = sorted({start, stop} | {min(max(x, start), stop) for a, b in busy for x in (a, b)})
    free, taken = [], []
    for a, b in zip(cuts, cuts[1:]):
        if a < b:
            (taken if any(x < b and a < y for x, y in busy) else free).append((a - start, b - start))
    return free, taken


def _waiting(p: int, timing: StreamTiming, ends: list[int], derived: list[Command]) -> list[int]:
    """The commands the copy at ``p`` waits for: its dependencies that end after the DMA engine is free for it."""
    previous = next((q for q in range(p - 1, -1, -1) if timing.engines[q] == Engine.DMA), None)
    free = 0 if previous is None else ends[previous]
    return [q for q in derived[p].deps if ends[q] > free]


def split_waiting_copies(commands: list[Command], config: NpuConfig) -> list[Command]:
    """The commands with each one-row DMA between DRAM and SRAM that waits for a compute command still using part
    of its SRAM bytes split so that its free bytes move first, the rest in the order they free, where that
    shortens the makespan; with their dependencies derived (the last timing derived them already)."""
    commands = list(commands)
    timing = StreamTiming(commands, config)
    best, starts, ends, derived, critical = timing.run(list(range(len(commands))))
    tried: set[int] = set()
    for _ in range(TRIALS):
        split = None
        for p in sorted(range(len(commands)), key=lambda q: starts[q]):
            command, copy = commands[p], commands[p].payload
            if id(command) in tried or not critical[p] or not isinstance(copy, DmaCopy) or copy.rows != 1 \
                    or MemorySpace.SRAM not in (copy.src_space, copy.dst_space) or copy.src_space == copy.dst_space:
                continue
            waits = _waiting(p, timing, ends, derived)
            if not waits:
                continue
            tried.add(id(command))
            busy = [(a.start, a.stop, ends[q]) for q in waits for a in accesses(commands[q], config)
                    if a.memory[0] == MemorySpace.SRAM]
            clear, taken = _pieces(copy, [(a, b) for a, b, _ in busy])
            if not clear or not taken:
                continue
            base = _sram_offset(copy)
            freed = lambda r: max(e for a, b, e in busy if a < base + r[1] and base + r[0] < b)  # noqa: E731
            pieces = [dataclasses.replace(command, deps=None, payload=dataclasses.replace(
                copy, src_offset=copy.src_offset + a, dst_offset=copy.dst_offset + a, row_bytes=b - a))
                for a, b in clear + sorted(taken, key=freed)]
            split = commands[:p] + pieces + commands[p + 1:]
            break
        if split is None:
            break
        trial = StreamTiming(split, config)
        span, *rest = trial.run(list(range(len(split))))
        if span < best:
            commands, timing, best = split, trial, span
            starts, ends, derived, critical = rest
    return derived
