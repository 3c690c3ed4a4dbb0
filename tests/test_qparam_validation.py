"""Invalid quantization parameters end as one QParamError naming the binding, the tensor and the value, before
anything is partitioned, whether the operator would have landed on the NPU or on the host."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from npu_backend.errors import QParamError
from relax_idioms import ConvIdiom, f32, i32


def _conv(**changes) -> ConvIdiom:
    idiom = ConvIdiom()
    for name, value in changes.items():
        if name == "weight_scales":
            idiom.weight_scales = np.asarray(value, np.float32)
        else:
            idiom = dataclasses.replace(idiom, **{name: value})
    return idiom


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("changes, message", [
    (dict(output_scale=0.0), r"= relax.quantize\(\w+\): tensor \w+ \(quantized\): scale = 0 must be positive"),
    (dict(input_scale=-0.5), r"relax.dequantize\(x\): tensor x \(dequantized\): scale = -0.5 must be positive"),
    (dict(input_scale=NAN), r"tensor x \(dequantized\): scale = nan must be positive and finite"),
    (dict(output_scale=INF), r"\(quantized\): scale = inf must be positive and finite"),
    (dict(weight_scales=[0.01, 0.02, 0.0, 0.01, 0.01, 0.01]), r"tensor \w+ \(dequantized\): scale\[2\] = 0 must"),
    (dict(input_zero_point=200), r"tensor x \(dequantized\): zero point = 200 is outside int8 \[-128, 127\]"),
    (dict(output_zero_point=-129), r"\(quantized\): zero point = -129 is outside int8 \[-128, 127\]"),
])
def test_invalid_qparams_of_an_offloadable_conv(changes, message):
    with pytest.raises(QParamError, match=message):
        npu_backend.partition_for_npu(_conv(**changes).module())


def _dequantized_weights(scales, axis):
    """A float conv (left on the host) whose weights are a per-axis dequantize of int8 constants."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 4, 2), "float32"))
    w = relax.const(np.ones((3, 3, 2, 4), np.int8))
    with bb.function("main", [x]):
        with bb.dataflow():
            wf = bb.emit(relax.op.dequantize(w, f32(np.asarray(scales, np.float32)),
                                             i32(np.zeros(len(scales), np.int32)), axis=axis))
            y = bb.emit_output(relax.op.nn.conv2d(x, wf, padding=1, data_layout="NHWC", kernel_layout="HWIO"))
        bb.emit_func_output(y)
    return bb.get()


def test_a_valid_per_axis_dequantize_passes():
    npu_backend.partition_for_npu(_dequantized_weights([0.1] * 4, 3))


def _spliced(mod, scales, axis):
    """``mod`` with its dequantize's qparams replaced by a raw call: what a module deserialized or built
    without TVM's normalization can hold (BlockBuilder's inference refuses these at construction)."""
    func = mod["main"]
    (block,) = func.body.blocks
    bindings = []
    for binding in block.bindings:
        value = binding.value
        if isinstance(value, relax.Call) and value.op.name == "relax.dequantize":
            attrs = tvm.ir.make_node("relax.attrs.QuantizeAttrs", axis=axis, out_dtype=value.attrs.out_dtype)
            value = relax.Call(value.op, [value.args[0], f32(np.asarray(scales, np.float32)),
                                          i32(np.zeros(len(scales), np.int32))], attrs)
        bindings.append(relax.VarBinding(binding.var, value))
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], func.body.body)
    return tvm.IRModule({"main": relax.Function(func.params, body, func.ret_ty)})


def test_per_axis_scales_must_match_their_axis():
    """Checked on a host operator too: validity does not depend on where the operator runs."""
    with pytest.raises(QParamError, match="3 scales for axis 3 of extent 4"):
        npu_backend.partition_for_npu(_spliced(_dequantized_weights([0.1] * 4, 3), [0.1, 0.2, 0.3], 3))


def test_the_quantization_axis_must_exist():
    with pytest.raises(QParamError, match="quantization axis 7 is out of range for rank 4"):
        npu_backend.partition_for_npu(_spliced(_dequantized_weights([0.1] * 4, 3), [0.1] * 4, 7))


def test_constant_value_reads_each_small_constant_once_and_read_only():
    from npu_backend.relax_exprs import SMALL_CONSTANT, constant_value

    x = relax.Var("x", relax.TensorType((1, 4), "float32"))
    call = relax.op.quantize(x, relax.const(np.float32(0.25)), relax.const(np.int32(-3)), axis=-1,
                             out_dtype="int8")
    first, again = constant_value(call.args[1]), constant_value(call.args[1])  # two wrappers of one constant
    assert first is again and first == np.float32(0.25) and constant_value(call.args[2]) == -3
    with pytest.raises(ValueError):
        first[...] = 1.0
    big = relax.const(np.arange(SMALL_CONSTANT + 1, dtype=np.float32))
    a, b = constant_value(big), constant_value(big)
    assert a is not b and np.array_equal(a, b) and not a.flags.writeable  # large ones are read each time
    other = relax.const(np.float32(0.25))
    assert constant_value(other) is not first  # equal values, another constant: its own entry


def test_constant_value_keeps_a_bounded_table(monkeypatch):
    from npu_backend import relax_exprs

    monkeypatch.setattr(relax_exprs, "_VALUES_KEPT", 2)
    monkeypatch.setattr(relax_exprs, "_VALUES", type(relax_exprs._VALUES)())
    first, second, third = (relax.const(np.float32(v)) for v in (1.0, 2.0, 3.0))
    a = relax_exprs.constant_value(first)
    assert relax_exprs.constant_value(first) is a  # kept
    relax_exprs.constant_value(second)
    relax_exprs.constant_value(third)  # the least recently read, first, goes
    assert len(relax_exprs._VALUES) == 2
    again = relax_exprs.constant_value(first)
    assert again is not a and again == a
