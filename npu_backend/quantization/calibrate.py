"""Calibrate a float graph layer by layer, on the integers the NPU will actually compute.

The walk goes in topological order. Each layer first runs in float on the
float model's activations (the reference every SQNR is measured against), then
on its quantized inputs with its quantized weights, which is what its output range
is observed on; its output qparams are chosen, and the NPU's exact int8 output
(:class:`npu_backend.quantization.steps.NpuLayer`) becomes the next layers'
input. A convolution or matmul is observed and run from one array of its exact
integer sums (:mod:`npu_backend.quantization.integer_sums`). The same walk with
every decision fixed is the simulated quantization of the model (:func:`simulate`):
its outputs are the NPU's, bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from simulator.config import NpuConfig
from simulator.macs import FLOAT32_EXACT
from simulator.softmax import SOFTMAX_OUTPUT
from simulator.tables import LOGISTIC_OUTPUT, TANH_OUTPUT

from ..errors import NpuError, NpuWarning
from .config import FLOAT_MODEL_METHODS, QConfig
from .layers import Layer, Output, function_outputs, resolve
from .observers import (Batches, RangeRequest, TensorStats, activation_qparams, choose_range, extremes_range,
                        int8_summary, quantize_weights)
from .rewrite import TensorQ, WeightQ
from .batched_float import ChannelTotals, HostObservation
from .integer_sums import IntegerObservation, IntegerSums, weight_magnitude
from . import batched_float, buffers, headroom, kernels, reconstruct, storage
from .parallel import TVM_LOCK, Deferred, run_all
from .predicted import Builder, Mispredicted, PredictedLayer, predict, predict_elementwise
from .steps import (Centred, FloatLayers, LayerSpec, NpuLayer, ReferencePass, built_records, centre_host,
                    dequantize_host, quantize_host)

FIXED_OUTPUTS = {"sigmoid": LOGISTIC_OUTPUT, "tanh": TANH_OUTPUT, "softmax": SOFTMAX_OUTPUT}
"""Output qparams TFLite's int8 kernels fix (the NPU's legality checks the same tables)."""


@dataclass
class Plan:
    """Every decision calibration made: enough to emit the QDQ module and to simulate it again."""

    tensors: dict = field(default_factory=dict)  # var -> TensorQ (graph inputs and layer outputs)
    weights: dict = field(default_factory=dict)  # layer index -> WeightQ
    constants: dict = field(default_factory=dict)  # layer index -> {Constant: (int8 array, TensorQ)}
    float_layers: set = field(default_factory=set)
    reasons: dict = field(default_factory=dict)  # layer index -> why it stays float


@dataclass
class LayerStats:
    sqnr_db: float = math.inf
    accumulator_peak: int = 0
    overflows: int = 0
    widened_channels: int = 0
    overflow_unfixable: bool = False
    on_npu: bool = False


@dataclass
class TensorRecord:
    name: str
    method: str
    stats: dict
    scale: float
    zero_point: int


class _Energy:
    """Signal and error energy of one tensor over the calibration set, for an SQNR (NaN when no sample was
    measured: calibration without the float model)."""

    def __init__(self):
        self.signal = 0.0
        self.noise = 0.0
        self.measured = False

    def add(self, reference: np.ndarray, value: np.ndarray) -> None:
        signal, noise = _energies(reference, value)
        self.signal += signal
        self.noise += noise
        self.measured = True

    def add_samples(self, references: np.ndarray, value) -> None:
        """:meth:`add` for every sample ``n``: ``references[n]`` against ``value(n)``; each sample's energies on
        the worker threads, added in sample order (as the sequential adds are)."""
        for signal, noise in run_all(lambda n: _energies(references[n], value(n)), range(len(references))):
            self.signal += signal
            self.noise += noise
            self.measured = True

    def add_quantized(self, references: np.ndarray, values: np.ndarray, q: TensorQ) -> None:
        """:meth:`add_samples` with the dequantized int8 ``values`` (:func:`.steps.dequantize_host`'s float32
        values): each chunk of samples (:func:`.batched_float.chunks`: fixed by the batch and the sample size, so
        the sums are the same for any thread count) in one compiled pass (:func:`_quantized_energies`), the
        chunks' energies added in order. A kernel call per sample had cost 100 calls a layer, most of a small
        layer's time; a 7x7 layer's whole batch is one chunk."""
        parts = batched_float.chunks(len(references), references[0].size) if len(references) else []
        for signal, noise in run_all(lambda part: _quantized_energies(references[part], values[part], q), parts):
            self.signal += signal
            self.noise += noise
            self.measured = True

    @property
    def db(self) -> float:
        if not self.measured:
            return math.nan
        if self.noise == 0.0:
            return math.inf
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)


def _layer_sqnr(references: np.ndarray, model_value, values: np.ndarray | None, q: TensorQ | None) -> float:
    """A layer's SQNR against the float model's ``references``: its int8 ``values`` with qparams ``q`` when
    ``model_value`` is None, else the host's float outputs ``model_value(n)``."""
    energy = _Energy()
    if model_value is None:
        energy.add_quantized(references, values, q)
    else:
        energy.add_samples(references, model_value)
    return energy.db


