"""A quantized convolution or matmul layer's exact integer sums over the calibration set, computed once and read
three ways.

The NPU's MAC array sums ``(x - zp) * w`` exactly; the bias, the register's width and the output stage follow
(:func:`simulator.kernels.mac_register_output`). Calibration needs, for the same layer on the same int8 inputs:

  - what it observes to choose the output range: the accumulator in real units, ``(sums + bias) * s_in * s_w``,
    then the layer's float clamp (:class:`IntegerObservation`);
  - the accumulators' per-channel extremes (peaks, overflow avoidance) and totals (bias correction);
  - the NPU's int8 outputs, which the next layers take.

All three are read from one array of sums (formed again at each read instead, where it is large and each sum takes
few products: :func:`formed_again`), formed by the float32 plan of :mod:`.batched_float` on the centred
int8 input and the int8 weights (a pointwise or dense layer's by :func:`.kernels.int8_matmul` where the CPU has
VNNI: the same exact values), channels last whatever the model's layout (the output stage broadcasts its
per-channel words along the last axis; an NCHW model's int8 input and output are transposed instead, a byte
each). Every product and partial sum is an integer, so the float32 sums are exact while
``max|x - zp| * max_oc sum|w| + max|bias|`` stays below 2**24 (the argument of :mod:`simulator.macs`), which
:func:`exact_bound` checks before anything is formed. Calibration once ran the layer three times instead: in float
on dequantized values to observe it, and twice more (sums and output stage) in the simulator on the lowered stream.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import numpy as np

from simulator.isa import Opcode
from simulator.kernels import mac_register_output
from simulator.mac_plans import MacConstants, exact_float_path
from simulator.numerics import Float64Requantizer
from simulator.macs import FLOAT32_EXACT

from . import buffers, kernels
from .batched_float import WeightedPlan, channel_totals, chunks, clamp_into, finished_batches, folded
from .layers import Layer
from .observers import Batches
from .parallel import run_all
from .transpose import to_channels_first

if TYPE_CHECKING:
    from ..codegen.lower import MacLayer

STAGE_BLOCK = 1 << 18
"""Accumulators the output stage takes per call (it works through them in blocks of its own): enough that each
call's fixed cost (finding its cached requantizer, binding its blocks) is small against the values, few enough
that ``sums + bias`` is formed in a reused buffer."""


FORMED_AGAIN_BYTES = 64 << 20
"""Integer sums this large are not kept between their reads when each takes few products (below): they are the
calibration's largest arrays (a MobileNetV2's first expansion at 100 samples: 482 MB), and a batch-sized array is
memory the machine must hand out, zeroed, once more (on a virtual machine whose host takes freed memory back, 1 to
2 s per GB, measured), where forming the sums again costs a few products per value."""
FORMED_AGAIN_PRODUCTS = 32
"""Products per sum up to which sums of :data:`FORMED_AGAIN_BYTES` or more are formed again when read: a
depthwise convolution's 9, a first RGB convolution's 27, a pointwise expansion of 16 to 32 channels."""


def formed_again(plan: WeightedPlan, shape: tuple[int, ...], in_channels: int) -> bool:
    """Whether the sums of ``shape`` (float32) are formed again at each read rather than kept (the constants
    above)."""
    if plan.conv is None:
        products = in_channels
    else:
        height, width = plan.conv.kernel
        products = height * width * (1 if plan.opcode == Opcode.DEPTHWISE_CONV2D else in_channels)
    return math.prod(shape) * 4 >= FORMED_AGAIN_BYTES and products <= FORMED_AGAIN_PRODUCTS


def weight_magnitude(weight: np.ndarray, axis: int) -> int:
    """``max_oc sum|w_oc|`` of an integer weight whose output channels are along ``axis``."""
    rows = np.moveaxis(np.asarray(weight), axis, 0).reshape(weight.shape[axis], -1)
    return int(np.abs(rows.astype(np.int64)).sum(axis=1).max(initial=0))


def _largest_bias(bias: np.ndarray | None) -> int:
    return 0 if bias is None else int(np.abs(np.asarray(bias, np.int64)).max(initial=0))


def exact_bound(largest_input: int, weight: np.ndarray, axis: int, bias: np.ndarray | None) -> int:
    """``largest_input * max_oc sum|w_oc| + max|bias|``: no partial sum of a layer's accumulator (with that bias)
    exceeds it in magnitude (``largest_input`` = ``max|x - zp|`` over its int8 input)."""
    return largest_input * weight_magnitude(weight, axis) + _largest_bias(bias)


class IntegerSums:
    """``sum((x - zp) * w)`` of every output element over the batch, float32, exact (the caller checked
    :func:`exact_bound` for the weights with no bias; :meth:`exact_with` says whether a bias keeps it so) and
    channels last: ``centred`` is the int8 input channels last (:func:`.steps.centre_host`), centred by
    ``input_zero_point`` as it is summed."""

    def __init__(self, layer: Layer, plan: WeightedPlan, centred: np.ndarray, weight: np.ndarray,
                 input_zero_point: int, largest_input: int, model_layout: bool | None = None, totals: bool = True,
                 total_samples: int | None = None, exact_largest=None, magnitude: int | None = None):
        """``largest_input``: a bound on ``|x - input_zero_point|`` (the input's own largest, or the int8 range's);
        ``exact_largest()``, if given, the input's own, read when a bias would not fit under the first bound;
        ``magnitude``: :func:`weight_magnitude` of ``weight``, if the caller has it."""
        self.layer, self.plan, self.weight = layer, plan, weight
        self.input_zero_point, self._exact_largest = input_zero_point, exact_largest
        self.model_layout = plan.channels_first if model_layout is None else model_layout
        """The NPU's outputs are transposed back to the model's NCHW (not when calibration keeps the layer's output
        channels last, :mod:`.storage`)."""
        self._magnitude = weight_magnitude(weight, layer.weight_axis) if magnitude is None else magnitude
        self.bound = largest_input * self._magnitude  # exact_bound's, with no bias
        self.total_samples = (len(centred) if total_samples is None else total_samples) if totals else 0
        """The leading samples whose totals :meth:`channel_totals` gives (bias correction compares them with the
        float model's, which may run on fewer samples than calibration: ``QConfig.reference_samples``); 0: none."""
        if totals and not 0 < self.total_samples <= len(centred):
            raise ValueError(f"totals of {self.total_samples} samples asked of sums of {len(centred)}")
        whole = self.total_samples == len(centred)  # taken as the sums form; else read again, in part
        statistics = _channel_statistics if whole else _channel_extremes  # totals: for bias correction alone
        self._plan, self._weight32, self._centred = (dataclasses.replace(plan, channels_first=False),
                                                     weight.astype(np.float32), centred)
        self.shape = self._plan.output_shape(centred, self._weight32)
        self.kept = not formed_again(self._plan, self.shape, centred.shape[-1])
        self._packed = self._plan.int8_weights(centred, self._weight32, input_zero_point)  # packed once, read twice
        self._kept, parts = self._plan.sums(centred, self._weight32, then=statistics, zero_point=input_zero_point,
                                            keep=self.kept, packed=self._packed)
        self.channels = self.shape[-1]
        self.per_channel = math.prod(self.shape) // self.channels
        self._chunks = chunks(self.shape[0], math.prod(self.shape[1:]))
        self._extremes = (np.minimum.reduce([p[0] for p in parts]).astype(np.float64),
                          np.maximum.reduce([p[1] for p in parts]).astype(np.float64))
        self._totals = np.sum([p[2] for p in parts], axis=0) if whole else None

    @property
    def sums(self) -> np.ndarray:
        """Every sum, ``[N, ..., channels]`` float32 (formed again, whole, when they were not kept)."""
        if self._kept is not None:
            return self._kept
        whole = np.empty(self.shape, np.float32)
        for part in self._chunks:
            rows = whole[part].reshape(-1, self.channels)
            for block, where in self.blocks(part):
                rows[where] = block
        return whole

    def blocks(self, part: slice):
        """The sums of the samples ``part`` as ``(block, rows)``: ``[rows, channels]`` blocks of their flattened
        sums (``rows`` a slice of them), each valid until the next; the kept array's rows, or formed again
        (:meth:`.batched_float.WeightedPlan.int8_blocks`: exact integers, the same values)."""
        if self._kept is not None:
            yield self._kept[part].reshape(-1, self.channels), slice(None)
            return
        yield from self._plan.int8_blocks(self._centred[part], self._weight32, self.input_zero_point, self._packed)

    def exact_with(self, bias: np.ndarray | None) -> bool:
        most_bias = _largest_bias(bias)
        if self.bound + most_bias >= FLOAT32_EXACT and self._exact_largest is not None:
            self.bound = self._exact_largest() * self._magnitude
            self._exact_largest = None  # the tightest bound there is
        return self.bound + most_bias < FLOAT32_EXACT

    def channel_extremes(self) -> tuple[np.ndarray, np.ndarray]:
        """(min, max) of the sums per output channel, float64 integers."""
        return self._extremes

    def channel_totals(self) -> np.ndarray:
        """The total per output channel of the sums of the first :attr:`total_samples` samples, float64 (exact:
        integers below 2**53, in any order). Of fewer samples than the batch, they are read once more (kept) or
        formed again, those samples alone, on the workers."""
        if not self.total_samples:
            raise ValueError("these integer sums were formed without their totals (totals=False)")
        if self._totals is None:
            parts = chunks(self.total_samples, math.prod(self.shape[1:]))
            self._totals = np.sum(run_all(lambda part: np.sum([channel_totals(block) for block, _ in
                                                               self.blocks(part)], axis=0), parts), axis=0)
        return self._totals

    @property
    def totalled(self) -> int:
        """Accumulators per output channel in :meth:`channel_totals`."""
        return self.total_samples * (self.per_channel // self.shape[0])

    def observed(self, bias: np.ndarray | None, steps: np.ndarray) -> IntegerObservation:
        """The layer observed with an int32 ``bias`` and per-channel float32 ``steps`` (``s_in * s_w``, the
        bias's own scale)."""
        return IntegerObservation(self, bias, steps)

    def same_weights(self, weights: np.ndarray, weight_order: tuple[int, ...] | None) -> bool:
        """Whether ``weights`` (a MAC command's layout) are this layer's int8 weights."""
        mine = self.weight if weight_order is None else np.transpose(self.weight, weight_order)
        return mine.size == weights.size and np.array_equal(mine.reshape(weights.shape), weights)

    def npu_outputs(self, mac: MacLayer) -> tuple[np.ndarray, int] | None:
        """The NPU's int8 outputs of the layer and its accumulator overflows, from these sums and the region's
        :class:`npu_backend.codegen.lower.MacLayer`: ``sums + bias`` through the MAC array's register and output
        stage. None when the region's record is not these sums' layer (other weights or input zero point) or its
        bias would leave float32's exact range: the caller then simulates the region's stream."""
        p = mac.params
        order = None if self.plan.conv is None else self.plan.weight_order
        weights = p.weights if self.plan.conv is not None else p.weights.T
        if (p.input_zero_point != self.input_zero_point or not self.same_weights(weights, order)
                or not self.exact_with(p.bias)):
            return None
        bias = np.asarray(p.bias, np.float32)
        shape, channels = self.shape, self.channels
        out = buffers.empty((*shape[:2], shape[-1], *shape[2:-1]) if self.model_layout else shape, np.int8)
        step = max(1, STAGE_BLOCK // channels)
        low, high = self.channel_extremes()
        ends = np.concatenate([low + p.bias, high + p.bias])
        largest = int(np.abs(ends).max(initial=0))  # max|sums + bias|: the register and the stage need no scan
        # The simulator's own fast path for a command with constant operands: where nothing can overflow and the
        # float64 requantizer (bias folded in) is exact for every channel's extreme sums, it takes the sums as
        # they are (simulator.mac_plans.exact_float_path).
        constants = MacConstants.of(mac.opcode, mac.conv, mac.config, p.weights,
                                    mac.table.astype("<i4").reshape(-1).view(np.uint8))
        bounds = np.maximum(np.abs(low), np.abs(high)).astype(np.int64)
        folded, fold = exact_float_path(bounds, constants.bias, constants.register_max, constants.requantizer)

        def stage(rows: np.ndarray, written: np.ndarray) -> int:
            """``rows`` of sums through the output stage into ``written``; their overflows."""
            overflows = 0
            if folded and kernels.requantize_applies(channels):  # the same stage, compiled: one pass
                kernels.requantize(rows, constants.requantizer, written)
            elif folded:
                work = np.empty(Float64Requantizer.work_size(channels))
                for start in range(0, len(rows), step):
                    constants.requantizer.bind(rows[start:start + step], written[start:start + step], work,
                                               fold=fold)()
            else:
                acc = np.empty((min(step, len(rows)), channels), np.float32)
                for start in range(0, len(rows), step):
                    block = rows[start:start + step]
                    np.add(block, bias, out=acc[:len(block)])
                    values, count = mac_register_output(acc[:len(block)], mac.conv, mac.config, mac.table, largest)
                    written[start:start + step] = values
                    overflows += count
            return overflows

        def chunk(part: slice) -> int:
            last = buffers.empty((part.stop - part.start, *shape[1:]), np.int8) if self.model_layout else out[part]
            written = last.reshape(-1, channels)
            overflows = sum(stage(rows, written[where]) for rows, where in self.blocks(part))
            if self.model_layout:
                to_channels_first(last, out[part])
            return overflows

        return out, sum(run_all(chunk, self._chunks))


def _channel_statistics(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per channel (the last axis): min, max and float64 total of a chunk of sums (a row-wise layer's: a block of
    rows), read while it is in cache: in one compiled pass (:func:`.kernels.integer_statistics`) where it applies.
    The totals are exact (integers below 2**53), so the order either takes changes nothing."""
    if kernels.integer_statistics_applies(sums):
        return kernels.integer_statistics(sums, totals=True)
    return *_channel_extremes(sums), channel_totals(sums)


def _channel_extremes(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per channel (the last axis): min and max of a chunk of sums (a row-wise layer's: a block of rows)."""
    if kernels.integer_statistics_applies(sums):
        return kernels.integer_statistics(sums, totals=False)
    rows, copies = folded(sums)
    channels = sums.shape[-1]
    return (np.min(rows, axis=0).reshape(copies, channels).min(axis=0),
            np.max(rows, axis=0).reshape(copies, channels).max(axis=0))


class IntegerObservation:
    """:class:`.batched_float.Observation` of a quantized layer read from its exact sums: the accumulator in
    real units, ``(sums + bias) * step`` per channel, and the output, that clamped by the layer's float clamp.
    ``sums + bias`` is formed in float32 (exact where :meth:`IntegerSums.exact_with` holds, else in float64), the
    product rounded once to float32."""

    def __init__(self, sums: IntegerSums, bias: np.ndarray | None, steps: np.ndarray):
        self._sums = sums
        self._bias = None if bias is None else np.asarray(bias, np.int64).reshape(-1)
        self._steps = np.broadcast_to(np.asarray(steps, np.float32).reshape(-1), (sums.channels,))
        self._dtype = np.float32 if sums.exact_with(self._bias) else np.float64
        self.shape, self.ndim = sums.shape, len(sums.shape)

    def _bias_or_zero(self) -> np.ndarray:
        return np.zeros(self._sums.channels) if self._bias is None else self._bias.astype(np.float64)

    def accumulator_sums(self, samples: int | None = None) -> list[np.ndarray]:
        """The accumulators' float64 total per output channel, in real units, over the first ``samples`` samples
        (the sums' :attr:`IntegerSums.total_samples`; None: those): one part, the sums' totals are exact, the bias
        adds ``count * bias``."""
        if samples is not None and samples != self._sums.total_samples:
            raise ValueError(f"these sums are totalled over {self._sums.total_samples} samples, not {samples}")
        totals = self._sums.channel_totals() + self._sums.totalled * self._bias_or_zero()
        return [totals * self._steps.astype(np.float64)]

    def accumulator_extremes(self) -> tuple[np.ndarray, np.ndarray]:
        """(min, max) of the accumulators per output channel in real units, float64: the exact integer extremes
        times the channel's step (positive, so the order is kept)."""
        low, high = self._sums.channel_extremes()
        bias, steps = self._bias_or_zero(), self._steps.astype(np.float64)
        return (low + bias) * steps, (high + bias) * steps

    def output_extremes(self) -> tuple[float, float]:
        """(min, max) of :meth:`outputs` without forming them: the per-channel extreme sums through the same
        float operations (each monotone: an exact or float64 addition, a product by a positive step rounded
        once to float32, the clamp), so the extremes are the outputs', bit for bit."""
        low, high = self._sums.channel_extremes()
        ends = np.stack([low, high])
        if self._dtype == np.float32:
            values = ends.astype(np.float32)
            if self._bias is not None:
                values = values + self._bias.astype(np.float32)
            values = values * self._steps
        else:
            wide = ends + (0.0 if self._bias is None else self._bias.astype(np.float64))
            values = (wide * self._steps.astype(np.float64)).astype(np.float32)
        _clamp(self._sums.layer, values)
        return float(values[0].min()), float(values[1].max())

    def outputs(self) -> Batches:
        return Batches(self.output_batches)

    def output_batches(self):
        """The outputs, samples in order, as batches (:func:`.batched_float.finished_batches`)."""
        sums = self._sums
        bias = None if self._bias is None else self._bias.astype(self._dtype)
        steps = self._steps

        def finish(part: slice, finished: np.ndarray) -> None:
            flat = finished.reshape(-1, sums.channels)
            for block, where in sums.blocks(part):
                rows = flat[where]
                if self._dtype == np.float32:
                    if bias is None:
                        np.multiply(block, steps, out=rows)
                    else:
                        np.add(block, bias, out=rows)  # exact
                        np.multiply(rows, steps, out=rows)
                else:
                    wide = block.astype(np.float64)
                    if bias is not None:
                        wide += bias
                    np.multiply(wide, steps, out=rows, casting="same_kind")
                _clamp(sums.layer, rows)

        return finished_batches(self.shape, sums._chunks, finish)


def _clamp(layer: Layer, rows: np.ndarray) -> None:
    if layer.clamp is not None:
        clamp_into(layer, rows, rows)
