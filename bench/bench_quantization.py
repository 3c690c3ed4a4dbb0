"""Post-training quantization against its anchors, on real data (scikit-learn's digits) and trained weights.

Every quantizer gets the same 100 calibration images (tests/fixtures/digits/digits_split.npz):
  - TFLite full-integer post-training quantization (made by scripts/make_digits_fixtures.py), run with
    LiteRT's BUILTIN_REF kernels;
  - onnxruntime ``quantize_static`` (QDQ, per-channel, MinMax / Entropy / Percentile), run with graph
    optimizations off;
  - ours, ``npu_backend.quantize`` with each method, with least-squares weight rounding, and without the
    outputs' cross-validated headroom (the default before it), from the float TFLite and the float ONNX model, run
    on the simulated NPU (and checked equal, image by image, to its simulated quantization).
Columns: test top-1 (400 images), agreement with the float model's top-1, logits SQNR against the float model
(dB), and the share of the quantized model's operators that ``partition_for_npu`` puts on the NPU.

Then the seed's table for our models: top-1 and SQNR against the global scale, the weight bits (rounded to
nearest and by least squares) and the accumulator bits (with the overflows counted on the test set).

Needs the ``reference`` extra (ai-edge-litert, onnxruntime):  python bench/bench_quantization.py [--quick]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DIGITS = ROOT / "tests" / "fixtures" / "digits"
MODELS = ("cnn", "mobilenet")
OURS = [(method, {"calibration": method}) for method in ("minmax", "percentile", "kl", "mse")] + [
    ("minmax, least_squares", {"weight_rounding": "least_squares"}),
    ("percentile, least_squares", {"calibration": "percentile", "weight_rounding": "least_squares"}),
    ("minmax, output_headroom=0", {"output_headroom": 0}),
]
"""Our rows: a name and the QConfig fields (every other one at its default: the outputs' headroom is
cross-validated unless the row says otherwise)."""
NAME_WIDTH = 52


def sqnr_db(reference: np.ndarray, value: np.ndarray) -> float:
    noise = float(np.sum((reference.astype(np.float64) - value.astype(np.float64)) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def tflite_logits(path: Path, images: np.ndarray, ref: bool = True) -> np.ndarray:
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    kind = OpResolverType.BUILTIN_REF if ref else OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    interpreter = Interpreter(model_path=str(path), experimental_op_resolver_type=kind)
    interpreter.allocate_tensors()
    inp, out = interpreter.get_input_details()[0], interpreter.get_output_details()[0]
    logits = []
    for image in images:
        interpreter.set_tensor(inp["index"], image[None])
        interpreter.invoke()
        logits.append(interpreter.get_tensor(out["index"])[0].astype(np.float32))
    return np.stack(logits)


def onnx_session(path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def onnx_logits(path: Path, images: np.ndarray) -> np.ndarray:
    session = onnx_session(path)
    name = session.get_inputs()[0].name
    return np.stack([session.run(None, {name: nchw(image)[None]})[0][0] for image in images])


def nchw(image: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.transpose(image, (2, 0, 1)))


def ort_quantize(float_model: Path, calibration: np.ndarray, method: str, out: Path) -> Path:
    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{"input": nchw(image)[None]} for image in calibration])

        def get_next(self):
            return next(self.items, None)

    quantize_static(str(float_model), str(out), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8,
                    calibrate_method=getattr(CalibrationMethod, method))
    return out


def npu_share(mod) -> str:
    import npu_backend

    report = npu_backend.partition_report(npu_backend.partition_for_npu(mod))
    boundary = ("relax.quantize", "relax.dequantize")
    host = [o for o in report.host_ops if o.op not in boundary]
    inner = [o for o in report.ops if o.op not in boundary or o.target == "npu"]
    return f"{len(inner) - len(host)}/{len(inner)}"


def run_npu(calibrated, images: np.ndarray, layout: str):
    """Logits of a quantized module with its NPU regions on the simulator, and the profile's overflows."""
    import tvm
    from tvm import relax

    import npu_backend

    partitioned = npu_backend.partition_for_npu(calibrated.module, calibrated.npu_config)
    vm = relax.VirtualMachine(npu_backend.codegen.build_partitioned(partitioned), tvm.cpu())
    logits = []
    with npu_backend.profile() as prof:
        for image in images:
            x = nchw(image)[None] if layout == "nchw" else image[None]
            logits.append(vm["main"](tvm.runtime.tensor(x)).numpy()[0])
    return np.stack(logits), prof.total_overflows


