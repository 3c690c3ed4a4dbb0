"""The region scheduler: where every feature map lives, in what order tiles run, what is prefetched.

It owns one SRAM allocator (:mod:`npu_backend.codegen.allocate`) for all the layers of a region and turns
the layers' tile programs (:mod:`npu_backend.codegen.programs`) into *steps*
(:mod:`npu_backend.codegen.steps`): one compute command each, with the DMA loads that must land before it
and the DMA stores that follow it. The emitter (:mod:`npu_backend.codegen.emitter`) writes the steps as
commands; the dependencies follow from the SRAM addresses chosen here (:func:`simulator.hazards.dependencies`).

The strategy, and every decision of it, is here (and deep prefetch in :mod:`npu_backend.codegen.prefetch`):

- **Residency.** A feature map produced and consumed by layers with row programs stays whole in SRAM
  from its producer to its last consumer. DRAM holds region inputs and outputs, the operands of layers
  without a row program, and spills.
- **Cascading.** A map larger than a third of SRAM is not kept whole: its producer and consumers form a
  *group* run stripe by stripe (rows of the group's last layer), each layer computing the rows its
  consumers' windows need in that stripe (rows shared by two stripes' windows are recomputed). A residual
  addition that consumes the group's last output joins the group.
- **The region's first layer**, when it streams its input from DRAM in stripes, starts with a short stripe
  (nothing can compute before it has loaded) and grows them while each still loads during the one before it.
- **Channel tiles.** A convolution or fully connected layer whose constants exceed a quarter of SRAM runs
  in output-channel tiles whose weights stream in turn; a per-channel layer that alone reads it (depthwise,
  pooling, mean) runs each tile right after it from SRAM. A channel-tiled map goes to DRAM (strided per
  tile) unless it is one pixel.
- **Prefetch.** A step's loads are emitted during the previous step, into buffers live at both steps,
  hence at distinct addresses: the DMA engine fills the next stripe while the compute engine works on this
  one. A tile's weights load during the previous tile; constants load earlier still where the DMA engine
  would idle (deep prefetch).
- **When SRAM runs out** (the allocation fails at some step), the scheduler halves that step's group's
  stripes (down to a few rows where halos are recomputed), spills the largest map kept whole across that
  step, spills a cascaded map when moving it through DRAM hides behind the cascade's compute, then
  halves stripes and channel tiles further; once everything fits it makes each cut stripe as tall as still
  fits. If nothing helps it raises :class:`ScheduleError` and the region is lowered layer by layer through
  DRAM.
- **Variants** the cycle model arbitrates (:data:`SCHEDULE_VARIANTS`): the lowering schedules a region with
  each and keeps the stream with the shortest makespan. They differ in the deep-prefetch policy, in whether a
  group's first constants load early, and in the tiles of layers whose weight traffic outlasts their compute
  (:data:`STREAMED_TILE_FRACTION`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from simulator.config import NpuConfig
from simulator.opcodes import opcode_def

from .allocate import SramBuffer, align_up, allocate
from .prefetch import PREFETCH_POLICIES, dma_cycles
from .programs import MacProgram, MeanProgram, Operand, PoolProgram, Window, channel_tile, tiles
from .steps import (ConstantsOf, Layer, Load, Schedule, ScheduleError, Slice, Step, Store, Value, constant_layout,
                    is_constant, scratch_id, tile_offset)

STREAM_FRACTION = 3
"""A map larger than ``sram_bytes / STREAM_FRACTION`` is cascaded rather than kept whole."""

TILE_FRACTION = 4
"""A layer whose constants exceed ``sram_bytes / TILE_FRACTION`` runs in output-channel tiles ..."""

TILE_BUDGET_FRACTION = 6
"""... each tile's constants at most ``sram_bytes / TILE_BUDGET_FRACTION``, so two fit while one computes ..."""

STREAMED_TILE_FRACTION = 12
"""... or ``sram_bytes / STREAMED_TILE_FRACTION`` for a layer whose constants take the DMA engine longer to move
than the layer takes to compute (a fully connected layer at batch 1, a 1x1 convolution on a small map). Such a
layer runs at the DMA's pace whatever its tiles, so smaller ones cost only a DMA latency each and gain twice:
more of them fit the SRAM left free by earlier layers (deep prefetch), and the compute left after the last
load (the region's tail) is a smaller tile's."""

MIN_STRIPE_ROWS = 8
"""Stripes are halved down to this many rows before a map is spilled to make room (shorter stripes
recompute a larger share of their rows)."""

