"""Regenerate the ONNX QDQ golden fixtures in tests/fixtures/onnx/.

Why: ONNX models reach the backend through TVM's ONNX importer, whose quantized
idioms differ from the TFLite importer's, and the reference for them is
onnxruntime executing the QDQ graph literally. This script builds small float
ONNX models with `onnx.helper` (random, seeded weights and biases), quantizes
them with `onnxruntime.quantization.quantize_static` (QDQ format, int8
activations and weights, MinMax calibration on seeded uniform inputs unless a
model names another method: MANIFEST.json `calibrate_method`, absent for
MinMax), runs
onnxruntime on seeded inputs and stores each model next to its inputs,
reference outputs and I/O quantization parameters (`<name>.npz`), plus a
MANIFEST.json that tests can parametrize over.

The reference is onnxruntime's CPUExecutionProvider with graph optimizations
disabled (`ORT_DISABLE_ALL`): every QuantizeLinear, DequantizeLinear and float
operator runs as written. With optimizations on, onnxruntime fuses the QDQ
groups into QLinearConv and friends, which on x86 without VNNI saturate int16
partial sums and disagree with the literal graph by many steps.

Each `<name>.npz` holds (S = 8 samples; the graph input and output are float,
with a QuantizeLinear right after the input and a DequantizeLinear right before
the output):

    inputs             float32 (S, *input shape)  exactly s_in * (inputs_q - z_in)
    inputs_q           int8    (S, *input shape)  what the first QuantizeLinear produces
    outputs            float32 (S, *output shape) onnxruntime's graph output
    outputs_q          int8    (S, *output shape) the last QuantizeLinear's output (outputs = s_out * (q - z_out))
    input_scale, input_zero_point, output_scale, output_zero_point   float32 / int32 scalars
    intermediate/<tensor>  int8 (S, *shape)     every other QuantizeLinear output, named by its ONNX tensor,
                                                to locate a mismatch inside multi-layer models

What quantize_static makes of these graphs (onnxruntime 1.32; MANIFEST.json lists
the operators before and after): with asymmetric activations it deletes a Relu
that follows a quantized op and gives the producer's output zero point -128
instead; with symmetric activations it keeps the Relu between its own Q/DQ
pairs. An AveragePool shares its input's scale and zero point and is left in
float unless its input is already quantized (hence ForceQuantizeNoInputCheck on
the pool fixtures). The Concat inputs keep their own, unequal qparams. A MatMul
followed by Add gets an int8 (not int32) bias with its own scale and zero point.
Averages that land exactly on .5 of an output step round by float32 noise in
onnxruntime (it sums each window column by column), so an integer pooling unit
can disagree with the reference there by one step.

The squeeze-and-excite models (se_block_*) are one float model quantized once
per calibration method (MinMax, Entropy, Percentile, each with quantize_static's
defaults) on the same calibration inputs, because a backend must accept the
graph whichever method a user ran. Through quantize_static, Entropy histograms
all calibration outputs at once into 128 bins and searches 128 quantized bins,
so its only candidate is the full range and its qparams equal MinMax's;
Percentile (99.999 on 2048 bins of |x|) trims only a fraction of a bin, so its
scales are a few 1e-4 relative smaller and some outputs move by a step.
Real SE blocks come from trained networks, so its weights are He-scaled
(normal with std sqrt(2 / fan_in)) and its biases small: activations neither
saturate nor vanish, and the sigmoid gate spreads over (0, 1) per channel
instead of sitting at 0.5. The gate ([1,16,1,1]) is broadcast over the
[1,16,12,12] block input by a quantized Mul. The input is 1x8x12x12 like the
other models' because at 16x16 the .npz outgrows MAX_FILE_BYTES (127 kB).

Run from the repository root, in an environment with the `fixtures` extra
(onnx, onnxruntime):

    python scripts/make_onnx_fixtures.py

It overwrites tests/fixtures/onnx/ and removes models no longer listed here.
Reruns produce byte-identical files. The tests never import onnxruntime; they
only read the files written here.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                      quantize_static)

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "onnx"
SAMPLES = 8
CALIBRATION_SAMPLES = 16
OPSET = 13  # the first opset with per-axis QuantizeLinear/DequantizeLinear; quantize_static keeps it for int8
INPUT_NAME = "input"
OUTPUT_NAME = "output"
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}
MAX_FILE_BYTES = 100_000


def seed_of(name: str) -> int:
    """Seed from the model name, so reordering or adding specs leaves other fixtures unchanged."""
    return zlib.crc32(name.encode()) % 2**31


class GraphBuilder:
    """A float ONNX graph under construction: seeded random initializers and nodes, NCHW, batch 1."""

    def __init__(self, rng: np.random.Generator, input_shape: tuple[int, ...]):
        self.rng = rng
        self.input_shape = input_shape
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def _name(self, prefix: str) -> str:
        return f"{prefix}{len(self.nodes)}"

    def constant(self, prefix: str, value: np.ndarray) -> str:
        name = f"{prefix}{len(self.initializers)}"
        self.initializers.append(numpy_helper.from_array(value.astype(np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], output: str | None = None, **attrs) -> str:
        output = output or self._name(op.lower() + "_out")
        self.nodes.append(helper.make_node(op, inputs, [output], name=self._name(op.lower()), **attrs))
        return output

    def conv(self, x: str, in_channels: int, out_channels: int, kernel: int, pad: int, std: float = 0.3,
             bias_std: float = 0.5, output: str | None = None) -> str:
        """A Conv with normal(0, std) weights and a random normal bias, so each channel is shifted differently
        and the outputs use the int8 range instead of collapsing around the zero point."""
        w = self.constant("weight", self.rng.normal(0.0, std, (out_channels, in_channels, kernel, kernel)))
        b = self.constant("bias", self.rng.normal(0.0, bias_std, (out_channels,)))
        return self.node("Conv", [x, w, b], output, kernel_shape=[kernel, kernel], pads=[pad] * 4,
                         strides=[1, 1], dilations=[1, 1], group=1)

    def model(self, name: str, output: str, output_shape: tuple[int, ...]) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, name,
            [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, list(self.input_shape))],
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, list(output_shape))],
            initializer=self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                                  producer_name="make_onnx_fixtures")
        model.ir_version = 8  # pinned, so a newer onnx release (whose default IR version moves) changes no bytes
        onnx.checker.check_model(model, full_check=True)
        return model


FEATURES = (1, 8, 12, 12)


def conv_relu(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    y = b.node("Relu", [b.conv(INPUT_NAME, 8, 16, 3, 1)], OUTPUT_NAME)
    return y, (1, 16, 12, 12)


def matmul(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    w = b.constant("weight", b.rng.normal(0.0, 0.3, (64, 10)))
    bias = b.constant("bias", b.rng.normal(0.0, 0.5, (10,)))
    return b.node("Add", [b.node("MatMul", [INPUT_NAME, w]), bias], OUTPUT_NAME), (1, 10)


def gemm(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    w = b.constant("weight", b.rng.normal(0.0, 0.3, (10, 64)))
    bias = b.constant("bias", b.rng.normal(0.0, 0.5, (10,)))
    return b.node("Gemm", [INPUT_NAME, w, bias], OUTPUT_NAME, transB=1, alpha=1.0, beta=1.0), (1, 10)


def add(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    left = b.conv(INPUT_NAME, 8, 8, 3, 1)
    right = b.conv(INPUT_NAME, 8, 8, 1, 0, std=0.6)
    return b.node("Add", [left, right], OUTPUT_NAME), FEATURES


def sigmoid(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    return b.node("Sigmoid", [INPUT_NAME], OUTPUT_NAME), b.input_shape


def avgpool_2x2_s2(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    return b.node("AveragePool", [INPUT_NAME], OUTPUT_NAME, kernel_shape=[2, 2], strides=[2, 2]), (1, 8, 6, 6)


def avgpool_3x3_s1_pad1(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    return (b.node("AveragePool", [INPUT_NAME], OUTPUT_NAME, kernel_shape=[3, 3], strides=[1, 1], pads=[1] * 4,
                   count_include_pad=0), FEATURES)


def global_avgpool(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    return b.node("GlobalAveragePool", [INPUT_NAME], OUTPUT_NAME), (1, 8, 1, 1)


def concat(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    """A wide-range branch (large weights, ReLU) and a narrow-range branch (small weights), so the two
    Concat inputs calibrate to different ranges."""
    wide = b.node("Relu", [b.conv(INPUT_NAME, 8, 8, 1, 0, std=0.8, bias_std=1.0)])
    narrow = b.conv(INPUT_NAME, 8, 8, 3, 1, std=0.05, bias_std=0.1)
    return b.node("Concat", [wide, narrow], OUTPUT_NAME, axis=1), (1, 16, 12, 12)


def residual(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    hidden = b.node("Relu", [b.conv(INPUT_NAME, 8, 8, 3, 1, std=0.2)])
    summed = b.node("Add", [INPUT_NAME, b.conv(hidden, 8, 8, 3, 1, std=0.2)])
    return b.node("Relu", [summed], OUTPUT_NAME), FEATURES


def he_std(in_channels: int, kernel: int) -> float:
    """He initialization's std, sqrt(2 / fan_in): what a trained ReLU network's weights are scaled like, so each
    layer keeps its input's variance instead of saturating or shrinking it."""
    return float(np.sqrt(2.0 / (in_channels * kernel * kernel)))


