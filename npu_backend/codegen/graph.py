"""A region as a graph of layers, and its lowering: tile programs -> region scheduler -> emitter.

:class:`RegionGraph` is what the codegen knows of a region once the Relax function is read
(:func:`npu_backend.codegen.lower.region_graph`): its input and output tensors and its layers in program
order, each an operator record with its operand tensors. :func:`lower_graph` lowers it through the region
scheduler (:mod:`npu_backend.codegen.schedule`), or, when the scheduler cannot fit the region in SRAM,
layer by layer through DRAM (each layer's own tile program, :mod:`npu_backend.codegen.emit`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from simulator.config import NpuConfig
from simulator.isa import WORD_RECORD, BufferKind, CommandStream, Convolution
from simulator.timeline import schedule

from ..errors import UnsupportedOpError
from ..legality import check
from ..ops import op_def
from ..params import NpuParams
from .emit import StreamBuilder
from .emitter import emit_schedule
from .programs import MapShape, row_program
from .reorder import ready_first
from .schedule import SCHEDULE_VARIANTS, RegionScheduler, ScheduleOptions
from .split_copies import split_waiting_copies
from .steps import Layer, ScheduleError, Value


@dataclass(frozen=True)
class Tensor:
    """A tensor of a region, by its (unique) name."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "int8"


@dataclass(frozen=True)
class GraphLayer:
    """One composite call: its record, its result and its operands (``None``: a constant the record holds)."""

    name: str
    params: NpuParams
    result: Tensor
    operands: tuple[Tensor | None, ...]


@dataclass(frozen=True)
class RegionGraph:
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    layers: tuple[GraphLayer, ...]


def lower_layer(sb: StreamBuilder, p: NpuParams, layer: str, sources: list, dst: int) -> None:
    """Append the commands of one layer through DRAM; refuse a record its operator's rules reject here."""
    definition = op_def(p.op)
    reason, plan, prepared = check(definition, p, sb.config)
    if reason is not None:
        raise UnsupportedOpError(f"{layer} ({definition.composite}) cannot run on {sb.config.name}: {reason}")
    definition.lower(sb, p, plan, prepared, layer, sources, dst)


def _region_buffers(sb: StreamBuilder, graph: RegionGraph) -> dict[Tensor, int]:
    """Inputs (by their names) and outputs (``output0``, ...) as DRAM buffers, first in the stream."""
    buffers = {t: sb.add_buffer(t.name, BufferKind.INPUT, t.shape, t.dtype) for t in graph.inputs}
    for k, t in enumerate(graph.outputs):
        if t in buffers:
            raise UnsupportedOpError("an NPU region cannot return its own input")
        buffers[t] = sb.add_buffer(f"output{k}", BufferKind.OUTPUT, t.shape, t.dtype)
    return buffers


def lower_through_dram(graph: RegionGraph, config: NpuConfig) -> StreamBuilder:
    """Every layer reads its inputs from DRAM and writes its output to DRAM (the fallback)."""
    sb = StreamBuilder(config)
    buffers = _region_buffers(sb, graph)
    for layer in graph.layers:
        if layer.result not in buffers:
            buffers[layer.result] = sb.add_buffer(layer.result.name, BufferKind.SCRATCH, layer.result.shape,
                                                  layer.result.dtype)
        lower_layer(sb, layer.params, layer.name, [None if o is None else buffers[o] for o in layer.operands],
                    buffers[layer.result])
    return sb


def _scheduler_inputs(graph: RegionGraph, config: NpuConfig, buffers: dict[Tensor, int], packed: bool):
    """The region as the scheduler sees it: its values and its layers with their row programs (``packed``:
    :attr:`ScheduleOptions.packed_records`)."""
    values: list[Value] = []
    index_of: dict[Tensor, int] = {}

    def value_of(t: Tensor) -> int:
        if t not in index_of:
            shape = MapShape.of(t.shape, np.dtype(t.dtype).itemsize)
            values.append(Value(len(values), t.name, t.shape, t.dtype, shape, dram=buffers.get(t),
                                fixed_dram=t in buffers))
            index_of[t] = len(values) - 1
        return index_of[t]

    for t in graph.inputs:
        value_of(t)
    layers: list[Layer] = []
    for g in graph.layers:
        definition = op_def(g.params.op)
        reason, plan, prepared = check(definition, g.params, config)
        if reason is not None:
            raise UnsupportedOpError(f"{g.name} ({definition.composite}) cannot run on {config.name}: {reason}")
        sources = [None if o is None else value_of(o) for o in g.operands]
        dst = value_of(g.result)
        program = row_program(g.params, prepared, list(g.operands), packed)
        computed = [s for s in sources if s is not None]
        if program is not None and (program.out != values[dst].shape or len(program.inputs) != len(computed)
                                    or any(shape != values[s].shape for shape, s in zip(program.inputs, computed))):
            program = None  # operand shapes the row view does not fit: the layer runs whole through DRAM
        index = len(layers)
        layers.append(Layer(index, g.name, g.params, definition, plan, prepared, sources, dst, program))
        values[dst].producer = index
        for s in computed:
            if index not in values[s].consumers:
                values[s].consumers.append(index)
    return values, layers


