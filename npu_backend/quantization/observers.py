"""Calibration statistics of float tensors, and the ways an int8 range is chosen from them.

Post-training quantization sees a tensor batch by batch, so :class:`TensorStats`
keeps only what fits in a few kilobytes whatever the calibration set: min, max,
exact moments and a symmetric histogram. The range methods in :data:`METHODS`
are the ones onnxruntime's calibrators offer (``MinMax``, ``Percentile``,
``Entropy``, in ``onnxruntime/quantization/calibrate.py``) plus a least-squared-error
search; ``"kl"`` is TensorRT's entropy calibration (Migacz, "8-bit inference with
TensorRT", GTC 2017). :func:`activation_qparams` and :func:`quantize_weights` turn
ranges and weights into the int8 parameters TFLite-style kernels take.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from ..errors import NpuError
from . import kernels
from .parallel import run_all

ZERO_RANGE_HI = 2.0 ** -8
"""Upper end of the range given to a tensor that was exactly 0 on every calibration value.

Any scale represents zeros exactly; the scale only matters for the requantization of the layer
producing the tensor. Small enough that unseen values are clipped near 0 (as minmax clips at the observed
max), large enough that the producer's multipliers stay representable: int8 ADD refuses an output scale
at or below ``2 * input_scale / 2**20``, i.e. this range works for inputs with scales up to 8.
"""

_FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def _storage_limits(bits: int) -> tuple[int, int]:
    """(qmin, qmax) of a ``bits``-wide integer stored in int8: [-128, 127] for 8 bits."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def _check_bits(bits, where: str) -> None:
    if not (isinstance(bits, int) and not isinstance(bits, bool) and 2 <= bits <= 8):
        raise NpuError(f"{where}: bits={bits!r} is not an integer from 2 to 8 (values are stored in int8)")


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


UPDATE_BLOCK = 1 << 16
"""Values a sample's deviations from its mean are converted to float64 and summed at a time (its squared
deviations are the sum of the blocks' dot products: a constant of the statistics, like the bins)."""
HISTOGRAM_BLOCK = 1 << 17
"""Values a sample's bin indices are computed and counted at a time (integer counts: any block gives the same;
larger blocks spend less on per-call overhead, smaller ones stay in cache)."""

_buffers = threading.local()


def _block_buffers() -> tuple[np.ndarray, np.ndarray]:
    """This thread's float64 and bin index buffers of :data:`HISTOGRAM_BLOCK` values (reused). The indices are
    int32: a sample's values lie within its grid (:meth:`TensorStats.update_each` widens the grid to the sample's
    extremes first), so ``floor(x * scale)`` is within ``bins / 2 + 1`` in magnitude, and numpy floors to int32
    twice as fast as to int64."""
    if not hasattr(_buffers, "pair"):
        _buffers.pair = (np.empty(max(UPDATE_BLOCK, HISTOGRAM_BLOCK)), np.empty(HISTOGRAM_BLOCK, np.int32))
    return _buffers.pair


def _real(values) -> np.ndarray:
    values = np.asarray(values)
    if values.dtype.kind not in "fiu":
        raise NpuError(f"calibration values must be real numbers, not {values.dtype}")
    return values


@dataclass(frozen=True)
class _Moments:
    """One sample's share of the statistics, computed from its values alone."""

    smallest: float
    largest: float
    count: int
    mean: float
    squares: float
    """Sum of squared deviations from the sample's own mean (Chan's merge adds the rest)."""
    zeros: int


def _moments(values: np.ndarray) -> _Moments | None:
    """The sample's extremes, mean, squared deviations and zeros; None if it holds NaN or infinity.

    The values' own type serves the extremes and the zeros (exact in any type); the deviations from the mean
    are formed in float64 a block at a time."""
    smallest, largest = values.min(), values.max()
    if not (np.isfinite(smallest) and np.isfinite(largest)):  # a NaN anywhere makes both NaN
        return None
    n = values.size
    mean = float(np.sum(values, dtype=np.float64)) / n
    x, _ = _block_buffers()
    squares = 0.0
    for start in range(0, n, UPDATE_BLOCK):
        block = values[start:start + UPDATE_BLOCK]
        v = x[:block.size]
        np.subtract(block, mean, out=v, dtype=np.float64)
        squares += float(np.dot(v, v))
    return _Moments(float(smallest), float(largest), n, mean, squares, int(np.count_nonzero(values == 0)))


