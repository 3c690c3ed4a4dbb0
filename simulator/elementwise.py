"""The elementwise unit's opcodes (ADD, SUB, MUL): one record each, read by the compiler, validator and kernel.

TFLite's integer kernels come in two shapes. ADD and SUB shift both centred
inputs left by 20 bits, rescale each to a common scale, combine them and
requantize to the output. MUL multiplies the centred inputs and requantizes
the product with the output multiplier alone: it has no input rescale, so its
input multipliers, shifts and left shift are 0. That fact lives here only:
:func:`elementwise_fields` programs a command, the validator rejects a MUL
that sets the unused fields, and :func:`compute` runs it.

``Rounding.ONNXRUNTIME`` replaces every fixed-point field with the three
float32 scales (onnxruntime dequantizes, combines in float32, quantizes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .errors import NpuError
from .isa import Elementwise, Opcode
from .numerics import (ADD_LEFT_SHIFT, Rounding, add_multipliers, elementwise_add, elementwise_mul,
                       elementwise_sub, mul_multiplier, sub_multipliers)
from .onnxruntime_numerics import ort_elementwise

INPUT_RESCALE_FIELDS = ("input_multiplier", "input_shift", "input2_multiplier", "input2_shift", "left_shift")
"""The fields of the input rescale, which only the opcodes with ``rescales_inputs`` read."""

FIXED_POINT_FIELDS = (*INPUT_RESCALE_FIELDS, "output_multiplier", "output_shift")
SCALE_FIELDS = ("input_scale", "input2_scale", "output_scale")


@dataclass(frozen=True)
class BinaryArithmetic:
    """How one elementwise opcode computes under TFLite's roundings."""

    rescales_inputs: bool
    """ADD, SUB: inputs rescaled to a common scale (left shift 20) before combining; MUL: only the product."""
    prepare: Callable
    """(s1, s2, s_out, rounding) -> the fixed-point multipliers and shifts TFLite's Prepare computes."""
    integer_kernel: Callable
    float_op: np.ufunc
    """The float32 operation under ``Rounding.ONNXRUNTIME``."""


def _mul_prepare(input_scale, input2_scale, output_scale, rounding):
    return (0, 0, 0, 0, *mul_multiplier(input_scale, input2_scale, output_scale, rounding))


def _mul_kernel(x1, x2, op: Elementwise):
    return elementwise_mul(x1, x2, op.input_zero_point, op.input2_zero_point, op.output_zero_point,
                           op.output_multiplier, op.output_shift, op.act_min, op.act_max, op.rounding)


def _rescaled_kernel(combine):
    def kernel(x1, x2, op: Elementwise):
        return combine(x1, x2, op.input_zero_point, op.input2_zero_point, op.output_zero_point,
                       op.input_multiplier, op.input_shift, op.input2_multiplier, op.input2_shift,
                       op.output_multiplier, op.output_shift, op.left_shift, op.act_min, op.act_max, op.rounding)
    return kernel


BINARY: dict[Opcode, BinaryArithmetic] = {
    Opcode.ADD: BinaryArithmetic(True, add_multipliers, _rescaled_kernel(elementwise_add), np.add),
    Opcode.SUB: BinaryArithmetic(True, sub_multipliers, _rescaled_kernel(elementwise_sub), np.subtract),
    Opcode.MUL: BinaryArithmetic(False, _mul_prepare, _mul_kernel, np.multiply),
}


def arithmetic(opcode: Opcode) -> BinaryArithmetic:
    try:
        return BINARY[opcode]
    except KeyError:
        raise NpuError(f"{opcode!r} is not an elementwise opcode") from None


def elementwise_fields(opcode: Opcode, input_scale: float, input2_scale: float, output_scale: float,
                       rounding: Rounding) -> dict[str, int | float]:
    """Every arithmetic field of an :class:`Elementwise` payload, as the compiler must program it."""
    arith = arithmetic(opcode)  # refuses an opcode that is not ADD, SUB or MUL, whatever the rounding
    if rounding == Rounding.ONNXRUNTIME:
        return {**dict.fromkeys(FIXED_POINT_FIELDS, 0),
                **dict(zip(SCALE_FIELDS, (input_scale, input2_scale, output_scale)))}
    m1, s1, m2, s2, mo, so = arith.prepare(input_scale, input2_scale, output_scale, rounding)
    return dict(input_multiplier=m1, input_shift=s1, input2_multiplier=m2, input2_shift=s2, output_multiplier=mo,
                output_shift=so, left_shift=ADD_LEFT_SHIFT if arith.rescales_inputs else 0,
                **dict.fromkeys(SCALE_FIELDS, 0.0))


def unused_fields(opcode: Opcode, op: Elementwise) -> tuple[str, list[str]]:
    """(why, fields): nonzero fields this opcode and rounding never read (a stream must leave them 0)."""
    if op.rounding == Rounding.ONNXRUNTIME:
        why, unread = "ONNXRUNTIME computes with the scales", FIXED_POINT_FIELDS
    elif any(getattr(op, name) != 0 for name in SCALE_FIELDS):
        why, unread = "only ONNXRUNTIME reads the scales", SCALE_FIELDS
    elif not arithmetic(opcode).rescales_inputs:
        why, unread = f"{opcode.name} rescales only the product", INPUT_RESCALE_FIELDS
    else:
        return "", []
    return why, [name for name in unread if getattr(op, name) != 0]


def compute(opcode: Opcode, x1: np.ndarray, x2: np.ndarray, op: Elementwise) -> np.ndarray:
    """The int8 result of one elementwise command on flat inputs."""
    arith = arithmetic(opcode)
    if op.rounding == Rounding.ONNXRUNTIME:
        return ort_elementwise(arith.float_op, x1, x2, op.input_scale, op.input_zero_point, op.input2_scale,
                               op.input2_zero_point, op.output_scale, op.output_zero_point, op.act_min, op.act_max)
    return arith.integer_kernel(x1, x2, op)
