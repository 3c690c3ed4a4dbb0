"""``npu_backend.profile()``: collect the simulator's statistics of every NPU call.

Accumulator overflows are never silent: when any command overflowed, the
summary gains an ``overflows`` column and one ``accumulator overflows: N (mode,
B bits)`` line per hardware configuration; otherwise it is unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from simulator.config import NpuConfig
from simulator.machine import RunStats, describe_overflows

_ACTIVE: list["Profile"] = []


@dataclass
class Profile:
    """Statistics of the NPU region calls made while the profile was active."""

    runs: list[tuple[str, RunStats]] = field(default_factory=list)

    @property
    def total_cycles(self) -> int:
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

    def summary(self) -> str:
        overflowed = self.total_overflows > 0
        extra = f" {'overflows':>9}" if overflowed else ""
        lines = [f"{'region':<30} {'layer':<22} {'cmds':>5} {'cycles':>10} {'MACs':>11} {'DMA bytes':>10}{extra}"]
        for symbol, layer, row in self.layers():
            extra = f" {row['overflows']:>9}" if overflowed else ""
            lines.append(f"{symbol[:30]:<30} {layer:<22} {row['commands']:>5} {row['cycles']:>10} "
                         f"{row['macs']:>11} {row['dram_bytes']:>10}{extra}")
        clock = self.runs[0][1].config.clock_mhz if self.runs else 0
        micros = f", {self.total_cycles / clock:.1f} us at {clock} MHz" if clock else ""
        lines.append(f"total: {len(self.runs)} NPU calls, {self.total_cycles} cycles{micros}, "
                     f"{self.total_macs} MACs, {self.total_dram_bytes} DMA bytes")
        lines.extend(describe_overflows(count, config) for config, count in self.overflows_by_config().items())
        return "\n".join(lines)


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
