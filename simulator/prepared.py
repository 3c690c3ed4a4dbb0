"""Running one command stream many times: what depends on the stream alone is worked out once.

A compiled model runs the same stream for every inference, and everything but the data in it is fixed: its
legality, its schedule and costs (:mod:`simulator.timeline`), the addresses every command touches, and the
weights and scale/bias tables its MAC-array commands read, wherever they come from constant buffers.
:func:`prepare_stream` validates the stream and schedules it once and turns each command into a *step*, a
function of the machine state that does what the opcode's kernel does, bit for bit:

* a DMA is one copy between views of the stream's memories, made once;
* a MAC-array command whose weights and table are constant runs a :class:`simulator.mac_plans.MacPlan`: the
  weights as the float matrices its exact sums multiply by (:class:`simulator.macs.SumPlan`; a reduction too
  long for float32 in float32 pieces added in float64), the output stage as float64 constants with the bias
  folded in (:class:`simulator.numerics.Float64Requantizer`), the type of the sums and whether the accumulator
  can overflow decided from bounds on the weights and the input type (from the data only where those are too
  loose, as :func:`simulator.kernels.mac_output` does); commands that read one unchanged input share one product
  (:func:`simulator.mac_plans.shared_inputs`);
* an elementwise command (ADD, SUB, MUL: each output byte is a function of its two input bytes alone) becomes
  a look-up in the 256 x 256 table of its results, computed by its kernel;
* a MEAN sums in int64 and requantizes with its zero-point correction as the bias;
* every other opcode runs its kernel.

The expensive preparations (matrices, tables) are made on a step's second run, so a stream run once costs what
it always did. Statistics come from the schedule, computed once; a run whose accumulators never overflowed
returns the same (immutable) :class:`simulator.machine.RunStats` every time.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import fields

import numpy as np

from . import elementwise
from .config import NpuConfig
from .isa import BufferKind, Command, CommandStream, DmaCopy, Elementwise, FeatureMap, MemorySpace, Opcode, Reduction
from .kernels import MachineState, _rows
from .machine import RunStats, _load_inputs, run_stats
from .mac_plans import MAC_OPCODES, MacPlan, SharedProduct, constant_operands, shared_inputs
from .macs import depthwise_input_size
from .numerics import Float64Requantizer, Rounding, float64_requantizer
from .opcodes import opcode_def
from .timeline import schedule
from .validate import validate_stream

PREPARE_ON_RUN = 2
"""The run of a step that prepares its matrices or table: a stream run once pays nothing for them."""

ELEMENTWISE_OPCODES = (Opcode.ADD, Opcode.SUB, Opcode.MUL)


def _dma_step(command: Command, config: NpuConfig, owner: PreparedStream, index: int) -> Callable[[MachineState], int]:
    """A DMA as one copy between views of the stream's own memories, made once (the kernel's strided rows,
    :func:`simulator.kernels._rows`)."""
    p: DmaCopy = command.payload
    src = _rows(owner.memory(p.src_space, p.src_buffer), p.src_offset, p.rows, p.src_stride, p.row_bytes)
    dst = _rows(owner.memory(p.dst_space, p.dst_buffer), p.dst_offset, p.rows, p.dst_stride, p.row_bytes)
    return lambda state: np.copyto(dst, src) or 0


def _kernel_step(command: Command, config: NpuConfig) -> Callable[[MachineState], int]:
    execute = opcode_def(command.opcode).execute
    opcode, payload = command.opcode, command.payload
    return lambda state: execute(state, opcode, payload, config)


class _LazyStep:
    """A step that runs its kernel until its :data:`PREPARE_ON_RUN`-th run, then what :meth:`prepare` returns
    (None: the kernel, for good)."""

    def __init__(self, command: Command, config: NpuConfig, owner: PreparedStream, index: int):
        self.command, self.config, self.owner, self.index = command, config, owner, index
        self.kernel = _kernel_step(command, config)
        self.fast: Callable[[MachineState], int] | None = None
        self.runs = 0

    def prepare(self) -> Callable[[MachineState], int] | None:
        raise NotImplementedError

    def __call__(self, state: MachineState) -> int:
        if self.fast is not None:
            return self.fast(state)
        self.runs += 1
        if self.runs == PREPARE_ON_RUN:
            fast = self.prepare()
            if fast is not None:
                self.fast = fast
                return fast(state)
        return self.kernel(state)


class _MacStep(_LazyStep):
    def prepare(self):
        plan = self.owner.mac_plan(self.index)
        if plan is None:
            return None
        self.plan = plan
        return plan.step()


def _arithmetic_key(opcode: Opcode, op: Elementwise) -> tuple:
    """What an elementwise command computes, without where: commands with equal keys share a table."""
    return (opcode, *(getattr(op, f.name) for f in fields(op) if not isinstance(getattr(op, f.name), FeatureMap)))


ALL_PAIRS = (np.repeat(np.arange(256, dtype=np.uint8), 256).view(np.int8),
             np.tile(np.arange(256, dtype=np.uint8), 256).view(np.int8))
"""Every (first, second) int8 input pair, the first operand's byte major: index ``first_byte * 256 + second_byte``."""


