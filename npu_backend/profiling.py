"""``npu_backend.profile()``: collect the simulator's statistics of every NPU call."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from simulator.machine import RunStats

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

    def layers(self) -> list[tuple[str, str, dict[str, int]]]:
        """(region symbol, layer, totals) for every layer of every call, in execution order."""
        return [(symbol, layer, row) for symbol, stats in self.runs
                for layer, row in stats.per_layer().items()]

    def summary(self) -> str:
        lines = [f"{'region':<30} {'layer':<22} {'cmds':>5} {'cycles':>10} {'MACs':>11} {'DMA bytes':>10}"]
        for symbol, layer, row in self.layers():
            lines.append(f"{symbol[:30]:<30} {layer:<22} {row['commands']:>5} {row['cycles']:>10} "
                         f"{row['macs']:>11} {row['dram_bytes']:>10}")
        clock = self.runs[0][1].config.clock_mhz if self.runs else 0
        micros = f", {self.total_cycles / clock:.1f} us at {clock} MHz" if clock else ""
        lines.append(f"total: {len(self.runs)} NPU calls, {self.total_cycles} cycles{micros}, "
                     f"{self.total_macs} MACs, {self.total_dram_bytes} DMA bytes")
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
