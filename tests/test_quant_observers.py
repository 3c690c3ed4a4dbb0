"""Calibration statistics, range methods and qparams (npu_backend.quantization.observers), checked by hand."""

import json
import math

import numpy as np
import pytest

from npu_backend.errors import NpuError
from npu_backend.quantization.observers import (METHODS, ZERO_RANGE_HI, RangeRequest, TensorStats, activation_qparams,
                                                choose_range, quantize_weights, resolve_method)


def stats_of(*batches, bins=2048) -> TensorStats:
    stats = TensorStats(bins=bins)
    for batch in batches:
        stats.update(np.asarray(batch, dtype=np.float32))
    return stats


def f32(x: float) -> float:
    return float(np.float32(x))


SYM = RangeRequest(symmetric=True)
ASYM = RangeRequest()


# --- TensorStats ---------------------------------------------------------------------------------------------------

def test_minmax_streams_like_one_batch():
    stats = stats_of([1.0, -2.0], [3.0], [[0.5, -4.0], [0.0, 0.0]])
    assert (stats.min, stats.max, stats.count, stats.zeros) == (-4.0, 3.0, 7, 2)
    # mean -1.5 / 7; squared deviations summed over the seven values
    values = np.array([1.0, -2.0, 3.0, 0.5, -4.0, 0.0, 0.0])
    assert stats.mean == pytest.approx(-1.5 / 7, rel=1e-15)
    assert stats.std == pytest.approx(math.sqrt(np.sum((values + 1.5 / 7) ** 2) / 7), rel=1e-15)
    assert choose_range(stats, "minmax", ASYM) == (-4.0, 3.0)
    assert choose_range(stats, "minmax", SYM) == (-4.0, 4.0)

    data = np.random.default_rng(1).normal(0.3, 2.0, size=(10, 500)).astype(np.float32)
    streamed, whole = stats_of(*data), stats_of(data)
    assert (streamed.min, streamed.max, streamed.count) == (whole.min, whole.max, whole.count)
    assert choose_range(streamed, "minmax", ASYM) == choose_range(whole, "minmax", ASYM)
    assert streamed.mean == pytest.approx(whole.mean, rel=1e-12)
    assert streamed.std == pytest.approx(whole.std, rel=1e-12)


def test_before_any_update():
    stats = TensorStats()
    assert (stats.min, stats.max, stats.count) == (math.inf, -math.inf, 0)
    assert stats.summary() == {"count": 0}
    with pytest.raises(NpuError, match="no calibration values"):
        choose_range(stats, "minmax", ASYM)
    with pytest.raises(NpuError, match="no calibration values"):
        METHODS["kl"](stats, ASYM)


def test_histogram_rebins_into_integer_multiples():
    stats = stats_of([0.25, -0.75, 1.0, 0.5], bins=8)
    counts, edges = stats.histogram
    # R = 1, width 0.25: -0.75 in [-0.75, -0.5), 0.25 in [0.25, 0.5), 0.5 in [0.5, 0.75), 1.0 in the closed last bin
    assert edges.tolist() == [-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0]
    assert counts.tolist() == [0, 1, 0, 0, 0, 1, 1, 1]
    assert counts.dtype == np.int64

    stats.update([2.5])  # R grows to ceil(2.5 / 1) * 1 = 3: each new bin is 3 old ones, 0 stays an edge
    counts, edges = stats.histogram
    assert edges.tolist() == [-3.0, -2.25, -1.5, -0.75, 0.0, 0.75, 1.5, 2.25, 3.0]
    # -0.75 -> [-0.75, 0); 0.25 and 0.5 -> [0, 0.75); 1.0 -> [0.75, 1.5); 2.5 -> [2.25, 3]
    assert counts.tolist() == [0, 0, 0, 1, 2, 1, 0, 1]
    assert counts.sum() == stats.count == 5
    assert counts.tolist() == np.histogram([0.25, -0.75, 1.0, 0.5, 2.5], bins=8, range=(-3, 3))[0].tolist()


