"""Regenerate tests/fixtures/oracle/elementwise_ops.npz: BUILTIN_REF outputs of int8 SUB, MUL and SOFTMAX.

Why: the simulator's SUB, MUL and SOFTMAX numerics must be bit-exact with
TFLite's reference kernels, and the tests must not depend on TensorFlow. This
script converts tiny tf.function graphs (one SUB, one MUL, one SOFTMAX) with
full-integer int8 quantization, then rewrites the quantization parameters (and
the fused activation or softmax beta) of the single operator's tensors in the
flatbuffer to the values listed below, so each case has exactly the qparams
it names. It runs LiteRT's BUILTIN_REF interpreter on:

* SUB and MUL: all 256 x 256 int8 input pairs, for every parameter case;
* SOFTMAX: a few hundred rows of depth 10 and 16 per input scale, mixing
  uniform rows, rows with one dominant value, narrow rows, constant rows and
  ties at the maximum.

It prints the operator and the qparams the interpreter reports for each case
and stops if the converter produced anything but the one expected operator.
Keep SOFTMAX input scales above 2**-26: below that, TFLite aborts the process.

Run from the repository root with the `fixtures` extra installed:

    python scripts/make_elementwise_oracle.py

Reruns produce the same arrays. The tests never import TensorFlow.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import flatbuffers
import numpy as np
import tensorflow as tf
from ai_edge_litert import schema_py_generated as schema
from ai_edge_litert.interpreter import Interpreter, OpResolverType

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "oracle" / "elementwise_ops.npz"
GRID = 256

# (input scale, zero point, input2 scale, zero point, output scale, zero point, fused activation)
SUB_CASES = [
    (0.02, -7, 0.031, 12, 0.045, 3, "NONE"),
    (0.05, 0, 0.05, 0, 0.1, 0, "NONE"),               # equal input scales: both multipliers 2**-1
    (0.0123, 20, 0.0789, -30, 0.006, -60, "RELU"),    # narrow output: mostly saturated, clamped at the zp
]
MUL_CASES = [
    (0.02, -7, 0.031, 12, 0.011, 3, "NONE"),
    (0.37, 5, 0.41, -9, 0.023, 0, "NONE"),            # real multiplier ~6.6: a positive (left) shift
    # s1 * s2 / s_out differs between float32 and double in the multiplier's last bits, and that changes
    # 32 of the 65536 outputs: this case tells the two apart (TFLite's mul.cc computes in float32).
    (0.039738819003105164, 3, 0.033220190554857254, -5, 0.04043462127447128, 2, "NONE"),
    (0.03, -2, 0.025, 7, 0.04, -100, "RELU6"),        # RELU6: clamped at both ends (-100 and 50)
]
SOFTMAX_SCALES = (0.004, 0.05, 0.3, 2.0, 40.0)       # 40: multiplier capped at 2**31 - 1, left shift 31
SOFTMAX_BETAS = (1.0, 1.0, 0.5, 1.0, 1.0)
SOFTMAX_ZERO_POINTS = (0, -12, 5, 0, 100)
SOFTMAX_DEPTHS = (10, 16)
SOFTMAX_ROWS = 320


def convert(function, shapes: list[tuple[int, ...]]) -> bytes:
    """Full-integer int8 conversion of a tf.function on float inputs of the given shapes."""
    concrete = function.get_concrete_function(*[tf.TensorSpec(s, tf.float32) for s in shapes])

    def representative():
        rng = np.random.default_rng(0)
        for _ in range(20):
            yield [rng.uniform(-3, 3, s).astype(np.float32) for s in shapes]

    converter = tf.lite.TFLiteConverter.from_concrete_functions([concrete], function)
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = representative
    converter.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
    converter.inference_input_type = tf.int8
    converter.inference_output_type = tf.int8
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Statistics for quantized inputs were expected")
        return converter.convert()


def with_qparams(model_bytes: bytes, qparams: list[tuple[float, int]], activation: str | None = None,
                 beta: float | None = None) -> bytes:
    """Set scale and zero point of the single operator's inputs then output, its fused activation or beta."""
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAs(model_bytes, 0))
    (graph,) = model.subgraphs
    (op,) = graph.operators
    for index, (scale, zero_point) in zip([*op.inputs, *op.outputs], qparams, strict=True):
        graph.tensors[index].quantization.scale = [float(np.float32(scale))]
        graph.tensors[index].quantization.zeroPoint = [int(zero_point)]
    if activation is not None:
        op.builtinOptions.fusedActivationFunction = getattr(schema.ActivationFunctionType, activation)
    if beta is not None:
        op.builtinOptions.beta = float(beta)
    builder = flatbuffers.Builder(1024)
    builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
    return bytes(builder.Output())


