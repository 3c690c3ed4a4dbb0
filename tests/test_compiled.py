"""npu compile writes a directory a fresh process can run whole: streams, the model and a manifest."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
import tvm
from onnx import TensorProto, helper, numpy_helper
from tvm import relax

import npu_backend
from conftest import FIXTURES
from npu_backend.cli import main
from simulator.isa import FORMAT_VERSION


def _qdq(nodes, inits, name, scale, zero_point, src):
    """QuantizeLinear -> DequantizeLinear of ``src`` (per tensor, int8), as quantize_static writes it."""
    inits += [numpy_helper.from_array(np.array(scale, np.float32), f"{name}_s"),
              numpy_helper.from_array(np.array(zero_point, np.int8), f"{name}_z")]
    nodes += [helper.make_node("QuantizeLinear", [src, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
              helper.make_node("DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_dq"])]
    return f"{name}_dq"


def _conv(nodes, inits, name, src, rng, channels=4):
    w = rng.integers(-100, 100, (channels, channels, 3, 3)).astype(np.int8)
    w_scale = np.float32(0.01)
    inits += [numpy_helper.from_array(w, f"{name}_w"), numpy_helper.from_array(np.array(w_scale), f"{name}_ws"),
              numpy_helper.from_array(np.array(0, np.int8), f"{name}_wz")]
    nodes.append(helper.make_node("DequantizeLinear", [f"{name}_w", f"{name}_ws", f"{name}_wz"], [f"{name}_wdq"]))
    nodes.append(helper.make_node("Conv", [src, f"{name}_wdq"], [f"{name}_y"], pads=[1, 1, 1, 1]))
    return f"{name}_y"


def two_region_model(path):
    """conv -> softmax over channels (host: onnxruntime's float softmax) -> conv, in QDQ form."""
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    x = _qdq(nodes, inits, "x", 0.02, 3, "input")
    y = _qdq(nodes, inits, "y", 0.1, -5, _conv(nodes, inits, "c1", x, rng))
    nodes.append(helper.make_node("Softmax", [y], ["sm"], axis=1))
    s = _qdq(nodes, inits, "s", 1 / 256, -128, "sm")
    z = _qdq(nodes, inits, "z", 0.05, 0, _conv(nodes, inits, "c2", s, rng))
    nodes.append(helper.make_node("Identity", [z], ["output"]))
    graph = helper.make_graph(nodes, "two_regions", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                                  [1, 4, 6, 6])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 4, 6, 6])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("compiled")
    model = two_region_model(root / "two_regions.onnx")
    assert main(["compile", str(model), "-o", str(root / "out")]) == 0
    return model, root / "out"


def test_the_manifest_lists_the_regions_in_call_order(compiled):
    model, out = compiled
    manifest = json.loads((out / "manifest.json").read_text())
    assert [t["name"] for t in manifest["inputs"]] == ["input"] and manifest["numerics"] == "onnxruntime"
    assert manifest["inputs"][0]["scale"] == pytest.approx(0.02) and manifest["inputs"][0]["zero_point"] == 3
    first, second = manifest["regions"]
    assert [r["symbol"] for r in manifest["regions"]] == [r["file"][:-len(".npucmd")] for r in manifest["regions"]]
    assert (first["inputs"][0]["dtype"], first["inputs"][0]["zero_point"]) == ("int8", 3)
    assert (first["outputs"][0]["scale"], first["outputs"][0]["zero_point"]) == (pytest.approx(0.1), -5)
    assert (second["inputs"][0]["scale"], second["inputs"][0]["zero_point"]) == (pytest.approx(1 / 256), -128)
    assert manifest["hardware"] == json.loads(npu_backend.get_config("npu-256").to_json())
    assert manifest["format_version"] == list(FORMAT_VERSION) and manifest["model"]["file"] == "two_regions.onnx"
    assert manifest["library"]["file"] == "model.so" and not (out / "two_regions.onnx").exists()


def test_a_fresh_process_runs_the_directory_exactly(compiled, tmp_path):
    """npu sim DIR in a new process (the exported library: nothing lowered or compiled) equals the in-process
    build."""
    model, out = compiled
    x = (np.random.default_rng(1).integers(-128, 128, (1, 4, 6, 6)) - 3).astype(np.float32) * np.float32(0.02)
    np.save(tmp_path / "x.npy", x)
    result = subprocess.run([sys.executable, "-m", "npu_backend.cli", "sim", str(out), "--input",
                             f"input={tmp_path / 'x.npy'}", "--output", str(tmp_path / "y.npz")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("npu_npu_256_") >= 2  # both regions ran on the simulator
    vm = relax.VirtualMachine(npu_backend.build(npu_backend.load_model(model)), tvm.cpu())
    (got,) = np.load(tmp_path / "y.npz").values()
    np.testing.assert_array_equal(got, vm["main"](tvm.runtime.tensor(x)).numpy())


def test_a_tflite_model_runs_from_its_directory_bit_exact(tmp_path, capsys):
    out = tmp_path / "mnv2"
    model = FIXTURES / "tflite" / "mobilenet_v2_035_96.tflite"
    assert main(["compile", str(model), "-o", str(out)]) == 0
    golden = np.load(model.with_suffix(".npz"))
    from npu_backend.compiled import run_compiled

    (name,) = [t["name"] for t in json.loads((out / "manifest.json").read_text())["inputs"]]
    (got,) = run_compiled(out, {name: golden["inputs"][0]}).values()
    np.testing.assert_array_equal(got, golden["outputs"][0])


@pytest.mark.parametrize("damage, message", [
    (lambda out: (out / next(p.name for p in out.glob("*.npucmd"))).write_bytes(b"NPUS" + b"\0" * 60),
     "does not match the manifest's SHA-256"),
    (lambda out: (out / "manifest.json").write_text("{"), "manifest.json is not valid JSON"),
    (lambda out: (out / "model.so").write_bytes(b"\0"), "model.so does not match the manifest"),
])
def test_a_damaged_directory_is_one_error_line(compiled, tmp_path, capsys, damage, message):
    import shutil

    model, out = compiled
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    damage(copy)
    assert main(["sim", str(copy), "--random-inputs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("npu: error:") and message in err[0]