def _sample_counts(values: np.ndarray, grid: float, bins: int, moments: _Moments) -> np.ndarray | None:
    """The sample's histogram on the grid ``[-grid, grid]`` (None while the grid is empty: all values 0 so far).

    Bin index ``floor(x * scale) + half`` with ``x * scale`` in float64, clipped to the bins: the floor lands in
    an integer buffer directly. The product and the floor are monotone in ``x``, so the sample's extremes say
    whether anything needs clipping at all."""
    if grid == 0.0:
        return None
    half = bins // 2
    scale = half / grid
    lowest = math.floor(moments.smallest * scale) + half
    highest = math.floor(moments.largest * scale) + half
    clip = lowest < 0 or highest > bins - 1
    x, index = _block_buffers()
    counts = np.zeros(bins, np.int64)
    for start in range(0, values.size, HISTOGRAM_BLOCK):
        block = values[start:start + HISTOGRAM_BLOCK]
        v, i = x[:block.size], index[:block.size]
        np.multiply(block, scale, out=v, dtype=np.float64)
        np.floor(v, out=i, casting="unsafe")  # an integer-valued float64: the conversion is exact
        i += half
        if clip:
            np.clip(i, 0, bins - 1, out=i)
        counts += np.bincount(i, minlength=bins)
    return counts


def _widened_range(current: float, absmax: float) -> tuple[float, int]:
    """The histogram range after seeing ``absmax`` (``> current``), and how many old bins one new bin holds
    (0 when there was no grid yet: the first nonzero value sets it)."""
    if current == 0.0:
        return absmax, 0
    ratio = absmax / current
    k = math.ceil(ratio) if math.isfinite(ratio) else 0
    while k and k * current < absmax:
        k += 1
    new_range = k * current
    if not k or not math.isfinite(new_range):
        raise NpuError(f"calibration values up to {absmax:g} overflow the histogram's range")
    return new_range, k


class Batches:
    """Samples that arrive a batch at a time: ``batches()`` gives arrays ``[k, ...]``, each valid until the next.
    Iterating gives the samples one by one; :meth:`TensorStats.update_samples` takes each batch whole."""

    def __init__(self, batches: Callable[[], Iterable[np.ndarray]]):
        self.batches = batches

    def __iter__(self):
        for batch in self.batches():
            yield from batch


