"""Deep prefetch: constant loads (weights and scale/bias tiles) emitted earlier than the step before their
use, into steps whose compute would leave the DMA engine idle.

The DMA engine takes its commands in order, so a load emitted early runs early. Where it can go is bounded by
SRAM: a prefetched constant holds its bytes from its load to its use. Three policies place it:
``repack`` holds constants wherever SRAM's total leaves room and allocates everything again; ``above``
places them over the maps' high-water mark; ``tail`` fills SRAM with a weight-streaming tail's constants
while the layers before it load theirs just in time. Which overlaps better depends on the region; the
lowering tries each (:data:`npu_backend.codegen.schedule.SCHEDULE_VARIANTS`).
"""

from __future__ import annotations

import math

from simulator.config import NpuConfig
from simulator.opcodes import opcode_def

from .allocate import SramBuffer, align_up, allocate
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


def emitted_at(steps: list[Step]) -> dict[int, list[tuple[int, int]]]:
    """Step -> the (step, load index) of the loads emitted in its window, in order: at the consumer's issue
    step, or where the scheduler already moved the load (``Step.hoisted``)."""
    regular: dict[int, list[tuple[int, int]]] = {}
    for j, step in enumerate(steps):
        for k in range(len(step.loads)):
            regular.setdefault(step.hoisted.get(k, step.issue), []).append((j, k))
    return regular


def high_water(buffers, steps: int) -> list[int]:
    """Per step, the end of the highest of ``buffers`` live at it (0 where none is)."""
    high = [0] * steps
    for b in buffers:
        for t in range(b.first, b.last + 1):
            high[t] = max(high[t], b.address + b.size)
    return high


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
    regular = emitted_at(steps)
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
        high = high_water([b for b in schedule.buffers if not (loose and id(b) in constants)], len(steps))
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
    overlapping = [p for p in placed if not (p[2] > last or p[3] < first)]
    return _highest(config, overlapping, max(high[first:last + 1]), size)


def _highest(config: NpuConfig, taken: list, floor: int, size: int) -> int | None:
    """The highest aligned address where ``size`` bytes fit at or above ``floor`` clear of every ``taken``
    (address, size, ...) range."""
    align = config.sram_align
    top = config.sram_bytes
    for address, other, *_ in sorted(taken, reverse=True):
        if address + other <= top - size and (top - size) // align * align >= align_up(address + other, align):
            break
        top = min(top, address)
    candidate = (top - size) // align * align
    return candidate if candidate >= align_up(floor, align) else None


def _lowest(config: NpuConfig, taken: list, floor: int, size: int) -> int | None:
    """The lowest aligned address at or above ``floor`` where ``size`` bytes fit clear of every ``taken``
    (address, size, ...) range."""
    cursor = align_up(floor, config.sram_align)
    for address, other, *_ in sorted(taken):
        if address - cursor >= size:
            break
        cursor = max(cursor, align_up(address + other, config.sram_align))
    return cursor if cursor + size <= config.sram_bytes else None


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


HEAD_LOOKAHEAD = 2
"""The ``tail`` policy loads a constant of the layers before the tail at most this many steps before its
regular issue: early enough that a tail load queued ahead of it on the DMA engine seldom delays its step,
late enough that it holds little SRAM."""

RUN_TILES = 5
"""The ``tail`` policy moves up to this many consecutive channel tiles of a streamed layer in one DMA command
(one latency for all of them), as long as their compute hides under the DMA of the constants still to load:
so runs shrink towards the region's end, and the last load moves one tile."""


def tail_start(comp: list[int], load_cycles: list[int]) -> int:
    """The first step of the tightest weight-streaming tail: the step ``s`` maximizing the compute of the
    steps before it plus the DMA cycles of the constant loads issued from it on (``load_cycles``, per
    step), the first such step on a tie: the bound ``bench/bench_tail_bound.py`` evaluates on a stream,
    here on the steps' own cycle estimates."""
    best, start, before, after = -1, 0, 0, sum(load_cycles)
    for s, (compute, loads) in enumerate(zip(comp, load_cycles)):
        if before + after > best:
            best, start = before + after, s
        before += compute
        after -= loads
    return start


