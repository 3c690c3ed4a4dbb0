"""SRAM allocation by liveness: one allocator for every buffer of a region.

Each buffer is live over an interval of schedule steps (from the step that writes or starts loading it to
the last step that reads or stores it); two buffers whose intervals meet never share bytes, and two that
do not may. The allocator is greedy by size (as TFLite's arena planner): the largest buffers are placed
first, each at the lowest address where it overlaps no placed buffer live at the same time. Large stripe
buffers then never wait behind a scatter of small ones, and the result is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class SramBuffer:
    """One SRAM allocation: ``size`` bytes live from step ``first`` to step ``last`` (inclusive)."""

    name: str
    size: int
    first: int = -1
    last: int = -1
    address: int = -1

    def live_at(self, step: int) -> None:
        """Extend the live interval to cover ``step``."""
        self.first = step if self.first < 0 else min(self.first, step)
        self.last = max(self.last, step)


def align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def allocate(buffers: list[SramBuffer], sram_bytes: int, align: int,
             fixed: tuple[SramBuffer, ...] = ()) -> SramBuffer | None:
    """Give every buffer an address such that buffers live at the same step are disjoint (and clear of the
    ``fixed`` ones, already placed); return the first buffer (in placement order) that does not fit, ``None``
    when all do."""
    by_step: dict[int, list[SramBuffer]] = {}
    for buffer in fixed:
        for step in range(buffer.first, buffer.last + 1):
            by_step.setdefault(step, []).append(buffer)
    order = sorted(enumerate(buffers), key=lambda item: (-item[1].size, item[1].first, item[0]))
    for _, buffer in order:
        seen, placed = set(), []
        for step in range(buffer.first, buffer.last + 1):
            for other in by_step.get(step, ()):
                if id(other) not in seen:
                    seen.add(id(other))
                    placed.append(other)
        cursor = 0
        for other in sorted(placed, key=lambda b: b.address):
            if other.address - cursor >= buffer.size:
                break
            cursor = max(cursor, align_up(other.address + other.size, align))
        if cursor + buffer.size > sram_bytes:
            return buffer
        buffer.address = cursor
        for step in range(buffer.first, buffer.last + 1):
            by_step.setdefault(step, []).append(buffer)
    return None
