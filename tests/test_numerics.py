"""simulator.numerics against TFLite's definitions and an independent per-element oracle."""

import math

import numpy as np
import pytest

import reference_kernels as ref
from simulator import NumericsError
from simulator.numerics import Rounding, conv_multipliers, fully_connected_multiplier, multiply_by_quantized_multiplier, quantize_multiplier, requantize


@pytest.mark.parametrize("real, expected", [
    (0.5, (1 << 30, 0)),          # frexp(0.5) = 0.5 * 2**0
    (1.0, (1 << 30, 1)),
    (0.25, (1 << 30, -1)),
    (0.0, (0, 0)),
    (2.0 ** -40, (0, 0)),         # below 2**-31: flushed to zero as TFLite does
    (0.999999999999, (1 << 30, 1)),  # q*2**31 rounds up to 2**31: halved, shift + 1
])
def test_quantize_multiplier_matches_tflite(real, expected):
    assert quantize_multiplier(real) == expected


def test_quantize_multiplier_reconstructs_the_real_value():
    rng = np.random.default_rng(1)
    for real in rng.uniform(1e-6, 0.99, 200):
        m, s = quantize_multiplier(float(real))
        assert (1 << 30) <= m < (1 << 31)
        assert math.isclose(m * 2.0 ** (s - 31), real, rel_tol=2 ** -30)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf"), 2.0 ** 31])
def test_quantize_multiplier_rejects_unrepresentable(bad):
    with pytest.raises(NumericsError):
        quantize_multiplier(bad)


def test_fc_multiplier_multiplies_scales_in_float32():
    s_in, s_w, s_out = np.float32(0.0123), np.float32(0.00457), np.float32(0.031)
    m, s = fully_connected_multiplier(s_in, s_w, s_out)
    assert (int(m[0]), int(s[0])) == quantize_multiplier(float(np.float32(s_in * s_w)) / float(s_out))
    mc, sc = conv_multipliers(s_in, [s_w], s_out)
    assert (int(mc[0]), int(sc[0])) == quantize_multiplier(float(s_in) * float(s_w) / float(s_out))


def test_vectorized_requantize_equals_scalar_oracle():
    rng = np.random.default_rng(7)
    acc = np.concatenate([rng.integers(-(1 << 24), 1 << 24, 4000),
                          [ref.INT32_MIN, ref.INT32_MAX, 0, -1, 1, (1 << 20) + (1 << 19), -(1 << 19)]])
    for real in (0.3, 0.0009765625, 0.75, 1.5, 2.0 ** -20, 0.1234567):
        m, s = quantize_multiplier(real)
        got = multiply_by_quantized_multiplier(acc, m, s)
        want = [ref.multiply_by_quantized_multiplier(int(a), m, s) for a in acc]
        assert got.tolist() == want


def test_exact_ties_round_away_from_zero():
    m, s = 1 << 30, -1  # x * 0.25 exactly
    assert multiply_by_quantized_multiplier(np.array([2, -2, 6, -6]), m, s).tolist() == [1, -1, 2, -2]


def test_single_rounding_rounds_half_up():
    m, s = 1 << 30, -1
    got = multiply_by_quantized_multiplier(np.array([2, -2, 6, -6]), m, s, Rounding.TFLITE_SINGLE)
    assert got.tolist() == [1, 0, 2, -1]


@pytest.mark.parametrize("shift", [-32, 31])
def test_out_of_range_shift_raises(shift):
    with pytest.raises(NumericsError, match="shift"):
        multiply_by_quantized_multiplier(np.array([5]), 1 << 30, shift)


def test_requantize_clamps_and_checks_its_range():
    m, s = quantize_multiplier(1.0)
    assert requantize(np.array([-500, 3, 500]), m, s, 10, -128, 100).tolist() == [-128, 13, 100]
    with pytest.raises(NumericsError):
        requantize(np.array([1]), m, s, 0, -129, 127)