def prefetch_tail(schedule: Schedule, config: NpuConfig) -> None:
    """Deep prefetch for a region that ends in a weight-streaming tail (a classifier at batch 1): as much of
    the tail's constants as SRAM holds is loaded before the tail starts, while the earlier layers' constants
    load just in time.

    The tail's last constants cannot load before SRAM frees, so the makespan is bounded by the compute before
    the tail plus the DMA of its constants, less what is already in SRAM when it starts
    (docs/cycle_model.md). The other policies prefetch in order of use, so the earlier layers' constants,
    loaded far ahead, hold SRAM the tail could use, and a long-lived constant above a map placed high (the
    maps are allocated together with the constants) wastes everything below it. Here the maps (every
    buffer but a constant) are allocated alone, packed low; the earlier layers' constants go just above
    them (lowest first), at most :data:`HEAD_LOOKAHEAD` steps early; the tail's go from the top of SRAM
    down whenever the DMA engine would idle, above what the maps and the earlier layers' constants need over
    the tail constant's lifetime: both allocated together beforehand, each earlier constant live from
    :data:`HEAD_LOOKAHEAD` steps before its issue (so the floor follows what each step holds, not the largest
    maps plus the largest constants of any step). The walk knows when each step's compute ends (the cycle
    model), so it places a load on bytes whose last reader has ended by then, or counts the wait when nothing
    else is free; it hoists nothing that would still be loading when the next step's maps could start to load,
    and it moves runs of a streamed layer's tiles in one DMA command, reserving room for the whole run below
    the first (:meth:`_TailWalk.run_of`; if runs leave a later constant no room, the walk runs again without
    them). A constant load that finds no room at
    its own issue leaves the schedule as the allocation made it (no deep prefetch), as does a tail whose
    constants fit SRAM whole (it streams nothing; the other policies keep such a region low in SRAM)."""
    steps, sram, align = schedule.steps, config.sram_bytes, config.sram_align
    if len(steps) < 3:
        return
    comp = [step_cycles(config, step) for step in steps]
    keys = [(j, k) for j, step in enumerate(steps) for k, load in enumerate(step.loads) if is_constant(load)]
    regular = emitted_at(steps)
    issue = {key: t for t, loads in regular.items() for key in loads}
    cycles = {(j, k): dma_cycles(config, steps[j].loads[k].row_bytes, steps[j].loads[k].rows) for j, k in keys}
    per_step = [0] * len(steps)
    for key, c in cycles.items():
        per_step[issue[key]] += c
    first_tail = tail_start(comp, per_step)
    constants = {id(steps[j].loads[k].sram) for j, k in keys}
    saved = [(b, b.first, b.address) for b in schedule.buffers]
    maps = [b for b in schedule.buffers if id(b) not in constants]
    streams = sum(steps[j].loads[k].sram.size for j, k in keys if j >= first_tail) > sram  # else it fits whole
    moves = None
    if streams and len(constants) == len(keys) and allocate(maps, sram, align) is None:  # one load per buffer
        earlier = [SramBuffer(b.name, b.size, max(0, issue[(j, k)] - HEAD_LOOKAHEAD), b.last)
                   for j, k in keys if j < first_tail for b in [steps[j].loads[k].sram]]
        if allocate(earlier, sram, align, fixed=tuple(maps)) is None:  # what the earlier layers need, per step
            floor = high_water(maps + earlier, len(steps))
            for runs in (True, False):  # runs of tiles hold SRAM a step earlier; without, if that fails
                moves = _TailWalk(config, steps, comp, maps, floor, runs).run(regular, keys, issue, cycles,
                                                                               first_tail)
                if moves is not None:
                    break
    if moves is None:
        for b, first, address in saved:
            b.first, b.address = first, address
        return
    for step, k, t, address in moves:
        buffer = step.loads[k].sram
        buffer.first, buffer.address = t, address
        if t != step.issue:
            step.hoisted[k] = t
        else:
            step.hoisted.pop(k, None)