SPILL_HIDE_FRACTION = 2
"""A cascaded map is spilled instead of cut in shorter stripes when moving it out and back takes the DMA
engine at most ``1 / SPILL_HIDE_FRACTION`` of the cascade's compute cycles (so it hides behind them)."""


DRAM_STRIPES = 4
"""A lone layer that reads or writes a map in DRAM runs in at least this many stripes, so that the DMA engine
moves one stripe while the compute engine works on another ..."""

OVERLAP_LATENCIES = 16
"""... when the maps it moves take at least this many DMA latencies to move, and the DMA cycles the stripes
hide exceed what they add (each stripe's issue and per-fold fill, a latency per extra load and store): a small
layer runs whole, as does any layer on an array whose every command refills it (``fold_fill_cycles``)."""

MAX_ATTEMPTS = 400


@dataclass
class Strategy:
    """The scheduler's decisions; each retry changes one of them. Groups and residency follow from them
    (:meth:`RegionScheduler._derive`)."""

    tile: dict[int, int]
    """Layer -> output channels per tile (layers split by channels)."""
    stripe: dict[int, int] = field(default_factory=dict)
    """First layer of a group -> output rows of its last layer per stripe (absent: all rows)."""
    no_stream: set[int] = field(default_factory=set)
    """Large maps spilled to DRAM rather than cascaded."""
    spilled: set[int] = field(default_factory=set)
    """Maps spilled to DRAM rather than kept whole in SRAM."""
    groups: list[list[int]] = field(default_factory=list)
    resident: set[int] = field(default_factory=set)
    too_tall: dict[int, int] = field(default_factory=dict)
    """First layer of a group -> the shortest stripe (rows) found not to fit."""


@dataclass(frozen=True)
class ScheduleOptions:
    """Choices the cycle model arbitrates: the lowering schedules a region with each of
    ``SCHEDULE_VARIANTS`` and keeps the stream with the shortest makespan (their effects on SRAM pressure,
    hence on stripes and spills, are too entangled to predict). ``growing_stripes`` is a switch instead: on in
    every variant, off where only values are wanted."""

    prefetch: str = "repack"
    """Deep-prefetch policy, a key of ``PREFETCH_POLICIES``."""
    early_constants: bool = False
    """A group's first steps load their constants a step early even when their input rows must wait for a
    store (more overlap, more SRAM held)."""
    streamed_tiles: bool = False
    """Layers whose constants take longer to move than to compute run in smaller channel tiles
    (:data:`STREAMED_TILE_FRACTION`)."""
    growing_stripes: bool = True
    """The region's first layer, striped because it streams its input from DRAM, may start with short stripes
    that grow (:meth:`RegionScheduler._growing`) when that ends it sooner. A choice of cycles alone, and the
    scheduler's costliest search (tens of milliseconds for a large first layer): a caller that needs only the
    values (``lower_graph(serial=True)``) leaves it out and gets uniform stripes."""
    packed_records: bool = True
    """MAC layers' scale/bias tables in 9-byte records where their rounding allows (a quarter fewer bytes to
    move and hold; format 2.5), else 12-byte ones. Fewer bytes are not always a shorter makespan: the
    prefetch heuristics place differently around them, so the lowering tries the winning variant with
    12-byte records too (:func:`npu_backend.codegen.graph.lower_graph`)."""