def pair_table(opcode: Opcode, op: Elementwise) -> np.ndarray:
    """The result byte of every int8 input pair (:data:`ALL_PAIRS` order), by the command's own arithmetic
    (:func:`elementwise.compute`)."""
    return np.ascontiguousarray(elementwise.compute(opcode, *ALL_PAIRS, op).astype(np.int8)).view(np.uint8)


class PairTables:
    """:func:`pair_table` of each arithmetic once: the commands of a stream that compute alike (a layer's tiles,
    the blocks of a network that share qparams) share one table."""

    def __init__(self):
        self._tables: dict[tuple, np.ndarray] = {}

    def get(self, opcode: Opcode, op: Elementwise) -> tuple[np.ndarray, bool]:
        """The command's table, and whether it was made by this call (its bytes are new)."""
        key = _arithmetic_key(opcode, op)
        table = self._tables.get(key)
        if table is not None:
            return table, False
        table = self._tables[key] = pair_table(opcode, op)
        return table, True


def lookup_pairs(first: np.ndarray, second: np.ndarray, table: np.ndarray, out: np.ndarray,
                 pairs: np.ndarray) -> None:
    """``out = table[first * 256 + second]`` element by element: an int8 ADD, SUB or MUL through its
    :func:`pair_table` (operands and result as uint8 views of one shape; ``pairs``, uint16 of that shape, is
    scratch). The one lookup a prepared stream and a prepared batch both run."""
    np.left_shift(first, 8, out=pairs, dtype=np.uint16)
    np.bitwise_or(pairs, second, out=pairs)
    np.take(table, pairs, out=out, mode="clip")  # every index is in range; "raise" would buffer


class _ElementwiseStep(_LazyStep):
    def prepare(self):
        opcode, op = self.command.opcode, self.command.payload
        table = self.owner.elementwise_table(opcode, op)
        sram = self.owner.memory(MemorySpace.SRAM, 0)
        n = op.ofm.size
        first, second = sram[op.ifm.address:op.ifm.address + n], sram[op.ifm2.address:op.ifm2.address + n]
        out = sram[op.ofm.address:op.ofm.address + n]
        pairs = np.empty(n, np.uint16)

        def run(state: MachineState) -> int:
            lookup_pairs(first, second, table, out, pairs)
            return 0

        return run


def _plain_step(command: Command, config: NpuConfig, owner: PreparedStream, index: int):
    return _kernel_step(command, config)


class _MeanStep(_LazyStep):
    """MEAN (:func:`simulator.kernels.run_mean`) under ``Rounding.TFLITE_DOUBLE``: the int64 sum of each channel,
    then the output stage with ``-zp * count`` as its bias (:class:`Float64Requantizer`), where no sum can
    overflow the accumulator nor leave the requantizer's exact range (bounds from the input type)."""

    def prepare(self):
        op: Reduction = self.command.payload
        count = op.ifm.height * op.ifm.width
        if op.rounding != Rounding.TFLITE_DOUBLE or count * 255 > (1 << (self.config.accumulator_bits - 1)) - 1:
            return None
        plan = float64_requantizer(op.multiplier, op.shift, op.output_zero_point, op.act_min, op.act_max,
                                   bias=-op.input_zero_point * count)
        if count * 128 > plan.limit:
            return None
        sram = self.owner.memory(MemorySpace.SRAM, 0)
        ifm = sram[op.ifm.address:op.ifm.address + op.ifm.size].view(np.int8).reshape(count, op.ifm.channels)
        ofm = sram[op.ofm.address:op.ofm.address + op.ofm.size].view(np.int8).reshape(1, op.ofm.channels)
        sums = np.empty((1, op.ifm.channels), np.int64)
        add, requantize = np.add.reduce, plan.bind(sums, ofm)

        def run(state: MachineState) -> int:
            add(ifm, axis=0, dtype=np.int64, out=sums[0])
            requantize()
            return 0

        return run


