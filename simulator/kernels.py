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

Products are summed by :mod:`simulator.macs` in float32 or float64 matrix
multiplies, whichever is exact for the command's actual values (its docstring
argues the bound), or in int64. The 16x8 CONV2D (int16 activations, zero point 0)
has 48-bit accumulators and TFLite's int64 output stage
(:func:`simulator.numerics.requantize_16x8`), as the ISA's ``ACTIVATION_FORMATS`` say.

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
from .isa import (ACTIVATION_FORMATS, DOUBLE_SCALE_ROUNDINGS, ActivationType, Convolution, DmaCopy, Elementwise,
                  FeatureMap, MatMul, MemorySpace, Opcode, Pooling, Reduction, Resize, Softmax, TableLookup,
                  scale_bias_bytes, scale_bias_words, weight_shape)
from .macs import conv2d_sums, depthwise_sums, exact_sums, fully_connected_sums, sum_bound, sum_dtype
from .numerics import Rounding, narrow_accumulator, requantize, requantize_16x8, requantize_float
from .onnxruntime_numerics import ort_avg_pool, ort_mean
from .resize import resize_bilinear
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


MAC_CHUNK = 1 << 18
"""Outputs a batched MAC command computes at a time: its float64 sums then fit buffers the allocator reuses."""


def mac_output(opcode: Opcode, conv: Convolution, config: NpuConfig, ifm: np.ndarray, weights: np.ndarray,
               table: np.ndarray) -> tuple[np.ndarray, int]:
    """A MAC-array command's output tile from its operands (``ifm`` may carry leading batch axes): the exact
    sums (:mod:`simulator.macs`) plus bias into the accumulator register, then the output stage; and how many
    accumulators overflowed."""
    bias = table[:, 0]
    # One exact type for the whole command: its bound covers every sample (and leaves room for the bias).
    bound = sum_bound(ifm, conv.input_zero_point, weights) + int(np.abs(bias.astype(np.int64)).max(initial=0))
    dtype = sum_dtype(bound)
    samples = ifm.reshape(-1, *ifm.shape[-3:])
    step = max(1, MAC_CHUNK // conv.ofm.size)  # a batch, a few samples at a time
    parts, overflows = [], 0
    for start in range(0, len(samples), step):
        exact = exact_sums(opcode, conv, samples[start:start + step], weights, dtype=dtype)
        exact += bias  # exact in the sums' own type
        out, count = mac_register_output(exact, conv, config, table)
        parts.append(out)
        overflows += count
    out = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out.reshape(*ifm.shape[:-3], *out.shape[1:]), overflows


def mac_register_output(exact: np.ndarray, conv: Convolution, config: NpuConfig, table: np.ndarray,
                        largest: int | None = None) -> tuple[np.ndarray, int]:
    """What a MAC-array command writes from its exact accumulator values (sums plus bias, ``[..., OC]``, in any
    exact type): the register's width and overflow mode (``accumulator_bits`` wide, 48 bits for 16x8), then the
    output stage; and how many accumulators overflowed. Calibration computes the sums of a whole layer its own
    way and hands them here, so that its outputs are this stage's, not a copy of it. ``largest``: ``max|exact|``
    when the caller knows it (a bound that is not attained would do too): the register and the stage then skip
    their scans of the values."""
    bits = ACTIVATION_FORMATS[conv.ifm.dtype].accumulator_bits or config.accumulator_bits
    if largest is not None and largest < 1 << (bits - 1):
        acc, count = exact, 0  # the register holds every value
    else:
        acc, count = narrow_accumulator(exact, bits, config.accumulator_overflow)
        largest = None
    return OUTPUT_STAGES[conv.ofm.dtype](acc, table, conv, largest), count


def _run_convolution(state: MachineState, opcode: Opcode, conv: Convolution, config: NpuConfig) -> int:
    ifm = _read(state, conv.ifm.address, (conv.ifm.height, conv.ifm.width, conv.ifm.channels), conv.ifm.numpy_dtype)
    weights = _read(state, conv.weights_address, weight_shape(opcode, conv), np.int8)
    table = scale_bias_words(_read(state, conv.scale_bias_address, (scale_bias_bytes(conv),), np.uint8), conv)
    out, overflows = mac_output(opcode, conv, config, ifm, weights, table)
    state.sram[conv.ofm.address:conv.ofm.address + conv.ofm.nbytes] = out.reshape(-1).view(np.uint8)
    return overflows


def _int8_output_stage(acc: np.ndarray, table: np.ndarray, conv: Convolution, largest: int | None = None
                       ) -> np.ndarray:
    if conv.rounding in DOUBLE_SCALE_ROUNDINGS:
        scales = np.ascontiguousarray(table[:, 1:3]).view(np.float64).reshape(-1)
        return requantize_float(acc, scales, conv.output_zero_point, conv.act_min, conv.act_max, conv.rounding)
    return requantize(acc, table[:, 1].astype(np.int64), table[:, 2].astype(np.int64),
                      conv.output_zero_point, conv.act_min, conv.act_max, conv.rounding, largest=largest)


def _int16_output_stage(acc: np.ndarray, table: np.ndarray, conv: Convolution, largest: int | None = None
                        ) -> np.ndarray:
    return requantize_16x8(acc, table[:, 1], table[:, 2], conv.output_zero_point, conv.act_min, conv.act_max)


OUTPUT_STAGES = {ActivationType.INT8: _int8_output_stage, ActivationType.INT16: _int16_output_stage}
"""The MAC array's output stage by ofm element type: int8 as the command's rounding says; int16 TFLite's
16x8 stage (one variant: both TFLite builds share it)."""


def mac_kernel(sums):
    """The kernel of a MAC-array opcode: its exact sums, then the shared output stage."""

    def run(state: MachineState, opcode: Opcode, conv: Convolution, config: NpuConfig) -> int:
        return _run_convolution(state, opcode, conv, config)

    run.__doc__ = sums.__doc__
    return run


run_conv2d = mac_kernel(conv2d_sums)
run_depthwise_conv2d = mac_kernel(depthwise_sums)
run_fully_connected = mac_kernel(fully_connected_sums)


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


def run_resize_bilinear(state: MachineState, opcode: Opcode, op: Resize, config: NpuConfig) -> int:
    """TFLite's reference int8 RESIZE_BILINEAR (``ResizeBilinearInteger``, :mod:`simulator.resize`) of one
    tile on the pooling unit: a 2x2 window of fixed-point weights per output pixel, no accumulator register."""
    _write(state, op.ofm, resize_bilinear(_fmap(state, op.ifm), op.ofm.height, op.ofm.width, op.step_h, op.step_w,
                                          op.offset_h, op.offset_w, op.rounding))
    return 0


def run_batch_matmul(state: MachineState, opcode: Opcode, op: MatMul, config: NpuConfig) -> int:
    """TFLite's reference int8 BATCH_MATMUL (``reference_ops::BatchMatMul``): per batch, the sum over the
    shared axis of ``(lhs - zp) * (rhs - zp2)`` into the accumulator register, then the output stage.
    Products are summed with float64 matrix multiplies, exact as in the convolutions (see the module
    docstring)."""
    lhs = _fmap(state, op.ifm).astype(np.float64) - op.input_zero_point
    rhs = _fmap(state, op.ifm2).astype(np.float64) - op.input2_zero_point
    exact = np.matmul(lhs, np.swapaxes(rhs, 1, 2) if op.adj_y else rhs).astype(np.int64)
    acc, overflows = narrow_accumulator(exact, config.accumulator_bits, config.accumulator_overflow)
    _write(state, op.ofm, requantize(acc, op.output_multiplier, op.output_shift, op.output_zero_point, op.act_min,
                                     op.act_max, op.rounding))
    return overflows
