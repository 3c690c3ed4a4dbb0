"""Regions whose intermediate results are also needed by the host: multi-output command streams."""

import numpy as np
import tvm
from tvm import relax

import npu_backend
from relax_idioms import ConvIdiom


def _graph(body):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 6, 6, 4), "int8"))
    with bb.function("main", [x]):
        with bb.dataflow():
            result = bb.emit_output(body(bb, x))
        bb.emit_func_output(result)
    return bb.get()


def _conv(idiom):
    return lambda bb, v: bb.emit(idiom._body(bb, v, relax.const(idiom.weights)))


def test_intermediate_used_by_the_host_becomes_a_second_region_output():
    first = ConvIdiom(x_shape=(1, 6, 6, 4), out_channels=4, seed=1)
    second = ConvIdiom(x_shape=(1, 6, 6, 4), out_channels=3, seed=2)

    def body(bb, x):
        y = _conv(first)(bb, x)
        z = _conv(second)(bb, y)
        return relax.Tuple([z, bb.emit(relax.op.astype(y, "float32"))])

    partitioned = npu_backend.partition_for_npu(_graph(body))
    report = npu_backend.partition_report(partitioned)
    assert [o.op for o in report.host_ops] == ["relax.astype"] and len({o.region for o in report.npu_ops}) == 1
    (stream,) = npu_backend.codegen.lower_module(partitioned).values()
    assert len([b for b in stream.buffers if b.kind.name == "OUTPUT"]) == 2
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm"), tvm.cpu())
    data = np.random.default_rng(0).integers(-128, 128, (1, 6, 6, 4), dtype=np.int8)
    z, y_float = (t.numpy() for t in vm["main"](tvm.runtime.tensor(data)))

    def alone(body_fn, inp):
        return relax.VirtualMachine(npu_backend.build(_graph(body_fn)), tvm.cpu())["main"](
            tvm.runtime.tensor(inp)).numpy()

    y = alone(_conv(first), data)
    np.testing.assert_array_equal(y_float, y.astype("float32"))
    np.testing.assert_array_equal(z, alone(_conv(second), y))