def se_block(b: GraphBuilder) -> tuple[str, tuple[int, ...]]:
    """A MobileNetV3-like block: Conv 3x3 8->16 + Relu, squeeze-and-excite (GlobalAveragePool, Conv 1x1 16->4,
    Relu, Conv 1x1 4->16, Sigmoid, Mul of the gate into the block input), then a Conv 1x1 16->8 projection. He-scaled
    weights and small biases (the excite conv's larger, so the gate differs between channels; with this seed it
    ranges over about 0.1 to 0.9, and one of the four squeezed channels is always 0 after its Relu)."""
    block = b.node("Relu", [b.conv(INPUT_NAME, 8, 16, 3, 1, std=he_std(8, 3), bias_std=0.1)])
    squeezed = b.node("Relu", [b.conv(b.node("GlobalAveragePool", [block]), 16, 4, 1, 0, std=he_std(16, 1),
                                      bias_std=0.1)])
    gate = b.node("Sigmoid", [b.conv(squeezed, 4, 16, 1, 0, std=he_std(4, 1), bias_std=0.5)])
    excited = b.node("Mul", [block, gate])
    return b.conv(excited, 16, 8, 1, 0, std=he_std(16, 1), bias_std=0.1, output=OUTPUT_NAME), FEATURES


@dataclass(frozen=True)
class Spec:
    name: str
    build: Callable[[GraphBuilder], tuple[str, tuple[int, ...]]]
    description: str
    input_shape: tuple[int, ...] = FEATURES
    per_channel: bool = True
    activation_symmetric: bool = False
    # Inputs are calibrated on uniform [low, high]; the default range is lopsided so the input zero point is
    # far from 0 (convolution padding, pools and Add must then handle it) unless activations are symmetric.
    calibration_range: tuple[float, float] = (-1.0, 2.0)
    extra_options: tuple[tuple[str, object], ...] = ()  # more quantize_static extra_options
    # quantize_static's calibrate_method; None is its default, MinMax, and keeps the key out of MANIFEST.json.
    calibrate_method: CalibrationMethod | None = None
    # The name whose seed draws the weights, the calibration inputs and the reference inputs (default: this
    # spec's own), so specs that differ only in how they are quantized share one float model and its data.
    seed_name: str | None = None

    @property
    def seed(self) -> int:
        return seed_of(self.seed_name or self.name)


