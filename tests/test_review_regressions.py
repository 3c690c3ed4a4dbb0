"""Regressions found in review: each case once crashed, mis-ran or mis-reported."""

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from relax_idioms import activation_module, f32, i32
from test_patterns import composites


def _run(mod, *inputs):
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(mod), target="llvm"), tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(x) for x in inputs])


def test_a_tensor_used_twice_by_one_operator():
    """x * x: one composite parameter feeds both operands (this crashed partitioning)."""
    import reference_kernels as ref

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            dx = bb.emit(relax.op.dequantize(x, f32(0.05), i32(3), axis=0))
            gv = bb.emit_output(relax.op.quantize(relax.op.multiply(dx, dx), f32(0.3), i32(-7), axis=0,
                                                  out_dtype="int8"))
        bb.emit_func_output(gv)
    mod = npu_backend.partition_for_npu(bb.get())
    assert [name for name, _ in composites(mod)] == ["npu.multiply"]
    data = np.random.default_rng(0).integers(-128, 128, (1, 4, 4, 8), dtype=np.int8)
    s = float(np.float32(0.05))
    want = ref.mul(data.ravel().tolist(), data.ravel().tolist(), s, 3, s, 3, float(np.float32(0.3)), -7,
                   (-128, 127))
    np.testing.assert_array_equal(_run(mod, data).numpy().ravel(), want)


def test_softmax_stays_on_host_under_onnxruntime():
    """The NPU's softmax is TFLite's fixed-point kernel; onnxruntime's float softmax is not it."""
    module = activation_module(lambda x: relax.op.nn.softmax(x, axis=-1), shape=(2, 10))
    mod = npu_backend.partition_for_npu(module, reference="onnxruntime")
    assert composites(mod) == []
    softmax = next(o for o in npu_backend.partition_report(mod).host_ops if o.op == "relax.nn.softmax")
    assert "onnxruntime's float32 softmax" in softmax.reason
    assert [n for n, _ in composites(npu_backend.partition_for_npu(module, reference="tflite"))] == ["npu.softmax"]


def test_a_transpose_whose_line_does_not_fit_sram_stays_on_host():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 224, 224), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(relax.op.permute_dims(x, (0, 2, 3, 1)))
        bb.emit_func_output(gv)
    mod = npu_backend.partition_for_npu(bb.get(), preset="npu-tiny")
    (op,) = npu_backend.partition_report(mod).host_ops
    assert op.reason == "npu.transpose: a 50176-byte transpose line does not fit the 32768-byte SRAM"
    small = npu_backend.partition_for_npu(bb.get(), preset="npu-256")
    data = np.random.default_rng(1).integers(-128, 128, (1, 3, 224, 224), dtype=np.int8)
    np.testing.assert_array_equal(_run(small, data).numpy(), np.transpose(data, (0, 2, 3, 1)))


def test_a_shared_dequantize_that_is_also_returned():
    """A dequantize both returned (in a tuple) and consumed: the returned binding must survive."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 4), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            d = bb.emit_output(relax.op.dequantize(x, f32(0.05), i32(1), axis=0))
            s = bb.emit_output(relax.op.quantize(relax.op.sigmoid(d), f32(1 / 256), i32(-128), axis=0,
                                                 out_dtype="int8"))
        bb.emit_func_output(relax.Tuple([d, s]))
    mod = npu_backend.partition_for_npu(bb.get())
    assert [name for name, _ in composites(mod)] == ["npu.sigmoid"]
    data = np.random.default_rng(2).integers(-128, 128, (1, 8, 8, 4), dtype=np.int8)
    real, sig = _run(mod, data)
    np.testing.assert_array_equal(real.numpy(), (data.astype(np.float32) - 1) * np.float32(0.05))
    from npu_backend.ops import op_def
    (_, p), = composites(mod)
    np.testing.assert_array_equal(sig.numpy(), op_def(p.op).prepare(p)[data.astype(np.int16) + 128])


@pytest.mark.parametrize("axes", [(1, 0), (-1, -2), None])
def test_weights_transposed_with_any_spelling_of_the_axes(axes):
    rng = np.random.default_rng(3)
    w = rng.integers(-127, 128, (6, 8), dtype=np.int8)
    scales = rng.uniform(0.002, 0.01, 6).astype(np.float32)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            dw = bb.emit(relax.op.permute_dims(relax.op.dequantize(relax.const(w), f32(scales), i32(np.zeros(6)),
                                                                   axis=0), axes))
            dx = bb.emit(relax.op.dequantize(x, f32(0.05), i32(1), axis=0))
            gv = bb.emit_output(relax.op.quantize(relax.op.matmul(dx, dw), f32(0.2), i32(3), axis=0,
                                                  out_dtype="int8"))
        bb.emit_func_output(gv)
    (name, p), = composites(npu_backend.partition_for_npu(bb.get()))
    assert name == "npu.fully_connected"
    np.testing.assert_array_equal(p.weights, w)
    np.testing.assert_array_equal(p.weight_scales, scales)


def test_report_names_each_operator_under_its_own_composite():
    """A composite's output binding is named like the graph's output ("gv"); the report must not be misled."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 8, 16), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            mean = relax.op.mean(relax.op.dequantize(x, f32(0.05), i32(1), axis=0), axis=[2, 3], keepdims=True)
            gv = bb.emit_output(relax.op.quantize(mean, f32(0.02), i32(0), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    report = npu_backend.partition_report(npu_backend.partition_for_npu(bb.get()))
    placed = [(o.op, o.composite) for o in report.ops]
    assert placed == [("relax.permute_dims", "npu.transpose"), ("relax.dequantize", "npu.mean"),
                      ("relax.mean", "npu.mean"), ("relax.quantize", "npu.mean"),
                      ("relax.permute_dims", "npu.transpose")]


@pytest.mark.parametrize("scale, removed", [(0.05, True), (0.0, False)])
def test_identity_requantize_is_removed_only_when_it_is_one(scale, removed):
    from npu_backend.canonicalize import canonicalize

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            d = bb.emit(relax.op.dequantize(x, f32(scale), i32(4), axis=0))
            gv = bb.emit_output(relax.op.quantize(d, f32(scale), i32(4), axis=0, out_dtype="int8"))
        bb.emit_func_output(gv)
    text = canonicalize(bb.get()).script()
    assert ("R.quantize" not in text) == removed