def _energies(reference: np.ndarray, value: np.ndarray) -> tuple[float, float]:
    difference = buffers.empty(reference.size, np.float64)  # float64 copies of a sample: reused, not new pages
    np.copyto(difference, reference.reshape(-1))
    signal = float(np.dot(difference, difference))
    np.subtract(difference, value.reshape(-1), out=difference)
    return signal, float(np.dot(difference, difference))


def _quantized_energies(reference: np.ndarray, values: np.ndarray, q: TensorQ) -> tuple[float, float]:
    """:func:`_energies` of a sample against int8 ``values`` with qparams ``q``, dequantized as the host's
    dequantize does (float32 ``(x - zp) * scale``), in one compiled pass (:func:`.kernels.energies`: its float64
    sums in another order than :func:`_energies`' dot products, so equal to them up to the last bits)."""
    return kernels.energies(np.ascontiguousarray(reference, np.float32), np.ascontiguousarray(values), q.scale,
                            q.zero_point)


class Context:
    """The float graph, cut and compiled once, and what every walk over it needs."""

    def __init__(self, func: relax.Function, layers: list[Layer], folded: dict, config: QConfig, npu: NpuConfig,
                 source: str, tir: dict | None = None):
        self.func, self.layers, self.folded, self.config, self.npu, self.source = func, layers, folded, config, npu, source
        self.tir = dict(tir or {})
        """The TIR functions the model's ``call_tir`` bindings call (an importer's ``emit_te``: ONNX's Pad), by
        global var: every module holding such a layer (the float layers, the quantized model) takes them along."""
        self._float = None
        self.producer = {layer.output: layer for layer in layers}
        self.consumers: dict = {}
        for layer in layers:
            for v in layer.inputs:
                self.consumers.setdefault(v, []).append(layer)
        self.outputs = [resolve(v, folded) for v in function_outputs(func)]
        self.last_use = {}
        for layer in layers:
            for v in layer.inputs:
                self.last_use[v] = layer.index
        self.npu_cache: dict = {}
        self.predicting = True
        """MAC and elementwise layers' records are predicted and their builds checked beside the walk
        (:mod:`.predicted`); off once a prediction was refuted."""
        self._kept = None

    @property
    def kept(self) -> frozenset:
        """The vars kept channels last (:mod:`.storage`; none when least-squares rounding reads a layer's inputs
        and accumulators in its model's layout)."""
        if self._kept is None:
            self._kept = frozenset() if self.config.weight_rounding == "least_squares" else \
                storage.channels_last_vars(self.layers, self.float.plans, self.float.elementwise, self.outputs)
        return self._kept

    def run_float(self, layer: Layer, inputs: list[np.ndarray], weight=None, bias=None, constants=(),
                  totals_only: bool = False):
        """:meth:`.steps.FloatLayers.run_batch` on inputs as the walk keeps them, its results kept so too: an NCHW
        convolution computed channels last when its input or output is kept so (its plan reads and writes
        either), any other layer on its model's layout."""
        kept = self.kept
        plan = self.float.plans[layer.index]
        out_last = layer.output in kept
        in_last = [v in kept for v in layer.inputs]
        if plan is not None and plan.conv is not None and plan.channels_first and (in_last[0] or out_last):
            x = inputs[0] if in_last[0] else storage.to_stored(inputs[0])
            acc, out = dataclasses.replace(plan, channels_first=False).finished(layer, x, weight, bias, totals_only)
            if not out_last:
                out = storage.to_model(out)
                acc = acc if totals_only else storage.to_model(acc)
            return acc, out
        if not (all(in_last) and out_last):  # else an elementwise layer of kept tensors: the order is free
            inputs = [storage.to_model(x) if last else x for x, last in zip(inputs, in_last)]
        return self.float.run_batch(layer, inputs, weight, bias, constants, totals_only)

    @property
    def float(self) -> FloatLayers:
        """The layers compiled as float functions (on first use: loading a stored model does not need them)."""
        if self._float is None:
            self._float = FloatLayers(self.layers, self.folded, self.tir)
        return self._float

    def quantized(self, layer: Layer, plan: Plan) -> bool:
        return layer.kind.output != Output.FLOAT and layer.index not in plan.float_layers

    def has_q_point(self, var, plan: Plan) -> bool:
        producer = self.producer.get(var)
        if producer is not None and self.quantized(producer, plan):
            return True
        return any(self.quantized(c, plan) for c in self.consumers.get(var, []))


def _request(config: QConfig) -> RangeRequest:
    return RangeRequest(bits=8, symmetric=config.symmetric_activations, percentile=float(config.percentile))


def _method_name(config: QConfig) -> str:
    method = config.calibration
    return method if isinstance(method, str) else getattr(method, "__name__", "callable")


def _given(ctx: Context, layer: Layer | None, plan: Plan) -> TensorQ | None:
    """A layer's output qparams that no observation chooses: its input's (a layer that moves int8 values), or
    those TFLite's kernels fix."""
    if layer is not None and layer.kind.output == Output.INPUT and layer.inputs[0] in plan.tensors:
        return plan.tensors[layer.inputs[0]]
    if layer is not None and layer.kind.output == Output.FIXED and ctx.source == "tflite":
        scale, zp = FIXED_OUTPUTS[layer.kind.fixed_op]
        return TensorQ(float(np.float32(scale)), int(zp))
    return None


