"""The runtime module relax.ext.npu returns carries its command streams: export_library, then load_module in
a fresh process, runs bit-exactly with npu_backend as the driver and nothing compiled again."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from conftest import FIXTURES
from npu_backend.codegen import lower_module
from npu_backend.codegen.embed import embed_streams
from simulator.stream import encode_stream

MODEL = FIXTURES / "tflite" / "resnet_small_32.tflite"

RUN_EXPORTED = """
import sys
import numpy as np
import tvm
from tvm import relax
import npu_backend
golden = np.load(sys.argv[2])
vm = relax.VirtualMachine(tvm.runtime.load_module(sys.argv[1]), tvm.cpu())
with npu_backend.profile() as prof:
    outputs = [vm["main"](tvm.runtime.tensor(x)).numpy() for x in golden["inputs"]]
np.save(sys.argv[3], np.stack(outputs))
print(len(prof.runs), prof.total_cycles)
"""


def _run_exported(library, golden, out, script=RUN_EXPORTED):
    return subprocess.run([sys.executable, "-c", script, str(library), str(golden), str(out)], capture_output=True,
                          text=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    partitioned = npu_backend.partition_for_npu(npu_backend.load_model(MODEL))
    generated = relax.transform.RunCodegen()(partitioned)
    relax.analysis.well_formed(generated)
    library = tmp_path_factory.mktemp("export") / "model.so"
    tvm.compile(generated, target="llvm").export_library(str(library))
    return partitioned, library


def test_a_fresh_process_runs_the_exported_library_bit_exact(exported, tmp_path):
    partitioned, library = exported
    golden = MODEL.with_suffix(".npz")
    result = _run_exported(library, golden, tmp_path / "y.npy")
    assert result.returncode == 0, result.stderr
    runs, cycles = map(int, result.stdout.split())
    expected = np.load(golden)
    assert runs == len(expected["inputs"]) * len(npu_backend.codegen.npu_regions(partitioned)) and cycles > 0
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), expected["outputs"])


def test_without_the_driver_the_library_says_what_is_missing(exported, tmp_path):
    _, library = exported
    without_driver = RUN_EXPORTED.replace("import npu_backend", "").replace("with npu_backend.profile() as prof:",
                                                                           "if True:")
    result = _run_exported(library, MODEL.with_suffix(".npz"), tmp_path / "y.npy", without_driver)
    assert result.returncode != 0
    assert "no NPU driver in this process: import npu_backend" in result.stderr


def test_a_damaged_embedded_stream_is_refused_before_it_runs(exported, tmp_path):
    """One flipped byte inside a stream the library embeds: the driver's SHA-256 check refuses it."""
    partitioned, library = exported
    data = library.read_bytes()
    (stream,) = [encode_stream(s) for s in lower_module(partitioned).values()]
    at = data.index(stream) + len(stream) // 2
    damaged = tmp_path / "damaged.so"
    damaged.write_bytes(data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:])
    result = _run_exported(damaged, MODEL.with_suffix(".npz"), tmp_path / "y.npy")
    assert result.returncode != 0
    assert "the embedded command stream does not match its SHA-256: the library is damaged" in result.stderr


def test_the_codegen_returns_one_c_module_with_a_function_per_region(exported):
    partitioned, _ = exported
    generated = relax.transform.RunCodegen()(partitioned)
    (module,) = generated.attrs["external_mods"]
    assert module.kind == "c" and module.is_binary_serializable()
    source = module.inspect_source()
    for symbol in npu_backend.codegen.npu_regions(partitioned):
        assert f"int __tvm_ffi_{symbol}(" in source


def test_a_region_symbol_that_is_not_a_c_identifier_is_refused():
    with pytest.raises(npu_backend.InternalError, match="is not a C identifier"):
        embed_streams({"npu-region": b"\0"}, 2)
