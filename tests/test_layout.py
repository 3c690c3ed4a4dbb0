"""NCHW -> NHWC: ONNX QDQ graphs reach the pattern table in the NPU's layout, transposing only int8 data."""

import numpy as np
import onnx
import pytest
import tvm
from onnx import numpy_helper
from tvm import relax

import npu_backend
from conftest import FIXTURES
from npu_backend.canonicalize import canonicalize
from npu_backend.layout import convert_to_nhwc

ONNX = FIXTURES / "onnx"


def _calls(func, name):
    return [b.value for block in func.body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op) and b.value.op.name == name]


@pytest.mark.parametrize("model, transposes", [("conv_relu_per_channel_asymmetric", 2), ("residual", 2),
                                               ("concat", 2), ("global_avgpool", 2), ("gemm", 0)])
def test_transposes_only_at_the_graph_edges_and_only_of_int8(model, transposes):
    main = canonicalize(npu_backend.load_onnx(ONNX / f"{model}.onnx"))["main"]
    permutes = _calls(main, "relax.permute_dims")
    assert len(permutes) == transposes
    assert all(str(p.args[0].ty.dtype) == "int8" for p in permutes)
    for conv in _calls(main, "relax.nn.conv2d"):
        assert (str(conv.attrs.data_layout), str(conv.attrs.kernel_layout)) == ("NHWC", "HWIO")


def test_weights_are_transposed_at_compile_time_with_their_channel_axis():
    model = onnx.load(ONNX / "conv_relu_per_channel_asymmetric.onnx")
    oihw = next(numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT8
                and len(t.dims) == 4)
    main = canonicalize(npu_backend.load_onnx(ONNX / "conv_relu_per_channel_asymmetric.onnx"))["main"]
    (conv,) = _calls(main, "relax.nn.conv2d")
    weight_dq = relax.analysis.get_var2val(main)[conv.args[1]]
    np.testing.assert_array_equal(weight_dq.args[0].value.numpy(), np.transpose(oihw, (2, 3, 1, 0)))
    assert int(weight_dq.attrs.axis) == 3 and weight_dq.args[1].value.numpy().size == 16


def test_bias_reshaped_for_nchw_becomes_one_dequantized_constant():
    main = canonicalize(npu_backend.load_onnx(ONNX / "conv_relu_per_channel_asymmetric.onnx"))["main"]
    assert _calls(main, "relax.reshape") == []
    var2val = relax.analysis.get_var2val(main)
    (add,) = _calls(main, "relax.add")
    bias = var2val[add.args[1]]
    assert bias.op.name == "relax.dequantize" and tuple(bias.ty.shape.values) == (1, 1, 1, 16)
    assert int(bias.attrs.axis) == 3


def test_nhwc_graphs_are_left_alone():
    from relax_idioms import ConvIdiom

    func = ConvIdiom().module()["main"]
    assert convert_to_nhwc(func).same_as(func)


