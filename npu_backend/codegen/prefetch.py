"""Deep prefetch: constant loads (weights and scale/bias tiles) emitted earlier than the step before their
use, into steps whose compute would leave the DMA engine idle.

The DMA engine takes its commands in order, so a load emitted early runs early. Where it can go is bounded by
SRAM: a prefetched constant holds its bytes from its load to its use. Two policies place it:
``repack`` holds constants wherever SRAM's total leaves room and allocates everything again; ``above``
places them over the maps' high-water mark. Which overlaps better depends on the region; the lowering tries
both (:data:`npu_backend.codegen.schedule.SCHEDULE_VARIANTS`).
"""

from __future__ import annotations

from simulator.config import NpuConfig
from simulator.opcodes import opcode_def

from .allocate import align_up, allocate
from .programs import Operand
from .steps import Schedule, ScheduleError, Step, is_constant

HOIST_ROUNDS = 4
"""Prefetched constants held across a step where the allocation around them fails are dropped, this many
times at most before prefetching only above everything allocated."""

HOIST_MARGIN = 0.2
"""Deep prefetch keeps this share of SRAM free at every step a prefetched constant is held across (room
for the allocator's fragmentation)."""


def dma_cycles(config: NpuConfig, row_bytes: int, rows: int) -> int:
    return config.dram_latency_cycles + -(-row_bytes * rows // config.dram_bytes_per_cycle)


def step_cycles(config: NpuConfig, step: Step) -> int:
    """The cycle model's figure for the step's compute command (0 for a layer run whole through DRAM)."""
    if step.opaque:
        return 0
    program = step.layer.program
    ifms = [Operand(0, w) for _, w in step.ifms]
    command = program.command(step.layer.name, *step.rows, *step.channels, ifms, 0, [0] * len(step.constants))
    return opcode_def(command.opcode).cost(command.opcode, command.payload, config).cycles


def prefetch_repacked(schedule: Schedule, config: NpuConfig) -> None:
    """Deep prefetch: emit constant loads (weights and scale/bias tiles) earlier than the step before their
    use, during steps whose compute would leave the DMA engine idle, while SRAM keeps a margin free at
    every step they are held across; then allocate again. Where the allocation fails, the moves held
    across the failing step are undone, until it succeeds (with no move left, it is the allocation that
    succeeded before)."""
    steps, sram = schedule.steps, config.sram_bytes
    if len(steps) < 3:
        return
    comp = [step_cycles(config, step) for step in steps]
    fifo = [(j, k) for j, step in enumerate(steps) for k, load in enumerate(step.loads)
            if is_constant(load) and load.sram.first == step.issue]
    live = [0] * len(steps)
    for b in schedule.buffers:
        for t in range(b.first, b.last + 1):
            live[t] += b.size
    first = {id(b): b.first for b in schedule.buffers}
    moves = _moves_repacked(config, steps, comp, fifo, live, sram * (1 - HOIST_MARGIN))
    while moves:
        failed = allocate(schedule.buffers, sram, config.sram_align)
        if failed is None:
            for step, k, t, _ in moves:
                step.hoisted[k] = t
            return
        kept = []
        for move in moves:
            step, k, t, buffer = move
            if t <= failed.last and failed.first <= first[id(buffer)]:
                buffer.first = first[id(buffer)]
            else:
                kept.append(move)
        if len(kept) == len(moves):
            break
        moves = kept
    for b in schedule.buffers:
        b.first = first[id(b)]
    if allocate(schedule.buffers, sram, config.sram_align) is not None:
        raise ScheduleError("the allocation that fitted no longer fits")  # cannot happen: same buffers


def _walk(config: NpuConfig, steps: list[Step], comp: list[int], fifo: list[tuple[int, int]], place) -> list:
    """Walk the two engines through the steps in program order; whenever the DMA engine would idle
    before a step's compute ends, emit the next constant loads (in the order they are used) during that
    step, each where ``place(t, w, load)`` finds room for it from step ``t`` until its use at step ``w``
    (it returns the move to record, or None: a later constant may still fit)."""
    moves, head = [], 0
    hoisted: set[tuple[int, int]] = set()
    done: dict[tuple[int, int], int] = {}
    dma = compute = 0
    regular: dict[int, list[tuple[int, int]]] = {}
    for j, step in enumerate(steps):
        for k in range(len(step.loads)):
            regular.setdefault(step.hoisted.get(k, step.issue), []).append((j, k))
    for t in range(len(steps)):
        for j, k in regular.get(t, []):  # the loads emitted at t, in order
            if (j, k) not in hoisted:
                load = steps[j].loads[k]
                dma += dma_cycles(config, load.row_bytes, load.rows)
                done[(j, k)] = dma
        start = max([compute] + [done.get((t, k), 0) for k in range(len(steps[t].loads))])
        compute = start + comp[t]
        while head < len(fifo) and steps[fifo[head][0]].issue <= t + 1:
            head += 1  # emitted at most a step later anyway
        candidate = head
        while candidate < len(fifo) and not steps[t].opaque and dma < compute:
            j, k = fifo[candidate]
            candidate += 1
            load, w = steps[j].loads[k], steps[j].issue
            if (j, k) in hoisted or w <= t + 1 or any(steps[u].opaque for u in range(t, w)):
                continue
            move = place(t, w, load)
            if move is None:
                continue
            dma += dma_cycles(config, load.row_bytes, load.rows)
            done[(j, k)] = dma
            hoisted.add((j, k))
            moves.append((steps[j], k, t, *move))
        for store in steps[t].stores:
            dma = max(dma, compute) + dma_cycles(config, store.row_bytes, store.rows)
    return moves


def _moves_repacked(config: NpuConfig, steps: list[Step], comp: list[int], fifo: list[tuple[int, int]],
                    live: list[int], limit: float) -> list:
    """:func:`_walk` holding each prefetched constant while SRAM stays under ``limit`` bytes at every step it
    is held across (the allocation is then run again)."""

    def place(t: int, w: int, load):
        if max(live[t:w]) + load.sram.size > limit:
            return None
        for u in range(t, w):
            live[u] += load.sram.size
        load.sram.first = t
        return (load.sram,)

    return _walk(config, steps, comp, fifo, place)


def prefetch_above(schedule: Schedule, config: NpuConfig) -> None:
    """Deep prefetch: emit constant loads (weights and scale/bias tiles) earlier than the step before their
    use, during steps whose compute would leave the DMA engine idle.

    A prefetched constant moves above everything the allocation placed at the steps it is now held
    across (their high-water mark), packed from the top of SRAM down among the other prefetched ones, so
    the allocation stays valid without being run again."""
    steps = schedule.steps
    if len(steps) < 3:
        return
    comp = [step_cycles(config, step) for step in steps]
    fifo = [(j, k) for j, step in enumerate(steps) for k, load in enumerate(step.loads)
            if is_constant(load) and load.sram.first == step.issue]
    constants = {id(steps[j].loads[k].sram) for j, k in fifo}
    saved = [(b, b.first, b.address) for b in schedule.buffers]
    for loose in (True, False):
        # loose: above the maps alone, the other constants allocated again around the prefetched ones;
        # else above everything, which needs no new allocation
        high = [0] * len(steps)
        for b in schedule.buffers:
            if not (loose and id(b) in constants):
                for t in range(b.first, b.last + 1):
                    high[t] = max(high[t], b.address + b.size)
        moves = _moves_above(config, steps, comp, fifo, high)
        for _ in range(HOIST_ROUNDS if loose else 1):
            for b, first, address in saved:
                b.first, b.address = first, address
            for step, k, t, buffer, address in moves:
                buffer.first, buffer.address = t, address
            moved = {id(m[3]) for m in moves}
            failed = allocate([b for b in schedule.buffers if id(b) not in moved], config.sram_bytes,
                              config.sram_align, tuple(m[3] for m in moves)) if loose else None
            if failed is None:
                for step, k, t, _, _ in moves:
                    step.hoisted[k] = t
                return
            moves = [m for m in moves if not m[2] <= failed.last or not failed.first <= m[3].last]
        for b, first, address in saved:
            b.first, b.address = first, address


def _place_above(config: NpuConfig, placed: list, high: list[int], first: int, last: int,
                 size: int) -> int | None:
    """The highest address where ``size`` bytes stay above ``high`` and clear of the ``placed``
    (address, size, first, last) prefetched constants from step ``first`` to ``last``."""
    align = config.sram_align
    floor = align_up(max(high[first:last + 1]), align)
    top = config.sram_bytes
    for address, other, start, stop in sorted(placed, reverse=True):
        if start > last or stop < first:
            continue
        if address + other <= top - size and (top - size) // align * align >= align_up(address + other, align):
            break
        top = min(top, address)
    candidate = (top - size) // align * align
    return candidate if candidate >= floor else None


def _moves_above(config: NpuConfig, steps: list[Step], comp: list[int], fifo: list[tuple[int, int]],
                 high: list[int]) -> list:
    """:func:`_walk` placing each prefetched constant where SRAM above the allocation has room for it until
    its last use."""
    placed = []

    def place(t: int, w: int, load):
        address = _place_above(config, placed, high, t, load.sram.last, load.sram.size)
        if address is None:
            return None
        placed.append((address, load.sram.size, t, load.sram.last))
        return (load.sram, address)

    return _walk(config, steps, comp, fifo, place)


PREFETCH_POLICIES = {"repack": prefetch_repacked, "above": prefetch_above}
"""Deep-prefetch policies by name (:class:`npu_backend.codegen.schedule.ScheduleOptions`)."""
