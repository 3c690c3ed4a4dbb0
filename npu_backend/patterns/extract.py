"""One extraction per operator: matched composite -> :class:`ConvParams`.

The same functions serve the pattern check (is this legal on the NPU?) and the
annotation of the fused composite (what will the codegen run?). They raise
``UnsupportedOpError`` / ``QParamError`` with the user-facing reason; the
check turns that into "stays on the host, because ...".

The idioms handled here are the float-emulated forms TVM 0.27's TFLite importer
emits: ``quantize(add(op(dequantize(x), dequantize(w)), dequantize(bias)))``
optionally followed by an int8 ``clip`` (the fused ReLU/ReLU6);
``quantize(add(dequantize(a), dequantize(b)))``; ``quantize(mean(dequantize(x)))``;
``max_pool2d`` directly on int8; ``astype(avg_pool2d(astype(x, "int32")), "int8")``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
from tvm import relax
from tvm.ir.expr import Constant

from simulator.isa import ACTIVATION_FORMATS, ActivationType
from simulator.numerics import Rounding

from ..errors import QParamError, UnsupportedOpError
from ..relax_exprs import constant_value, static_shape
from ..params import (ElementwiseParams, ConcatParams, ConvParams, LutParams, MeanParams, NpuOp, PadParams, PoolParams,
                      ReshapeParams, SliceParams, SoftmaxParams, TransposeParams)

ACTIVATION_RANGES = {t: (int(np.iinfo(f.dtype).min), int(np.iinfo(f.dtype).max))
                     for t, f in ACTIVATION_FORMATS.items()}
"""Integer range of each activation type: where a fused ReLU/ReLU6 clamp is cut off."""

BIAS_SCALE_RTOL = 1e-6
"""The NPU adds the int32 bias in the accumulator domain, so its scale must be
s_in * s_w; TFLite's converter stores exactly that product in float32."""
CONV_LAYOUTS = {NpuOp.CONV2D: ("NHWC", "HWIO", "NHWC"), NpuOp.DEPTHWISE_CONV2D: ("NHWC", "HWOI", "NHWC")}
"""The (data, kernel, out) layouts each convolution composite takes (TFLite's, which the NCHW conversion writes)."""


def _const(expr, what: str) -> np.ndarray:
    if not isinstance(expr, Constant):
        raise UnsupportedOpError(f"{what} must be a compile-time constant")
    return constant_value(expr)


def _shape(expr) -> tuple[int, ...]:
    shape = static_shape(expr)
    if shape is None:
        raise UnsupportedOpError("tensor shape must be known and static")
    return shape


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _qparams(call, what: str, per_tensor: bool = True):
    """(scales, zero_points, axis) of a quantize/dequantize call with constant qparams."""
    scales = np.atleast_1d(_const(call.args[1], f"{what} scale")).astype(np.float32)
    zero_points = np.atleast_1d(_const(call.args[2], f"{what} zero point")).astype(np.int64)
    if per_tensor and (scales.size != 1 or zero_points.size != 1):
        raise QParamError(f"{what} must be quantized per tensor")
    if not np.all(np.isfinite(scales)) or np.any(scales <= 0):
        raise QParamError(f"{what} scale must be positive and finite")
    return scales, zero_points, int(call.attrs.axis)


def _clamp(annotations: Mapping[str, relax.Expr], bounds: tuple[int, int] = (-128, 127)) -> tuple[int, int]:
    """The fused ReLU/ReLU6 clip as an integer clamp within ``bounds`` (the output type's range)."""
    clip = annotations.get("clip")
    if clip is None:
        return bounds
    low, high = (float(getattr(arg.value, "value", arg.value)) for arg in clip.args[1:3])
    return integer_clamp(low, high, bounds)


def integer_clamp(low: float, high: float, bounds: tuple[int, int] = (-128, 127)) -> tuple[int, int]:
    """A clip's float bounds as the integers it lets through, within ``bounds``."""
    return (max(bounds[0], int(np.ceil(low))), min(bounds[1], int(np.floor(high))))


