"""npu_backend.profile(): every NPU call inside the context is recorded, and the figures add up."""

import numpy as np
import tvm
from tvm import relax

import npu_backend
from simulator.opcodes import Engine
from conftest import FIXTURES

MODEL = FIXTURES / "tflite" / "depthwise_3x3_s1_same_relu6.tflite"


def test_profile_collects_every_call_and_totals_add_up():
    vm = relax.VirtualMachine(npu_backend.build(npu_backend.load_tflite(MODEL)), tvm.cpu())
    x = tvm.runtime.tensor(np.load(MODEL.with_suffix(".npz"))["inputs"][0])
    with npu_backend.profile() as outer:
        vm["main"](x)
        with npu_backend.profile() as inner:
            vm["main"](x)
    vm["main"](x)  # outside both: not recorded
    assert len(outer.runs) == 2 and len(inner.runs) == 1
    assert outer.total_cycles == 2 * inner.total_cycles > 0
    layers = inner.layers()
    assert [layer for _, layer, _ in layers] == ["depthwise_conv2d_0"]
    # A layer's cycles are its commands' (busy) cycles; the call's are its makespan, where DMA and compute overlap.
    assert sum(row["cycles"] for _, _, row in layers) == sum(map(inner.busy_cycles, Engine)) >= inner.total_cycles
    assert inner.layer_table()[0].span == inner.total_cycles  # the region's one layer spans the whole call
    assert inner.total_macs == 12 * 12 * 16 * 3 * 3
    summary = inner.summary()
    assert "depthwise_conv2d_0" in summary and f"{inner.total_cycles} cycles" in summary