def interpreter(model_bytes: bytes, expected_op: str) -> Interpreter:
    """BUILTIN_REF interpreter of a model that must hold exactly one ``expected_op`` reading the graph inputs."""
    with tempfile.NamedTemporaryFile(suffix=".tflite", delete=False) as handle:
        handle.write(model_bytes)
    try:
        interp = Interpreter(model_path=handle.name, experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    finally:
        os.unlink(handle.name)
    interp.allocate_tensors()
    ops = interp._get_ops_details()
    if [op["op_name"] for op in ops] != [expected_op]:
        raise SystemExit(f"expected a single {expected_op}, the converter produced {[o['op_name'] for o in ops]}")
    graph_inputs = [d["index"] for d in interp.get_input_details()]
    if sorted(ops[0]["inputs"].tolist()) != sorted(graph_inputs):
        raise SystemExit(f"{expected_op} does not read the graph inputs directly")
    return interp


def describe(interp: Interpreter) -> str:
    (op,) = interp._get_ops_details()
    tensors = {t["index"]: t for t in interp.get_tensor_details()}
    parts = [f"{tensors[i]['name']}{tuple(tensors[i]['quantization'])}" for i in [*op["inputs"], *op["outputs"]]]
    return f"{op['op_name']}: " + ", ".join(parts)


def activation_range(activation: str, scale: float, zero_point: int) -> tuple[int, int]:
    """CalculateActivationRangeQuantized for int8: zp + TfLiteRound(float(bound) / scale), clipped to int8."""
    def quantize(value: float) -> int:
        q = float(np.float32(value) / np.float32(scale))  # float32 division, then std::round (half away from 0)
        return zero_point + int(math.copysign(math.floor(abs(q) + 0.5), q))

    low, high = {"NONE": (-128, 127), "RELU": (quantize(0.0), 127),
                 "RELU6": (quantize(0.0), quantize(6.0))}[activation]
    return max(-128, low), min(127, high)


def run_binary(name: str, function, cases) -> dict[str, np.ndarray]:
    """All 256 x 256 input pairs through the one-operator model, once per parameter case."""
    base = convert(function, [(GRID, GRID), (GRID, GRID)])
    x1, x2 = np.meshgrid(np.arange(-128, 128, dtype=np.int8), np.arange(-128, 128, dtype=np.int8), indexing="ij")
    outputs, acts = [], []
    for s1, z1, s2, z2, so, zo, activation in cases:
        interp = interpreter(with_qparams(base, [(s1, z1), (s2, z2), (so, zo)], activation), name.upper())
        (op,) = interp._get_ops_details()
        first, second = op["inputs"].tolist()
        interp.set_tensor(first, x1)
        interp.set_tensor(second, x2)
        interp.invoke()
        outputs.append(interp.get_tensor(op["outputs"][0]).copy())
        acts.append(activation_range(activation, so, zo))
        print(f"{describe(interp)}  {activation} -> clamp {acts[-1]}, "
              f"{len(np.unique(outputs[-1]))} distinct outputs")
    return {f"{name}_scales": np.array([[c[0], c[2], c[4]] for c in cases], np.float32),
            f"{name}_zero_points": np.array([[c[1], c[3], c[5]] for c in cases], np.int32),
            f"{name}_act": np.array(acts, np.int32), f"{name}_out": np.stack(outputs)}


def softmax_rows(rng: np.random.Generator, rows: int, depth: int) -> np.ndarray:
    """Uniform rows, one dominant value, narrow spreads, constant rows and ties at the maximum."""
    kinds = np.arange(rows) % 5
    x = rng.integers(-128, 128, (rows, depth))
    dominant = kinds == 1
    x[dominant] = rng.integers(-128, -60, (dominant.sum(), depth))
    x[dominant, rng.integers(0, depth, dominant.sum())] = rng.integers(60, 128, dominant.sum())
    narrow = kinds == 2
    x[narrow] = rng.integers(-4, 5, (narrow.sum(), 1)) * 10 + rng.integers(-3, 4, (narrow.sum(), depth))
    constant = kinds == 3
    x[constant] = rng.integers(-128, 128, (constant.sum(), 1))
    ties = np.flatnonzero(kinds == 4)
    x[ties, :3] = x[ties].max(axis=1, keepdims=True)
    return x.astype(np.int8)


def run_softmax() -> dict[str, np.ndarray]:
    @tf.function
    def softmax(x):
        return tf.nn.softmax(x)

    arrays = {"softmax_scale": np.array(SOFTMAX_SCALES, np.float32),
              "softmax_zero_point": np.array(SOFTMAX_ZERO_POINTS, np.int32),
              "softmax_beta": np.array(SOFTMAX_BETAS, np.float32)}
    for depth in SOFTMAX_DEPTHS:
        base = convert(softmax, [(SOFTMAX_ROWS, depth)])
        rng = np.random.default_rng(depth)
        inputs, outputs = [], []
        for scale, zero_point, beta in zip(SOFTMAX_SCALES, SOFTMAX_ZERO_POINTS, SOFTMAX_BETAS):
            interp = interpreter(with_qparams(base, [(scale, zero_point), (1 / 256, -128)], beta=beta), "SOFTMAX")
            (op,) = interp._get_ops_details()
            x = softmax_rows(rng, SOFTMAX_ROWS, depth)
            interp.set_tensor(op["inputs"][0], x)
            interp.invoke()
            inputs.append(x)
            outputs.append(interp.get_tensor(op["outputs"][0]).copy())
            print(f"{describe(interp)}  beta {beta}, depth {depth}: "
                  f"{np.mean(outputs[-1] == -128):.0%} of outputs at -128")
        arrays[f"softmax_d{depth}_x"] = np.stack(inputs)
        arrays[f"softmax_d{depth}_out"] = np.stack(outputs)
    return arrays


def main() -> None:
    @tf.function
    def sub(a, b):
        return a - b

    @tf.function
    def mul(a, b):
        return a * b

    arrays = {**run_binary("sub", sub, SUB_CASES), **run_binary("mul", mul, MUL_CASES), **run_softmax()}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"{OUT.relative_to(Path.cwd()) if OUT.is_relative_to(Path.cwd()) else OUT}: {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