def _int8_qparams(call, what: str) -> tuple[float, int]:
    scale, zero_point, _ = _qparams(call, what)
    if not -128 <= zero_point[0] <= 127:
        raise QParamError(f"{what} zero point {zero_point[0]} is outside int8")
    return float(scale[0]), int(zero_point[0])


def _dequantized_int8(annotations, tensor: str, dequantize: str, what: str):
    x = annotations[tensor]
    if _dtype(x) != "int8":
        raise UnsupportedOpError(f"{what} dtype {_dtype(x)} is not int8")
    return (x, *_int8_qparams(annotations[dequantize], what))


def _input_and_output(annotations):
    x, in_scale, in_zp = _dequantized_int8(annotations, "input", "input_dq", "input")
    quantize = annotations["quantize"]
    if str(quantize.attrs.out_dtype) != "int8":
        raise UnsupportedOpError(f"output dtype {quantize.attrs.out_dtype} is not int8")
    return (x, in_scale, in_zp, *_int8_qparams(quantize, "output"))


def _int16_qparams(call, what: str) -> tuple[float, int]:
    """TFLite's 16x8 quantization is symmetric: an int16 activation's zero point must be 0 (its kernels add none)."""
    scale, zero_point, _ = _qparams(call, what)
    if zero_point[0] != 0:
        raise QParamError(f"{what} zero point {zero_point[0]} of an int16 tensor must be 0 (TFLite's 16x8 "
                          f"quantization is symmetric)")
    return float(scale[0]), 0


def _conv_input_and_output(annotations):
    """(x, s_in, z_in, s_out, z_out, activation type) of a convolution: int8, or int16 in and out (TFLite's
    16x8 mode, int8 weights; whether the NPU runs it is :func:`npu_backend.legality.sixteen_by_eight`'s call)."""
    x, quantize = annotations["input"], annotations["quantize"]
    if _dtype(x) != "int16":
        return (*_input_and_output(annotations), ActivationType.INT8)
    if str(quantize.attrs.out_dtype) != "int16":
        raise UnsupportedOpError(f"output dtype {quantize.attrs.out_dtype} of an int16 convolution is not int16 "
                                 f"(16x8 keeps int16 activations)")
    return (x, *_int16_qparams(annotations["input_dq"], "input"), *_int16_qparams(quantize, "output"),
            ActivationType.INT16)


def _weights(annotations, out_channels: int, oc_axis_after: int):
    """Constant int8 weights (after an optional transpose of the raw constant) and per-OC scales.

    ``oc_axis_after`` is the output-channel axis of the weight as the operator
    consumes it. TFLite's fully connected transposes the int8 constant before
    dequantizing it; layout ops after the dequantize are folded by canonicalization.
    """
    weight_dq = annotations["weight_dq"]
    raw = _const(annotations["weight"], "weights")
    if raw.dtype != np.int8:
        raise UnsupportedOpError(f"weight dtype {raw.dtype} is not int8")
    scales, zero_points, axis = _qparams(weight_dq, "weights", per_tensor=False)
    if np.any(zero_points != 0):
        raise QParamError("weight zero points must be 0 (symmetric int8 weights)")
    dq_shape = _shape(weight_dq)
    value = raw
    if "weight_permute" in annotations:  # permute_dims(const) -> dequantize
        permute = annotations["weight_permute"]
        axes = ([int(a) % raw.ndim for a in permute.attrs.axes] if permute.attrs.axes is not None
                else list(reversed(range(raw.ndim))))
        value = np.transpose(raw, axes)
    if scales.size > 1 and axis % len(dq_shape) != oc_axis_after:
        raise QParamError(f"per-channel weight axis {axis} is not the output-channel axis")
    if scales.size not in (1, out_channels):
        raise QParamError(f"{scales.size} weight scales for {out_channels} output channels")
    per_channel = scales.size > 1
    scales = np.broadcast_to(scales, (out_channels,)).astype(np.float32)
    return value, scales, np.zeros(out_channels, dtype=np.int32), per_channel