class _TailWalk:
    """The two engines walked through the steps for :func:`prefetch_tail`, placing every constant."""

    def __init__(self, config: NpuConfig, steps: list[Step], comp: list[int], maps: list, floor: list[int],
                 runs: bool):
        """``floor``: per step, the top of what the maps and the earlier layers' constants need then; ``runs``:
        whether a streamed layer's tiles may share a DMA command."""
        self.config, self.steps, self.comp, self.maps, self.floor, self.runs = config, steps, comp, maps, floor, runs
        self.high = high_water(maps, len(steps))
        self.end = [0] * len(steps)  # each step's compute end, once walked
        self.placed: list[tuple[int, int, int, int]] = []  # (address, size, first step, last step)
        self._reused: dict[int, int] = {}

    def run(self, regular, keys, issue, cycles, first_tail) -> list | None:
        """(step, load index, step it is emitted at, address) of every constant load (``keys``; ``regular``:
        :func:`emitted_at`, ``issue`` its inverse); None when one finds no room at its own issue."""
        steps, config = self.steps, self.config
        constant = set(keys)
        moves, early, done = self.moves, self.early, self.done = [], set(), {}
        self.keys, self.issue, self.cycles = keys, issue, cycles
        self.position = {key: i for i, key in enumerate(keys)}
        dma = compute = 0
        head = 0
        for t in range(len(steps)):
            for j, k in regular.get(t, []):
                if (j, k) in early:
                    continue
                load = steps[j].loads[k]
                if (j, k) in constant:
                    if j >= first_tail:
                        got = self.place_run(t, (j, k), dma, dma, reserve=False, must=True)
                    else:
                        got = self.place(t, load.sram, dma, dma, low=True, reserve=False, must=True)
                    if got is None:
                        return None
                    moves.append((steps[j], k, t, got[0]))
                    start = got[1]
                else:
                    start = max(dma, self.released(load.sram))
                dma = start + dma_cycles(config, load.row_bytes, load.rows)
                done[(j, k)] = dma
                if (j, k) in constant and j >= first_tail:
                    dma = self.run_of(t, (j, k), got[0], dma)
            compute = self.end[t] = max([compute] + [done.get((t, k), 0) for k in range(len(steps[t].loads))]) \
                + self.comp[t]
            while head < len(keys) and issue[keys[head]] <= t + 1:
                head += 1  # emitted at most a step later anyway
            # a load hoisted now runs before the maps the next window loads, so it must end by the time they could
            # start (their bytes' last reader has ended) or the step they feed waits for it
            deadline = max(compute, min([self.released(steps[j].loads[k].sram) for j, k in regular.get(t + 1, [])
                                         if (j, k) not in constant] or [math.inf]))
            for j, k in keys[head:]:
                if dma >= compute or steps[t].opaque:
                    break
                w = issue[(j, k)]
                if (j, k) in early or w <= t + 1 or (j < first_tail and w > t + HEAD_LOOKAHEAD) \
                        or any(steps[u].opaque for u in range(t, w)):
                    continue
                if j >= first_tail:
                    got = self.place_run(t, (j, k), dma, compute, reserve=True, must=False,
                                         latest=deadline - cycles[(j, k)])
                else:
                    got = self.place(t, steps[j].loads[k].sram, dma, compute, low=True, reserve=False, must=False,
                                     latest=deadline - cycles[(j, k)])
                if got is None:
                    continue
                dma = got[1] + cycles[(j, k)]
                done[(j, k)] = dma
                early.add((j, k))
                moves.append((steps[j], k, t, got[0]))
                if j >= first_tail:
                    dma = self.run_of(t, (j, k), got[0], dma)
            for store in steps[t].stores:
                dma = max(dma, compute) + dma_cycles(config, store.row_bytes, store.rows)
        return moves

    def released(self, buffer) -> int:
        """When the compute that last read the bytes of a map buffer before it was live has ended (0: none)."""
        if id(buffer) not in self._reused:
            before = [b.last for b in self.maps if b is not buffer and b.last < buffer.first
                      and b.address < buffer.address + buffer.size and buffer.address < b.address + b.size]
            self._reused[id(buffer)] = self.end[max(before)] if before else 0
        return self._reused[id(buffer)]

    def follower(self, t: int, key, computed: int = 0):
        """The tail constant that may join ``key``'s DMA command during step ``t`` (None if none): the next
        tile of the same layer, not yet placed, whose compute together with the run's so far (``computed``
        cycles) ends before the DMA engine has loaded every constant not yet placed (after the last load, only
        the compute of what it loaded is left; the region's last constant is never in a run). It lies just
        below ``key`` in DRAM (:func:`npu_backend.codegen.steps.tile_offset`), so it must go just below it in
        SRAM."""
        keys, issue, i = self.keys, self.issue, self.position[key]
        if not self.runs or i + 2 >= len(keys):
            return None
        other_key = keys[i + 1]
        load, other = self.steps[key[0]].loads[key[1]], self.steps[other_key[0]].loads[other_key[1]]
        w = issue[other_key]
        if other_key in self.early or w <= t or other.buffer != load.buffer or load.rows != 1 or other.rows != 1 \
                or other.offset + other.row_bytes != load.offset or any(self.steps[u].opaque for u in range(t, w)):
            return None
        if computed + self.comp[other_key[0]] > sum(self.cycles[k] for k in keys[i + 2:] if k not in self.early):
            return None  # the run's tiles would still be computing when the DMA engine has nothing left to load
        return other_key

    def place_run(self, t: int, key, now: int, horizon: int, reserve: bool, must: bool,
                  latest: float = math.inf) -> tuple[int, int] | None:
        """:meth:`place` for the tail constant ``key``, with room kept just below it for the tiles that may
        follow it in one command (:meth:`follower`), as many of them as fit: otherwise the first tile often lands
        where the next one's bytes are still in use, and every tile pays its own latency."""
        buffer = self.steps[key[0]].loads[key[1]].sram
        run, last = [], key
        computed = self.comp[key[0]]
        while len(run) < RUN_TILES - 1 and (last := self.follower(t, last, computed)) is not None:
            run.append(self.steps[last[0]].loads[last[1]])
            computed += self.comp[last[0]]
        while run:
            below = sum(load.row_bytes for load in run)
            whole = SramBuffer(buffer.name, buffer.size + below, t, max([buffer.last] + [ld.sram.last for ld in run]))
            got = self.place(t, whole, now, horizon, low=False, reserve=reserve, must=False, latest=latest)
            if got is not None:
                self.placed.pop()  # only reserved: the tiles are placed one by one
                got = self.place(t, buffer, now, horizon, low=False, reserve=reserve, must=False, latest=latest,
                                 at=got[0] + below)
                if got is not None:
                    return got
            run.pop()
        return self.place(t, buffer, now, horizon, low=False, reserve=reserve, must=must, latest=latest)

    def run_of(self, t: int, key, address: int, dma: int) -> int:
        """Emit with the tail constant ``key``, just placed at ``address`` during step ``t``, the tiles that follow
        it (:meth:`follower`) as one DMA command (:func:`npu_backend.codegen.emitter.coalesced`), each just below
        the one before it, while those bytes are free from ``t`` on. A layer that streams its weights at the DMA's
        pace then pays one latency per run. The command ends when its last tile has arrived, so that is when
        every tile of it is ready. ``dma``: when the DMA engine is free; returns when it is free again."""
        members = [key]
        while len(members) < RUN_TILES and (other_key := self.follower(
                t, key, sum(self.comp[m[0]] for m in members))) is not None:
            other = self.steps[other_key[0]].loads[other_key[1]]
            got = self.place(t, other.sram, dma, dma, low=False, reserve=False, must=False,
                             at=address - other.row_bytes)
            if got is None:
                break
            self.early.add(other_key)
            self.moves.append((self.steps[other_key[0]], other_key[1], t, got[0]))
            dma = max(dma, got[1]) + self.cycles[other_key] - self.config.dram_latency_cycles  # one latency
            key, address = other_key, got[0]
            members.append(key)
        for member in members:
            self.done[member] = dma
        return dma

    def place(self, t: int, buffer, now: int, horizon: int, low: bool, reserve: bool,
              must: bool, at: int | None = None, latest: float = math.inf) -> tuple[int, int] | None:
        """(address, when its load can start) for ``buffer`` held from step ``t`` to its last use, lowest or
        highest first (or at ``at`` alone); bytes whose last reader ends after ``horizon`` count as taken
        (``must``: else as free, and the load waits for them). ``now``: when the DMA engine is free;
        ``reserve``: stay above what the earlier layers need (the walk's ``floor``); ``latest``: None if the
        load could not start by then."""
        end, high, last, size = self.end, self.high, buffer.last, buffer.size
        fit = _lowest if low else _highest
        u = t - 1
        while u >= 0 and end[u] > horizon:
            u -= 1
        taken = [p for p in self.placed if (p[3] >= t and p[2] <= last) or (p[3] < t and end[p[3]] > horizon)]
        floor = max((self.floor if reserve else high)[u + 1:last + 1])
        if at is not None:
            clear = at >= align_up(floor, self.config.sram_align) and at + size <= self.config.sram_bytes \
                and all(other + other_size <= at or at + size <= other for other, other_size, *_ in taken)
            address = at if clear else None
        else:
            address = fit(self.config, taken, floor, size)
        if address is None and must:
            taken = [p for p in self.placed if p[3] >= t and p[2] <= last]
            address = fit(self.config, taken, max(high[t:last + 1]), size)
        if address is None:
            return None
        start = now
        for other, other_size, _, other_last in self.placed:
            if other_last < t and end[other_last] > start and other < address + size and address < other + other_size:
                start = end[other_last]
        for u in range(t - 1, -1, -1):
            if end[u] <= now:
                break
            if high[u] > address:
                start = max(start, end[u])
        if start > latest:
            return None
        self.placed.append((address, size, t, last))
        return address, start


PREFETCH_POLICIES = {"repack": prefetch_repacked, "above": prefetch_above, "tail": prefetch_tail}
"""Deep-prefetch policies by name (:class:`npu_backend.codegen.schedule.ScheduleOptions`)."""