def lower_scheduled(graph: RegionGraph, config: NpuConfig, options: ScheduleOptions = ScheduleOptions()
                    ) -> StreamBuilder:
    """The region through its scheduler; raises ``ScheduleError`` when it cannot fit the region."""
    sb = StreamBuilder(config)
    values, layers = _scheduler_inputs(graph, config, _region_buffers(sb, graph), options.packed_records)
    emit_schedule(sb, RegionScheduler(config, values, layers, options).run(), values)
    return sb


def _stream(sb: StreamBuilder, config: NpuConfig, name: str, serial: bool = False) -> CommandStream:
    """The stream of the builder's commands: compute commands ready sooner moved ahead (:func:`ready_first`) and
    DMAs waiting for part of their SRAM split so that their free bytes move first (:func:`split_waiting_copies`),
    each where that shortens the makespan (the values are the same either way), then the dependencies their SRAM
    addresses imply; ``serial``: none of these, every command waits for the one before it (:func:`lower_graph`)."""
    if serial:
        return CommandStream(name=name, config=config, buffers=tuple(sb.buffers), commands=tuple(sb.commands))
    commands = split_waiting_copies(ready_first(sb.commands, config), config)  # dependencies derived
    return CommandStream(name=name, config=config, buffers=tuple(sb.buffers), commands=tuple(commands))


def _packed(stream: CommandStream) -> bool:
    """Whether a MAC command of the stream reads packed scale/bias records."""
    return any(isinstance(c.payload, Convolution) and c.payload.scale_bias_record != WORD_RECORD
               for c in stream.commands)


def lower_graph(graph: RegionGraph, config: NpuConfig, name: str, scheduled: bool = True,
                variants: tuple[ScheduleOptions, ...] = SCHEDULE_VARIANTS, serial: bool = False,
                word_records: bool = True) -> CommandStream:
    """The region's command stream, with the dependencies its SRAM addresses imply: through the scheduler
    with each of ``variants`` (variants that differ only in prefetch share their plan), keeping the
    one with the shortest makespan (the earlier one on a tie), or layer by layer through DRAM when the
    scheduler cannot fit the region (or ``scheduled`` is False). Every variant computes the same values, so a
    caller that needs only those (calibration, which lowers a stream for every layer it tries) asks for
    ``serial``: the first variant that fits, without growing stripes (:attr:`ScheduleOptions.growing_stripes`),
    untimed, with no dependencies derived; every command waits for the one before it (``deps`` None, as in
    streams before format 2.4), a valid stream with no overlap.

    ``word_records``: when the winner reads packed scale/bias records, it is also tried with 12-byte ones and
    the shorter kept (:attr:`ScheduleOptions.packed_records`); False keeps exactly the variants given."""
    schedulers, inputs = {}, {}

    def emitted(options: ScheduleOptions) -> StreamBuilder | None:
        """The region scheduled with ``options`` as commands; None if it does not fit (nor will any variant)."""
        if options.packed_records not in inputs:
            inputs[options.packed_records] = _scheduler_inputs(
                graph, config, _region_buffers(StreamBuilder(config), graph), options.packed_records)
        values, layers = inputs[options.packed_records]
        planned = dataclasses.replace(options, prefetch=SCHEDULE_VARIANTS[0].prefetch)
        scheduler = schedulers.setdefault(planned, RegionScheduler(config, values, layers, options))
        scheduler.options = options
        try:
            plan = scheduler.run()
        except ScheduleError:
            return None
        sb = StreamBuilder(config)
        _region_buffers(sb, graph)  # the same buffer indices as the values were given
        emit_schedule(sb, plan, values)
        return sb

    best = None  # (cycles, stream, options)

    def keep(sb: StreamBuilder, options: ScheduleOptions) -> None:
        nonlocal best
        stream = _stream(sb, config, name)
        cycles = max((slot.end for slot in schedule(stream, config)), default=0)
        if best is None or cycles < best[0]:
            best = (cycles, stream, options)

    if serial:  # values only: the cycle search that changes nothing else is left out
        variants = tuple(dataclasses.replace(v, growing_stripes=False) for v in variants)
    for options in variants if scheduled else ():
        sb = emitted(options)
        if sb is None:
            break
        if serial:
            return _stream(sb, config, name, serial=True)
        keep(sb, options)
    if word_records and best is not None and best[2].packed_records and _packed(best[1]):
        words = dataclasses.replace(best[2], packed_records=False)
        sb = emitted(words)
        if sb is not None:
            keep(sb, words)
    if best is not None:
        return best[1]
    return _stream(lower_through_dram(graph, config), config, name, serial=serial)
