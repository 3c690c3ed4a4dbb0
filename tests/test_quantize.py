"""Post-training quantization: the canonical QDQ form it emits, its configuration, and that the NPU computes
exactly what calibration simulated."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from float_models import float_cnn, float_conv_block, float_dense_chain
from npu_backend import NpuError, QConfig
from npu_backend.errors import NpuWarning
from npu_backend.quantization import calibrate, calibration_samples, quantization_report

RNG = np.random.default_rng(7)
CALIBRATION = RNG.random((12, 8, 8, 1)).astype(np.float32)
TEST = RNG.random((6, 8, 8, 1)).astype(np.float32)


def _run_partitioned(qmod, inputs, preset=npu_backend.DEFAULT_PRESET):
    partitioned = npu_backend.partition_for_npu(qmod, preset)
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm"), tvm.cpu())
    return partitioned, [vm["main"](tvm.runtime.tensor(x[None])).numpy() for x in inputs]


def _calls(mod, op_name):
    return [b.value for block in mod["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and getattr(b.value.op, "name", "") == op_name]


@pytest.fixture(scope="module")
def cnn():
    return calibrate(float_cnn(), CALIBRATION)


@pytest.mark.parametrize("rounding", ["tflite", "onnxruntime"])
def test_every_layer_on_the_npu_and_bit_exact_with_the_simulation(rounding, cnn):
    calibrated = cnn if rounding == "tflite" else calibrate(float_cnn(), CALIBRATION, QConfig(rounding=rounding))
    partitioned, outputs = _run_partitioned(calibrated.module, TEST)
    report = npu_backend.partition_report(partitioned)
    assert report.numerics == ("tflite" if rounding == "tflite" else "onnxruntime")
    assert sorted({o.op for o in report.host_ops}) == ["relax.dequantize", "relax.quantize"]
    assert len(report.host_ops) == 2  # the model's entry quantize and exit dequantize
    composites = {o.composite for o in report.npu_ops}
    assert {"npu.conv2d", "npu.depthwise_conv2d", "npu.add", "npu.mean", "npu.sigmoid", "npu.multiply",
            "npu.hard_swish", "npu.avg_pool2d", "npu.reshape", "npu.fully_connected"} <= composites
    simulated = calibrated.simulate(TEST)
    for got, sim in zip(outputs, simulated):
        np.testing.assert_array_equal(got, sim[0])


def test_signature_stays_float_and_weights_are_per_channel_with_zero_point_zero(cnn):
    main = cnn.module["main"]
    assert [str(p.ty.dtype) for p in main.params] == ["float32"]
    assert str(main.body.body.ty.dtype) == "float32"
    weights = [c for c in _calls(cnn.module, "relax.dequantize") if str(c.args[0].ty.dtype) == "int8"
               and isinstance(c.args[0], tvm.ir.expr.Constant)]
    conv, depthwise, dense = weights
    for call, axis, channels in ((conv, 3, 4), (depthwise, 2, 4), (dense, 1, 10)):
        assert int(call.attrs.axis) == axis
        assert call.args[1].value.numpy().shape == (channels,)
        np.testing.assert_array_equal(call.args[2].value.numpy(), np.zeros(channels))
        q = call.args[0].value.numpy()
        assert q.min() >= -127 and q.max() <= 127
        assert np.all(np.abs(np.moveaxis(q, axis, 0)).reshape(channels, -1).max(axis=1) == 127)


def test_sigmoid_output_is_tflites_fixed_qparams(cnn):
    sigmoid = next(layer for layer in cnn.report.layers if layer.kind == "sigmoid")
    assert (sigmoid.output_scale, sigmoid.output_zero_point) == (1.0 / 256, -128)


def test_report_lists_every_layer_with_its_sqnr(cnn):
    report = quantization_report(cnn.module)
    assert [layer.name for layer in report.layers] == [
        "conv2d_0", "conv2d_1", "add_2", "mean_3", "sigmoid_4", "multiply_5", "hard_swish_6", "avg_pool2d_7",
        "reshape_8", "matmul_9"]
    assert all(layer.placement == "npu" for layer in report.layers)
    assert all(20.0 < layer.sqnr_db < 80.0 for layer in report.layers)
    assert report.output_sqnr_db == pytest.approx(report.layers[-1].sqnr_db)
    assert report.layers[0].accumulator_peak > 0
    assert report.total_overflows == 0
    text = report.to_table()
    assert "conv2d_0" in text and "output SQNR" in text
    assert quantization_report(cnn.module).to_json() == report.to_json()


def test_weight_bits_restrict_the_int8_range():
    calibrated = calibrate(float_cnn(), CALIBRATION, QConfig(weight_bits=4))
    for call in _calls(calibrated.module, "relax.dequantize"):
        if isinstance(call.args[0], tvm.ir.expr.Constant) and str(call.args[0].ty.dtype) == "int8":
            q = call.args[0].value.numpy()
            assert q.min() >= -7 and q.max() <= 7 and np.abs(q).max() == 7


def test_power_of_two_scales_everywhere():
    calibrated = calibrate(float_cnn(), CALIBRATION, QConfig(power_of_two=True, rounding="onnxruntime"))
    for call in _calls(calibrated.module, "relax.quantize") + _calls(calibrated.module, "relax.dequantize"):
        if str(call.args[0].ty.dtype) == "int32":
            continue  # a bias scale is the product of two powers of two, so one too: checked below
        scales = call.args[1].value.numpy().reshape(-1)
        assert np.all(np.log2(scales) == np.round(np.log2(scales))), scales


def test_global_scale_puts_every_calibrated_activation_on_one_range():
    calibrated = calibrate(float_cnn(), CALIBRATION, QConfig(global_scale=8.0))
    calibrated_kinds = {"conv2d", "add", "mean", "multiply", "hard_swish", "matmul"}
    for layer in calibrated.report.layers:
        if layer.kind in calibrated_kinds:  # the old workflow's global scale: symmetric, [-g, g] on 127 steps
            assert (layer.output_scale, layer.output_zero_point) == (float(np.float32(8.0 / 127)), 0)
    assert {t.method for t in calibrated.report.tensors} == {"global_scale"}


def test_skip_layers_and_float_ops_stay_on_the_host_in_float():
    by_index = calibrate(float_cnn(), CALIBRATION, QConfig(skip_layers=(0,), float_ops=("sigmoid",)))
    placements = {layer.name: layer.placement for layer in by_index.report.layers}
    assert placements["conv2d_0"] == "float" and placements["sigmoid_4"] == "float"
    assert placements["conv2d_1"] == "npu"
    by_name = calibrate(float_cnn(), CALIBRATION, QConfig(skip_layers=("conv2d_0",)))
    assert by_name.report.layers[0].placement == "float"
    partitioned, outputs = _run_partitioned(by_index.module, TEST)
    host = {o.op for o in npu_backend.partition_report(partitioned).host_ops}
    assert {"relax.nn.conv2d", "relax.sigmoid"} <= host
    for got, sim in zip(outputs, by_index.simulate(TEST)):
        np.testing.assert_allclose(got, sim[0], rtol=0, atol=0)


@pytest.mark.parametrize("skip, message", [((99,), "index 99"), (("conv9",), "no layer named 'conv9'")])
def test_skip_layers_that_do_not_exist_are_refused(skip, message):
    with pytest.raises(NpuError, match=message):
        calibrate(float_cnn(), CALIBRATION, QConfig(skip_layers=skip))


def test_fallback_keeps_the_sensitive_layer_in_float():
    rng = np.random.default_rng(3)
    first = rng.normal(0, 0.2, (16, 16)).astype(np.float32)
    sensitive = rng.normal(0, 0.2, (16, 16)).astype(np.float32)
    first[:, 0] = 0.0  # the first layer's channel 0 is always 0 ...
    sensitive[0, :] = 200.0  # ... so these weights never matter in float, but per tensor every other weight rounds to 0
    last = rng.normal(0, 0.2, (16, 4)).astype(np.float32)
    mod = float_dense_chain([first, sensitive, last])
    data = rng.normal(0, 1, (16, 16)).astype(np.float32)
    base = calibrate(mod, data, QConfig(per_channel=False))
    fallback = calibrate(mod, data, QConfig(per_channel=False, fallback_budget_db=3.0))
    placements = [layer.placement for layer in fallback.report.layers]
    assert placements == ["npu", "float", "npu"]
    assert "float fall-back" in fallback.report.layers[1].note
    assert fallback.report.output_sqnr_db > base.report.output_sqnr_db + 3.0


def test_calibration_data_forms():
    params = float_cnn()["main"].params
    batch = calibration_samples(CALIBRATION[:3], params)
    as_list = calibration_samples([CALIBRATION[i:i + 1] for i in range(3)], params)
    as_dicts = calibration_samples(({"x": CALIBRATION[i:i + 1]} for i in range(3)), params)
    assert len(batch) == len(as_list) == len(as_dicts) == 3
    for a, b, c in zip(batch, as_list, as_dicts):
        assert a[0].shape == (1, 8, 8, 1)
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[0], c[0])


@pytest.mark.parametrize("data, message", [
    (np.zeros((2, 9, 8, 1), np.float32), r"has shape \(2, 9, 8, 1\); the model takes \(1, 8, 8, 1\)"),
    ([], "empty"),
    (np.full((1, 8, 8, 1), np.nan, np.float32), "NaN"),
    ({"y": np.zeros((1, 8, 8, 1), np.float32)}, "lacks input"),
    (3, "must be an array"),
])
def test_bad_calibration_data_is_refused(data, message):
    with pytest.raises(NpuError, match=message):
        calibrate(float_cnn(), data)


def test_an_already_quantized_model_is_refused(cnn):
    with pytest.raises(NpuError, match="already quantizes"):
        calibrate(cnn.module, CALIBRATION)


@pytest.mark.parametrize("field, value", [
    ("calibration", "median"), ("percentile", 40.0), ("percentile", 101.0), ("per_channel", 1),
    ("weight_bits", 1), ("weight_bits", 9), ("weight_bits", 8.0), ("rounding", "half_up"),
    ("accumulator_bits", 13), ("accumulator_bits", 33), ("accumulator_overflow", "clip"),
    ("global_scale", 0.0), ("global_scale", math.inf), ("skip_layers", [0]), ("skip_layers", (-1,)),
    ("float_ops", ("sigmoid", 3)), ("fallback_budget_db", -1.0), ("bins", 8), ("preset", 3),
    ("symmetric_activations", "yes"), ("power_of_two", None), ("avoid_overflow", 0), ("bias_correction", 1),
    ("float_reference", "no"), ("reference_samples", 0), ("reference_samples", 2.0), ("reference_samples", True),
])
def test_every_invalid_config_value_names_its_field(field, value):
    with pytest.raises(NpuError, match=rf"QConfig\.{field}:"):
        QConfig(**{field: value})


@pytest.mark.parametrize("field, value", [
    ("bias_correction", True), ("calibration", "kl"), ("weight_rounding", "least_squares"),
    ("fallback_budget_db", 1.0)])
def test_settings_that_read_the_float_model_are_refused_without_it(field, value):
    settings = {"float_reference": False, "bias_correction": False, field: value}
    with pytest.raises(NpuError, match=rf"QConfig\.{field}: .* needs the float model, and float_reference is False"):
        QConfig(**settings)


def test_without_the_float_reference_the_same_model_and_no_sqnr(cnn):
    """The float model's pass only measures (with bias correction off and minmax): skipping it changes no
    decision, and the report says it measured nothing rather than a number."""
    measured = calibrate(float_cnn(), CALIBRATION, QConfig(bias_correction=False))
    fast = calibrate(float_cnn(), CALIBRATION, QConfig(bias_correction=False, float_reference=False))
    tvm.ir.assert_structural_equal(fast.module.without_attr("npu.quantization_report"),
                                   measured.module.without_attr("npu.quantization_report"), map_free_vars=True)
    assert [t.scale for t in fast.report.tensors] == [t.scale for t in measured.report.tensors]
    assert all(math.isfinite(layer.sqnr_db) or layer.sqnr_db == math.inf for layer in measured.report.layers)
    assert all(math.isnan(layer.sqnr_db) for layer in fast.report.layers)
    assert math.isnan(fast.report.output_sqnr_db) and math.isfinite(measured.report.output_sqnr_db)
    table = fast.report.to_table()
    assert "output SQNR not measured (float_reference off)" in table
    assert math.isnan(quantization_report(fast.module).layers[0].sqnr_db)  # through the module's JSON
    with pytest.raises(NpuError, match="no SQNR to plot"):
        fast.report.plot("unused.png")
    for a, b in zip(fast.simulate(TEST), measured.simulate(TEST)):
        np.testing.assert_array_equal(a[0], b[0])


def test_a_callable_is_a_calibration_method():
    seen = []

    def half_range(stats, request):
        seen.append(stats.count)
        return stats.min / 2, stats.max / 2

    calibrated = calibrate(float_cnn(), CALIBRATION, QConfig(calibration=half_range, output_headroom=0))
    assert seen and all(count > 0 for count in seen)
    assert {t.method for t in calibrated.report.tensors} == {"half_range"}


def test_narrow_accumulator_overflows_are_counted_and_avoidable():
    rng = np.random.default_rng(5)
    w = rng.normal(0, 0.3, (64, 8)).astype(np.float32)
    mod = float_dense_chain([w])
    data = rng.random((8, 64)).astype(np.float32) + 0.5  # all-positive inputs: products add up
    wide = calibrate(mod, data, QConfig(accumulator_bits=32))
    peak = wide.report.layers[0].accumulator_peak
    assert 2 ** 13 < peak < 2 ** 20
    narrow = calibrate(mod, data, QConfig(accumulator_bits=14, accumulator_overflow="saturate"))
    assert narrow.report.layers[0].overflows > 0
    assert narrow.report.total_overflows == narrow.report.layers[0].overflows
    fixed = calibrate(mod, data, QConfig(accumulator_bits=14, avoid_overflow=True))
    layer = fixed.report.layers[0]
    assert layer.overflows == 0 and layer.accumulator_peak <= 2 ** 13 - 1
    assert layer.widened_channels > 0 and "widened" in layer.note
    partitioned, outputs = _run_partitioned(fixed.module, data[:3], fixed.npu_config)
    for got, sim in zip(outputs, fixed.simulate(data[:3])):
        np.testing.assert_array_equal(got, sim[0])


def test_partitioning_for_other_accumulators_than_calibrated_says_so():
    """A module calibrated for 16-bit saturating accumulators, built for the default 32-bit NPU, computes that
    hardware's results, which differ from its calibration's simulation where sums overflowed: a warning says so
    and names the hardware to pass; built for its own, it warns of nothing and equals the simulation."""
    import warnings

    rng = np.random.default_rng(5)
    mod = float_dense_chain([rng.normal(0, 0.3, (64, 8)).astype(np.float32)])
    data = rng.random((8, 64)).astype(np.float32) + 0.5  # all-positive inputs: the sums outgrow 16 bits
    narrow = calibrate(mod, data, QConfig(accumulator_bits=16, accumulator_overflow="saturate"))
    assert narrow.report.total_overflows > 0
    with pytest.warns(NpuWarning, match="calibrated for 16-bit accumulators that saturate; "
                                                    "partitioning for npu-256 .32-bit, wrap."):
        npu_backend.partition_for_npu(narrow.module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, outputs = _run_partitioned(narrow.module, data[:3], narrow.npu_config)
    for got, sim in zip(outputs, narrow.simulate(data[:3])):
        np.testing.assert_array_equal(got, sim[0])


def test_bias_correction_takes_back_the_mean_error_of_coarse_weights():
    rng = np.random.default_rng(11)
    w = rng.normal(0.05, 0.3, (64, 8)).astype(np.float32)
    mod = float_dense_chain([w])
    data = rng.random((32, 64)).astype(np.float32) + 0.5  # one-signed inputs: rounding errors add up, not cancel
    config = QConfig(weight_bits=3, per_channel=False)
    plain = calibrate(mod, data, config.replace(bias_correction=False))
    corrected = calibrate(mod, data, config)
    assert corrected.report.output_sqnr_db > plain.report.output_sqnr_db + 1.0
    shift = corrected._plan.weights[0].bias.astype(np.int64) - plain._plan.weights[0].bias
    assert np.any(shift != 0)


def test_the_float_model_runs_on_the_leading_reference_samples():
    """QConfig.reference_samples: the float model runs on the first k calibration samples, and what reads it (bias
    correction, every SQNR) reads those k. With every range fixed (a global scale), calibrating 12 samples with
    k = 5 must give the biases and SQNRs that calibrating those 5 samples alone gives, bit for bit."""
    mod = float_cnn(seed=3)
    fixed = QConfig(global_scale=4.0, reference_samples=5)
    lead = calibrate(mod, CALIBRATION, fixed)
    alone = calibrate(mod, CALIBRATION[:5], fixed.replace(reference_samples=None))
    every = calibrate(mod, CALIBRATION, fixed.replace(reference_samples=None))
    biased = [i for i, wq in lead._plan.weights.items() if wq.bias is not None]
    assert len(biased) >= 2
    for i in biased:
        np.testing.assert_array_equal(lead._plan.weights[i].bias, alone._plan.weights[i].bias)
    assert any(not np.array_equal(lead._plan.weights[i].bias, every._plan.weights[i].bias) for i in biased)
    assert [layer.sqnr_db for layer in lead.report.layers] == [layer.sqnr_db for layer in alone.report.layers]
    assert lead.report.output_sqnr_db == alone.report.output_sqnr_db != every.report.output_sqnr_db
    assert lead.report.config["reference_samples"] == 5
    assert (lead.report.samples, lead.report.compared_samples) == (12, 5)
    assert "(float model on 5 of 12 samples)" in lead.report.to_table()
    assert quantization_report(lead.module).compared_samples == 5  # through the module's JSON
    # ranges from extremes (a global scale): their int8 summaries are descriptive, taken on those 5 samples too
    assert lead.report.tensors[0].histogram["count"] == 5 * 8 * 8 and lead.report.tensors[0].name == "x"


def test_a_grouped_nchw_convolution_on_a_global_scale_calibrates_and_runs_as_simulated():
    """Its ReLU6 bound on the global scale's step is a rounding tie (6 / (4 / 127) = 190.5), so canonicalization
    leaves the float clip, and the NHWC conversion's output alias reached the rewrite as a var (an AttributeError,
    not a model error). A grouped convolution stays on the host in int8; the module equals its simulation."""
    rng = np.random.default_rng(2)
    mod = float_conv_block(rng, "NCHW", "OIHW", 4, (1, 8, 6, 6), 8, padding=[1, 1, 1, 1])
    data = rng.normal(size=(6, 8, 6, 6)).astype(np.float32)
    calibrated = calibrate(mod, data, QConfig(global_scale=4.0))
    assert [layer.placement for layer in calibrated.report.layers] == ["host int8"]
    _, outputs = _run_partitioned(calibrated.module, data[:3])
    for got, sim in zip(outputs, calibrated.simulate(data[:3])):
        np.testing.assert_array_equal(got, sim[0])


def test_the_methods_that_observe_the_float_model_run_it_on_every_sample():
    assert QConfig().compared_samples(100) == 16 and QConfig().compared_samples(10) == 10
    assert QConfig(reference_samples=None).compared_samples(100) == 100
    assert QConfig(calibration="kl").compared_samples(100) == 100
    assert QConfig(weight_rounding="least_squares").compared_samples(100) == 100


def test_onnx_clips_of_several_shapes_are_fused_activations():
    """TVM's ONNX importer legalizes each further shape's Clip bounds as ``maximum1``, ``minimum1``, ...: every
    one is still the convolution's ReLU6, not a host layer."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from npu_backend.quantization.layers import cut_layers

    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(np.array(0.0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6.0, np.float32), "hi")]
    nodes, x = [], "x"
    for k, (cin, cout, stride) in enumerate([(3, 4, 2), (4, 6, 2), (6, 8, 1)]):
        inits += [numpy_helper.from_array(rng.normal(0, 0.5, (cout, cin, 3, 3)).astype(np.float32), f"w{k}"),
                  numpy_helper.from_array(np.zeros(cout, np.float32), f"b{k}")]
        nodes += [helper.make_node("Conv", [x, f"w{k}", f"b{k}"], [f"c{k}"], kernel_shape=[3, 3], pads=[1] * 4,
                                   strides=[stride] * 2),
                  helper.make_node("Clip", [f"c{k}", "lo", "hi"], [f"r{k}"])]
        x = f"r{k}"
    graph = helper.make_graph(nodes, "clips", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, 8, 4, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    from tvm.relax.frontend.onnx import from_onnx

    layers, _ = cut_layers(from_onnx(model, keep_params_in_input=False)["main"])
    assert [(layer.kind.name, layer.clamp) for layer in layers] == [("conv2d", (0.0, 6.0))] * 3
