"""Least-squares weight rounding (npu_backend/quantization/reconstruct.py) and the model outputs' cross-validated
headroom (npu_backend/quantization/headroom.py): hand-checkable constructed cases, the canonical form kept (int8
weights in the bits' range, per-channel zero point 0), the NPU equal to the simulation, and the config checks."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax

import npu_backend
from float_models import float_cnn, float_dense_chain
from npu_backend import NpuError, QConfig
from npu_backend.quantization import calibrate, headroom, reconstruct
from npu_backend.quantization.observers import activation_qparams
from npu_backend.quantization.rewrite import TensorQ

RNG = np.random.default_rng(11)
CALIBRATION = RNG.random((12, 8, 8, 1)).astype(np.float32)
TEST = RNG.random((6, 8, 8, 1)).astype(np.float32)


def _weights(mod) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """(int8 weight, scales, zero points, axis) of every weight dequantize of a quantized module."""
    out = []
    for block in mod["main"].body.blocks:
        for b in block.bindings:
            call = b.value
            if (isinstance(call, relax.Call) and getattr(call.op, "name", "") == "relax.dequantize"
                    and isinstance(call.args[0], tvm.ir.expr.Constant) and str(call.args[0].ty.dtype) == "int8"):
                out.append((call.args[0].value.numpy(), call.args[1].value.numpy(), call.args[2].value.numpy(),
                            int(call.attrs.axis)))
    return out


def _npu_equals_simulation(calibrated, inputs) -> None:
    partitioned = npu_backend.partition_for_npu(calibrated.module, calibrated.npu_config)
    host = [o.op for o in npu_backend.partition_report(partitioned).host_ops]
    assert set(host) == {"relax.quantize", "relax.dequantize"}  # every layer offloaded
    vm = relax.VirtualMachine(tvm.compile(relax.transform.RunCodegen()(partitioned), target="llvm"), tvm.cpu())
    for x, sim in zip(inputs, calibrated.simulate(inputs)):
        np.testing.assert_array_equal(vm["main"](tvm.runtime.tensor(x)).numpy(), sim[0])


# A dense layer x [1, 3] @ W [3, 2] whose inputs 2 and 3 are always equal: their weights act only through their
# sum. In steps of each channel's scale (max|w| / 127), channel 0 is [127, 10.6, 10.6] and channel 1
# [-127, 5.7, 5.7]: to nearest [127, 11, 11] and [-127, 6, 6], sums 22 and 12 where 21.2 and 11.4 are wanted.
# The best integers make the sums 21 and 11 (errors 0.2 and 0.4 steps instead of 0.8 and 0.6).
DENSE = np.array([[1.0, -2.0], [10.6 / 127, 2 * 5.7 / 127], [10.6 / 127, 2 * 5.7 / 127]], np.float32)


def _twin_inputs(count: int, rng) -> list[np.ndarray]:
    """Inputs [a, b, b] on the grid k / 255 (exact after the input's quantization), 0 and 1 both present."""
    a = rng.integers(0, 256, count) / 255.0
    b = rng.integers(0, 256, count) / 255.0
    a[:2], b[:2] = (0.0, 1.0), (1.0, 0.0)
    return [np.array([[x, y, y]], np.float32) for x, y in zip(a, b)]


def test_least_squares_rounding_cancels_errors_that_nearest_adds_up():
    rng = np.random.default_rng(3)
    data = _twin_inputs(64, rng)
    # the float model on every sample for both (least squares runs it on all): SQNRs over the same 64 samples
    nearest = calibrate(float_dense_chain([DENSE]), data, QConfig(output_headroom=0, reference_samples=None))
    fitted = calibrate(float_dense_chain([DENSE]), data, QConfig(output_headroom=0, weight_rounding="least_squares"))
    (q_near, s_near, _, _), = _weights(nearest.module)
    (q, scales, zero_points, axis), = _weights(fitted.module)
    np.testing.assert_array_equal(q_near, [[127, -127], [11, 6], [11, 6]])
    # Same scales (one per output channel, along the weight's axis 1), zero points 0, the range of 8 bits.
    assert axis == 1
    np.testing.assert_array_equal(scales, s_near)
    np.testing.assert_array_equal(scales, np.float32([1.0 / 127, 2.0 / 127]))
    np.testing.assert_array_equal(zero_points, [0, 0])
    assert q[0].tolist() == [127, -127]
    assert (q[1] + q[2]).tolist() == [21, 11]
    assert np.all(np.abs(q[1:] - q_near[1:]) <= 1)
    # The layer's output error on the calibration inputs: 0.2 and 0.4 steps per unit of b, not 0.8 and 0.6.
    x = np.concatenate(data).astype(np.float64)
    want = x @ DENSE.astype(np.float64)
    err_near = np.sum((x @ (q_near * s_near) - want) ** 2, axis=0)
    err_fit = np.sum((x @ (q * scales) - want) ** 2, axis=0)
    b2 = np.sum(x[:, 1] ** 2)
    np.testing.assert_allclose(err_near, [(0.8 / 127) ** 2 * b2, (0.6 * 2 / 127) ** 2 * b2], rtol=1e-4)
    np.testing.assert_allclose(err_fit, [(0.2 / 127) ** 2 * b2, (0.4 * 2 / 127) ** 2 * b2], rtol=1e-4)
    assert fitted.report.output_sqnr_db > nearest.report.output_sqnr_db  # the int8 output's rounding remains
    _npu_equals_simulation(fitted, _twin_inputs(8, np.random.default_rng(4)))


def test_gptq_round_then_polish_reach_the_integer_optimum_of_a_small_quadratic():
    # H of two equal inputs (plus 1 % damping), v = [10.6, 10.6] on scale 1: the error of q is
    # 1.01 (q1 - 10.6)^2 + 1.01 (q2 - 10.6)^2 + 2 (q1 - 10.6)(q2 - 10.6), least at q1 + q2 = 21. Shapes are
    # [groups, channels, inputs]: one group, one channel.
    h = np.array([[[1.01, 1.0], [1.0, 1.01]]])
    v = np.array([[[10.6, 10.6]]])
    s = np.array([[1.0]])
    q = reconstruct.polish(h, v, s, reconstruct.gptq_round(h, v, s, 127), 127)
    assert sorted(q[0, 0].tolist()) == [10, 11]
    best = min(((a, b) for a in range(8, 14) for b in range(8, 14)),
               key=lambda p: (np.array(p) - v[0, 0]) @ h[0] @ (np.array(p) - v[0, 0]))
    assert sorted(best) == sorted(q[0, 0].tolist())
    # The range is a hard limit: with qmax 10 the best is the corner [10, 10].
    np.testing.assert_array_equal(reconstruct.polish(h, v, s, reconstruct.gptq_round(h, v, s, 10), 10), [[[10, 10]]])
    # Groups are independent: a second group with its own H and scale rounds as if alone.
    h2 = np.concatenate([h, [[[1.0, 0.0], [0.0, 1.0]]]])
    v2 = np.concatenate([v, [[[3.4, -2.6]]]])
    s2 = np.array([[1.0], [0.5]])
    q2 = reconstruct.polish(h2, v2, s2, reconstruct.gptq_round(h2, v2, s2, 127), 127)
    assert q2[0].tolist() == q[0].tolist() and q2[1].tolist() == [[7, -5]]


def test_least_squares_at_4_bits_keeps_the_canonical_form_and_the_npu_bit_exact():
    nearest = calibrate(float_cnn(), CALIBRATION, QConfig(weight_bits=4))
    fitted = calibrate(float_cnn(), CALIBRATION, QConfig(weight_bits=4, weight_rounding="least_squares"))
    weights = _weights(fitted.module)
    assert len(weights) == 3  # conv, depthwise, dense
    changed = 0
    for (q, scales, zero_points, axis), (q_near, s_near, _, _) in zip(weights, _weights(nearest.module)):
        assert q.min() >= -7 and q.max() <= 7
        np.testing.assert_array_equal(zero_points, np.zeros(scales.shape))
        assert scales.shape == (q.shape[axis],)
        changed += int(np.sum(q != q_near))
    assert changed > 0
    assert fitted.report.output_sqnr_db > nearest.report.output_sqnr_db + 1.0
    _npu_equals_simulation(fitted, [x[None] for x in TEST])


@pytest.mark.parametrize("outlier", [1.1, 1.3, 1.5])
def test_held_out_factor_is_the_least_widening_that_covers_an_outlier(outlier):
    # Ten samples, so ten folds of one: nine spread evenly over [0, 1] (1,001 values), one over [0, outlier].
    # Held out, the outlier sample is clipped at a (the others' max times a) unless a >= outlier: at
    # a = outlier - 0.02 that costs about 770 * 0.02**3 / 3 = 2e-3, while the nine samples' rounding costs
    # 9,009 * (outlier * a / 255)**2 / 12, growing by about 1e-3 per step of a; so the least covering a wins.
    base = np.linspace(0, 1, 1001, dtype=np.float32)
    samples = np.stack([base] * 9 + [base * np.float32(outlier)])

    def minmax(subset):
        return float(subset.min()), float(subset.max())

    def qparams(lo, hi):
        return TensorQ(*activation_qparams(lo, hi))

    assert headroom.held_out_factor(samples, minmax, qparams) == outlier
    # Without an outlier nothing is widened; a fixed headroom h widens by 1 + h.
    assert headroom.held_out_factor(np.stack([base] * 10), minmax, qparams) == 1.0
    assert headroom.widened_range(samples, -0.5, 2.0, 0.25, minmax, qparams) == (-0.625, 2.5, 1.25)


def test_output_headroom_widens_only_the_model_outputs_range():
    weights = [RNG.normal(0, 0.5, (4, 6)).astype(np.float32), RNG.normal(0, 0.5, (6, 3)).astype(np.float32)]
    data = [RNG.normal(0, 1, (1, 4)).astype(np.float32) for _ in range(20)]
    plain = calibrate(float_dense_chain(weights), data, QConfig(output_headroom=0))
    wide = calibrate(float_dense_chain(weights), data, QConfig(output_headroom=0.25))
    first, last = plain.report.tensors[1], plain.report.tensors[-1]
    assert wide.report.tensors[1] == first  # the hidden layer's range is the method's own
    out = wide.report.tensors[-1]
    assert out.method == "minmax, headroom x1.25" and last.method == "minmax"
    assert (out.min, out.max) == (last.min, last.max)
    assert (out.scale, out.zero_point) == activation_qparams(1.25 * min(last.min, 0), 1.25 * max(last.max, 0))
    default = calibrate(float_dense_chain(weights), data)
    assert default.report.config["output_headroom"] == "cross_validated"
    assert default.report.tensors[-1].method.startswith("minmax, headroom x")


@pytest.mark.parametrize("field, value", [
    ("weight_rounding", "adaround"), ("weight_rounding", None), ("output_headroom", "loo"),
    ("output_headroom", -0.1), ("output_headroom", 1.5), ("output_headroom", float("nan")),
    ("output_headroom", True)])
def test_invalid_values_name_their_field(field, value):
    with pytest.raises(NpuError, match=f"QConfig.{field}"):
        QConfig(**{field: value})


@pytest.mark.parametrize("symmetric", [False, True])
def test_minmax_range_of_held_out_samples_from_extremes_is_the_observers(symmetric):
    # Cross-validating a model output's headroom asks for the method's range ten times; minmax's comes from the
    # samples' extremes, and must be the range the observer (histograms and all) gives the same samples.
    import importlib

    from npu_backend.quantization.observers import TensorStats, choose_range

    calibrate = importlib.import_module("npu_backend.quantization.calibrate")
    config = npu_backend.QConfig(symmetric_activations=symmetric)
    rng = np.random.default_rng(3)
    for shift in (0.0, 5.0, -5.0):
        samples = (rng.standard_normal((9, 4, 7)) * 3 + shift).astype(np.float32)
        stats = TensorStats(bins=config.bins)
        stats.update_samples(samples)
        want = choose_range(stats, "minmax", calibrate._request(config))
        assert calibrate._method_range(config, samples) == want
    samples[2, 1, 1] = np.nan  # not finite: the observer's path, and its error
    with pytest.raises(NpuError, match="NaN or infinite"):
        TensorStats(bins=config.bins).update_samples(samples)
    with pytest.raises(NpuError, match="NaN or infinite"):
        calibrate._method_range(config, samples)
