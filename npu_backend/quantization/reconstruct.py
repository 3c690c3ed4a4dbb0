"""Weight rounding chosen for the layer's output, not weight by weight (GPTQ-style least squares).

Round-to-nearest makes each weight's own error as small as it can be, but what
the model feels is the layer's output error: the weights' errors add up along
the inputs they multiply, and one weight rounded the other way can cancel
another's. Calibration runs layer by layer on the NPU's own integers, so each
weighted layer has both what it will see, its quantized inputs ``X_q``, and
what it should produce, the float model's accumulator ``T = X_f w + b``. Per
output channel, :func:`build` and :func:`apply`

1. solve the ridge least-squares problem ``min ||X_q v - (T - b)||^2 + lam ||v - w||^2`` in float (centred
   when the bias is corrected afterwards, which then plays the intercept), so that the weights also take back
   part of the error of every layer upstream; ``lam`` is chosen by generalized cross-validation, because a
   layer that sees one row per calibration image (a classifier's dense layer) would otherwise fit the
   calibration set's noise;
2. round ``v`` onto the channel's grid ``s * {-qmax .. qmax}`` one input at a time, spreading each rounding
   error onto the inputs not yet rounded through the inverse of ``H = X_q^T X_q`` (Frantar et al., "GPTQ",
   ICLR 2023, after Optimal Brain Quantization), the inputs with the most energy first;
3. polish the integers by coordinate descent: a weight moves by one step whenever that lowers
   ``(s q - v) H (s q - v)^T``, until no single step does.

The scales stay those round-to-nearest chose (``max|w| / qmax`` per output channel, or the widened ones that
keep a narrow accumulator from overflowing), the zero point 0, and the integers within ``±qmax``: the result is
exactly the canonical QDQ form, so the NPU still equals the simulated quantization bit for bit. A layer whose
sums :mod:`.batched_float` does not compute with numpy (other groupings or layouts) keeps round-to-nearest.

Measured on the digits models (``bench/bench_quantization.py``, logits SQNR on 400 test images): 0.06 to
0.6 dB at 8-bit weights, where rounding is a small part of the error, 1.2 to 3.5 dB at 6 bits, 5.5 to 6.9 dB
at 4 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.isa import Opcode
from simulator.macs import centred_input

from .batched_float import WeightedPlan
from .rewrite import WeightQ

DAMPING = 0.01
"""Least ridge, as a fraction of the mean diagonal of ``X^T X / rows``: added to ``H`` for the rounding (GPTQ's
1 %), it keeps ``H`` invertible when inputs are collinear or constant."""
RIDGES = np.array([10.0 ** (k / 4) for k in range(-24, 13)])
"""Ridge strengths generalized cross-validation chooses from, relative to the same mean diagonal (1e-6 to 1e3)."""
MAX_ROWS = 1 << 15
"""Rows (output positions over the calibration set) the normal equations are summed over at most; a larger layer
takes every k-th row. ``X^T X`` costs rows x K^2 multiply-adds."""
CHUNK_ELEMENTS = 1 << 22
"""Input taps gathered at a time (16 MiB of float32): the tap matrix is summed chunk by chunk, never kept."""
GPTQ_BLOCK = 128
"""Inputs rounded between two updates of the inputs after them (GPTQ's lazy batch: one matrix product per block
instead of one outer product per input; the same result)."""
POLISH_SWEEPS = 8
"""Coordinate-descent sweeps over every weight at most (it stops at the first sweep that changes nothing)."""


@dataclass(frozen=True)
class Problem:
    """One layer's least-squares problems, one per group of output channels that read the same inputs: one group
    of all channels, or for a depthwise layer one per input channel (its ``multiplier`` output channels).

    ``hessians``: ``H`` per group, ``[G, K, K]`` (float64, damped); ``targets``: the unrounded weights ``v``,
    ``[G, C, K]`` (output channel ``g * C + c``). ``plan`` and ``shape`` map them back to the layer's weight.
    """

    plan: WeightedPlan
    shape: tuple
    hessians: np.ndarray
    targets: np.ndarray


def weight_rows(plan: WeightedPlan, weight: np.ndarray) -> np.ndarray:
    """The layer's weight as one row per output channel, ``[OC, K]``, K in the order of :func:`_taps`."""
    if plan.conv is None:
        return np.asarray(weight).T
    w = np.transpose(weight, plan.weight_order)  # [OC, KH, KW, IC]
    return w.reshape(w.shape[0], -1)