def _bias(annotations, in_scale: float, weight_scales: np.ndarray) -> np.ndarray:
    out_channels = weight_scales.size
    bias_dq = annotations.get("bias")
    if bias_dq is None:
        return np.zeros(out_channels, dtype=np.int32)
    values = _const(bias_dq.args[0], "bias")
    if values.dtype != np.int32:
        raise UnsupportedOpError(f"bias dtype {values.dtype} is not int32")
    scales, zero_points, _ = _qparams(bias_dq, "bias", per_tensor=False)
    if np.any(zero_points != 0):
        raise QParamError("bias zero point must be 0")
    values = np.broadcast_to(values.reshape(-1), (out_channels,)) if values.size in (1, out_channels) else None
    if values is None:
        raise QParamError("bias must hold one value per output channel")
    expected = np.float32(in_scale) * weight_scales
    if not np.allclose(np.broadcast_to(scales, expected.shape), expected, rtol=BIAS_SCALE_RTOL, atol=0):
        raise QParamError("bias scale is not input_scale * weight_scale")
    return np.ascontiguousarray(values, dtype=np.int32)


def _conv_common(annotations, op: NpuOp) -> ConvParams:
    conv = annotations["anchor"]
    attrs = conv.attrs
    layouts = (str(attrs.data_layout), str(attrs.kernel_layout), str(attrs.out_layout))
    x, in_scale, in_zp, out_scale, out_zp, activation_type = _conv_input_and_output(annotations)
    ifm_shape, ofm_shape = _shape(x), _shape(conv)
    if len(ifm_shape) != 4 or ifm_shape[0] != 1:
        raise UnsupportedOpError(f"input shape {list(ifm_shape)} is not a batch-1 NHWC image")
    groups = int(attrs.groups)
    channels = ifm_shape[3]
    if layouts != CONV_LAYOUTS[op]:
        raise UnsupportedOpError(f"layouts {layouts} are not {'/'.join(CONV_LAYOUTS[op][:2])}")
    if op == NpuOp.CONV2D:
        if groups != 1:
            raise UnsupportedOpError(f"grouped convolution (groups={groups}) is not a plain conv2d")
        out_channels = ofm_shape[3]
        value, scales, zps, per_channel = _weights(annotations, out_channels, oc_axis_after=3)
        weights = np.transpose(value, (3, 0, 1, 2))  # HWIO -> [OC, KH, KW, IC]
    else:
        if groups != channels or ofm_shape[3] % channels:
            raise UnsupportedOpError(f"depthwise convolution needs groups == channels ({groups} != {channels}) and "
                                     f"a whole channel multiplier ({ofm_shape[3]} outputs of {channels} channels)")
        out_channels = ofm_shape[3]  # channel multiplier m: output o reads input o // m (TFLite's rule)
        value, scales, zps, per_channel = _weights(annotations, out_channels, oc_axis_after=2)
        weights = np.transpose(value[:, :, :, 0], (2, 0, 1))  # HWO1 -> [C, KH, KW]
    padding = tuple(int(p) for p in attrs.padding)
    if len(padding) == 2:
        padding = padding * 2
    return ConvParams(
        op=op, ifm_shape=ifm_shape, ofm_shape=ofm_shape, input_scale=in_scale, input_zero_point=in_zp,
        weight_scales=scales, weight_zero_points=zps, per_channel=per_channel,
        weights=np.ascontiguousarray(weights), bias=_bias(annotations, in_scale, scales),
        output_scale=out_scale, output_zero_point=out_zp,
        clamp=_clamp(annotations, ACTIVATION_RANGES[activation_type]),
        kernel=(int(weights.shape[1]), int(weights.shape[2])),
        strides=tuple(int(s) for s in attrs.strides), dilation=tuple(int(d) for d in attrs.dilation),
        padding=padding, rounding=mac_rounding(op, per_channel), activation_type=activation_type)


def extract_conv2d(annotations: Mapping[str, relax.Expr]) -> ConvParams:
    return _conv_common(annotations, NpuOp.CONV2D)


def extract_depthwise_conv2d(annotations: Mapping[str, relax.Expr]) -> ConvParams:
    return _conv_common(annotations, NpuOp.DEPTHWISE_CONV2D)


