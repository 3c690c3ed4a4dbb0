"""How much wider than the calibration's range a model output is quantized, chosen by cross-validation.

A tensor the model returns (its logits) feeds nothing after it, and its
quantization error lands in the result as it is. Its two costs are uneven: a
wider range costs rounding noise, ``scale**2 / 12`` per value, while a value
beyond the range costs its whole excess squared. A range read from 100
calibration samples is the range of those samples: the next sample exceeds
it about once in a hundred, and the logits' tails are where the large,
decisive values are (MobileNet-like digits model: 6 of the 4,000 test logits
past the calibrated range cost a fifth of the logits' error energy).

:func:`widened_range` estimates the right headroom from the calibration samples
alone: each tenth of them is quantized with the range the method chooses from
the other nine tenths, widened by a factor ``a``, and the factor with the least
total error over the ten held-out tenths (rounding and clipping together,
exactly as the host dequantizes) widens the range chosen from all samples.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .config import CROSS_VALIDATED
from .rewrite import TensorQ
from .steps import dequantize_host, quantize_host

FOLDS = 10
"""Parts the calibration samples are cut into (fewer samples: one each). Leave-one-out would mirror "the
next sample" most closely but recomputes the method once per sample."""
FACTORS = tuple(round(1.0 + 0.02 * k, 2) for k in range(51))
"""Widening factors tried: 1.00 (the method's own range) to 2.00 in steps of 0.02."""


def _error(values: np.ndarray, q: TensorQ) -> float:
    """Squared error of ``values`` quantized and dequantized as the host does."""
    r = (dequantize_host(quantize_host(values, q), q).astype(np.float64) - values).reshape(-1)
    return float(np.dot(r, r))


def held_out_factor(samples: np.ndarray, method_range: Callable, qparams: Callable) -> float:
    """The factor of :data:`FACTORS` whose widened ranges quantize held-out samples with the least squared error.

    ``samples``: ``[N, *shape]``; ``method_range(subset) -> (lo, hi)``: the calibration method on some of them;
    ``qparams(lo, hi) -> TensorQ``: the activation qparams of a range (symmetry, power-of-two scales).
    """
    samples = np.asarray(samples)
    folds = np.array_split(np.arange(len(samples)), min(FOLDS, len(samples)))
    if len(folds) < 2:
        return 1.0
    totals = np.zeros(len(FACTORS))
    for fold in folds:
        lo, hi = method_range(np.delete(samples, fold, axis=0))
        for k, a in enumerate(FACTORS):
            totals[k] += _error(samples[fold], qparams(lo * a, hi * a))
    return FACTORS[int(np.argmin(totals))]  # the first of equal errors: ties keep the narrower range


def widened_range(samples: np.ndarray, lo: float, hi: float, headroom, method_range: Callable,
                  qparams: Callable) -> tuple[float, float, float]:
    """The range ``[lo, hi]`` chosen from all samples, widened as ``headroom`` says (``"cross_validated"``: by
    :func:`held_out_factor`; a number ``h``: by ``1 + h``). Returns (lo, hi, the factor)."""
    factor = held_out_factor(samples, method_range, qparams) if headroom == CROSS_VALIDATED else 1.0 + headroom
    return lo * factor, hi * factor, factor
