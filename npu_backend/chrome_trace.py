"""A profile as a Chrome trace-event file: the format Perfetto (https://ui.perfetto.dev) and chrome://tracing open.

Layout. One process per hardware configuration (normally one: "NPU npu-256 (500 MHz)"), because the engines are the
hardware's, whatever region runs on them. Its threads are the tracks:

- ``calls``: one slice per region call, named by the region's symbol (args: call number, makespan, busy
  cycles per engine, MACs, DRAM bytes);
- one track per engine (:class:`simulator.opcodes.Engine`: ``dma``, ``compute``), one complete event
  (``"ph": "X"``) per command, named by its opcode, categorised by its unit (``mac_array``, ``pooling``...),
  with args ``call``, ``index`` (in its stream), ``layer``, ``cycles``, ``start_cycle`` (from its call's
  start), ``macs``, ``dram_read_bytes``, ``dram_write_bytes`` and ``deps`` (the commands it waited for).

An engine runs one command at a time, so its slices never overlap; slices on the two engine tracks at the
same time are DMA and compute overlapping. Calls follow one another in the order they were made: each starts
when the previous one ended.

Time. ``ts`` and ``dur`` are microseconds at the configuration's ``clock_mhz``, the trace-event format's own
unit, which both viewers read alike. Each command boundary is rounded once to a whole nanosecond (a cycle is
2.5 ns at 400 MHz) and ``dur`` is the difference of two rounded boundaries, so back-to-back commands stay
exactly adjacent and never overlap by a rounding error. There is no ``displayTimeUnit``: Perfetto takes it as
the unit of ``ts`` where chrome://tracing only displays in it, so the two would disagree by 1000x. The exact
cycles are in each event's args.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from simulator.config import NpuConfig
from simulator.machine import CommandStats, RunStats
from simulator.opcodes import Engine, opcode_def

from .errors import NpuError

TRACKS = ("calls",) + tuple(engine.value for engine in Engine)
"""Threads of each process, top to bottom."""


def _nanoseconds(cycles: int, clock_mhz: int) -> int:
    """``cycles`` at ``clock_mhz`` in whole nanoseconds, rounded half up."""
    return (cycles * 1000 + clock_mhz // 2) // clock_mhz


def _slice(pid: int, tid: int, name: str, category: str, start_ns: int, end_ns: int, args: dict) -> dict:
    return {"name": name, "cat": category, "ph": "X", "pid": pid, "tid": tid, "ts": start_ns / 1000,
            "dur": (end_ns - start_ns) / 1000, "args": args}


def _process(pid: int, config: NpuConfig) -> list[dict]:
    """Metadata naming the process of ``config`` and its tracks, in :data:`TRACKS` order."""
    events = [{"name": "process_name", "ph": "M", "pid": pid,
               "args": {"name": f"NPU {config.name} ({config.clock_mhz} MHz)"}},
              {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
    for position, track in enumerate(TRACKS):
        tid = _tid(pid, track)
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"sort_index": position}})
    return events


def _tid(pid: int, track: str) -> int:
    """Thread ids unique across processes (Perfetto, like Linux, treats a tid as system-wide)."""
    return (pid - 1) * len(TRACKS) + TRACKS.index(track) + 1


def _command_args(call: int, c: CommandStats) -> dict:
    return {"call": call, "index": c.index, "layer": c.layer, "cycles": c.cycles, "start_cycle": c.start,
            "macs": c.macs, "dram_read_bytes": c.dram_read_bytes, "dram_write_bytes": c.dram_write_bytes,
            "deps": list(c.deps)}


def chrome_trace(runs: Sequence[tuple[str, RunStats]]) -> dict:
    """The trace of ``runs`` ((region symbol, statistics) per call, in call order) as a JSON-ready dict."""
    pids: dict[NpuConfig, int] = {}
    events: list[dict] = []
    call_start_ns = 0
    for call, (symbol, stats) in enumerate(runs):
        config = stats.config
        if config not in pids:
            pids[config] = len(pids) + 1
            events.extend(_process(pids[config], config))
        pid = pids[config]

        def at(cycle: int) -> int:
            return call_start_ns + _nanoseconds(cycle, config.clock_mhz)

        events.append(_slice(pid, _tid(pid, "calls"), symbol, "call", at(0), at(stats.total_cycles), {
            "call": call, "cycles": stats.total_cycles,
            **{f"{engine.value}_busy": stats.busy_cycles(engine) for engine in Engine},
            "macs": stats.total_macs, "dram_bytes": stats.total_dram_bytes}))
        for c in stats.commands:
            events.append(_slice(pid, _tid(pid, c.engine.value), c.opcode.name, opcode_def(c.opcode).unit.value,
                                 at(c.start), at(c.end), _command_args(call, c)))
        call_start_ns = at(stats.total_cycles)
    return {"traceEvents": events,
            "otherData": {"generator": "npu_backend.profile",
                          "time": "microseconds at each configuration's clock_mhz; calls one after another, "
                                  "in call order; exact cycles in args"}}


def write_chrome_trace(runs: Sequence[tuple[str, RunStats]], path) -> None:
    """Write :func:`chrome_trace` of ``runs`` to ``path`` (JSON)."""
    try:
        Path(path).write_text(json.dumps(chrome_trace(runs), separators=(",", ":")) + "\n")
    except OSError as exc:
        raise NpuError(f"cannot write the trace to {path}: {exc.strerror}") from None
