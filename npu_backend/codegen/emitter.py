"""The emitter: a region's schedule written as commands.

Each step's window is: the loads issued at that step (its own when nothing precedes it, else the next
step's, which is how prefetch happens), then its compute command (or, for a layer without a row
program, that layer's whole DRAM-in/DRAM-out tile program), then its stores. So on the DMA engine the
next stripe's loads come before this stripe's stores, and each engine keeps its own order.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from simulator.isa import BufferKind

from .emit import StreamBuilder
from .programs import Operand
from .steps import ConstantsOf, Load, Schedule, Store, Value, is_constant, packed_constants


def emit_schedule(sb: StreamBuilder, schedule: Schedule, values: list[Value]) -> None:
    """Append the schedule's commands; values it spilled get their DRAM scratch buffers here."""
    scratch = {}
    for index in schedule.scratch:
        v = values[index]
        scratch[-1 - index] = sb.add_buffer(f"{v.name}", BufferKind.SCRATCH, v.dims, v.dtype)

    constants: dict[ConstantsOf, int] = {}
    for step in schedule.steps:  # in order of first use, so that the stream is deterministic
        for load in step.loads:
            key = load.buffer
            if isinstance(key, ConstantsOf) and key not in constants:
                data = packed_constants(step.layer.program, key.tile, sb.config.sram_align)
                constants[key] = sb.add_buffer(f"{step.layer.name}.constants", BufferKind.CONSTANT, (len(data),),
                                               data=data)

    def dram(buffer) -> int:
        if isinstance(buffer, ConstantsOf):
            return constants[buffer]
        return scratch[buffer] if buffer < 0 else buffer

    issued: dict[int, list[Load]] = defaultdict(list)
    hoisted: dict[int, list[Load]] = defaultdict(list)  # after a step's own loads: they are needed later
    for step in schedule.steps:
        for k, load in enumerate(step.loads):
            if k in step.hoisted:
                hoisted[step.hoisted[k]].append(load)
            else:
                issued[step.issue].append(load)
    for j, loads in hoisted.items():
        issued[j].extend(loads)
    for j, step in enumerate(schedule.steps):
        layer = step.layer
        for load in coalesced(issued[j]):
            sb.dma(layer.name, dram(load.buffer), load.offset, load.sram.address + load.sram_offset, load.row_bytes,
                   load.rows, load.dram_stride, load.sram_stride)
        if step.opaque:
            sources = [None if s is None else dram(values[s].dram) for s in layer.sources]
            layer.definition.lower(sb, layer.params, layer.plan, layer.prepared, layer.name, sources,
                                   dram(values[layer.dst].dram))
            continue
        ifms = [Operand(s.sram.address + s.offset, w) for s, w in step.ifms]
        c0, ct = step.channels
        sb.commands.append(layer.program.command(
            layer.name, *step.rows, c0, ct, ifms, step.ofm.sram.address + step.ofm.offset,
            [c.sram.address + c.offset for c in step.constants]))
        for store in step.stores:
            _store(sb, layer.name, store, dram(store.buffer))


def coalesced(loads: list[Load]) -> list[Load]:
    """The loads with each run of consecutive constant loads that lie next to one another both in DRAM and in
    SRAM, in the same order (the tail policy places runs of a streamed layer's tiles so:
    :meth:`npu_backend.codegen.prefetch._TailWalk.run_of`), merged into one. The DMA engine runs them back to
    back anyway, so the merged load ends when the last of them would have and pays one latency instead of
    one each; only the first one's readers wait longer, for bytes that were next in the queue."""
    merged: list[Load] = []
    for load in loads:
        last = merged[-1] if merged else None
        if last is not None and is_constant(load) and load.buffer == last.buffer and load.rows == last.rows == 1:
            here, there = load.sram.address + load.sram_offset, last.sram.address + last.sram_offset
            if load.offset + load.row_bytes == last.offset and here + load.row_bytes == there:  # just below
                merged[-1] = dataclasses.replace(load, row_bytes=load.row_bytes + last.row_bytes)
                continue
            if last.offset + last.row_bytes == load.offset and there + last.row_bytes == here:  # just above
                merged[-1] = dataclasses.replace(last, row_bytes=last.row_bytes + load.row_bytes)
                continue
        merged.append(load)
    return merged


def _store(sb: StreamBuilder, layer: str, store: Store, buffer: int) -> None:
    sb.dma(layer, buffer, store.offset, store.sram.address + store.sram_offset, store.row_bytes, store.rows,
           store.dram_stride, store.sram_stride, to_sram=False)
