"""256-entry tables of TFLite's int8 activations, as its reference kernels compute them.

An elementwise int8 operator is exactly its table: LOGISTIC and TANH from
gemmlowp fixed point, HARD_SWISH and LEAKY_RELU from their integer kernels,
QUANTIZE int8 -> int8 from the requantizer, and the ``LUTPopulate`` family
(EXP, GELU) from float32 functions.
"""

from __future__ import annotations

import math

import numpy as np

from . import fixedpoint
from .errors import NumericsError
from .numerics import Rounding, multiply_by_quantized_multiplier, quantize_multiplier, requantize


LUT_INPUT_INTEGER_BITS = 4
"""TFLite's int8 LOGISTIC and TANH rescale inputs to Q4 (activations.cc, kInputIntegerBits)."""


def _lut_input_rescale(input_scale: float):
    """(multiplier, left shift, radius) as TFLite's sigmoid/tanh Prepare computes them."""
    real = float(np.float32(input_scale)) * float(1 << (31 - LUT_INPUT_INTEGER_BITS))
    if real <= 1.0:
        raise NumericsError(f"LOGISTIC/TANH input scale {input_scale} is too small for the Q4 rescale")
    multiplier, shift = quantize_multiplier(real)
    max_rescaled = ((1 << LUT_INPUT_INTEGER_BITS) - 1) * (1 << (31 - LUT_INPUT_INTEGER_BITS)) / (1 << shift)
    return multiplier, shift, int(math.floor(max_rescaled))


def _activation_table(input_scale, input_zero_point, function, output_shift: int, output_offset: int):
    multiplier, shift, radius = _lut_input_rescale(input_scale)
    table = np.empty(256, dtype=np.int8)
    for index, value in enumerate(range(-128, 128)):
        centred = value - int(input_zero_point)
        if centred <= -radius:
            out = -128
        elif centred >= radius:
            out = 127
        else:
            q4 = int(multiply_by_quantized_multiplier(np.array([centred]), multiplier, shift)[0])
            raw = function(q4, LUT_INPUT_INTEGER_BITS)
            out = fixedpoint.rounding_divide_by_pot(raw, output_shift) + output_offset
        table[index] = min(max(out, -128), 127)
    return table


LOGISTIC_OUTPUT = (1.0 / 256, -128)
"""(scale, zero point): TFLite's int8 LOGISTIC exists only with this output (activations.cc)."""
TANH_OUTPUT = (1.0 / 128, 0)
"""(scale, zero point): TFLite's int8 TANH exists only with this output."""


def logistic_table(input_scale, input_zero_point) -> np.ndarray:
    """int8 LOGISTIC of every input -128..127, as reference_integer_ops::Logistic computes it (output
    :data:`LOGISTIC_OUTPUT`: Q0.8 offset by the zero point)."""
    return _activation_table(input_scale, input_zero_point, fixedpoint.logistic, 31 - 8, LOGISTIC_OUTPUT[1])


def tanh_table(input_scale, input_zero_point) -> np.ndarray:
    """int8 TANH of every input -128..127, as reference_integer_ops::Tanh computes it (output
    :data:`TANH_OUTPUT`: Q0.7)."""
    return _activation_table(input_scale, input_zero_point, fixedpoint.tanh, 31 - 7, TANH_OUTPUT[1])


def requantize_table(input_scale, input_zero_point, output_scale, output_zero_point,
                     rounding=Rounding.TFLITE_DOUBLE) -> np.ndarray:
    """int8 -> int8 requantization (TFLite QUANTIZE with an int8 input) of every input -128..127.

    reference_ops::Requantize: multiplier from double(s_in) / double(s_out),
    ``MultiplyByQuantizedMultiplier(x - z_in) + z_out``, saturated to int8.
    """
    multiplier, shift = quantize_multiplier(float(np.float32(input_scale)) / float(np.float32(output_scale)),
                                            rounding)
    values = np.arange(-128, 128, dtype=np.int64) - int(input_zero_point)
    return requantize(values, multiplier, shift, output_zero_point, -128, 127, rounding)


def leaky_relu_table(input_scale, input_zero_point, output_scale, output_zero_point, alpha) -> np.ndarray:
    """int8 LEAKY_RELU of every input -128..127, as reference_ops::QuantizeLeakyRelu computes it.

    TFLite's Prepare forms both multipliers in float32 (``s_in * alpha / s_out``
    and ``s_in / s_out``) before QuantizeMultiplier widens them to double.
    """
    s_in, s_out, a = np.float32(input_scale), np.float32(output_scale), np.float32(alpha)
    alpha_m, alpha_s = quantize_multiplier(float(np.float32(np.float32(s_in * a) / s_out)))
    ident_m, ident_s = quantize_multiplier(float(np.float32(s_in / s_out)))
    values = np.arange(-128, 128, dtype=np.int64) - int(input_zero_point)
    scaled = np.where(values >= 0, multiply_by_quantized_multiplier(values, ident_m, ident_s),
                      multiply_by_quantized_multiplier(values, alpha_m, alpha_s))
    return np.clip(scaled + int(output_zero_point), -128, 127).astype(np.int8)