def mac_rounding(op: NpuOp, per_channel: bool) -> Rounding:
    """A MAC layer's requantization as TFLite's reference kernels do it: per-channel weights select
    ``Rounding.FLOAT64`` for FULLY_CONNECTED (its kernel requantizes in double, not with fixed-point multipliers),
    fixed point otherwise."""
    return Rounding.FLOAT64 if op == NpuOp.FULLY_CONNECTED and per_channel else Rounding.TFLITE_DOUBLE


def extract_fully_connected(annotations: Mapping[str, relax.Expr]) -> ConvParams:
    matmul = annotations["anchor"]
    x, in_scale, in_zp, out_scale, out_zp = _input_and_output(annotations)
    ifm_shape, ofm_shape = _shape(x), _shape(matmul)
    weight_shape = _shape(annotations["weight_dq"])
    if len(ifm_shape) != 2 or len(weight_shape) != 2:
        raise UnsupportedOpError(f"fully connected needs a 2-D input and weight, got {list(ifm_shape)}")
    out_channels = weight_shape[1]
    value, scales, zps, per_channel = _weights(annotations, out_channels, oc_axis_after=1)
    weights = np.ascontiguousarray(value.T)  # [IC, OC] -> [OC, IC]
    return ConvParams(
        op=NpuOp.FULLY_CONNECTED, ifm_shape=ifm_shape, ofm_shape=ofm_shape, input_scale=in_scale,
        input_zero_point=in_zp, weight_scales=scales, weight_zero_points=zps, per_channel=per_channel,
        weights=weights, bias=_bias(annotations, in_scale, scales), output_scale=out_scale,
        output_zero_point=out_zp, clamp=_clamp(annotations), rounding=mac_rounding(NpuOp.FULLY_CONNECTED, per_channel))


def _per_channel(shape: tuple, out_shape: tuple) -> bool:
    """Whether ``shape`` is one value per channel (the last axis) of ``out_shape``."""
    return (len(shape) == len(out_shape) and shape[-1] == out_shape[-1] and all(d == 1 for d in shape[:-1]))


def extract_elementwise(op: NpuOp, verb: str):
    """Extraction of a binary int8 operator: both inputs dequantized per tensor, same shape, requantized."""

    def extract(annotations: Mapping[str, relax.Expr]) -> ElementwiseParams:
        x, in_scale, in_zp, out_scale, out_zp = _input_and_output(annotations)
        x2, in2_scale, in2_zp = _dequantized_int8(annotations, "input2", "input2_dq", "second input")
        if isinstance(x, Constant):
            raise UnsupportedOpError(f"the first operand of {verb} is a constant")
        shape, shape2 = _shape(x), _shape(x2)
        values, broadcast = np.zeros(0, np.int8), ()
        out_shape = _shape(annotations["anchor"])
        if isinstance(x2, Constant):
            try:
                values = np.ascontiguousarray(np.broadcast_to(x2.value.numpy(), shape))
            except ValueError:
                raise UnsupportedOpError(f"constant {list(shape2)} does not broadcast to {list(shape)}") from None
        elif shape != shape2:
            broadcast = tuple(i for i, s in enumerate((shape, shape2)) if s != out_shape)
            if len(broadcast) != 1 or not _per_channel(shape2 if broadcast == (1,) else shape, out_shape):
                raise UnsupportedOpError(f"broadcasting {verb} ({list(shape)} and {list(shape2)}) is supported only "
                                         "of a per-channel vector [1, ..., 1, C] over the other operand")
        return ElementwiseParams(op=op, shape=out_shape, input_scale=in_scale, input_zero_point=in_zp,
                                 input2_scale=in2_scale, input2_zero_point=in2_zp, output_scale=out_scale,
                                 output_zero_point=out_zp, clamp=_clamp(annotations), input2_values=values,
                                 broadcast=broadcast)

    extract.__doc__ = f"TFLite int8 {op.name}: {verb} of two same-shaped tensors."
    return extract