def _widened(ctx: Context, layer: Layer | None) -> bool:
    """A model output's range gets headroom, cross-validated on its samples (headroom.py)."""
    config = ctx.config
    return (layer is not None and config.output_headroom != 0 and config.global_scale is None
            and layer.output in ctx.outputs)


def _extremes_suffice(ctx: Context, layer: Layer, plan: Plan) -> bool:
    """The output range follows from the output's extremes alone: minmax, or a global scale (which needs none)."""
    config = ctx.config
    return ((config.global_scale is not None or config.calibration == "minmax") and _given(ctx, layer, plan) is None
            and not _widened(ctx, layer))


def _global_range(config: QConfig) -> tuple[float, float, str, bool] | None:
    """relay.quantize's global scale: one symmetric range for every activation (range, method, symmetric)."""
    if config.global_scale is None:
        return None
    return -float(config.global_scale), float(config.global_scale), "global_scale", True


def _choose_from_extremes(ctx: Context, low: float, high: float, name: str, records: list) -> TensorQ:
    """:func:`_choose` from the output's extremes, for :func:`_extremes_suffice`. The record's summary is left
    empty: it is filled from the NPU's int8 output (:func:`.observers.int8_summary`) once the layer has run."""
    config = ctx.config
    lo, hi, method, symmetric = _global_range(config) or (*extremes_range(low, high, _request(config)),
                                                           _method_name(config), config.symmetric_activations)
    scale, zp = activation_qparams(lo, hi, bits=8, symmetric=symmetric, power_of_two=config.power_of_two)
    records.append(TensorRecord(name, method, {"min": low, "max": high}, float(scale), int(zp)))
    return TensorQ(float(scale), int(zp))


def _output_extremes(chunks) -> tuple[float, float] | None:
    """(min, max) of an observed layer's outputs, for :func:`_extremes_suffice`: from the integer sums' channel
    extremes, or one pass over the outputs; None where a value is NaN or infinite (:func:`_choose` says so)."""
    if isinstance(chunks, IntegerObservation):
        return chunks.output_extremes()
    return _finite_extremes(chunks.outputs())


def batch_of(samples: list[np.ndarray]) -> np.ndarray:
    """``np.stack(samples)``, read-only; a view, not a copy, where the samples lie one after the other in one
    array's memory (calibration data given as a batch: 60 MB for MobileNetV2-224's 100 inputs, which the stack
    had written to fresh memory on the walk's one thread, to be read once)."""
    first = samples[0]
    address = first.__array_interface__["data"][0]
    if first.base is not None and all(
            s.base is first.base and s.flags.c_contiguous and s.shape == first.shape and s.dtype == first.dtype
            and s.__array_interface__["data"][0] == address + n * first.nbytes for n, s in enumerate(samples)):
        # every byte of the view is one of a sample's own, in the same owner's memory
        return np.lib.stride_tricks.as_strided(first, (len(samples), *first.shape),
                                               (first.nbytes, *first.strides), writeable=False)
    stacked = np.stack(samples)
    stacked.flags.writeable = False
    return stacked


def _finite_extremes(values) -> tuple[float, float] | None:
    """(min, max) of an array ``[N, ...]`` or of :class:`.observers.Batches`, None if any is not finite."""
    parts = values.batches() if isinstance(values, Batches) else [values]
    low, high = math.inf, -math.inf
    for part in parts:
        if np.asarray(part).size:
            part_low, part_high = float(np.min(part)), float(np.max(part))
            if not (math.isfinite(part_low) and math.isfinite(part_high)):  # NaN is in neither min nor max
                return None
            low, high = min(low, part_low), max(high, part_high)
    return (low, high) if math.isfinite(low) and math.isfinite(high) else None


def _choose(ctx: Context, layer: Layer | None, values: list[np.ndarray], plan: Plan, name: str,
            records: list) -> TensorQ:
    config = ctx.config
    given = _given(ctx, layer, plan)
    if given is not None:
        return given
    widen = _widened(ctx, layer)
    if widen:  # a model output: its samples are kept to cross-validate its headroom (headroom.py)
        values = np.stack([np.array(v) for v in values])  # copies: batches may reuse their buffers
    stats = TensorStats(bins=config.bins)
    stats.update_samples(values)
    lo, hi, method, symmetric = _global_range(config) or (*choose_range(stats, config.calibration, _request(config)),
                                                           _method_name(config), config.symmetric_activations)
    if widen:
        lo, hi, factor = headroom.widened_range(values, lo, hi, config.output_headroom,
                                                lambda subset: _method_range(config, subset),
                                                lambda a, b: TensorQ(*activation_qparams(
                                                    a, b, bits=8, symmetric=symmetric,
                                                    power_of_two=config.power_of_two)))
        method = f"{method}, headroom x{factor:.2f}"
    scale, zp = activation_qparams(lo, hi, bits=8, symmetric=symmetric, power_of_two=config.power_of_two)
    records.append(TensorRecord(name, method, stats.summary(), float(scale), int(zp)))
    return TensorQ(float(scale), int(zp))