class RegionScheduler:
    """Schedules one region's layers (in program order) on ``config``."""

    def __init__(self, config: NpuConfig, values: list[Value], layers: list[Layer],
                 options: ScheduleOptions = ScheduleOptions()):
        self.config, self.values, self.layers, self.options = config, values, layers, options
        self._planned: Strategy | None = None
        self._estimates: dict[tuple, int] = {}  # (kind, layer, first row, stop row) -> compute or load cycles
        self._grown: dict[tuple[int, bool], list[int]] = {}  # (rows, whether it stores) -> the first layer's stripes

    # ---- decisions -------------------------------------------------------------------------------------

    def _row(self, layer: int) -> bool:
        return self.layers[layer].program is not None

    def _initial(self) -> Strategy:
        sram = self.config.sram_bytes
        tile = {}
        for layer in self.layers:
            program = layer.program
            if program is not None and program.splits_channels:
                const = sum(len(c.data) for c in program.constants)
                if const > sram // TILE_FRACTION:
                    streamed = (self.options.streamed_tiles
                                and dma_cycles(self.config, const, 1) > self._compute_estimate(layer))
                    budget = sram // (STREAMED_TILE_FRACTION if streamed else TILE_BUDGET_FRACTION)
                    ct = channel_tile(program, budget, self.config.mac_rows)
                    if ct < program.out.channels:
                        tile[layer.index] = ct
        return Strategy(tile)

    def _derive(self, strategy: Strategy) -> None:
        """Groups (cascades of the large maps not spilled) and the maps kept whole, from the decisions."""
        sram, tile = self.config.sram_bytes, strategy.tile
        streamable = lambda i: self._row(i) and i not in tile  # noqa: E731
        spans: list[list[int]] = []
        for v in self.values:
            if v.producer is None or not v.consumers or v.nbytes * STREAM_FRACTION <= sram \
                    or v.index in strategy.no_stream:
                continue
            span = range(v.producer, max(v.consumers) + 1)
            if all(streamable(i) for i in span) and all(self.values[self.layers[i].dst].shape for i in span):
                spans.append([span.start, span.stop - 1])
        spans.sort()
        merged: list[list[int]] = []
        for first, last in spans:
            if merged and first <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], last)
            else:
                merged.append([first, last])
        for span in merged:  # a residual addition of the group's last map joins the group
            nxt = span[1] + 1
            if nxt < len(self.layers) and streamable(nxt) and self.layers[nxt].program.halo_free \
                    and self.layers[span[1]].dst in self.layers[nxt].sources \
                    and self.values[self.layers[span[1]].dst].consumers == [nxt]:
                span[1] = nxt
        for i in sorted(tile):  # a channel-tiled layer and the per-channel layer that alone reads it
            if self._follower(i, tile) is not None:
                merged.append([i, i + 1])
        grouped = {i for first, last in merged for i in range(first, last + 1)}
        groups = [list(range(first, last + 1)) for first, last in merged]
        groups += [[layer.index] for layer in self.layers if layer.index not in grouped]
        groups.sort()
        group_of = {i: g for g, members in enumerate(groups) for i in members}
        resident = set()
        for v in self.values:
            if v.producer is None or not self._row(v.producer) or v.shape is None or v.index in strategy.spilled:
                continue
            if self._blocked(v.producer, strategy) and v.shape.height * v.shape.width != 1:
                continue
            outside = [c for c in v.consumers if group_of[c] != group_of[v.producer]]
            if outside and all(self._row(c) for c in v.consumers):
                resident.add(v.index)
        strategy.groups, strategy.resident = groups, resident

    def _follower(self, layer: int, tile: dict[int, int]) -> int | None:
        """The layer that runs each channel tile of ``layer`` right after it: the next layer, when it alone
        reads ``layer``'s map, works channel by channel (depthwise without channel multiplier, pooling, mean),
        is not split itself and its own map is not one to cascade (it would then lead a group of its own)."""
        nxt = layer + 1
        own = self.values[self.layers[nxt].dst] if nxt < len(self.layers) else None
        if own is None or nxt in tile or not self._row(nxt) \
                or (own.consumers and own.nbytes * STREAM_FRACTION > self.config.sram_bytes):
            return None
        program = self.layers[nxt].program
        v = self.values[self.layers[layer].dst]
        per_channel = isinstance(program, (PoolProgram, MeanProgram)) or (
            isinstance(program, MacProgram) and program.g.depthwise and program.g.multiplier == 1)
        if not per_channel or v.consumers != [nxt] or self.layers[nxt].sources != [v.index] or v.fixed_dram:
            return None
        return nxt

    def _blocked(self, layer: int, strategy: Strategy) -> bool:
        """Whether ``layer`` writes its map channel tile by channel tile (so not as NHWC rows in SRAM)."""
        return layer in strategy.tile or any(self._follower(i, strategy.tile) == layer for i in strategy.tile)

    def _rows(self, strategy: Strategy, members: list[int]) -> int:
        last = self.layers[members[-1]]
        if last.program is None:
            return 1
        height = last.program.out.height
        if members[0] not in strategy.stripe and len(members) == 1:
            moved = [self.values[s] for s in last.sources if s is not None] + [self.values[last.dst]]
            dram_bytes = sum(v.nbytes for v in moved if v.dram is not None and v.index not in strategy.resident)
            if dram_bytes >= OVERLAP_LATENCIES * self.config.dram_latency_cycles * self.config.dram_bytes_per_cycle:
                # stripes let its loads and stores overlap its compute; each streams enough pixels to fill a fold
                least = -(-2 * self.config.mac_cols // last.program.out.width)
                rows = min(height, max(least, -(-height // DRAM_STRIPES)))
                count = -(-height // rows)
                # ... when the DMA they hide outweighs what cutting adds: each stripe's fixed costs (issue,
                # the array's fill per fold) and a latency for each extra load and store
                hidden = dma_cycles(self.config, dram_bytes, 1) * (count - 1) // count
                added = (sum(self._compute_estimate(last, r0, min(height, r0 + rows)) for r0 in range(0, height, rows))
                         - self._compute_estimate(last) + 2 * (count - 1) * self.config.dram_latency_cycles)
                if hidden > added:
                    return rows
        return strategy.stripe.get(members[0], height)

    def _stops(self, strategy: Strategy, members: list[int]) -> list[int]:
        """Where each stripe of the group's last layer ends (its output rows): every ``_rows`` rows, except that
        the region's first layer, striped because it streams its input from DRAM, starts with short stripes that
        grow (:meth:`_growing`)."""
        rows = self._rows(strategy, members)
        height = self.layers[members[-1]].program.out.height
        uniform = list(range(rows, height, rows)) + [height]
        if members != [0] or not 2 <= rows < height or 0 in strategy.stripe or not self.options.growing_stripes:
            return uniform
        return min(self._growing(strategy, rows), uniform, key=lambda ends: (self._first_layer_end(strategy, ends),
                                                                           len(ends)))

    def _growing(self, strategy: Strategy, rows: int) -> list[int]:
        """Stripe ends for the region's first layer: nothing computes before its first stripe has loaded, so that
        stripe is short, and each next one as tall (up to ``rows``) as still loads while the one before it computes,
        so the compute engine need not wait again; of every first height, the one that ends the layer earliest
        (:meth:`_first_layer_end`), the fewer stripes on a tie."""
        layer = self.layers[0]
        height = layer.program.out.height
        key = (rows, self._stores_rows(strategy) > 0)
        if key in self._grown:
            return self._grown[key]
        candidates = []
        for first in range(1, rows):
            ends = [first]
            while ends[-1] < height:
                computed = self._compute_estimate(layer, ends[-2] if len(ends) > 1 else 0, ends[-1])
                fits = lambda r: self._load_estimate(layer, ends[-1], min(height, ends[-1] + r)) <= computed  # noqa
                grow = bisect.bisect_left(range(1, rows + 1), True, key=lambda r: not fits(r))  # loads grow with r
                ends.append(min(height, ends[-1] + max(grow, 1)))
            candidates.append(ends)
        self._grown[key] = min(candidates, key=lambda ends: (self._first_layer_end(strategy, ends), len(ends)))
        return self._grown[key]

    def _stores_rows(self, strategy: Strategy) -> int:
        """Bytes per output row the region's first layer stores to DRAM (0: its map stays in SRAM)."""
        v = self.values[self.layers[0].dst]
        return v.shape.row_bytes if v.dram is not None and v.index not in strategy.resident else 0

    def _load_estimate(self, layer: Layer, first: int, stop: int) -> int:
        """DMA cycles of loading the input rows the output rows ``[first, stop)`` of ``layer`` read (one
        contiguous load per DRAM source)."""
        key = ("load", layer.index, first, stop)
        if key not in self._estimates:
            total = 0
            for operand, s in enumerate(x for x in layer.sources if x is not None):
                v = self.values[s]
                if v.dram is not None:
                    w = layer.program.window(operand, first, stop)
                    total += dma_cycles(self.config, (w.stop - w.start) * v.shape.row_bytes, 1)
            self._estimates[key] = total
        return self._estimates[key]

    def _first_layer_end(self, strategy: Strategy, stops: list[int]) -> int:
        """When the region's first layer ends with these stripes, in the order the emitter queues them: its
        constants and first stripe's rows load; each stripe computes once its rows have loaded and the stripe
        before it has computed, while the next stripe's rows load; its rows go to DRAM after it computes, if its
        map lives there."""
        layer = self.layers[0]
        row_bytes = self._stores_rows(strategy)
        dma = sum(dma_cycles(self.config, len(c.data), 1) for c in layer.program.constants)
        bounds = list(zip([0] + stops[:-1], stops))
        dma += self._load_estimate(layer, *bounds[0])
        ready, done = dma, 0
        for k, (start, stop) in enumerate(bounds):
            if k + 1 < len(bounds):
                dma += self._load_estimate(layer, *bounds[k + 1])
            done = max(done, ready) + self._compute_estimate(layer, start, stop)
            ready = dma
            if row_bytes:
                dma = max(dma, done) + dma_cycles(self.config, (stop - start) * row_bytes, 1)
        return max(done, dma)

    def _compute_estimate(self, layer: Layer, first: int = 0, stop: int | None = None) -> int:
        """Cycles of output rows ``[first, stop)`` of the layer (all of them by default) as one command (the cycle
        model's figure; addresses do not matter)."""
        program = layer.program
        stop = program.out.height if stop is None else stop
        key = ("compute", layer.index, first, stop)
        if key not in self._estimates:
            ifms = [Operand(0, program.window(i, first, stop)) for i in range(len(program.inputs))]
            command = program.command(layer.name, first, stop, 0, program.out.channels, ifms, 0,
                                      [0] * len(program.constants))
            self._estimates[key] = opcode_def(command.opcode).cost(command.opcode, command.payload, self.config).cycles
        return self._estimates[key]

    def _relieve(self, strategy: Strategy, schedule: Schedule, failed: SramBuffer) -> bool:
        """Change one decision to make room at the step where ``failed`` did not fit; False if none helps."""
        step = failed.first
        layer = schedule.steps[step].layer.index
        members = next(m for m in strategy.groups if layer in m)
        rows = self._rows(strategy, members)
        streamed = [self.layers[i].dst for i in members[:-1]
                    if self.values[self.layers[i].dst].nbytes * STREAM_FRACTION > self.config.sram_bytes]
        haloed = [v for v in streamed if any(c in members and not self.layers[c].program.halo_free
                                             for c in self.values[v].consumers)]
        least = MIN_STRIPE_ROWS if haloed else 1  # without halos, short stripes recompute nothing
        if rows > least:
            strategy.stripe[members[0]] = max(least, -(-rows // 2))
            strategy.too_tall[members[0]] = min(strategy.too_tall.get(members[0], rows), rows)
            return True
        live = [v for v in sorted(strategy.resident)
                if self._full[v].first <= step <= self._full[v].last]
        if live:
            strategy.spilled.add(max(live, key=lambda v: (self.values[v].nbytes, -v)))
            return True
        if haloed:  # spilling a cascaded map costs DMA the compute can hide; recomputing halos costs compute
            victim = max(haloed, key=lambda v: (self.values[v].nbytes, -v))
            dma = 2 * self.values[victim].nbytes / self.config.dram_bytes_per_cycle
            compute = sum(self._compute_estimate(self.layers[i]) for i in members)
            if dma * SPILL_HIDE_FRACTION <= compute:
                strategy.no_stream.add(victim)
                return True
        if rows > 1:
            strategy.stripe[members[0]] = -(-rows // 2)
            return True
        if members[0] in strategy.tile:
            layer = members[0]
        program = self.layers[layer].program
        if program is not None and program.splits_channels and (len(members) == 1 or layer in strategy.tile):
            ct = strategy.tile.get(layer, program.out.channels)
            if ct > 1:
                strategy.tile[layer] = max(1, ct // 2)
                return True
        return False

    def plan(self) -> Strategy:
        """The decisions (groups, stripes, residency, spills, tiles) under which every step fits, found once:
        relieve the SRAM where the allocation fails, then make the stripes as tall as still fits."""
        if self._planned is None:
            strategy = self._initial()
            for _ in range(MAX_ATTEMPTS):
                schedule = self._build(strategy)
                failed = allocate(schedule.buffers, self.config.sram_bytes, self.config.sram_align)
                if failed is None:
                    self._taller(strategy, schedule)
                    self._planned = strategy
                    break
                if not self._relieve(strategy, schedule, failed):
                    break
            if self._planned is None:
                raise ScheduleError(f"the region's layers do not fit the {self.config.sram_bytes}-byte SRAM "
                                    "together")
        return self._planned

    def run(self) -> Schedule:
        """The steps of the planned decisions, allocated, with constants prefetched by ``options.prefetch``."""
        schedule = self._build(self.plan())
        if allocate(schedule.buffers, self.config.sram_bytes, self.config.sram_align) is not None:
            raise ScheduleError("a planned schedule no longer fits")  # cannot happen: the plan fitted
        PREFETCH_POLICIES[self.options.prefetch](schedule, self.config)
        return schedule

    def _taller(self, strategy: Strategy, schedule: Schedule) -> Schedule:
        """Halving overshoots: for each group whose stripes were cut, binary-search the tallest stripe between
        what fits and what did not (taller stripes recompute fewer halo rows), the rest unchanged."""
        for first, too_tall in sorted(strategy.too_tall.items()):
            low, high = strategy.stripe.get(first, too_tall), too_tall - 1
            while low < high:
                middle = (low + high + 1) // 2
                strategy.stripe[first] = middle
                trial = self._build(strategy)
                if allocate(trial.buffers, self.config.sram_bytes, self.config.sram_align) is None:
                    low, schedule = middle, trial
                else:
                    high = middle - 1
            strategy.stripe[first] = low
        if strategy.too_tall:  # the last build tried may not be the one kept: rebuild what was decided
            schedule = self._build(strategy)
            if allocate(schedule.buffers, self.config.sram_bytes, self.config.sram_align) is not None:
                raise ScheduleError("a decided schedule no longer fits")  # cannot happen: it fitted
        return schedule

    # ---- steps -----------------------------------------------------------------------------------------

    def _needs_dram(self, v: Value, strategy: Strategy, group_of: dict[int, int]) -> bool:
        if v.fixed_dram:
            return True
        if v.producer is None or not self._row(v.producer):
            return True
        if v.producer in strategy.tile and self._follower(v.producer, strategy.tile) is not None:
            return False  # its follower reads each tile from SRAM
        if self._blocked(v.producer, strategy) and v.shape.height * v.shape.width != 1:
            return True
        if any(not self._row(c) for c in v.consumers):
            return True
        if v.index in strategy.resident:
            return False
        return any(group_of[c] != group_of[v.producer] for c in v.consumers)

    def _build(self, strategy: Strategy) -> Schedule:
        self._derive(strategy)
        self._tile_of = dict(strategy.tile)
        for i, ct in strategy.tile.items():
            follower = self._follower(i, strategy.tile)
            if follower is not None:
                self._tile_of[follower] = ct
        group_of = {i: g for g, members in enumerate(strategy.groups) for i in members}
        scratch = []
        for v in self.values:
            if not v.fixed_dram:
                v.dram = None
                if self._needs_dram(v, strategy, group_of):
                    scratch.append(v.index)
                    v.dram = scratch_id(v.index)
        self.steps: list[Step] = []
        self.buffers: list[SramBuffer] = []
        self._full = {}
        for v in sorted(strategy.resident):
            self._full[v] = self._buffer(f"{self.values[v].name}.whole", self.values[v].nbytes)
        for g, members in enumerate(strategy.groups):
            first = self.layers[members[0]]
            if first.program is None:
                self._opaque(first)
            elif first.index in strategy.tile:
                follower = self.layers[members[1]] if len(members) == 2 else None
                self._tiled(first, strategy.tile[first.index], strategy, follower)
            else:
                self._group(members, self._stops(strategy, members), strategy)
        self._finish()
        return Schedule(self.steps, self.buffers, scratch)

    def _buffer(self, name: str, size: int) -> SramBuffer:
        buffer = SramBuffer(name, align_up(max(1, size), self.config.sram_align))
        self.buffers.append(buffer)
        return buffer

    def _step(self, step: Step) -> int:
        index = len(self.steps)
        early = index > 0 and not self.steps[-1].opaque and not step.opaque and not (
            {load.buffer for load in step.loads} & {store.buffer for store in self.steps[-1].stores})
        step.issue = index - 1 if early else index  # a load never overtakes the store of the rows it reads
        self.steps.append(step)
        return index

    def _finish(self) -> None:
        """Live intervals from what each step touches: loads from their issue step, stores one step past
        theirs when a compute step follows (the store runs while that step computes)."""
        for j, step in enumerate(self.steps):
            for k, load in enumerate(step.loads):
                load.sram.live_at(step.hoisted.get(k, step.issue))
                load.sram.live_at(j)
            for s, _ in step.ifms:
                s.sram.live_at(j)
            for s in step.constants:
                s.sram.live_at(j)
            if step.ofm is not None:
                step.ofm.sram.live_at(j)
            for store in step.stores:
                store.sram.live_at(j)
                if j + 1 < len(self.steps) and not self.steps[j + 1].opaque:
                    store.sram.live_at(j + 1)
            if step.opaque:
                whole = SramBuffer(f"{step.layer.name}.sram", self.config.sram_bytes)
                whole.live_at(j)
                self.buffers.append(whole)

    def _opaque(self, layer: Layer) -> None:
        self._step(Step(layer, opaque=True))

    def _constants(self, layer: Layer, c0: int, ct: int) -> tuple[list[Slice], list[Load]]:
        """One SRAM buffer and one load for a tile's constants, packed as :func:`packed_constants` lays them
        out in DRAM (weights, then the scale/bias table, each aligned)."""
        if not layer.program.constants:
            return [], []
        tile = self._tile_of.get(layer.index, layer.program.out.channels)
        offsets, size = constant_layout(layer.program, ct, self.config.sram_align)
        sram = self._buffer(f"{layer.name}.constants{c0}", size)
        load = Load(ConstantsOf(layer.index, tile), tile_offset(layer.program, tile, c0, self.config.sram_align),
                    sram, 0, size)
        return [Slice(sram, offset) for offset in offsets], [load]

    def _group(self, members: list[int], ends: list[int], strategy: Strategy) -> None:
        """Stripes of the last member's output rows ending at ``ends``; each member computes what its consumers
        in the group read in that stripe, plus its share of what others read later."""
        inside = set(members)
        last = self.layers[members[-1]]
        count = len(ends)
        done = {i: 0 for i in members}
        constants: dict[int, list[Slice]] = {}
        for k in range(count):
            ranges: dict[int, tuple[int, int]] = {}
            for i in reversed(members):
                layer = self.layers[i]
                v = self.values[layer.dst]
                h = layer.program.out.height
                if i == last.index:
                    ranges[i] = (done[i], ends[k])
                    continue
                starts, stops = [], []
                for c in v.consumers:
                    if c in inside and c in ranges and ranges[c][0] < ranges[c][1]:
                        for operand, s in enumerate(self.layers[c].sources):
                            if s == v.index:
                                w = self.layers[c].program.window(self._operand(c, operand), *ranges[c])
                                starts.append(w.start)
                                stops.append(w.stop)
                external = v.index in strategy.resident or v.dram is not None
                if external:
                    stops.append(h if k == count - 1 else -(-h * (k + 1) // count))
                stop = max([done[i]] + stops)
                if v.index in strategy.resident or not starts:
                    start = done[i]
                else:
                    start = min(starts) if v.dram is None else min(min(starts), done[i])
                ranges[i] = (start, stop)
            loaded: dict[int, tuple[Slice, int]] = {}
            produced: dict[int, tuple[Slice, int]] = {}
            for i in members:
                start, stop = ranges[i]
                if start >= stop:
                    continue
                layer = self.layers[i]
                step = Step(layer, (start, stop), (0, layer.program.out.channels))
                if i not in constants:
                    constants[i], loads = self._constants(layer, 0, layer.program.out.channels)
                    step.loads += loads
                step.constants = constants[i]
                for operand, s in enumerate(x for x in layer.sources if x is not None):
                    w = layer.program.window(operand, start, stop)
                    step.ifms.append((self._source(s, w, k, inside, ranges, loaded, produced, step, strategy), w))
                v = self.values[layer.dst]
                rb = v.shape.row_bytes
                if v.index in strategy.resident:
                    step.ofm = Slice(self._full[v.index], start * rb)
                else:
                    step.ofm = Slice(self._buffer(f"{v.name}.rows{start}", (stop - start) * rb))
                produced[v.index] = (step.ofm, start)
                if v.dram is not None and stop > done[i]:
                    new = max(start, done[i])
                    step.stores.append(Store(step.ofm.sram, step.ofm.offset + (new - start) * rb, v.dram,
                                             new * rb, (stop - new) * rb))
                done[i] = stop
                index = self._step(step)
                if self.options.early_constants and k == 0 and step.issue == index and index \
                        and not self.steps[index - 1].opaque:
                    step.hoisted.update({n: index - 1 for n, load in enumerate(step.loads)
                                         if is_constant(load)})  # constants need not wait for the input

    def _operand(self, consumer: int, source_position: int) -> int:
        """Index among the layer's non-constant inputs of its ``source_position``-th source."""
        sources = self.layers[consumer].sources
        return sum(1 for s in sources[:source_position] if s is not None)

    def _source(self, s: int, w: Window, k: int, inside: set[int], ranges, loaded, produced, step: Step,
                strategy: Strategy) -> Slice:
        v = self.values[s]
        rb = v.shape.row_bytes
        if s in strategy.resident:
            return Slice(self._full[s], w.start * rb)
        if v.producer is not None and v.producer in inside:
            sl, start = produced[s]
            return Slice(sl.sram, sl.offset + (w.start - start) * rb)
        if s not in loaded:  # rows every consumer in the group reads from DRAM in this stripe, loaded once
            first, stop = w.start, w.stop
            for c in v.consumers:
                if c in inside and c in ranges and ranges[c][0] < ranges[c][1]:
                    for operand, src in enumerate(self.layers[c].sources):
                        if src == s:
                            cw = self.layers[c].program.window(self._operand(c, operand), *ranges[c])
                            first, stop = min(first, cw.start), max(stop, cw.stop)
            sram = self._buffer(f"{v.name}.in{first}", (stop - first) * rb)
            step.loads.append(Load(v.dram, first * rb, sram, 0, (stop - first) * rb))
            loaded[s] = (Slice(sram), first)
        sl, first = loaded[s]
        return Slice(sl.sram, (w.start - first) * rb)

    def _tiled(self, layer: Layer, ct: int, strategy: Strategy, follower: Layer | None = None) -> None:
        """Output-channel tiles (weights streamed tile by tile), all rows of a tile before the next. A
        ``follower`` (a per-channel layer, the only consumer) runs each tile right after it, from SRAM. When
        the input comes from DRAM, the first tile runs in two row stripes, so that it starts once the first
        rows have landed rather than the whole map."""
        program = layer.program
        (s,) = [x for x in layer.sources if x is not None]
        source = self.values[s]
        rb_in = source.shape.row_bytes
        last = follower or layer
        v = self.values[last.dst]
        out, mid = last.program.out, program.out
        e = out.itemsize
        whole = None
        if out.height * out.width == 1:
            whole = (Slice(self._full[v.index]) if v.index in strategy.resident
                     else Slice(self._buffer(f"{v.name}.whole", v.nbytes)))
        window = program.window(0, 0, mid.height)
        if s in strategy.resident:
            inputs, loaded = Slice(self._full[s]), mid.height
            base = 0
        else:
            inputs, loaded = Slice(self._buffer(f"{source.name}.in", (window.stop - window.start) * rb_in)), 0
            base = window.start
        split = max(-(-self.config.mac_cols // mid.width), mid.height // 3)
        previous = None
        for c0, count in tiles(mid.channels, ct):
            consts, const_loads = self._constants(layer, c0, count)
            stripes = [(0, split), (split, mid.height)] if loaded == 0 and whole is None and split < mid.height \
                else [(0, mid.height)]
            produced = self._buffer(f"{layer.name}.ofm.c{c0}", mid.height * mid.width * count * e)
            for o0, o1 in stripes:
                w = program.window(0, o0, o1)
                step = Step(layer, (o0, o1), (c0, count), constants=consts,
                            loads=list(const_loads) if o0 == 0 else [])
                index = len(self.steps)
                if o0 == 0 and previous is not None and follower is not None:
                    step.hoisted = {k: previous for k in range(len(const_loads))}  # while the previous tile computes
                elif o0 == 0 and previous is None and index and not self.steps[-1].opaque:
                    step.hoisted = {k: index - 1 for k in range(len(const_loads))}  # even if its input must wait
                if o0 == 0:
                    previous = index
                if loaded < w.stop - base and inputs.sram is not self._full.get(s):
                    first = max(w.start, base + loaded)
                    step.loads.append(Load(source.dram, first * rb_in, inputs.sram, (first - base) * rb_in,
                                           (w.stop - first) * rb_in))
                    loaded = w.stop - base
                step.ifms.append((Slice(inputs.sram, inputs.offset + (w.start - base) * rb_in), w))
                if whole is not None and follower is None:
                    step.ofm = Slice(whole.sram, whole.offset + c0 * e)
                else:
                    step.ofm = Slice(produced, o0 * mid.width * count * e)
                    if follower is None:
                        step.stores.append(Store(produced, o0 * mid.width * count * e, v.dram,
                                                 (o0 * mid.width * mid.channels + c0) * e, count * e,
                                                 (o1 - o0) * mid.width, mid.channels * e, count * e))
                self._step(step)
            if follower is not None:
                consts, const_loads = self._constants(follower, c0, count)
                fw = follower.program.window(0, 0, out.height)
                step = Step(follower, (0, out.height), (c0, count), constants=consts, loads=list(const_loads))
                step.ifms.append((Slice(produced, fw.start * mid.width * count * e), fw))
                if whole is not None:
                    step.ofm = Slice(whole.sram, whole.offset + c0 * e)
                else:
                    step.ofm = Slice(self._buffer(f"{v.name}.c{c0}", out.height * out.width * count * e))
                    step.stores.append(Store(step.ofm.sram, 0, v.dram, c0 * e, count * e, out.height * out.width,
                                             out.channels * e, count * e))
                self._step(step)
        if whole is not None and v.dram is not None:
            self.steps[-1].stores.append(Store(whole.sram, whole.offset, v.dram, 0, v.nbytes))

SCHEDULE_VARIANTS = (ScheduleOptions("repack"), ScheduleOptions("above"), ScheduleOptions("repack", True),
                     ScheduleOptions("above", True), ScheduleOptions("above", streamed_tiles=True),
                     ScheduleOptions("tail", True), ScheduleOptions("tail", streamed_tiles=True))
"""The variants :func:`npu_backend.codegen.graph.lower_graph` tries, in order (the first wins a tie)."""