def _conv_relu_spec(per_channel: bool, symmetric: bool) -> Spec:
    weights = "per_channel" if per_channel else "per_tensor"
    activations = "symmetric" if symmetric else "asymmetric"
    return Spec(f"conv_relu_{weights}_{activations}", conv_relu,
                f"Conv 3x3 pads 1 8->16 with bias, then Relu, on 1x8x12x12; {weights.replace('_', '-')} weights, "
                f"{activations} activations", per_channel=per_channel, activation_symmetric=symmetric)


def _se_block_spec(method: CalibrationMethod) -> Spec:
    return Spec(f"se_block_{method.name.lower()}", se_block,
                f"Conv 3x3 pads 1 8->16 + Relu on 1x8x12x12, squeeze-and-excite (GlobalAveragePool, Conv 1x1 16->4, "
                f"Relu, Conv 1x1 4->16, Sigmoid, Mul of the [1,16,1,1] gate into the [1,16,12,12] block), Conv 1x1 "
                f"16->8; {method.name} calibration", calibrate_method=method,
                seed_name="se_block")


# quantize_static leaves an AveragePool in float unless its input is already quantized (it shares the input's
# qparams with its output); on a graph input that needs this option.
FORCE_QUANTIZE = (("ForceQuantizeNoInputCheck", True),)
SPECS = [
    *(_conv_relu_spec(pc, sym) for pc in (True, False) for sym in (True, False)),
    Spec("matmul", matmul, "MatMul [1,64] x [64,10], then Add of a [10] bias", input_shape=(1, 64)),
    Spec("gemm", gemm, "Gemm [1,64] x [10,64]^T (transB=1) + [10] bias", input_shape=(1, 64)),
    Spec("add", add, "Conv 3x3 and Conv 1x1 branches (8->8, bias) from one 1x8x12x12 input, then Add"),
    Spec("sigmoid", sigmoid, "Sigmoid directly on the 1x16x8x8 input, calibrated on [-8, 8] so the int8 inputs "
         "reach both saturating tails", input_shape=(1, 16, 8, 8), calibration_range=(-8.0, 8.0)),
    Spec("avgpool_2x2_s2", avgpool_2x2_s2, "AveragePool 2x2 stride 2, no padding, directly on the 1x8x12x12 input",
         extra_options=FORCE_QUANTIZE),
    Spec("avgpool_3x3_s1_pad1", avgpool_3x3_s1_pad1,
         "AveragePool 3x3 stride 1 pads 1 count_include_pad=0, directly on the 1x8x12x12 input",
         extra_options=FORCE_QUANTIZE),
    Spec("global_avgpool", global_avgpool, "GlobalAveragePool directly on the 1x8x12x12 input"),
    Spec("concat", concat, "Conv 1x1 (large weights) + Relu branch and Conv 3x3 (small weights) branch from one "
         "1x8x12x12 input, concatenated on channels (-> 1x16x12x12): the Concat inputs have different ranges"),
    Spec("residual", residual, "Conv 3x3 + Relu, Conv 3x3 (8->8, bias), Add of the 1x8x12x12 input (skip), Relu"),
    *(_se_block_spec(method) for method in (CalibrationMethod.MinMax, CalibrationMethod.Entropy,
                                            CalibrationMethod.Percentile)),
]