def test_an_operator_that_needs_nchw_gets_it_back_by_one_transpose():
    """A reshape after an NCHW conv sees NCHW data: one int8 transpose before it, none after the conv's input."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 6, 6), "int8"))
    f32 = lambda v: relax.const(np.float32(v))  # noqa: E731
    i8 = lambda v: relax.const(np.int8(v))  # noqa: E731
    w = np.random.default_rng(0).integers(-127, 128, (8, 4, 3, 3), dtype=np.int8)
    with bb.function("main", [x]):
        with bb.dataflow():
            dx = bb.emit(relax.op.dequantize(x, f32(0.1), i8(3), axis=1))
            dw = bb.emit(relax.op.dequantize(relax.const(w), f32(0.01), i8(0), axis=0))
            conv = bb.emit(relax.op.nn.conv2d(dx, dw, padding=(1, 1, 1, 1)))
            q = bb.emit(relax.op.quantize(conv, f32(0.2), i8(-1), axis=1, out_dtype="int8"))
            gv = bb.emit_output(relax.op.reshape(q, (1, 288)))
        bb.emit_func_output(gv)
    main = canonicalize(bb.get())["main"]
    permutes = _calls(main, "relax.permute_dims")
    assert [tuple(int(a) for a in p.attrs.axes) for p in permutes] == [(0, 2, 3, 1), (0, 3, 1, 2)]
    assert all(str(p.args[0].ty.dtype) == "int8" for p in permutes)
    (reshape,) = _calls(main, "relax.reshape")
    assert tuple(reshape.args[0].ty.shape.values) == (1, 8, 6, 6)


def _nchw_conv(kernel=3, weight_is_param=False, x_dtype="int8", per_channel_input=False):
    """An ONNX-style QDQ conv (NCHW/OIHW, int8 zero points) built by hand, varying one thing."""
    rng = np.random.default_rng(0)
    f32 = lambda v: relax.const(np.asarray(v, np.float32))  # noqa: E731
    i8 = lambda v: relax.const(np.asarray(v, np.int8))  # noqa: E731
    w = rng.integers(-127, 128, (8, 4, kernel, kernel), dtype=np.int8)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 12, 12), x_dtype))
    params = [x]
    if weight_is_param:
        wv = relax.Var("w", relax.TensorType(w.shape, "int8"))
        params.append(wv)
    with bb.function("main", params):
        with bb.dataflow():
            if x_dtype == "int8":
                in_scale = f32(np.full(4, 0.05)) if per_channel_input else f32(0.05)
                in_zp = i8(np.full(4, 3)) if per_channel_input else i8(3)
                dx = bb.emit(relax.op.dequantize(x, in_scale, in_zp, axis=1))
            else:
                dx = x
            dw = bb.emit(relax.op.dequantize(wv if weight_is_param else relax.const(w), f32(np.full(8, 0.01)),
                                             i8(np.zeros(8)), axis=0))
            pad = kernel // 2
            conv = bb.emit(relax.op.nn.conv2d(dx, dw, padding=(pad, pad, pad, pad)))
            gv = bb.emit_output(relax.op.quantize(conv, f32(0.2), i8(-1), axis=1, out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def test_nchw_conv_reaches_the_same_composite_as_tflite():
    mod = npu_backend.partition_for_npu(_nchw_conv(), reference="onnxruntime")
    report = npu_backend.partition_report(mod)
    assert {o.composite for o in report.npu_ops} == {"npu.conv2d", "npu.transpose"} and not report.host_ops


@pytest.mark.parametrize("variant, reason", [
    (dict(kernel=9), "kernel 9x9 exceeds the NPU maximum of 8"),
    (dict(weight_is_param=True), "no NPU pattern covers this operator"),
    (dict(x_dtype="float32"), "no NPU pattern covers this operator"),
    (dict(per_channel_input=True), "input must be quantized per tensor")])
def test_nchw_conv_the_npu_cannot_run_stays_on_host_with_the_reason(variant, reason):
    mod = npu_backend.partition_for_npu(_nchw_conv(**variant), reference="onnxruntime")
    report = npu_backend.partition_report(mod)
    (conv,) = [o for o in report.ops if o.op == "relax.nn.conv2d"]
    assert conv.target == "host" and reason in conv.reason, report.format_table()


def _broadcast_multiply(gate_shape):
    """A lone QDQ multiply of NCHW int8 data [1, 8, 6, 6] by an int8 operand of ``gate_shape``: a squeeze-excite
    gate as calibration builds it, a layer alone (no convolution before it to make its data NHWC)."""
    f32 = lambda v: relax.const(np.float32(v))  # noqa: E731
    i8 = lambda v: relax.const(np.int8(v))  # noqa: E731
    x = relax.Var("x", relax.TensorType((1, 8, 6, 6), "int8"))
    g = relax.Var("g", relax.TensorType(gate_shape, "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g]):
        with bb.dataflow():
            dx = bb.emit(relax.op.dequantize(x, f32(0.05), i8(-3)))
            dg = bb.emit(relax.op.dequantize(g, f32(1 / 256), i8(-128)))
            y = bb.emit(relax.op.multiply(dx, dg))
            gv = bb.emit_output(relax.op.quantize(y, f32(0.04), i8(-5), out_dtype="int8"))
        bb.emit_func_output(gv)
    return bb.get()


def test_a_per_channel_broadcast_is_converted_even_alone_and_runs_on_the_npu():
    """In NCHW the gate broadcasts over the spatial axes (which the NPU does not do), in NHWC along the last axis
    (which it does): converted alone as in a whole model, so calibration's one-layer build places it where the
    whole model's partition does (it was on the host alone, on the NPU in the model: NPU != simulation)."""
    main = canonicalize(_broadcast_multiply((1, 8, 1, 1)))["main"]
    (multiply,) = _calls(main, "relax.multiply")
    assert tuple(multiply.args[1].ty.shape.values) == (1, 1, 1, 8)
    assert all(str(p.args[0].ty.dtype) == "int8" for p in _calls(main, "relax.permute_dims"))
    report = npu_backend.partition_report(npu_backend.partition_for_npu(_broadcast_multiply((1, 8, 1, 1))))
    assert [o.target for o in report.ops if o.op == "relax.multiply"] == ["npu"]


@pytest.mark.parametrize("gate_shape", [(1, 1, 6, 6), (1, 8, 6, 6), (1, 1, 1, 1)])
def test_other_broadcasts_alone_stay_in_their_layout(gate_shape):
    main = canonicalize(_broadcast_multiply(gate_shape))["main"]
    assert not _calls(main, "relax.permute_dims")


def test_a_per_channel_broadcast_of_float_data_is_not_transposed():
    """Converting it would transpose floats (the rule converts only dequantized or constant operands)."""
    x = relax.Var("x", relax.TensorType((1, 8, 6, 6), "float32"))
    g = relax.Var("g", relax.TensorType((1, 8, 1, 1), "int8"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, g]):
        with bb.dataflow():
            dg = bb.emit(relax.op.dequantize(g, relax.const(np.float32(1 / 256)), relax.const(np.int8(-128))))
            gv = bb.emit_output(relax.op.multiply(x, dg))
        bb.emit_func_output(gv)
    assert not _calls(canonicalize(bb.get())["main"], "relax.permute_dims")
