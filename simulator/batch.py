"""Running one command stream on many inputs at once, bit-exactly as many separate runs.

A stream's commands do not depend on the data, so N runs of it are the same
commands applied to N memories. :func:`run_stream_batch` keeps the N memories
side by side (SRAM ``[N, bytes]``, every non-constant DRAM buffer ``[N, bytes]``,
constant buffers once) and executes each command once for all of them: a DMA
is one strided copy, a MAC-array command one set of matrix multiplies over all
samples' pixels (:func:`simulator.kernels.mac_output`), an elementwise command one
computation over all samples' elements, and a run of one-byte DMAs
that transposes a layout one channel at a time is one copy (:func:`_transpose_runs`). Any other opcode runs
its ordinary kernel once per sample on that sample's memories, so every opcode
is supported and each result is, by construction, the single run's.

A MAC command reads its weights and scale/bias table once for all samples, which
is only right if those SRAM bytes are equal in every sample. The runner knows
which are: a byte is *uniform* when it was last written by a DMA from a constant
buffer (or from uniform SRAM); any other write clears the mark. A MAC command
whose weights or table are not uniform runs per sample.

Costs come from the commands alone (:mod:`simulator.cycles`), as in
:func:`simulator.machine.run_stream`; the statistics are one run's, with each
command's accumulator overflows summed over the batch.

A stream run on many batches (calibration runs each layer's on a few) is prepared
once (:class:`PreparedBatch`): validated, its DMA runs fused, its constant-weight
MAC commands given their converted weights and bias-folded requantizer
(:class:`_ConstantMac`), its elementwise commands a table of every input pair; its
runs return the values and overflow counts without scheduling the stream.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from . import elementwise
from .config import NpuConfig
from .errors import ExecutionError
from .isa import (ActivationType, BufferKind, CommandStream, Convolution, DmaCopy, Elementwise, MemorySpace, Opcode,
                  scale_bias_bytes, scale_bias_words, weight_shape)
from .kernels import MAC_CHUNK, MachineState, mac_output
from .mac_plans import MacConstants, constant_operands, exact_float_path
from .machine import RunStats, run_stats
from .macs import centred_input, sum_dtype
from .opcodes import opcode_def
from .prepared import ELEMENTWISE_OPCODES, PairTables, lookup_pairs
from .stream import decode_stream
from .timeline import schedule
from .validate import validate_stream


def _rows(memory: np.ndarray, offset: int, rows: int, stride: int, row_bytes: int) -> np.ndarray:
    """``rows`` x ``row_bytes`` at ``offset`` of a memory: ``[rows, bytes]`` of a shared one (1-D), ``[N, rows,
    bytes]`` of a batched one (2-D); rows of one byte (a layout transpose, channel by channel) without that last
    axis, which numpy would otherwise walk one element at a time."""
    if row_bytes == 1:
        if memory.ndim == 1:
            return np.lib.stride_tricks.as_strided(memory[offset:], shape=(rows,), strides=(stride,),
                                                   writeable=memory.flags.writeable)
        return np.lib.stride_tricks.as_strided(memory[:, offset:], shape=(memory.shape[0], rows),
                                               strides=(memory.strides[0], stride), writeable=True)
    if memory.ndim == 1:
        return np.lib.stride_tricks.as_strided(memory[offset:], shape=(rows, row_bytes), strides=(stride, 1),
                                               writeable=memory.flags.writeable)
    return np.lib.stride_tricks.as_strided(memory[:, offset:], shape=(memory.shape[0], rows, row_bytes),
                                           strides=(memory.strides[0], stride, 1), writeable=True)


def _zeros(shape: tuple[int, ...], empty) -> np.ndarray:
    if empty is None:
        return np.zeros(shape, np.uint8)
    memory = empty(shape, np.uint8)
    memory.fill(0)
    return memory


class _BatchState:
    def __init__(self, stream: CommandStream, inputs: Mapping[str, np.ndarray], config: NpuConfig, empty=None):
        declared = {b.name: (i, b) for i, b in stream.buffers_of(BufferKind.INPUT)}
        missing, extra = sorted(set(declared) - set(inputs)), sorted(set(inputs) - set(declared))
        if missing or extra:
            raise ExecutionError(f"inputs do not match the stream: missing {missing}, unexpected {extra}")
        sizes = {len(np.asarray(v)) if np.ndim(v) else 0 for v in inputs.values()}
        if len(sizes) != 1 or 0 in sizes:
            raise ExecutionError("batched inputs must all have the same, non-zero length on axis 0")
        self.batch = sizes.pop()
        loaded = {}
        for name, (index, buf) in declared.items():
            value = np.asarray(inputs[name])
            if value.dtype != np.dtype(buf.dtype) or tuple(value.shape[1:]) != tuple(buf.shape):
                raise ExecutionError(f"input {name!r} must be a batch of {buf.dtype}{list(buf.shape)}, "
                                     f"got {value.dtype}{list(value.shape)}")
            data = np.ascontiguousarray(value).reshape(self.batch, -1).view(np.uint8)
            loaded[index] = data.copy() if empty is None else _copied(data, empty)
        self.dram = []
        for index, buf in enumerate(stream.buffers):
            if buf.kind == BufferKind.CONSTANT:
                self.dram.append(np.frombuffer(buf.data, dtype=np.uint8))
            else:
                self.dram.append(loaded[index] if index in loaded else _zeros((self.batch, buf.size), empty))
        self.sram = _zeros((self.batch, config.sram_bytes), empty)
        self.uniform = np.zeros(config.sram_bytes, dtype=bool)
        self.samples = [MachineState(sram=self.sram[n], dram=[d if d.ndim == 1 else d[n] for d in self.dram])
                        for n in range(self.batch)]

    def is_uniform(self, address: int, size: int) -> bool:
        return bool(self.uniform[address:address + size].all())


def _copied(data: np.ndarray, empty) -> np.ndarray:
    memory = empty(data.shape, data.dtype)
    memory[...] = data
    return memory


def _dma(state: _BatchState, opcode: Opcode, dma: DmaCopy, config: NpuConfig) -> int:
    src = state.sram if dma.src_space == MemorySpace.SRAM else state.dram[dma.src_buffer]
    dst = state.sram if dma.dst_space == MemorySpace.SRAM else state.dram[dma.dst_buffer]
    data = _rows(src, dma.src_offset, dma.rows, dma.src_stride, dma.row_bytes)
    if src is dst:
        data = data.copy()  # source and destination may overlap, as in the single run
    if dma.dst_space == MemorySpace.SRAM:
        if dma.src_space == MemorySpace.SRAM:
            same = _rows(state.uniform, dma.src_offset, dma.rows, dma.src_stride, dma.row_bytes).copy()
        else:
            same = src.ndim == 1
        _rows(state.uniform, dma.dst_offset, dma.rows, dma.dst_stride, dma.row_bytes)[...] = same
    _rows(dst, dma.dst_offset, dma.rows, dma.dst_stride, dma.row_bytes)[...] = data
    return 0


def _mac(state: _BatchState, opcode: Opcode, conv, config: NpuConfig):
    """A MAC-array command for every sample in one call; None when its weights differ between samples."""
    if not _uniform_operands(state, opcode, conv):
        return None
    shape = weight_shape(opcode, conv)
    weight_bytes = int(np.prod(shape))
    table_bytes = scale_bias_bytes(conv)
    sram0 = state.sram[0]
    weights = sram0[conv.weights_address:conv.weights_address + weight_bytes].view(np.int8).reshape(shape)
    table = scale_bias_words(sram0[conv.scale_bias_address:conv.scale_bias_address + table_bytes], conv)
    ifm = conv.ifm
    x = state.sram[:, ifm.address:ifm.address + ifm.nbytes].view(ifm.numpy_dtype).reshape(
        state.batch, ifm.height, ifm.width, ifm.channels)
    out, overflows = mac_output(opcode, conv, config, x, weights, table)
    state.sram[:, conv.ofm.address:conv.ofm.address + conv.ofm.nbytes] = out.reshape(state.batch, -1).view(np.uint8)
    return overflows


def _byte_rows(command) -> DmaCopy | None:
    payload = command.payload
    return payload if command.opcode == Opcode.DMA_COPY and payload.row_bytes == 1 else None


def _transpose_runs(commands) -> dict[int, int]:
    """Runs of consecutive one-byte-row DMAs that are one 2-D gather between two memories (a layout transpose,
    channel by channel): start index -> end index, for runs of two or more.

    Consecutive commands fuse when they copy between the same two distinct memories with the same rows and
    strides, their offsets advance by constant steps, and no two of their destination bytes coincide (one of the
    two destination strides spans the other's whole range): then no command reads what another writes, and the
    order of the writes cannot matter.
    """
    runs, start = {}, 0
    while start < len(commands):
        first = _byte_rows(commands[start])
        end = start + 1
        one_memory = first is not None and first.src_space == first.dst_space and (
            first.src_space == MemorySpace.SRAM or first.src_buffer == first.dst_buffer)
        if first is not None and not one_memory:
            key = (first.src_space, first.src_buffer, first.dst_space, first.dst_buffer, first.rows, first.src_stride,
                   first.dst_stride)
            steps = None
            while end < len(commands):
                nxt, prev = _byte_rows(commands[end]), commands[end - 1].payload
                if nxt is None or (nxt.src_space, nxt.src_buffer, nxt.dst_space, nxt.dst_buffer, nxt.rows,
                                   nxt.src_stride, nxt.dst_stride) != key:
                    break
                step = (nxt.src_offset - prev.src_offset, nxt.dst_offset - prev.dst_offset)
                if steps is None:
                    steps = step
                elif step != steps:
                    break
                end += 1
            count = end - start
            if count > 1:
                dst_step, dst_stride = steps[1], first.dst_stride
                span_rows = (first.rows - 1) * dst_stride if first.rows > 1 else 0
                if dst_step > 0 and (first.rows == 1 or dst_stride > 0) and (
                        dst_step > span_rows or dst_stride > (count - 1) * dst_step):
                    runs[start] = end
                else:
                    end = start + 1
        start = end
    return runs


def _grid(memory: np.ndarray, offset: int, count: int, step: int, rows: int, stride: int) -> np.ndarray:
    """``count`` x ``rows`` bytes at ``offset + i * step + r * stride``, with the batch axis first if any."""
    if memory.ndim == 1:
        return np.lib.stride_tricks.as_strided(memory[offset:], shape=(count, rows), strides=(step, stride),
                                               writeable=memory.flags.writeable)
    return np.lib.stride_tricks.as_strided(memory[:, offset:], shape=(memory.shape[0], count, rows),
                                           strides=(memory.strides[0], step, stride), writeable=True)


def _fused_dma(state: _BatchState, payloads: list[DmaCopy]) -> None:
    """The DMAs of one :func:`_transpose_runs` run as one copy, sample by sample (each sample's source is read
    while it is in cache, where one DMA at a time would stream the whole batch through it per channel)."""
    first, count = payloads[0], len(payloads)
    src_step = payloads[1].src_offset - first.src_offset
    dst_step = payloads[1].dst_offset - first.dst_offset
    src = state.sram if first.src_space == MemorySpace.SRAM else state.dram[first.src_buffer]
    dst = state.sram if first.dst_space == MemorySpace.SRAM else state.dram[first.dst_buffer]
    data = _grid(src, first.src_offset, count, src_step, first.rows, first.src_stride)
    if first.dst_space == MemorySpace.SRAM:  # the source is DRAM (distinct memories): uniform if constant
        _grid(state.uniform, first.dst_offset, count, dst_step, first.rows, first.dst_stride)[...] = src.ndim == 1
    _grid(dst, first.dst_offset, count, dst_step, first.rows, first.dst_stride)[...] = data


ELEMENTWISE_CHUNK = 1 << 18
"""Elements a batched elementwise command computes at a time."""


def _elementwise(state: _BatchState, opcode: Opcode, op, config: NpuConfig):
    """ADD, SUB or MUL for every sample in one call (each output element depends on its two inputs alone);
    None for operands of unequal sizes."""
    if op.ifm.nbytes != op.ifm2.nbytes or op.ofm.nbytes != op.ifm.nbytes:
        return None
    x1 = state.sram[:, op.ifm.address:op.ifm.address + op.ifm.nbytes].view(np.int8)
    x2 = state.sram[:, op.ifm2.address:op.ifm2.address + op.ifm2.nbytes].view(np.int8)
    out = state.sram[:, op.ofm.address:op.ofm.address + op.ofm.nbytes].view(np.int8)
    step = max(1, ELEMENTWISE_CHUNK // op.ofm.nbytes)  # a few samples at a time: temporaries the allocator reuses
    for start in range(0, state.batch, step):
        part = slice(start, start + step)
        out[part] = elementwise.compute(opcode, x1[part].reshape(-1), x2[part].reshape(-1), op).reshape(
            out[part].shape)
    return 0


BATCHED = {Opcode.DMA_COPY: _dma, Opcode.CONV2D: _mac, Opcode.DEPTHWISE_CONV2D: _mac, Opcode.FULLY_CONNECTED: _mac,
           Opcode.ADD: _elementwise, Opcode.SUB: _elementwise, Opcode.MUL: _elementwise}
"""Opcodes executed once for the whole batch; the others run their kernel per sample."""


def _per_sample(state: _BatchState, command, config: NpuConfig) -> int:
    execute = opcode_def(command.opcode).execute
    return sum(execute(sample, command.opcode, command.payload, config) for sample in state.samples)


class _ConstantMac:
    """A MAC-array command whose weights and scale/bias table are the same in every run
    (:func:`simulator.mac_plans.constant_operands`), for a whole batch: its weights converted once
    (:class:`simulator.macs.SumPlan`) and its ``TFLITE_DOUBLE`` int8 output stage, bias folded in, one
    :class:`simulator.numerics.Float64Requantizer`.

    Where the batch's largest ``|x - zp|`` times each channel's ``sum(|w|)`` (plus its bias) fits the accumulator
    and the requantizer's exact range, no accumulator overflows and the float sums (exact in the type
    :func:`simulator.macs.sum_dtype` picks from that bound) are requantized as they are: the kernel's integers
    without its bias add, register narrowing and second pass over the sums. Anything else (another output
    stage, a bound past those limits) returns None: the caller runs :func:`simulator.kernels.mac_output`."""

    def __init__(self, opcode: Opcode, conv: Convolution, config: NpuConfig, weights: np.ndarray, table: np.ndarray):
        self.conv = conv
        constants = MacConstants.of(opcode, conv, config, weights, table)
        self.sums, self.bias, self.register_max = constants.sums, constants.bias, constants.register_max
        self.requantizer = constants.requantizer
        self.tiles: dict = {}
        """The requantizer's per-channel constants tiled to a whole block (:meth:`Float64Requantizer.bind`): one
        numpy loop per block instead of one per pixel, which a layer of few channels pays for on every pixel.
        Shared by the threads running one batch: an entry is never changed once made, so a race makes it twice."""

    def __call__(self, x: np.ndarray) -> np.ndarray | None:
        """The int8 outputs ``[N, OH, OW, OC]`` of the inputs ``x [N, H, W, IC]``, or None (class docstring)."""
        if self.requantizer is None or x.size == 0:
            return None
        zp = self.conv.input_zero_point
        largest = max(abs(int(x.max()) - zp), abs(int(x.min()) - zp))
        exact, fold = exact_float_path(largest * self.sums.weight_bounds, self.bias, self.register_max,
                                       self.requantizer)
        if not exact:
            return None
        dtype = sum_dtype(largest * self.sums.weight_bound)  # below the requantizer's limits: a float type
        ofm = self.conv.ofm
        out = np.empty((len(x), ofm.height, ofm.width, ofm.channels), np.int8)
        step = max(1, MAC_CHUNK // ofm.size)
        for start in range(0, len(x), step):
            part = slice(start, start + step)
            exact = self.sums.sums(centred_input(x[part], zp, self.conv.padding, dtype))
            self.requantizer.bind(exact, out[part], tiles=self.tiles, fold=fold)()
        return out


def _constant_mac(state: _BatchState, conv: Convolution, plan: _ConstantMac) -> int | None:
    """:func:`_mac` through the command's :class:`_ConstantMac`; None where the plan declines."""
    ifm = conv.ifm
    x = state.sram[:, ifm.address:ifm.address + ifm.nbytes].view(ifm.numpy_dtype).reshape(
        state.batch, ifm.height, ifm.width, ifm.channels)
    out = plan(x)
    if out is None:
        return None
    state.sram[:, conv.ofm.address:conv.ofm.address + conv.ofm.nbytes] = out.reshape(state.batch, -1).view(np.uint8)
    return 0