def extract_mean(annotations: Mapping[str, relax.Expr]) -> MeanParams:
    x, in_scale, in_zp, out_scale, out_zp = _input_and_output(annotations)
    mean = annotations["anchor"]
    ifm_shape = _shape(x)
    axes = sorted(int(a) % len(ifm_shape) for a in mean.attrs.axis) if mean.attrs.axis is not None else None
    if len(ifm_shape) != 4 or ifm_shape[0] != 1 or axes != [1, 2]:
        raise UnsupportedOpError("only the spatial mean (axes 1, 2) of a batch-1 NHWC tensor is supported")
    return MeanParams(op=NpuOp.MEAN, ifm_shape=ifm_shape, ofm_shape=_shape(mean), input_scale=in_scale,
                      input_zero_point=in_zp, output_scale=out_scale, output_zero_point=out_zp)


def _pool(annotations, op: NpuOp) -> PoolParams:
    pool = annotations["anchor"]
    x = annotations["input"]
    if _dtype(x) != "int8":
        raise UnsupportedOpError(f"pooling input dtype {_dtype(x)} is not int8")
    attrs = pool.attrs
    if str(attrs.layout) != "NHWC" or (attrs.out_layout is not None and str(attrs.out_layout) != "NHWC"):
        raise UnsupportedOpError(f"pooling layout {attrs.layout} is not NHWC")
    if any(int(d) != 1 for d in attrs.dilation) or bool(attrs.ceil_mode):
        raise UnsupportedOpError("dilated or ceil-mode pooling is not supported")
    if op == NpuOp.AVG_POOL2D and bool(attrs.count_include_pad):
        raise UnsupportedOpError("average pooling that counts padding is not TFLite's and not supported")
    ifm_shape = _shape(x)
    if len(ifm_shape) != 4 or ifm_shape[0] != 1:
        raise UnsupportedOpError(f"input shape {list(ifm_shape)} is not a batch-1 NHWC image")
    padding = tuple(int(v) for v in attrs.padding)
    padding = padding * 2 if len(padding) == 2 else padding
    return PoolParams(op=op, ifm_shape=ifm_shape, ofm_shape=_shape(pool),
                      kernel=tuple(int(k) for k in attrs.pool_size), strides=tuple(int(v) for v in attrs.strides),
                      padding=padding, clamp=_clamp(annotations))


def extract_max_pool2d(annotations: Mapping[str, relax.Expr]) -> PoolParams:
    return _pool(annotations, NpuOp.MAX_POOL2D)


def extract_avg_pool2d(annotations: Mapping[str, relax.Expr]) -> PoolParams:
    """The cast idiom: the int32 cast must come from int8 and the result go back to int8."""
    if str(annotations["widen"].attrs.dtype) != "int32" or str(annotations["narrow"].attrs.dtype) != "int8":
        raise UnsupportedOpError("average pooling must be computed on int32 casts of int8 data")
    return _pool(annotations, NpuOp.AVG_POOL2D)


def _qdq_pool(op: NpuOp):
    """Extraction of ``quantize(pool(dequantize(x)))``, the form ONNX QDQ graphs give pooling."""

    def extract(annotations: Mapping[str, relax.Expr]) -> PoolParams:
        _, in_scale, in_zp, out_scale, out_zp = _input_and_output(annotations)
        return dataclasses.replace(_pool(annotations, op), input_scale=in_scale, input_zero_point=in_zp,
                                   output_scale=out_scale, output_zero_point=out_zp)

    extract.__doc__ = f"{op.name} between a dequantize and a quantize, with both sides' qparams."
    return extract


extract_qdq_max_pool2d = _qdq_pool(NpuOp.MAX_POOL2D)
extract_qdq_avg_pool2d = _qdq_pool(NpuOp.AVG_POOL2D)


def extract_reshape(annotations: Mapping[str, relax.Expr]) -> ReshapeParams:
    x, reshape = annotations["input"], annotations["anchor"]
    if _dtype(x) != "int8":
        raise UnsupportedOpError(f"reshape of {_dtype(x)} data is not an int8 tensor move")
    return ReshapeParams(op=NpuOp.RESHAPE, ifm_shape=_shape(x), ofm_shape=_shape(reshape))


def _activation(annotations, op: NpuOp) -> LutParams:
    x, in_scale, in_zp, out_scale, out_zp = _input_and_output(annotations)
    return LutParams(op=op, shape=_shape(x), input_scale=in_scale, input_zero_point=in_zp,
                     output_scale=out_scale, output_zero_point=out_zp)


