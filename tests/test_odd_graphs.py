"""Odd but valid graphs partition without any TVM error reaching the user, as well-formed IR that runs.

Outputs that only move int8 data (a pooled or returned input, a constant) must equal TVM's own build of
the unpartitioned module exactly; the requantizing ones are TFLite's arithmetic, which TVM's float QDQ
build does not reproduce (the golden tests check those against TFLite), so here only their shape and type
are compared."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from relax_idioms import f32, i32


def _dq(bb, x, q=(0.05, 3)):
    return bb.emit(relax.op.dequantize(x, f32(q[0]), i32(q[1]), axis=0))


def _q(value, q=(0.05, 3)):
    return relax.op.quantize(value, f32(q[0]), i32(q[1]), axis=0, out_dtype="int8")


def shared_input():
    """One int8 input feeds two operators and is itself returned."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(_q(relax.op.sigmoid(_dq(bb, x)), (1 / 256, -128)))
            m = bb.emit(relax.op.nn.max_pool2d(x, (2, 2), (2, 2), layout="NHWC"))
            gv = bb.emit_output(relax.Tuple([a, m, x]))
        bb.emit_func_output(gv)
    return bb.get()


def output_used_twice():
    """An NPU result that is both returned and consumed by another NPU operator."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(_q(relax.op.tanh(_dq(bb, x)), (1 / 128, 0)))
            b = bb.emit(_q(relax.op.add(_dq(bb, a, (1 / 128, 0)), _dq(bb, a, (1 / 128, 0)))))
            gv = bb.emit_output(relax.Tuple([a, b, a]))
        bb.emit_func_output(gv)
    return bb.get()


def broadcast_diamond():
    """A squeeze-excite diamond: the block feeds both the gate's mean and the multiply by the gate."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 6, 6, 8), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            mean = bb.emit(_q(relax.op.mean(_dq(bb, x), axis=[1, 2], keepdims=True), (0.02, -10)))
            gate = bb.emit(_q(relax.op.sigmoid(_dq(bb, mean, (0.02, -10))), (1 / 256, -128)))
            gv = bb.emit_output(_q(relax.op.multiply(_dq(bb, x), _dq(bb, gate, (1 / 256, -128))), (0.03, 0)))
        bb.emit_func_output(gv)
    return bb.get()


def constant_output():
    """A function that returns a constant beside an NPU result."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 4, 8), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.nn.max_pool2d(x, (2, 2), (2, 2), layout="NHWC"))
            gv = bb.emit_output(relax.Tuple([a, relax.const(np.arange(4, dtype=np.int8))]))
        bb.emit_func_output(gv)
    return bb.get()


def _flat(result) -> list[np.ndarray]:
    if hasattr(result, "numpy"):
        return [result.numpy()]
    return [r.numpy() for r in result]


@pytest.mark.parametrize("build, moved", [(shared_input, (1, 2)), (output_used_twice, ()),
                                          (broadcast_diamond, ()), (constant_output, (0, 1))],
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_odd_graphs_partition_and_run(build, moved):
    mod = build()
    partitioned = npu_backend.partition_for_npu(mod)
    relax.analysis.well_formed(partitioned)
    assert npu_backend.partition_report(partitioned).npu_ops, "nothing was offloaded"
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm"), tvm.cpu())
    x = np.random.default_rng(0).integers(-128, 128, tuple(int(d) for d in mod["main"].params[0].ty.shape.values),
                                          dtype=np.int8)
    got = _flat(vm["main"](tvm.runtime.tensor(x)))
    host = relax.VirtualMachine(tvm.compile(mod, target="llvm"), tvm.cpu())
    want = _flat(host["main"](tvm.runtime.tensor(x)))
    assert len(got) == len(want)
    for index, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        if index in moved:
            np.testing.assert_array_equal(g, w)