def _table_elementwise(state: _BatchState, op: Elementwise, table: np.ndarray) -> int:
    """An int8 ADD, SUB or MUL through the table of its result for every input pair (made once per command from
    its own arithmetic, :func:`simulator.elementwise.compute`): each output byte is ``table[a * 256 + b]``."""
    n = op.ofm.nbytes
    x1 = state.sram[:, op.ifm.address:op.ifm.address + n]
    x2 = state.sram[:, op.ifm2.address:op.ifm2.address + n]
    out = state.sram[:, op.ofm.address:op.ofm.address + n]
    step = max(1, ELEMENTWISE_CHUNK // n)
    pairs = np.empty((min(step, state.batch), n), np.uint16)
    for start in range(0, state.batch, step):
        part = slice(start, start + step)
        lookup_pairs(x1[part], x2[part], table, out[part], pairs[:len(x1[part])])
    return 0


def _pairable(op: Elementwise) -> bool:
    """Whether the table step can run the command: int8 operands and result of one size, paired element by
    element (the table holds the result byte of every input pair, :func:`simulator.prepared.pair_table`)."""
    return op.ifm.nbytes == op.ifm2.nbytes == op.ofm.nbytes and all(
        f.dtype == ActivationType.INT8 for f in (op.ifm, op.ifm2, op.ofm))


class PreparedBatch:
    """A stream validated once and run on many batches (:meth:`run`): what does not depend on the data is worked
    out here, once: the DMA runs that fuse (:func:`_transpose_runs`), each constant-weight MAC command's
    :class:`_ConstantMac`, each elementwise command's table. A caller that needs only the values (calibration)
    skips the schedule and its statistics; :func:`run_stream_batch` adds them.

    :meth:`run` keeps its memories to itself, so several threads may run one prepared batch at once."""

    def __init__(self, stream: CommandStream | bytes, config: NpuConfig | None = None):
        if not isinstance(stream, CommandStream):
            stream = decode_stream(stream)
        self.stream, self.config = stream, config or stream.config
        validate_stream(stream, self.config)
        self.runs = _transpose_runs(stream.commands)
        self.macs = {index: _ConstantMac(stream.commands[index].opcode, stream.commands[index].payload, self.config,
                                         *operands)
                     for index, operands in constant_operands(stream, self.config).items()}
        shared = PairTables()
        self.tables = {index: shared.get(c.opcode, c.payload)[0] for index, c in enumerate(stream.commands)
                       if c.opcode in ELEMENTWISE_OPCODES and _pairable(c.payload)}

    def run(self, inputs: Mapping[str, np.ndarray], empty=None) -> tuple[dict[str, np.ndarray], list[int]]:
        """Outputs by name (``[N, *shape]`` each) and each command's accumulator overflows summed over the batch:
        equal to N runs of :func:`simulator.machine.run_stream`. ``empty(shape, dtype)``, if given, allocates
        the run's memories (the batch's DRAM buffers and SRAM images, zeroed here), and the outputs are views of
        them: a caller running many batches hands out memory it reuses (calibration's pool), where each run's
        ``np.zeros`` of a hundred SRAM images was fresh memory, faulted in and zeroed again."""
        stream, config = self.stream, self.config
        state = _BatchState(stream, inputs, config, empty)
        counts = []
        fused_until = 0
        for index, command in enumerate(stream.commands):
            if index in self.runs:
                fused_until = self.runs[index]
                _fused_dma(state, [c.payload for c in stream.commands[index:fused_until]])
            overflows = None
            if index < fused_until:
                overflows = 0
            elif index in self.tables:
                overflows = _table_elementwise(state, command.payload, self.tables[index])
            else:
                plan = self.macs.get(index)
                if plan is not None and _uniform_operands(state, command.opcode, command.payload):
                    overflows = _constant_mac(state, command.payload, plan)
                if overflows is None:
                    batched = BATCHED.get(command.opcode)
                    overflows = batched(state, command.opcode, command.payload, config) if batched else None
            if overflows is None:
                overflows = _per_sample(state, command, config)
                ofm = getattr(command.payload, "ofm", None)
                if ofm is None:
                    state.uniform[:] = False
                else:
                    state.uniform[ofm.address:ofm.address + ofm.nbytes] = False
            elif command.opcode != Opcode.DMA_COPY:
                ofm = command.payload.ofm
                state.uniform[ofm.address:ofm.address + ofm.nbytes] = False
            counts.append(int(overflows))
        outputs = {buf.name: state.dram[i].view(np.dtype(buf.dtype)).reshape((state.batch, *buf.shape))
                   for i, buf in stream.buffers_of(BufferKind.OUTPUT)}
        return ({name: value.copy() for name, value in outputs.items()} if empty is None else outputs), counts


def _uniform_operands(state: _BatchState, opcode: Opcode, conv: Convolution) -> bool:
    """The command's weights and scale/bias table are equal in every sample."""
    return (state.is_uniform(conv.weights_address, int(np.prod(weight_shape(opcode, conv))))
            and state.is_uniform(conv.scale_bias_address, scale_bias_bytes(conv)))


def run_stream_batch(stream: CommandStream | bytes, inputs: Mapping[str, np.ndarray],
                     config: NpuConfig | None = None) -> tuple[dict[str, np.ndarray], RunStats]:
    """Execute a stream on a batch of inputs: ``inputs[name]`` is ``[N, *shape]``; outputs likewise.

    Equal, output for output, to N calls of :func:`simulator.machine.run_stream`. The statistics are those of
    one run (costs do not depend on the data) with each command's overflows summed over the N runs. A stream run
    on many batches is better prepared once (:class:`PreparedBatch`).
    """
    prepared = PreparedBatch(stream, config)
    outputs, counts = prepared.run(inputs)
    return outputs, run_stats(prepared.stream, prepared.config, schedule(prepared.stream, prepared.config), counts)