def test_histogram_large_growth_and_leading_zeros():
    stats = stats_of([0.0, 0.0], bins=8)
    assert stats.histogram[0].tolist() == [0, 0, 0, 0, 2, 0, 0, 0]
    stats.update([-0.25, 1.0])  # first nonzero values: R = 1, the zeros stay in [0, 0.25)
    assert stats.histogram[0].tolist() == [0, 0, 0, 1, 2, 0, 0, 1]
    stats.update([100.0])  # k = 100 >= 4: every old bin lands on one side of 0, in [-25, 0) or [0, 25)
    counts, edges = stats.histogram
    assert edges[[0, 4, 8]].tolist() == [-100.0, 0.0, 100.0]
    assert counts.tolist() == [0, 0, 0, 1, 3, 0, 0, 1]


def test_abs_histogram_folds_at_zero():
    stats = stats_of([-0.5, 0.5, -1.5, 3.5, -4.0], bins=8)
    counts, edges = stats.abs_histogram()
    assert edges.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert counts.tolist() == [2, 1, 0, 2]


def test_summary_percentiles_interpolate_in_bins():
    values = np.append(np.arange(999) + 0.5, 1000.0)  # one value per unit bin when R = 1000, bins = 2000
    summary = stats_of(values, bins=2000).summary()
    json.dumps(summary, allow_nan=False)
    assert summary["count"] == 1000
    assert (summary["min"], summary["max"]) == (0.5, 1000.0)
    # the q-th percentile is q% of 1000 values: 10 values lie in [0, 10) -> p1 is 10.0
    assert (summary["p1"], summary["p50"], summary["p99.9"]) == (10.0, 500.0, 999.0)
    assert summary["p0.1"] == 1.0
    assert summary["mean"] == pytest.approx(values.mean(), rel=1e-15)


def test_non_finite_values_raise():
    stats = stats_of([1.0, 2.0])
    for bad in ([1.0, np.nan], [np.inf], [[0.0], [-np.inf]]):
        with pytest.raises(NpuError, match="NaN or infinite"):
            stats.update(np.array(bad, dtype=np.float32))
    assert stats.count == 2 and stats.max == 2.0
    with pytest.raises(NpuError, match="real numbers"):
        stats.update(np.array(["a"]))
    with pytest.raises(NpuError, match="even"):
        TensorStats(bins=7)


# --- range methods --------------------------------------------------------------------------------------------------

def test_percentile_symmetric_keeps_at_least_p_percent():
    # |x| is k + 0.5 (k < 999) and 1000: one value per unit bin of the |x| histogram (R = 1000, 1000 bins)
    values = np.append((np.arange(999) + 0.5) * np.where(np.arange(999) % 2, -1.0, 1.0), 1000.0)
    stats = stats_of(values, bins=2000)
    # 99% of 1000 values = 990 lie below the edge 990 (onnxruntime would take 989, the crossing bin's lower edge)
    assert choose_range(stats, "percentile", RangeRequest(symmetric=True, percentile=99.0)) == (-990.0, 990.0)
    assert choose_range(stats, "percentile", RangeRequest(symmetric=True, percentile=100.0)) == (-1000.0, 1000.0)


def test_percentile_asymmetric_cuts_half_of_the_rest_per_tail():
    values = np.concatenate([[-1000.0], np.arange(-999, 999) + 0.5, [1000.0]])  # 2000 values, one per bin
    stats = stats_of(values, bins=2000)
    # p = 99: 0.5% of 2000 = 10 values cut from each tail
    assert choose_range(stats, "percentile", RangeRequest(percentile=99.0)) == (-990.0, 990.0)

    relu = stats_of(np.append(np.arange(999) + 0.5, 1000.0), bins=2000)
    # 5 values cut from each end: lo = 5.0 is widened to 0, hi = 995 (995 values below it)
    assert choose_range(relu, "percentile", RangeRequest(percentile=99.0)) == (0.0, 995.0)
    assert choose_range(relu, "percentile", RangeRequest(percentile=100.0)) == (0.0, 1000.0)


