"""Quantizing trained float models (scikit-learn's digits, scripts/make_digits_fixtures.py) end to end:
both source formats, every layer on the NPU, the NPU equal to the simulated quantization on real images,
and the ``npu quantize`` file round trip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from npu_backend import QConfig
from npu_backend.cli import main as npu
from npu_backend.quantization import calibrate
from npu_backend.quantization.predicted import PredictedLayer
from npu_backend.quantization.stored import load_quantized, save_quantized

DIGITS = Path(__file__).parent / "fixtures" / "digits"
SPLIT = np.load(DIGITS / "digits_split.npz")
CALIBRATION, TEST, LABELS = SPLIT["calibration"], SPLIT["test"][:40], SPLIT["test_labels"][:40]
EXPECTED_COMPOSITES = {
    "cnn": {"npu.conv2d", "npu.max_pool2d", "npu.avg_pool2d", "npu.reshape", "npu.fully_connected"},
    "mobilenet": {"npu.conv2d", "npu.depthwise_conv2d", "npu.hard_swish", "npu.mean", "npu.sigmoid",
                  "npu.multiply", "npu.add", "npu.fully_connected"},
}


def _inputs(images, source):
    return [np.ascontiguousarray(np.transpose(x, (2, 0, 1)))[None] if source == "onnx" else x[None] for x in images]


@pytest.fixture(scope="module", params=[(m, s) for m in ("cnn", "mobilenet") for s in ("tflite", "onnx")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def quantized(request):
    model, source = request.param
    mod = npu_backend.load_model(DIGITS / f"{model}_float.{source}")
    rounding = "tflite" if source == "tflite" else "onnxruntime"
    return model, source, calibrate(mod, _inputs(CALIBRATION, source), QConfig(rounding=rounding))


def test_every_operator_on_the_npu_and_equal_to_the_simulation(quantized):
    model, source, calibrated = quantized
    partitioned = npu_backend.partition_for_npu(calibrated.module)
    report = npu_backend.partition_report(partitioned)
    host = [o for o in report.host_ops if o.op not in ("relax.quantize", "relax.dequantize")]
    assert host == [], [(o.op, o.reason) for o in host]
    assert EXPECTED_COMPOSITES[model] <= {o.composite for o in report.npu_ops}
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm"), tvm.cpu())
    inputs = _inputs(TEST, source)
    simulated = calibrated.simulate(inputs)
    logits = []
    for x, sim in zip(inputs, simulated):
        out = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_array_equal(out, sim[0])
        logits.append(out[0])
    assert np.mean(np.argmax(logits, axis=1) == LABELS) > 0.8
    assert calibrated.report.output_sqnr_db > 20.0
    # every convolution and dense layer was calibrated from its predicted record, which its build confirmed
    ctx = calibrated._ctx
    macs = [layer for layer in ctx.layers if layer.kind.name in ("conv2d", "matmul")]
    assert macs and ctx.predicting
    assert all(isinstance(ctx.npu_cache[layer.index], PredictedLayer) and ctx.npu_cache[layer.index].verified
               for layer in macs)


def test_stored_file_round_trip(tmp_path):
    model = DIGITS / "cnn_float.tflite"
    calibrated = calibrate(npu_backend.load_model(model), _inputs(CALIBRATION[:20], "tflite"))
    path = tmp_path / "cnn.npuq"
    save_quantized(calibrated, model, path)
    loaded = load_quantized(path)
    tvm.ir.assert_structural_equal(loaded.module["main"], calibrated.module["main"])
    assert loaded.report.to_json() == calibrated.report.to_json()
    x = _inputs(TEST[:3], "tflite")
    for a, b in zip(loaded.simulate(x), calibrated.simulate(x)):
        np.testing.assert_array_equal(a[0], b[0])
    tvm.ir.assert_structural_equal(npu_backend.load_model(path)["main"], calibrated.module["main"])


def test_cli_quantize_then_run_partition_and_compile(tmp_path, capsys):
    calib = tmp_path / "calib.npz"
    np.savez(calib, images=CALIBRATION[:20])
    out = tmp_path / "cnn.npuq"
    assert npu(["quantize", str(DIGITS / "cnn_float.tflite"), "--calibration", str(calib), "--method", "mse",
                "--weight-rounding", "least_squares", "--output-headroom", "0.25", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "conv2d_0" in printed and "output SQNR" in printed and str(out) in printed
    assert [t.method for t in load_quantized(out).report.tensors if "headroom" in t.method] == [
        "mse, headroom x1.25"]  # the model's output range, widened as asked
    assert npu(["run", str(out)]) == 0
    assert "MATCH" in capsys.readouterr().out
    assert npu(["partition", str(out)]) == 0
    assert "on the NPU" in capsys.readouterr().out
    assert npu(["compile", str(out), "-o", str(tmp_path / "compiled")]) == 0
    assert npu(["sim", str(tmp_path / "compiled"), "--random-inputs"]) == 0


@pytest.mark.parametrize("case, message", [
    ("missing", "cannot read calibration data"),
    ("shape", "has shape"),
    ("quantized", "already quantizes"),
    ("suffix", "written as a .npuq file"),
    ("headroom", "output_headroom: 3.0 is neither 'cross_validated' nor a number from 0 to 1"),
    ("plot", "--plot draws each layer's SQNR against the float model, which --no-float-reference skips"),
    ("reference", "reference_samples: 0 is neither None (every sample) nor a positive integer"),
])
def test_cli_quantize_bad_input_is_one_error_line(tmp_path, capsys, case, message):
    model = DIGITS / "cnn_float.tflite"
    calib = tmp_path / "calib.npz"
    np.savez(calib, images=np.zeros((4, 9, 9, 1), np.float32) if case == "shape" else CALIBRATION[:4])
    args = {"missing": [str(model), "--calibration", str(tmp_path / "nope.npz"), "-o", str(tmp_path / "q.npuq")],
            "shape": [str(model), "--calibration", str(calib), "-o", str(tmp_path / "q.npuq")],
            "quantized": [str(DIGITS / "cnn_tflite_ptq.tflite"), "--calibration", str(calib),
                          "-o", str(tmp_path / "q.npuq")],
            "suffix": [str(model), "--calibration", str(calib), "-o", str(tmp_path / "q.tflite")],
            "headroom": [str(model), "--calibration", str(calib), "--output-headroom", "3", "-o",
                         str(tmp_path / "q.npuq")],
            "plot": [str(model), "--calibration", str(calib), "--no-float-reference", "--plot",
                     str(tmp_path / "sqnr.png"), "-o", str(tmp_path / "q.npuq")],
            "reference": [str(model), "--calibration", str(calib), "--reference-samples", "0", "-o",
                          str(tmp_path / "q.npuq")]}[case]
    assert npu(["quantize", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("npu: error:") and message in err[0], err


@pytest.mark.parametrize("given, compared", [(None, 16), ("5", 5), ("all", 20)])
def test_cli_reference_samples_say_how_many_samples_the_float_model_ran_on(tmp_path, capsys, given, compared):
    calib = tmp_path / "calib.npz"
    np.savez(calib, images=CALIBRATION[:20])
    out = tmp_path / "cnn.npuq"
    option = [] if given is None else ["--reference-samples", given]
    assert npu(["quantize", str(DIGITS / "cnn_float.tflite"), "--calibration", str(calib), *option,
                "-o", str(out)]) == 0
    assert f"(float model on {compared} of 20 samples)" in capsys.readouterr().out
    report = load_quantized(out).report
    assert (report.samples, report.compared_samples) == (20, compared)
    assert report.config["reference_samples"] == {None: 16, "5": 5, "all": None}[given]


def test_cli_narrow_accumulator_model_runs_on_its_own_hardware_and_reports_overflows(tmp_path, capsys):
    calib = tmp_path / "calib.npz"
    np.savez(calib, images=CALIBRATION[:10])
    out = tmp_path / "narrow.npuq"
    assert npu(["quantize", str(DIGITS / "cnn_float.tflite"), "--calibration", str(calib),
                "--accumulator-bits", "14", "--overflow", "saturate", "--no-float-reference", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "output SQNR not measured (float_reference off); accumulators 14 bits (saturate)" in printed
    assert load_quantized(out).report.config["float_reference"] is False
    overflowed = sum(layer.overflows for layer in load_quantized(out).report.layers)
    assert overflowed > 0  # 14 bits cannot hold this CNN's sums: counted, never silent
    assert npu(["run", str(out)]) == 0  # partitioned for the file's own 14-bit NPU, so equal to its simulation
    printed = capsys.readouterr().out
    assert "MATCH" in printed and "accumulator overflows:" in printed and "(saturate, 14 bits)" in printed


def test_a_file_that_is_not_a_quantized_model_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "bad.npuq"
    bad.write_bytes(b"not a zip")
    assert npu(["run", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("npu: error: bad.npuq: not a quantized-model file")


def test_kl_observes_the_float_model_and_keeps_table_outputs_whole():
    """KL on the quantized path saw a hard swish's output as a comb of at most 256 values and clipped it to a
    fifth of its range (the model's SQNR fell to 3 dB); observed on the float model it keeps the tail."""
    mod = npu_backend.load_model(DIGITS / "mobilenet_float.tflite")
    kl = calibrate(mod, _inputs(CALIBRATION, "tflite"), QConfig(calibration="kl"))
    # KL runs the float model on every sample: minmax too, so that both SQNRs are over the same samples
    minmax = calibrate(mod, _inputs(CALIBRATION, "tflite"), QConfig(calibration="minmax", reference_samples=None))
    assert kl.report.output_sqnr_db > minmax.report.output_sqnr_db - 3.0
    assert kl.report.output_sqnr_db > 25.0
