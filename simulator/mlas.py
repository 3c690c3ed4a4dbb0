"""float32 ports of the MLAS activation kernels onnxruntime runs on x86-64, bit for bit.

One user: the compiler, through :func:`simulator.onnxruntime_numerics.qdq_table`, fills the
256-entry look-up tables of ONNX QDQ Sigmoid, Tanh and HardSwish by running
onnxruntime's own float32 algorithm on every int8 input, which makes the NPU's
table look-up bit-exact with onnxruntime (``Rounding.ONNXRUNTIME``). numpy's
correctly rounded functions are not enough: MLAS's polynomials are off by an
ulp here and there, which moves about four table entries in a million.

Which kernel onnxruntime dispatches depends on the CPU. These are the ones of
onnxruntime 1.32 on an x86-64 CPU with FMA3 (any AVX2 machine):
``MlasComputeLogisticF32KernelFma3`` (LogisticKernelFma3.S) and
``MlasComputeTanhF32KernelFma3`` (TanhKernelFma3.S), whose Horner steps are
fused multiply-adds (one rounding). CPUs without FMA run the SSE2 kernels
(separate multiply and add; logistic clamped to [0, 1]), which differ in a
few entries per ten million; they are not modelled.

Every function takes any real array (values are taken as float32) and returns float32.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def fma32(a, b, c) -> np.ndarray:
    """float32 fused multiply-add ``a * b + c`` with one rounding (half to even), element-wise.

    The float32 product is exact in float64 and ``s = p + c`` rounds at most
    once more; TwoSum gives the exact error ``e`` of that sum. Rounding ``s``
    to float32 equals rounding the exact value unless ``s`` falls exactly on
    a float32 midpoint, where the sign of ``e`` decides between the two
    neighbours (no midpoint can lie strictly between ``s`` and the exact sum:
    midpoints are float64 numbers and ``s`` is the float64 nearest to it).
    """
    a, b, c = (np.asarray(v, F32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    b_virtual = s - p
    e = (p - (s - b_virtual)) + (c - b_virtual)
    r = s.astype(F32)
    r64 = r.astype(np.float64)
    up = np.nextafter(r, F32(np.inf)).astype(np.float64)
    down = np.nextafter(r, F32(-np.inf)).astype(np.float64)
    midpoint = (2 * (s - r64) == up - r64) | (2 * (s - r64) == down - r64)
    fix = midpoint & (e != 0)
    if np.any(fix):
        r = np.array(r, copy=True)
        rf, sf, ef = r[fix], s[fix], e[fix]
        above = rf.astype(np.float64) > sf   # r rounded s up: the neighbours are (r - ulp, r)
        low = np.where(above, np.nextafter(rf, F32(-np.inf)), rf)
        high = np.where(above, rf, np.nextafter(rf, F32(np.inf)))
        r[fix] = np.where(ef > 0, high, low)
    return r


LOGISTIC_ALPHA = tuple(F32(v) for v in (4.37031012579801e-11, 1.15627324459942e-07, 6.08574864600143e-05,
                                          8.51377133304701e-03, 2.48287947061529e-01))
"""MlasLogisticConstants (logistic.cpp) alpha_9, alpha_7, alpha_5, alpha_3, alpha_1, as float32."""
LOGISTIC_BETA = tuple(F32(v) for v in (6.10247389755681e-13, 5.76102136993427e-09, 6.29106785017040e-06,
                                         1.70198817374094e-03, 1.16817656904453e-01, 9.93151921023180e-01))
"""MlasLogisticConstants beta_10, beta_8, beta_6, beta_4, beta_2, beta_0."""
LOGISTIC_LIMIT = F32(18.0)

TANH_ALPHA = tuple(F32(v) for v in (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11,
                                      5.12229709037114e-08, 1.48572235717979e-05, 6.37261928875436e-04,
                                      4.89352455891786e-03))
"""MlasTanhConstants (tanh.cpp) alpha_13 ... alpha_1, as float32."""
TANH_BETA = tuple(F32(v) for v in (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03,
                                     4.89352518554385e-03))
"""MlasTanhConstants beta_6, beta_4, beta_2, beta_0."""
TANH_LIMIT = F32(9.0)


def _horner(x2: np.ndarray, coefficients) -> np.ndarray:
    """``((c0 * x2 + c1) * x2 + c2) ...`` with one vfmadd per step, as the kernels evaluate it."""
    result = fma32(x2, coefficients[0], coefficients[1])
    for c in coefficients[2:]:
        result = fma32(x2, result, c)
    return result


def logistic(x) -> np.ndarray:
    """MLAS's float32 sigmoid (FMA3 kernel): a rational polynomial of x clamped to [-18, 18].

    ``p = x * P(x**2)``, ``q = Q(x**2)`` by fused Horner steps, then
    ``max(p / q + 0.5, 0)``. The FMA3 kernel has no upper clamp, so the
    result can exceed 1 by an ulp.
    """
    x = np.clip(np.asarray(x, F32), -LOGISTIC_LIMIT, LOGISTIC_LIMIT)
    x2 = x * x
    p = x * _horner(x2, LOGISTIC_ALPHA)
    q = _horner(x2, LOGISTIC_BETA)
    return np.maximum(p / q + F32(0.5), F32(0))


def tanh(x) -> np.ndarray:
    """MLAS's float32 tanh (FMA3 kernel): ``x * P(x**2) / Q(x**2)`` of x clamped to [-9, 9], no output clamp."""
    x = np.clip(np.asarray(x, F32), -TANH_LIMIT, TANH_LIMIT)
    x2 = x * x
    return (x * _horner(x2, TANH_ALPHA)) / _horner(x2, TANH_BETA)


HARD_SIGMOID_ALPHA = F32(1.0 / 6.0)
"""The HardSigmoid alpha of ONNX's HardSwish function body (float32 1/6; beta is 0.5)."""


def hard_swish(x) -> np.ndarray:
    """onnxruntime's HardSwish: ONNX's function body ``x * HardSigmoid(x, 1/6, 0.5)`` in float32.

    onnxruntime has no HardSwish kernel of its own: it expands the function,
    and its HardSigmoid (Eigen) multiplies then adds (two roundings, no FMA)
    before clamping to [0, 1].
    """
    x = np.asarray(x, F32)
    return x * np.clip(HARD_SIGMOID_ALPHA * x + F32(0.5), F32(0), F32(1))


def leaky_relu(x, alpha) -> np.ndarray:
    """onnxruntime's LeakyRelu: ``x >= 0 ? x : float32(alpha) * x`` in float32."""
    x = np.asarray(x, F32)
    return np.where(x >= 0, x, F32(alpha) * x)