def test_kl_hand_computed_with_two_levels():
    # bits=2 -> 2 levels on |x|; bins=8 -> |x| histogram [0,1,2,3,4] with counts [4, 2, 1, 1]
    stats = stats_of([0.5, -0.5, 0.5, -0.5, 1.5, -1.5, 2.5, -4.0], bins=8)
    # threshold 2: P = [4, 4], Q = [4, 2]              -> KL = ln(9/8) / 2 = 0.0589
    # threshold 3: P = [4, 2, 2], Q = [4, 1.5, 1.5]    -> KL = ln(49/48) / 2 = 0.0103 (smallest)
    # threshold 4: P = [4, 2, 1, 1], Q = [3, 3, 1, 1]  -> KL = ln(4/3) / 2 + ln(2/3) / 4 = 0.0425
    assert choose_range(stats, "kl", RangeRequest(bits=2, symmetric=True)) == (-3.0, 3.0)
    assert choose_range(stats, "kl", RangeRequest(bits=2)) == (-3.0, 2.5)  # (max(min, -t), min(max, t))

    flat = stats_of([0.5, -1.5, 2.5, 4.0], bins=8)  # counts [1, 1, 1, 1]: KL 0.131, 0.173, 0 -> keep everything
    assert choose_range(flat, "kl", RangeRequest(bits=2, symmetric=True)) == (-4.0, 4.0)


@pytest.fixture(scope="module")
def gaussian_with_outliers() -> TensorStats:
    data = np.concatenate([np.random.default_rng(0).standard_normal(20000), [50.0, -40.0]])
    return stats_of(*np.array_split(data, 5))


@pytest.fixture(scope="module")
def uniform() -> TensorStats:
    return stats_of(*np.random.default_rng(2).uniform(-1.0, 1.0, size=(4, 5000)))


def test_kl_clips_outliers_and_keeps_uniform(gaussian_with_outliers, uniform):
    lo, hi = choose_range(gaussian_with_outliers, "kl", SYM)
    assert lo == -hi and 4.0 < hi < 0.2 * gaussian_with_outliers.absmax
    lo, hi = choose_range(uniform, "kl", SYM)
    assert lo == -hi and hi >= 0.99 * uniform.absmax


def test_mse_hand_computed():
    stats = stats_of([0.5] * 6 + [4.0], bins=8)  # |x| bins of width 1: six values in [0, 1), one in [3, 4]
    # bits=2 symmetric: step t, grid [-2t, t]. Error = (values inside) * t^2/12 + sum over the [3, 4] bin beyond t
    # of (x - t)^2, i.e. ((3-t)^2 + (3-t)(4-t) + (4-t)^2) / 3 when t <= 3:
    # t=1: 6/12 + 19/3 = 6.83; t=2: 24/12 + 7/3 = 4.33; t=3: 54/12 + 1/3 = 4.83; t=4: 7 * 16/12 = 9.33
    assert choose_range(stats, "mse", RangeRequest(bits=2, symmetric=True)) == (-2.0, 2.0)
    # asymmetric: grid [0, hi], hi = 4 alpha for alpha in 1/4, 2/4, 3/4, 1, step hi/3:
    # hi=1: 6 (1/9)/12 + 19/3 = 6.39; hi=2: 6 (4/9)/12 + 7/3 = 2.56; hi=3: 6/12 + 1/3 = 0.83; hi=4: 7 (16/9)/12 = 1.04
    assert choose_range(stats, "mse", RangeRequest(bits=2)) == (0.0, 3.0)


def test_mse_counts_no_noise_for_exact_zeros():
    # 30 exact zeros on top of the case above: 0 is on every grid, so the choice stays t = 2 (were they counted as
    # noise, t=1 would cost 36/12 + 19/3 = 9.33 against t=2's 36 * 4/12 + 7/3 = 14.33)
    stats = stats_of([0.0] * 30 + [0.5] * 6 + [4.0], bins=8)
    assert stats.zeros == 30
    assert choose_range(stats, "mse", RangeRequest(bits=2, symmetric=True)) == (-2.0, 2.0)