class UniformReader(CalibrationDataReader):
    """Seeded uniform [low, high] calibration inputs."""

    def __init__(self, seed: int, shape: tuple[int, ...], calibration_range: tuple[float, float]):
        rng = np.random.default_rng((seed, 0))
        self.samples = iter([{INPUT_NAME: rng.uniform(*calibration_range, shape)
                              .astype(np.float32)} for _ in range(CALIBRATION_SAMPLES)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.samples, None)


def quantize(spec: Spec, float_model: onnx.ModelProto) -> onnx.ModelProto:
    # The histogram calibrators (Entropy, Percentile) print their progress; keep the script's one line per model.
    with tempfile.TemporaryDirectory(prefix="onnx_fixture.") as tmp, contextlib.redirect_stdout(io.StringIO()):
        path = Path(tmp) / f"{spec.name}.onnx"
        quantize_static(float_model, path, UniformReader(spec.seed, spec.input_shape, spec.calibration_range),
                        quant_format=QuantFormat.QDQ, per_channel=spec.per_channel,
                        calibrate_method=spec.calibrate_method or CalibrationMethod.MinMax,
                        activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                        extra_options={"ActivationSymmetric": spec.activation_symmetric, **dict(spec.extra_options)})
        return onnx.load(path)


def initializer_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def io_quantization(model: onnx.ModelProto) -> dict:
    """The QuantizeLinear right after the graph input and the one feeding the DequantizeLinear that
    produces the graph output, with their (per-tensor) scale and zero point."""
    consts = initializer_values(model)
    (inp,), (out,) = model.graph.input, model.graph.output
    first_q = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == inp.name]
    (last_dq,) = [n for n in model.graph.node if out.name in n.output]
    (last_q,) = [n for n in model.graph.node if n.op_type == "QuantizeLinear" and last_dq.input[0] in n.output]
    if len(first_q) != 1 or last_dq.op_type != "DequantizeLinear":
        raise SystemExit(f"{model.graph.name}: graph input/output are not wrapped in one Q / DQ")
    (first_q,) = first_q
    info = dict(input_q=first_q.output[0], output_q=last_q.output[0])
    for key, node in (("input", first_q), ("output", last_q)):
        scale, zero_point = consts[node.input[1]], consts[node.input[2]]
        if scale.shape != () or zero_point.dtype != np.int8:
            raise SystemExit(f"{model.graph.name}: {key} quantization is not per-tensor int8")
        info[f"{key}_scale"], info[f"{key}_zero_point"] = np.float32(scale), np.int32(zero_point)
    return info


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def reference(model: onnx.ModelProto, seed: int) -> dict[str, np.ndarray]:
    """Seeded int8 inputs over the whole int8 range, turned into float inputs that the first QuantizeLinear
    maps back exactly, and onnxruntime's outputs, float and int8 (read from a copy of the model that also
    exposes every QuantizeLinear output; exposing a tensor changes nothing in how it is computed)."""
    io = io_quantization(model)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    intermediates = [n.output[0] for n in model.graph.node if n.op_type == "QuantizeLinear"
                     and n.output[0] not in (io["input_q"], io["output_q"])]
    for name in (io["input_q"], io["output_q"], *intermediates):
        probe.graph.output.append(helper.make_tensor_value_info(name, TensorProto.INT8, None))
    run = session(probe)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng((seed, 1))
    inputs_q = rng.integers(-128, 128, (SAMPLES, *shape), dtype=np.int8)
    inputs = (io["input_scale"] * (inputs_q.astype(np.int32) - io["input_zero_point"]).astype(np.float32))
    outputs, outputs_q, seen = [], [], {name: [] for name in intermediates}
    for x, xq in zip(inputs, inputs_q):
        y, seen_q, yq, *rest = run.run([OUTPUT_NAME, io["input_q"], io["output_q"], *intermediates], {INPUT_NAME: x})
        for name, value in zip(intermediates, rest):
            seen[name].append(value)
        if not np.array_equal(seen_q, xq):
            raise SystemExit(f"{model.graph.name}: the first QuantizeLinear does not reproduce the int8 input")
        dequantized = io["output_scale"] * (yq.astype(np.int32) - io["output_zero_point"]).astype(np.float32)
        if not np.array_equal(dequantized, y):
            raise SystemExit(f"{model.graph.name}: the float output is not s_out * (q_out - z_out)")
        outputs.append(y)
        outputs_q.append(yq)
    return dict(inputs=inputs, inputs_q=inputs_q, outputs=np.stack(outputs), outputs_q=np.stack(outputs_q),
                **{k: v for k, v in io.items() if not k.endswith("_q")},
                **{f"intermediate/{name}": np.stack(values) for name, values in seen.items()})