def test_activation_tables_track_the_real_functions():
    """The fixed-point tables (exact against BUILTIN_REF in the golden tests) stay within 1 LSB of math."""
    from simulator.tables import logistic_table, tanh_table

    x = np.arange(-128, 128)
    s_in, zp = 0.0625, 5
    real = (x - zp) * s_in
    sigmoid = np.clip(np.round(1 / (1 + np.exp(-real)) * 256) - 128, -128, 127)
    tanh = np.clip(np.round(np.tanh(real) * 128), -128, 127)
    assert np.max(np.abs(logistic_table(s_in, zp).astype(int) - sigmoid)) <= 1
    assert np.max(np.abs(tanh_table(s_in, zp).astype(int) - tanh)) <= 1
    assert logistic_table(s_in, zp)[zp + 128] == 0  # logistic(0) = 0.5 -> 128/256 - 128


def test_activation_tables_equal_tflite_on_every_input_across_scales():
    """Exhaustive oracle: BUILTIN_REF's LOGISTIC/TANH/HARD_SWISH of all 256 inputs at 7 input scales each, and
    TFLite's ELU kernel (BUILTIN_REF has none; scripts/make_tflite_fixtures.py, NOT_IN_BUILTIN_REF)."""
    from conftest import FIXTURES
    from simulator.tables import hard_swish_table, logistic_table, lut_populate, tanh_table, tflite_elu

    sweep = np.load(FIXTURES / "tflite" / "activation_tables.npz")
    generators = {"logistic": lambda s, z, so, zo: logistic_table(s, z),
                  "tanh": lambda s, z, so, zo: tanh_table(s, z), "hard_swish": hard_swish_table,
                  "elu": lambda s, z, so, zo: lut_populate(tflite_elu, s, z, so, zo)}
    kinds = [str(k) for k in sweep["kind"]]
    assert {k: kinds.count(k) for k in generators} == dict.fromkeys(generators, 7)
    for kind, s, z, so, zo, table in zip(sweep["kind"], sweep["input_scale"], sweep["input_zero_point"],
                                         sweep["output_scale"], sweep["output_zero_point"], sweep["table"]):
        np.testing.assert_array_equal(generators[str(kind)](float(s), int(z), float(so), int(zo)), table,
                                      err_msg=f"{kind} at input scale {s}")


def test_hard_swish_table_tracks_the_real_function():
    from simulator.tables import hard_swish_table

    s_in, s_out, zo = 0.04, 0.02, -100
    real = (np.arange(-128, 128)) * s_in
    want = np.clip(np.round(real * np.clip(real + 3, 0, 6) / 6 / s_out) + zo, -128, 127)
    assert np.max(np.abs(hard_swish_table(s_in, 0, s_out, zo).astype(int) - want)) <= 1


ORACLE = "oracle/elementwise_ops.npz"
"""BUILTIN_REF SUB/MUL on all 256 x 256 input pairs and SOFTMAX rows (scripts/make_elementwise_oracle.py)."""


def _oracle():
    from conftest import FIXTURES

    return np.load(FIXTURES / ORACLE)


def _every_pair():
    return np.meshgrid(np.arange(-128, 128), np.arange(-128, 128), indexing="ij")


@pytest.mark.parametrize("scales", [(0.02, 0.031, 0.045), (0.05, 0.05, 0.1), (0.0123, 0.0789, 0.006),
                                    (0.9, 0.001, 3e-6)])
def test_sub_multipliers_are_adds(scales):
    """sub.cc PrepareGeneralSubOp and add.cc Prepare compute the same six numbers from the same expressions."""
    from simulator.numerics import add_multipliers, sub_multipliers

    assert sub_multipliers(*scales) == add_multipliers(*scales)


def test_sub_output_multiplier_must_stay_below_one():
    """s1 = s2 = 0.5 makes the output multiplier 1 / (2**20 * s_out): 1 at s_out = 2**-20, just below one float up."""
    from simulator.numerics import sub_multipliers

    with pytest.raises(NumericsError, match="SUB output multiplier 1 must be below 1"):
        sub_multipliers(0.5, 0.5, 2.0 ** -20)
    assert sub_multipliers(0.5, 0.5, np.nextafter(np.float32(2.0 ** -20), np.float32(1)))[5] == 0


