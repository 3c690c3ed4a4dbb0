"""MAC layers' NPU records predicted by calibration (npu_backend.quantization.predicted): equal to their builds,
checked against them, and a refuted prediction never reaches the result."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import tvm

from float_models import float_cnn, float_conv_block, float_two_branches
from npu_backend import QConfig
from npu_backend.canonicalize import quantized_activation
from npu_backend.errors import NpuWarning
from npu_backend.quantization import calibrate
from npu_backend.quantization.predicted import PredictedElementwise, PredictedLayer, difference

calibrate_module = __import__("npu_backend.quantization.calibrate", fromlist=["predict"])
RNG = np.random.default_rng(5)
CALIBRATION = RNG.random((12, 8, 8, 1)).astype(np.float32)
TEST = RNG.random((4, 8, 8, 1)).astype(np.float32)


@pytest.mark.parametrize("low, top, scale, zero_point, expected", [
    (0.0, math.inf, 0.05, -128, (-128, 127)),  # ReLU: the zero point up
    (0.0, 6.0, 0.1, 0, (0, 60)),  # f32(6) / f32(0.1) = 59.999998...: rounds to 60
    (0.0, 6.0, 0.01, 0, (0, 127)),  # past the int8 range: saturates
    (0.0, 6.0, 0.1, -200, (-128, -128)),  # a zero point below int8: both bounds clamp
    (0.0, 1.25, 0.5, 0, None),  # 2.5 exactly: a tie, which each rounding settles its own way
    (-1.0, 1.0, 0.1, 0, None),  # a lower bound other than 0 stays a float op
])
def test_the_float_activation_becomes_the_int8_clamp_of_its_rule(low, top, scale, zero_point, expected):
    assert quantized_activation(low, top, scale, zero_point) == expected


def _summary(calibrated):
    plan = calibrated._plan
    weights = {i: (w.weight.tobytes(), None if w.bias is None else w.bias.tobytes(), w.scales.tobytes())
               for i, w in plan.weights.items()}
    outputs = [out[0].tobytes() for out in calibrated.simulate(TEST)]
    return calibrated.report.to_json(), weights, list(plan.tensors.values()), outputs


def _calibrate(config=None):
    with warnings.catch_warnings():
        warnings.simplefilter("error", NpuWarning)
        return calibrate(float_cnn(), CALIBRATION, config)


@pytest.mark.parametrize("config", [QConfig(), QConfig(rounding="onnxruntime", per_channel=False, weight_bits=4)],
                         ids=["default", "onnxruntime-per-tensor-4bit"])
def test_every_mac_and_elementwise_layer_is_predicted_and_its_build_agrees(config):
    calibrated = _calibrate(config)
    ctx = calibrated._ctx
    macs = [layer for layer in ctx.layers if layer.kind.name in ("conv2d", "matmul")]
    assert macs and ctx.predicting
    for layer in macs:
        npu = ctx.npu_cache[layer.index]
        assert isinstance(npu, PredictedLayer) and npu.verified, layer.name
        assert difference(npu.mac, npu.built().mac) is None
    binary = [layer for layer in ctx.layers if layer.kind.name in ("add", "subtract", "multiply")
              and not layer.constants and len({str(v.ty.shape) for v in (*layer.inputs, layer.output)}) == 1]
    assert [layer.name for layer in binary] == ["add_2"]  # the residual add; not the squeeze-excite's broadcast
    for layer in binary:  # two computed operands of one shape: predicted too, outputs from the pair table
        npu = ctx.npu_cache[layer.index]
        assert isinstance(npu, PredictedElementwise) and npu.verified, layer.name
        shape = npu.record.params.shape
        a, b = (RNG.integers(-128, 128, (3, *shape)).astype(np.int8) for _ in range(2))
        got, want = npu.run_batch([a, b]), npu.built().run_batch([a, b])  # the table, the stream simulated
        assert got[0].tobytes() == want[0].tobytes() and got[1] == want[1] == 0
    others = [npu for i, npu in ctx.npu_cache.items() if ctx.layers[i] not in macs + binary]
    assert others and not any(isinstance(npu, PredictedLayer) for npu in others)


def test_a_difference_names_the_first_field_that_differs():
    calibrated = _calibrate()
    npu = next(n for n in calibrated._ctx.npu_cache.values() if isinstance(n, PredictedLayer))
    mac = npu.built().mac
    assert difference(mac, mac) is None
    assert difference(mac, None) == "the build is not one MAC layer"
    params = mac.params
    shifted = dataclasses.replace(mac, params=dataclasses.replace(params,
                                                                  output_zero_point=params.output_zero_point + 1))
    assert difference(shifted, mac).startswith("params.output_zero_point:")
    wider = dataclasses.replace(mac, params=dataclasses.replace(params, bias=params.bias.astype(np.int64)))
    assert difference(wider, mac) == f"params.bias: int64{list(params.bias.shape)} against int32" \
                                     f"{list(params.bias.shape)} built"
    retyped = dataclasses.replace(mac, params=dataclasses.replace(params, input_zero_point=np.int64(
        params.input_zero_point)))
    assert difference(retyped, mac).startswith("params.input_zero_point:")  # the same value, another type
    table = mac.table.copy()
    table.reshape(-1)[0] += 1
    assert difference(dataclasses.replace(mac, table=table), mac).startswith("table:")


def _output_zero_point_one_off(predict):
    """``predict`` whose records have their output zero point one off: a rule the prediction got wrong."""
    def wrong(*args):
        record = predict(*args)
        if record is None:
            return None
        params = record.params
        return dataclasses.replace(record, params=dataclasses.replace(params,
                                                                      output_zero_point=params.output_zero_point + 1))
    return wrong


def test_a_refuted_prediction_calibrates_again_with_every_layer_built(monkeypatch):
    expected = _summary(_calibrate())
    monkeypatch.setattr(calibrate_module, "predict", _output_zero_point_one_off(calibrate_module.predict))
    with pytest.warns(NpuWarning, match="differs from calibration's prediction .*params.output_zero_point.*again"):
        refuted = calibrate(float_cnn(), CALIBRATION)
    assert not refuted._ctx.predicting
    assert not any(isinstance(n, PredictedLayer) for n in refuted._ctx.npu_cache.values())
    assert _summary(refuted) == expected
    monkeypatch.setattr(calibrate_module, "predict", lambda *args: None)
    monkeypatch.setattr(calibrate_module, "predict_elementwise", lambda *args: None)
    built = _calibrate()  # no prediction at all: every layer built on the walk, as before predictions
    assert _summary(built) == expected
    tvm.ir.assert_structural_equal(built.module["main"], refuted.module["main"])


def test_a_refuted_elementwise_prediction_calibrates_again(monkeypatch):
    """An add's predicted record that its build does not give (here its output zero point, one off) is caught
    beside the walk, and calibration walks again with the add built: the same model as without predictions."""
    expected = _summary(_calibrate())
    monkeypatch.setattr(calibrate_module, "predict_elementwise",
                        _output_zero_point_one_off(calibrate_module.predict_elementwise))
    with pytest.warns(NpuWarning, match="layer add_.* differs from calibration's prediction .*output_zero_point"):
        refuted = calibrate(float_cnn(), CALIBRATION)
    assert not refuted._ctx.predicting
    assert _summary(refuted) == expected


def test_a_failed_batch_build_is_a_refutation_not_an_error(monkeypatch):
    """A batch that fails to build (a layer its module cannot take) says nothing of any one layer: calibration
    builds them one by one on the walk instead, which gives the layer's own answer."""
    expected = _summary(_calibrate())

    def broken(specs, source, config):
        raise RuntimeError("no partition today")

    monkeypatch.setattr(calibrate_module, "built_records", broken)
    with pytest.warns(NpuWarning, match="their build together failed: no partition today"):
        refuted = calibrate(float_cnn(), CALIBRATION)
    assert _summary(refuted) == expected