def layer_weight(plan: WeightedPlan, rows: np.ndarray, shape: tuple) -> np.ndarray:
    """Inverse of :func:`weight_rows`: rows ``[OC, K]`` back in the layer's own weight layout ``shape``."""
    if plan.conv is None:
        return np.ascontiguousarray(rows.T)
    ordered = tuple(shape[a] for a in plan.weight_order)
    return np.ascontiguousarray(np.transpose(rows.reshape(ordered), np.argsort(plan.weight_order)))


def _taps(plan: WeightedPlan, x: np.ndarray) -> np.ndarray:
    """The input values each output position multiplies, one row per output position (samples x pixels), as
    ``[rows, G, K]``: one group of all taps (``KH * KW * IC``, :func:`weight_rows`' order) for a convolution or
    a matmul, one group of ``KH * KW`` taps per input channel for a depthwise convolution."""
    if plan.conv is None:
        return x.reshape(-1, 1, x.shape[-1])
    conv = plan.conv
    nhwc = np.transpose(x, (0, 1, 3, 4, 2)) if plan.channels_first else x
    padded = centred_input(nhwc, 0, conv.padding, np.float32)
    (sh, sw), (dh, dw) = conv.stride, conv.dilation
    oh, ow = conv.ofm.height, conv.ofm.width
    kh, kw = conv.kernel
    windows = [padded[..., ky * dh:ky * dh + (oh - 1) * sh + 1:sh, kx * dw:kx * dw + (ow - 1) * sw + 1:sw, :]
               for ky in range(kh) for kx in range(kw)]
    taps = np.stack(windows, axis=-2).reshape(-1, kh * kw, padded.shape[-1])  # [rows, KH*KW, IC]
    if plan.opcode == Opcode.DEPTHWISE_CONV2D:
        return taps.transpose(0, 2, 1)
    return taps.reshape(taps.shape[0], 1, -1)


def _outputs(plan: WeightedPlan, accumulators: np.ndarray, groups: int) -> np.ndarray:
    """Accumulators ``[N, *shape]`` as ``[rows, G, C]``, rows in the order of :func:`_taps`."""
    if plan.channels_first and plan.conv is not None:
        accumulators = np.moveaxis(accumulators, 2, -1)
    flat = accumulators.reshape(-1, accumulators.shape[-1])
    return flat.reshape(flat.shape[0], groups, -1)


@dataclass
class _Sums:
    """Sums over the sampled rows, per group: what the least squares and the centring need."""

    rows: int = 0
    xx: np.ndarray = 0.0  # [G, K, K]
    xt: np.ndarray = 0.0  # [G, K, C]
    tt: np.ndarray = 0.0  # [G, C]
    x: np.ndarray = 0.0  # [G, K]
    t: np.ndarray = 0.0  # [G, C]

    def add(self, x: np.ndarray, t: np.ndarray) -> None:
        x = x.astype(np.float64).transpose(1, 0, 2)  # [G, rows, K]
        t = t.astype(np.float64).transpose(1, 0, 2)  # [G, rows, C]
        self.rows += x.shape[1]
        self.xx = self.xx + np.matmul(x.transpose(0, 2, 1), x)
        self.xt = self.xt + np.matmul(x.transpose(0, 2, 1), t)
        self.tt = self.tt + np.einsum("grc,grc->gc", t, t)
        self.x = self.x + x.sum(axis=1)
        self.t = self.t + t.sum(axis=1)


