"""Bit-exact execution of each opcode on the simulated memories.

Convolution follows TFLite's reference integer kernels
(reference_integer_ops/conv.h, depthwise_conv.h, fully_connected.h):
``acc = bias + sum((x - input_zero_point) * w)`` in wide integers, written to an
accumulator register of ``NpuConfig.accumulator_bits`` (wrapped or saturated as
``NpuConfig.accumulator_overflow`` says), then the numerics module's output
stage. Padding is filled with the input zero point, i.e. contributes nothing to
the sum.

Every kernel returns how many output elements overflowed their accumulator
(:func:`simulator.numerics.narrow_accumulator`): the MAC array's kernels
(CONV2D, DEPTHWISE_CONV2D, FULLY_CONNECTED, MEAN) and AVG_POOL2D's window sum
have one; the others return 0, and so do MEAN and AVG_POOL2D under
``Rounding.ONNXRUNTIME``, which compute in float32.

Products are summed with float64 matrix multiplies for speed: every term is an
integer below 2**16 in magnitude, so partial sums stay exact while fewer than
2**37 terms are added, far beyond any legal kernel.

Commands with ``Rounding.ONNXRUNTIME`` reproduce onnxruntime's QDQ execution
instead (:mod:`simulator.numerics`): the elementwise, pooling and mean units
compute in float32 in MLAS's order; the MAC array keeps its integer
accumulator and rounds ``acc * scale`` half to even.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import elementwise
from .config import NpuConfig
from .isa import (SCALE_BIAS_WORDS, Convolution, DmaCopy, Elementwise, FeatureMap, MemorySpace, Opcode, Pooling,
                  Reduction, Softmax, TableLookup, weight_shape)
from .numerics import Rounding, narrow_accumulator, requantize, requantize_float
from .onnxruntime_numerics import ort_avg_pool, ort_mean
from .softmax import softmax


@dataclass
class MachineState:
    """The memories a stream runs against: SRAM and one byte array per DRAM buffer."""

    sram: np.ndarray
    dram: list[np.ndarray]


def _rows(memory: np.ndarray, offset: int, rows: int, stride: int, row_bytes: int) -> np.ndarray:
    if rows == 1:
        return memory[offset:offset + row_bytes].reshape(1, row_bytes)
    return np.lib.stride_tricks.as_strided(memory[offset:], shape=(rows, row_bytes),
                                           strides=(stride, 1), writeable=True)


def run_dma(state: MachineState, opcode: Opcode, dma: DmaCopy, config: NpuConfig) -> int:
    src = state.sram if dma.src_space == MemorySpace.SRAM else state.dram[dma.src_buffer]
    dst = state.sram if dma.dst_space == MemorySpace.SRAM else state.dram[dma.dst_buffer]
    data = _rows(src, dma.src_offset, dma.rows, dma.src_stride, dma.row_bytes).copy()
    _rows(dst, dma.dst_offset, dma.rows, dma.dst_stride, dma.row_bytes)[...] = data
    return 0


def _read(state: MachineState, address: int, shape: tuple[int, ...], dtype) -> np.ndarray:
    count = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return state.sram[address:address + count].view(dtype).reshape(shape)


def _padded_input(state: MachineState, conv: Convolution) -> np.ndarray:
    """ifm minus its zero point, zero-padded: the TFLite ``input + input_offset`` term."""
    ifm = _read(state, conv.ifm.address, (conv.ifm.height, conv.ifm.width, conv.ifm.channels), np.int8)
    pt, pl, pb, pr = conv.padding
    return np.pad(ifm.astype(np.float64) - conv.input_zero_point, ((pt, pb), (pl, pr), (0, 0)))


def _windows(x: np.ndarray, conv: Convolution):
    """Yield (ky, kx, strided input slice of shape [OH, OW, C]) for every kernel tap."""
    (kh, kw), (sh, sw), (dh, dw) = conv.kernel, conv.stride, conv.dilation
    oh, ow = conv.ofm.height, conv.ofm.width
    for ky in range(kh):
        for kx in range(kw):
            y0, x0 = ky * dh, kx * dw
            yield ky, kx, x[y0:y0 + (oh - 1) * sh + 1:sh, x0:x0 + (ow - 1) * sw + 1:sw, :]


def _accumulate_conv2d(x: np.ndarray, weights: np.ndarray, conv: Convolution) -> np.ndarray:
    """CONV2D: every output channel sums over all input channels of every kernel tap."""
    acc = np.zeros((conv.ofm.height, conv.ofm.width, conv.ofm.channels), dtype=np.float64)
    for ky, kx, window in _windows(x, conv):
        acc += window @ weights[:, ky, kx, :].T
    return acc


def _accumulate_depthwise(x: np.ndarray, weights: np.ndarray, conv: Convolution) -> np.ndarray:
    """DEPTHWISE_CONV2D: each output channel sums over its input channel's kernel taps only; with a channel
    multiplier m (ofm channels = m * ifm channels) output channel o reads input channel o // m."""
    multiplier = conv.ofm.channels // conv.ifm.channels
    acc = np.zeros((conv.ofm.height, conv.ofm.width, conv.ofm.channels), dtype=np.float64)
    for ky, kx, window in _windows(x, conv):
        acc += (np.repeat(window, multiplier, axis=-1) if multiplier > 1 else window) * weights[:, ky, kx]
    return acc