def test_mul_multiplier_is_formed_in_float32():
    """mul.cc: ``input1 scale * input2 scale / output scale`` on floats; double would differ in the last bits."""
    from simulator.numerics import mul_multiplier

    s1, s2, so = np.float32(0.039738819003105164), np.float32(0.033220190554857254), np.float32(0.04043462127447128)
    assert mul_multiplier(s1, s2, so) == quantize_multiplier(float(np.float32(np.float32(s1 * s2) / so)))
    assert mul_multiplier(s1, s2, so) != quantize_multiplier(float(s1) * float(s2) / float(so))
    assert mul_multiplier(0.37, 0.41, 0.023)[1] == 3  # a real multiplier above 1 keeps its left shift


def test_sub_and_mul_match_the_slow_reference():
    from simulator.numerics import elementwise_mul, elementwise_sub, mul_multiplier, sub_multipliers

    rng = np.random.default_rng(12)
    x1, x2 = (rng.integers(-128, 128, 3000) for _ in range(2))
    s1, s2, so = (float(np.float32(s)) for s in (0.031, 0.017, 0.02))
    got = elementwise_sub(x1, x2, -7, 12, 3, *sub_multipliers(s1, s2, so), 20, -100, 127)
    assert got.tolist() == ref.sub(x1.tolist(), x2.tolist(), s1, -7, s2, 12, so, 3, (-100, 127))
    got = elementwise_mul(x1, x2, -7, 12, 3, *mul_multiplier(s1, s2, so), -128, 90)
    assert got.tolist() == ref.mul(x1.tolist(), x2.tolist(), s1, -7, s2, 12, so, 3, (-128, 90))


@pytest.mark.parametrize("op", ["sub", "mul"])
def test_sub_and_mul_equal_tflite_on_every_input_pair(op):
    """Exhaustive oracle, tolerance 0: every int8 pair at each parameter case of the fixture."""
    from simulator.numerics import elementwise_mul, elementwise_sub, mul_multiplier, sub_multipliers

    oracle = _oracle()
    x1, x2 = _every_pair()
    cases = zip(oracle[f"{op}_scales"], oracle[f"{op}_zero_points"], oracle[f"{op}_act"], oracle[f"{op}_out"])
    count = 0
    for (s1, s2, so), (z1, z2, zo), (lo, hi), want in cases:
        if op == "sub":
            got = elementwise_sub(x1, x2, z1, z2, zo, *sub_multipliers(s1, s2, so), 20, lo, hi)
        else:
            got = elementwise_mul(x1, x2, z1, z2, zo, *mul_multiplier(s1, s2, so), lo, hi)
        np.testing.assert_array_equal(got, want, err_msg=f"{op} scales {(s1, s2, so)} zero points {(z1, z2, zo)}")
        count += want.size
    assert count >= 3 * 65536


def test_softmax_params_probe_tflites_limits():
    """2**-26 is where PreprocessSoftmaxScaling aborts (multiplier 1); 40 caps the multiplier at 2**31 - 1."""
    from simulator.softmax import softmax_params

    with pytest.raises(NumericsError, match=r"at most 2\*\*-26"):
        softmax_params(2.0 ** -26)
    with pytest.raises(NumericsError, match=r"at most 2\*\*-26"):
        softmax_params(2.0 ** -25, beta=0.5)
    just_above = np.nextafter(np.float32(2.0 ** -26), np.float32(1))
    assert softmax_params(just_above) == ((1 << 30) + (1 << 7), 1, -(31 << 25))  # 2**30 * (1 + 2**-23)
    assert softmax_params(40.0) == ((1 << 31) - 1, 31, 0)
    assert softmax_params(0.05) == ref.softmax_params(float(np.float32(0.05)))


