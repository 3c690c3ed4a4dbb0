"""``npu_backend.profile()``: collect the simulator's statistics of every NPU call, and view them.

Three views of one profile: :meth:`Profile.summary` (the per-layer table, :meth:`Profile.layer_table`),
:meth:`Profile.to_chrome_trace` (every command on its engine's track, for Perfetto) and :meth:`Profile.plot`
(per-layer cycles against the roofline). A profile may hold several calls (several regions, repeated
inferences); the trace lays them out one after another, each call starting when the previous one ended, as
the host makes them: the NPU runs one region call at a time.

Accumulator overflows are never silent: when any command overflowed, the summary gains an ``overflows``
column and one ``accumulator overflows: N (mode, B bits)`` line per hardware configuration; otherwise it is
unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from simulator.config import NpuConfig
from simulator.machine import CommandStats, RunStats, describe_overflows
from simulator.opcodes import Engine

_ACTIVE: list["Profile"] = []

@dataclass(frozen=True)
class LayerRow:
    """One layer of one region: its figures over one call, or summed over ``calls`` calls of the region.

    ``span`` is the layer's elapsed time: from its first command's start to its last command's end (so it
    includes the cycles in which its engines waited, and any other layer's commands that overlapped it).
    ``compute_busy`` and ``dma_busy`` are the cycles its commands ran on each engine; ``compute_fixed`` and
    ``dma_fixed`` the part of them paid whatever the commands' sizes
    (:attr:`simulator.cycles.CommandCost.fixed_cycles`: DMA latency, issue overhead).
    """

    region: str
    layer: str
    config: NpuConfig
    calls: int
    commands: int
    span: int
    compute_busy: int
    dma_busy: int
    compute_fixed: int
    dma_fixed: int
    macs: int
    dram_bytes: int
    overflows: int

    @classmethod
    def of(cls, region: str, layer: str, config: NpuConfig, commands: Sequence[CommandStats]) -> "LayerRow":
        """The row of ``commands``, every command of ``layer`` in one call."""
        busy = {engine: 0 for engine in Engine}
        fixed = {engine: 0 for engine in Engine}
        for c in commands:
            busy[c.engine] += c.cycles
            fixed[c.engine] += c.fixed_cycles
        return cls(region, layer, config, 1, len(commands),
                   max(c.end for c in commands) - min(c.start for c in commands),
                   busy[Engine.COMPUTE], busy[Engine.DMA], fixed[Engine.COMPUTE], fixed[Engine.DMA],
                   sum(c.macs for c in commands), sum(c.dram_read_bytes + c.dram_write_bytes for c in commands),
                   sum(c.overflows for c in commands))

    def merged(self, other: "LayerRow") -> "LayerRow":
        """This row and another call's row of the same layer, summed."""
        sums = ("calls", "commands", "span", "compute_busy", "dma_busy", "compute_fixed", "dma_fixed", "macs",
                "dram_bytes", "overflows")
        return replace(self, **{name: getattr(self, name) + getattr(other, name) for name in sums})

    @property
    def utilisation(self) -> float:
        """MACs over what the array could have done in the span: MACs / (span * mac_rows * mac_cols)."""
        return self.macs / (self.span * self.config.mac_rows * self.config.mac_cols) if self.span else 0.0

    @property
    def compute_floor(self) -> int:
        """The compute roofline: cycles the MAC array needs at full use, MACs / (mac_rows * mac_cols)."""
        return math.ceil(self.macs / (self.config.mac_rows * self.config.mac_cols))

    @property
    def dma_floor(self) -> int:
        """The DMA roofline: cycles the DRAM port needs at full bandwidth, bytes / dram_bytes_per_cycle."""
        return math.ceil(self.dram_bytes / self.config.dram_bytes_per_cycle)

    @property
    def bound(self) -> str:
        """What limits the layer: its busiest engine (compute on a tie) is what it waits for, so

        - ``"overhead"`` when more than half of that engine's busy cycles are fixed per-command costs (issue
          overhead, DMA latency): fewer, larger commands would help more than a faster engine;
        - otherwise that engine's name: ``"compute"`` or ``"dma"``.
        """
        name, busy, fixed = max((("compute", self.compute_busy, self.compute_fixed),
                                 ("dma", self.dma_busy, self.dma_fixed)), key=lambda engine: engine[1])
        return "overhead" if 2 * fixed > busy else name