def check(spec: Spec, model: onnx.ModelProto) -> None:
    """Fail loudly if quantize_static ignored the per-channel or symmetric settings or left a float path."""
    consts = initializer_values(model)
    nodes = model.graph.node
    weight_dqs = [n for n in nodes if n.op_type == "DequantizeLinear" and n.input[0] in consts
                  and consts[n.input[0]].dtype == np.int8 and consts[n.input[0]].ndim >= 2]
    for n in weight_dqs:
        per_channel = consts[n.input[1]].ndim == 1 and consts[n.input[1]].size > 1
        if per_channel != spec.per_channel:
            raise SystemExit(f"{spec.name}: weight {n.input[0]} per_channel={per_channel}, wanted {spec.per_channel}")
    activation_zps = [consts[n.input[2]] for n in nodes if n.op_type == "QuantizeLinear"]
    if any(zp.dtype != np.int8 for zp in activation_zps):
        raise SystemExit(f"{spec.name}: activations are not int8")
    if spec.activation_symmetric and any(np.any(zp != 0) for zp in activation_zps):
        raise SystemExit(f"{spec.name}: symmetric activations with non-zero zero points")
    if not spec.activation_symmetric and all(np.all(zp == 0) for zp in activation_zps):
        raise SystemExit(f"{spec.name}: asymmetric activations but every zero point is 0")
    producer = {out: n for n in nodes for out in n.output}
    consumers = {name: [n for n in nodes if name in n.input] for name in producer}
    for n in nodes:
        if n.op_type in QDQ_OPS:
            continue
        if any(producer.get(i) is None or producer[i].op_type != "DequantizeLinear" for i in n.input if i):
            raise SystemExit(f"{spec.name}: {n.op_type} {n.name} has an input that is not a DequantizeLinear output")
        if [c.op_type for c in consumers[n.output[0]]] != ["QuantizeLinear"]:
            raise SystemExit(f"{spec.name}: {n.op_type} {n.name} output does not go to one QuantizeLinear")


