"""Regenerate tests/fixtures/oracle/onnxruntime_ops.npz: onnxruntime's outputs of tiny int8 QDQ graphs.

Why: ``Rounding.ONNXRUNTIME`` must reproduce onnxruntime bit for bit, and the
tests must not depend on onnxruntime. This script builds one-operator QDQ
graphs (DequantizeLinear -> float op -> QuantizeLinear, opset 17) and runs them
in onnxruntime's CPU execution provider with graph optimizations off
(``ORT_DISABLE_ALL``, so nothing is fused into QLinear* kernels) on one thread,
the way ONNX QDQ models are checked in this project. Qparams are fed as graph
inputs, so one session serves every case of an operator. It stores:

* Add, Sub, Mul: every int8 pair (256 x 256), three qparam cases each, one of
  them tie-prone (equal input scales and an output scale that makes the exact
  result a multiple of 1/2, or a power-of-two multiple for Mul);
* AveragePool (count_include_pad=0) 2x2 stride 2, 3x3 stride 1 pad 1, 3x3
  stride 3 pad 1 (MLAS's generic kernel) and a window over the whole 12x12
  input (MLAS's global kernel), each on four random int8 tensors, two with the
  output qparams equal to the input's (tie-prone) and two with others;
* GlobalAveragePool over 7x7, 12x12 and 13x13 (four random tensors each,
  likewise). Ties are rarer here, so for 12x12 (and the whole-window pool)
  the tie-prone tensors are drawn until the exact result rounded half to even
  and a plain sequential float32 sum each get at least one output wrong
  (odd counts, 7x7 and 13x13, cannot tie);
* Sigmoid, Tanh, LeakyRelu(alpha=0.1), HardSwish and Identity on all 256 int8
  inputs, for five fixed qparam cases plus, for Sigmoid and Tanh, two cases
  found by search where numpy's float64 function (rounded to float32) gives a
  different table than onnxruntime (MLAS's polynomial is an ulp off there).

For each case it prints how many outputs the exact real result rounded half
to even would get wrong, so the tie-prone cases are seen to bite.

Spatial tensors are stored NHWC (the NPU's layout), transposed from
onnxruntime's NCHW. Which MLAS kernels run depends on the CPU: the stored
outputs come from an x86-64 CPU with AVX2 and FMA3 (the script refuses other
machines). Run from the repository root with the `fixtures` extra installed:

    python scripts/make_ort_oracle.py

Reruns produce the same arrays. The tests never import onnxruntime.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "oracle" / "onnxruntime_ops.npz"
OPSET = 17
F32 = np.float32

# (input scale, zero point, input2 scale, zero point, output scale, zero point)
BINARY_CASES = {
    "Add": [(0.0431, 17, 0.0431, 17, 0.0862, 17),          # tie-prone: exact sums are multiples of 1/2 step
            (0.02, -7, 0.031, 12, 0.045, 3),
            (0.0123, 20, 0.0789, -30, 0.006, -60)],        # narrow output: mostly saturated
    "Sub": [(0.0431, 17, 0.0431, -3, 0.0862, 5),           # tie-prone
            (0.02, -7, 0.031, 12, 0.045, 3),
            (0.1, 0, 0.05, -128, 0.07, 10)],
    "Mul": [(0.02, 0, 0.03, 0, 0.0096, 0),                 # tie-prone: s1 * s2 / s_out = 1/16
            (0.02, -7, 0.031, 12, 0.011, 3),
            (0.37, 5, 0.41, -9, 0.023, 0)],                # real multiplier ~6.6
}
EXACT_BINARY = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}

# name: (kernel, strides, pads (top, left, bottom, right), input H x W, channels)
POOL_CASES = {
    "avgpool_2x2_s2": ((2, 2), (2, 2), (0, 0, 0, 0), (12, 12), 8),
    "avgpool_3x3_s1_p1": ((3, 3), (1, 1), (1, 1, 1, 1), (12, 12), 8),
    "avgpool_3x3_s3_p1": ((3, 3), (3, 3), (1, 1, 1, 1), (13, 14), 8),
    "avgpool_whole_12x12": ((12, 12), (1, 1), (0, 0, 0, 0), (12, 12), 32),
}
GLOBAL_CASES = {"global_7x7": (7, 7), "global_12x12": (12, 12), "global_13x13": (13, 13)}
GLOBAL_CHANNELS = 32
TENSORS_PER_CASE = 4

UNARY_OPS = {"Sigmoid": {}, "Tanh": {}, "LeakyRelu": {"alpha": 0.1}, "HardSwish": {}, "Identity": {}}
# (input scale, zero point, output scale, zero point)
UNARY_CASES = [(0.1, 0, 1 / 256, -128), (0.0625, -10, 0.0078125, 0), (0.0235, 20, 0.0039, -128),
               (0.05, 5, 0.02, 3), (0.125, 0, 0.03125, -7)]
NUMPY_F64 = {"Sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "Tanh": np.tanh}
SEARCHED_CASES = 2


def session(nodes, inputs, outputs) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def value(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def qparam_inputs(*names):
    """Graph inputs of scalar scales (s*) and int8 zero points (z*)."""
    return [value(n, TensorProto.FLOAT if n.startswith("s") else TensorProto.INT8, []) for n in names]


def feeds(**qparams):
    return {k: np.array(F32(v)) if k.startswith("s") else np.array(v, np.int8) for k, v in qparams.items()}


def exact_rne(real, output_zero_point):
    """The exact result rounded half to even, for the 'would an exact formula do?' column."""
    return np.clip(np.rint(real) + output_zero_point, -128, 127)


def dq64(q, scale, zero_point):
    return (q.astype(np.float64) - zero_point) * float(F32(scale))


def binary_cases(arrays):
    q = np.arange(-128, 128, dtype=np.int8)
    a, b = np.meshgrid(q, q, indexing="ij")
    for op, cases in BINARY_CASES.items():
        sess = session([helper.make_node("DequantizeLinear", ["a", "s1", "z1"], ["af"]),
                        helper.make_node("DequantizeLinear", ["b", "s2", "z2"], ["bf"]),
                        helper.make_node(op, ["af", "bf"], ["yf"]),
                        helper.make_node("QuantizeLinear", ["yf", "so", "zo"], ["y"])],
                       [value("a", TensorProto.INT8, [256, 256]), value("b", TensorProto.INT8, [256, 256]),
                        *qparam_inputs("s1", "z1", "s2", "z2", "so", "zo")],
                       [value("y", TensorProto.INT8, [256, 256])])
        outputs = []
        for s1, z1, s2, z2, so, zo in cases:
            y = sess.run(None, {"a": a, "b": b, **feeds(s1=s1, z1=z1, s2=s2, z2=z2, so=so, zo=zo)})[0]
            exact = exact_rne(EXACT_BINARY[op](dq64(a, s1, z1), dq64(b, s2, z2)) / float(F32(so)), zo)
            print(f"{op} {(s1, z1, s2, z2, so, zo)}: exact-RNE differs on {int((exact != y).sum())} of 65536")
            outputs.append(y)
        key = op.lower()
        arrays[f"{key}_scales"] = np.array([(c[0], c[2], c[4]) for c in cases], F32)
        arrays[f"{key}_zero_points"] = np.array([(c[1], c[3], c[5]) for c in cases], np.int32)
        arrays[f"{key}_outputs"] = np.stack(outputs)


def random_qparams(rng, same: bool):
    s_in, z_in = F32(10 ** rng.uniform(-2.5, -0.5)), int(rng.integers(-128, 128))
    if same:
        return s_in, z_in, s_in, z_in
    return s_in, z_in, F32(s_in * rng.uniform(0.3, 1.2)), int(rng.integers(-30, 30))


def sequential_mean(x_centred, si, so, zo):
    """A plain float32 sum in row-major order, divided and quantized: what the 4-lane global order is not."""
    values = (x_centred.astype(F32) * F32(si)).reshape(*x_centred.shape[:2], -1)
    total = np.zeros(values.shape[:2], F32)
    for i in range(values.shape[2]):
        total = total + values[:, :, i]
    v = np.clip(total / F32(values.shape[2]) / F32(so), F32(-128 - zo), F32(127 - zo))
    return (np.rint(v).astype(np.int32) + zo).reshape(*x_centred.shape[:2], 1, 1)


def pool_runs(name, node, height, width, channels, out_hw, seed, count_of, must_bite=False):
    """Run ``node`` on TENSORS_PER_CASE random tensors; store NHWC inputs/outputs and qparams under ``name``.

    ``must_bite`` (whole-input windows): redraw each tie-prone tensor until both the exact formula and
    a sequential float32 sum miss at least one output.
    """
    sess = session([helper.make_node("DequantizeLinear", ["x", "si", "zi"], ["xf"]), node,
                    helper.make_node("QuantizeLinear", ["pf", "so", "zo"], ["y"])],
                   [value("x", TensorProto.INT8, [1, channels, height, width]), *qparam_inputs("si", "zi", "so", "zo")],
                   [value("y", TensorProto.INT8, [1, channels, *out_hw])])
    rng = np.random.default_rng(seed)
    inputs, outputs, qparams = [], [], []
    for index in range(TENSORS_PER_CASE):
        same = index % 2 == 0
        for _ in range(2000):
            x = rng.integers(-128, 128, (1, channels, height, width)).astype(np.int8)
            si, zi, so, zo = random_qparams(rng, same)
            y = sess.run(None, {"x": x, **feeds(si=si, zi=zi, so=so, zo=zo)})[0]
            sums, counts = count_of(x.astype(np.float64) - zi)
            exact_misses = int((exact_rne(sums * float(si) / counts / float(so), zo) != y).sum())
            if not (must_bite and same):
                break
            sequential_misses = int((sequential_mean(x.astype(np.int32) - zi, si, so, zo) != y).sum())
            if exact_misses and sequential_misses:
                print(f"{name} #{index}: a sequential float32 sum differs on {sequential_misses} of {y.size}")
                break
        else:
            raise SystemExit(f"{name}: no tensor found on which the exact formula and a sequential sum miss")
        print(f"{name} #{index} {(float(si), zi, float(so), zo)}: exact-RNE differs on {exact_misses} of {y.size}")
        inputs.append(x[0].transpose(1, 2, 0))
        outputs.append(y[0].transpose(1, 2, 0))
        qparams.append((si, zi, so, zo))
    arrays = {f"{name}_input": np.stack(inputs), f"{name}_output": np.stack(outputs),
              f"{name}_scales": np.array([(q[0], q[2]) for q in qparams], F32),
              f"{name}_zero_points": np.array([(q[1], q[3]) for q in qparams], np.int32)}
    return arrays


def window_sums(kernel, strides, pads, out_hw):
    """Exact window sums and counts (inputs inside the image) of an NCHW float64 tensor."""
    def compute(x):
        h, w = x.shape[2:]
        sums, counts = np.zeros((*x.shape[:2], *out_hw)), np.zeros(out_hw)
        for oy in range(out_hw[0]):
            y0, y1 = max(oy * strides[0] - pads[0], 0), min(oy * strides[0] - pads[0] + kernel[0], h)
            for ox in range(out_hw[1]):
                x0, x1 = max(ox * strides[1] - pads[1], 0), min(ox * strides[1] - pads[1] + kernel[1], w)
                sums[:, :, oy, ox] = x[:, :, y0:y1, x0:x1].sum(axis=(2, 3))
                counts[oy, ox] = (y1 - y0) * (x1 - x0)
        return sums, counts
    return compute


def pool_cases(arrays):
    for seed, (name, (kernel, strides, pads, (h, w), channels)) in enumerate(POOL_CASES.items()):
        out_hw = ((h + pads[0] + pads[2] - kernel[0]) // strides[0] + 1,
                  (w + pads[1] + pads[3] - kernel[1]) // strides[1] + 1)
        node = helper.make_node("AveragePool", ["xf"], ["pf"], kernel_shape=list(kernel), strides=list(strides),
                                pads=[pads[0], pads[1], pads[2], pads[3]], count_include_pad=0)
        arrays.update(pool_runs(name, node, h, w, channels, out_hw, 500 + seed,
                                window_sums(kernel, strides, pads, out_hw), must_bite=kernel == (h, w)))
        arrays[f"{name}_geometry"] = np.array([*kernel, *strides, *pads], np.int32)
    for seed, (name, (h, w)) in enumerate(GLOBAL_CASES.items()):
        node = helper.make_node("GlobalAveragePool", ["xf"], ["pf"])
        arrays.update(pool_runs(name, node, h, w, GLOBAL_CHANNELS, (1, 1), 600 + seed,
                                lambda x: (x.sum(axis=(2, 3), keepdims=True), x.shape[2] * x.shape[3]),
                                must_bite=h * w % 2 == 0))


def unary_session(op):
    nodes = [helper.make_node("DequantizeLinear", ["x", "si", "zi"], ["xf"]),
             helper.make_node(op, ["xf"], ["yf"], **UNARY_OPS[op]),
             helper.make_node("QuantizeLinear", ["yf", "so", "zo"], ["y"])]
    return session(nodes, [value("x", TensorProto.INT8, [256]), *qparam_inputs("si", "zi", "so", "zo")],
                   [value("y", TensorProto.INT8, [256])])


def numpy_table(op, si, zi, so, zo):
    """numpy's float64 function rounded to float32, then quantized as onnxruntime does."""
    x = ((np.arange(-128, 128, dtype=np.int32) - zi).astype(F32) * F32(si)).astype(np.float64)
    y = NUMPY_F64[op](x).astype(F32)
    v = np.clip(y / F32(so), F32(-128 - zo), F32(127 - zo))
    return np.rint(v).astype(np.int32) + zo