def test_mse_clips_outliers_and_keeps_uniform(gaussian_with_outliers, uniform):
    absmax = gaussian_with_outliers.absmax
    lo, hi = choose_range(gaussian_with_outliers, "mse", SYM)
    assert lo == -hi and hi < absmax  # at 8 bits two outliers' clipping error is worth little rounding noise
    lo, hi = choose_range(gaussian_with_outliers, "mse", RangeRequest(bits=4, symmetric=True))
    assert 2.0 < hi < 0.1 * absmax  # at 4 bits the noise dominates: clip hard
    lo, hi = choose_range(gaussian_with_outliers, "mse", RangeRequest(bits=4))
    assert -0.1 * absmax < lo < -2.0 and 2.0 < hi < 0.1 * absmax
    lo, hi = choose_range(uniform, "mse", SYM)
    assert lo == -hi and 0.98 * uniform.absmax <= hi <= uniform.absmax


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("symmetric", [False, True])
def test_every_range_holds_zero(method, symmetric):
    request = RangeRequest(symmetric=symmetric)
    lo, hi = METHODS[method](stats_of(np.linspace(1.0, 5.0, 300)), request)
    assert lo <= 0.0 < hi and (lo == -hi or not symmetric)
    zero = METHODS[method](stats_of(np.zeros(10)), request)
    assert zero == ((-ZERO_RANGE_HI, ZERO_RANGE_HI) if symmetric else (0.0, ZERO_RANGE_HI))


# --- method resolution ----------------------------------------------------------------------------------------------

def test_callable_method_is_used_and_widened():
    seen = []

    def fixed(stats, request):
        seen.append((stats.count, request.bits))
        return (0.5, np.float32(2.0))

    stats = stats_of([1.0, 2.0, 3.0])
    assert resolve_method(fixed) is fixed
    assert resolve_method("kl") is METHODS["kl"]
    assert choose_range(stats, fixed, RangeRequest(bits=6)) == (0.0, 2.0)
    assert seen == [(3, 6)]
    assert choose_range(stats, lambda s, r: (0, 0), ASYM) == (0.0, ZERO_RANGE_HI)


@pytest.mark.parametrize("result, problem", [
    ((1.0, float("nan")), "non-finite"), ((2.0, 1.0), "lo=2.0 > hi=1.0"), ((1.0, 2.0, 3.0), "not a pair"),
    (None, "not a pair"), (("a", 1.0), "real numbers"), ((True, 2.0), "real numbers")])
def test_bad_callable_results_raise(result, problem):
    with pytest.raises(NpuError, match=problem):
        choose_range(stats_of([1.0]), lambda s, r: result, ASYM)


def test_unknown_method_names_the_methods():
    with pytest.raises(NpuError, match="'entropy'.*minmax, percentile, kl, mse"):
        choose_range(stats_of([1.0]), "entropy", ASYM)
    with pytest.raises(NpuError, match="neither"):
        resolve_method(42)


def test_range_request_validation():
    for bad in ({"bits": 9}, {"bits": 1}, {"percentile": 0.0}, {"percentile": 100.5}, {"symmetric": 1}):
        with pytest.raises(NpuError):
            RangeRequest(**bad)


# --- activation qparams ---------------------------------------------------------------------------------------------

def test_activation_qparams_asymmetric():
    # scale 4/255; zero point round(-128 + 1 / scale) = round(-64.25) = -64
    assert activation_qparams(-1.0, 3.0) == (f32(4 / 255), -64)
    # scale 510/255 = 2 exactly; -128 + 3/2 = -126.5 rounds half away from zero to -127 (half-even would give -126)
    assert activation_qparams(-3.0, 507.0) == (2.0, -127)
    # TFLite's converter works in float32: -128 + 8 / float32(16/255) is -0.5000076 there, so -1 (onnxruntime
    # divides in float64 by the unrounded 16/255, gets exactly -0.5 and rounds it half to even: 0)
    assert activation_qparams(-8.0, 8.0) == (f32(16 / 255), -1)
    # a range without 0 is widened: (1, 3) -> (0, 3), (-3, -1) -> (-3, 0)
    assert activation_qparams(1.0, 3.0) == (f32(3 / 255), -128)
    assert activation_qparams(-3.0, -1.0) == (f32(3 / 255), 127)
    assert activation_qparams(0.0, 0.0) == (f32(ZERO_RANGE_HI / 255), -128)