def _accumulate_fully_connected(x: np.ndarray, weights: np.ndarray, conv: Convolution) -> np.ndarray:
    """FULLY_CONNECTED: one row of the N x IC input against every output channel's weights."""
    return x @ weights.T


DOUBLE_SCALE_ROUNDINGS = (Rounding.FLOAT64, Rounding.ONNXRUNTIME)
"""Modes whose scale/bias table holds a float64 scale per channel instead of (multiplier, shift)."""


def _run_convolution(accumulate, state: MachineState, opcode: Opcode, conv: Convolution, config: NpuConfig) -> int:
    weights = _read(state, conv.weights_address, weight_shape(opcode, conv), np.int8).astype(np.float64)
    table = _read(state, conv.scale_bias_address, (conv.ofm.channels, SCALE_BIAS_WORDS), np.int32)
    bias = table[:, 0].astype(np.int64)
    exact = accumulate(_padded_input(state, conv), weights, conv).astype(np.int64) + bias
    # The adder tree is exact; the register of accumulator_bits receives bias + sum on write-back.
    acc, overflows = narrow_accumulator(exact, config.accumulator_bits, config.accumulator_overflow)
    if conv.rounding in DOUBLE_SCALE_ROUNDINGS:
        scales = np.ascontiguousarray(table[:, 1:3]).view(np.float64).reshape(-1)
        out = requantize_float(acc, scales, conv.output_zero_point, conv.act_min, conv.act_max, conv.rounding)
    else:
        out = requantize(acc, table[:, 1].astype(np.int64), table[:, 2].astype(np.int64),
                         conv.output_zero_point, conv.act_min, conv.act_max, conv.rounding)
    state.sram[conv.ofm.address:conv.ofm.address + conv.ofm.size] = out.reshape(-1).view(np.uint8)
    return overflows


def mac_kernel(accumulate):
    """The kernel of a MAC-array opcode: its accumulation, then the shared output stage."""

    def run(state: MachineState, opcode: Opcode, conv: Convolution, config: NpuConfig) -> int:
        return _run_convolution(accumulate, state, opcode, conv, config)

    run.__doc__ = accumulate.__doc__
    return run


run_conv2d = mac_kernel(_accumulate_conv2d)
run_depthwise_conv2d = mac_kernel(_accumulate_depthwise)
run_fully_connected = mac_kernel(_accumulate_fully_connected)


def _fmap(state: MachineState, fmap: FeatureMap) -> np.ndarray:
    return _read(state, fmap.address, (fmap.height, fmap.width, fmap.channels), np.int8)


def _write(state: MachineState, fmap: FeatureMap, values: np.ndarray) -> None:
    state.sram[fmap.address:fmap.address + fmap.size] = values.astype(np.int8).reshape(-1).view(np.uint8)


def run_elementwise(state: MachineState, opcode: Opcode, op: Elementwise, config: NpuConfig) -> int:
    """ADD, SUB or MUL of two flat operands, as :mod:`simulator.elementwise` defines each."""
    out = elementwise.compute(opcode, _fmap(state, op.ifm).reshape(-1), _fmap(state, op.ifm2).reshape(-1), op)
    _write(state, op.ofm, out)
    return 0