def extract_activation(op: NpuOp):
    """Extraction of an elementwise activation between a dequantize and a quantize: a table look-up."""

    def extract(annotations: Mapping[str, relax.Expr]) -> LutParams:
        return _activation(annotations, op)

    extract.__doc__ = f"int8 {op.name} as a table: the input's and output's qparams."
    return extract


def extract_concat(annotations: Mapping[str, relax.Expr]) -> ConcatParams:
    """Every input must share the output's qparams: TFLite's int8 CONCATENATION never rescales."""
    quantize, concat = annotations["quantize"], annotations["anchor"]
    out_scale, out_zp = _int8_qparams(quantize, "output")
    if str(quantize.attrs.out_dtype) != "int8":
        raise UnsupportedOpError(f"output dtype {quantize.attrs.out_dtype} is not int8")
    count = sum(1 for name in annotations if name.startswith("input_dq"))
    ofm_shape = _shape(concat)
    axis = int(concat.attrs.axis) % len(ofm_shape)
    extents = []
    for i in range(count):
        x, scale, zero_point = _dequantized_int8(annotations, f"input{i}", f"input_dq{i}", f"input {i}")
        if (scale, zero_point) != (out_scale, out_zp):
            raise QParamError(f"concat input {i} has qparams ({scale:g}, {zero_point}) but the output "
                              f"({out_scale:g}, {out_zp}); each needs a requantize first")
        extents.append(_shape(x)[axis])
    return ConcatParams(op=NpuOp.CONCAT, ofm_shape=ofm_shape, axis=axis, extents=tuple(extents),
                        output_scale=out_scale, output_zero_point=out_zp)


def extract_pad(annotations: Mapping[str, relax.Expr]) -> PadParams:
    x, pad = annotations["input"], annotations["anchor"]
    if _dtype(x) != "int8":
        raise UnsupportedOpError(f"pad of {_dtype(x)} data is not an int8 tensor move")
    if str(pad.attrs.pad_mode) != "constant":
        raise UnsupportedOpError(f"pad mode {pad.attrs.pad_mode} is not constant")
    ifm_shape = _shape(x)
    widths = [int(w) for w in pad.attrs.pad_width]
    if len(ifm_shape) != 4 or ifm_shape[0] != 1 or any(widths[i] for i in (0, 1, 6, 7)):
        raise UnsupportedOpError("only spatial padding of a batch-1 NHWC tensor is supported")
    value = float(pad.attrs.pad_value)
    if value != int(value) or not -128 <= value <= 127:
        raise QParamError(f"pad value {value} is not an int8 value")
    return PadParams(op=NpuOp.PAD, ifm_shape=ifm_shape, padding=(widths[2], widths[4], widths[3], widths[5]),
                     pad_value=int(value))


def extract_leaky_relu(annotations: Mapping[str, relax.Expr]) -> LutParams:
    x, in_scale, in_zp, out_scale, out_zp = _input_and_output(annotations)
    return LutParams(op=NpuOp.LEAKY_RELU, shape=_shape(x), input_scale=in_scale, input_zero_point=in_zp,
                     output_scale=out_scale, output_zero_point=out_zp,
                     alpha=float(np.float32(annotations["anchor"].attrs.alpha)))


def _scalar(expr, what: str) -> float:
    value = _const(expr, what)
    if value.size != 1:
        raise UnsupportedOpError(f"{what} is not a scalar")
    return float(value.reshape(-1)[0])


def _one_input(annotations) -> None:
    """An idiom that uses x twice (dequantized once per use) must dequantize it the same way both times."""
    if _int8_qparams(annotations["input_dq"], "input") != _int8_qparams(annotations["input_dq2"], "input"):
        raise QParamError("the two uses of x are dequantized with different qparams")


def extract_hard_swish(annotations: Mapping[str, relax.Expr]) -> LutParams:
    """x * clip(x + 3, 0, 6) / 6, as TVM's importer spells HARD_SWISH; the constants must be those."""
    low, high = (float(getattr(a.value, "value", a.value)) for a in annotations["relu6"].args[1:3])
    if (_scalar(annotations["plus"].args[1], "hard swish offset"),
            _scalar(annotations["anchor"].args[1], "hard swish divisor"), low, high) != (3.0, 6.0, 0.0, 6.0):
        raise UnsupportedOpError("not x * relu6(x + 3) / 6")
    _one_input(annotations)
    return _activation(annotations, NpuOp.HARD_SWISH)