def searched_cases(op, sess, x):
    """Qparams where numpy's float64 function gives another table than onnxruntime (MLAS)."""
    rng = np.random.default_rng(700)
    found = []
    for _ in range(40000):
        si, zi = F32(rng.uniform(0.003, 0.25)), int(rng.integers(-128, 128))
        so, zo = (F32(rng.uniform(0.5, 1.5) / 256), -128) if op == "Sigmoid" else (F32(rng.uniform(0.5, 1.5) / 128), 0)
        y = sess.run(None, {"x": x, **feeds(si=si, zi=zi, so=so, zo=zo)})[0]
        differ = int((numpy_table(op, si, zi, so, zo) != y).sum())
        if differ:
            print(f"{op} searched {(float(si), zi, float(so), zo)}: numpy float64 table differs in {differ} entries")
            found.append((si, zi, so, zo))
            if len(found) == SEARCHED_CASES:
                return found
    raise SystemExit(f"{op}: no qparams found where numpy and onnxruntime disagree")


def unary_cases(arrays):
    x = np.arange(-128, 128, dtype=np.int8)
    for op in UNARY_OPS:
        sess = unary_session(op)
        cases = [(F32(a), b, F32(c), d) for a, b, c, d in UNARY_CASES]
        if op in NUMPY_F64:
            cases += searched_cases(op, sess, x)
        key = op.lower()
        arrays[f"{key}_scales"] = np.array([(c[0], c[2]) for c in cases], F32)
        arrays[f"{key}_zero_points"] = np.array([(c[1], c[3]) for c in cases], np.int32)
        arrays[f"{key}_tables"] = np.stack([sess.run(None, {"x": x, **feeds(si=si, zi=zi, so=so, zo=zo)})[0]
                                            for si, zi, so, zo in cases])


def main() -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SystemExit("the stored outputs are those of onnxruntime's x86-64 MLAS kernels")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " fma " not in flags or " avx2 " not in flags:
        raise SystemExit("run on a CPU with AVX2 and FMA3: without FMA, MLAS dispatches other Sigmoid/Tanh kernels")
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}")
    arrays: dict[str, np.ndarray] = {}
    binary_cases(arrays)
    pool_cases(arrays)
    unary_cases(arrays)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {len(arrays)} arrays)")


if __name__ == "__main__":
    main()
