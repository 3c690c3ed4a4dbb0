"""The canonical parameter records of NPU operators and their attribute encoding.

A matched composite is turned into its record (:class:`ConvParams`,
:class:`ElementwiseParams`, ...) once, by the pattern table's ``extract_*`` functions;
the record is written onto the
composite function as ``npu.*`` attributes, and the codegen rebuilds the
record from those attributes. Nothing downstream re-derives a qparam from the
operator body, so what a user reads on the composite is what runs.

Attribute schema of ``npu.conv2d``, ``npu.depthwise_conv2d`` and
``npu.fully_connected``. The other composites use the same names for the
fields they have (one name per fact across all records), plus
``npu.input2_scale`` / ``npu.input2_zero_point`` for the second operand of
``npu.add``, ``npu.subtract``, ``npu.multiply`` and ``npu.batch_matmul`` (plus its ``npu.ifm2_shape`` and
``npu.adj_y``), ``npu.beta`` for ``npu.softmax``, ``npu.align_corners`` / ``npu.half_pixel_centers`` for
``npu.resize_bilinear`` and ``npu.shape`` for elementwise shapes; qparam-transparent ops
(pooling, reshape, pad, transpose, slices, nearest resize) carry ``npu.input_scale`` ... ``npu.output_zero_point``
where the graph determines them (the dataflow analysis of :mod:`npu_backend.qparams`; equal on both
sides, since these operators cannot change them) and none where it does not. Every composite
also carries ``npu.source_vars``, the bindings of the input graph it absorbed,
and ``npu.operands``: the indices of its parameters in operand order (input,
second input; concat inputs in order; -1 for a constant operand, whose values
the record holds), since a composite's parameters come in order of first use
in its body, which says nothing about their roles.

=========================  ===========================================================
``npu.op``                 operator kind (the :class:`NpuOp` member name, e.g. ``CONV2D``)
``npu.ifm_shape``          input shape (NHWC, or [N, IC] for fully connected)
``npu.ofm_shape``          output shape
``npu.input_scale``        float32 input scale
``npu.input_zero_point``   input zero point
``npu.weight_scales``      float32 tensor, one scale per output channel (repeated if per-tensor)
``npu.weight_zero_points`` int tensor, per output channel (all 0 for int8 TFLite weights)
``npu.weight_axis``        output-channel axis of ``npu.weights`` (always 0)
``npu.per_channel``        whether the source model quantized weights per channel
``npu.weights``            int8 tensor, canonical layout: [OC,KH,KW,IC] / [C,KH,KW] / [OC,IC]
``npu.bias``               int32 tensor [OC] in the accumulator domain (scale = s_in * s_w; a 16x8 model's
                           int64 bias, narrowed exactly by :mod:`npu_backend.tflite_import`)
``npu.output_scale``       float32 output scale
``npu.output_zero_point``  output zero point
``npu.clamp``              (qmin, qmax): the fused activation as an integer clamp
``npu.kernel`` ...         ``npu.strides``, ``npu.dilation``, ``npu.padding`` (top, left, bottom, right)
``npu.rounding``           requantization rounding (``TFLITE_DOUBLE``, ``TFLITE_SINGLE``, ``FLOAT64``,
                           ``ONNXRUNTIME``: see :mod:`npu_backend.reference`)
``npu.activation_type``    ``INT8``, or ``INT16`` for TFLite's 16x8 convolution (int16 in and out)
=========================  ===========================================================
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import get_type_hints

import numpy as np
import tvm

from simulator.isa import ActivationType
from simulator.numerics import Rounding


class NpuOp(str, Enum):
    CONV2D = "conv2d"
    DEPTHWISE_CONV2D = "depthwise_conv2d"
    FULLY_CONNECTED = "fully_connected"
    ADD = "add"
    MEAN = "mean"
    MAX_POOL2D = "max_pool2d"
    AVG_POOL2D = "avg_pool2d"
    RESHAPE = "reshape"
    SIGMOID = "sigmoid"
    TANH = "tanh"
    REQUANTIZE = "requantize"
    CONCAT = "concat"
    PAD = "pad"
    LEAKY_RELU = "leaky_relu"
    HARD_SWISH = "hard_swish"
    SUBTRACT = "subtract"
    MULTIPLY = "multiply"
    SOFTMAX = "softmax"
    TRANSPOSE = "transpose"
    EXP = "exp"
    STRIDED_SLICE = "strided_slice"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    ELU = "elu"
    RESIZE_NEAREST = "resize_nearest"
    RESIZE_BILINEAR = "resize_bilinear"
    BATCH_MATMUL = "batch_matmul"


@dataclass(frozen=True)
class ConvParams:
    """Everything the NPU needs to run one convolution-class operator."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    ofm_shape: tuple[int, ...]
    input_scale: float
    input_zero_point: int
    weight_scales: np.ndarray = field(compare=False, repr=False)
    weight_zero_points: np.ndarray = field(compare=False, repr=False)
    per_channel: bool
    weights: np.ndarray = field(compare=False, repr=False)
    bias: np.ndarray = field(compare=False, repr=False)
    output_scale: float
    output_zero_point: int
    clamp: tuple[int, int]
    kernel: tuple[int, int] = (1, 1)
    strides: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    weight_axis: int = 0
    activation_type: ActivationType = ActivationType.INT8
    """Element type of input and output: int8, or int16 in TFLite's 16x8 mode (int8 weights, zero points 0,
    an int16 clamp, TFLite's int64 output stage; CONV2D only, :func:`npu_backend.legality.sixteen_by_eight`)."""

    @property
    def out_channels(self) -> int:
        return int(self.weights.shape[0])


