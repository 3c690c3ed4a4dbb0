"""TVM's TFLite converter, with the quantized operators it refuses written in the canonical QDQ forms.

TVM 0.27 refuses every quantized operator outside its ``_SUPPORTED_QUANTIZED_OPS``, although some need
nothing new: PAD already pads with the zero point and STRIDED_SLICE moves int8 data as it is. GELU and ELU
have no quantized conversion at all; here they become ``quantize(f(dequantize(x)))``, the fake-quantized
activation the pattern table matches whole (GELU as ``nn.gelu`` or, with TFLite's ``approximate``,
``nn.gelu_tanh``; ELU as TVM's own float spelling). :func:`npu_backend.load_tflite` uses this converter.
"""

from __future__ import annotations

from tvm import relax
from tvm.relax.frontend.tflite.tflite_frontend import OperatorConverter


class NpuOperatorConverter(OperatorConverter):
    _SUPPORTED_QUANTIZED_OPS = OperatorConverter._SUPPORTED_QUANTIZED_OPS | {
        "PAD", "PADV2", "STRIDED_SLICE", "GELU", "ELU"}

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