STEPS: dict[Opcode, Callable] = {Opcode.DMA_COPY: _dma_step, **{opcode: _MacStep for opcode in MAC_OPCODES},
                                 **{opcode: _ElementwiseStep for opcode in ELEMENTWISE_OPCODES},
                                 Opcode.MEAN: _MeanStep}
"""How each opcode's step is made, ``(command, config, prepared stream, index) -> step``; an opcode without an
entry runs its kernel."""


class PreparedStream:
    """A validated, scheduled stream whose commands are steps (module docstring); :meth:`run` it many times.

    It owns its memories (SRAM and one array per DRAM buffer, cleared at the start of every run, constant buffers
    read in place), so that steps hold views of them made once. Runs are serialized by a lock; the outputs
    returned are copies, the caller's to keep.
    """

    def __init__(self, stream: CommandStream, config: NpuConfig):
        validate_stream(stream, config)
        self.stream, self.config = stream, config
        self.slots = schedule(stream, config)
        self._sram = np.zeros(config.sram_bytes, np.uint8)
        self._dram = [np.frombuffer(buf.data, dtype=np.uint8) if buf.kind == BufferKind.CONSTANT
                      else np.zeros(buf.size, np.uint8) for buf in stream.buffers]
        self._cleared = [d for d, buf in zip(self._dram, stream.buffers) if buf.kind != BufferKind.CONSTANT]
        self._state = MachineState(sram=self._sram, dram=self._dram)
        self._lock = threading.Lock()
        self._scratch: dict[tuple[str, np.dtype], np.ndarray] = {}
        convs = [c.payload for c in stream.commands if c.opcode in MAC_OPCODES]
        self._scratch_sizes = {
            "input": max([max((f.height + p.padding[0] + p.padding[2]) * (f.width + p.padding[1] + p.padding[3])
                              * f.channels, depthwise_input_size(p)) for p in convs for f in (p.ifm,)], default=0),
            "sums": max([p.ofm.size for p in convs], default=0),
            "folded": max([p.ifm.height * p.ifm.width * (p.ifm.channels + 1) for p in convs], default=0),
            "requantize": Float64Requantizer.work_size(max([p.ofm.channels for p in convs], default=0))}
        self._constants: dict | None = None
        self._shared: dict[int, list[int]] | None = None
        self._plans: dict[int, MacPlan | None] = {}
        self._tables = PairTables()
        self.operands: dict = {}
        """Converted weights (:class:`simulator.macs.SumPlan`), shared by the commands of one layer."""
        self.requantizer_tiles: dict = {}
        """Output-stage constants tiled to a block (:meth:`simulator.numerics.Float64Requantizer.bind`), shared by
        the commands of one layer."""
        self.prepared_bytes = sum(d.nbytes for d in self._cleared) + self._sram.nbytes
        """Bytes held besides the stream: its memories and what the steps prepared (matrices, tables, scratch), for
        callers that bound their caches."""
        self.steps = [STEPS.get(c.opcode, _plain_step)(c, config, self, i) for i, c in enumerate(stream.commands)]
        self._stats = run_stats(stream, config, self.slots, [0] * len(stream.commands))

    def memory(self, space: MemorySpace, buffer: int) -> np.ndarray:
        """The stream's SRAM, or its DRAM buffer ``buffer`` (bytes)."""
        return self._sram if space == MemorySpace.SRAM else self._dram[buffer]

    def scratch(self, name: str, dtype: np.dtype, shape=None) -> np.ndarray:
        """A scratch array shared by the steps (they run one at a time): ``"input"`` (a centred, padded input),
        ``"sums"`` or ``"requantize"`` (:meth:`simulator.numerics.Float64Requantizer.work_size`), as large as the
        stream's largest MAC command needs, so that the views steps keep of it stay valid; ``shape``: a view of
        that shape, else the whole array."""
        buffer = self._scratch.get((name, dtype))
        if buffer is None:
            buffer = self._scratch[(name, dtype)] = np.empty(self._scratch_sizes[name], dtype)
            self.add_prepared_bytes(buffer.nbytes)
        return buffer if shape is None else buffer[:math.prod(shape)].reshape(shape)

    def constant_operands(self) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        if self._constants is None:
            self._constants = constant_operands(self.stream, self.config)
            self.add_prepared_bytes(sum(w.nbytes + t.nbytes for w, t in self._constants.values()))
        return self._constants

    def mac_plan(self, index: int) -> MacPlan | None:
        """The :class:`MacPlan` of command ``index`` (None: its operands are not constant); the plans of commands
        sharing a product (:func:`shared_inputs`) are made together."""
        if index in self._plans:
            return self._plans[index]
        constants = self.constant_operands()
        if self._shared is None:
            self._shared = {i: run for run in shared_inputs(self.stream, self.config, constants) for i in run}
        run = self._shared.get(index, [index])
        tiled = self.requantizer_tiles.get("nbytes", 0) + self.operands.get("nbytes", 0)
        plans = [MacPlan(self, self.stream.commands[i].opcode, self.stream.commands[i].payload, self.config,
                         *constants[i]) if i in constants else None for i in run]
        together = [p for p in plans if p is not None and p.static_dtype is not None]
        added = SharedProduct(self, together).nbytes if len(together) > 1 else 0
        for plan in together:
            plan.bind(plan.static_dtype)
        added += sum(p.nbytes for p in plans if p is not None)
        self._plans.update(zip(run, plans))
        self.add_prepared_bytes(added + self.requantizer_tiles.get("nbytes", 0) + self.operands.get("nbytes", 0) - tiled)
        return self._plans[index]

    def elementwise_table(self, opcode: Opcode, op: Elementwise) -> np.ndarray:
        """The result byte of every input pair, by the command's own arithmetic (:func:`elementwise.compute`)."""
        table, made = self._tables.get(opcode, op)
        if made:
            self.add_prepared_bytes(table.nbytes)
        return table

    def add_prepared_bytes(self, count: int) -> None:
        self.prepared_bytes += count

    def run(self, inputs: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], RunStats]:
        """Outputs by name and statistics, exactly as :func:`simulator.machine.run_stream` returns them."""
        stream, config = self.stream, self.config
        loaded = _load_inputs(stream, inputs)  # checked against the declared buffers
        with self._lock:
            self._sram.fill(0)
            for memory in self._cleared:
                memory.fill(0)
            for index, value in loaded.items():
                self._dram[index][:] = value
            overflows = [step(self._state) for step in self.steps]
            outputs = {buf.name: self._dram[i].view(np.dtype(buf.dtype)).reshape(buf.shape).copy()
                       for i, buf in stream.buffers_of(BufferKind.OUTPUT)}
        if any(overflows):
            return outputs, run_stats(stream, config, self.slots, overflows)
        return outputs, self._stats