def test_activation_qparams_symmetric_and_bits():
    assert activation_qparams(-1.0, 3.0, symmetric=True) == (f32(3 / 127), 0)
    # 4 bits: q in [-8, 7]; scale 3/15 = 0.2, zero point round(-8 + 1/0.2) = -3
    assert activation_qparams(-1.0, 2.0, bits=4) == (f32(0.2), -3)
    assert activation_qparams(-1.0, 3.0, bits=4, symmetric=True) == (f32(3 / 7), 0)
    scale, _ = activation_qparams(-0.3, 0.7)
    assert isinstance(scale, float) and float(np.float32(scale)) == scale


def test_activation_qparams_power_of_two():
    # 4/255 = 0.0157 > 2^-6 -> 2^-5; zero point -128 + 1/2^-5 = -96
    assert activation_qparams(-1.0, 3.0, power_of_two=True) == (2.0 ** -5, -96)
    assert activation_qparams(-1.0, 3.0, symmetric=True, power_of_two=True) == (2.0 ** -5, 0)  # 3/127 -> 2^-5
    assert activation_qparams(0.0, 255 / 16, power_of_two=True) == (2.0 ** -4, -128)  # already a power of two
    # -128 + 1.01 * 32 = -95.68 rounds to -96, which would clip lo to -1.0; the slack moves it to -95
    assert activation_qparams(-1.01, 3.0, power_of_two=True) == (2.0 ** -5, -95)


def test_activation_qparams_rejects_bad_ranges():
    for lo, hi, kw in ((2.0, 1.0, {}), (float("nan"), 1.0, {}), (-1.0, float("inf"), {}), (-1.0, 1.0, {"bits": 9})):
        with pytest.raises(NpuError):
            activation_qparams(lo, hi, **kw)


# --- weights ----------------------------------------------------------------------------------------------------------

def test_quantize_weights_per_channel_axis_0_rounds_half_even():
    w = np.array([[127.0, 2.5, -3.5], [-254.0, 127.0, 0.5]], np.float32)
    q, scales = quantize_weights(w, axis=0)
    assert scales.dtype == np.float32 and scales.tolist() == [1.0, 2.0]
    assert q.dtype == np.int8 and q.tolist() == [[127, 2, -4], [-127, 64, 0]]


def test_quantize_weights_axis_3_and_zero_channel():
    w = np.zeros((1, 1, 2, 3), np.float32)
    w[0, 0, :, 0] = [127.0, -63.5]
    w[0, 0, :, 2] = [-508.0, 254.0]
    q, scales = quantize_weights(w, axis=3)
    assert scales.tolist() == [1.0, 4.0, 4.0]  # the zero channel takes the largest scale
    assert q[0, 0, :, 0].tolist() == [127, -64] and q[0, 0, :, 1].tolist() == [0, 0]
    assert q[0, 0, :, 2].tolist() == [-127, 64]
    q_neg, scales_neg = quantize_weights(w, axis=-1)
    assert np.array_equal(q_neg, q) and np.array_equal(scales_neg, scales)


def test_quantize_weights_per_tensor_and_bits():
    q, scales = quantize_weights(np.array([-1.0, 0.3, 1.0, 0.99]), axis=None, bits=4)
    assert scales.shape == (1,) and scales[0] == np.float32(1 / 7)
    assert q.tolist() == [-7, 2, 7, 7]  # [-7, 7]: -8 is never used
    q, scales = quantize_weights(np.zeros((2, 2)), axis=None)
    assert scales.tolist() == [1.0] and not q.any()
    q, scales = quantize_weights(np.array([[-2.0, 1.0], [0.5, 0.25]]), axis=None)
    assert scales.tolist() == [f32(2 / 127)] and q.tolist() == [[-127, 64], [32, 16]]


def test_quantize_weights_rejects_bad_input():
    with pytest.raises(NpuError, match="NaN"):
        quantize_weights(np.array([1.0, np.nan]), axis=None)
    with pytest.raises(NpuError, match="axis"):
        quantize_weights(np.ones((2, 3)), axis=2)
    with pytest.raises(NpuError, match="bits"):
        quantize_weights(np.ones(3), axis=None, bits=9)
