"""Float ONNX graphs as users bring them, each once a crash inside ``quantize`` or ``partition_for_npu``: a scalar
constant operand (HardSigmoid, ``x * 0.5``), several model outputs, an unfolded batch norm, a split, a branch of
constants alone, a Gemm with ``beta``, a 3-D matmul, ONNX's Pad (a ``call_tir`` the importer writes), a symbolic
batch. Each quantizes, partitions and builds, and the built module's outputs equal the simulated quantization's,
bit for bit, on inputs calibration has not seen; where an operator stays off the NPU the test says where it runs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import npu_backend
from npu_backend import NpuError
from npu_backend.quantization import calibrate


class Graph:
    """A small ONNX graph, written node by node (seeded weights)."""

    def __init__(self, input_shape=(1, 3, 8, 8)):
        self.rng = np.random.default_rng(3)
        self.nodes, self.initializers, self.outputs = [], [], []
        self.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(input_shape))]
        self.count = 0

    def constant(self, values) -> str:
        self.count += 1
        name = f"c{self.count}"
        self.initializers.append(numpy_helper.from_array(np.asarray(values), name))
        return name

    def op(self, op_type: str, inputs: list, outputs: int = 1, **attrs):
        self.count += 1
        names = [f"{op_type.lower()}{self.count}_{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, **attrs))
        return names[0] if outputs == 1 else names

    def conv(self, x: str, cin: int = 3, cout: int = 4) -> str:
        weight = self.constant(self.rng.normal(0, 0.4, (cout, cin, 3, 3)).astype(np.float32))
        bias = self.constant(self.rng.normal(0, 0.1, cout).astype(np.float32))
        return self.op("Conv", [x, weight, bias], kernel_shape=[3, 3], pads=[1, 1, 1, 1])

    def save(self, path, *outputs: str) -> str:
        graph = helper.make_graph(self.nodes, "g", self.inputs,
                                  [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                                  self.initializers)
        model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]))
        known = {v.name: v for v in model.graph.value_info}
        for k, out in enumerate(model.graph.output):
            if out.name in known:
                model.graph.output[k].CopyFrom(known[out.name])
        model.ir_version = 8
        onnx.save(model, path)
        return str(path)


def _scalar_then_clamp(g):  # HardSigmoid: x * 0.2 + 0.5, clipped to [0, 1]
    return g.op("HardSigmoid", [g.conv("x")], alpha=0.2, beta=0.5)


def _scalar_multiply(g):
    return g.op("Mul", [g.conv("x"), g.constant(np.array(0.75, np.float32))])


def _scalar_add_relu(g):
    return g.op("Relu", [g.op("Add", [g.conv("x"), g.constant(np.array(0.5, np.float32))])])


def _batch_norm(g):
    stats = [g.constant(np.full(4, v, np.float32)) for v in (1.2, 0.1, 0.2, 1.5)]
    return g.op("BatchNormalization", [g.conv("x"), *stats])


def _split(g):
    return g.op("Add", g.op("Split", [g.conv("x"), g.constant(np.array([2, 2], np.int64))], outputs=2, axis=1))


def _constant_branch(g):
    branch = g.op("Relu", [g.constant(np.linspace(-1, 1, 4).reshape(1, 4, 1, 1).astype(np.float32))])
    return g.op("Add", [g.conv("x"), branch])


def _relu_beside_a_branch(g):  # the convolution has two users, so its ReLU is a layer of its own
    y = g.conv("x")
    return g.op("Add", [g.op("Relu", [y]), g.op("Sigmoid", [y])])


def _squeeze_excite(g):  # a spatial mean's sigmoid gating the channels, as MobileNetV3 and EfficientNet write it
    y = g.op("Relu", [g.conv("x")])
    gate = g.op("Sigmoid", [g.op("ReduceMean", [y], axes=[2, 3], keepdims=1)])
    return g.op("Mul", [y, gate])


def _pad(g):
    return g.op("Pad", [g.conv("x"), g.constant(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64))])


GRAPHS = {  # name: (body, where each layer runs)
    "hard sigmoid": (_scalar_then_clamp, ["npu", "host int8", "npu"]),
    "scalar multiply": (_scalar_multiply, ["npu", "npu"]),
    "scalar add, relu": (_scalar_add_relu, ["npu", "npu"]),
    "batch norm": (_batch_norm, ["npu", "npu", "float", "npu", "npu"]),  # its divide stays in float
    "split": (_split, ["npu", "host int8", "host int8", "npu"]),
    "constant branch": (_constant_branch, ["npu", "npu"]),
    "pad (call_tir)": (_pad, ["npu", "float"]),
    "squeeze-excite": (_squeeze_excite, ["npu", "npu", "npu", "npu"]),
    "relu beside a branch": (_relu_beside_a_branch, ["npu", "host int8", "npu", "npu"]),  # int8 clamp, exact
}


def _samples(shape, count, seed):
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1, shape).astype(np.float32) for _ in range(count)]


def _built_equals_simulated(path, shape, config=None):
    calibrated = calibrate(npu_backend.load_model(path), _samples(shape, 8, 0), config)
    partitioned = npu_backend.partition_for_npu(calibrated.module, calibrated.npu_config)
    vm = relax.VirtualMachine(npu_backend.codegen.build_partitioned(partitioned), tvm.cpu())
    tests = _samples(shape, 3, 1)
    for sample, simulated in zip(tests, calibrated.simulate(tests)):
        result = vm["main"](tvm.runtime.tensor(sample))
        built = [result.numpy()] if hasattr(result, "numpy") else [r.numpy() for r in result]
        assert len(built) == len(simulated)
        for a, b in zip(built, simulated):
            assert a.shape == b.shape and a.tobytes() == b.tobytes()
    return calibrated


@pytest.mark.parametrize("name", GRAPHS)
def test_the_graph_quantizes_and_the_npu_equals_the_simulation(name, tmp_path):
    body, placements = GRAPHS[name]
    g = Graph()
    path = g.save(tmp_path / "m.onnx", body(g))
    calibrated = _built_equals_simulated(path, (1, 3, 8, 8))
    assert [layer.placement for layer in calibrated.report.layers] == placements


def test_two_outputs_are_two_outputs(tmp_path):
    g = Graph()
    y = g.conv("x")
    path = g.save(tmp_path / "m.onnx", g.op("Relu", [y]), g.op("Sigmoid", [y]))
    calibrated = _built_equals_simulated(path, (1, 3, 8, 8))
    assert len(calibrated.module["main"].ret_ty.fields) == 2


@pytest.mark.parametrize("alpha,beta", [(1.0, 2.0), (0.5, 1.0)])
def test_a_gemm_with_alpha_and_beta(alpha, beta, tmp_path):
    g = Graph((1, 8))
    weight = g.constant(g.rng.normal(0, 0.4, (8, 4)).astype(np.float32))
    bias = g.constant(np.linspace(-1, 1, 4).astype(np.float32))
    path = g.save(tmp_path / "m.onnx", g.op("Gemm", ["x", weight, bias], alpha=alpha, beta=beta))
    _built_equals_simulated(path, (1, 8))


def test_a_matmul_of_a_three_dimensional_input_is_built_not_predicted(tmp_path):
    g = Graph((1, 4, 8))
    weight = g.constant(g.rng.normal(0, 0.4, (8, 5)).astype(np.float32))
    path = g.save(tmp_path / "m.onnx", g.op("MatMul", ["x", weight]))
    calibrated = _built_equals_simulated(path, (1, 4, 8))
    assert [layer.placement for layer in calibrated.report.layers] == ["host int8"]


def test_a_symbolic_batch_is_refused_with_the_reason(tmp_path):
    g = Graph()
    g.inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])]
    path = g.save(tmp_path / "m.onnx", g.op("Relu", [g.conv("x")]))
    with pytest.raises(NpuError, match="static input shapes: input x"):
        npu_backend.quantize(npu_backend.load_model(path), np.zeros((2, 3, 8, 8), np.float32))


@pytest.mark.parametrize("consumer", ["Add", "Concat"])
def test_a_model_input_read_by_a_float_layer_and_a_quantized_one(consumer, tmp_path):
    """The first convolution kept in float reads the model's input as it is, as the quantized module does; the
    quantized layer beside it reads the input's int8 values (the simulation gave the float layer those too)."""
    g = Graph()
    weight = g.constant(g.rng.normal(0, 0.4, (3, 3, 3, 3)).astype(np.float32))
    y = g.op("Conv", ["x", weight], kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    out = g.op(consumer, [y, "x"], **({"axis": 1} if consumer == "Concat" else {}))
    path = g.save(tmp_path / "m.onnx", out)
    calibrated = _built_equals_simulated(path, (1, 3, 8, 8), npu_backend.QConfig(skip_layers=(0,)))
    assert [layer.placement for layer in calibrated.report.layers] == ["float", "npu"]


def test_the_partition_report_says_who_recorded_a_quantized_models_numerics(tmp_path):
    """An ONNX model quantized with TFLite's rounding follows TFLite's numerics: the report says the module
    records them and that quantize may be who did (it had named npu_backend.load_tflite alone)."""
    g = Graph()
    path = g.save(tmp_path / "m.onnx", g.op("Relu", [g.conv("x")]))
    qmod = npu_backend.quantize(npu_backend.load_model(path), _samples((1, 3, 8, 8), 4, 0))
    report = npu_backend.partition_report(npu_backend.partition_for_npu(qmod))
    assert report.numerics == "tflite"
    assert "npu.source='tflite'" in report.numerics_why and "npu_backend.quantize" in report.numerics_why