def _method_range(config: QConfig, samples: np.ndarray) -> tuple[float, float]:
    """The calibration method's range on some of a tensor's samples: minmax's from their extremes alone, as
    :func:`_choose_from_extremes` takes it (the same range the observer gives finite values, without its
    histogram: cross-validating a model output's headroom asks for it ten times)."""
    if config.calibration == "minmax":
        extremes = _finite_extremes(samples)
        if extremes is not None:
            return extremes_range(*extremes, _request(config))
    stats = TensorStats(bins=config.bins)
    stats.update_samples(samples)
    return choose_range(stats, config.calibration, _request(config))


def _along(scales: np.ndarray, ndim: int, axis: int | None) -> np.ndarray:
    """Per-channel scales shaped to broadcast along ``axis`` of an ``ndim`` tensor (one scale: a scalar)."""
    shape = [1] * ndim
    if axis is not None and scales.size > 1:
        shape[axis] = scales.size
    return scales.reshape(shape)


def _int32(values: np.ndarray) -> np.ndarray:
    return np.clip(np.rint(values), -2 ** 31, 2 ** 31 - 1).astype(np.int32)


def _quantize_with(w: np.ndarray, scales: np.ndarray, axis: int | None, bits: int) -> np.ndarray:
    qmax = 2 ** (bits - 1) - 1
    return np.clip(np.rint(w / _along(scales, w.ndim, axis)), -qmax, qmax).astype(np.int8)


def _weights(layer: Layer, config: QConfig, input_q: TensorQ, scales: np.ndarray | None = None) -> WeightQ:
    axis = layer.weight_axis if config.per_channel else None
    if scales is None:
        _, scales = quantize_weights(layer.weight, axis=axis, bits=config.weight_bits)
        scales = np.asarray(scales, np.float32).reshape(-1)
        if config.power_of_two:
            scales = (2.0 ** np.ceil(np.log2(scales))).astype(np.float32)
    q = _quantize_with(layer.weight, scales, axis, config.weight_bits)
    bias = bias_scales = None
    if layer.bias is not None:
        bias_scales = (np.float32(input_q.scale) * scales).astype(np.float32)
        channels = layer.weight.shape[layer.weight_axis]
        bias = _int32(layer.bias / np.broadcast_to(bias_scales, (channels,)))
    return WeightQ(q, scales, layer.weight_axis, bias, bias_scales)


def _dequantized(wq: WeightQ) -> tuple[np.ndarray, np.ndarray | None]:
    weight = wq.weight.astype(np.float32) * _along(wq.scales, wq.weight.ndim, wq.axis)
    bias = None if wq.bias is None else (wq.bias.astype(np.float32) * wq.bias_scales).astype(np.float32)
    return weight, bias


def _accumulator_peaks(layer: Layer, chunks, input_q: TensorQ, wq: WeightQ) -> np.ndarray:
    """Per output channel, the largest |accumulator| the NPU's integer sum reaches (rounded from float)."""
    channels = layer.weight.shape[layer.weight_axis]
    per = np.broadcast_to((np.float32(input_q.scale) * wq.scales).astype(np.float64), (channels,))
    # |rint(v / per)| is largest at the smallest or the largest v (division by per > 0 and rint are monotone).
    low, high = chunks.accumulator_extremes()
    return np.maximum(np.abs(np.rint(low / per)), np.abs(np.rint(high / per)))


def _constants(layer: Layer) -> dict:
    """Each float constant operand quantized on its own range, at the rank of the layer's output: a scalar or
    short constant broadcasts the same with leading ones, and the partitioner's fusion took the quantized graph's
    0-d and 1-d constant operands for variables it had not seen (a TVM ``InternalError`` on ``x * 0.5``)."""
    rank = len(layer.output.ty.shape.values)
    out = {}
    for constant, data in layer.constants.items():
        data = data.reshape((1,) * (rank - data.ndim) + data.shape) if data.ndim < rank else data
        scale, zp = activation_qparams(min(float(data.min()), 0.0), max(float(data.max()), 0.0), bits=8)
        q = TensorQ(float(scale), int(zp))
        out[constant] = (quantize_host(data, q), q)
    return out


def walk(ctx: Context, plan: Plan, samples: list[tuple], calibrating: bool, progress=None, reference: bool = False):
    """Run every layer over every sample, choosing qparams on the way when ``calibrating``. The float model runs
    beside it when ``reference`` or, calibrating, the config's ``float_reference`` asks for it; without it, only
    the quantized model's outputs are computed, and no SQNR is measured (the layers' are NaN).

    Returns (the quantized model's outputs per sample, the float model's outputs per sample (empty lists without
    the reference), per-layer statistics by index, tensor records).
    """
    before = {f.name: copy.copy(getattr(plan, f.name)) for f in dataclasses.fields(plan)}  # each walk adds entries
    try:
        return _walk_once(ctx, plan, samples, calibrating, progress, reference)
    except Mispredicted as error:
        warnings.warn(NpuWarning(f"calibration: {error}; calibrating again with every layer built (slower; "
                                 "please report the model)"), stacklevel=2)
        ctx.predicting = False
        for index, npu in list(ctx.npu_cache.items()):  # even verified ones: every layer built, as the warning says
            if isinstance(npu, PredictedLayer):
                del ctx.npu_cache[index]
        for name, value in before.items():
            setattr(plan, name, value)
        return _walk_once(ctx, plan, samples, calibrating, progress, reference)


