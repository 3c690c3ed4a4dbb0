"""The batch-matmul idiom: the product of two dequantized int8 activations, requantized.

``quantize(matmul(dequantize(a), dequantize(b)))``, where ``b`` may be a ``permute_dims`` of an int8 tensor
that swaps its last two axes (TFLite's ``adj_y``, as :mod:`npu_backend.tflite_import` writes it): the
MAC array reads that operand transposed, so the transpose costs no command. A constant ``b`` is a fully
connected layer's weight, not this idiom: the pattern leaves it to that operator.
"""

from __future__ import annotations

from collections.abc import Mapping

from tvm import relax
from tvm.relax.dpl.pattern import is_const, is_op, wildcard

from ..errors import UnsupportedOpError
from ..params import BatchMatMulParams, NpuOp
from .extract import _dequantized_int8, _input_and_output, _shape


def batch_matmul_pattern(with_clip: bool):
    """quantize(matmul(dequantize(a), dequantize([permute_dims] b))) of two computed int8 tensors."""
    x, x2 = wildcard(), ~is_const()
    input_dq = is_op("relax.dequantize")(x, is_const(), is_const())
    permute = is_op("relax.permute_dims")(x2)
    input2_dq = is_op("relax.dequantize")(permute | x2, is_const(), is_const())
    matmul = is_op("relax.matmul")(input_dq, input2_dq)
    quantize = is_op("relax.quantize")(matmul, is_const(), is_const())
    return quantize, dict(input=x, input_dq=input_dq, input2=x2, input2_permute=permute, input2_dq=input2_dq,
                          anchor=matmul, quantize=quantize)


def _adjoint(annotations, rank: int) -> bool:
    """Whether the second operand is transposed: a permute_dims swapping exactly its last two axes."""
    permute = annotations.get("input2_permute")
    if permute is None:
        return False
    axes = (list(reversed(range(rank))) if permute.attrs.axes is None
            else [int(a) % rank for a in permute.attrs.axes])
    if axes != [*range(rank - 2), rank - 1, rank - 2]:
        raise UnsupportedOpError(f"permute_dims {axes} of the second operand is not a swap of its last two axes")
    return True


def extract_batch_matmul(annotations: Mapping[str, relax.Expr]) -> BatchMatMulParams:
    """TFLite's int8 BATCH_MATMUL: both operands' and the output's qparams, batch axes equal (no broadcast)."""
    x, in_scale, in_zp, out_scale, out_zp = _input_and_output(annotations)
    x2, in2_scale, in2_zp = _dequantized_int8(annotations, "input2", "input2_dq", "second input")
    ifm_shape, ifm2_shape, ofm_shape = _shape(x), _shape(x2), _shape(annotations["anchor"])
    rhs = _shape(annotations["input2_dq"])
    if len(ifm_shape) < 2 or len(rhs) != len(ifm_shape) or ifm_shape[:-2] != rhs[:-2]:
        raise UnsupportedOpError(f"batch matmul of {list(ifm_shape)} and {list(rhs)}: the NPU multiplies operands "
                                 "of equal rank and equal batch axes only (no broadcasting)")
    return BatchMatMulParams(op=NpuOp.BATCH_MATMUL, ifm_shape=ifm_shape, ifm2_shape=ifm2_shape, ofm_shape=ofm_shape,
                             adj_y=_adjoint(annotations, len(ifm2_shape)), input_scale=in_scale,
                             input_zero_point=in_zp, input2_scale=in2_scale, input2_zero_point=in2_zp,
                             output_scale=out_scale, output_zero_point=out_zp)