def test_a_predicted_layer_runs_its_build_where_the_sums_cannot(monkeypatch):
    """Where a sample's sums could leave float32's exact range the layer runs on its stream: a predicted layer
    then builds itself, and gives what its sums gave."""
    calibrated = _calibrate()
    expected = [out[0].tobytes() for out in calibrated.simulate(TEST)]
    predicted = [n for n in calibrated._ctx.npu_cache.values()
                 if isinstance(n, PredictedLayer) and n.mac is not None]
    assert predicted and all(n._built is None for n in predicted)
    monkeypatch.setattr(calibrate_module, "_integer_sums", lambda *args, **kwargs: None)
    assert [out[0].tobytes() for out in calibrated.simulate(TEST)] == expected
    assert all(n._built is not None and n._built.stream is not None for n in predicted)


@pytest.mark.parametrize("kernel_layout, groups, placement", [
    ("HWIO", 1, "npu"), ("HWOI", 8, "npu"),  # the composites' own layouts
    ("OHWI", 1, "host int8"), ("HWOI", 1, "host int8"), ("HWIO", 8, "host int8"), ("OHWI", 8, "host int8")])
def test_a_kernel_layout_the_composite_does_not_take_is_not_predicted(kernel_layout, groups, placement):
    """An NHWC convolution whose kernel layout is not the composite's (HWIO; HWOI for depthwise) stays on the host:
    predicting a MAC record for it was refuted by its build, and calibration walked again with every layer built
    (60% of such layers in a robustness sweep). The prediction now declines them, as the partitioner does."""
    rng = np.random.default_rng(0)
    mod = float_conv_block(rng, "NHWC", kernel_layout, groups, (1, 6, 6, 8), 8, k=3)
    data = rng.normal(size=(6, 6, 6, 8)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NpuWarning)  # no refuted prediction
        calibrated = calibrate(mod, data, QConfig())
    assert [layer.placement for layer in calibrated.report.layers] == [placement]


