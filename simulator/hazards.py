"""Which bytes each command reads and writes, and the dependencies that keep concurrent engines correct.

The DMA engine and the compute units run concurrently (:mod:`simulator.timeline`); each engine takes its
own commands in stream order. Two commands on different engines that touch the same bytes, one of them
writing (read after write, write after read, write after write), must be ordered by the stream's
dependencies (``Command.deps``), directly or through a chain, or the concurrent machine could compute
something other than the stream read in order. :func:`check_dependencies` rejects such a stream;
:func:`dependencies` derives, for a command list in program order, the fewest dependencies that order
every hazard, which is what the compiler writes.

"Ordered" is decided with a vector clock per command: for each engine, the latest of its commands known
to have finished before this one starts. Engines are in order, so if command ``a`` of engine ``E`` is
known finished, so is every earlier command of ``E``; that is why a byte range need only remember its
last writer and, per engine, its latest reader since that write.

A command's footprint is its extent: a strided DMA is taken as the span from its first to its last byte,
gaps included, which can only add dependencies, never miss one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from .config import NpuConfig
from .errors import StreamError
from .isa import (Command, CommandStream, Convolution, DmaCopy, MemorySpace, TableLookup, feature_maps,
                  scale_bias_bytes, weight_shape)
from .opcodes import Engine, opcode_def

SRAM = (MemorySpace.SRAM, -1)
"""The key of the one SRAM in an access; DRAM accesses are keyed by (DRAM, buffer index)."""


@dataclass(frozen=True)
class Access:
    memory: tuple[MemorySpace, int]
    start: int
    stop: int
    write: bool

    def describe(self) -> str:
        space, buffer = self.memory
        where = "SRAM" if space == MemorySpace.SRAM else f"DRAM buffer {buffer}"
        return f"{'writes' if self.write else 'reads'} {where} [{self.start}, {self.stop})"


def _dma_side(space: MemorySpace, buffer: int, offset: int, stride: int, rows: int, row_bytes: int,
              write: bool) -> Access:
    memory = SRAM if space == MemorySpace.SRAM else (MemorySpace.DRAM, buffer)
    return Access(memory, offset, offset + (rows - 1) * stride + row_bytes, write)


def accesses(command: Command, config: NpuConfig) -> tuple[Access, ...]:
    """Every byte range the command reads or writes: a DMA its source and destination; a compute command
    its feature maps in SRAM (the ``ofm`` written, the others read), plus the weights and scale/bias table
    of a convolution and the table of a look-up."""
    p = command.payload
    if isinstance(p, DmaCopy):
        return (_dma_side(p.src_space, p.src_buffer, p.src_offset, p.src_stride, p.rows, p.row_bytes, False),
                _dma_side(p.dst_space, p.dst_buffer, p.dst_offset, p.dst_stride, p.rows, p.row_bytes, True))
    found = [Access(SRAM, fmap.address, fmap.address + fmap.nbytes, name == "ofm")
             for name, fmap in feature_maps(p)]
    if isinstance(p, Convolution):
        weights = int(np.prod(weight_shape(command.opcode, p)))
        found += [Access(SRAM, p.weights_address, p.weights_address + weights, False),
                  Access(SRAM, p.scale_bias_address, p.scale_bias_address + scale_bias_bytes(p), False)]
    if isinstance(p, TableLookup):
        found.append(Access(SRAM, p.table_address, p.table_address + config.lut_entries, False))
    return tuple(found)


def engine_of(command: Command) -> Engine:
    return opcode_def(command.opcode).unit.engine


def waits_for(index: int, command: Command) -> tuple[int, ...]:
    """The commands ``command`` (at ``index``) waits for besides its engine's previous one: its ``deps``, or,
    absent (streams before format 2.4), the previous command of the stream."""
    if command.deps is not None:
        return command.deps
    return (index - 1,) if index else ()


class _Shadow:
    """Per byte range of one memory: the last writer and, per engine, the latest reader since that write.

    Segments are disjoint, sorted by start, and cover only bytes some command touched.
    """

    def __init__(self):
        self.starts: list[int] = []
        self.segments: list[list] = []  # [start, stop, writer | None, {engine: latest reader}]

    def _split(self, at: int) -> None:
        i = bisect.bisect_right(self.starts, at) - 1
        if i >= 0:
            start, stop, writer, readers = self.segments[i]
            if start < at < stop:
                self.segments[i][1] = at
                self.segments.insert(i + 1, [at, stop, writer, dict(readers)])
                self.starts.insert(i + 1, at)

    def overlapping(self, start: int, stop: int) -> list[list]:
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        last = bisect.bisect_left(self.starts, stop)
        return [s for s in self.segments[first:last] if s[0] < stop and start < s[1]]

    def record(self, access: Access, index: int, engine: Engine) -> None:
        self._split(access.start)
        self._split(access.stop)
        if access.write:  # one segment for the whole range: its history restarts here
            first = bisect.bisect_left(self.starts, access.start)
            last = bisect.bisect_left(self.starts, access.stop)
            del self.starts[first:last], self.segments[first:last]
            self.starts.insert(first, access.start)
            self.segments.insert(first, [access.start, access.stop, index, {}])
            return
        for segment in self.overlapping(access.start, access.stop):
            segment[3][engine] = index
        gaps, cursor = [], access.start  # bytes never touched before: new segments read by this command
        for segment in self.overlapping(access.start, access.stop):
            if segment[0] > cursor:
                gaps.append((cursor, segment[0]))
            cursor = max(cursor, segment[1])
        if cursor < access.stop:
            gaps.append((cursor, access.stop))
        for start, stop in gaps:
            at = bisect.bisect_left(self.starts, start)
            self.starts.insert(at, start)
            self.segments.insert(at, [start, stop, None, {engine: index}])


def _conflicts(shadows: dict, access: Access, engine: Engine) -> list[int]:
    """Earlier commands of other engines that ``access`` must be ordered after."""
    shadow = shadows.get(access.memory)
    if shadow is None:
        return []
    found = []
    for _, _, writer, readers in shadow.overlapping(access.start, access.stop):
        if writer is not None:
            found.append(writer)
        if access.write:
            found.extend(readers.values())
    return found


class _Clocks:
    """Vector clocks: for each command, per engine, the latest command of that engine known finished when it
    starts (its own engine's previous command included)."""

    def __init__(self, commands: tuple[Command, ...]):
        self.engines = [engine_of(c) for c in commands]
        self.clocks: list[dict[Engine, int]] = []
        self.last: dict[Engine, int] = {}

    def start(self, index: int, deps: tuple[int, ...]) -> dict[Engine, int]:
        engine = self.engines[index]
        clock: dict[Engine, int] = {}
        for before in ([self.last[engine]] if engine in self.last else []) + list(deps):
            for e, i in self.clocks[before].items():
                if clock.get(e, -1) < i:
                    clock[e] = i
            if clock.get(self.engines[before], -1) < before:
                clock[self.engines[before]] = before
        self.clocks.append(clock)
        self.last[engine] = index
        return clock

    def ordered(self, earlier: int, clock: dict[Engine, int]) -> bool:
        return clock.get(self.engines[earlier], -1) >= earlier


def _check_deps_form(index: int, command: Command) -> None:
    if command.deps is None:
        return
    for d in command.deps:
        if not 0 <= d < index:
            raise StreamError(f"command {index} ({command.opcode.name}) depends on command {d}, which does not "
                              f"come before it")
    if len(set(command.deps)) != len(command.deps):
        raise StreamError(f"command {index} ({command.opcode.name}) names a dependency twice")


def check_dependencies(stream: CommandStream, config: NpuConfig) -> None:
    """Raise ``StreamError`` unless every hazard between engines is ordered by the dependencies.

    A serial stream (every ``deps`` None: each command waits for the one before it) orders everything by
    construction and is not walked."""
    if all(command.deps is None for command in stream.commands):
        return
    clocks, shadows = _Clocks(stream.commands), {}
    for index, command in enumerate(stream.commands):
        _check_deps_form(index, command)
        clock = clocks.start(index, waits_for(index, command))
        engine = clocks.engines[index]
        found = accesses(command, config)
        for access in found:
            for earlier in _conflicts(shadows, access, engine):
                if not clocks.ordered(earlier, clock):
                    raise StreamError(
                        f"command {index} ({command.opcode.name}) {access.describe()} while command {earlier} "
                        f"({stream.commands[earlier].opcode.name}) may still be using it: it must depend on "
                        f"command {earlier}")
        for access in found:
            shadows.setdefault(access.memory, _Shadow()).record(access, index, engine)


def dependencies(commands: list[Command] | tuple[Command, ...], config: NpuConfig) -> tuple[Command, ...]:
    """The commands with the fewest ``deps`` that order every hazard of the program order: per other engine,
    the latest conflicting command not already ordered through another dependency."""
    commands = tuple(commands)
    clocks, shadows, result = _Clocks(commands), {}, []
    for index, command in enumerate(commands):
        engine = clocks.engines[index]
        found = accesses(command, config)
        latest: dict[Engine, int] = {}
        for access in found:
            for earlier in _conflicts(shadows, access, engine):
                e = clocks.engines[earlier]
                if e != engine and latest.get(e, -1) < earlier:
                    latest[e] = earlier
        # A dependency already implied by another (through its clock) is dropped; engine's own order is free.
        own = clocks.clocks[clocks.last[engine]] if engine in clocks.last else {}
        deps = []
        for e, earlier in sorted(latest.items(), key=lambda item: item[1], reverse=True):
            implied = own.get(e, -1) >= earlier or any(clocks.clocks[d].get(e, -1) >= earlier for d in deps)
            if not implied:
                deps.append(earlier)
        deps = tuple(sorted(deps))
        clocks.start(index, deps)
        for access in found:
            shadows.setdefault(access.memory, _Shadow()).record(access, index, engine)
        result.append(Command(command.opcode, command.payload, command.layer, deps))
    return tuple(result)