def run_softmax(state: MachineState, opcode: Opcode, op: Softmax, config: NpuConfig) -> int:
    """Every pixel's channels are one row of TFLite's softmax."""
    rows = _fmap(state, op.ifm).reshape(-1, op.ifm.channels)
    _write(state, op.ofm, softmax(rows, op.input_multiplier, op.input_left_shift, op.diff_min,
                                  op.output_zero_point))
    return 0


def run_mean(state: MachineState, opcode: Opcode, op: Reduction, config: NpuConfig) -> int:
    """TFLite ``QuantizedMeanOrSum``: int32 sum, minus zero point * count, one requantization;
    ``Rounding.ONNXRUNTIME``: onnxruntime's float32 global average pool. The MAC array's accumulator
    receives the centred sum of each channel (up to 255 * height * width in magnitude)."""
    ifm = _fmap(state, op.ifm)
    if op.rounding == Rounding.ONNXRUNTIME:
        _write(state, op.ofm, ort_mean(ifm, op.input_scale, op.input_zero_point, op.output_scale,
                                       op.output_zero_point, op.act_min, op.act_max))
        return 0
    count = op.ifm.height * op.ifm.width
    exact = ifm.astype(np.int64).sum(axis=(0, 1)) - op.input_zero_point * count
    total, overflows = narrow_accumulator(exact, config.accumulator_bits, config.accumulator_overflow)
    _write(state, op.ofm, requantize(total, op.multiplier, op.shift, op.output_zero_point, op.act_min,
                                     op.act_max, op.rounding))
    return overflows


def _pool_windows(values: np.ndarray, op: Pooling):
    """Yield the strided [OH, OW, C] slice of a padded tensor for every window tap."""
    for ky in range(op.kernel_h):
        for kx in range(op.kernel_w):
            yield values[ky:ky + (op.ofm.height - 1) * op.stride_h + 1:op.stride_h,
                         kx:kx + (op.ofm.width - 1) * op.stride_w + 1:op.stride_w, :]


def _padded(values: np.ndarray, op: Pooling, fill) -> np.ndarray:
    pads = ((op.pad_top, op.pad_bottom), (op.pad_left, op.pad_right), (0, 0))
    return np.pad(values, pads, constant_values=fill)


def run_max_pool(state: MachineState, opcode: Opcode, op: Pooling, config: NpuConfig) -> int:
    """TFLite reference int8 MaxPool: the largest input inside the image, then the clamp."""
    padded = _padded(_fmap(state, op.ifm).astype(np.int16), op, np.iinfo(np.int16).min)
    out = np.max(np.stack(list(_pool_windows(padded, op))), axis=0)
    _write(state, op.ofm, np.clip(out, op.act_min, op.act_max))
    return 0


def run_avg_pool(state: MachineState, opcode: Opcode, op: Pooling, config: NpuConfig) -> int:
    """TFLite reference int8 AveragePool: sum / count of inputs inside the image, rounded half
    away from zero in integers, then the clamp; ``Rounding.ONNXRUNTIME``: onnxruntime's float32 average.
    The window sum (up to 128 * kernel_h * kernel_w in magnitude) is held in an accumulator register."""
    ifm = _fmap(state, op.ifm)
    if op.rounding == Rounding.ONNXRUNTIME:
        out = ort_avg_pool(ifm, (op.kernel_h, op.kernel_w), (op.stride_h, op.stride_w),
                           (op.pad_top, op.pad_left, op.pad_bottom, op.pad_right), op.input_scale,
                           op.input_zero_point, op.output_scale, op.output_zero_point, op.act_min, op.act_max)
        _write(state, op.ofm, out)
        return 0
    exact = sum(w for w in _pool_windows(_padded(ifm.astype(np.int64), op, 0), op))
    total, overflows = narrow_accumulator(exact, config.accumulator_bits, config.accumulator_overflow)
    count = sum(w for w in _pool_windows(_padded(np.ones((*ifm.shape[:2], 1), np.int64), op, 0), op))
    half = count // 2
    average = np.where(total > 0, (total + half) // count, -((half - total) // count))
    _write(state, op.ofm, np.clip(average, op.act_min, op.act_max))
    return overflows


def run_lut(state: MachineState, opcode: Opcode, op: TableLookup, config: NpuConfig) -> int:
    table = _read(state, op.table_address, (config.lut_entries,), np.int8)
    _write(state, op.ofm, table[_fmap(state, op.ifm).astype(np.int16) + 128])
    return 0
