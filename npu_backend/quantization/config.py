"""What post-training quantization may choose, and what the NPU imposes, as one validated value.

Every knob of the old ``relay.quantize`` qconfig (bit widths, a global scale,
layers to skip, calibration mode) and of onnxruntime's ``quantize_static``
(methods, per-channel weights, symmetric activations) has a field here; the
hardware constraints (power-of-two scales, rounding, accumulator width) are
fields too, because a scale the NPU cannot honour is not a choice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from simulator.config import DEFAULT_PRESET, NpuConfig

from ..errors import NpuError

METHOD_NAMES = ("minmax", "percentile", "kl", "mse")
FLOAT_MODEL_METHODS = frozenset({"kl"})
"""Range methods that observe a layer's output in the float model rather than on its quantized inputs. KL's
divergence compares continuous distributions, as TensorRT and onnxruntime (which calibrate the float model) feed
it; on quantized inputs a table operator's output (hard swish, sigmoid) takes at most 256 values, a comb whose
coarse re-binning looks lossless, so KL kept clipping such tensors to a fraction of their range (MobileNet-like
digits model: 2.97 dB)."""
ROUNDINGS = {
    "tflite": "tflite",
    "onnxruntime": "onnx",
}
"""Requantization rounding the NPU implements -> the source whose numerics it reproduces
(``tflite``: fixed-point multipliers rounding half away from zero; ``onnxruntime``: float scales rounding half
to even). Half-up is not a rounding any reference runtime uses, so the NPU has no such mode."""
OVERFLOWS = ("wrap", "saturate")
WEIGHT_ROUNDINGS = ("nearest", "least_squares")
"""How a weight's integer is chosen on its channel's grid (``least_squares``: :mod:`.reconstruct`)."""
CROSS_VALIDATED = "cross_validated"
"""``QConfig.output_headroom`` chosen from the calibration samples (:mod:`.headroom`)."""


def _check(condition: bool, field: str, why: str) -> None:
    if not condition:
        raise NpuError(f"QConfig.{field}: {why}")


@dataclass(frozen=True)
class QConfig:
    """Post-training quantization settings (defaults: TFLite-style int8, per-channel weights).

    Attributes
    ----------
    calibration : str or callable
        How an activation's range is chosen from its calibration statistics: ``"minmax"``, ``"percentile"``
        (of ``percentile``), ``"kl"`` (entropy, histogram based), ``"mse"`` (least expected squared error), or
        ``f(stats, request) -> (lo, hi)`` (see :mod:`npu_backend.quantization.observers`).
    percentile : float
        The percentile the ``"percentile"`` method keeps (of ``|x|`` when symmetric).
    per_channel : bool
        Weights get one scale per output channel (zero point 0); else one per tensor.
    weight_bits : int
        2 to 8: weights are stored in int8 but restricted to ``±(2**(bits-1) - 1)``.
    symmetric_activations : bool
        Activations get zero point 0 (else the range's own, asymmetric).
    power_of_two : bool
        Activation and weight scales are powers of two, so requantization is a shift (rounded up: nothing
        clipped).
    rounding : str
        ``"tflite"`` or ``"onnxruntime"``: which reference's requantization the NPU reproduces.
    accumulator_bits : int
        14 to 32: width of the NPU's accumulators (the hardware run is configured with it).
    accumulator_overflow : str
        ``"wrap"`` or ``"saturate"``: what a too-wide sum does on that accumulator.
    avoid_overflow : bool
        Widen weight scales, channel by channel, until no accumulator overflows on the calibration set; the
        report says which layers needed it and which could not be fixed.
    global_scale : float or None
        The old workflow's global-scale mode: every activation on the fixed range ``[-g, g]`` (no calibration).
    skip_layers : tuple
        Layers kept in float on the host, by name (``conv2d_0``, see the report) or by index among the
        quantizable layers (``0`` is the first).
    float_ops : tuple of str
        Operator kinds kept in float everywhere (e.g. ``("sigmoid",)``; names as in the report).
    fallback_budget_db : float or None
        Automatic float fall-back: a layer whose quantization costs the model's output more than this many dB
        of SQNR (measured by calibrating again with it in float) stays in float on the host; costliest first,
        each kept only if it still gains more than the budget.
    float_reference : bool
        Run the float model beside calibration, on the first :attr:`reference_samples` samples: the report's SQNR
        against float (per layer and at the outputs), bias correction, the ``"kl"`` method (which observes the
        float model), least-squares weight rounding and the float fall-back all read it. ``False`` computes only
        the quantized model's integers (what onnxruntime's ``quantize_static`` does: ranges, no float
        comparison); the report's SQNR columns are then empty, and the settings that need the float model must
        be off (``bias_correction=False``), or the config is refused.
    reference_samples : int or None
        How many calibration samples (the first ones) the float model runs on: bias correction's means, the report's
        SQNR against float and the float fall-back's measurements are taken on them, and the report's int8 summaries
        of ranges read from extremes; ``None`` (or any count at least the samples', as a TOML grid, which has no
        None, says it): every sample. The ranges are always observed on every sample. The float model's pass was as
        much work as the quantized one and most of calibration's memory (MobileNetV2-224, 100 samples, one
        calibration in a fresh process: 6.5 s with it on all of them, 4.0 s on 16, 3.3 s without it). A channel's
        mean error over 16 samples' pixels is already precise (AIMET too takes bias correction's statistics on fewer
        samples than its ranges): on the digits models, 16, 32, 50 or all 100 samples gave output SQNRs within a
        third of a dB of each other and top-1 within 5 of 400 test images, as noisy as that; with 8 or 12 the
        MobileNet-like net fell to 94.5-94.75% (the anchors: 95%). ``"kl"`` and least-squares rounding read the
        float model on every sample they observe, so they run it on every sample whatever this says.
    bias_correction : bool
        Empirical bias correction: each biased layer's bias absorbs the mean difference, per output channel,
        between the float model's accumulator and the quantized model's (weight rounding and upstream error)
        over the calibration set.
    weight_rounding : str
        ``"nearest"``: each weight rounded to its nearest step. ``"least_squares"``: each weighted layer's integers
        chosen together to minimise the layer's output error against the float model on its quantized inputs
        (ridge least squares, then GPTQ-style rounding; :mod:`npu_backend.quantization.reconstruct`): same
        scales, zero point 0 and range, so the NPU still equals the simulation. Worth most at low weight bits.
    output_headroom : str or float
        How much wider than the calibration method's range the model's outputs are quantized (they feed
        nothing after them: a wider range costs a little rounding, an unseen value past it costs its whole
        excess). ``"cross_validated"``: the factor from 1 to 2 that quantizes each tenth of the calibration
        samples best under the range chosen from the other nine tenths
        (:mod:`npu_backend.quantization.headroom`); a number ``h`` from 0 to 1: the range times ``1 + h``.
    bins : int
        Histogram bins of the calibration statistics.
    preset : NpuConfig or str
        The NPU the quantized model is simulated on (its accumulator width is replaced by ``accumulator_bits``).
    """

    calibration: str | Callable = "minmax"
    percentile: float = 99.99
    per_channel: bool = True
    weight_bits: int = 8
    symmetric_activations: bool = False
    power_of_two: bool = False
    rounding: str = "tflite"
    accumulator_bits: int = 32
    accumulator_overflow: str = "wrap"
    avoid_overflow: bool = False
    global_scale: float | None = None
    skip_layers: tuple = ()
    float_ops: tuple = ()
    fallback_budget_db: float | None = None
    float_reference: bool = True
    reference_samples: int | None = 16
    bias_correction: bool = True
    weight_rounding: str = "nearest"
    output_headroom: str | float = CROSS_VALIDATED
    bins: int = 2048
    preset: NpuConfig | str = DEFAULT_PRESET

    def __post_init__(self) -> None:
        method = self.calibration
        _check(callable(method) or method in METHOD_NAMES, "calibration",
               f"{method!r} is neither one of {', '.join(METHOD_NAMES)} nor a callable")
        _check(isinstance(self.percentile, (int, float)) and 50.0 < self.percentile <= 100.0, "percentile",
               f"{self.percentile!r} is not in (50, 100]")
        for name in ("per_channel", "symmetric_activations", "power_of_two", "avoid_overflow", "float_reference",
                     "bias_correction"):
            _check(isinstance(getattr(self, name), bool), name, f"{getattr(self, name)!r} is not a bool")
        _check(_is_int(self.weight_bits) and 2 <= self.weight_bits <= 8, "weight_bits",
               f"{self.weight_bits!r} is not an integer from 2 to 8")
        _check(self.rounding in ROUNDINGS, "rounding",
               f"{self.rounding!r} is not one of {', '.join(ROUNDINGS)} (the requantizations the NPU implements)")
        _check(_is_int(self.accumulator_bits) and 14 <= self.accumulator_bits <= 32, "accumulator_bits",
               f"{self.accumulator_bits!r} is not an integer from 14 to 32")
        _check(self.accumulator_overflow in OVERFLOWS, "accumulator_overflow",
               f"{self.accumulator_overflow!r} is not one of {', '.join(OVERFLOWS)}")
        _check(self.global_scale is None or (isinstance(self.global_scale, (int, float))
                                             and math.isfinite(self.global_scale) and self.global_scale > 0),
               "global_scale", f"{self.global_scale!r} is not a positive finite number")
        _check(isinstance(self.skip_layers, tuple) and all(isinstance(s, str) or _is_int(s) and s >= 0
                                                          for s in self.skip_layers),
               "skip_layers", "must be a tuple of layer names or non-negative indices")
        _check(isinstance(self.float_ops, tuple) and all(isinstance(s, str) for s in self.float_ops),
               "float_ops", "must be a tuple of operator kinds")
        _check(self.fallback_budget_db is None or (isinstance(self.fallback_budget_db, (int, float))
                                                   and math.isfinite(self.fallback_budget_db)
                                                   and self.fallback_budget_db >= 0),
               "fallback_budget_db", f"{self.fallback_budget_db!r} is not a non-negative number of dB")
        _check(self.reference_samples is None or _is_int(self.reference_samples) and self.reference_samples >= 1,
               "reference_samples", f"{self.reference_samples!r} is neither None (every sample) nor a positive "
               "integer")
        _check(self.weight_rounding in WEIGHT_ROUNDINGS, "weight_rounding",
               f"{self.weight_rounding!r} is not one of {', '.join(WEIGHT_ROUNDINGS)}")
        _check(self.output_headroom == CROSS_VALIDATED if isinstance(self.output_headroom, str) else
               isinstance(self.output_headroom, (int, float)) and not isinstance(self.output_headroom, bool)
               and 0 <= self.output_headroom <= 1, "output_headroom",
               f"{self.output_headroom!r} is neither {CROSS_VALIDATED!r} nor a number from 0 to 1")
        _check(_is_int(self.bins) and 16 <= self.bins <= 65536, "bins", f"{self.bins!r} is not from 16 to 65536")
        _check(isinstance(self.preset, (NpuConfig, str)), "preset", "must be an NpuConfig or a preset name/file")
        if not self.float_reference:
            for name, needs in (("bias_correction", self.bias_correction),
                                ("calibration", self.calibration in FLOAT_MODEL_METHODS),
                                ("weight_rounding", self.weight_rounding == "least_squares"),
                                ("fallback_budget_db", self.fallback_budget_db is not None)):
                _check(not needs, name, f"{getattr(self, name)!r} needs the float model, and float_reference is False")

    def replace(self, **changes) -> QConfig:
        return dataclasses.replace(self, **changes)

    def compared_samples(self, samples: int) -> int:
        """How many of ``samples`` calibration samples (the first) the float model runs on
        (:attr:`reference_samples`; all of them for the settings that read it on every observed sample)."""
        if (self.reference_samples is None or self.calibration in FLOAT_MODEL_METHODS
                or self.weight_rounding == "least_squares"):
            return samples
        return min(samples, self.reference_samples)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
