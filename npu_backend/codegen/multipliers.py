"""Fixed-point multipliers (and look-up tables) of each operator, prepared exactly as the reference does.

TFLite roundings: TFLite's own preparation (fixed-point multipliers, integer
tables). ``Rounding.ONNXRUNTIME``: the MAC array gets double scales, the
elementwise, mean and pooling units compute with the float32 scales
themselves (no multipliers), and tables are onnxruntime's float32 function
of every dequantized input.

The pattern check calls this too, so an operator whose scales cannot be
represented stays on the host instead of failing at code generation.
"""

from __future__ import annotations

import numpy as np

from simulator import mlas, numerics, onnxruntime_numerics, softmax, tables

from ..errors import QParamError, UnsupportedOpError
from ..params import (ElementwiseParams, ConcatParams, ConvParams, LutParams, MeanParams, NpuOp, NpuParams, PadParams,
                      PoolParams, ReshapeParams, SliceParams, SoftmaxParams, TransposeParams)


def conv_multipliers(p: ConvParams):
    """Per-channel (multiplier, shift); per-tensor fully connected multiplies scales in float32.

    With ``Rounding.FLOAT64`` and ``Rounding.ONNXRUNTIME`` the pair is the
    float64 scale split into its two 32-bit halves, the layout the output
    stage reads in those modes.
    """
    if p.rounding in (numerics.Rounding.FLOAT64, numerics.Rounding.ONNXRUNTIME):
        words = numerics.float_scales(p.input_scale, p.weight_scales, p.output_scale).view(np.int32)
        return words[0::2].copy(), words[1::2].copy()
    if p.op == NpuOp.FULLY_CONNECTED and not p.per_channel:
        multiplier, shift = numerics.fully_connected_multiplier(
            p.input_scale, p.weight_scales[0], p.output_scale, p.rounding)
        return np.repeat(multiplier, p.out_channels), np.repeat(shift, p.out_channels)
    return numerics.conv_multipliers(p.input_scale, p.weight_scales, p.output_scale, p.rounding)


def _mul_multipliers(input_scale, input2_scale, output_scale, rounding):
    """MUL rescales only the product: its input multipliers and shifts are zero."""
    return (0, 0, 0, 0, *numerics.mul_multiplier(input_scale, input2_scale, output_scale, rounding))


ELEMENTWISE_PREPARE = {
    NpuOp.ADD: numerics.add_multipliers,
    NpuOp.SUBTRACT: numerics.sub_multipliers,
    NpuOp.MULTIPLY: _mul_multipliers,
}
"""(m1, s1, m2, s2, m_out, s_out) of each binary operator, as TFLite's Prepare computes them."""


def _check_ort_scales(**scales: float) -> None:
    """onnxruntime divides by and multiplies with the float32 scales: each must be positive and finite."""
    for name, scale in scales.items():
        value = np.float32(scale)
        if not (np.isfinite(value) and value > 0):
            raise QParamError(f"{name} {scale} must be positive and finite")


def elementwise_multipliers(p: ElementwiseParams):
    """(m1, s1, m2, s2, m_out, s_out); all 0 under ``Rounding.ONNXRUNTIME``, which uses the scales."""
    if p.rounding == numerics.Rounding.ONNXRUNTIME:
        _check_ort_scales(input_scale=p.input_scale, input2_scale=p.input2_scale, output_scale=p.output_scale)
        return (0, 0, 0, 0, 0, 0)
    return ELEMENTWISE_PREPARE[p.op](p.input_scale, p.input2_scale, p.output_scale, p.rounding)


def softmax_multiplier(p: SoftmaxParams):
    """(input multiplier, input left shift, diff_min) of TFLite's reference int8 SOFTMAX."""
    return softmax.softmax_params(p.input_scale, p.beta)


def mean_multiplier(p: MeanParams):
    """(multiplier, shift) with 1 / count folded in; (0, 0) under ``Rounding.ONNXRUNTIME``, which uses the scales."""
    if p.rounding == numerics.Rounding.ONNXRUNTIME:
        _check_ort_scales(input_scale=p.input_scale, output_scale=p.output_scale)
        return 0, 0
    _, height, width, _ = p.ifm_shape
    return numerics.mean_multiplier(p.input_scale, p.output_scale, height * width, p.rounding)


def no_multipliers(p: ReshapeParams | ConcatParams | PadParams):
    """Reshape, concat and pad keep their inputs' qparams: nothing to rescale."""
    return ()