def op_types(model: onnx.ModelProto) -> list[str]:
    return sorted({n.op_type for n in model.graph.node})


def write(spec: Spec) -> dict:
    seed = spec.seed
    builder = GraphBuilder(np.random.default_rng(seed), spec.input_shape)
    output, output_shape = spec.build(builder)
    assert output == OUTPUT_NAME
    float_model = builder.model(spec.name, OUTPUT_NAME, output_shape)
    model = quantize(spec, float_model)
    check(spec, model)
    path = OUT / f"{spec.name}.onnx"
    path.write_bytes(model.SerializeToString(deterministic=True))
    golden = reference(model, seed)
    np.savez_compressed(path.with_suffix(".npz"), **golden)
    for p in (path, path.with_suffix(".npz")):
        if p.stat().st_size > MAX_FILE_BYTES:
            raise SystemExit(f"{p.name}: {p.stat().st_size} bytes, over the {MAX_FILE_BYTES} byte budget")
    q = golden["outputs_q"]
    zps = sorted({int(v) for n in model.graph.node if n.op_type == "QuantizeLinear"
                  for v in np.atleast_1d(initializer_values(model)[n.input[2]])})
    print(f"{spec.name:<34} {path.stat().st_size:>6} B  out {'x'.join(map(str, q.shape[1:])):<10} "
          f"{len(np.unique(q)):>3} distinct, {np.mean(q == -128):4.0%} at -128, {np.mean(q == 127):4.0%} at 127  "
          f"in s={golden['input_scale']:.5g} z={golden['input_zero_point']:<4} "
          f"out s={golden['output_scale']:.5g} z={golden['output_zero_point']:<4} act zps {zps}  "
          f"{' '.join(op_types(model))}")
    return dict(name=spec.name, file=path.name, description=spec.description, per_channel=spec.per_channel,
                activation_symmetric=spec.activation_symmetric, extra_options=dict(spec.extra_options),
                calibration_range=list(spec.calibration_range), input=INPUT_NAME, output=OUTPUT_NAME,
                input_shape=list(spec.input_shape), output_shape=list(output_shape), operators=op_types(model),
                float_operators=op_types(float_model),
                **({} if spec.calibrate_method is None else {"calibrate_method": spec.calibrate_method.name}))


def remove_stale(keep: set[str]) -> None:
    """Delete fixtures of models that are no longer generated, so reruns leave exactly this script's output."""
    for path in [*OUT.glob("*.onnx"), *OUT.glob("*.npz")]:
        if path.stem not in keep:
            path.unlink()
            print(f"removed stale {path.name}")


def main() -> None:
    logging.getLogger().setLevel(logging.ERROR)  # quantize_static warns that the models were not pre-processed
    ort.set_default_logger_severity(3)
    OUT.mkdir(parents=True, exist_ok=True)
    manifest = [write(spec) for spec in SPECS]
    remove_stale({entry["name"] for entry in manifest})
    (OUT / "MANIFEST.json").write_text(json.dumps({"models": manifest}, indent=1) + "\n")


if __name__ == "__main__":
    main()