def row(name, source, logits, float_logits, labels, share, seconds=None):
    top1 = float(np.mean(np.argmax(logits, 1) == labels))
    agree = float(np.mean(np.argmax(logits, 1) == np.argmax(float_logits, 1)))
    timing = "" if seconds is None else f" {seconds:8.1f}"
    print(f"{name:<{NAME_WIDTH}} {source:<7} {top1:7.2%} {agree:9.2%} {sqnr_db(float_logits, logits):9.2f} "
          f"{share:>9}{timing}", flush=True)
    return top1, sqnr_db(float_logits, logits)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 test images, no sweeps")
    args = parser.parse_args()
    import npu_backend
    from npu_backend import QConfig
    from npu_backend.quantization import calibrate

    split = np.load(DIGITS / "digits_split.npz")
    calibration, test, labels = split["calibration"], split["test"], split["test_labels"]
    if args.quick:
        test, labels = test[:100], labels[:100]
    tmp = Path(tempfile.mkdtemp())
    for model in MODELS:
        tfl, onnx_path = DIGITS / f"{model}_float.tflite", DIGITS / f"{model}_float.onnx"
        float_tfl = tflite_logits(tfl, test, ref=False)
        float_onnx = onnx_logits(onnx_path, test)
        print(f"\n== {model}: {len(test)} test images, 100 calibration images ==")
        print(f"{'quantizer':<{NAME_WIDTH}} {'source':<7} {'top-1':>7} {'agreement':>9} {'SQNR dB':>9} {'on NPU':>9} "
              f"{'quantize s':>8}")
        row("float", "tflite", float_tfl, float_tfl, labels, "-")
        ptq = DIGITS / f"{model}_tflite_ptq.tflite"
        row("TFLite PTQ (BUILTIN_REF)", "tflite", tflite_logits(ptq, test), float_tfl, labels,
            npu_share(npu_backend.load_model(ptq)))
        for method in ("MinMax", "Entropy", "Percentile"):
            start = time.perf_counter()
            out = ort_quantize(onnx_path, calibration, method, tmp / f"{model}_{method}.onnx")
            seconds = time.perf_counter() - start
            row(f"onnxruntime quantize_static {method}", "onnx", onnx_logits(out, test), float_onnx, labels,
                npu_share(npu_backend.load_model(out)), seconds)
        for source, path, float_logits, layout in (("tflite", tfl, float_tfl, "nhwc"),
                                                   ("onnx", onnx_path, float_onnx, "nchw")):
            mod = npu_backend.load_model(path)
            data = [nchw(x)[None] if layout == "nchw" else x[None] for x in calibration]
            rounding = "tflite" if source == "tflite" else "onnxruntime"
            for name, options in OURS:
                start = time.perf_counter()
                calibrated = calibrate(mod, data, QConfig(rounding=rounding, **options))
                seconds = time.perf_counter() - start
                logits, _ = run_npu(calibrated, test, layout)
                simulated = np.stack([o[0][0] for o in calibrated.simulate(
                    [nchw(x)[None] if layout == "nchw" else x[None] for x in test])])
                exact = int(np.sum(np.all(simulated == logits, axis=1)))
                row(f"ours {name} (NPU = sim {exact}/{len(test)})", source, logits, float_logits, labels,
                    npu_share(calibrated.module), seconds)
        if args.quick:
            continue
        print(f"\n-- {model} (from TFLite, ours, minmax): the seed's sweeps --")
        print(f"{'setting':<{NAME_WIDTH}} {'source':<7} {'top-1':>7} {'agreement':>9} {'SQNR dB':>9} {'overflows':>9}")
        mod = npu_backend.load_model(tfl)
        data = [x[None] for x in calibration]
        sweeps = [(f"global scale {g}", QConfig(global_scale=float(g))) for g in (2, 4, 8, 16)]
        sweeps += [(f"weight bits {b}", QConfig(weight_bits=b)) for b in (8, 6, 4)]
        sweeps += [(f"weight bits {b}, least_squares", QConfig(weight_bits=b, weight_rounding="least_squares"))
                   for b in (8, 6, 4)]
        sweeps += [(f"accumulator {b} bits, {mode}", QConfig(accumulator_bits=b, accumulator_overflow=mode))
                   for b in (32, 16, 14) for mode in ("wrap", "saturate")]
        sweeps += [("accumulator 14 bits, avoid overflow", QConfig(accumulator_bits=14, avoid_overflow=True))]
        for name, config in sweeps:
            calibrated = calibrate(mod, data, config)
            logits, overflows = run_npu(calibrated, test, "nhwc")
            row(name, "tflite", logits, float_tfl, labels, str(overflows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
