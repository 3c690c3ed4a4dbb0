"""Fixed-point multipliers (and look-up tables) of each operator, prepared exactly as TFLite does.

The pattern check calls this too, so an operator whose scales cannot be
represented stays on the host instead of failing at code generation.
"""

from __future__ import annotations

import numpy as np

from simulator import numerics

from ..errors import QParamError
from ..params import (ElementwiseParams, ConcatParams, ConvParams, LutParams, MeanParams, NpuOp, NpuParams, PadParams,
                      PoolParams, ReshapeParams, SoftmaxParams)


def conv_multipliers(p: ConvParams):
    """Per-channel (multiplier, shift); per-tensor fully connected multiplies scales in float32.

    With ``Rounding.FLOAT64`` the pair is the float64 scale split into its two
    32-bit halves, the layout the output stage reads in that mode.
    """
    if p.rounding == numerics.Rounding.FLOAT64:
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


def elementwise_multipliers(p: ElementwiseParams):
    return ELEMENTWISE_PREPARE[p.op](p.input_scale, p.input2_scale, p.output_scale, p.rounding)


def softmax_multiplier(p: SoftmaxParams):
    """(input multiplier, input left shift, diff_min) of TFLite's reference int8 SOFTMAX."""
    return numerics.softmax_params(p.input_scale, p.beta)


def mean_multiplier(p: MeanParams):
    _, height, width, _ = p.ifm_shape
    return numerics.mean_multiplier(p.input_scale, p.output_scale, height * width, p.rounding)


def no_multipliers(p: PoolParams | ReshapeParams | ConcatParams | PadParams):
    """Pooling, reshape, concat and pad keep their inputs' qparams: nothing to rescale."""
    return ()


FIXED_OUTPUT_ACTIVATIONS = {
    NpuOp.SIGMOID: (numerics.logistic_table, (1.0 / 256, -128), "LOGISTIC"),
    NpuOp.TANH: (numerics.tanh_table, (1.0 / 128, 0), "TANH"),
}
"""Table generator and the output qparams TFLite's int8 kernel requires, per activation."""


def lut_table(p: LutParams) -> np.ndarray:
    """The 256-entry table; TFLite's int8 activations only exist for their fixed output qparams."""
    if p.op == NpuOp.REQUANTIZE:
        return numerics.requantize_table(p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point)
    if p.op == NpuOp.HARD_SWISH:
        return numerics.hard_swish_table(p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point)
    if p.op == NpuOp.LEAKY_RELU:
        return numerics.leaky_relu_table(p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point,
                                         p.alpha)
    generate, (scale, zero_point), name = FIXED_OUTPUT_ACTIVATIONS[p.op]
    if (p.output_scale, p.output_zero_point) != (float(np.float32(scale)), zero_point):
        raise QParamError(f"int8 {name} needs output scale {scale:g} and zero point {zero_point}, "
                          f"got {p.output_scale:g} and {p.output_zero_point}")
    return generate(p.input_scale, p.input_zero_point)


DERIVE = {ConvParams: conv_multipliers, ElementwiseParams: elementwise_multipliers, MeanParams: mean_multiplier,
          PoolParams: no_multipliers, ReshapeParams: no_multipliers, LutParams: lut_table,
          ConcatParams: no_multipliers, PadParams: no_multipliers,
          SoftmaxParams: softmax_multiplier}


def derive_multipliers(p: NpuParams):
    return DERIVE[type(p)](p)