def extract_elu(annotations: Mapping[str, relax.Expr]) -> LutParams:
    """-1 * relu(1 - exp(x)) + relu(x), as TVM's importer spells ELU; the constants must be those."""
    if (_scalar(annotations["one"], "ELU one"), _scalar(annotations["minus_one"], "ELU alpha")) != (1.0, -1.0):
        raise UnsupportedOpError("not -relu(1 - exp(x)) + relu(x), an ELU of alpha 1")
    _one_input(annotations)
    return _activation(annotations, NpuOp.ELU)


def extract_softmax(annotations: Mapping[str, relax.Expr]) -> SoftmaxParams:
    """int8 softmax over the last axis (TVM's importer spells TFLite SOFTMAX as QDQ around ``nn.softmax``)."""
    x, in_scale, in_zp, out_scale, out_zp = _input_and_output(annotations)
    shape = _shape(x)
    axis = int(annotations["anchor"].attrs.axis)
    if axis % len(shape) != len(shape) - 1:
        raise UnsupportedOpError(f"softmax over axis {axis} is not over the last axis")
    return SoftmaxParams(op=NpuOp.SOFTMAX, shape=shape, input_scale=in_scale, input_zero_point=in_zp,
                         output_scale=out_scale, output_zero_point=out_zp)


def extract_transpose(annotations: Mapping[str, relax.Expr]) -> TransposeParams:
    """A transpose of int8 data that rotates the non-batch axes (NCHW <-> NHWC)."""
    x, permute = annotations["input"], annotations["anchor"]
    if _dtype(x) != "int8":
        raise UnsupportedOpError(f"transpose of {_dtype(x)} data is not an int8 tensor move")
    shape = _shape(x)
    rank = len(shape)
    axes = tuple(int(a) for a in permute.attrs.axes) if permute.attrs.axes is not None else tuple(
        reversed(range(rank)))
    rotations = [(0, *range(k, rank), *range(1, k)) for k in range(2, rank)]
    if rank < 3 or shape[0] != 1 or axes not in rotations:
        raise UnsupportedOpError(f"transpose {list(axes)} of {list(shape)} is not a rotation of a batch-1 "
                                 "tensor's axes (a 2-D transpose)")
    return TransposeParams(op=NpuOp.TRANSPOSE, ifm_shape=shape, axes=axes)


def extract_strided_slice(annotations: Mapping[str, relax.Expr]) -> SliceParams:
    """A forward strided slice of a batch-1 NHWC int8 tensor."""
    x, call = annotations["input"], annotations["anchor"]
    if _dtype(x) != "int8":
        raise UnsupportedOpError(f"strided slice of {_dtype(x)} data is not an int8 tensor move")
    shape, out_shape = _shape(x), _shape(call)
    if len(shape) != 4 or shape[0] != 1:
        raise UnsupportedOpError(f"strided slice of {list(shape)} is not of a batch-1 NHWC tensor")
    try:
        axes, begins, _, steps = ([int(v.value) for v in arg.fields] for arg in call.args[1:5])
    except (AttributeError, TypeError, IndexError):
        raise UnsupportedOpError("strided slice bounds must be constants") from None
    begin, strides = [0, 0, 0, 0], [1, 1, 1, 1]
    for axis, start, step in zip(axes, begins, steps):
        axis %= 4
        if step <= 0:
            raise UnsupportedOpError(f"strided slice step {step} is not positive")
        begin[axis] = min(max(start + shape[axis] if start < 0 else start, 0), shape[axis])
        strides[axis] = step
    if out_shape[0] != 1 or any(b + (n - 1) * s >= d for b, n, s, d in zip(begin, out_shape, strides, shape)):
        raise UnsupportedOpError("strided slice reads outside its input")
    return SliceParams(op=NpuOp.STRIDED_SLICE, ifm_shape=shape, ofm_shape=out_shape, begin=tuple(begin),
                       strides=tuple(strides))
