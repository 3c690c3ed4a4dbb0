"""npu eval / npu_backend.evaluate in this process: figures checked against an independent run, data errors,
resuming after an interruption and after a real kill, and the serial fallback without Ray."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from conftest import FIXTURES
from npu_backend.cli import main
from npu_backend.distributed import executor
from npu_backend.errors import NpuError, NpuWarning

DIGITS = FIXTURES / "digits"
MODEL = DIGITS / "cnn_tflite_ptq.tflite"
DATA = DIGITS / "digits_split.npz"
SAMPLES = 48


def _evaluate(**kwargs):
    settings = dict(key="test", labels="test_labels", limit=SAMPLES, workers=0, shard_size=8)
    return npu_backend.evaluate(MODEL, DATA, **{**settings, **kwargs})


@pytest.fixture(scope="module")
def serial():
    return _evaluate()


def test_figures_match_an_independent_run(serial):
    """Build the model ourselves, run every sample, and compare with TFLite's reference kernels directly."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    data = np.load(DATA)
    images, labels = data["test"][:SAMPLES], data["test_labels"][:SAMPLES]
    vm = relax.VirtualMachine(npu_backend.build(npu_backend.load_model(MODEL)), tvm.cpu())
    interpreter = Interpreter(model_path=str(MODEL), experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    interpreter.allocate_tensors()
    top1, cycles, exact = [], [], 0
    for image in images:
        with npu_backend.profile() as prof:
            out = vm["main"](tvm.runtime.tensor(image[None])).numpy()
        interpreter.set_tensor(interpreter.get_input_details()[0]["index"], image[None])
        interpreter.invoke()
        ref = interpreter.get_tensor(interpreter.get_output_details()[0]["index"])
        exact += int(np.count_nonzero(out == ref))
        top1.append(int(np.argmax(out)))
        cycles.append(prof.total_cycles)
    assert serial.samples == SAMPLES and serial.records["top1"] == tuple(top1)
    assert serial.top1 == pytest.approx(np.mean(np.array(top1) == labels))
    assert serial.exact_elements == exact == serial.elements == SAMPLES * 10
    assert serial.sqnr_db == float("inf") and serial.agreement == 1.0
    assert serial.cycles == (min(cycles), float(np.median(cycles)), max(cycles))
    assert serial.npu_ops > 0 and serial.reference_label == "TFLite BUILTIN_REF"


def test_float_reference_and_none(serial):
    floated = _evaluate(reference="float", limit=16)
    assert floated.reference == "float" and 20 < floated.sqnr_db < 80
    assert floated.records["top1"] == serial.records["top1"][:16]
    bare = _evaluate(reference="none", limit=16)
    assert bare.reference is None and bare.agreement is None and bare.sqnr_db is None
    assert "agreement" not in bare.to_table() and "SQNR" not in bare.to_table()
    assert bare.records["digest"] == serial.records["digest"][:16]


def test_shard_size_does_not_change_the_result(serial):
    assert _evaluate(shard_size=5) == serial


def test_resume_after_an_interruption_runs_only_the_rest(serial, tmp_path):
    seen = []

    def interrupt(done, total):
        seen.append(done)
        if done >= 24:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _evaluate(resume=tmp_path, progress=interrupt)
    assert sorted(p.name for p in tmp_path.glob("task-*.json")) == [f"task-{i:06d}.json" for i in range(3)]
    calls = []
    resumed = _evaluate(resume=tmp_path, progress=lambda done, total: calls.append(done))
    assert resumed == serial
    assert calls[0] == 24 and calls[-1] == SAMPLES and len(calls) == 1 + 3  # three shards were left
    again = []
    assert _evaluate(resume=tmp_path, progress=lambda done, total: again.append(done)) == serial
    assert again == [SAMPLES]  # nothing left to run


def test_resume_directory_of_other_work_is_refused(tmp_path):
    _evaluate(resume=tmp_path, limit=8)
    with pytest.raises(NpuError, match=r"holds results of other work \(data, samples differ\)"):
        _evaluate(resume=tmp_path, limit=16)
    with pytest.raises(NpuError, match=r"\(shard_size differ\)"):
        _evaluate(resume=tmp_path, limit=8, shard_size=4)


def test_rerun_after_killing_the_command_continues(serial, tmp_path):
    """SIGKILL a running `npu eval` once some shards are on disk; the rerun finishes with the serial figures."""
    resume = tmp_path / "shards"
    args = [sys.executable, "-m", "npu_backend.cli", "eval", str(MODEL), "--data", str(DATA), "--key", "test",
            "--labels", "test_labels", "--workers", "0", "--shard-size", "1", "--limit", str(SAMPLES),
            "--resume", str(resume), "--json"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(list(resume.glob("task-*.json"))) < 3 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    kept = len(list(resume.glob("task-*.json")))
    assert process.returncode == -signal.SIGKILL and 3 <= kept < SAMPLES
    finished = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    assert json.loads(finished.stdout) == json.loads(serial.to_json())
    assert len(list(resume.glob("task-*.json"))) == SAMPLES


def test_without_ray_it_runs_serially_and_says_how_to_parallelize(serial, monkeypatch, capsys):
    monkeypatch.setattr(executor, "ray_available", lambda: False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _evaluate(workers=None) == serial
    notes = [str(w.message) for w in caught if issubclass(w.category, NpuWarning)]
    assert len(notes) == 1 and "pip install 'npu-backend[distributed]'" in notes[0]
    with pytest.raises(NpuError, match="needs Ray"):
        _evaluate(workers=None, address="auto")
    assert main(["eval", str(MODEL), "--data", str(DATA), "--key", "test", "--limit", "8", "--workers", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("npu: note: Ray is not installed") and "in this process" in captured.out


def test_eval_command_table_and_json(serial, capsys):
    args = ["eval", str(MODEL), "--data", str(DATA), "--key", "test", "--labels", "test_labels", "--limit",
            str(SAMPLES), "--workers", "0"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert serial.top1 == serial.reference_top1 == 46 / 48  # two of the first 48 test digits are misread by both
    assert "top-1      95.83% (reference: 95.83%)" in table and "SQNR       exact" in table
    assert main([*args, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures == serial.to_dict() and figures["sqnr_db"] == "inf" and figures["samples"] == SAMPLES


@pytest.mark.parametrize("extra, message", [
    (["--data", "missing.npz", "--key", "test"], "cannot read data missing.npz"),
    (["--data", str(DATA)], "say which array is the input with --key"),
    (["--data", str(DATA), "--key", "nope"], "has no array 'nope'"),
    (["--data", str(DATA), "--key", "test", "--labels", "calibration_labels"], "hold 100 classes for 400 samples"),
    (["--data", str(DATA), "--key", "test", "--labels", "calibration"], "one integer class per sample"),
    (["--data", str(DATA), "--key", "test", "--labels", "test"], "cannot be both the input and the labels"),
    (["--data", str(DATA), "--key", "test", "--reference", "onnxruntime"], "runs .onnx models"),
    (["--data", str(DATA), "--key", "test", "--preset", "npu-9"], "unknown NPU preset 'npu-9'"),
    (["--data", str(DATA), "--key", "test", "--shard-size", "0"], "shard size must be a positive integer"),
    (["--data", str(DATA), "--key", "test", "--workers", "-1"], "workers must be a non-negative integer"),
])
def test_bad_input_is_one_line_and_exit_2(extra, message, capsys):
    assert main(["eval", str(MODEL), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("npu: error: ") and message in err[0]


def test_data_that_does_not_fit_the_model_is_refused(tmp_path):
    int8_model = FIXTURES / "tflite" / "conv2d_3x3_s2_same_relu.tflite"
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 8, 8, 1), np.float32), wide=np.full((2, 1, 12, 12, 8), 300))
    with pytest.raises(NpuError, match=r"shape \[4, 8, 8, 1\]; the model's input .* is \[1, 12, 12, 8\]"):
        npu_backend.evaluate(int8_model, tmp_path / "d.npz", key="x", workers=0)
    with pytest.raises(NpuError, match="values outside int8"):
        npu_backend.evaluate(int8_model, tmp_path / "d.npz", key="wide", workers=0)
    with pytest.raises(NpuError, match="is float32 but the model's input .* is int8"):
        npu_backend.evaluate(int8_model, {"x": np.zeros((2, 12, 12, 8), np.float32)}, workers=0)


def test_batch_of_samples_with_or_without_the_batch_axis(serial):
    images = np.load(DATA)["test"][:8]
    flat = npu_backend.evaluate(MODEL, images, workers=0, reference="none")
    batched = npu_backend.evaluate(MODEL, images[:, None], workers=0, reference="none")
    assert flat == batched and flat.records["digest"] == serial.records["digest"][:8]


def test_compile_is_cached_per_process(monkeypatch):
    """A process compiles a model once for every later shard (what each Ray worker relies on)."""
    _evaluate(limit=8)
    calls = []
    monkeypatch.setattr(npu_backend.partition, "partition_for_npu", lambda *a: calls.append(a))
    assert _evaluate(limit=16).samples == 16 and calls == []


def test_quantized_model_is_scored_against_the_float_model_it_came_from(tmp_path):
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    from npu_backend.quantization import calibrate
    from npu_backend.quantization.stored import save_quantized

    data = np.load(DATA)
    float_model = DIGITS / "cnn_float.tflite"
    calibrated = calibrate(npu_backend.load_model(float_model), data["calibration"][:20])
    save_quantized(calibrated, float_model, tmp_path / "cnn.npuq")
    settings = dict(key="test", labels="test_labels", limit=16, workers=0)
    against_tvm = npu_backend.evaluate(tmp_path / "cnn.npuq", DATA, **settings)
    against_tflite = npu_backend.evaluate(tmp_path / "cnn.npuq", DATA, reference="tflite", **settings)
    assert against_tvm.reference == "float" and against_tflite.reference == "tflite"
    assert against_tvm.records["digest"] == against_tflite.records["digest"]
    images = data["test"][:16]
    quantized = np.concatenate([out[0] for out in calibrated.simulate(images)])  # the NPU's outputs, bit for bit
    interpreter = Interpreter(model_path=str(float_model), experimental_op_resolver_type=OpResolverType.BUILTIN_REF)
    interpreter.allocate_tensors()
    floats = []
    for image in images:
        interpreter.set_tensor(interpreter.get_input_details()[0]["index"], image[None])
        interpreter.invoke()
        floats.append(interpreter.get_tensor(interpreter.get_output_details()[0]["index"])[0])
    floats = np.array(floats, np.float64)
    expected = 10 * np.log10(np.sum(floats ** 2) / np.sum((floats - quantized) ** 2))
    assert against_tflite.sqnr_db == pytest.approx(expected, rel=1e-9)
    assert against_tflite.records["top1"] == tuple(np.argmax(quantized, axis=1))
    assert against_tvm.sqnr_db == pytest.approx(expected, abs=0.01)  # TVM's float build ~ TFLite's float kernels
