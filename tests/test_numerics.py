"""simulator.numerics against TFLite's definitions and an independent per-element oracle."""

import math

import numpy as np
import pytest

import reference_kernels as ref
from simulator import NumericsError
from simulator.numerics import (Rounding, conv_multipliers, fully_connected_multiplier,
                                multiply_by_quantized_multiplier, quantize_multiplier, requantize)


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
    from simulator.numerics import logistic_table, tanh_table

    x = np.arange(-128, 128)
    s_in, zp = 0.0625, 5
    real = (x - zp) * s_in
    sigmoid = np.clip(np.round(1 / (1 + np.exp(-real)) * 256) - 128, -128, 127)
    tanh = np.clip(np.round(np.tanh(real) * 128), -128, 127)
    assert np.max(np.abs(logistic_table(s_in, zp).astype(int) - sigmoid)) <= 1
    assert np.max(np.abs(tanh_table(s_in, zp).astype(int) - tanh)) <= 1
    assert logistic_table(s_in, zp)[zp + 128] == 0  # logistic(0) = 0.5 -> 128/256 - 128


def test_activation_tables_equal_tflite_on_every_input_across_scales():
    """Exhaustive oracle: BUILTIN_REF's LOGISTIC/TANH/HARD_SWISH of all 256 inputs at 7 input scales each."""
    from conftest import FIXTURES
    from simulator.numerics import hard_swish_table, logistic_table, tanh_table

    sweep = np.load(FIXTURES / "tflite" / "activation_tables.npz")
    generators = {"logistic": lambda s, z, so, zo: logistic_table(s, z),
                  "tanh": lambda s, z, so, zo: tanh_table(s, z), "hard_swish": hard_swish_table}
    assert len(sweep["kind"]) == 21
    for kind, s, z, so, zo, table in zip(sweep["kind"], sweep["input_scale"], sweep["input_zero_point"],
                                         sweep["output_scale"], sweep["output_zero_point"], sweep["table"]):
        np.testing.assert_array_equal(generators[str(kind)](float(s), int(z), float(so), int(zo)), table,
                                      err_msg=f"{kind} at input scale {s}")


def test_hard_swish_table_tracks_the_real_function():
    from simulator.numerics import hard_swish_table

    s_in, s_out, zo = 0.04, 0.02, -100
    real = (np.arange(-128, 128)) * s_in
    want = np.clip(np.round(real * np.clip(real + 3, 0, 6) / 6 / s_out) + zo, -128, 127)
    assert np.max(np.abs(hard_swish_table(s_in, 0, s_out, zo).astype(int) - want)) <= 1