def prepare_stream(stream: CommandStream, config: NpuConfig | None = None) -> PreparedStream:
    """Validate and prepare ``stream`` for ``config`` (default: the stream's own); raises ``StreamError``."""
    return PreparedStream(stream, config or stream.config)


_RECENT: OrderedDict[tuple[int, NpuConfig], PreparedStream] = OrderedDict()
_RECENT_LIMIT = 4
"""Prepared streams :func:`recently_prepared` keeps (each holds its stream, so no id is reused while kept)."""
_RECENT_LOCK = threading.Lock()


def recently_prepared(stream: CommandStream, config: NpuConfig) -> PreparedStream:
    """The :class:`PreparedStream` of this very stream object on ``config``, kept for the last few streams run:
    a caller that runs one stream object repeatedly (:func:`simulator.machine.run_stream` in a loop) prepares it
    once. Keyed by identity, since a stream's equality would hash every command."""
    key = (id(stream), config)
    with _RECENT_LOCK:
        prepared = _RECENT.get(key)
        if prepared is not None and prepared.stream is stream:
            _RECENT.move_to_end(key)
            return prepared
    prepared = prepare_stream(stream, config)
    with _RECENT_LOCK:
        _RECENT[key] = prepared
        _RECENT.move_to_end(key)
        while len(_RECENT) > _RECENT_LIMIT:
            _RECENT.popitem(last=False)
    return prepared
