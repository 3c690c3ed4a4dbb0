"""TVM's TFLite converter, with the quantized operators it refuses written in the canonical QDQ forms.

TVM 0.27 refuses every quantized operator outside its ``_SUPPORTED_QUANTIZED_OPS``, although some need
nothing new: PAD already pads with the zero point and STRIDED_SLICE moves int8 data as it is. GELU and ELU
have no quantized conversion at all; here they become ``quantize(f(dequantize(x)))``, the fake-quantized
activation the pattern table matches whole (GELU as ``nn.gelu`` or, with TFLite's ``approximate``,
``nn.gelu_tanh``; ELU as TVM's own float spelling). RESIZE_NEAREST_NEIGHBOR needs nothing new either: TVM
already converts it as ``image.resize2d`` on the int8 data, whose index arithmetic is TFLite's (it only copies
pixels, and TFLite keeps the qparams). BATCH_MATMUL of two activations becomes
``quantize(matmul(dequantize(lhs), dequantize(rhs)))``, with ``adj_x`` / ``adj_y`` as a ``permute_dims`` of the
int8 operand swapping its last two axes (pure data movement, which the batch-matmul pattern absorbs for the rhs).
:func:`npu_backend.load_tflite` uses this converter.

TFLite's 16x8 mode (int16 activations, int8 weights, an int64 bias) is imported for CONV_2D, the one 16x8
operator the NPU runs (bit-exactly: TVM's float arithmetic does not reproduce TFLite's int16 kernels; see
:attr:`NpuOperatorConverter.SIXTEEN_BY_EIGHT_OPS`). TVM converts it already, except that Relax's
``dequantize`` takes no int64 data: the bias is narrowed to int32, exactly, and a bias beyond int32 is
refused. Any other operator on int16 tensors is refused in one line.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax.frontend.tflite.tflite_frontend import OperatorConverter


class NpuOperatorConverter(OperatorConverter):
    _SUPPORTED_QUANTIZED_OPS = OperatorConverter._SUPPORTED_QUANTIZED_OPS | {
        "PAD", "PADV2", "STRIDED_SLICE", "GELU", "ELU", "RESIZE_NEAREST_NEIGHBOR", "BATCH_MATMUL"}

    SIXTEEN_BY_EIGHT_OPS = frozenset({"CONV_2D"})
    """Operators on int16 tensors (TFLite's 16x8 mode) this import accepts: those the NPU runs bit-exactly.
    TVM's float QDQ build of the others would not give TFLite's integers (on the 16x8 CONV_2D fixture it
    differs on 582 of 8192 outputs), so they are refused rather than run wrong on the host."""

    def check_unsupported_ops(self):
        """TVM's checks, after refusing in one line what of the 16x8 mode is not imported: operators outside
        ``SIXTEEN_BY_EIGHT_OPS`` on int16 tensors, and a 16x8 CONV_2D without an int64 bias (TFLite then
        accumulates in int32 and requantizes as for int8, a kernel the NPU does not implement)."""
        from tflite.TensorType import TensorType

        graph, refused, narrow_bias = self.subgraph, set(), []
        for i in range(graph.OperatorsLength()):
            op = graph.Operators(i)
            inputs = [op.Inputs(j) for j in range(op.InputsLength())]
            used = [t for t in (*inputs, *(op.Outputs(j) for j in range(op.OutputsLength()))) if t >= 0]
            if not any(graph.Tensors(t).Type() == TensorType.INT16 for t in used):
                continue
            name = self.get_op_code_str(op)
            if name not in self.SIXTEEN_BY_EIGHT_OPS:
                refused.add(name)
            elif len(inputs) < 3 or inputs[2] < 0 or graph.Tensors(inputs[2]).Type() != TensorType.INT64:
                narrow_bias.append(graph.Tensors(op.Outputs(0)).Name().decode())
        if refused:
            raise tvm.error.OpNotImplemented(
                f"int16 activations (16x8 quantization) of {', '.join(sorted(refused))} are not supported: "
                f"npu_backend imports 16x8 {', '.join(sorted(self.SIXTEEN_BY_EIGHT_OPS))} only")
        if narrow_bias:
            raise tvm.error.OpNotImplemented(
                f"16x8 CONV_2D {narrow_bias[0]!r} has no int64 bias: TFLite then accumulates in int32 and "
                f"requantizes as for int8, which the NPU's 16x8 convolution does not do")
        super().check_unsupported_ops()

    def dequantize(self, expr, tensor):
        """A 16x8 convolution's int64 bias is dequantized as int32, its values unchanged: Relax's ``dequantize``
        takes no int64 data (TVM's own conversion fails on it). A value beyond int32 is refused."""
        from tflite.TensorType import TensorType

        if tensor.tensor.Type() != TensorType.INT64:
            return super().dequantize(expr, tensor)
        name = tensor.tensor.Name().decode()
        if not isinstance(expr, Constant):
            raise tvm.error.OpNotImplemented(f"int64 tensor {name!r} is not a constant bias")
        values = expr.value.numpy()
        info = np.iinfo(np.int32)
        outside = values[(values < info.min) | (values > info.max)]
        if outside.size:
            raise tvm.error.OpNotImplemented(f"int64 bias {name!r} holds {int(outside[0])}, beyond the int32 "
                                             f"bias the NPU's scale/bias table carries")
        return super().dequantize(relax.const(values.astype(np.int32), "int32"), tensor)

    def _fake_quantized(self, op, function):
        """quantize(function(dequantize(input))) with the operator's own input and output qparams."""
        (input_tensor,) = self.get_input_tensors(op)
        (output_tensor,) = self.get_output_tensors(op)
        x = self.dequantize(self.get_expr(input_tensor.tensor_idx), input_tensor)
        return self.quantize(function(x), output_tensor)

    def convert_gelu(self, op):
        if not self.is_quantized(op):
            return super().convert_gelu(op)
        from tflite.GeluOptions import GeluOptions

        options = GeluOptions()
        table = op.BuiltinOptions()
        approximate = False
        if table is not None:
            options.Init(table.Bytes, table.Pos)
            approximate = bool(options.Approximate())
        return self._fake_quantized(op, relax.op.nn.gelu_tanh if approximate else relax.op.nn.gelu)

    def convert_elu(self, op):
        if not self.is_quantized(op):
            return super().convert_elu(op)

        def elu(x):  # TVM's float ELU (convert_elu): -1 * relu(1 - exp(x)) + relu(x)
            return relax.const(-1.0, "float32") * relax.op.nn.relu(
                relax.const(1.0, "float32") - relax.op.exp(x)) + relax.op.nn.relu(x)

        return self._fake_quantized(op, elu)

    def convert_batch_matmul(self, op):
        if not self.is_quantized(op):
            return super().convert_batch_matmul(op)
        from tflite.BatchMatMulOptions import BatchMatMulOptions

        options = BatchMatMulOptions()
        table = op.BuiltinOptions()
        options.Init(table.Bytes, table.Pos)
        lhs, rhs = self.get_input_tensors(op)
        (output_tensor,) = self.get_output_tensors(op)

        def operand(tensor, adjoint: bool):
            expr = self.get_tensor_expr(tensor)
            if adjoint:  # TFLite's adj_x / adj_y: the operand's last two axes swapped
                rank = len(tensor.tensor.ShapeAsNumpy())
                expr = relax.op.permute_dims(expr, [*range(rank - 2), rank - 1, rank - 2])
            return self.dequantize(expr, tensor)

        product = relax.op.matmul(operand(lhs, options.AdjX()), operand(rhs, options.AdjY()))
        return self.quantize(product, output_tensor)
