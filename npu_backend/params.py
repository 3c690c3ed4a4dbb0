"""The canonical parameter record of a MAC-array operator and its attribute encoding.

A matched composite is turned into a :class:`ConvParams` once (by the
pattern table's ``extract_*`` functions); the record is written onto the
composite function as ``npu.*`` attributes, and the codegen rebuilds the
record from those attributes. Nothing downstream re-derives a qparam from the
operator body, so what a user reads on the composite is what runs.

Attribute schema (every composite ``npu.conv2d``, ``npu.depthwise_conv2d``,
``npu.fully_connected``):

=========================  ===========================================================
``npu.op``                 operator kind (``conv2d`` / ``depthwise_conv2d`` / ``fully_connected``)
``npu.ifm_shape``          input shape (NHWC, or [N, IC] for fully connected)
``npu.ofm_shape``          output shape
``npu.input_scale``        float32 input scale
``npu.input_zero_point``   input zero point
``npu.weight_scales``      float32 tensor, one scale per output channel (repeated if per-tensor)
``npu.weight_zero_points`` int tensor, per output channel (all 0 for int8 TFLite weights)
``npu.weight_axis``        output-channel axis of ``npu.weights`` (always 0)
``npu.per_channel``        whether the source model quantized weights per channel
``npu.weights``            int8 tensor, canonical layout: [OC,KH,KW,IC] / [C,KH,KW] / [OC,IC]
``npu.bias``               int32 tensor [OC] in the accumulator domain (scale = s_in * s_w)
``npu.output_scale``       float32 output scale
``npu.output_zero_point``  output zero point
``npu.clamp``              (qmin, qmax): the fused activation as an integer clamp
``npu.kernel`` ...         ``npu.strides``, ``npu.dilation``, ``npu.padding`` (top, left, bottom, right)
``npu.rounding``           requantization rounding (``TFLITE_DOUBLE``, ``TFLITE_SINGLE``)
=========================  ===========================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import Enum

import numpy as np
import tvm

from simulator.numerics import Rounding


class NpuOp(str, Enum):
    CONV2D = "conv2d"
    DEPTHWISE_CONV2D = "depthwise_conv2d"
    FULLY_CONNECTED = "fully_connected"


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

    @property
    def out_channels(self) -> int:
        return int(self.weights.shape[0])


_TENSOR_FIELDS = {"weight_scales": "float32", "weight_zero_points": "int32", "weights": "int8",
                  "bias": "int32"}
_FLOAT_FIELDS = ("input_scale", "output_scale")


def to_attrs(params: ConvParams) -> dict[str, object]:
    """Encode the record as ``npu.*`` function attributes (float32 scales stay exact)."""
    attrs: dict[str, object] = {}
    for f in fields(params):
        value = getattr(params, f.name)
        key = f"npu.{f.name}"
        if f.name in _TENSOR_FIELDS:
            attrs[key] = tvm.runtime.tensor(np.ascontiguousarray(value, dtype=_TENSOR_FIELDS[f.name]))
        elif f.name in _FLOAT_FIELDS:
            attrs[key] = tvm.tirx.FloatImm("float32", float(np.float32(value)))
        elif isinstance(value, Enum):
            attrs[key] = value.name
        elif isinstance(value, bool):
            attrs[key] = tvm.tirx.IntImm("bool", value)
        else:
            attrs[key] = value
    return attrs


def from_attrs(attrs) -> ConvParams:
    """Rebuild the record from a composite function's attributes."""
    values = {}
    for f in fields(ConvParams):
        raw = attrs[f"npu.{f.name}"]
        if f.name in _TENSOR_FIELDS:
            values[f.name] = raw.numpy()
        elif f.name in _FLOAT_FIELDS:
            values[f.name] = float(np.float32(raw.value))
        elif f.name == "op":
            values[f.name] = NpuOp[str(raw)]
        elif f.name == "rounding":
            values[f.name] = Rounding[str(raw)]
        elif f.name == "per_channel":
            values[f.name] = bool(raw)
        elif isinstance(raw, (int, tvm.tirx.IntImm)):
            values[f.name] = int(raw)
        else:
            values[f.name] = tuple(int(v) for v in raw)
    return ConvParams(**values)