@dataclass
class Profile:
    """Statistics of the NPU region calls made while the profile was active, in call order."""

    runs: list[tuple[str, RunStats]] = field(default_factory=list)

    @property
    def total_cycles(self) -> int:
        """Cycles of every call end to end: the sum of the calls' makespans."""
        return sum(stats.total_cycles for _, stats in self.runs)

    @property
    def total_macs(self) -> int:
        return sum(stats.total_macs for _, stats in self.runs)

    @property
    def total_dram_bytes(self) -> int:
        return sum(stats.total_dram_bytes for _, stats in self.runs)

    @property
    def total_overflows(self) -> int:
        """Output elements whose accumulator overflowed, over every call."""
        return sum(stats.total_overflows for _, stats in self.runs)

    def busy_cycles(self, engine: Engine) -> int:
        """Cycles in which ``engine`` ran a command, over every call."""
        return sum(stats.busy_cycles(engine) for _, stats in self.runs)

    @property
    def overlap_cycles(self) -> int:
        """Cycles in which the DMA engine and the compute units both ran a command, over every call."""
        return sum(overlap_cycles(stats) for _, stats in self.runs)

    def overflows_by_config(self) -> dict[NpuConfig, int]:
        """Accumulator overflows per hardware configuration, for those that had any."""
        counts: dict[NpuConfig, int] = {}
        for _, stats in self.runs:
            if stats.total_overflows:
                counts[stats.config] = counts.get(stats.config, 0) + stats.total_overflows
        return counts

    def layers(self) -> list[tuple[str, str, dict[str, int]]]:
        """(region symbol, layer, totals) for every layer of every call, in execution order; the totals
        include ``overflows``, the layer's output elements whose accumulator overflowed."""
        return [(symbol, layer, row) for symbol, stats in self.runs
                for layer, row in stats.per_layer().items()]

    def layer_table(self, per_call: bool = False) -> list[LayerRow]:
        """One :class:`LayerRow` per layer of each region, in first-run order.

        Parameters
        ----------
        per_call : bool
            False (default): the calls of one region are summed into one row per layer (``calls`` says how
            many; a region's timing does not depend on its data, so only ``overflows`` can differ between
            them). True: one row per layer of every call, in call order.
        """
        rows: dict[tuple, LayerRow] = {}
        for call, (symbol, stats) in enumerate(self.runs):
            grouped: dict[str, list[CommandStats]] = {}
            for c in stats.commands:
                grouped.setdefault(c.layer, []).append(c)
            for layer, commands in grouped.items():
                row = LayerRow.of(symbol, layer, stats.config, commands)
                key = (call, symbol, layer) if per_call else (symbol, layer)
                rows[key] = rows[key].merged(row) if key in rows else row
        return list(rows.values())

    def summary(self) -> str:
        """The per-layer table (:meth:`layer_table`, calls of a region summed), then the totals.

        Columns: ``span`` the layer's elapsed cycles, ``compute`` and ``dma`` the cycles each engine was busy
        with it, ``util`` its MAC utilisation, ``bound`` what limits it (:attr:`LayerRow.bound`); ``calls``
        appears when a region ran more than once. The ``engines busy`` line gives the cycles each engine ran,
        and those in which both did (:attr:`overlap_cycles`), each with its share of the total.
        """
        rows = self.layer_table()
        repeated = any(row.calls > 1 for row in rows)
        overflowed = self.total_overflows > 0
        calls = f" {'calls':>5}" if repeated else ""
        extra = f" {'overflows':>9}" if overflowed else ""
        lines = [f"{'region':<30} {'layer':<22}{calls} {'cmds':>5} {'span':>9} {'compute':>9} {'dma':>9} "
                 f"{'MACs':>11} {'util':>6} {'DMA bytes':>10} {'bound':<8}{extra}".rstrip()]
        for row in rows:
            calls = f" {row.calls:>5}" if repeated else ""
            extra = f" {row.overflows:>9}" if overflowed else ""
            lines.append(f"{row.region[:30]:<30} {row.layer:<22}{calls} {row.commands:>5} {row.span:>9} "
                         f"{row.compute_busy:>9} {row.dma_busy:>9} {row.macs:>11} {row.utilisation:>6.1%} "
                         f"{row.dram_bytes:>10} {row.bound:<8}{extra}".rstrip())
        total = self.total_cycles
        clock = self.runs[0][1].config.clock_mhz if self.runs else 0
        micros = f", {total / clock:.1f} us at {clock} MHz" if clock else ""
        lines.append(f"total: {len(self.runs)} NPU calls, {total} cycles{micros}, "
                     f"{self.total_macs} MACs, {self.total_dram_bytes} DMA bytes")
        if total:
            busy = ", ".join(f"{engine.value} {self.busy_cycles(engine)} ({self.busy_cycles(engine) / total:.0%})"
                             for engine in Engine)
            lines.append(f"engines busy: {busy}, both at once {self.overlap_cycles} ({self.overlap_cycles / total:.0%})"
                         f" of the {total} cycles")
        lines.extend(describe_overflows(count, config) for config, count in self.overflows_by_config().items())
        return "\n".join(lines)

    def to_chrome_trace(self, path) -> None:
        """Write the calls as a Chrome trace-event JSON file (:mod:`npu_backend.chrome_trace`): open it in
        https://ui.perfetto.dev or chrome://tracing to see the DMA engine and the compute units side by side."""
        from .chrome_trace import write_chrome_trace

        write_chrome_trace(self.runs, path)

    def plot(self, path) -> None:
        """Write a PNG of per-layer cycles by engine against the roofline (:mod:`npu_backend.roofline_plot`;
        needs matplotlib: ``pip install 'npu-backend[plot]'``)."""
        from .roofline_plot import plot_layers

        plot_layers(self.layer_table(), path, f"{len(self.runs)} NPU calls, {self.total_cycles} cycles")


def overlap_cycles(stats: RunStats) -> int:
    """Cycles of one call in which the DMA engine and the compute units both ran a command. Each engine runs
    its commands one at a time, in stream order, so each one's busy intervals are disjoint and sorted: one
    merge of the two lists finds their intersection."""
    dma, compute = ([(c.start, c.end) for c in stats.commands if c.engine == engine]
                    for engine in (Engine.DMA, Engine.COMPUTE))
    i = j = both = 0
    while i < len(dma) and j < len(compute):
        both += max(0, min(dma[i][1], compute[j][1]) - max(dma[i][0], compute[j][0]))
        if dma[i][1] < compute[j][1]:
            i += 1
        else:
            j += 1
    return both


@contextlib.contextmanager
def profile():
    """Context manager yielding a :class:`Profile` filled by every NPU call inside it."""
    prof = Profile()
    _ACTIVE.append(prof)
    try:
        yield prof
    finally:
        _ACTIVE.remove(prof)


def record_run(symbol: str, stats: RunStats) -> None:
    for prof in _ACTIVE:
        prof.runs.append((symbol, stats))