@dataclass(eq=False)
class TensorStats:
    """Streaming statistics of one float tensor over the calibration set.

    ``update`` takes each batch once and keeps no values: min, max, count, the count of exact zeros, an exact
    running mean and sum of squared deviations (Chan's pairwise merge, so ``std`` does not suffer from the
    cancellation of ``E[x^2] - E[x]^2``), and a histogram of ``bins`` bins (an even number, so 0 is an edge
    and the histogram of ``|x|`` is the signed one folded).

    Attributes
    ----------
    bins : int
        Histogram bins over ``[-R, R]``; even, at least 2.
    min, max : float
        Observed extremes (``+inf`` and ``-inf`` before any update).
    count : int
        Number of values seen.
    zeros : int
        Number of values exactly 0 (they quantize without error; the ``"mse"`` method uses it).
    """

    bins: int = 2048
    min: float = field(default=math.inf, init=False)
    max: float = field(default=-math.inf, init=False)
    count: int = field(default=0, init=False)
    zeros: int = field(default=0, init=False)
    _mean: float = field(default=0.0, init=False, repr=False)
    _m2: float = field(default=0.0, init=False, repr=False)
    _range: float = field(default=0.0, init=False, repr=False)
    _counts: np.ndarray = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.bins, int) and not isinstance(self.bins, bool)
                and self.bins >= 2 and self.bins % 2 == 0):
            raise NpuError(f"TensorStats.bins={self.bins!r} is not an even integer >= 2 (0 must be a bin edge)")
        self._counts = np.zeros(self.bins, np.int64)

    def update(self, values) -> None:
        """Add a batch of values (any shape). NaN or infinity raises :class:`NpuError`; nothing is skipped."""
        values = _real(values)
        self.update_each(values.reshape(1, -1))

    def update_samples(self, samples) -> None:
        """:meth:`update` with each sample, in order: ``samples`` is an array ``[N, ...]``, :class:`Batches`, or
        any iterable of arrays (updated one by one)."""
        if isinstance(samples, np.ndarray):
            self.update_each(samples)
        elif isinstance(samples, Batches):
            for batch in samples.batches():
                self.update_each(batch)
        else:
            for sample in samples:
                self.update(sample)

    def update_each(self, samples) -> None:
        """:meth:`update` with each sample of ``samples`` (an array ``[N, ...]``), one after the other.

        The result is that of N calls, bit for bit; the passes over each sample's values (its extremes and
        moments, then its histogram on the grid it meets) run on the worker threads (:mod:`.parallel`), and only
        the per-sample scalars and the histogram merges are sequential. A sample holding NaN or infinity raises
        :class:`NpuError` after the samples before it were added.
        """
        rows = _real(samples)
        if rows.size == 0:
            return
        rows = rows.reshape(len(rows), -1) if rows.ndim else rows.reshape(1, 1)
        moments = run_all(_moments, rows)
        # The grid each sample is binned on depends on the samples before it: found from the extremes alone.
        grids, failure = [], None
        low, high, current = self.min, self.max, self._range
        for m in moments:
            if m is None:
                failure = NpuError("calibration values holds NaN or infinite values")
                break
            low, high = min(low, m.smallest), max(high, m.largest)
            if max(-low, high) > current:
                try:
                    current = _widened_range(current, max(-low, high))[0]
                except NpuError as error:  # before anything of this sample is added, as one update would
                    failure = error
                    break
            grids.append(current)
        counts = run_all(lambda k: _sample_counts(rows[k], grids[k], self.bins, moments[k]), range(len(grids)))
        for m, grid, sample_counts in zip(moments, grids, counts):
            low, high = min(self.min, m.smallest), max(self.max, m.largest)
            if max(-low, high) > self._range:
                self._widen(max(-low, high))
            total = self.count + m.count
            delta = m.mean - self._mean
            self._mean += delta * m.count / total
            self._m2 += m.squares + delta * delta * self.count * m.count / total
            self.count, self.min, self.max = total, low, high
            self.zeros += m.zeros
            if sample_counts is None:  # all zeros so far: they belong to the bin [0, w) of whatever grid comes
                self._counts[self.bins // 2] += m.count
            else:
                self._counts += sample_counts
        if failure is not None:
            raise failure

    def _widen(self, absmax: float) -> None:
        """Grow the histogram's range to ``k * R`` (``k`` the smallest integer covering ``absmax``).

        onnxruntime's ``HistogramCollector.merge_histogram`` keeps its bin width and adds bins on both sides, so
        its bin count grows with the data. With a fixed bin count the new bins must be wider; making them exactly
        ``k`` old bins wide keeps 0 on an edge and puts each old bin inside one new bin, so the merge moves no
        mass to a wrong bin: the result is exactly the histogram of all values seen on the final grid (up to values
        within a rounding error of an edge). The price is resolution: the final ``R`` lies in
        ``[max|x|, 2 * max|x|)``, so at least half the bins cover the data.
        """
        new_range, k = _widened_range(self._range, absmax)
        if k:
            half = self.bins // 2
            offsets = np.arange(self.bins, dtype=np.int64) - half
            target = half + np.floor_divide(offsets, min(k, half))  # k >= half maps alike: all to the middle two
            merged = np.zeros(self.bins, np.int64)
            np.add.at(merged, target, self._counts)
            self._counts = merged
        self._range = new_range

    @property
    def mean(self) -> float:
        return self._mean if self.count else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation (ddof 0), from the exact running sum of squared deviations."""
        return math.sqrt(self._m2 / self.count) if self.count else math.nan

    @property
    def absmax(self) -> float:
        return max(-self.min, self.max) if self.count else 0.0

    @property
    def histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """(counts int64, edges float64) over ``[-R, R]``, ``bins`` bins, ``R`` in ``[max|x|, 2 max|x|)``.

        The last bin is closed (holds ``R``), as in ``np.histogram``. Before any nonzero value ``R`` is 0 and all
        values sit in bin ``bins // 2``.
        """
        return self._counts.copy(), np.linspace(-self._range, self._range, self.bins + 1)

    def abs_histogram(self) -> tuple[np.ndarray, np.ndarray]:
        """The histogram of ``|x|``: ``bins // 2`` bins over ``[0, R]``, the signed one folded at 0."""
        half = self.bins // 2
        counts = self._counts[half:] + self._counts[half - 1::-1]
        return counts, np.linspace(0.0, self._range, half + 1)

    def summary(self) -> dict:
        """JSON-ready floats: min, max, count, mean, std, and percentiles estimated from the histogram.

        A percentile interpolates linearly inside its bin (values assumed uniform there) and is clamped to
        ``[min, max]``. Before any update only ``{"count": 0}``.
        """
        if not self.count:
            return {"count": 0}
        return _summary(self.min, self.max, self.count, self.mean, self.std, *self.histogram)


SUMMARY_PERCENTILES = (0.1, 1.0, 50.0, 99.0, 99.9)


def _summary(low: float, high: float, count: int, mean: float, std: float, counts: np.ndarray,
             edges: np.ndarray) -> dict:
    """The summary's fields: extremes, count, mean, std, and :data:`SUMMARY_PERCENTILES` from the histogram."""
    out = {"min": low, "max": high, "count": count, "mean": mean, "std": std}
    for q in SUMMARY_PERCENTILES:
        out[f"p{q:g}"] = _interpolated_percentile(counts, edges, q, low, high)
    return out


def _interpolated_percentile(counts, edges, q: float, lo: float, hi: float) -> float:
    cum = np.concatenate([[0], np.cumsum(counts)])
    target = q * float(cum[-1]) / 100.0
    b = int(np.clip(np.searchsorted(cum, target, side="left") - 1, 0, len(counts) - 1))
    frac = (target - cum[b]) / counts[b] if counts[b] else 0.0
    return float(min(max(edges[b] + frac * (edges[b + 1] - edges[b]), lo), hi))


@dataclass(frozen=True)
class RangeRequest:
    """What a range method is asked for.

    Attributes
    ----------
    bits : int
        2 to 8: the quantized tensor has ``2**bits`` levels (stored in int8).
    symmetric : bool
        The range is for zero point 0: methods return ``(-t, t)``.
    percentile : float
        In (0, 100]: the share of values the ``"percentile"`` method keeps.
    """

    bits: int = 8
    symmetric: bool = False
    percentile: float = 99.99

    def __post_init__(self) -> None:
        _check_bits(self.bits, "RangeRequest")
        if not isinstance(self.symmetric, bool):
            raise NpuError(f"RangeRequest.symmetric={self.symmetric!r} is not a bool")
        p = self.percentile
        if not _is_real(p) or not 0.0 < p <= 100.0:
            raise NpuError(f"RangeRequest.percentile={p!r} is not in (0, 100]")


def _finish(lo: float, hi: float, symmetric: bool) -> tuple[float, float]:
    """Widen a range to hold 0 (zero must be exact: padding and ReLU produce it); give a zero range its default."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    if lo == hi:
        return (-ZERO_RANGE_HI, ZERO_RANGE_HI) if symmetric else (0.0, ZERO_RANGE_HI)
    return lo, hi


def _observed(stats: TensorStats) -> None:
    if not stats.count:
        raise NpuError("no calibration values were observed for this tensor: its range cannot be chosen")


def minmax_range(stats: TensorStats, request: RangeRequest) -> tuple[float, float]:
    """The observed (min, max); symmetric: ``±max|x|`` (onnxruntime's MinMax calibrator does the same)."""
    _observed(stats)
    return extremes_range(stats.min, stats.max, request)


def extremes_range(low: float, high: float, request: RangeRequest) -> tuple[float, float]:
    """:func:`minmax_range` of a tensor whose extremes are known without its values (calibration reads a layer's
    from its accumulators' per-channel extremes)."""
    if request.symmetric:
        absmax = max(-float(low), float(high))
        return _finish(-absmax, absmax, True)
    return _finish(low, high, False)


COUNT_BLOCK = 1 << 22
"""Bytes :func:`int8_summary` counts per task (:func:`.kernels.byte_counts`), the tasks shared by the workers."""


def int8_summary(values: np.ndarray, scale: float, zero_point: int, low: float, high: float) -> dict:
    """:meth:`TensorStats.summary` of an int8 tensor's dequantized values ``(q - zero_point) * scale``: its exact
    histogram has one bin per level (each bin ``scale`` wide around its level, percentiles interpolated inside),
    count, mean and std are exact over the levels; ``min`` and ``max`` are the float range observed before
    quantizing (``low``, ``high``), which percentiles are clamped to. One counting pass over the bytes."""
    flat = np.ascontiguousarray(values, np.int8).reshape(-1)
    unsigned = np.zeros(256, np.int64)
    for part in run_all(lambda part: kernels.byte_counts(flat[part]),
                        [slice(start, start + COUNT_BLOCK) for start in range(0, flat.size, COUNT_BLOCK)]):
        unsigned += part
    counts = np.concatenate([unsigned[128:], unsigned[:128]])  # levels -128 .. 127
    count = int(counts.sum())
    if not count:
        return {"count": 0}
    levels = (np.arange(-128, 128, dtype=np.float64) - zero_point) * float(scale)
    mean = float(np.dot(counts, levels)) / count
    std = math.sqrt(float(np.dot(counts, (levels - mean) ** 2)) / count)
    edges = np.append(levels - float(scale) / 2, levels[-1] + float(scale) / 2)
    return _summary(float(low), float(high), count, mean, std, counts, edges)


def percentile_range(stats: TensorStats, request: RangeRequest) -> tuple[float, float]:
    """Clip the tails so that at least ``percentile`` % of the values stay inside.

    Symmetric: ``t`` is the smallest edge of the ``|x|`` histogram with at least ``p`` % of the values below it.
    Asymmetric: ``(100 - p) / 2`` % is cut from each tail of the signed histogram, as onnxruntime does; ``lo`` is
    the largest edge with at most that share below, ``hi`` the smallest with at most that share above.
    onnxruntime takes the lower edge of the bin where the cumulative share crosses ``p`` (keeping slightly less
    than ``p`` %); the edges here err on the side of keeping. Clamped to the observed [min, max].
    """
    _observed(stats)
    p = float(request.percentile)
    if request.symmetric:
        counts, edges = stats.abs_histogram()
        cum = np.concatenate([[0], np.cumsum(counts)])
        t = edges[np.searchsorted(cum, p * cum[-1] / 100.0, side="left")]
        t = min(float(t), stats.absmax)
        return _finish(-t, t, True)
    counts, edges = stats.histogram
    cum = np.concatenate([[0], np.cumsum(counts)])
    cut = (100.0 - p) * cum[-1] / 200.0
    lo = edges[np.searchsorted(cum, cut, side="right") - 1]
    hi = edges[np.searchsorted(cum, cum[-1] - cut, side="left")]
    return _finish(max(float(lo), stats.min), min(float(hi), stats.max), False)


KL_SMOOTHING = 1e-4
"""Share of Q spread uniformly over P's support: ``Q' = (1 - e) Q + e / |support|``. onnxruntime and MXNet move
the same 1e-4 from nonzero bins to empty ones (and give up when a bin is too small to give it); a mixture never
has to give up, and since ``Q' >= (1 - e) Q`` it raises no finite divergence by more than ``-log(1 - e)``."""


def _kl_divergence(counts: np.ndarray, i: int, levels: int) -> float:
    """KL(P || Q) of TensorRT's entropy calibration for a threshold after ``i`` bins of the ``|x|`` histogram.

    P is the first ``i`` bins with every value beyond them added to the last (what clipping does). Q quantizes
    the first ``i`` bins, outliers excluded (so clipping mass costs divergence), to ``levels`` groups of
    consecutive bins as even as integers allow (TensorRT puts the remainder in the last group), and spreads each
    group's mass evenly over its bins where P is nonzero. Q is zero where P is nonzero when the clipped mass lands
    in an empty group (isolated outliers far beyond the bulk: the very case clipping is for); the divergence would be
    infinite and such thresholds never chosen, so Q is smoothed, see :data:`KL_SMOOTHING`.
    """
    sliced = counts[:i].astype(np.float64)
    p = sliced.copy()
    p[-1] += counts[i:].sum()
    nonzero = p > 0
    levels = min(levels, i)
    starts = (np.arange(levels) * i) // levels
    sizes = np.diff(np.append(starts, i))
    mass = np.add.reduceat(sliced, starts)
    spread = np.add.reduceat(nonzero.astype(np.float64), starts)
    q = (np.repeat(mass / np.maximum(spread, 1.0), sizes) * nonzero)[nonzero]
    p = p[nonzero] / p.sum()
    q = (1.0 - KL_SMOOTHING) * (q / q.sum() if q.sum() else q) + KL_SMOOTHING / q.size
    return float(np.sum(p * np.log(p / q)))


def kl_range(stats: TensorStats, request: RangeRequest) -> tuple[float, float]:
    """TensorRT's entropy calibration: the ``|x|`` threshold whose clipped, ``2**(bits-1)``-level quantized
    distribution diverges least (KL) from the clipped original.

    Candidate thresholds are the ``|x|`` histogram's edges from ``2**(bits-1)`` bins (fewer bins than levels
    lose nothing to quantization) up to the last nonempty bin; the threshold is that bin edge, clamped to
    ``max|x|``. Symmetric: ``(-t, t)``; asymmetric: ``(max(min, -t), min(max, t))``.
    """
    _observed(stats)
    if stats.absmax == 0.0:
        return _finish(0.0, 0.0, request.symmetric)
    counts, edges = stats.abs_histogram()
    # Exact zeros (half of a ReLU output) are exact on every grid: left in the first bin they dominate P, and
    # merging that bin with its neighbours looks so costly that the coarse grids of wide thresholds always lose.
    counts = counts.copy()
    counts[0] -= min(int(counts[0]), int(stats.zeros))
    if not counts.any():
        return _finish(0.0, 0.0, request.symmetric)
    used = int(np.flatnonzero(counts)[-1]) + 1
    # |x| spans all 2**bits levels when the tensor is one-signed (a ReLU output) and quantized asymmetrically
    one_signed = not request.symmetric and (stats.min >= 0.0 or stats.max <= 0.0)
    levels = 2 ** request.bits if one_signed else 2 ** (request.bits - 1)
    candidates = range(min(levels, used), used + 1)
    divergences = [_kl_divergence(counts, i, levels) for i in candidates]
    t = min(float(edges[candidates[int(np.argmin(divergences))]]), stats.absmax)
    if request.symmetric:
        return _finish(-t, t, True)
    return _finish(max(stats.min, -t), min(stats.max, t), False)


def _clipping_above(counts: np.ndarray, edges: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(mass above ``hi``, sum of ``(x - hi)**2`` over it) for each candidate ``hi``, values uniform in their bin.

    Bins wholly above contribute ``n ((c - hi)**2 + w**2 / 12)`` (``c`` the centre), summed for all candidates
    at once from suffix sums; the bin ``hi`` falls in contributes the part beyond ``hi``: ``n v**3 / (3 w)``.
    """
    width = edges[1] - edges[0]
    centres = edges[:-1] + width / 2
    n = counts.astype(np.float64)

    def suffix(values):
        return np.concatenate([np.cumsum(values[::-1])[::-1], [0.0]])

    s0, s1, s2 = suffix(n), suffix(n * centres), suffix(n * (centres ** 2 + width ** 2 / 12))
    k = np.clip(np.floor((hi - edges[0]) / width).astype(np.int64), 0, len(counts) - 1)
    v = np.clip(edges[k + 1] - hi, 0.0, width)
    mass = s0[k + 1] + n[k] * v / width
    error = np.maximum(s2[k + 1] - 2 * hi * s1[k + 1] + hi * hi * s0[k + 1], 0.0) + n[k] * v ** 3 / (3 * width)
    return mass, error


def _expected_squared_error(stats: TensorStats, lo: np.ndarray, hi: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Sum of squared quantization errors for candidate grids ``[lo, hi]`` of spacing ``step`` (1-D arrays).

    Values are assumed uniform within each histogram bin: a value inside the grid is off by rounding noise of
    variance ``step**2 / 12`` (exact zeros excepted: 0 is on every grid); one outside by its distance to the end
    of the grid (integrated exactly over the part of a bin beyond it). The bins below ``lo`` are those above
    ``-lo`` of the mirrored histogram (its edges are symmetric).
    """
    counts, edges = stats.histogram
    above, above_error = _clipping_above(counts, edges, hi)
    below, below_error = _clipping_above(counts[::-1], edges, -lo)
    inside = np.maximum(stats.count - above - below - stats.zeros, 0.0)
    return above_error + below_error + inside * step ** 2 / 12.0


def mse_range(stats: TensorStats, request: RangeRequest) -> tuple[float, float]:
    """The clipping that minimizes the expected squared quantization error (rounding inside, clipping outside).

    Symmetric: ``t`` over the positive histogram edges below ``max|x|`` and ``max|x|`` itself, on the grid the
    symmetric qparams give (step ``t / qmax``, levels ``qmin * step .. t``). Asymmetric: the observed range
    (widened to 0) scaled by ``alpha`` in ``1/n, 2/n, .., 1`` (``n = bins / 2``), step ``range / (2**bits - 1)``,
    which keeps the zero point of the full range and searches one parameter. Ties go to the smallest range.
    """
    _observed(stats)
    if stats.absmax == 0.0:
        return _finish(0.0, 0.0, request.symmetric)
    qmin, qmax = _storage_limits(request.bits)
    half = stats.bins // 2
    if request.symmetric:
        _, edges = stats.abs_histogram()
        t = np.append(edges[1:][edges[1:] < stats.absmax], stats.absmax)
        step = t / qmax
        errors = _expected_squared_error(stats, qmin * step, t, step)
        best = float(t[int(np.argmin(errors))])
        return _finish(-best, best, True)
    alpha = np.arange(1, half + 1) / half
    lo, hi = alpha * min(stats.min, 0.0), alpha * max(stats.max, 0.0)
    errors = _expected_squared_error(stats, lo, hi, (hi - lo) / (qmax - qmin))
    best = int(np.argmin(errors))
    return _finish(lo[best], hi[best], False)


RangeMethod = Callable[[TensorStats, RangeRequest], tuple[float, float]]

METHODS: dict[str, RangeMethod] = {
    "minmax": minmax_range,
    "percentile": percentile_range,
    "kl": kl_range,
    "mse": mse_range,
}
"""Range methods by name; a user method is any callable ``(stats, request) -> (lo, hi)``."""


def resolve_method(method) -> RangeMethod:
    """The range method ``method`` names (a key of :data:`METHODS`), or ``method`` itself if callable."""
    if isinstance(method, str):
        if method not in METHODS:
            raise NpuError(f"unknown calibration method {method!r}: use one of {', '.join(METHODS)} or a callable "
                           "(stats, request) -> (lo, hi)")
        return METHODS[method]
    if callable(method):
        return method
    raise NpuError(f"calibration method {method!r} is neither one of {', '.join(METHODS)} nor a callable")


def choose_range(stats: TensorStats, method="minmax", request: RangeRequest | None = None) -> tuple[float, float]:
    """The range ``method`` chooses from ``stats``, checked and widened to hold 0.

    Raises
    ------
    NpuError
        Nothing was observed; ``method`` is unknown; a callable returned something other than two finite real
        numbers with ``lo <= hi``.
    """
    request = request if request is not None else RangeRequest()
    fn = resolve_method(method)
    _observed(stats)
    name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
    result = fn(stats, request)
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise NpuError(f"calibration method {name} returned {result!r}, not a pair (lo, hi)")
    lo, hi = result
    if not (_is_real(lo) and _is_real(hi)):
        raise NpuError(f"calibration method {name} returned ({lo!r}, {hi!r}): lo and hi must be real numbers")
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise NpuError(f"calibration method {name} returned a non-finite range ({lo}, {hi})")
    if lo > hi:
        raise NpuError(f"calibration method {name} returned lo={lo} > hi={hi}")
    return _finish(lo, hi, request.symmetric)


def _round_half_away(x: float) -> int:
    """std::round, as TFLite's ``TfLiteRound`` (Python's ``round`` is half to even)."""
    r = round(x)
    if abs(x - math.trunc(x)) == 0.5:
        r = math.trunc(x) + (1 if x > 0 else -1)
    return int(r)


def activation_qparams(lo: float, hi: float, *, bits: int = 8, symmetric: bool = False,
                       power_of_two: bool = False) -> tuple[float, int]:
    """(scale, zero_point) for a range, integers in ``[-2**(bits-1), 2**(bits-1) - 1]`` stored as int8.

    The range is first widened to hold 0 (a zero-width one becomes ``[0, ZERO_RANGE_HI]``). Asymmetric, bit for
    bit as TFLite's converter (``GetAsymmetricQuantizationParams`` in ``tools/optimize/quantization_utils.cc``):
    in float32, ``scale = (hi - lo) / (qmax - qmin)`` and ``zero_point = round(qmin - lo / scale)``, rounded half
    away from zero (``std::round``; onnxruntime rounds half to even, in float64), clamped to ``[qmin, qmax]``.
    Symmetric: ``scale = max(|lo|, |hi|) / qmax`` in float32, zero point 0. ``power_of_two`` rounds the scale up
    to a power of two (nothing clipped; requantization becomes a shift), recomputes the zero point alike, then
    moves it, when the slack allows, so that neither end of the range is clipped by its rounding.

    Returns
    -------
    (float, int)
        The scale, a positive normal float32 returned as a Python float, and the zero point.
    """
    _check_bits(bits, "activation_qparams")
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise NpuError(f"activation range [{lo}, {hi}] is not finite")
    if lo > hi:
        raise NpuError(f"activation range has lo={lo} > hi={hi}")
    lo, hi = _finish(lo, hi, symmetric)
    qmin, qmax = _storage_limits(bits)
    with np.errstate(over="ignore", under="ignore"):
        lo32, hi32 = np.float32(lo), np.float32(hi)
        if symmetric:
            scale = max(-lo32, hi32) / np.float32(qmax)
        else:
            scale = (hi32 - lo32) / np.float32(qmax - qmin)
    if power_of_two and scale > 0:
        mantissa, exponent = math.frexp(float(scale))
        scale = np.float32(math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent))
    if not _FLOAT32_TINY <= scale < math.inf:
        raise NpuError(f"range [{lo:g}, {hi:g}] gives scale {float(scale):g}, not a normal float32")
    if symmetric:
        return float(scale), 0
    from_min = float(np.float32(qmin) - lo32 / scale)
    zero_point = _round_half_away(from_min)
    if power_of_two:
        low, high = math.ceil(from_min), math.floor(float(np.float32(qmax) - hi32 / scale))
        if low <= high:
            zero_point = min(max(zero_point, low), high)
    return float(scale), int(min(max(zero_point, qmin), qmax))


def quantize_weights(w, *, axis: int | None, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric weight quantization (zero point 0) to ``±(2**(bits-1) - 1)`` in int8, per tensor or per channel.

    ``scale = max|w| / qmax`` (float32) per channel along ``axis`` (or one for the tensor if ``axis`` is None);
    ``-qmax - 1`` is left unused, as TFLite's int8 weights require. Quantized as onnxruntime's ``quantize_data``:
    float32 ``w / scale`` rounded half to even, then clipped. An all-zero channel gets the tensor's largest
    channel scale (1.0 if all are zero), not a tiny one: the bias of that channel is quantized with
    ``input_scale * weight_scale`` and would otherwise overflow int32, or a narrow accumulator.

    Returns
    -------
    (np.ndarray, np.ndarray)
        The int8 weights, shaped as ``w``, and the float32 scales, shape ``(1,)`` or ``(w.shape[axis],)``.
    """
    _check_bits(bits, "quantize_weights")
    array = np.asarray(w)
    if array.dtype.kind not in "fiu":
        raise NpuError(f"weights must be real numbers, not {array.dtype}")
    if array.size == 0:
        raise NpuError("weights are empty")
    with np.errstate(over="ignore"):
        w32 = array.astype(np.float32)
    if not np.all(np.isfinite(w32)):
        raise NpuError("weights hold NaN or infinite values (or values beyond float32)")
    qmax = 2 ** (bits - 1) - 1
    shape = [1] * w32.ndim
    if axis is None:
        absmax = np.array([np.max(np.abs(w32))])
    else:
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -w32.ndim <= axis < w32.ndim:
            raise NpuError(f"weight axis {axis!r} is out of range for weights of shape {w32.shape}")
        axis = int(axis) % w32.ndim
        others = tuple(d for d in range(w32.ndim) if d != axis)
        absmax = np.max(np.abs(w32), axis=others) if others else np.abs(w32)
        shape[axis] = w32.shape[axis]
    scales = (absmax.astype(np.float64) / qmax).astype(np.float32)
    unusable = ~(scales >= _FLOAT32_TINY)
    if np.any(unusable):
        scales[unusable] = scales.max() if not np.all(unusable) else np.float32(1.0)
    q = np.clip(np.rint(w32 / scales.reshape(shape)), -qmax, qmax).astype(np.int8)
    return q, scales


__all__ = ["TensorStats", "Batches", "RangeRequest", "METHODS", "RangeMethod", "ZERO_RANGE_HI", "KL_SMOOTHING",
           "resolve_method", "choose_range", "activation_qparams", "quantize_weights", "minmax_range",
           "percentile_range", "kl_range", "mse_range"]
