"""When each command runs: the engines' schedule, a function of the stream alone.

Each engine (:class:`simulator.opcodes.Engine`) takes its commands in stream order, one at a time; a
command starts when its engine is free and every command it waits for (``Command.deps``, or the previous
command for streams without dependencies) has ended, and it lasts its cost
(:mod:`simulator.cycles`). The stream takes its makespan: the latest end. Nothing here executes a
kernel, so the timing of a stream is computed once, whatever data runs through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import NpuConfig
from .cycles import CommandCost
from .hazards import waits_for
from .isa import CommandStream
from .opcodes import Engine, opcode_def


@dataclass(frozen=True)
class Slot:
    """One command's place in the schedule, in cycles from the stream's start."""

    engine: Engine
    start: int
    end: int
    cost: CommandCost


def schedule(stream: CommandStream, config: NpuConfig) -> tuple[Slot, ...]:
    """The slot of every command, in stream order."""
    free: dict[Engine, int] = {}
    slots: list[Slot] = []
    for index, command in enumerate(stream.commands):
        definition = opcode_def(command.opcode)
        engine = definition.unit.engine
        cost = definition.cost(command.opcode, command.payload, config)
        start = max([free.get(engine, 0)] + [slots[d].end for d in waits_for(index, command)])
        slots.append(Slot(engine, start, start + cost.cycles, cost))
        free[engine] = start + cost.cycles
    return tuple(slots)