@dataclass(frozen=True)
class ElementwiseParams:
    """An int8 elementwise ADD, SUB or MUL of two tensors of ``shape`` (either may be a per-channel vector
    broadcast over the rest), requantized to the output."""

    op: NpuOp
    shape: tuple[int, ...]
    input_scale: float
    input_zero_point: int
    input2_scale: float
    input2_zero_point: int
    output_scale: float
    output_zero_point: int
    clamp: tuple[int, int]
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    input2_values: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int8), compare=False, repr=False)
    """The second operand when it is a constant (e.g. ONNX MatMul's bias, added as its own quantized Add),
    broadcast to ``shape``; empty when the graph computes it."""
    broadcast: tuple[int, ...] = ()
    """Indices (0: input, 1: input2) of computed operands that hold one value per channel (shape
    [1, ..., 1, C]) and are broadcast over every other axis, as a squeeze-excite gate is."""


@dataclass(frozen=True)
class MeanParams:
    """An int8 mean over the height and width of an NHWC tensor (TFLite MEAN, axes 1 and 2)."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    ofm_shape: tuple[int, ...]
    input_scale: float
    input_zero_point: int
    output_scale: float
    output_zero_point: int
    rounding: Rounding = Rounding.TFLITE_DOUBLE


@dataclass(frozen=True)
class PoolParams:
    """An int8 max or average pooling; input and output share their qparams (TFLite's rule),
    so the arithmetic needs none."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    ofm_shape: tuple[int, ...]
    kernel: tuple[int, int]
    strides: tuple[int, int]
    padding: tuple[int, int, int, int]
    clamp: tuple[int, int] = (-128, 127)
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    """How an average is computed and rounded: TFLite's integer kernel, or onnxruntime's float32 one."""
    input_scale: float = 0.0
    input_zero_point: int = 0
    output_scale: float = 0.0
    output_zero_point: int = 0
    """Qparams where the graph states them (the QDQ form, or the dataflow analysis); scale 0.0 where it
    does not (a bare int8 pooling of a graph input: the integer result needs none)."""


@dataclass(frozen=True)
class ReshapeParams:
    """An int8 reshape (or squeeze): bytes unchanged, qparams unchanged."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    ofm_shape: tuple[int, ...]


@dataclass(frozen=True)
class LutParams:
    """An elementwise int8 -> int8 function run as a 256-entry table (sigmoid, tanh, hard swish, leaky ReLU,
    requantize)."""

    op: NpuOp
    shape: tuple[int, ...]
    input_scale: float
    input_zero_point: int
    output_scale: float
    output_zero_point: int
    alpha: float = 0.0
    """Negative slope (leaky ReLU only)."""
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    """Which reference the table reproduces: TFLite's integer kernel, or (ONNXRUNTIME) onnxruntime's
    float function of the dequantized input, quantized half to even."""


@dataclass(frozen=True)
class ConcatParams:
    """Concatenation of int8 tensors that share one scale and zero point (TFLite's int8 rule),
    so it only moves bytes."""

    op: NpuOp
    ofm_shape: tuple[int, ...]
    axis: int
    extents: tuple[int, ...]
    """Size of each input along ``axis``, in input order."""
    output_scale: float
    output_zero_point: int


@dataclass(frozen=True)
class PadParams:
    """Spatial constant padding of an int8 NHWC tensor; TFLite pads with the zero point."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    padding: tuple[int, int, int, int]
    """(top, left, bottom, right)"""
    pad_value: int


@dataclass(frozen=True)
class SoftmaxParams:
    """int8 softmax along the last axis; TFLite's kernel fixes the output at scale 1/256, zero point -128."""

    op: NpuOp
    shape: tuple[int, ...]
    input_scale: float
    input_zero_point: int
    output_scale: float
    output_zero_point: int
    beta: float = 1.0
    rounding: Rounding = Rounding.TFLITE_DOUBLE
    """Only TFLite's integer softmax exists on the NPU; onnxruntime's float softmax stays on the host."""


@dataclass(frozen=True)
class TransposeParams:
    """An int8 transpose that is a 2-D transpose of a batch-1 tensor: axes 1..k moved behind the rest
    (NHWC <-> NCHW at the edges of an ONNX graph). Bytes move by strided DMA; qparams unchanged."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    axes: tuple[int, ...]

    @property
    def matrix(self) -> tuple[int, int]:
        """(rows, columns) of the row-major matrix whose transpose this is."""
        k = self.axes[1] - 1
        return math.prod(self.ifm_shape[1:k + 1]), math.prod(self.ifm_shape[k + 1:])


@dataclass(frozen=True)
class SliceParams:
    """A strided slice of a batch-1 NHWC int8 tensor (TFLite STRIDED_SLICE): a strided gather by DMA,
    qparams unchanged."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    ofm_shape: tuple[int, ...]
    begin: tuple[int, ...]
    """First element taken along each of the four axes (non-negative)."""
    strides: tuple[int, ...]
    """Step along each axis (positive)."""


@dataclass(frozen=True)
class ResizeNearestParams:
    """A nearest-neighbour upscale of an int8 NHWC tensor by whole factors: every input pixel repeated
    ``ofm / ifm`` times along height and width (TFLite RESIZE_NEAREST_NEIGHBOR's index map for such sizes,
    with or without half-pixel centres). Bytes move by strided DMA; qparams unchanged."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    ofm_shape: tuple[int, ...]

    @property
    def factors(self) -> tuple[int, int]:
        """(height, width) repetitions."""
        return self.ofm_shape[1] // self.ifm_shape[1], self.ofm_shape[2] // self.ifm_shape[2]


@dataclass(frozen=True)
class ResizeBilinearParams:
    """An int8 bilinear resize of an NHWC tensor (TFLite RESIZE_BILINEAR, its integer reference kernel): the
    raw integers are interpolated, so the output must keep the input's qparams."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    ofm_shape: tuple[int, ...]
    align_corners: bool
    half_pixel_centers: bool
    input_scale: float
    input_zero_point: int
    output_scale: float
    output_zero_point: int
    rounding: Rounding = Rounding.TFLITE_DOUBLE


@dataclass(frozen=True)
class BatchMatMulParams:
    """The product of two int8 activations over their last two axes, batched over the rest (TFLite
    BATCH_MATMUL): ``ifm`` [..., M, K] times ``ifm2`` [..., K, N] (or, with ``adj_y``, ``ifm2`` [..., N, K]
    transposed), requantized per tensor."""

    op: NpuOp
    ifm_shape: tuple[int, ...]
    ifm2_shape: tuple[int, ...]
    ofm_shape: tuple[int, ...]
    adj_y: bool
    input_scale: float
    input_zero_point: int
    input2_scale: float
    input2_zero_point: int
    output_scale: float
    output_zero_point: int
    clamp: tuple[int, int] = (-128, 127)
    rounding: Rounding = Rounding.TFLITE_DOUBLE

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """(batches, M, K, N)."""
        *batch, rows, depth = self.ifm_shape
        return math.prod(batch), rows, depth, self.ofm_shape[-1]


OPERANDS_ATTR = "npu.operands"
"""Composite attribute: parameter indices in operand order (see the module docstring)."""

OPERAND_ROLES = ("input", *(f"input{i}" for i in range(16)))
"""Pattern annotations naming a composite's operands, in operand order (``input2`` is both the second
addend of a binary op and the third input of a concat; no pattern has both)."""


NpuParams = (ConvParams | ElementwiseParams | MeanParams | PoolParams | ReshapeParams | LutParams | ConcatParams
             | PadParams | SoftmaxParams | TransposeParams | SliceParams | ResizeNearestParams | ResizeBilinearParams
             | BatchMatMulParams)

def to_attrs_value(value):
    """One field value as an attribute (float32 scales stay exact)."""
    if isinstance(value, np.ndarray):
        return tvm.runtime.tensor(np.ascontiguousarray(value))
    if isinstance(value, Enum):
        return value.name
    if isinstance(value, bool):
        return tvm.tirx.IntImm("bool", value)
    if isinstance(value, float):
        return tvm.tirx.FloatImm("float32", float(np.float32(value)))
    return value


def to_attrs(params: NpuParams) -> dict[str, object]:
    """Encode a record as ``npu.*`` function attributes."""
    return {f"npu.{f.name}": to_attrs_value(getattr(params, f.name)) for f in fields(params)}


def _decode(kind, raw):
    if kind is np.ndarray:
        return raw.numpy()
    if kind is float:
        return float(np.float32(raw.value))
    if kind is bool:
        return bool(raw)
    if kind is int:
        return int(raw)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return kind[str(raw)]
    return tuple(int(v) for v in raw)


def from_attrs(attrs, cls: type) -> NpuParams:
    """Rebuild a record of type ``cls`` from a composite function's attributes
    (:func:`npu_backend.ops.decode_composite` knows which type each operator's record has)."""
    return cls(**{name: _decode(kind, attrs[f"npu.{name}"]) for name, kind in _field_types(cls)})


@functools.cache
def _field_types(cls: type) -> tuple[tuple[str, type], ...]:
    """Each field's name and resolved type (``get_type_hints`` evaluates the annotations: once per record type,
    not once per region decoded)."""
    hints = get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in fields(cls))
