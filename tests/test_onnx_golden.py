"""End to end on ONNX QDQ fixtures (onnxruntime quantize_static): TVM import -> partition -> NPU.

Every output element must equal onnxruntime's (graph optimizations off, the QDQ
graph executed literally), stored by scripts/make_onnx_fixtures.py. The models
take and return float tensors: only the quantize of the input and the
dequantize of the output may stay on the host, with the float-boundary reason,
and the partitioner must have picked onnxruntime's rounding on its own (the
loader records the source).
"""

import json

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from conftest import FIXTURES
from npu_backend.report import FLOAT_BOUNDARY
from test_patterns import composites

ONNX = FIXTURES / "onnx"
MODELS = json.loads((ONNX / "MANIFEST.json").read_text())["models"]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: m["name"])
def compiled(request):
    entry = request.param
    partitioned = npu_backend.partition_for_npu(npu_backend.load_onnx(ONNX / entry["file"]))
    relax.analysis.well_formed(partitioned)  # raises on ill-formed IR
    generated = relax.transform.RunCodegen()(partitioned)
    relax.analysis.well_formed(generated)
    vm = relax.VirtualMachine(tvm.compile(generated, target="llvm"), tvm.cpu())
    return entry, partitioned, vm


def test_only_the_float_boundary_stays_on_the_host(compiled):
    entry, partitioned, _ = compiled
    report = npu_backend.partition_report(partitioned)
    assert [(o.op, o.reason) for o in report.host_ops] == [
        ("relax.quantize", FLOAT_BOUNDARY["relax.quantize"]),
        ("relax.dequantize", FLOAT_BOUNDARY["relax.dequantize"])], report.format_table()
    found = composites(partitioned)
    assert found and all(p.rounding.name == "ONNXRUNTIME" for _, p in found if hasattr(p, "rounding"))


def test_outputs_equal_onnxruntime(compiled):
    entry, _, vm = compiled
    golden = np.load(ONNX / entry["file"].replace(".onnx", ".npz"))
    for x, expected in zip(golden["inputs"], golden["outputs"]):
        with npu_backend.profile() as prof:
            got = vm["main"](tvm.runtime.tensor(x)).numpy()
        assert prof.runs and prof.total_cycles > 0, "nothing ran on the NPU"
        mismatched = int(np.count_nonzero(got != expected))
        assert mismatched == 0, f"{mismatched} of {got.size} elements differ from onnxruntime"


@pytest.mark.parametrize("entry", MODELS, ids=lambda m: m["name"])
def test_plain_from_onnx_gets_onnxruntime_numerics(entry):
    """TVM's documented flow, from_onnx then partition_for_npu with no loader and no reference: the importer is
    recognised by what it leaves in the module, and every output equals onnxruntime's."""
    import onnx
    from tvm.relax.frontend.onnx import from_onnx

    mod = from_onnx(onnx.load(ONNX / entry["file"]))
    partitioned = npu_backend.partition_for_npu(mod)
    report = npu_backend.partition_report(partitioned)
    assert report.numerics == "onnxruntime" and report.numerics_why.startswith("detected: zero points are typed")
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm"), tvm.cpu())
    golden = np.load(ONNX / entry["file"].replace(".onnx", ".npz"))
    for x, expected in zip(golden["inputs"], golden["outputs"]):
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), expected)


def _initializers(name):
    from onnx import load, numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in load(ONNX / f"{name}.onnx").graph.initializer}


@pytest.mark.parametrize("name, per_channel", [("conv_relu_per_channel_asymmetric", True),
                                               ("conv_relu_per_tensor_symmetric", False)])
def test_conv_composite_carries_the_models_own_qparams(name, per_channel):
    """Every qparam of the ONNX Conv, read from its initializers, lands on the composite unchanged; the
    weights arrive in the NPU's [OC, KH, KW, IC] layout; Relu is the clamp [z_out, 127]."""
    init = _initializers(name)
    mod = npu_backend.partition_for_npu(npu_backend.load_onnx(ONNX / f"{name}.onnx"))
    (p,) = [p for composite, p in composites(mod) if composite == "npu.conv2d"]
    assert p.input_scale == init["input_scale"] and p.input_zero_point == int(init["input_zero_point"])
    np.testing.assert_array_equal(p.weights, np.transpose(init["weight0_quantized"], (0, 2, 3, 1)))
    np.testing.assert_array_equal(p.weight_scales, np.broadcast_to(init["weight0_scale"], (16,)))
    np.testing.assert_array_equal(p.bias, init["bias1_quantized"])
    assert p.per_channel == per_channel and p.rounding.name == "ONNXRUNTIME"
    golden = np.load(ONNX / f"{name}.npz")  # the conv's output qparams are the model output's
    z_out = int(golden["output_zero_point"])
    assert p.output_scale == golden["output_scale"] and p.output_zero_point == z_out
    assert p.clamp == (max(-128, z_out), 127)
    assert (p.kernel, p.strides, p.padding) == ((3, 3), (1, 1), (1, 1, 1, 1))