def _walk_once(ctx: Context, plan: Plan, samples: list[tuple], calibrating: bool, progress, reference: bool):
    """:func:`walk`, its MAC and elementwise layers' records predicted (:mod:`.predicted`) while
    ``ctx.predicting``."""
    later = Deferred()  # each layer's SQNR and output summary, read when the walk ends
    builder = Builder(functools.partial(built_records, source=ctx.source, config=ctx.npu)) if ctx.predicting \
        else None
    try:
        return _walk(ctx, plan, samples, calibrating, progress, reference, later, builder)
    finally:
        later.close(cancel=True)  # _walk waited for its work; after an error, what has not started is dropped
        if builder is not None:
            builder.close()
            for index, npu in list(ctx.npu_cache.items()):  # unchecked or refuted predictions are not kept
                if isinstance(npu, PredictedLayer) and not npu.verified:
                    del ctx.npu_cache[index]


def _walk(ctx: Context, plan: Plan, samples: list[tuple], calibrating: bool, progress, reference: bool,
          later: Deferred, builder: Builder | None):
    reference = reference or (calibrating and ctx.config.float_reference)
    # the float model's samples: while calibrating, the first QConfig.reference_samples (on every sample its pass was
    # as much work as the quantized model's, and most of the memory); else, asked for, all of them
    compared = ctx.config.compared_samples(len(samples)) if calibrating else len(samples)
    fvals: dict = {}
    qvals: dict = {}
    hvals: dict = {}
    records: list = []
    layer_stats: dict = {}
    # Every tensor's values over the calibration set are one array [samples, *shape]: each layer runs once
    # for all samples (iterating such an array gives the samples in order, as the per-sample steps need).
    for k, param in enumerate(ctx.func.params):
        fvals[param] = batch_of([s[k] for s in samples])
        if ctx.has_q_point(param, plan):
            extremes = None
            if calibrating and _extremes_suffice(ctx, None, plan):
                extremes = _finite_extremes(fvals[param])
            if extremes is not None:  # summarized from its int8 values, as a layer's output is
                plan.tensors[param] = _choose_from_extremes(ctx, *extremes, param.name, records)
            elif calibrating:
                plan.tensors[param] = _choose(ctx, None, fvals[param], plan, param.name, records)
            q = plan.tensors[param]
            qvals[param] = quantize_host(fvals[param], q)
            if extremes is not None:
                records[-1].stats = later.submit(int8_summary, qvals[param][:compared], q.scale, q.zero_point,
                                                 *extremes)
        else:
            hvals[param] = fvals[param]

    dqvals: dict = {}  # each quantized tensor dequantized once, for its SQNR and all its consumers
    centred_vals: dict = {}  # and centred once (x - zp), for the integer sums of its weighted consumers

    def value(var) -> np.ndarray:
        if var in qvals:
            if var not in dqvals:
                dqvals[var] = dequantize_host(qvals[var], plan.tensors[var])
            return dqvals[var]
        return hvals[var]

    params = set(ctx.func.params)

    def host_value(var) -> np.ndarray:
        """What a layer kept in float reads, as the quantized module computes it (:func:`.qdq.emit_module`): a
        model input or a float layer's output as it is, any other tensor dequantized from its int8 values (a
        model input that quantized layers also read was dequantized here, while the module reads it raw)."""
        if var in hvals:
            return hvals[var]
        if var in params:
            return fvals[var]
        return value(var)

    def centred(var, channels_first: bool) -> Centred:
        values = centred_vals.setdefault(var, {})
        if channels_first not in values:
            values[channels_first] = centre_host(qvals[var], plan.tensors[var].zero_point, channels_first)
        return values[channels_first]

    # The float model's layers run ahead on a thread of their own: they depend on no quantization decision.
    summarize = functools.partial(_float_accumulators, ctx.config)
    # least-squares rounding fits to the accumulators themselves; otherwise their totals are all that is read
    run = functools.partial(ctx.run_float, totals_only=ctx.config.weight_rounding != "least_squares")
    pending = (ReferencePass(ctx.float, ctx.layers, {v: x[:compared] for v, x in fvals.items()}, ctx.last_use,
                             ctx.outputs, summarize, run) if reference else None)
    for layer in ctx.layers:
        stats = LayerStats()
        weight = layer.weight
        consts = [d for d in layer.constants.values()]
        references = float_accumulators = None
        if reference:
            float_accumulators, references = pending.take(layer)
        fvals[layer.output] = references
        if ctx.quantized(layer, plan):
            _run_quantized(ctx, layer, plan, stats, qvals, value, centred, calibrating, records, float_accumulators,
                           references, later, builder, compared)
            model_value = None
        else:
            inputs = [host_value(v) for v in layer.inputs]
            out = ctx.run_float(layer, inputs, weight, layer.bias, consts, totals_only=True)[1]
            hvals[layer.output] = out
            if ctx.has_q_point(layer.output, plan):
                if calibrating:
                    plan.tensors[layer.output] = _choose(ctx, None, out, plan, layer.output.name, records)
                qvals[layer.output] = quantize_host(out, plan.tensors[layer.output])
            model_value = out.__getitem__
        # the int8 output (dequantized as the host does) or the host's float output against the reference
        stats.sqnr_db = _Energy().db if references is None else later.submit(
            _layer_sqnr, references, model_value, qvals.get(layer.output), plan.tensors.get(layer.output))
        layer_stats[layer.index] = stats
        for v in list(layer.inputs):
            if ctx.last_use.get(v) == layer.index and v not in ctx.outputs:
                for table in (fvals, qvals, hvals, dqvals, centred_vals):
                    table.pop(v, None)
        if progress is not None:
            progress(layer.index + 1, len(ctx.layers))
    if builder is not None:
        builder.finish()  # every predicted record checked against its build (raises Mispredicted)
    later.close()
    for stats in layer_stats.values():
        if isinstance(stats.sqnr_db, Future):
            stats.sqnr_db = stats.sqnr_db.result()
    for record in records:
        if isinstance(record.stats, Future):
            record.stats = record.stats.result()
    outputs, floats = [], []
    for n in range(len(samples)):
        outs, refs = [], []
        for var in ctx.outputs:
            producer = ctx.producer.get(var)
            if var in qvals and (producer is None or ctx.quantized(producer, plan)):
                outs.append(dequantize_host(qvals[var][n], plan.tensors[var]))
            else:
                outs.append(hvals[var][n])
            if reference and n < compared:
                refs.append(fvals[var][n])
        outputs.append(outs)
        floats.append(refs)
    return outputs, floats, layer_stats, records


