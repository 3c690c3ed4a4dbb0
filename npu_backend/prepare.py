"""Constants the hardware needs, prepared exactly as the reference runtime does: multipliers and tables.

TFLite roundings: TFLite's own preparation (fixed-point multipliers, integer
tables). ``Rounding.ONNXRUNTIME``: the MAC array gets double scales, the
elementwise, mean and pooling units compute with the float32 scales
themselves (no multipliers), and tables are onnxruntime's float32 function
of every dequantized input.

This module sits below both the pattern table and the codegen: the legality
check calls an operator's preparation (a scale the hardware cannot represent
keeps the operator on the host) and the lowering programs what it returns.
Which preparation an operator uses is said by its definition in
:mod:`npu_backend.ops`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from simulator import numerics, onnxruntime_numerics, softmax, tables
from simulator import resize as bilinear
from simulator.elementwise import elementwise_fields
from simulator.isa import ActivationType, Opcode

from .errors import QParamError, UnsupportedOpError
from .params import ConvParams, ElementwiseParams, LutParams, MeanParams, NpuOp, PoolParams, SoftmaxParams
from .params import BatchMatMulParams, ResizeBilinearParams


def conv_multipliers(p: ConvParams):
    """Per-channel (multiplier, shift); per-tensor fully connected multiplies scales in float32.

    With ``Rounding.FLOAT64`` and ``Rounding.ONNXRUNTIME`` the pair is the
    float64 scale split into its two 32-bit halves, the layout the output
    stage reads in those modes.
    """
    if p.activation_type == ActivationType.INT16:  # TFLite's 16x8 Prepare: the int8 multipliers, shift <= 7
        return numerics.conv_multipliers_16x8(p.input_scale, p.weight_scales, p.output_scale)
    if p.rounding in (numerics.Rounding.FLOAT64, numerics.Rounding.ONNXRUNTIME):
        words = numerics.float_scales(p.input_scale, p.weight_scales, p.output_scale).view(np.int32)
        return words[0::2].copy(), words[1::2].copy()
    if p.op == NpuOp.FULLY_CONNECTED and not p.per_channel:
        multiplier, shift = numerics.fully_connected_multiplier(
            p.input_scale, p.weight_scales[0], p.output_scale, p.rounding)
        return np.repeat(multiplier, p.out_channels), np.repeat(shift, p.out_channels)
    return numerics.conv_multipliers(p.input_scale, p.weight_scales, p.output_scale, p.rounding)


def _check_ort_scales(**scales: float) -> None:
    """onnxruntime divides by and multiplies with the float32 scales: each must be positive and finite."""
    for name, scale in scales.items():
        value = np.float32(scale)
        if not (np.isfinite(value) and value > 0):
            raise QParamError(f"{name} {scale} must be positive and finite")


def elementwise_prepare(opcode: Opcode) -> Callable[[ElementwiseParams], dict]:
    """The arithmetic fields of one elementwise opcode's commands (:mod:`simulator.elementwise`)."""

    def prepare(p: ElementwiseParams) -> dict:
        if p.rounding == numerics.Rounding.ONNXRUNTIME:
            _check_ort_scales(input_scale=p.input_scale, input2_scale=p.input2_scale, output_scale=p.output_scale)
        return elementwise_fields(opcode, p.input_scale, p.input2_scale, p.output_scale, p.rounding)

    prepare.__doc__ = f"{opcode.name}'s fields, as TFLite's Prepare (or onnxruntime's scales) give them."
    return prepare


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


def nothing(p) -> tuple:
    """Data movement (reshape, concat, pad, transpose, slice) keeps its inputs' qparams: nothing to prepare."""
    return ()


def pool_qparams(p: PoolParams) -> tuple:
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


TableFunction = Callable[[LutParams], np.ndarray]


def lut_prepare(tflite: TableFunction, onnxruntime: TableFunction | None) -> TableFunction:
    """The table of a look-up operator: TFLite's kernel, or onnxruntime's ``Q(f(DQ(q)))``."""

    def prepare(p: LutParams) -> np.ndarray:
        if p.rounding != numerics.Rounding.ONNXRUNTIME:
            return tflite(p)
        if onnxruntime is None:
            raise UnsupportedOpError(f"no onnxruntime table for {p.op.value}: onnxruntime's kernel for it is not "
                                     "reproduced")
        return onnxruntime(p)

    return prepare


def _qparams(p: LutParams) -> tuple:
    return p.input_scale, p.input_zero_point, p.output_scale, p.output_zero_point


def populated(function) -> TableFunction:
    """TFLite's ``LUTPopulate`` of a float function (EXP, GELU, ELU): float32 in, rounded half away from zero."""
    return lambda p: tables.lut_populate(function, *_qparams(p))


def fixed_output(table) -> TableFunction:
    """A TFLite kernel whose output qparams are fixed (LOGISTIC, TANH): the table needs only the input's."""
    return lambda p: table(p.input_scale, p.input_zero_point)


def with_qparams(table) -> TableFunction:
    """A TFLite kernel of the input's and output's qparams (HARD_SWISH, QUANTIZE)."""
    return lambda p: table(*_qparams(p))


def tflite_leaky_relu(p: LutParams) -> np.ndarray:
    return tables.leaky_relu_table(*_qparams(p), p.alpha)


def onnxruntime_function(function) -> TableFunction:
    """onnxruntime's float32 ``function`` of every dequantized input, quantized half to even."""
    return lambda p: onnxruntime_numerics.qdq_table(function, *_qparams(p))


def onnxruntime_leaky_relu(p: LutParams) -> np.ndarray:
    return onnxruntime_numerics.qdq_leaky_relu_table(*_qparams(p), p.alpha)


def batch_matmul_multiplier(p: BatchMatMulParams) -> tuple[int, int]:
    """(multiplier, shift) of TFLite's int8 BATCH_MATMUL (scales multiplied in float32, as FULLY_CONNECTED)."""
    return numerics.batch_matmul_multiplier(p.input_scale, p.input2_scale, p.output_scale, p.rounding)


def resize_bilinear_steps(p: ResizeBilinearParams) -> tuple[int, int, int, int]:
    """(step_h, step_w, offset_h, offset_w) of the whole image: TFLite's 10-bit fixed-point positions."""
    _, height, width, _ = p.ifm_shape
    _, out_height, out_width, _ = p.ofm_shape
    step_h = bilinear.bilinear_step(height, out_height, p.align_corners)
    step_w = bilinear.bilinear_step(width, out_width, p.align_corners)
    return (step_h, step_w, bilinear.bilinear_offset(step_h, p.half_pixel_centers),
            bilinear.bilinear_offset(step_w, p.half_pixel_centers))
