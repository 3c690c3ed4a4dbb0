"""Calibration keeps an NCHW model's tensors channels last between layers that work so (quantization/storage.py):
which tensors, and that keeping them changes no decision and no integer the quantized model computes."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from npu_backend import QConfig
from npu_backend.quantization import calibrate, storage
from npu_backend.quantization.integer_sums import IntegerSums
from npu_backend.quantization.layers import cut_layers, function_outputs, resolve
from npu_backend.quantization.steps import FloatLayers

RNG = np.random.default_rng(8)
calibrate_module = sys.modules["npu_backend.quantization.calibrate"]  # the package's calibrate() shadows its name


def _conv(bb, x, cin, cout, k=1, groups=1, clip=True):
    w = relax.const(RNG.normal(0, 0.4, (cout, cin // groups, k, k)).astype(np.float32))
    y = bb.emit(relax.op.nn.conv2d(x, w, padding=[k // 2] * 4, groups=groups, data_layout="NCHW",
                                   kernel_layout="OIHW"))
    y = bb.emit(relax.op.add(y, relax.const(RNG.normal(0, 0.1, (1, cout, 1, 1)).astype(np.float32))))
    return bb.emit(relax.op.clip(y, 0, 6)) if clip else y


def nchw_block(skip_from_input: bool = False) -> tvm.IRModule:
    """x -> 1x1 -> depthwise -> 1x1 (y); x -> 1x1 (r); y + r (or y + x) -> 1x1 -> global mean: ONNX's layout."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 6, 6), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = _conv(bb, x, 4, 8)
            y = _conv(bb, y, 8, 8, k=3, groups=8)
            y = _conv(bb, y, 8, 4, clip=False)
            r = x if skip_from_input else _conv(bb, x, 4, 4, clip=False)
            s = bb.emit(relax.op.add(y, r))
            z = _conv(bb, s, 4, 6)
            out = bb.emit_output(bb.emit(relax.op.mean(z, axis=[2, 3])))
        bb.emit_func_output(out)
    return bb.get()


def _kept_layers(mod):
    func = mod["main"]
    layers, folded = cut_layers(func)
    floats = FloatLayers(layers, folded)
    kept = storage.channels_last_vars(layers, floats.plans, floats.elementwise,
                                      [resolve(v, folded) for v in function_outputs(func)])
    return [layer.name for layer in layers if layer.output in kept], [layer.name for layer in layers]


def test_tensors_between_flexible_layers_are_kept_channels_last():
    kept, names = _kept_layers(nchw_block())
    # the three convolutions of the branch, the residual's, and the add; not the conv feeding the mean, nor the mean
    assert names == ["conv2d_0", "conv2d_1", "conv2d_2", "conv2d_3", "add_4", "conv2d_5", "mean_6"]
    assert kept == ["conv2d_0", "conv2d_1", "conv2d_2", "conv2d_3", "add_4"]


def test_an_add_of_a_model_input_keeps_its_operands_in_the_models_layout():
    kept, names = _kept_layers(nchw_block(skip_from_input=True))
    assert names == ["conv2d_0", "conv2d_1", "conv2d_2", "add_3", "conv2d_4", "mean_5"]
    assert kept == ["conv2d_0", "conv2d_1"]  # the add reads x (the model's input): it and its operands are not


@pytest.mark.parametrize("config", [QConfig(), QConfig(calibration="percentile", accumulator_bits=16),
                                    QConfig(calibration="kl"), "no integer sums"],
                         ids=["default", "percentile-acc16", "kl", "no-integer-sums"])
def test_keeping_tensors_channels_last_changes_no_decision(config, monkeypatch):
    if config == "no integer sums":  # every layer's sums past float32's exact range: the float observation and the
        # simulated stream, which take the model's layout, converted from and to the kept one
        monkeypatch.setattr(calibrate_module, "FLOAT32_EXACT", 0)
        monkeypatch.setattr(IntegerSums, "__init__", lambda *args: pytest.fail("integer sums formed"))
        config = QConfig()
    mod = nchw_block()
    samples = RNG.normal(0, 1, (12, 4, 6, 6)).astype(np.float32)
    test = RNG.normal(0, 1, (5, 4, 6, 6)).astype(np.float32)
    kept = calibrate(mod, samples, config)
    assert kept._ctx.kept  # the path under test is taken
    with monkeypatch.context() as m:
        m.setattr(storage, "channels_last_vars", lambda *args: frozenset())
        model_layout = calibrate(mod, samples, config)
        assert not model_layout._ctx.kept
    assert list(kept._plan.tensors.values()) == list(model_layout._plan.tensors.values())
    assert {i: (w.weight.tobytes(), w.bias.tobytes()) for i, w in kept._plan.weights.items()} == {
        i: (w.weight.tobytes(), w.bias.tobytes()) for i, w in model_layout._plan.weights.items()}
    for a, b in zip(kept.simulate(test), model_layout.simulate(test)):
        assert a[0].tobytes() == b[0].tobytes()
    for a, b in zip(kept.report.layers, model_layout.report.layers):
        assert a.sqnr_db == pytest.approx(b.sqnr_db, rel=1e-6)  # the float model's sums, in another order
        assert (a.accumulator_peak, a.overflows) == (b.accumulator_peak, b.overflows)


@pytest.mark.parametrize("config", [QConfig(), QConfig(rounding="onnxruntime", calibration="percentile"),
                                    QConfig(accumulator_bits=16, accumulator_overflow="saturate")],
                         ids=["default", "onnxruntime-percentile", "acc16-saturate"])
def test_the_partitioned_module_equals_the_simulation_with_tensors_kept(config):
    # every layer on the NPU: the simulation is the module's integers, whatever layout the walk kept
    calibrated = calibrate(nchw_block(), RNG.normal(0, 1, (12, 4, 6, 6)).astype(np.float32), config)
    assert calibrated._ctx.kept
    test = RNG.normal(0, 1, (4, 1, 4, 6, 6)).astype(np.float32)
    partitioned = npu_backend.partition_for_npu(calibrated.module, calibrated.npu_config)
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm"), tvm.cpu())
    for x, simulated in zip(test, calibrated.simulate(test[:, 0])):
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), simulated[0])
