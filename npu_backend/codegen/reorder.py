"""Compute commands that are ready sooner run sooner: a pass over a finished command list.

The compute engine takes its commands in stream order, so one that waits for a load holds back every
command after it, even those whose inputs landed long before. The tiles of one layer are independent
(distinct output channels or rows), and the scheduler emits them in channel order while deep prefetch
loads their constants in whatever order SRAM allowed: at the end of MobileNetV2's classifier, tiles
prefetched early sat behind the tile of the last load and ran after it, 2,624 cycles of tail.

A command moves ahead of earlier commands only past commands whose bytes it does not touch (neither of a
pair writes what the other reads or writes), so the reordered list computes exactly what the original
does; the dependencies are derived again from it (:func:`simulator.hazards.dependencies`). A move is
kept only when the makespan shrinks, so the pass never makes a stream slower.
"""

from __future__ import annotations

import itertools

from simulator.config import NpuConfig
from simulator.hazards import Access, accesses, dependencies, engine_of
from simulator.isa import Command, CommandStream
from simulator.opcodes import Engine, opcode_def
from simulator.timeline import schedule

WINDOW = 16
"""How many later compute commands of the same layer, on the critical path, are considered for each one that
waits."""

TRIALS = 24
"""Reorders timed at most per stream (each times the whole stream again). Only a command on the critical path
(ending later would end the stream later) is worth moving into an earlier gap, and the walk starts from the
end, where such commands are."""


def _touch(a: tuple[Access, ...], b: tuple[Access, ...]) -> bool:
    """Whether two commands' accesses conflict: the same bytes, one of them writing."""
    return any(x.memory == y.memory and x.start < y.stop and y.start < x.stop and (x.write or y.write)
               for x in a for y in b)


class StreamTiming:
    """A command list timed as a stream (for the passes that try changes to it and keep those that shorten it)."""

    def __init__(self, commands: list[Command], config: NpuConfig):
        self.commands, self.config = commands, config
        self.engines = [engine_of(c) for c in commands]
        self.cycles = [opcode_def(c.opcode).cost(c.opcode, c.payload, config).cycles for c in commands]

    def run(self, order: list[int]) -> tuple[int, list[int], list[int], list[Command], list[bool]]:
        """Makespan, start and end per position (:func:`simulator.timeline.schedule` of the commands in
        ``order``), the commands in that order with their dependencies derived (positions), and whether each is
        critical: whether ending later would end the stream later."""
        derived = dependencies([self.commands[i] for i in order], self.config)
        slots = schedule(CommandStream("reorder", self.config, (), derived), self.config)
        starts, ends = [s.start for s in slots], [s.end for s in slots]
        span = max(ends, default=0)
        before, last = [], {}  # what each waits for: its dependencies and its engine's previous command
        for p, slot in enumerate(slots):
            before.append(derived[p].deps + ((last[slot.engine],) if slot.engine in last else ()))
            last[slot.engine] = p
        latest = [span] * len(order)  # the latest each may end without ending the stream later
        for p in range(len(order) - 1, -1, -1):
            for d in before[p]:
                latest[d] = min(latest[d], latest[p] - (ends[p] - starts[p]))
        return span, starts, ends, derived, [late == end for late, end in zip(latest, ends)]


def ready_first(commands: list[Command] | tuple[Command, ...], config: NpuConfig) -> list[Command]:
    """The commands with compute commands moved ahead of a waiting one of their layer where that shortens the
    makespan (dependencies not yet derived: the caller derives them, as for any command list)."""
    commands = list(commands)
    timing = StreamTiming(commands, config)
    touched = [accesses(c, config) for c in commands]
    order = list(range(len(commands)))
    best, starts, ends, derived, critical = timing.run(order)
    trials = 0
    p = len(order) - 1
    while p > 0 and trials < TRIALS:
        i = order[p]
        previous = next((r for r in range(p - 1, -1, -1) if timing.engines[order[r]] == Engine.COMPUTE), None)
        free = 0 if previous is None else ends[previous]  # when the compute engine was free for it
        if timing.engines[i] == Engine.COMPUTE and starts[p] > free:
            # it waited for a dependency: a later command of its layer that is ready may run in the gap
            later = (q for q in range(p + 1, len(order)) if critical[q]
                     and timing.engines[order[q]] == Engine.COMPUTE and commands[order[q]].layer == commands[i].layer)
            for q in itertools.islice(later, WINDOW):
                j = order[q]
                ready = max([free] + [ends[d] for d in derived[q].deps])
                if ready + timing.cycles[j] > starts[p]:
                    continue  # it would not end before the waiting one starts, which would then wait longer
                if any(_touch(touched[j], touched[order[r]]) for r in range(p, q)):
                    continue
                trial = order[:p] + [j] + order[p:q] + order[q + 1:]
                trials += 1
                span, *rest = timing.run(trial)
                if span < best:
                    order, best, (starts, ends, derived, critical) = trial, span, rest
                    p += 2  # after the step back below: the one that waited, now a place later, again
                    break
        p -= 1
    return [commands[i] for i in order]
