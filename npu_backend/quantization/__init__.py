"""Post-training quantization of a float model into the canonical int8 form the NPU runs.

``quantize(mod, calibration_data, config)`` cuts the float graph into layers
(:mod:`.layers`), calibrates them in topological order on the NPU's own integers
(:mod:`.calibrate`), optionally keeps the layers that cost the most in float,
and returns the QDQ module (:mod:`.qdq`) with its report (:mod:`.report`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

import numpy as np
import tvm

from simulator.config import NpuConfig, resolve_config

from ..errors import NpuError
from . import buffers
from .batched_float import one_blas_thread
from .calibrate import Context, LayerStats, Plan, check_float_module, sqnr_db, walk
from .config import ROUNDINGS, QConfig
from .layers import Output, cut_layers, prepared, tir_functions
from .qdq import emit_module
from .report import REPORT_ATTR, LayerEntry, QuantizationReport, TensorEntry, quantization_report


def _shape(param) -> tuple[int, ...]:
    return tuple(int(d) for d in param.ty.shape.values)


def _split(array, shape: tuple[int, ...], name: str, copy: bool = True) -> list[np.ndarray]:
    """One input's values as samples of ``shape``: the array itself, or a batch of them on axis 0; copied unless
    ``copy`` is False (the caller's own array, given whole: a float32 batch is then read where it lies)."""
    array = np.asarray(array)
    if array.dtype.kind not in "fiu":
        raise NpuError(f"calibration input {name} is not numeric ({array.dtype})")
    array = array.astype(np.float32, copy=copy)
    if array.shape == shape:
        return [array]
    if shape and shape[0] == 1 and array.shape[1:] == shape[1:]:
        return [array[i:i + 1] for i in range(array.shape[0])]
    raise NpuError(f"calibration input {name} has shape {array.shape}; the model takes {shape} "
                   f"(or a batch of them on axis 0)")


def calibration_samples(calibration_data, params) -> list[tuple[np.ndarray, ...]]:
    """Calibration data as a list of per-sample input tuples.

    Accepts an array (batched on axis 0), a mapping ``{input_name: array}``, or an iterable of arrays
    or mappings. The iterable is read once; what is kept is the samples themselves, because each layer is
    calibrated on all of them before the next one runs.
    """
    names = [p.name for p in params]
    shapes = [_shape(p) for p in params]

    def one(item, copy: bool = True) -> list[tuple]:
        if isinstance(item, dict):
            missing = [n for n in names if n not in item]
            if missing:
                raise NpuError(f"calibration sample lacks input(s) {', '.join(missing)} (the model takes "
                               f"{', '.join(names)})")
            columns = [_split(item[n], s, n, copy) for n, s in zip(names, shapes)]
        else:
            if len(names) != 1:
                raise NpuError(f"the model takes {len(names)} inputs ({', '.join(names)}): give calibration "
                               "samples as dicts {input_name: array}")
            columns = [_split(item, shapes[0], names[0], copy)]
        if len({len(c) for c in columns}) != 1:
            raise NpuError("calibration inputs of one sample have different batch sizes")
        return list(zip(*columns))

    if isinstance(calibration_data, (np.ndarray, dict)):
        samples = one(calibration_data, copy=False)  # read in place: calibration never writes it
    elif isinstance(calibration_data, Iterable):
        samples = [s for item in calibration_data for s in one(item)]  # copied: a loader may refill one buffer
    else:
        raise NpuError(f"calibration data must be an array, a dict or an iterable of them, not "
                       f"{type(calibration_data).__name__}")
    if not samples:
        raise NpuError("calibration data is empty")
    for sample in samples:
        for x, name in zip(sample, names):
            if not np.all(np.isfinite(x)):
                raise NpuError(f"calibration input {name} holds NaN or infinite values")
    return samples


def _npu_config(config: QConfig) -> NpuConfig:
    base = resolve_config(config.preset)
    changes = {"accumulator_bits": config.accumulator_bits, "accumulator_overflow": config.accumulator_overflow}
    if all(getattr(base, k) == v for k, v in changes.items()):
        return base
    suffix = "" if config.accumulator_overflow == "wrap" else "s"
    return dataclasses.replace(base, name=f"{base.name}-acc{config.accumulator_bits}{suffix}", **changes)


def _initial_float_layers(layers, config: QConfig) -> tuple[set, dict]:
    quantizable = [layer for layer in layers if layer.kind.output != Output.FLOAT]
    names = {layer.name: layer for layer in quantizable}
    chosen, reasons = set(), {}
    for skip in config.skip_layers:
        if isinstance(skip, int):
            if skip >= len(quantizable):
                raise NpuError(f"QConfig.skip_layers: index {skip} is past the {len(quantizable)} quantizable layers")
            layer = quantizable[skip]
        elif skip in names:
            layer = names[skip]
        else:
            raise NpuError(f"QConfig.skip_layers: no layer named {skip!r} (layers: {', '.join(names)})")
        chosen.add(layer.index)
        reasons[layer.index] = "skipped by QConfig.skip_layers"
    kinds = {layer.kind.name for layer in quantizable}
    for op in config.float_ops:
        if op not in kinds:
            raise NpuError(f"QConfig.float_ops: the model has no {op!r} layer (kinds: {', '.join(sorted(kinds))})")
        for layer in quantizable:
            if layer.kind.name == op:
                chosen.add(layer.index)
                reasons[layer.index] = "kept float by QConfig.float_ops"
    return chosen, reasons


def _calibrate(ctx: Context, float_layers: set, reasons: dict, samples, progress=None):
    plan = Plan(float_layers=set(float_layers), reasons=dict(reasons))
    outputs, floats, stats, records = walk(ctx, plan, samples, calibrating=True, progress=progress)
    return plan, sqnr_db(floats, outputs), stats, records


def _fallback(ctx: Context, plan: Plan, samples, budget: float, base_db: float):
    """Keep in float, greedily, the layers whose quantization costs the output more than ``budget`` dB.

    A layer's cost is measured by calibrating the model again with that layer in float (its output range is then
    observed on float values, not on what its quantized version produced); the costliest go first, each kept
    only if it still gains more than the budget given those already in float.
    """
    costs = {}
    for layer in ctx.layers:
        if ctx.quantized(layer, plan):
            _, db, _, _ = _calibrate(ctx, plan.float_layers | {layer.index}, plan.reasons, samples)
            costs[layer.index] = db - base_db
    current = base_db
    for index in sorted((i for i, c in costs.items() if c > budget), key=lambda i: -costs[i]):
        _, db, _, _ = _calibrate(ctx, plan.float_layers | {index}, plan.reasons, samples)
        if db - current > budget:
            plan.float_layers.add(index)
            plan.reasons[index] = f"float fall-back: keeping it float gains {db - current:.1f} dB (budget {budget:g} dB)"
            current = db
    return _calibrate(ctx, plan.float_layers, plan.reasons, samples)


@dataclasses.dataclass
class Calibrated:
    """A calibrated model: the quantized module, its report, and its simulated quantization."""

    module: tvm.IRModule
    report: QuantizationReport
    _ctx: Context
    _plan: Plan

    @property
    def npu_config(self) -> NpuConfig:
        """The hardware calibration simulated (its accumulator width and overflow mode): partition for it."""
        return self._ctx.npu

    def simulate(self, inputs) -> list[list[np.ndarray]]:
        """The quantized model's outputs on ``inputs`` (any form ``calibration_data`` takes), computed layer by
        layer with the NPU's integer arithmetic: what the partitioned module returns, bit for bit."""
        samples = calibration_samples(inputs, self._ctx.func.params)
        with one_blas_thread(), buffers.reuse():
            outputs, _, _, _ = walk(self._ctx, self._plan, samples, calibrating=False)
        return outputs


def calibrate(mod: tvm.IRModule, calibration_data, config: QConfig | None = None, progress=None) -> Calibrated:
    """:func:`quantize`, keeping what is needed to simulate the quantized model afterwards."""
    config = config or QConfig()
    if not isinstance(config, QConfig):
        raise NpuError(f"config must be a QConfig, not {type(config).__name__}")
    if not isinstance(mod, tvm.IRModule) or "main" not in mod:
        raise NpuError("quantize needs an IRModule with a 'main' function")
    check_float_module(mod["main"])
    mod = prepared(mod)
    func = mod["main"]
    samples = calibration_samples(calibration_data, func.params)
    layers, folded = cut_layers(func)
    source = ROUNDINGS[config.rounding]
    ctx = Context(func, layers, folded, config, _npu_config(config), source, tir_functions(mod))
    float_layers, reasons = _initial_float_layers(layers, config)
    with one_blas_thread(), buffers.reuse():
        plan, output_db, stats, records = _calibrate(ctx, float_layers, reasons, samples, progress)
        if config.fallback_budget_db is not None:
            plan, output_db, stats, records = _fallback(ctx, plan, samples, float(config.fallback_budget_db),
                                                        output_db)
    report = _report(ctx, plan, stats, records, output_db, len(samples))
    qmod = emit_module(ctx, plan).with_attr(REPORT_ATTR, report.to_json())
    return Calibrated(qmod, report, ctx, plan)


def quantize(mod: tvm.IRModule, calibration_data, config: QConfig | None = None, progress=None) -> tvm.IRModule:
    """Quantize a float Relax module for the NPU from calibration data.

    Parameters
    ----------
    mod : tvm.IRModule
        A float model (``main`` takes and returns float32): from ``from_tflite``/``from_onnx`` on a float model,
        :func:`npu_backend.load_model`, or built by hand.
    calibration_data : array, dict or iterable
        Calibration inputs: an array (a batch on axis 0) for a single-input model, a dict
        ``{input_name: array}``, or an iterable of either.
    config : QConfig, optional
        Methods, bit widths, hardware constraints and fall-back (defaults: :class:`QConfig`).
    progress : callable, optional
        ``progress(done, total)`` after each layer is calibrated (e.g. to advance a progress bar).

    Returns
    -------
    tvm.IRModule
        The float model's signature around the canonical QDQ graph; ``partition_for_npu`` offloads it as is.
        Its report: :func:`npu_backend.quantization_report`. :func:`calibrate` also returns the simulation.
    """
    return calibrate(mod, calibration_data, config, progress).module


def _report(ctx: Context, plan: Plan, stats: dict, records: list, output_db: float, samples: int
            ) -> QuantizationReport:
    config = ctx.config
    tensors = tuple(TensorEntry(r.name, r.method, float(r.stats.get("min", math.nan)),
                                float(r.stats.get("max", math.nan)), r.scale, r.zero_point, r.stats)
                    for r in records)
    layers = []
    for layer in ctx.layers:
        s: LayerStats = stats[layer.index]
        quantized = ctx.quantized(layer, plan)
        q = plan.tensors.get(layer.output)
        if quantized:
            placement = "npu" if s.on_npu else "host int8"
        else:
            placement = "float"
        notes = []
        if layer.index in plan.reasons:
            notes.append(plan.reasons[layer.index])
        elif layer.kind.output == Output.FLOAT:
            notes.append("no NPU operator: float on the host")
        if s.widened_channels:
            notes.append(f"weight scales widened on {s.widened_channels} channel(s) to fit the accumulator")
        if s.overflow_unfixable:
            notes.append(f"accumulator still overflows {config.accumulator_bits} bits")
        layers.append(LayerEntry(layer.name, layer.kind.name, placement, q.scale if q else 0.0,
                                 q.zero_point if q else 0, s.sqnr_db, s.accumulator_peak, s.overflows,
                                 s.widened_channels, "; ".join(notes)))
    settings = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    settings["calibration"] = settings["calibration"] if isinstance(settings["calibration"], str) else "callable"
    settings["preset"] = ctx.npu.name
    settings["skip_layers"] = list(settings["skip_layers"])
    settings["float_ops"] = list(settings["float_ops"])
    return QuantizationReport(settings, tensors, tuple(layers), output_db, config.accumulator_bits,
                              config.accumulator_overflow, samples, config.compared_samples(samples))


__all__ = ["quantize", "calibrate", "Calibrated", "QConfig", "QuantizationReport", "quantization_report", "calibration_samples"]