def pool_qparams(p: PoolParams):
    """Pooling rescales nothing, except onnxruntime's average: it needs the qparams of both sides.

    onnxruntime's max pool of a QDQ graph requantizes too when the output
    qparams differ from the input's; the max pooling unit cannot, so that is refused.
    """
    if p.rounding != numerics.Rounding.ONNXRUNTIME:
        return ()
    if p.op == NpuOp.AVG_POOL2D:
        if p.input_scale == 0.0 or p.output_scale == 0.0:
            raise UnsupportedOpError("an onnxruntime average pool needs its qparams: its float average is "
                                     "requantized from the input's to the output's")
        _check_ort_scales(input_scale=p.input_scale, output_scale=p.output_scale)
    elif p.output_scale != 0.0 and ((p.input_scale, p.input_zero_point) != (p.output_scale, p.output_zero_point)):
        raise UnsupportedOpError(f"max pool input qparams ({p.input_scale:g}, {p.input_zero_point}) differ from "
                                 f"the output's ({p.output_scale:g}, {p.output_zero_point}): the max pooling unit "
                                 f"cannot requantize")
    return ()


FIXED_OUTPUT_ACTIVATIONS = {
    NpuOp.SIGMOID: (tables.logistic_table, (1.0 / 256, -128), "LOGISTIC"),
    NpuOp.TANH: (tables.tanh_table, (1.0 / 128, 0), "TANH"),
}
"""Table generator and the output qparams TFLite's int8 kernel requires, per activation."""


ORT_TABLE_FUNCTIONS = {
    NpuOp.SIGMOID: mlas.logistic,
    NpuOp.TANH: mlas.tanh,
    NpuOp.HARD_SWISH: mlas.hard_swish,
    NpuOp.REQUANTIZE: np.float32,
}
"""onnxruntime's float32 function of each table operator (MLAS's kernels; a requantize is DQ -> Q);
LEAKY_RELU takes its alpha in :func:`onnxruntime_numerics.qdq_leaky_relu_table`."""


def ort_lut_table(p: LutParams) -> np.ndarray:
    """onnxruntime's ``Q(f(DQ(q)))`` for every int8 q; any output qparams (onnxruntime fixes none)."""
    args = (p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point)
    if p.op == NpuOp.LEAKY_RELU:
        return onnxruntime_numerics.qdq_leaky_relu_table(*args, p.alpha)
    try:
        function = ORT_TABLE_FUNCTIONS[p.op]
    except KeyError:
        raise UnsupportedOpError(f"no onnxruntime table for {p.op.value}") from None
    return onnxruntime_numerics.qdq_table(function, *args)


LUT_POPULATE_FUNCTIONS = {NpuOp.EXP: np.exp, NpuOp.GELU: tables.tflite_gelu, NpuOp.GELU_TANH: tables.tflite_gelu_tanh}
"""Operators whose TFLite int8 kernel is a ``LUTPopulate`` table of a float function."""


def lut_table(p: LutParams) -> np.ndarray:
    """The 256-entry table; TFLite's int8 activations only exist for their fixed output qparams."""
    if p.rounding == numerics.Rounding.ONNXRUNTIME:
        return ort_lut_table(p)
    if p.op == NpuOp.REQUANTIZE:
        return tables.requantize_table(p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point)
    if p.op == NpuOp.HARD_SWISH:
        return tables.hard_swish_table(p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point)
    if p.op in LUT_POPULATE_FUNCTIONS:
        return tables.lut_populate(LUT_POPULATE_FUNCTIONS[p.op], p.input_scale, p.input_zero_point,
                                     p.output_scale, p.output_zero_point)
    if p.op == NpuOp.LEAKY_RELU:
        return tables.leaky_relu_table(p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point,
                                         p.alpha)
    generate, (scale, zero_point), name = FIXED_OUTPUT_ACTIVATIONS[p.op]
    if (p.output_scale, p.output_zero_point) != (float(np.float32(scale)), zero_point):
        raise QParamError(f"int8 {name} needs output scale {scale:g} and zero point {zero_point}, "
                          f"got {p.output_scale:g} and {p.output_zero_point}")
    return generate(p.input_scale, p.input_zero_point)


DERIVE = {ConvParams: conv_multipliers, ElementwiseParams: elementwise_multipliers, MeanParams: mean_multiplier,
          PoolParams: pool_qparams, ReshapeParams: no_multipliers, LutParams: lut_table,
          ConcatParams: no_multipliers, PadParams: no_multipliers,
          SoftmaxParams: softmax_multiplier, TransposeParams: no_multipliers,
          SliceParams: no_multipliers}


def derive_multipliers(p: NpuParams):
    return DERIVE[type(p)](p)
