"""The integer-domain convolution whose requantization is written out in fixed point.

The old ``qnn.conv2d -> requantize`` lowered by hand, with no float anywhere::

    acc = conv2d|matmul(astype(x, "int32") [- z_in], astype(w, "int32"), out_dtype="int32") [+ bias]
    out = astype(clip(add(astype(right_shift(add(multiply(astype(acc, "int64"), M), R), S), "int32"), Z),
                      lo, hi), "int8")

with ``R = 2**(S - 1)``: one multiply and one rounding shift, rounding half up,
i.e. TFLite's ``TFLITE_SINGLE_ROUNDING`` build (``Rounding.TFLITE_SINGLE``). It
cannot become the QDQ canonical form: that form holds float scales, and the
chain's 31-bit multipliers, which decide its results, would not survive the
trip. So it is matched as it stands. The scales the composite records come from
the dataflow analysis (s_in from the input's producer, s_out from the output's
consumer) and ``s_w = M * 2**-S * s_out / s_in`` rounded to float32; the
extraction accepts the chain only if those scales give back exactly its
multipliers and shifts, which holds whenever the chain was built from float32
scales, as every quantizer builds it. Then s_in and s_w are kept separately
(seed 003) and the NPU computes exactly what the chain computes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from tvm import relax
from tvm.relax.dpl.pattern import is_const, is_op, wildcard

from simulator.numerics import Rounding

from ..errors import QParamError, UnsupportedOpError
from ..params import ConvParams, NpuOp
from ..prepare import conv_multipliers
from .builders import integer_accumulator
from .extract import _const, _dtype, _shape

QPARAM_ROLES = ("input", "output")
"""Tensors whose qparams the extraction takes from the dataflow analysis."""


def fixed_point_pattern(op_name: str):
    def build(with_clip: bool):
        acc, names = integer_accumulator((op_name,))
        multiplier, rounding_bias, shift, zero_point = is_const(), is_const(), is_const(), is_const()
        product = is_op("relax.multiply")(is_op("relax.astype")(acc), multiplier)
        shifted = is_op("relax.right_shift")(is_op("relax.add")(product, rounding_bias), shift)
        offset = is_op("relax.add")(is_op("relax.astype")(shifted), zero_point)
        clip = is_op("relax.clip")(offset, wildcard(), wildcard())
        output = is_op("relax.astype")(clip)
        return output, dict(names, multiplier=multiplier, rounding_bias=rounding_bias, shift=shift,
                            zero_point=zero_point, clip=clip, output=output)

    build.__doc__ = f"{op_name} on int32 data, requantized by an explicit fixed-point chain (single rounding)."
    return build


def _chain(annotations, channels: int):
    """(multiplier, shift) per channel in TFLite's convention, checked against the chain's constants."""
    multiplier = np.broadcast_to(_const(annotations["multiplier"], "multiplier").astype(np.int64), (channels,))
    right = np.broadcast_to(_const(annotations["shift"], "shift").astype(np.int64), (channels,))
    rounding_bias = np.broadcast_to(_const(annotations["rounding_bias"], "rounding term").astype(np.int64),
                                    (channels,))
    if np.any(right < 1) or np.any(right > 62) or np.any(rounding_bias != (np.int64(1) << (right - 1))):
        raise UnsupportedOpError("not a rounding shift: the added term must be 2**(shift - 1)")
    if np.any(multiplier < (1 << 30)) or np.any(multiplier >= (1 << 31)):
        raise UnsupportedOpError("fixed-point multipliers must be normalized int32 values in [2**30, 2**31)")
    return multiplier, 31 - right


def extract_fixed_point(op: NpuOp):
    def extract(annotations: Mapping[str, relax.Expr], qparams: Mapping) -> ConvParams:
        x, anchor = annotations["input"], annotations["anchor"]
        if _dtype(x) != "int8" or _dtype(annotations["output"]) != "int8" or _dtype(anchor) != "int32":
            raise UnsupportedOpError("the fixed-point idiom needs int8 input and output and an int32 accumulator")
        q_in, q_out = qparams.get("input"), qparams.get("output")
        if q_in is None or q_out is None:
            raise QParamError("no quantize or dequantize states the input's and output's qparams, from which "
                              "the weight scales would follow")
        input_zp = int(_const(annotations["input_zp"], "input zero point").reshape(-1)[0]) \
            if "centred" in annotations else 0
        zero_point = _const(annotations["zero_point"], "output zero point")
        if input_zp != q_in.zero_point or zero_point.size != 1 or int(zero_point.reshape(-1)[0]) != q_out.zero_point:
            raise QParamError("the zero points the chain subtracts and adds are not the tensors' own")
        raw = _const(annotations["weight"], "weights")
        if raw.min() < -128 or raw.max() > 127:
            raise UnsupportedOpError("weights are not int8 values")
        ifm_shape, ofm_shape = _shape(x), _shape(anchor)
        if op == NpuOp.CONV2D:
            attrs = anchor.attrs
            if (str(attrs.data_layout), str(attrs.kernel_layout), int(attrs.groups)) != ("NHWC", "HWIO", 1):
                raise UnsupportedOpError("only an NHWC/HWIO convolution of one group")
            weights = np.transpose(raw, (3, 0, 1, 2)).astype(np.int8)
            padding = tuple(int(p) for p in attrs.padding)
            geometry = dict(kernel=tuple(weights.shape[1:3]), strides=tuple(int(s) for s in attrs.strides),
                            dilation=tuple(int(d) for d in attrs.dilation),
                            padding=padding * 2 if len(padding) == 2 else padding)
        else:
            if len(ifm_shape) != 2 or raw.ndim != 2:
                raise UnsupportedOpError("fully connected needs a 2-D input and weight")
            weights, geometry = np.ascontiguousarray(raw.T).astype(np.int8), {}  # [IC, OC] -> [OC, IC]
        channels = weights.shape[0]
        multiplier, shift = _chain(annotations, channels)
        reals = multiplier.astype(np.float64) * np.exp2(shift.astype(np.float64) - 31)
        scales = (reals * float(np.float32(q_out.scale)) / float(np.float32(q_in.scale))).astype(np.float32)
        bias = _const(annotations["bias"], "bias").reshape(-1) if "bias" in annotations else np.zeros(channels)
        low, high = (int(float(getattr(a.value, "value", a.value))) for a in annotations["clip"].args[1:3])
        per_channel = bool(np.unique(scales).size > 1)
        params = ConvParams(
            op=op, ifm_shape=ifm_shape, ofm_shape=ofm_shape, input_scale=q_in.scale,
            input_zero_point=q_in.zero_point, weight_scales=scales, weight_zero_points=np.zeros(channels, np.int32),
            per_channel=per_channel, weights=np.ascontiguousarray(weights),
            bias=np.broadcast_to(bias, (channels,)).astype(np.int32), output_scale=q_out.scale,
            output_zero_point=q_out.zero_point, clamp=(max(-128, low), min(127, high)),
            rounding=Rounding.TFLITE_SINGLE, **geometry)
        derived = conv_multipliers(params)  # what the code generator will program: it must be the chain
        if not (np.array_equal(derived[0], multiplier) and np.array_equal(derived[1], shift)):
            raise QParamError("the chain's multipliers are not those of any float32 weight scales "
                              "(s_in * s_w / s_out), so no scales can stand for them")
        return params

    extract.__doc__ = f"{op.name} with its requantization written in fixed point (see the module docstring)."
    return extract