def test_softmax_matches_the_slow_reference():
    from simulator.softmax import softmax, softmax_params

    rng = np.random.default_rng(4)
    for scale, depth in ((0.004, 1), (0.05, 13), (0.3, 40), (2.0, 7), (40.0, 5)):
        scale = float(np.float32(scale))
        rows = rng.integers(-128, 128, (60, depth))
        rows[::3, : min(3, depth)] = 127  # ties at the maximum
        assert softmax(rows, *softmax_params(scale)).tolist() == ref.softmax(rows.tolist(), scale)


def test_softmax_row_sum_of_512_raises_like_tflites_abort():
    """511 equal channels sum to 511 and give 1/511 each (what BUILTIN_REF returns); 512 make TFLite abort."""
    from simulator.softmax import softmax, softmax_params

    params = softmax_params(0.0235)
    assert softmax(np.zeros((1, 511), np.int8), *params).tolist() == [[-127] * 511]
    with pytest.raises(NumericsError, match="reaches 512"):
        softmax(np.zeros((1, 512), np.int8), *params)


@pytest.mark.parametrize("depth", [10, 16])
def test_softmax_equals_tflite(depth):
    """Oracle, tolerance 0: hundreds of rows (uniform, dominant, narrow, constant, tied) at five input scales."""
    from simulator.softmax import softmax, softmax_params

    oracle = _oracle()
    cases = zip(oracle["softmax_scale"], oracle["softmax_beta"], oracle[f"softmax_d{depth}_x"],
                oracle[f"softmax_d{depth}_out"])
    for scale, beta, rows, want in cases:
        np.testing.assert_array_equal(softmax(rows, *softmax_params(scale, beta)), want,
                                      err_msg=f"input scale {scale}, beta {beta}")
    assert oracle[f"softmax_d{depth}_out"].size >= 5 * 300 * depth


def test_slow_softmax_reference_equals_tflite():
    """The second oracle agrees with the first, so the two are not wrong together."""
    oracle = _oracle()
    scale, beta = float(oracle["softmax_scale"][2]), float(oracle["softmax_beta"][2])
    rows, want = oracle["softmax_d10_x"][2][:100], oracle["softmax_d10_out"][2][:100]
    assert ref.softmax(rows.tolist(), scale, beta) == want.tolist()


def test_softmax_refuses_differences_that_overflow_int32():
    from simulator.softmax import softmax

    row = np.array([[127, -128]])
    assert softmax(row, 1 << 30, 24, -128).tolist() == [[127, -128]]  # 128 << 24 is -2**31: still an int32
    with pytest.raises(NumericsError, match="overflows int32"):
        softmax(row, 1 << 30, 24, -129)


def test_vectorized_multipliers_are_the_scalar_function_element_by_element():
    """quantize_multipliers (what conv_multipliers uses for every channel) against quantize_multiplier: random
    reals across the whole range, the carry at q = 1 - 2**-33, zero, flushed tiny values and both roundings."""
    from simulator.numerics import quantize_multipliers

    rng = np.random.default_rng(3)
    reals = np.concatenate([
        np.exp2(rng.uniform(-40, 30, 5000)) * rng.uniform(0.5, 1.0, 5000),
        [0.0, 2.0 ** -33, 2.0 ** -32, 2.0 ** -31.5, 1.0 - 2.0 ** -33, 0.5 - 2.0 ** -34, 1.0, 0.5, 2.0 ** 30 - 1]])
    for rounding in (Rounding.TFLITE_DOUBLE, Rounding.TFLITE_SINGLE):
        multipliers, shifts = quantize_multipliers(reals, rounding)
        want = [quantize_multiplier(float(r), rounding) for r in reals]
        assert multipliers.dtype == np.int32 and shifts.dtype == np.int32
        assert list(zip(multipliers.tolist(), shifts.tolist())) == want
    single = quantize_multipliers(np.array([1.0, 2.0 ** 31]), Rounding.TFLITE_SINGLE)
    assert single[0].tolist() == [1 << 30, ref.INT32_MAX] and single[1].tolist() == [1, 30]
    for bad in ([1.0, 2.0 ** 31], [0.5, -1.0], [np.nan], [np.inf]):
        with pytest.raises(NumericsError):
            quantize_multipliers(np.array(bad))
