"""Running a command stream: validate, load DRAM, execute, account.

Every figure in the returned statistics is the cost of one executed command;
totals are sums over them, never estimated separately, except the stream's
cycles: its makespan, the end of the last command in the engines' schedule
(:mod:`simulator.timeline`), where the DMA engine and the compute units overlap. So are accumulator
overflows: each command reports how many of its output elements had an exact
sum outside the accumulator's ``NpuConfig.accumulator_bits`` range (then wrapped
or saturated as ``NpuConfig.accumulator_overflow`` says).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .config import NpuConfig
from .errors import ExecutionError
from .hazards import waits_for
from .isa import BufferKind, CommandStream, Opcode
from .opcodes import Engine
from .stream import decode_stream
from .timeline import Slot


@dataclass(frozen=True)
class CommandStats:
    index: int
    opcode: Opcode
    layer: str
    cycles: int
    macs: int
    dram_read_bytes: int
    dram_write_bytes: int
    overflows: int = 0
    """Output elements whose accumulator overflowed (0 for commands without one)."""
    engine: Engine = Engine.COMPUTE
    start: int = 0
    """Cycle at which the command starts in the schedule (:mod:`simulator.timeline`); it ends at start + cycles."""
    deps: tuple[int, ...] = ()
    """The commands it waited for besides its engine's previous one (:func:`simulator.hazards.waits_for`: its
    ``deps``, or the previous command in a stream without dependencies)."""
    fixed_cycles: int = 0
    """The part of ``cycles`` paid whatever the command's size (:attr:`simulator.cycles.CommandCost.fixed_cycles`)."""

    @property
    def end(self) -> int:
        return self.start + self.cycles


@dataclass(frozen=True)
class RunStats:
    """Per-command statistics of one stream execution."""

    stream: str
    config: NpuConfig
    commands: tuple[CommandStats, ...]

    @property
    def total_cycles(self) -> int:
        """The makespan: DMA and compute overlap, so this is at most the sum of the commands' cycles."""
        return max((c.end for c in self.commands), default=0)

    def busy_cycles(self, engine: Engine) -> int:
        """Cycles during which ``engine`` runs a command."""
        return sum(c.cycles for c in self.commands if c.engine == engine)

    @property
    def total_macs(self) -> int:
        return sum(c.macs for c in self.commands)

    @property
    def total_dram_bytes(self) -> int:
        return sum(c.dram_read_bytes + c.dram_write_bytes for c in self.commands)

    @property
    def total_overflows(self) -> int:
        return sum(c.overflows for c in self.commands)

    def per_layer(self) -> dict[str, dict[str, int]]:
        """Sum the commands of each layer (DMA included), in first-seen order."""
        layers: dict[str, dict[str, int]] = {}
        for c in self.commands:
            row = layers.setdefault(c.layer, {"commands": 0, "cycles": 0, "macs": 0, "dram_bytes": 0,
                                              "overflows": 0})
            row["commands"] += 1
            row["cycles"] += c.cycles
            row["macs"] += c.macs
            row["dram_bytes"] += c.dram_read_bytes + c.dram_write_bytes
            row["overflows"] += c.overflows
        return layers


def describe_overflows(count: int, config: NpuConfig) -> str:
    """The report line for ``count`` overflows on ``config``: ``accumulator overflows: N (mode, B bits)``."""
    return f"accumulator overflows: {count} ({config.accumulator_overflow}, {config.accumulator_bits} bits)"


def _load_inputs(stream: CommandStream, inputs: Mapping[str, np.ndarray]) -> dict[int, np.ndarray]:
    declared = dict((b.name, (i, b)) for i, b in stream.buffers_of(BufferKind.INPUT))
    missing = sorted(set(declared) - set(inputs))
    extra = sorted(set(inputs) - set(declared))
    if missing or extra:
        raise ExecutionError(f"inputs do not match the stream: missing {missing}, unexpected {extra}")
    loaded = {}
    for name, (index, buf) in declared.items():
        value = np.asarray(inputs[name])
        if value.dtype != np.dtype(buf.dtype) or tuple(value.shape) != tuple(buf.shape):
            raise ExecutionError(f"input {name!r} must be {buf.dtype}{list(buf.shape)}, "
                                 f"got {value.dtype}{list(value.shape)}")
        loaded[index] = np.ascontiguousarray(value).reshape(-1).view(np.uint8).copy()
    return loaded


def run_stream(stream: CommandStream | bytes, inputs: Mapping[str, np.ndarray],
               config: NpuConfig | None = None) -> tuple[dict[str, np.ndarray], RunStats]:
    """Execute a stream bit-exactly and return its outputs by name and its statistics.

    ``config`` defaults to the one the stream carries; a stream never runs on
    hardware whose numbers differ from those it was compiled for.
    """
    if not isinstance(stream, CommandStream):
        stream = decode_stream(stream)
    # Validated, scheduled and run by prepared steps (simulator.prepared, which builds on this module's
    # statistics, hence the import here); running the same stream object again reuses its preparation.
    from .prepared import recently_prepared

    return recently_prepared(stream, config or stream.config).run(inputs)


def run_stats(stream: CommandStream, config: NpuConfig, slots: tuple[Slot, ...], overflows: list[int]) -> RunStats:
    """The statistics of one execution: the schedule's figures (data-independent) and the overflows counted."""
    return RunStats(stream.name, config, tuple(
        CommandStats(index, command.opcode, command.layer, slot.cost.cycles, slot.cost.macs,
                     slot.cost.dram_read_bytes, slot.cost.dram_write_bytes, count, slot.engine, slot.start,
                     waits_for(index, command), slot.cost.fixed_cycles)
        for index, (command, slot, count) in enumerate(zip(stream.commands, slots, overflows))))