def hard_swish_table(input_scale, input_zero_point, output_scale, output_zero_point) -> np.ndarray:
    """int8 HARD_SWISH of every input -128..127, as reference_ops::HardSwish computes it.

    Prepare works in float32: the input on a "hires" scale s_in / 128, rescaled
    to the output and to the "reluish" scale 3 / 32768, each multiplier then
    quantized to Q31 and rounded down to Q15.
    """
    hires = np.float32(np.float32(1.0 / 128.0) * np.float32(input_scale))
    output_m, output_e = quantize_multiplier(float(np.float32(hires / np.float32(output_scale))))
    reluish_m, reluish_e = quantize_multiplier(float(np.float32(hires / np.float32(3.0 / 32768.0))))
    if output_e > 0:
        raise NumericsError("HARD_SWISH output scale is below the input scale / 128")
    output_m16 = fixedpoint.downscale_multiplier_to_int16(output_m)
    reluish_m16 = fixedpoint.downscale_multiplier_to_int16(reluish_m)
    table = [fixedpoint.hard_swish(v - int(input_zero_point), reluish_m16, reluish_e, output_m16, output_e)
             + int(output_zero_point) for v in range(-128, 128)]
    return np.clip(np.array(table), -128, 127).astype(np.int8)


def lut_populate(function, input_scale, input_zero_point, output_scale, output_zero_point) -> np.ndarray:
    """int8 table of TFLite's ``LUTPopulateInt8`` (kernels/internal/common.h), used by its int8 EXP (and ELU, GELU).

    In float32: ``dequantized = s_in * (q - z_in)``, ``transformed = f(dequantized)``,
    ``round(transformed * (1 / s_out))`` half away from zero (``std::round``), plus
    ``z_out``, saturated. ``function`` is evaluated in float64 and rounded to
    float32, i.e. the correctly rounded float function, as glibc's ``expf`` is.
    """
    s_in, s_out = np.float32(input_scale), np.float32(output_scale)
    if not (np.isfinite(s_in) and np.isfinite(s_out) and s_in > 0 and s_out > 0):
        raise NumericsError("table scales must be positive and finite")
    dequantized = s_in * (np.arange(-128, 128) - int(input_zero_point)).astype(np.float32)
    with np.errstate(over="ignore"):
        transformed = np.asarray(function(dequantized.astype(np.float64)), dtype=np.float64).astype(np.float32)
        scaled = (transformed * (np.float32(1.0) / s_out)).astype(np.float64)
    rounded = np.where(np.isfinite(scaled), np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), np.sign(scaled) * 256)
    return np.clip(rounded + int(output_zero_point), -128, 127).astype(np.int8)


def tflite_elu(x) -> np.ndarray:
    """TFLite's int8 ELU transform (activations.cc, EluPrepare): ``x < 0 ? expm1(x) : x``.

    Checked against TFLite's kernel on qparams chosen so that ``expm1`` and
    ``exp(x) - 1`` give different tables: ``expm1`` it is.
    """
    x = np.asarray(x, dtype=np.float64)
    return np.where(x < 0, np.expm1(np.minimum(x, 0)), x)


def tflite_gelu(x) -> np.ndarray:
    """TFLite's ``GeluTransform`` in float32: ``0.5f * x * erfc(x * float(-sqrt(1/2)))``.

    Older TFLite wrote ``0.5f * x * (1 + erf(x * M_SQRT1_2))`` in double; both give
    the same table on every entry of the fixture tests/fixtures/tflite/gelu.npz.
    """
    x32 = np.asarray(x, dtype=np.float32)
    scaled = x32 * np.float32(-math.sqrt(0.5))
    complement = np.array([math.erfc(float(v)) for v in scaled.ravel()], dtype=np.float32).reshape(scaled.shape)
    return (np.float32(0.5) * x32 * complement).astype(np.float64)


def tflite_gelu_tanh(x) -> np.ndarray:
    """TFLite's ``GeluTransformApproximate``, all float32:
    ``0.5f * x * (1 + tanh(float(sqrt(2/pi)) * (x + 0.044715f * x * x * x)))``."""
    x32 = np.asarray(x, dtype=np.float32)
    inner = x32 + np.float32(0.044715) * x32 * x32 * x32
    t = np.tanh((np.float32(math.sqrt(2.0 / math.pi)) * inner).astype(np.float64)).astype(np.float32)
    return (np.float32(0.5) * x32 * (np.float32(1.0) + t)).astype(np.float64)