def _sums(plan: WeightedPlan, inputs: np.ndarray, accumulators: np.ndarray, groups: int, bias) -> _Sums:
    """:class:`_Sums` of every k-th output position (at most about :data:`MAX_ROWS`), gathered a few samples at a
    time; the targets are the accumulators less the float ``bias``."""
    count = inputs.shape[0]
    per_sample = _outputs(plan, accumulators[:1], groups).shape[0]
    step = max(1, -(-count * per_sample // MAX_ROWS))
    taps = inputs.shape[-1] if plan.conv is None else int(np.prod(plan.conv.kernel)) * plan.conv.ifm.channels
    chunk = max(1, CHUNK_ELEMENTS // max(1, per_sample * taps))
    sums = _Sums()
    shift = None if bias is None else np.asarray(bias, np.float64).reshape(1, groups, -1)
    for start in range(0, count, chunk):
        first = (-start * per_sample) % step  # global row start * per_sample + first is a multiple of step
        x = _taps(plan, inputs[start:start + chunk])[first::step]
        t = _outputs(plan, accumulators[start:start + chunk], groups)[first::step].astype(np.float64)
        sums.add(x, t if shift is None else t - shift)
    return sums


def _solve(sums: _Sums, w: np.ndarray, intercept: bool) -> tuple[np.ndarray, np.ndarray]:
    """Every group's ridge least squares from its sums, ``w`` [G, C, K] the float weights -> (H, V), batched.

    ``V = w + argmin_d ||x (w + d) - t||^2 + lam ||d||^2``, ``lam`` minimising the generalized cross-validation
    score ``RSS / (1 - dof / rows)^2`` (Golub, Heath and Wahba, 1979) over :data:`RIDGES`, from the eigenvalues
    of ``x^T x``; ``H = x^T x / rows + DAMPING``. ``intercept``: ``x`` and ``t`` centred.
    """
    rows = sums.rows
    xx, xt, tt = sums.xx / rows, sums.xt / rows, sums.tt / rows
    if intercept:
        mx, mt = sums.x / rows, sums.t / rows
        xx = xx - mx[:, :, None] * mx[:, None, :]
        xt = xt - mx[:, :, None] * mt[:, None, :]
        tt = tt - mt * mt
    groups, k = xx.shape[:2]
    eye = np.eye(k)
    scale = np.maximum(np.trace(xx, axis1=1, axis2=2) / k, 1e-30)  # [G]
    wt = w.transpose(0, 2, 1)  # [G, K, C]
    correlation = xt - xx @ wt  # x^T r / rows, r = t - x w: what the float weights leave unexplained on X_q
    total = (tt.sum(axis=1) - 2 * np.einsum("gkc,gkc->g", wt, xt)
             + np.einsum("gkc,gkc->g", wt, xx @ wt))  # |r|^2 / rows
    eig, basis = np.linalg.eigh(xx)
    eig = np.maximum(eig, 0.0)
    energy = np.sum((basis.transpose(0, 2, 1) @ correlation) ** 2, axis=2)  # [G, K]
    live = eig > 1e-12 * scale[:, None]
    lam = RIDGES[:, None, None] * scale[None, :, None]  # [R, G, 1]
    e = np.where(live, eig, 0.0)[None]
    # RSS(lam) / rows = |r|^2 / rows - sum_i (e_i + 2 lam) / (e_i + lam)^2 * (v_i . x^T r / rows)^2
    rss = total[None] - np.sum(np.where(live, (e + 2 * lam) / (e + lam) ** 2 * energy[None], 0.0), axis=2)
    dof = np.sum(np.where(live, e / (e + lam), 0.0), axis=2)
    score = np.maximum(rss, 0.0) / np.maximum(1.0 - dof / rows, 1e-12) ** 2  # [R, G]
    chosen = RIDGES[np.argmin(score, axis=0)] * scale  # the first of equal scores: the weakest ridge
    ridge = np.maximum(chosen, DAMPING * scale)[:, None, None] * eye
    v = w + np.linalg.solve(xx + ridge, correlation).transpose(0, 2, 1)
    h = xx + (DAMPING * scale)[:, None, None] * eye
    return h, v


def build(plan: WeightedPlan, inputs: np.ndarray, accumulators: np.ndarray, weight: np.ndarray,
          bias: np.ndarray | None, intercept: bool) -> Problem:
    """A layer's least-squares problems from its quantized inputs (dequantized, ``[N, *shape]``, what the NPU
    will see) and the float model's accumulators (``[N, *shape]``, bias included, before the clamp).
    ``intercept``: the bias is corrected afterwards, so only the centred error counts."""
    w = weight_rows(plan, weight).astype(np.float64)
    groups = plan.conv.ifm.channels if plan.opcode == Opcode.DEPTHWISE_CONV2D else 1
    sums = _sums(plan, inputs, accumulators, groups, bias)
    h, v = _solve(sums, w.reshape(groups, -1, w.shape[1]), intercept)
    return Problem(plan, tuple(weight.shape), h, v)


def gptq_round(h: np.ndarray, v: np.ndarray, scales: np.ndarray, qmax: int) -> np.ndarray:
    """Integers ``q`` [G, C, K] in ``±qmax`` that keep each ``(s q - v) H (s q - v)^T`` small, each row on its own
    scale ``s`` [G, C], each group with its ``H`` [G, K, K]: inputs are rounded in order of decreasing ``H``
    diagonal, each one's error carried onto those left through the Cholesky factor of ``H^-1`` (GPTQ's update,
    exact for a quadratic error)."""
    order = np.argsort(-np.diagonal(h, axis1=1, axis2=2), axis=1, kind="stable")  # [G, K]
    permuted = np.take_along_axis(np.take_along_axis(h, order[:, :, None], 1), order[:, None, :], 2)
    upper = np.linalg.cholesky(np.linalg.inv(permuted)).transpose(0, 2, 1)  # H^-1 = U^T U
    work = np.take_along_axis(v, order[:, None, :], 2).copy()
    q = np.empty(work.shape, np.int64)
    inputs = work.shape[2]
    for start in range(0, inputs, GPTQ_BLOCK):
        end = min(inputs, start + GPTQ_BLOCK)
        errors = np.empty((*work.shape[:2], end - start))
        for k in range(start, end):
            q[:, :, k] = np.clip(np.rint(work[:, :, k] / scales), -qmax, qmax)
            errors[:, :, k - start] = (work[:, :, k] - q[:, :, k] * scales) / upper[:, k, k][:, None]
            work[:, :, k + 1:end] -= errors[:, :, k - start, None] * upper[:, None, k, k + 1:end]
        work[:, :, end:] -= errors @ upper[:, start:end, end:]  # the block's errors, onto the inputs after it
    out = np.empty_like(q)
    np.put_along_axis(out, np.broadcast_to(order[:, None, :], q.shape), q, 2)
    return out


def polish(h: np.ndarray, v: np.ndarray, scales: np.ndarray, q: np.ndarray, qmax: int) -> np.ndarray:
    """Coordinate descent on the integers (shapes as :func:`gptq_round`'s): ``q[g, c, k]`` moves by ±1 whenever
    ``(s q - v) H (s q - v)^T`` drops. Moving ``s q[g, c, k]`` by ``d`` changes that error by
    ``2 d G[g, c, k] + d^2 H[g, k, k]``, with ``G = (s q - v) H`` kept current as the integers move."""
    q = q.copy()
    gradient = (q * scales[:, :, None] - v) @ h
    diagonal = np.diagonal(h, axis1=1, axis2=2)
    for _ in range(POLISH_SWEEPS):
        moved = False
        for k in range(q.shape[2]):
            for sign in (1, -1):
                d = sign * scales
                curvature = d * d * diagonal[:, k][:, None]
                move = (2 * d * gradient[:, :, k] + curvature < -1e-12 * curvature) & (np.abs(q[:, :, k] + sign)
                                                                                         <= qmax)
                if move.any():
                    g, c = np.nonzero(move)
                    q[g, c, k] += sign
                    gradient[g, c] += d[g, c, None] * h[g, k]
                    moved = True
        if not moved:
            break
    return q


def round_rows(problem: Problem, scales: np.ndarray, qmax: int) -> np.ndarray:
    """The integers of every output channel, ``[OC, K]``: :func:`gptq_round` then :func:`polish`."""
    groups, per_group, k = problem.targets.shape
    s = np.broadcast_to(np.asarray(scales, np.float64).reshape(-1), (groups * per_group,)).reshape(groups, per_group)
    h, v = problem.hessians, problem.targets
    return polish(h, v, s, gptq_round(h, v, s, qmax), qmax).reshape(groups * per_group, k)


def apply(problem: Problem, wq: WeightQ, bits: int) -> WeightQ:
    """``wq`` with its integers chosen by :func:`round_rows` on its own scales (the bias is left to the bias
    correction, which runs after)."""
    q = round_rows(problem, wq.scales, 2 ** (bits - 1) - 1)
    weight = layer_weight(problem.plan, q, problem.shape).astype(np.int8)
    return WeightQ(weight, wq.scales, wq.axis, wq.bias, wq.bias_scales)
