"""End to end on TFLite fixtures: TVM import -> partition -> codegen -> VM + simulator.

Every output element must equal TFLite's reference kernels (BUILTIN_REF; for ELU,
which BUILTIN_REF lacks, TFLite's builtin kernel without delegates), whose
outputs the fixture script stored next to each model; and every operator of
each model must have been offloaded (none of these models holds anything the
NPU cannot run). The models include those only npu_backend's extended importer
accepts (quantized PAD, STRIDED_SLICE, GELU, ELU, RESIZE_NEAREST_NEIGHBOR, BATCH_MATMUL), and RESIZE_BILINEAR,
whose TVM host lowering differs from TFLite (1725 of 32768 elements, scripts/make_tflite_fixtures.py) but
whose NPU kernel is TFLite's integer one. The 16x8 CONV_2D (int16 activations, int64 bias) runs on the NPU's
16x8 convolution; TVM's host build of it differs from TFLite on 582 of 8192 elements.
"""

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from conftest import FIXTURES, tflite_manifest


def model_inputs(golden) -> list:
    """The stacked samples of each model input, in order: ``inputs``, then ``inputs1``, ``inputs2``, ..."""
    extra = sorted((k for k in golden.files if k.startswith("inputs") and k != "inputs"), key=lambda k: int(k[6:]))
    return [golden["inputs"], *(golden[k] for k in extra)]


@pytest.mark.parametrize("entry", tflite_manifest(), ids=lambda e: e["name"])
def test_model_is_offloaded_and_bit_exact(entry):
    model = FIXTURES / "tflite" / entry["file"]
    golden = np.load(model.with_suffix(".npz"))
    partitioned = npu_backend.partition_for_npu(npu_backend.load_tflite(model))
    report = npu_backend.partition_report(partitioned)
    assert report.npu_ops and not report.host_ops, report.format_table()
    relax.analysis.well_formed(partitioned)  # raises on ill-formed IR
    generated = relax.transform.RunCodegen()(partitioned)
    relax.analysis.well_formed(generated)
    vm = relax.VirtualMachine(tvm.compile(generated, target="llvm"), tvm.cpu())
    assert len(golden["inputs"]) >= 8
    for sample, expected in zip(zip(*model_inputs(golden)), golden["outputs"]):
        with npu_backend.profile() as prof:
            got = vm["main"](*[tvm.runtime.tensor(x) for x in sample]).numpy()
        assert prof.runs and prof.total_cycles > 0, "nothing ran on the NPU"
        mismatched = int(np.count_nonzero(got != expected))
        assert mismatched == 0, f"{mismatched} of {got.size} elements differ from TFLite BUILTIN_REF"