@pytest.mark.parametrize("kind, layout, clamp, rounding", [
    ("subtract", "NHWC", None, "tflite"), ("subtract", "NCHW", (0.0, 6.0), "onnxruntime"),
    ("add", "NCHW", (0.0, math.inf), "tflite"), ("multiply", "NHWC", (0.0, 6.0), "onnxruntime")])
def test_an_elementwise_prediction_is_what_the_layer_built_on_the_walk_gives(kind, layout, clamp, rounding):
    """Two branches of different scales into a subtract (whose operands do not commute), an add or a multiply,
    fused clamp or none, either layout (an NCHW model's tensors kept channels last), either rounding: the layer is
    predicted, its build agrees, and the calibrated model is the one calibrated with the layer built on the walk."""
    module = float_two_branches(np.random.default_rng(3), kind, layout, clamp)
    shape = [int(d) for d in module["main"].params[0].ty.shape.values]
    data = np.random.default_rng(4).normal(0, 1, (10, *shape[1:])).astype(np.float32)
    config = QConfig(rounding=rounding)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NpuWarning)
        predicted = calibrate(module, data, config)
    layer = next(layer for layer in predicted._ctx.layers if layer.kind.name == kind)
    npu = predicted._ctx.npu_cache[layer.index]
    assert isinstance(npu, PredictedElementwise) and npu.verified
    assert npu.record.params.input_scale != npu.record.params.input2_scale
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibrate_module, "predict_elementwise", lambda *args: None)
        built = calibrate(module, data, config)
    assert not isinstance(built._ctx.npu_cache[layer.index], PredictedLayer)
    test = data[:3] * 1.5
    assert predicted.report.to_json() == built.report.to_json()
    assert [o[0].tobytes() for o in predicted.simulate(test)] == [o[0].tobytes() for o in built.simulate(test)]