@dataclass(frozen=True)
class FloatAccumulators:
    """What calibration reads of a weighted layer's accumulators in the float model, taken on the reference
    thread (:class:`.steps.ReferencePass`): their per-channel float64 sums over the calibration set (for bias
    correction), and the accumulators themselves only where least-squares rounding fits to them. Otherwise the
    batch-sized array is released there, and its sum is off the walk's path."""

    values: np.ndarray | None
    totals: np.ndarray | None
    count: int
    """Accumulators per channel."""


def _float_accumulators(config: QConfig, layer: Layer, accumulators: np.ndarray | ChannelTotals) -> FloatAccumulators:
    """What the walk reads of a weighted layer's accumulators in the float model. The array itself comes only from
    a layer TVM computes or with least-squares rounding, and is in the model's layout then (storage.py keeps
    nothing channels last with least squares, nor a TVM layer's output)."""
    if isinstance(accumulators, ChannelTotals):  # taken chunk by chunk as the float model's pass formed them
        totals = accumulators.totals if config.bias_correction and layer.bias is not None else None
        return FloatAccumulators(None, totals, accumulators.count)
    channels = layer.weight.shape[layer.weight_axis]
    totals = None
    if config.bias_correction and layer.bias is not None:
        totals = np.sum(accumulators, axis=layer.batch_reduction(accumulators.ndim), dtype=np.float64)
    kept = accumulators if config.weight_rounding == "least_squares" else None
    return FloatAccumulators(kept, totals, accumulators.size // channels)


def _bias_shift(float_accumulators: FloatAccumulators, chunks, samples: int) -> np.ndarray:
    """Per output channel, the mean of (float model's accumulator - quantized model's) over the first ``samples``
    calibration samples (those the float model ran on): the systematic error of the weights' rounding and of
    everything upstream, which a bias can take back."""
    total = float_accumulators.totals.copy()
    for part in chunks.accumulator_sums(samples):  # chunk by chunk, in order
        total -= part
    return total / float_accumulators.count


def _run_quantized(ctx: Context, layer: Layer, plan: Plan, stats: LayerStats, qvals: dict, value, centred,
                   calibrating: bool, records: list, float_accumulators: FloatAccumulators | None,
                   references: np.ndarray | None, later: Deferred, builder: Builder | None, summarized: int) -> None:
    sums = summarize = None
    if builder is not None and ctx.float.plans[layer.index] is not None:
        builder.flush(least=Builder.BATCH // 2)  # built while the walk's GEMMs run, without the GIL
    if calibrating:
        sums, summarize = _calibrate_layer(ctx, layer, plan, stats, value, centred, records, float_accumulators,
                                           references)
    inputs_q = [plan.tensors[v] for v in layer.inputs]
    constants = plan.constants.get(layer.index, {})
    wq = plan.weights.get(layer.index)
    npu = ctx.npu_cache.get(layer.index)
    if npu is None or npu.key != _key(layer, plan) or npu.weights is not wq:
        output_q = plan.tensors[layer.output]
        spec = LayerSpec(layer, ctx.folded, inputs_q, output_q, wq, constants)
        build = functools.partial(NpuLayer, spec, ctx.source, ctx.npu)
        npu = None
        mac = predict(layer, ctx.float.plans[layer.index], inputs_q[0], output_q, wq, ctx.source, ctx.npu) \
            if builder is not None else None
        if mac is not None:  # its outputs from its sums through the predicted record; the build checks it beside
            if not (isinstance(sums, IntegerSums) and sums.weight is wq.weight):
                sums = _integer_sums(ctx, layer, wq, centred)
            if sums is not None and sums.exact_with(wq.bias):
                npu = builder.submit(layer.name, mac, wq, spec, build)
        elif builder is not None:
            # an add's, subtract's or multiply's outputs from its predicted command's table of input pairs
            record = predict_elementwise(layer, inputs_q, output_q, ctx.source, ctx.npu)
            if record is not None:
                npu = builder.submit(layer.name, record, None, spec, build)
        if npu is None:
            with TVM_LOCK:
                npu = build()
        npu.key = _key(layer, plan)
        ctx.npu_cache[layer.index] = npu
    stats.on_npu = npu.on_npu
    result = None
    if npu.mac is not None:  # one MAC layer: its outputs from the sums calibration formed (or forms now)
        if not (isinstance(sums, IntegerSums) and sums.weight is wq.weight):
            sums = _integer_sums(ctx, layer, wq, centred)
        if sums is not None:
            result = sums.npu_outputs(npu.mac)
    if result is None:
        result = _run_npu_layer(ctx, layer, npu, [qvals[v] for v in layer.inputs])
    out, overflows = result
    if summarize is not None:
        q = plan.tensors[layer.output]
        # descriptive only (the range came from every sample's extremes): on the first samples, as the SQNRs are
        summarize.stats = later.submit(int8_summary, out[:summarized], q.scale, q.zero_point, summarize.stats["min"],
                                       summarize.stats["max"])
    stats.overflows += overflows
    qvals[layer.output] = out


def _run_npu_layer(ctx: Context, layer: Layer, npu: NpuLayer, inputs: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """``npu.run_batch`` on the walk's int8 values (its stream or TVM's module take the model's layout): an
    elementwise layer of kept tensors reads their bytes as they are (the order of the elements is free), any
    other layer gets and gives the model's layout."""
    kept = ctx.kept
    in_last = [v in kept for v in layer.inputs]
    if all(in_last) and layer.output in kept and ctx.float.plans[layer.index] is None:
        out, overflows = npu.run_batch([storage.reinterpreted(x, v) for x, v in zip(inputs, layer.inputs)])
        return out.reshape(len(out), *np.moveaxis(out[0], 1, -1).shape), overflows
    out, overflows = npu.run_batch([storage.to_model(x) if last else x for x, last in zip(inputs, in_last)])
    return (storage.to_stored(out) if layer.output in kept else out), overflows


def _integer_sums(ctx: Context, layer: Layer, wq: WeightQ | None, centred, totalled: int = 0) -> IntegerSums | None:
    """The layer's exact integer sums on its int8 input (:mod:`.integer_sums`), with the totals per channel of its
    first ``totalled`` samples (bias correction's; 0: none); None for a layer TVM computes, or one whose sums could
    leave float32's exact range."""
    plan = ctx.float.plans[layer.index]
    if plan is None or wq is None:
        return None
    x = centred(layer.inputs[0], plan.channels_first and layer.inputs[0] not in ctx.kept)
    # bounded by the int8 range first: the input is scanned for its own largest only where that bound is too wide
    # (here with no bias; with a bias, IntegerSums.exact_with tightens it when asked)
    magnitude = weight_magnitude(wq.weight, layer.weight_axis)  # exact_bound's, once
    if x.most * magnitude >= FLOAT32_EXACT and x.largest * magnitude >= FLOAT32_EXACT:
        return None
    return IntegerSums(layer, plan, x.values, wq.weight, x.zero_point, x.most,
                       model_layout=plan.channels_first and layer.output not in ctx.kept,
                       totals=totalled > 0, total_samples=totalled, exact_largest=lambda: x.largest,
                       magnitude=magnitude)


def _calibrate_layer(ctx: Context, layer: Layer, plan: Plan, stats: LayerStats, value, centred, records: list,
                     float_accumulators: FloatAccumulators | None, references: np.ndarray | None
                     ) -> tuple[IntegerSums | None, TensorRecord | None]:
    """Quantize the layer's weights and constants, observe it on its quantized inputs, correct its bias, fit its
    accumulator and choose its output qparams (from the float model's ``references`` for the
    :data:`FLOAT_MODEL_METHODS`): every decision about it, into ``plan``. Returns the integer sums of its final
    weights, when it was observed from them (the NPU's outputs are read from them too), and the record whose
    summary its int8 output is to fill (when its range came from its extremes alone)."""
    config = ctx.config
    input_q = plan.tensors[layer.inputs[0]]
    constants = plan.constants[layer.index] = _constants(layer)
    wq = _weights(layer, config, input_q) if layer.weight is not None else None
    dq_inputs = functools.cache(lambda: [value(v) for v in layer.inputs])  # the integer sums do not need them
    model_inputs = functools.cache(lambda: [storage.to_model(x) if v in ctx.kept else x
                                            for x, v in zip(dq_inputs(), layer.inputs)])
    dq_consts = [dequantize_host(constants[c][0], constants[c][1]).reshape(data.shape)  # the float function's own
                 for c, data in layer.constants.items()]
    problem = None  # least-squares weight rounding (reconstruct.py), applied to every choice of weight scales
    if wq is not None and config.weight_rounding == "least_squares" and ctx.float.plans[layer.index] is not None:
        problem = reconstruct.build(ctx.float.plans[layer.index], dq_inputs()[0], float_accumulators.values,
                                    layer.weight, layer.bias, config.bias_correction and layer.bias is not None)
        wq = reconstruct.apply(problem, wq, config.weight_bits)

    memo: dict = {}
    # the samples bias correction compares, those the float model ran on (QConfig.reference_samples)
    totalled = len(references) if config.bias_correction and layer.bias is not None and references is not None else 0

    def observe():
        """The layer over the calibration set: its accumulators and outputs. A numpy layer's sums are computed
        once per weight (a new bias alone reuses them) and finished chunk by chunk whenever they are read: its
        exact integer sums (:class:`.integer_sums.IntegerObservation`), or where those could round, the float32
        sums of its dequantized inputs and weights (:class:`.batched_float.Observation`); a TVM layer is run
        once."""
        w, b = _dequantized(wq) if wq is not None else (None, None)
        if wq is not None and ctx.float.plans[layer.index] is not None:
            if memo.get("weight") is not wq.weight or memo.get("scales") is not wq.scales:
                sums = _integer_sums(ctx, layer, wq, centred, totalled)
                memo.update(weight=wq.weight, scales=wq.scales,
                            sums=sums if sums is not None else ctx.float.sums(layer, model_inputs(), w))
            if isinstance(memo["sums"], IntegerSums):
                steps = (np.float32(input_q.scale) * wq.scales).astype(np.float32)
                return memo["sums"].observed(wq.bias, steps)
            return memo["sums"].observed(layer, b)
        return HostObservation(layer, *ctx.run_float(layer, dq_inputs(), w, b, dq_consts))

    chunks = observe()
    if wq is not None:
        if config.bias_correction and layer.bias is not None:
            shift = _bias_shift(float_accumulators, chunks, totalled)
            corrected = _int32(wq.bias + shift / np.broadcast_to(wq.bias_scales, shift.shape).astype(np.float64))
            wq = WeightQ(wq.weight, wq.scales, wq.axis, corrected, wq.bias_scales)
            chunks = observe()
        peaks = _accumulator_peaks(layer, chunks, input_q, wq)
        limit = 2 ** (config.accumulator_bits - 1) - 1
        if config.avoid_overflow and peaks.max() > limit:
            widened = np.zeros(peaks.shape, bool)
            for _ in range(8):  # each pass scales the overflowing channels' weights down by their excess
                over = peaks > limit
                if not over.any():
                    break
                widened |= over
                scales = np.broadcast_to(wq.scales, peaks.shape).astype(np.float64).copy()
                scales[over] *= peaks[over] / limit * 1.001
                scales = scales.astype(np.float32)
                if config.power_of_two:
                    scales = (2.0 ** np.ceil(np.log2(scales))).astype(np.float32)
                wq = _weights(layer, config, input_q, scales)
                if problem is not None:
                    wq = reconstruct.apply(problem, wq, config.weight_bits)
                chunks = observe()
                peaks = _accumulator_peaks(layer, chunks, input_q, wq)
            stats.widened_channels = int(widened.sum())
            stats.overflow_unfixable = bool(peaks.max() > limit)
        stats.accumulator_peak = int(peaks.max())
        plan.weights[layer.index] = wq
    extremes = _output_extremes(chunks) if _extremes_suffice(ctx, layer, plan) else None
    if extremes is not None:
        plan.tensors[layer.output] = _choose_from_extremes(ctx, *extremes, layer.output.name, records)
        summarize = records[-1]
    else:
        outputs = references if config.calibration in FLOAT_MODEL_METHODS else chunks.outputs()
        plan.tensors[layer.output] = _choose(ctx, layer, outputs, plan, layer.output.name, records)
        summarize = None
    sums = memo.get("sums")
    return (sums if isinstance(sums, IntegerSums) and sums.weight is wq.weight else None), summarize


def _key(layer: Layer, plan: Plan) -> tuple:
    """The qparams an :class:`NpuLayer` was built for (its weights are compared by identity apart)."""
    return tuple(plan.tensors[v] for v in layer.inputs), plan.tensors[layer.output]


def sqnr_db(references: list, values: list) -> float:
    energy = _Energy()
    for refs, vals in zip(references, values):
        for r, v in zip(refs, vals):
            energy.add(r, v)
    return energy.db


def check_float_module(func: relax.Function) -> None:
    for param in func.params:
        dtype = str(getattr(param.ty, "dtype", ""))
        if dtype != "float32":
            raise NpuError(f"quantize needs a float model: input {param.name} is {dtype or 'not a tensor'} "
                           "(is the model already quantized?)")
        shape = getattr(param.ty, "shape", None)
        dims = getattr(shape, "values", None)
        if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
            raise NpuError(f"quantize needs static input shapes: input {param.name} is {shape} (export the model with "
                           "a fixed batch of 1, or bind its symbolic sizes: relax.transform.BindSymbolicVars)")
    for block in func.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(value, relax.Call) and getattr(value.op, "name", "") in ("relax.quantize",
                                                                                    "relax.dequantize"):
                raise NpuError("quantize needs a float model: this one already quantizes "
                               f"({binding.var.name} = {value.op.name})")
